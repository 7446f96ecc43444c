//! torchvision's `references/classification/train.py` flags as written: `--recipe`, the path and
//! device flags it translates into ours, the ones it refuses with the reason, and their checks.

use std::ffi::OsString;
use std::path::PathBuf;

use clap::parser::ValueSource;
use clap::{ArgMatches, CommandFactory, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::cli::{InvalidArgs, TrainArgs};
use crate::lr_plan::{LrScheduler, torchvision_defaults};

/// `--recipe`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum Recipe {
    /// torchvision's ResNet-50 IMAGENET1K_V2 recipe (80.9% top-1), 8 processes of 128 images.
    #[value(name = "torchvision-resnet50-v2")]
    #[serde(rename = "torchvision-resnet50-v2")]
    TorchvisionResnet50V2,
}

/// torchvision's ResNet-50 IMAGENET1K_V2 recipe (its blog "How to train state-of-the-art models
/// using TorchVision's latest primitives", and `references/classification/README.md`), for
/// `torchrun --nproc_per_node=8`: flag id and value (`""` for a switch).
///
/// `opt`, `norm_weight_decay`, `mixup_alpha` and `cutmix_alpha` are set only by a build whose
/// command line has those flags; the config table says when one is missing.
pub const TORCHVISION_RESNET50_V2: &[(&str, &str)] = &[
    ("model", "resnet50"),
    ("batch_size", "128"),
    ("opt", "sgd"),
    ("lr", "0.5"),
    ("lr_scheduler", "cosineannealinglr"),
    ("lr_warmup_epochs", "5"),
    ("lr_warmup_method", "linear"),
    ("auto_augment", "ta_wide"),
    ("epochs", "600"),
    ("random_erase", "0.1"),
    ("wd", "0.00002"),
    ("norm_weight_decay", "0.0"),
    ("label_smoothing", "0.1"),
    ("mixup_alpha", "0.2"),
    ("cutmix_alpha", "1.0"),
    ("train_crop_size", "176"),
    ("model_ema", ""),
    ("val_resize_size", "232"),
    ("ra_sampler", ""),
    ("ra_reps", "4"),
];

impl Recipe {
    /// The flags the recipe sets.
    pub fn flags(self) -> &'static [(&'static str, &'static str)] {
        match self {
            Self::TorchvisionResnet50V2 => TORCHVISION_RESNET50_V2,
        }
    }

    /// The name `--recipe` takes.
    pub fn name(self) -> &'static str {
        match self {
            Self::TorchvisionResnet50V2 => "torchvision-resnet50-v2",
        }
    }
}

/// Whether this build's command line has the flag `id`.
pub fn has_flag(id: &str) -> bool {
    TrainArgs::command()
        .get_arguments()
        .any(|a| a.get_id().as_str() == id)
}

fn flag_arg(id: &str, value: &str) -> OsString {
    let flag = id.replace('_', "-");
    if value.is_empty() {
        format!("--{flag}").into()
    } else {
        format!("--{flag}={value}").into()
    }
}

/// Parses `argv` (the program name first) and expands `--recipe`: each of its flags that the
/// command line does not give is appended, so flags given win and clap checks the result as if
/// typed. Returns the expanded command line and its matches.
///
/// # Errors
/// clap's error for a bad command line (before or after the expansion).
pub fn parse_with_recipe<I, T>(argv: I) -> Result<(Vec<OsString>, ArgMatches), clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    let mut argv: Vec<OsString> = argv.into_iter().map(Into::into).collect();
    let matches = TrainArgs::command().try_get_matches_from(&argv)?;
    let Some(recipe) = matches.get_one::<Recipe>("recipe").copied() else {
        return Ok((argv, matches));
    };
    for (id, value) in recipe.flags() {
        if has_flag(id) && matches.value_source(id) != Some(ValueSource::CommandLine) {
            argv.push(flag_arg(id, value));
        }
    }
    let matches = TrainArgs::command().try_get_matches_from(&argv)?;
    Ok((argv, matches))
}

/// [`parse_with_recipe`], then `TrainArgs` with torchvision's path and device flags applied.
///
/// # Errors
/// clap's error for a bad command line.
pub fn try_parse<I, T>(argv: I) -> Result<TrainArgs, clap::Error>
where
    I: IntoIterator<Item = T>,
    T: Into<OsString>,
{
    use clap::FromArgMatches;
    let (_, matches) = parse_with_recipe(argv)?;
    let mut args = TrainArgs::from_arg_matches(&matches)?;
    args.apply_torchvision_paths();
    Ok(args)
}

impl TrainArgs {
    /// Whether a torchvision schedule flag is given: the run then uses torchvision's schedule.
    pub fn uses_torchvision_lr(&self) -> bool {
        self.lr.is_some()
            || self.lr_scheduler.is_some()
            || self.lr_step_size.is_some()
            || self.lr_gamma.is_some()
            || self.lr_min.is_some()
            || self.lr_warmup_epochs.is_some()
            || self.lr_warmup_method.is_some()
            || self.lr_warmup_decay.is_some()
    }

    /// `--data-path`, `--output-dir` and `--device cpu` in our terms (clap refuses them beside
    /// the flags they set).
    pub fn apply_torchvision_paths(&mut self) {
        if let Some(root) = &self.data_path {
            self.train_dir = root.join("train");
            self.val_dir = root.join("val");
        }
        if let Some(out) = &self.output_dir {
            self.log_dir = out.join("logs");
            self.checkpoint_format = out
                .join("checkpoint-{epoch}.ckpt")
                .to_string_lossy()
                .into_owned();
        }
        if self
            .device
            .as_deref()
            .is_some_and(|d| d.eq_ignore_ascii_case("cpu"))
        {
            self.no_cuda = true;
        }
    }

    /// Where the EMA is exported: the export path with `_ema` before the extension
    /// (`checkpoint-90_ema.safetensors`).
    pub fn ema_export_path(&self) -> PathBuf {
        let path = self.export_path();
        let stem = path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default();
        path.with_file_name(format!("{stem}_ema.safetensors"))
    }

    /// The checks of the torchvision flags (part of [`TrainArgs::validate`]).
    ///
    /// # Errors
    /// [`InvalidArgs`] naming the first bad flag.
    pub fn validate_torchvision(&self) -> Result<(), InvalidArgs> {
        let bad = |flag, reason: &str| {
            Err(InvalidArgs {
                flag,
                reason: reason.to_string(),
            })
        };
        if self.lr.is_some_and(|lr| !(lr.is_finite() && lr > 0.0)) {
            return bad("lr", "must be a positive number, e.g. 0.5");
        }
        if self.lr_step_size == Some(0) {
            return bad("lr-step-size", "must be at least 1");
        }
        if self.lr_gamma.is_some_and(|g| !(g.is_finite() && g > 0.0)) {
            return bad("lr-gamma", "must be a positive number, e.g. 0.1");
        }
        if self.lr_min.is_some_and(|m| !(m.is_finite() && m >= 0.0)) {
            return bad("lr-min", "must be zero or positive");
        }
        if self
            .lr_warmup_decay
            .is_some_and(|d| !(d.is_finite() && d > 0.0 && d <= 1.0))
        {
            return bad(
                "lr-warmup-decay",
                "must be in (0, 1] (the warmup's factor of the rate, e.g. 0.01)",
            );
        }
        let warmup = self
            .lr_warmup_epochs
            .unwrap_or(torchvision_defaults::WARMUP_EPOCHS);
        if self.lr_scheduler == Some(LrScheduler::Cosineannealinglr) && warmup >= self.epochs {
            return bad(
                "lr-warmup-epochs",
                "must be smaller than --epochs with --lr-scheduler cosineannealinglr (the cosine \
                 runs over epochs - warmup epochs)",
            );
        }
        if self.model_ema_steps == 0 {
            return bad("model-ema-steps", "must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.model_ema_decay) {
            return bad("model-ema-decay", "must be in [0, 1], e.g. 0.99998");
        }
        if self.print_freq == 0 {
            return bad("print-freq", "must be at least 1");
        }
        if self.start_epoch != 0 {
            return bad(
                "start-epoch",
                "is not supported: a run starts after the epochs of the checkpoint it resumes \
                 (--resume PATH, or the newest in --checkpoint-format); drop --start-epoch",
            );
        }
        if let Some(device) = &self.device
            && !matches!(device.to_ascii_lowercase().as_str(), "cpu" | "cuda")
        {
            return bad(
                "device",
                "must be cuda (one process per visible GPU) or cpu; to pick GPUs set \
                 CUDA_VISIBLE_DEVICES",
            );
        }
        if self.amp == crate::cli::Amp::Fp16 {
            return bad(
                "amp",
                "torchvision's --amp (fp16 autocast with a gradient scaler) is not implemented; \
                 --amp bf16 runs the convs in bf16 on CUDA (f32 weights, no scaler needed)",
            );
        }
        if self.sync_bn {
            return bad(
                "sync-bn",
                "SyncBatchNorm is not implemented: BatchNorm statistics are per process and \
                 averaged across processes once per epoch; drop --sync-bn",
            );
        }
        if self.cache_dataset {
            return bad(
                "cache-dataset",
                "there is no dataset cache: images are decoded as they are read; drop \
                 --cache-dataset",
            );
        }
        if self.world_size.is_some() {
            return bad(
                "world-size",
                "the launcher sets the world size (--nproc-per-node × --nnodes, or torchrun's \
                 WORLD_SIZE); drop --world-size",
            );
        }
        if self.dist_url.as_deref().is_some_and(|u| u != "env://") {
            return bad(
                "dist-url",
                "only env:// is accepted (torchrun's environment); use --master-addr and \
                 --master-port",
            );
        }
        if self
            .backend
            .as_deref()
            .is_some_and(|b| !b.eq_ignore_ascii_case("pil"))
        {
            return bad(
                "backend",
                "only pil is accepted: decoding and transforms here follow PIL's; drop --backend",
            );
        }
        Ok(())
    }
}

/// Config-table rows of this module's flags: the EMA and the recipe.
pub fn config_rows(args: &TrainArgs, world: usize) -> Vec<(&'static str, String)> {
    let mut rows = Vec::new();
    if args.model_ema {
        let per_process = args.batch_size * args.batches_per_allreduce;
        let decay = crate::ema::adjusted_decay(
            args.model_ema_decay,
            world,
            per_process,
            args.model_ema_steps,
            args.epochs,
        );
        rows.push((
            "ema",
            format!(
                "every {} steps, decay {decay} ({} adjusted by {world} x {per_process} x {} / {} \
                 epochs); copies during the warmup",
                args.model_ema_steps, args.model_ema_decay, args.model_ema_steps, args.epochs
            ),
        ));
    }
    if let Some(recipe) = args.recipe {
        rows.push(("recipe", describe_recipe(args, recipe)));
    }
    rows
}

/// `--flag value` for each recipe flag: `(given: x)` where the command line overrode it,
/// `(not in this build)` where the flag does not exist here.
pub fn describe_recipe(args: &TrainArgs, recipe: Recipe) -> String {
    let now = serde_json::to_value(args).unwrap_or_default();
    let parts: Vec<String> = recipe
        .flags()
        .iter()
        .map(|(id, value)| {
            let flag = format!("--{}", id.replace('_', "-"));
            let shown = if value.is_empty() {
                flag.clone()
            } else {
                format!("{flag} {value}")
            };
            if !has_flag(id) {
                return format!("{shown} (not in this build)");
            }
            let current = &now[*id];
            let same = match current {
                serde_json::Value::Bool(b) => *b == value.is_empty(),
                serde_json::Value::Number(n) => value.parse::<f64>().ok() == n.as_f64(),
                serde_json::Value::String(s) => s.eq_ignore_ascii_case(value),
                _ => false,
            };
            if same {
                shown
            } else {
                format!("{shown} (given: {})", show(current))
            }
        })
        .collect();
    format!("{}: {}", recipe.name(), parts.join(", "))
}

fn show(value: &serde_json::Value) -> String {
    match value {
        serde_json::Value::String(s) => s.clone(),
        serde_json::Value::Null => "none".into(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::tests::parse;

    fn parsed(args: &[&str]) -> TrainArgs {
        try_parse(std::iter::once("train").chain(args.iter().copied())).expect("parses")
    }

    fn refused(args: &[&str]) -> String {
        try_parse(std::iter::once("train").chain(args.iter().copied()))
            .expect_err("refused")
            .to_string()
    }

    fn json(args: &TrainArgs) -> serde_json::Value {
        serde_json::to_value(args).expect("json")
    }

    #[test]
    fn torchvisions_names_parse_to_the_same_args_as_ours() {
        assert_eq!(
            json(&parse(&[
                "-b",
                "64",
                "-j",
                "3",
                "--weight-decay",
                "0.00002"
            ])),
            json(&parse(&[
                "--batch-size",
                "64",
                "--workers",
                "3",
                "--wd",
                "0.00002"
            ]))
        );
        let a = parsed(&["--data-path", "/data/imagenet", "--output-dir", "/runs/a"]);
        assert_eq!(a.train_dir, PathBuf::from("/data/imagenet/train"));
        assert_eq!(a.val_dir, PathBuf::from("/data/imagenet/val"));
        assert_eq!(a.log_dir, PathBuf::from("/runs/a/logs"));
        assert_eq!(
            a.checkpoint_path(3),
            PathBuf::from("/runs/a/checkpoint-3.ckpt")
        );
        assert!(parsed(&["--device", "cpu"]).no_cuda);
        assert!(!parsed(&["--device", "cuda"]).no_cuda);
        // Lower case, as torchvision's `.lower()`.
        let a = parsed(&["--lr-scheduler", "CosineAnnealingLR"]);
        assert_eq!(a.lr_scheduler, Some(LrScheduler::Cosineannealinglr));
        parsed(&[
            "--use-deterministic-algorithms",
            "--use-v2",
            "--dist-url",
            "env://",
        ])
        .validate()
        .expect("accepted");
    }

    #[test]
    fn lr_with_horovods_rate_flags_is_refused_naming_both() {
        for (args, horovod) in [
            (&["--lr", "0.1", "--base-lr", "0.01"][..], "--base-lr"),
            (
                &["--base-lr", "0.01", "--lr-scheduler", "steplr"][..],
                "--base-lr",
            ),
            (
                &["--lr-warmup-epochs", "5", "--warmup-epochs", "2"][..],
                "--warmup-epochs",
            ),
            (
                &["--lr-gamma", "0.5", "--lr-schedule", "cosine"][..],
                "--lr-schedule",
            ),
        ] {
            let message = refused(args);
            assert!(
                message.contains(horovod) && message.contains("cannot be used"),
                "{message}"
            );
        }
    }

    #[test]
    fn the_recipe_sets_what_is_not_given_and_given_flags_win() {
        let a = parsed(&["--recipe", "torchvision-resnet50-v2"]);
        assert_eq!(
            (a.model.as_str(), a.batch_size, a.epochs),
            ("resnet50", 128, 600)
        );
        assert_eq!(a.lr, Some(0.5));
        assert_eq!(a.lr_scheduler, Some(LrScheduler::Cosineannealinglr));
        assert_eq!(
            (a.lr_warmup_epochs, a.lr_warmup_method),
            (Some(5), Some(crate::cli::WarmupMethod::Linear))
        );
        assert_eq!(
            (a.wd, a.label_smoothing, a.random_erase),
            (0.00002, 0.1, 0.1)
        );
        assert_eq!(
            (a.train_crop_size, a.val_resize_size),
            (Some(176), Some(232))
        );
        assert!(a.model_ema && a.ra_sampler);
        assert_eq!(a.ra_reps, 4);
        assert_eq!(a.auto_augment, Some(crate::cli::AutoAugmentPolicy::TaWide));
        a.validate().expect("valid");
        let described = describe_recipe(&a, Recipe::TorchvisionResnet50V2);
        assert!(
            described.contains("--lr 0.5") && !described.contains("given"),
            "{described}"
        );

        let b = parsed(&[
            "--recipe",
            "torchvision-resnet50-v2",
            "--epochs",
            "2",
            "-b",
            "16",
            "--lr",
            "0.1",
        ]);
        assert_eq!((b.epochs, b.batch_size, b.lr), (2, 16, Some(0.1)));
        assert_eq!(b.val_resize_size, Some(232));
        let described = describe_recipe(&b, Recipe::TorchvisionResnet50V2);
        assert!(described.contains("--epochs 600 (given: 2)"), "{described}");
        assert!(
            described.contains("--batch-size 128 (given: 16)"),
            "{described}"
        );
        // Horovod's rate with the recipe: the recipe's --lr stands, so the pair is refused.
        let message = refused(&["--recipe", "torchvision-resnet50-v2", "--base-lr", "0.1"]);
        assert!(message.contains("--base-lr"), "{message}");
    }

    #[test]
    fn torchvisions_documented_command_needs_only_its_data_path() {
        // references/classification README, ResNet-50 v2 (torchrun's flags aside); flags that
        // another part of the recipe adds are left out when this build lacks them.
        let command = "--model resnet50 --batch-size 128 --lr 0.5 --lr-scheduler \
            cosineannealinglr --lr-warmup-epochs 5 --lr-warmup-method linear --auto-augment \
            ta_wide --epochs 600 --random-erase 0.1 --weight-decay 0.00002 --norm-weight-decay \
            0.0 --label-smoothing 0.1 --mixup-alpha 0.2 --cutmix-alpha 1.0 --train-crop-size 176 \
            --model-ema --val-resize-size 232 --ra-sampler --ra-reps 4 --data-path /data/imagenet";
        let mut argv = vec!["train".to_string()];
        let mut words = command.split_whitespace().peekable();
        while let Some(flag) = words.next() {
            let value = words.next_if(|w| !w.starts_with("--"));
            let id = flag.trim_start_matches("--").replace('-', "_");
            if id == "weight_decay" || has_flag(&id) {
                argv.push(flag.to_string());
                argv.extend(value.map(str::to_string));
            }
        }
        let a = try_parse(&argv).expect("parses");
        a.validate().expect("valid");
        let recipe = parsed(&[
            "--recipe",
            "torchvision-resnet50-v2",
            "--data-path",
            "/data/imagenet",
        ]);
        let (mut typed, mut expanded) = (json(&a), json(&recipe));
        typed["recipe"] = serde_json::Value::Null;
        expanded["recipe"] = serde_json::Value::Null;
        assert_eq!(typed, expanded);
    }

    #[test]
    fn flags_that_cannot_be_honoured_are_refused_with_the_reason() {
        for (args, flag, reason) in [
            (&["--sync-bn"][..], "sync-bn", "not implemented"),
            (&["--amp"][..], "amp", "--amp bf16"),
            (&["--start-epoch", "3"][..], "start-epoch", "checkpoint"),
            (&["--device", "tpu"][..], "device", "cuda"),
            (&["--world-size", "8"][..], "world-size", "launcher"),
            (&["--cache-dataset"][..], "cache-dataset", "decoded"),
            (&["--dist-url", "tcp://x:1"][..], "dist-url", "env://"),
            (&["--backend", "tensor"][..], "backend", "pil"),
            (&["--lr", "0"][..], "lr", "positive"),
            (&["--lr-warmup-decay", "2"][..], "lr-warmup-decay", "(0, 1]"),
            (
                &[
                    "--lr-scheduler",
                    "cosineannealinglr",
                    "--epochs",
                    "5",
                    "--lr-warmup-epochs",
                    "5",
                ][..],
                "lr-warmup-epochs",
                "smaller than --epochs",
            ),
            (
                &["--model-ema-steps", "0"][..],
                "model-ema-steps",
                "at least 1",
            ),
        ] {
            let error = parsed(args).validate().expect_err("refused");
            assert_eq!(error.flag, flag, "{args:?}");
            assert!(error.reason.contains(reason), "{error}");
        }
    }

    #[test]
    fn the_ema_export_sits_beside_the_model_export() {
        let a = parse(&[
            "--checkpoint-format",
            "/tmp/run/ckpt-{epoch}.ckpt",
            "--epochs",
            "4",
        ]);
        assert_eq!(
            a.export_path(),
            PathBuf::from("/tmp/run/ckpt-4.safetensors")
        );
        assert_eq!(
            a.ema_export_path(),
            PathBuf::from("/tmp/run/ckpt-4_ema.safetensors")
        );
    }
}
