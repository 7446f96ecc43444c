#![deny(missing_docs)]
//! Data-parallel ImageNet training on Burn: Horovod's `pytorch_imagenet_resnet50.py`, as a
//! library and the `train` binary.
//!
//! The binary trains the ResNets; your own model trains through the same loop, CLI and launcher
//! by implementing [`ClassifierConfig`] for its config and calling [`main_with`] from its `main`
//! (see `examples/custom_model.rs` and the README, whose example is compiled as a doctest).
//!
//! The optimizer (`--opt`, weight-decay groups, `--clip-grad-norm`) is [`optim::TorchOptimizer`]:
//! torch.optim's update rules over any Burn module, its groups taken from the module path.

mod app;
pub mod check_env;
pub mod checkpoint;
pub mod cli;
pub mod cpu_pool;
pub mod cuda_setup;
pub mod datasets;
pub mod elastic;
pub mod ema;
mod error;
pub mod lr_plan;
pub mod malloc;
pub mod metrics;
pub mod mix;
mod model;
pub mod optim;
pub mod preemption;
pub mod progress;
pub mod resume;
pub mod run_log;
pub mod schedule;
pub mod tensorboard;
pub mod torchvision_flags;
pub mod trainer;
pub mod weights;

pub use app::{
    QUICKSTART, QUICKSTART_WAIT, Quickstart, main_with, parse_args, resnet_from_args,
    synthetic_cache_dir,
};
pub use cli::{LrDecay, LrScheduler, Recipe, TrainArgs, WarmupMethod};
pub use datasets::{Datasets, load_data};
pub use error::TrainError;
pub use lr_plan::{LrPlan, TorchvisionSchedule};
pub use metrics::{EpochMetrics, PhaseMetrics, batch_stats, per_sample_loss, per_sample_soft_loss};
pub use model::{ClassifierConfig, ResNetFamily};
pub use schedule::LrSchedule;
pub use trainer::{RunContext, RunSummary, evaluate, run};

/// The README's Rust examples compile (`cargo test --doc`).
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
