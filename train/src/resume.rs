//! How a run starts: from the newest valid checkpoint when its settings fit this run, else from
//! `--weights`, else from the initialisation. Rank 0 decides and broadcasts the decision, so a
//! refusal on rank 0 stops every rank at once instead of leaving them waiting in a collective.

use burn::module::AutodiffModule;
use burn::optim::Optimizer;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::CommunicatorExt;
use serde_json::Value;

use crate::TrainError;
use crate::checkpoint::{self, Checkpoint};
use crate::cli::{LrDecay, LrScheduler, TrainArgs, expand_home};
use crate::metrics::EpochMetrics;
use crate::preemption::MidEpoch;
use crate::trainer::RunContext;
use crate::weights;

/// Flags whose change alters how the run optimises: resuming with another value is refused
/// unless `--resume-anyway` is given.
const LR_SETTINGS: &[&str] = &[
    "base_lr",
    "warmup_epochs",
    "batch_size",
    "batches_per_allreduce",
    "lr_schedule",
    "momentum",
    "wd",
    "label_smoothing",
    "max_steps_per_epoch",
    "lr",
    "lr_scheduler",
    "lr_step_size",
    "lr_gamma",
    "lr_min",
    "lr_warmup_epochs",
    "lr_warmup_method",
    "lr_warmup_decay",
    "opt",
    "norm_weight_decay",
    "bias_weight_decay",
    "clip_grad_norm",
];

/// Flags that say where and how to run, not what to train (or that only matter at a fresh
/// start): never reported. `epochs` is compared only under the cosine schedule.
const NOT_COMPARED: &[&str] = &[
    "resume_anyway",
    "test_only",
    "weights",
    "zero_init_residual",
    "use_adasum",
    "epochs",
    "nproc_per_node",
    "nnodes",
    "node_rank",
    "master_addr",
    "master_port",
    "workers",
    "keep_checkpoints",
    "on_bad_image",
    "no_cuda",
    "log_dir",
    "checkpoint_format",
    "recipe",
    "data_path",
    "output_dir",
    "resume",
    "start_epoch",
    "print_freq",
    "device",
    "use_deterministic_algorithms",
    "use_v2",
    "checkpoint_every",
    "save_on_signal",
];

/// A setting that differs between a checkpoint and this run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Changed {
    /// `world size`, `global batch`, or the flag (`--base-lr`).
    pub setting: String,
    /// The value the checkpoint was written with.
    pub saved: String,
    /// This run's value.
    pub now: String,
    /// Whether resuming with it changes the optimisation (refused without `--resume-anyway`).
    pub affects_lr: bool,
}

/// The settings of a checkpoint written by `saved` at `saved_world` processes that differ in this
/// run: the world size and the global batch (which scale the learning rate), then every flag by
/// name.
pub fn changed_settings(
    saved: &TrainArgs,
    saved_world: usize,
    args: &TrainArgs,
    world: usize,
) -> Vec<Changed> {
    let mut changes = Vec::new();
    let mut push = |setting: &str, saved: String, now: String, affects_lr: bool| {
        changes.push(Changed {
            setting: setting.to_string(),
            saved,
            now,
            affects_lr,
        });
    };
    // The peak LR: torchvision's `--lr` is the total; Horovod's `--base-lr` is per batch of
    // `--batch-size` and grows with the world and `--batches-per-allreduce`.
    let peak = |a: &TrainArgs, world: usize| {
        a.lr.unwrap_or(a.base_lr * (world * a.batches_per_allreduce) as f64)
    };
    // 8 GPUs, or 4 GPUs × --batches-per-allreduce 2: the same global batch at the same peak LR
    // is the same optimisation, regrouped (only a Horovod warmup starts elsewhere).
    let regrouped = saved.global_batch(saved_world) == args.global_batch(world)
        && (peak(saved, saved_world) - peak(args, world)).abs()
            <= 1e-9 * peak(saved, saved_world).abs();
    const REGROUPING: [&str; 3] = ["batch_size", "batches_per_allreduce", "base_lr"];
    if saved_world != world {
        push(
            "world size",
            saved_world.to_string(),
            world.to_string(),
            !regrouped,
        );
    }
    if saved.global_batch(saved_world) != args.global_batch(world) {
        push(
            "global batch",
            saved.global_batch(saved_world).to_string(),
            args.global_batch(world).to_string(),
            true,
        );
    }
    let ends_at_epochs = |a: &TrainArgs| {
        if a.uses_torchvision_lr() {
            a.lr_scheduler == Some(LrScheduler::Cosineannealinglr)
        } else {
            a.lr_schedule == LrDecay::Cosine
        }
    };
    let cosine = ends_at_epochs(saved) || ends_at_epochs(args);
    if cosine && saved.epochs != args.epochs {
        push(
            "--epochs (the cosine ends there)",
            saved.epochs.to_string(),
            args.epochs.to_string(),
            true,
        );
    }
    let (Ok(Value::Object(before)), Ok(Value::Object(after))) =
        (serde_json::to_value(saved), serde_json::to_value(args))
    else {
        return changes;
    };
    for (key, now) in &after {
        if NOT_COMPARED.contains(&key.as_str()) {
            continue;
        }
        // A flag newer than the checkpoint: nothing to compare with.
        let Some(then) = before.get(key) else {
            continue;
        };
        if then != now {
            push(
                &format!("--{}", key.replace('_', "-")),
                show(then),
                show(now),
                LR_SETTINGS.contains(&key.as_str())
                    && !(regrouped && REGROUPING.contains(&key.as_str())),
            );
        }
    }
    changes
}

fn show(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "none".into(),
        other => other.to_string(),
    }
}

/// `setting saved -> now, ...`.
pub fn describe(changes: &[&Changed]) -> String {
    changes
        .iter()
        .map(|c| format!("{} {} -> {}", c.setting, c.saved, c.now))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Where a training run starts.
pub struct Start<M, O> {
    /// The model: restored, pretrained or freshly initialised (on rank 0; the caller broadcasts).
    pub model: M,
    /// The optimizer, with its restored state on rank 0.
    pub optimizer: O,
    /// Completed epochs (0 on a fresh start).
    pub resumed_from: usize,
    /// The figures of the completed epochs (rank 0).
    pub history: Vec<EpochMetrics>,
    /// `--model-ema` resumed from the checkpoint (rank 0): the averaged weights and their update
    /// count.
    pub ema: Option<(M, u64)>,
    /// Resumed from a mid-epoch checkpoint: where in epoch `resumed_from` (every rank).
    pub mid_epoch: Option<MidEpoch>,
}

/// Decides, on rank 0, where training starts: the newest valid checkpoint (refused when its
/// learning-rate settings differ, unless `--resume-anyway`), else `--weights` (the head `head`
/// skipped when its class count differs), else the initialisation. Every rank learns the outcome;
/// parameters and optimizer state are broadcast by the caller.
///
/// # Errors
/// Rank 0's reason ([`TrainError::ResumeChanged`], a damaged or foreign checkpoint, weights that
/// do not fit) on rank 0, [`TrainError::StoppedByRankZero`] on the others.
pub fn start<B, M, O>(
    ctx: &RunContext,
    model: M,
    optimizer: O,
    head: &str,
    device: &B::Device,
) -> Result<Start<M, O>, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let outcome = if ctx.dist.is_main() {
        start_on_rank_zero::<B, M, O>(ctx, model, optimizer, head, device)
    } else {
        Ok(Start {
            model,
            optimizer,
            resumed_from: 0,
            history: Vec::new(),
            ema: None,
            mid_epoch: None,
        })
    };
    let verdict = agree(ctx, outcome.as_ref().map(|s| s.resumed_from as i64))?;
    let mut start = outcome?;
    start.resumed_from = verdict as usize;
    // Every rank starts the epoch at the same batch.
    let mut position = start.mid_epoch.map_or([0.0; 9], |m| m.to_array());
    ctx.comm().broadcast_slice(&mut position, 0)?;
    start.mid_epoch = MidEpoch::from_array(&position);
    Ok(start)
}

/// The weights `--test-only` evaluates, loaded on rank 0: `--weights` (every tensor must fit, the
/// head included), else the newest valid checkpoint.
///
/// # Errors
/// [`TrainError::NothingToEvaluate`], or why the weights do not load, on rank 0;
/// [`TrainError::StoppedByRankZero`] on the others.
pub fn evaluation_model<B, M>(
    ctx: &RunContext,
    model: M,
    device: &B::Device,
) -> Result<M, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    let outcome = if ctx.dist.is_main() {
        evaluation_model_on_rank_zero::<B, M>(&ctx.args, model, device)
    } else {
        Ok(model)
    };
    agree(ctx, outcome.as_ref().map(|_| 0))?;
    outcome
}

/// Rank 0's outcome (`Ok(value ≥ 0)` or an error) reaches every rank; returns rank 0's value.
/// On rank 0 a failed outcome is returned by the caller, so its own error wins over a failed
/// broadcast.
fn agree<E>(ctx: &RunContext, outcome: Result<i64, &E>) -> Result<i64, TrainError> {
    let failed = outcome.is_err();
    let mut verdict = [outcome.unwrap_or(-1)];
    let sent = ctx.comm().broadcast_slice(&mut verdict, 0);
    if ctx.dist.is_main() && failed {
        // The caller returns rank 0's own error.
        return Ok(-1);
    }
    sent?;
    if verdict[0] < 0 {
        return Err(TrainError::StoppedByRankZero {
            rank: ctx.dist.rank(),
        });
    }
    Ok(verdict[0])
}

/// `--resume PATH` (which must read back intact), else the newest valid checkpoint.
fn newest_valid_checkpoint(args: &TrainArgs) -> Result<Option<Checkpoint>, TrainError> {
    if let Some(path) = &args.resume {
        return Ok(Some(checkpoint::read(&expand_home(path))?));
    }
    let scan = checkpoint::scan_for_resume(args);
    for damaged in &scan.damaged {
        println!("warning: {damaged}; trying an older checkpoint");
    }
    Ok(scan.newest_valid)
}

fn start_on_rank_zero<B, M, O>(
    ctx: &RunContext,
    model: M,
    optimizer: O,
    head: &str,
    device: &B::Device,
) -> Result<Start<M, O>, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let args = &ctx.args;
    if let Some(found) = newest_valid_checkpoint(args)? {
        let changes = changed_settings(
            &found.header.args,
            found.header.world_size,
            args,
            ctx.dist.world_size(),
        );
        let refused: Vec<&Changed> = changes.iter().filter(|c| c.affects_lr).collect();
        if !refused.is_empty() && !args.resume_anyway {
            return Err(TrainError::ResumeChanged {
                path: found.path.clone(),
                changes: describe(&refused),
            });
        }
        let (model, optimizer) = if let Some(why) = optimizer_state_unusable(&found, args) {
            println!("optimizer state not restored: {why}; it starts afresh");
            (found.restore_model(model, device)?, optimizer)
        } else {
            found.restore(model, optimizer, device)?
        };
        let ema = match (args.model_ema, found.ema_n_averaged()) {
            // A copy that shares no running state with the model (a clone would: loading the
            // EMA's BatchNorm statistics into it would overwrite the model's).
            (true, Some(n_averaged)) => found
                .restore_ema(M::from_inner(model.valid()), device)?
                .map(|ema| (ema, n_averaged)),
            (true, None) => {
                println!(
                    "--model-ema: {} holds no EMA; the EMA starts from its weights",
                    found.path.display()
                );
                None
            }
            (false, _) => None,
        };
        match found.header.mid_epoch {
            None => println!(
                "resuming from {} ({} epochs done)",
                found.path.display(),
                found.header.epoch
            ),
            Some(at) => println!(
                "resuming from {} (epoch {}, step {}: {} epochs and {} steps done)",
                found.path.display(),
                found.header.epoch + 1,
                at.step,
                found.header.epoch,
                at.step
            ),
        }
        if !changes.is_empty() {
            let all: Vec<&Changed> = changes.iter().collect();
            println!(
                "resuming with changed settings{}: {}",
                if refused.is_empty() {
                    ""
                } else {
                    " (--resume-anyway)"
                },
                describe(&all)
            );
        }
        if let Some(weights) = &args.weights {
            println!(
                "--weights {} ignored: the run resumes from its checkpoint",
                weights.display()
            );
        }
        return Ok(Start {
            model,
            optimizer,
            resumed_from: found.header.epoch,
            mid_epoch: found.header.mid_epoch,
            history: found.header.history,
            ema,
        });
    }
    let model = match &args.weights {
        Some(path) => {
            let path = expand_home(path);
            let (model, report) = weights::load_pretrained(model, &path, Some(head), device)?;
            for line in weights::describe_load(&path, &report, head) {
                println!("{line}");
            }
            model
        }
        None => model,
    };
    Ok(Start {
        model,
        optimizer,
        resumed_from: 0,
        history: Vec::new(),
        ema: None,
        mid_epoch: None,
    })
}

/// Why `found`'s optimizer state cannot continue in this run, if it cannot: another `--opt`
/// (only reached with `--resume-anyway`), or a file from before the optimizer choice.
fn optimizer_state_unusable(found: &Checkpoint, args: &TrainArgs) -> Option<String> {
    if !found.has_current_optimizer_format() {
        return Some(format!(
            "{} holds the SGD state of an older version of this program",
            found.path.display()
        ));
    }
    let saved = found.header.args.opt;
    (saved != args.opt).then(|| {
        format!(
            "the checkpoint was written by --opt {}, this run uses --opt {}",
            saved.name(),
            args.opt.name()
        )
    })
}

fn evaluation_model_on_rank_zero<B, M>(
    args: &TrainArgs,
    model: M,
    device: &B::Device,
) -> Result<M, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    if let Some(path) = &args.weights {
        let path = expand_home(path);
        let (model, report) = weights::load_pretrained(model, &path, None, device)?;
        for line in weights::describe_load(&path, &report, "") {
            println!("{line}");
        }
        if args.model_ema {
            println!("--model-ema: the EMA of weights never trained is the weights themselves");
        }
        return Ok(model);
    }
    let Some(found) = newest_valid_checkpoint(args)? else {
        return Err(TrainError::NothingToEvaluate {
            checkpoint: args.checkpoint_path(args.epochs),
        });
    };
    // As torchvision's --test-only: with --model-ema the EMA is evaluated, else the model.
    if args.model_ema {
        let Some(ema) = found.restore_ema(model, device)? else {
            return Err(crate::cli::InvalidArgs {
                flag: "model-ema",
                reason: format!(
                    "{} holds no EMA (it was trained without --model-ema); drop --model-ema to \
                     evaluate its weights",
                    found.path.display()
                ),
            }
            .into());
        };
        println!(
            "evaluating the EMA of {} ({} epochs trained)",
            found.path.display(),
            found.header.epoch
        );
        return Ok(ema);
    }
    if found.ema_n_averaged().is_some() {
        println!(
            "{} also holds an EMA: --model-ema evaluates it",
            found.path.display()
        );
    }
    println!(
        "evaluating {} ({} epochs trained)",
        found.path.display(),
        found.header.epoch
    );
    Ok(found.restore_model(model, device)?)
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> TrainArgs {
        TrainArgs::try_parse_from(std::iter::once("train").chain(extra.iter().copied()))
            .expect("flags")
    }

    #[test]
    fn the_same_settings_change_nothing() {
        let a = args(&["--batch-size", "64"]);
        assert!(changed_settings(&a, 4, &a, 4).is_empty());
        // Where and how to run, and a longer step schedule, are not changes.
        let b = args(&["--batch-size", "64", "--workers", "9", "--epochs", "120"]);
        assert!(changed_settings(&a, 4, &b, 4).is_empty());
    }

    #[test]
    fn another_world_size_changes_the_lr_and_the_global_batch() {
        let a = args(&[]);
        let changes = changed_settings(&a, 2, &a, 4);
        let names: Vec<(&str, &str, &str, bool)> = changes
            .iter()
            .map(|c| {
                (
                    c.setting.as_str(),
                    c.saved.as_str(),
                    c.now.as_str(),
                    c.affects_lr,
                )
            })
            .collect();
        assert_eq!(
            names,
            vec![
                ("world size", "2", "4", true),
                ("global batch", "64", "128", true),
            ]
        );
    }

    #[test]
    fn the_same_global_batch_and_peak_lr_on_another_world_is_no_lr_change() {
        // 8 processes → 4 × --batches-per-allreduce 2: reported, not refused.
        let saved = args(&["--batch-size", "32"]);
        let now = args(&["--batch-size", "32", "--batches-per-allreduce", "2"]);
        let changes = changed_settings(&saved, 8, &now, 4);
        let seen: Vec<(&str, bool)> = changes
            .iter()
            .map(|c| (c.setting.as_str(), c.affects_lr))
            .collect();
        assert_eq!(
            seen,
            vec![("world size", false), ("--batches-per-allreduce", false)]
        );
        // torchvision's --lr is the total: the same on any world.
        let saved = args(&["--lr", "0.5", "--batch-size", "64"]);
        let now = args(&["--lr", "0.5", "--batch-size", "128"]);
        assert!(
            changed_settings(&saved, 8, &now, 4)
                .iter()
                .all(|c| !c.affects_lr)
        );
        // Another global batch, or another peak LR, is refused.
        let horovod = args(&["--batch-size", "32"]);
        let more = args(&["--batch-size", "32", "--batches-per-allreduce", "4"]);
        assert!(
            changed_settings(&horovod, 8, &more, 4)
                .iter()
                .any(|c| c.affects_lr)
        );
        let hotter = args(&["--batch-size", "64", "--base-lr", "0.0125"]);
        let changes = changed_settings(&horovod, 8, &hotter, 4);
        assert!(
            changes
                .iter()
                .any(|c| c.setting == "world size" && c.affects_lr)
        );
    }

    #[test]
    fn flags_are_compared_by_name_and_sorted_into_lr_and_other() {
        let saved = args(&["--base-lr", "0.1", "--seed", "1", "--lr-schedule", "cosine"]);
        let now = args(&["--base-lr", "0.2", "--seed", "2", "--epochs", "100"]);
        let changes = changed_settings(&saved, 1, &now, 1);
        let find = |name: &str| {
            changes
                .iter()
                .find(|c| c.setting.starts_with(name))
                .unwrap_or_else(|| panic!("{name} in {changes:?}"))
        };
        assert!(find("--base-lr").affects_lr);
        assert_eq!(
            (
                find("--base-lr").saved.as_str(),
                find("--base-lr").now.as_str()
            ),
            ("0.1", "0.2")
        );
        assert!(find("--lr-schedule").affects_lr);
        assert!(find("--epochs").affects_lr, "the cosine ends at --epochs");
        assert!(!find("--seed").affects_lr);
        assert_eq!(changes.len(), 4, "{changes:?}");
    }
}
