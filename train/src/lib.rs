#![deny(missing_docs)]
//! Data-parallel ImageNet training on Burn: Horovod's `pytorch_imagenet_resnet50.py`, as a
//! library and the `train` binary.
//!
//! The binary trains the ResNets; your own model trains through the same loop, CLI and launcher
//! by implementing [`ClassifierConfig`] for its config and calling [`main_with`] from its `main`
//! (see `examples/custom_model.rs` and the README, whose example is compiled as a doctest).

mod app;
pub mod checkpoint;
pub mod cli;
pub mod cuda_setup;
pub mod elastic;
mod error;
mod model;
pub mod progress;
pub mod schedule;
pub mod tensorboard;
pub mod trainer;

pub use app::{QUICKSTART, main_with, parse_args, resnet_from_args, synthetic_cache_dir};
pub use cli::TrainArgs;
pub use error::TrainError;
pub use model::{ClassifierConfig, ResNetFamily};
pub use schedule::LrSchedule;
pub use trainer::{EpochMetrics, RunContext, RunSummary, run};

/// The README's Rust examples compile (`cargo test --doc`).
#[doc = include_str!("../../README.md")]
#[cfg(doctest)]
pub struct ReadmeDoctests;
