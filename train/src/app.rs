//! The binary's body: flags, quickstart, launcher, backend choice, then [`crate::run`]. Exposed
//! so that a user's own binary is one call, [`main_with`].

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::time::{Duration, Instant};

use burn::backend::{Autodiff, Flex};
use burn_dist::{CommBackend, DistOptions, LaunchConfig};
use clap::parser::ValueSource;
use clap::{FromArgMatches, Parser};
use data::synthetic::{SyntheticConfig, SyntheticSummary};

use crate::TrainError;
use crate::cli::{InvalidArgs, TrainArgs, expand_home};
use crate::model::ClassifierConfig;
use crate::trainer::{RunContext, RunSummary, run};

/// Flags the quickstart sets when the user did not: a small ResNet at 32 px that reaches high
/// accuracy on the synthetic data in a few minutes on two CPU cores.
pub const QUICKSTART: &[(&str, &str)] = &[
    ("model", "resnet18"),
    ("image_size", "32"),
    ("epochs", "5"),
    ("batch_size", "32"),
    ("val_batch_size", "100"),
    ("base_lr", "0.02"),
    ("warmup_epochs", "1"),
    ("workers", "2"),
];

/// Where the quickstart keeps its generated dataset.
pub fn synthetic_cache_dir() -> PathBuf {
    crate::cuda_setup::cache_root().join("synthetic-imagenet-v1")
}

/// Generates the quickstart's dataset, once per machine even for several jobs started at once:
/// the first process to take the lock writes it, later ones wait for the lock, then reuse it.
fn generate_synthetic_once(
    cache: &Path,
    cfg: &SyntheticConfig,
) -> Result<SyntheticSummary, TrainError> {
    let lock_path = cache.with_extension("lock");
    let lock_err = |source| TrainError::Log {
        path: lock_path.clone(),
        source,
    };
    if let Some(parent) = lock_path.parent() {
        std::fs::create_dir_all(parent).map_err(lock_err)?;
    }
    let lock = std::fs::File::create(&lock_path).map_err(lock_err)?;
    lock.lock().map_err(lock_err)?;
    Ok(data::synthetic::generate(cache, cfg)?)
}

/// The quickstart's dataset, for the line rank 0 prints.
#[derive(Debug, Clone)]
pub struct Quickstart {
    /// Where the user's `--train-dir` (the default) pointed.
    pub missing_train_dir: PathBuf,
    /// The generated (or reused) dataset.
    pub dataset: SyntheticSummary,
    /// Its folder.
    pub root: PathBuf,
}

impl Quickstart {
    /// The line saying what happens instead of ImageNet.
    pub fn describe(&self) -> String {
        format!(
            "no ImageNet at {}: quickstart on the synthetic dataset in {} ({} train / {} val \
             JPEGs, {})",
            self.missing_train_dir.display(),
            self.root.display(),
            self.dataset.train_images,
            self.dataset.val_images,
            if self.dataset.reused {
                "reused"
            } else {
                "generated now"
            }
        )
    }
}

/// How long a process waits for its node's local rank 0 to write the quickstart dataset.
pub const QUICKSTART_WAIT: Duration = Duration::from_secs(600);

/// Parses the flags (with the quickstart applied when there is no ImageNet and no `--train-dir`).
/// Returns the flags and, for the quickstart, its dataset.
///
/// # Errors
/// The synthetic dataset cannot be written, or did not appear in time.
pub fn parse_args() -> Result<(TrainArgs, Option<Quickstart>), TrainError> {
    // `--recipe` expanded first: what it sets counts as given.
    let (mut argv, matches) = crate::torchvision_flags::parse_with_recipe(std::env::args_os())
        .unwrap_or_else(|e| e.exit());
    let mut args = TrainArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    args.apply_torchvision_paths();
    let from_user = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let quickstart = !from_user("train_dir")
        && !from_user("data_path")
        && !expand_home(&args.train_dir).exists();
    if !quickstart {
        return Ok((args, None));
    }
    // Horovod's rate and warmup are not the quickstart's to set beside torchvision's schedule.
    let torchvision_lr = args.uses_torchvision_lr();
    for (id, value) in QUICKSTART {
        let left_to_torchvision = torchvision_lr && matches!(*id, "base_lr" | "warmup_epochs");
        if !(from_user(id) || left_to_torchvision) {
            argv.push(format!("--{}={value}", id.replace('_', "-")).into());
        }
    }
    let root = synthetic_cache_dir();
    let dataset = quickstart_dataset(&root, &SyntheticConfig::default())?;
    let missing_train_dir = args.train_dir.clone();
    args = TrainArgs::try_parse_from(&argv).unwrap_or_else(|e| e.exit());
    args.apply_torchvision_paths();
    args.train_dir = dataset.train_dir.clone();
    if !from_user("val_dir") {
        args.val_dir = dataset.val_dir.clone();
    }
    Ok((
        args,
        Some(Quickstart {
            missing_train_dir,
            dataset,
            root,
        }),
    ))
}

/// One process per node writes the quickstart dataset: the launcher before it starts its
/// workers, or, under torchrun, SLURM or MPI, local rank 0; the others wait for its marker.
fn quickstart_dataset(root: &Path, cfg: &SyntheticConfig) -> Result<SyntheticSummary, TrainError> {
    let local_rank = if burn_dist::is_worker_env() {
        // An unreadable environment is reported by the launcher later; writing is safe anyway.
        burn_dist::World::from_env().map_or(0, |w| w.local_rank)
    } else {
        0
    };
    if local_rank == 0 {
        generate_synthetic_once(root, cfg)
    } else {
        wait_for_dataset(root, cfg, QUICKSTART_WAIT)
    }
}

/// Waits until another process has written the dataset `cfg` describes under `root`.
fn wait_for_dataset(
    root: &Path,
    cfg: &SyntheticConfig,
    timeout: Duration,
) -> Result<SyntheticSummary, TrainError> {
    let started = Instant::now();
    while !data::synthetic::is_complete(root, cfg) {
        if started.elapsed() >= timeout {
            return Err(TrainError::QuickstartTimeout {
                root: root.to_path_buf(),
                marker: root.join(data::synthetic::MARKER_FILE),
                seconds: timeout.as_secs(),
            });
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    // Complete: this only reads the marker and fills in the paths.
    Ok(data::synthetic::generate(root, cfg)?)
}

/// Runs the whole job for the model `make` builds from the flags: launches one process per device
/// when asked (`--nproc-per-node`, or one per visible GPU), joins the job, picks CUDA or the CPU,
/// trains. Returns the process exit code.
pub fn main_with<C: ClassifierConfig>(
    make: impl FnOnce(&TrainArgs) -> Result<C, InvalidArgs>,
) -> ExitCode {
    crate::malloc::keep_freed_memory();
    // Before any CUDA call: find the CUDA libraries and re-execute once with them arranged.
    #[cfg(feature = "cuda")]
    let libs = burn_dist::cuda_libs::prepare();
    #[cfg(not(feature = "cuda"))]
    let libs = burn_dist::cuda_libs::find();
    if std::env::args_os().any(|a| a == "--check-env") {
        return crate::check_env::run(&TrainArgs::parse(), libs);
    }
    match try_main(make, &libs) {
        Ok(()) => ExitCode::SUCCESS,
        // Not a failure: torchrun's error file stays empty, and the exit code tells a requeue
        // script that the job saved and wants to go on.
        Err(error @ TrainError::Preempted { .. }) => {
            eprintln!("{error}");
            ExitCode::from(crate::preemption::PREEMPTED_EXIT_CODE)
        }
        // The launcher's ranks all exited with one code after a signal: pass it on.
        Err(
            error @ TrainError::Dist(burn_dist::DistError::Interrupted {
                exit_code: Some(code),
                ..
            }),
        ) => {
            eprintln!("{error}");
            ExitCode::from(u8::try_from(code).unwrap_or(1))
        }
        Err(error) => {
            let message = format!("error: {}", error_chain(&error));
            eprintln!("{message}");
            if let Err(e) = crate::elastic::record_failure(&error, &message) {
                eprintln!("could not write torchrun's error file: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

/// The error and its causes, each said once: a message that already quotes its cause (as
/// "cannot write checkpoint ...: No space left on device (os error 28)" does) is not followed by
/// it again.
fn error_chain(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut source = error.source();
    while let Some(cause) = source {
        let text = cause.to_string();
        if !message.contains(&text) {
            message.push_str(&format!(": {text}"));
        }
        source = cause.source();
    }
    message
}

fn try_main<C: ClassifierConfig>(
    make: impl FnOnce(&TrainArgs) -> Result<C, InvalidArgs>,
    libs: &burn_dist::cuda_libs::CudaLibraries,
) -> Result<(), TrainError> {
    let (args, quickstart) = parse_args()?;
    args.validate()?;
    models::set_conv_impl(args.conv.into());
    models::set_batch_norm_impl(args.batch_norm.into());
    let mut dirs = vec![("val-dir", &args.val_dir)];
    if !args.test_only {
        dirs.insert(0, ("train-dir", &args.train_dir));
    }
    for (flag, dir) in dirs {
        let path = expand_home(dir);
        if let Err(error) = std::fs::read_dir(&path) {
            return Err(InvalidArgs {
                flag,
                reason: format!(
                    "cannot read the directory {}: {error}; point it at an ImageFolder \
                     (<dir>/<class>/<image>.JPEG)",
                    path.display()
                ),
            }
            .into());
        }
    }
    if let Some(weights) = &args.weights {
        let path = expand_home(weights);
        if let Err(error) = std::fs::metadata(&path) {
            return Err(InvalidArgs {
                flag: "weights",
                reason: format!(
                    "cannot read {}: {error}; pass a torchvision state_dict saved with \
                     safetensors.torch.save_file",
                    path.display()
                ),
            }
            .into());
        }
    }
    let config = make(&args)?;

    let use_cuda = cfg!(feature = "cuda") && !args.no_cuda && burn_dist::visible_cuda_devices() > 0;
    if args.amp == crate::cli::Amp::Bf16 {
        crate::check_env::amp_refusal(use_cuda, args.conv).map_err(|reason| InvalidArgs {
            flag: "amp",
            reason,
        })?;
        models::set_conv_precision(models::ConvPrecision::Bf16);
    }
    let launch = LaunchConfig {
        nproc_per_node: args.nproc_per_node.or((!use_cuda).then_some(1)),
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
        rdzv_id: args.rdzv_id.clone(),
    };
    let world = burn_dist::launch_or_run(&launch)?;
    if let (0, Some(quickstart)) = (world.rank, &quickstart) {
        println!("{}", quickstart.describe());
    }
    let backend = if use_cuda {
        crate::cuda_setup::keep_autotune_results();
        CommBackend::Nccl
    } else {
        CommBackend::Ring
    };
    let dist = burn_dist::init(&world, &DistOptions::from_env(backend)?)?;
    if dist.is_main() && use_cuda {
        println!("{}", libs.summary());
    }
    if dist.is_main() && !use_cuda {
        println!(
            "{}training on the CPU (Flex backend)",
            if args.no_cuda {
                "--no-cuda: "
            } else if cfg!(feature = "cuda") {
                "no CUDA device found: "
            } else {
                "built without CUDA: "
            }
        );
    }
    let ctx = RunContext {
        args,
        dist: dist.clone(),
        backend: String::new(),
        devices: String::new(),
        show_progress: burn_dist::should_draw_progress(),
    };
    let summary = run_on_backend(ctx, &config, use_cuda)?;
    if dist.is_main() {
        print_closing(&summary, quickstart.is_some(), &config);
    }
    Ok(())
}

fn run_on_backend<C: ClassifierConfig>(
    mut ctx: RunContext,
    config: &C,
    use_cuda: bool,
) -> Result<RunSummary, TrainError> {
    #[cfg(feature = "cuda")]
    if use_cuda {
        let index = ctx.dist.cuda_device();
        let convs = if ctx.args.amp == crate::cli::Amp::Bf16 {
            ", convs in bf16 (--amp bf16)"
        } else {
            ""
        };
        ctx.backend = format!("cuda (burn-cuda, NCCL allreduce){convs}");
        ctx.devices = format!(
            "cuda:{index} on this process (local rank {}), {} per node",
            ctx.dist.world.local_rank, ctx.dist.world.local_world_size
        );
        let device = burn::backend::cuda::CudaDevice::new(index);
        if !crate::cuda_setup::fusion_enabled() {
            ctx.backend = format!("cuda without fusion (burn-cuda, NCCL allreduce){convs}");
            return run::<Autodiff<burn_dist::CudaRaw>, C>(&ctx, config, device);
        }
        return run::<Autodiff<burn_dist::CudaFused>, C>(&ctx, config, device);
    }
    let _ = use_cuda;
    ctx.backend = "flex (CPU), host ring allreduce".into();
    ctx.devices = format!(
        "cpu x {} process(es) per node",
        ctx.dist.world.local_world_size
    );
    // On a worker of rayon's pool, where Flex's parallel ops start without a hand-off.
    crate::cpu_pool::on_pool_worker(|| run::<Autodiff<Flex>, C>(&ctx, config, Default::default()))
}

fn print_closing<C: ClassifierConfig>(summary: &RunSummary, quickstart: bool, config: &C) {
    if let Some(test) = &summary.evaluation {
        println!(
            "test: {} top-1 {:.2}% top-5 {:.2}% on {} images (loss {:.4}){}",
            config.name(),
            100.0 * test.accuracy,
            100.0 * test.accuracy_top5,
            test.count,
            test.loss,
            if summary.evaluated_ema { " (EMA)" } else { "" }
        );
        return;
    }
    if let Some(last) = summary.epochs.last() {
        println!(
            "done: {} after {} epochs, validation accuracy {:.2}% (top-5 {:.2}%) on {} images",
            config.name(),
            last.epoch,
            100.0 * last.val_accuracy,
            100.0 * last.val_accuracy_top5,
            last.val_images
        );
    }
    if let Some(path) = &summary.exported {
        println!(
            "final weights: {} (a torchvision state_dict: load_state_dict(safetensors.torch.load_file(..)))",
            path.display()
        );
    }
    if let Some(path) = &summary.exported_ema {
        println!("EMA weights: {} (the same format)", path.display());
    }
    if quickstart {
        println!(
            "\nNext:\n  ImageNet on every GPU of this node:\n    cargo run --release -p train -- \
             --train-dir ~/imagenet/train --val-dir ~/imagenet/validation\n  \
             Two nodes with 8 GPUs each (run on each node, node-rank 0 and 1):\n    \
             cargo run --release -p train -- --nnodes 2 --node-rank 0 --master-addr <node0> --rdzv-id <job> --nproc-per-node 8\n  \
             Several CPU processes on this machine:\n    cargo run --release -p train -- --nproc-per-node 2 --no-cuda"
        );
    }
}

/// Picks the ResNet `--model` names, or says which names exist.
///
/// # Errors
/// [`InvalidArgs`] for `--model`.
pub fn resnet_from_args(args: &TrainArgs) -> Result<crate::ResNetFamily, InvalidArgs> {
    args.resnet_depth()
        .map(|depth| crate::ResNetFamily {
            depth,
            zero_init_residual: args.zero_init_residual,
        })
        .ok_or_else(|| InvalidArgs {
            flag: "model",
            reason: format!(
                "unknown model {:?}; expected resnet18, resnet34, resnet50, resnet101 or resnet152",
                args.model
            ),
        })
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_error_chain_says_each_cause_once() {
        let full = crate::checkpoint::CheckpointError::Io {
            op: "write",
            path: "/full/checkpoint-3.ckpt".into(),
            source: std::io::Error::from_raw_os_error(28),
        };
        let message = super::error_chain(&full);
        assert_eq!(message.matches("os error 28").count(), 1, "{message}");
        assert!(message.contains("/full/checkpoint-3.ckpt"), "{message}");
        // A cause the message does not quote is still added.
        let wrapped = crate::error::TrainError::Checkpoint(full);
        assert_eq!(
            super::error_chain(&wrapped).matches("os error 28").count(),
            1
        );
        #[derive(Debug, thiserror::Error)]
        #[error("outer")]
        struct Outer(#[source] std::io::Error);
        let outer = Outer(std::io::Error::other("inner cause"));
        assert_eq!(super::error_chain(&outer), "outer: inner cause");
    }

    use super::*;

    fn tiny() -> SyntheticConfig {
        SyntheticConfig {
            classes: 2,
            train_per_class: 2,
            val_per_class: 1,
            min_side: 16,
            max_side: 24,
            quality: 80,
            seed: 1,
        }
    }

    #[test]
    fn a_waiting_process_returns_once_the_writer_is_done() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("set");
        let cfg = tiny();
        let waited = std::thread::scope(|scope| {
            let waiter = scope.spawn(|| wait_for_dataset(&root, &cfg, Duration::from_secs(60)));
            std::thread::sleep(Duration::from_millis(300));
            data::synthetic::generate(&root, &cfg).expect("writer");
            waiter.join().expect("waiter thread")
        });
        let summary = waited.expect("sees the finished set");
        assert!(summary.reused, "the waiter writes nothing");
        assert_eq!(summary.train_dir, root.join("train"));
    }

    #[test]
    fn a_waiting_process_gives_up_naming_the_marker() {
        let dir = tempfile::tempdir().expect("temp dir");
        let root = dir.path().join("never");
        let error = wait_for_dataset(&root, &tiny(), Duration::from_millis(250))
            .expect_err("nobody writes it");
        let message = error.to_string();
        assert!(message.contains(data::synthetic::MARKER_FILE), "{message}");
        assert!(message.contains("local rank 0"), "{message}");
        assert!(!root.exists(), "the waiter wrote nothing");
    }
}
