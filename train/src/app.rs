//! The binary's body: flags, quickstart, launcher, backend choice, then [`crate::run`]. Exposed
//! so that a user's own binary is one call, [`main_with`].

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use burn::backend::{Autodiff, Flex};
use burn_dist::{CommBackend, DistOptions, LaunchConfig};
use clap::parser::ValueSource;
use clap::{CommandFactory, FromArgMatches, Parser};

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

/// Generates the quickstart's dataset, once per machine: under torchrun or srun every process
/// starts here at the same moment, so the first to take the lock writes it and the others wait,
/// then reuse it.
fn generate_synthetic_once(cache: &Path) -> Result<data::synthetic::SyntheticSummary, TrainError> {
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
    Ok(data::synthetic::generate(
        cache,
        &data::synthetic::SyntheticConfig::default(),
    )?)
}

/// Parses the flags (with the quickstart applied when there is no ImageNet and no `--train-dir`).
/// Returns the flags and whether the quickstart is on.
///
/// # Errors
/// The synthetic dataset cannot be written.
pub fn parse_args() -> Result<(TrainArgs, bool), TrainError> {
    let matches = TrainArgs::command().get_matches();
    let mut args = TrainArgs::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    let from_user = |id: &str| matches.value_source(id) == Some(ValueSource::CommandLine);
    let quickstart = !from_user("train_dir") && !expand_home(&args.train_dir).exists();
    if !quickstart {
        return Ok((args, false));
    }
    let mut argv: Vec<String> = std::env::args().collect();
    for (id, value) in QUICKSTART {
        if !from_user(id) {
            argv.push(format!("--{}={value}", id.replace('_', "-")));
        }
    }
    let cache = synthetic_cache_dir();
    let summary = generate_synthetic_once(&cache)?;
    if !burn_dist::is_worker_env() || burn_dist::World::from_env().is_ok_and(|w| w.is_main()) {
        println!(
            "no ImageNet at {}: quickstart on the synthetic dataset in {} ({} train / {} val JPEGs, {})",
            args.train_dir.display(),
            cache.display(),
            summary.train_images,
            summary.val_images,
            if summary.reused {
                "reused"
            } else {
                "generated now"
            }
        );
    }
    args = TrainArgs::try_parse_from(&argv).unwrap_or_else(|e| e.exit());
    args.train_dir = summary.train_dir;
    if !from_user("val_dir") {
        args.val_dir = summary.val_dir;
    }
    Ok((args, true))
}

/// Runs the whole job for the model `make` builds from the flags: launches one process per device
/// when asked (`--nproc-per-node`, or one per visible GPU), joins the job, picks CUDA or the CPU,
/// trains. Returns the process exit code.
pub fn main_with<C: ClassifierConfig>(
    make: impl FnOnce(&TrainArgs) -> Result<C, InvalidArgs>,
) -> ExitCode {
    match try_main(make) {
        Ok(()) => ExitCode::SUCCESS,
        Err(error) => {
            let mut message = format!("error: {error}");
            let mut source = std::error::Error::source(&error);
            while let Some(cause) = source {
                message.push_str(&format!(": {cause}"));
                source = cause.source();
            }
            eprintln!("{message}");
            if let Err(e) = crate::elastic::record_failure(&error, &message) {
                eprintln!("could not write torchrun's error file: {e}");
            }
            ExitCode::FAILURE
        }
    }
}

fn try_main<C: ClassifierConfig>(
    make: impl FnOnce(&TrainArgs) -> Result<C, InvalidArgs>,
) -> Result<(), TrainError> {
    let (args, quickstart) = parse_args()?;
    args.validate()?;
    for (flag, dir) in [("train-dir", &args.train_dir), ("val-dir", &args.val_dir)] {
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
    let config = make(&args)?;

    let use_cuda = cfg!(feature = "cuda") && !args.no_cuda && burn_dist::visible_cuda_devices() > 0;
    let launch = LaunchConfig {
        nproc_per_node: args.nproc_per_node.or((!use_cuda).then_some(1)),
        nnodes: args.nnodes,
        node_rank: args.node_rank,
        master_addr: args.master_addr.clone(),
        master_port: args.master_port,
        rdzv_id: args.rdzv_id.clone(),
    };
    let world = burn_dist::launch_or_run(&launch)?;
    let backend = if use_cuda {
        crate::cuda_setup::keep_autotune_results();
        CommBackend::Nccl
    } else {
        CommBackend::Host
    };
    let dist = burn_dist::init(&world, &DistOptions::from_env(backend)?)?;
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
        print_closing(&summary, quickstart, &config);
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
        let local_rank = ctx.dist.world.local_rank;
        ctx.backend = "cuda (burn-cuda, NCCL allreduce)".into();
        ctx.devices = format!(
            "cuda:{local_rank} on this process, {} per node",
            ctx.dist.world.local_world_size
        );
        let device = burn::backend::cuda::CudaDevice::new(local_rank);
        return run::<Autodiff<burn::backend::Cuda>, C>(&ctx, config, device);
    }
    let _ = use_cuda;
    ctx.backend = "flex (CPU), host ring allreduce".into();
    ctx.devices = format!(
        "cpu x {} process(es) per node",
        ctx.dist.world.local_world_size
    );
    run::<Autodiff<Flex>, C>(&ctx, config, Default::default())
}

fn print_closing<C: ClassifierConfig>(summary: &RunSummary, quickstart: bool, config: &C) {
    if let Some(last) = summary.epochs.last() {
        println!(
            "done: {} after {} epochs, validation accuracy {:.2}% on {} images",
            config.name(),
            last.epoch,
            100.0 * last.val_accuracy,
            last.val_images
        );
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
        .map(|depth| crate::ResNetFamily { depth })
        .ok_or_else(|| InvalidArgs {
            flag: "model",
            reason: format!(
                "unknown model {:?}; expected resnet18, resnet34, resnet50, resnet101 or resnet152",
                args.model
            ),
        })
}
