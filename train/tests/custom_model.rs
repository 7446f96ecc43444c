//! The custom-model example trains through the library's loop on generated data.

mod common;

#[path = "../examples/custom_model.rs"]
mod custom_model;

use burn::backend::{Autodiff, Flex};
use burn_dist::{DistOptions, World};
use clap::Parser;
use train::{RunContext, TrainArgs, run};

#[test]
fn the_example_model_trains_and_its_loss_falls() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = common::small_dataset(&dir.path().join("data"), 24, 6);
    let format = dir.path().join("ckpt-{epoch}.ckpt");
    let args = TrainArgs::try_parse_from([
        "custom_model",
        "--train-dir",
        train_dir.to_str().expect("utf-8"),
        "--val-dir",
        val_dir.to_str().expect("utf-8"),
        "--log-dir",
        dir.path().join("logs").to_str().expect("utf-8"),
        "--checkpoint-format",
        format.to_str().expect("utf-8"),
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--epochs",
        "2",
        "--base-lr",
        "0.05",
        "--warmup-epochs",
        "0",
        "--workers",
        "1",
    ])
    .expect("flags");
    args.validate().expect("valid flags");
    let dist = burn_dist::init(&World::single(), &DistOptions::default()).expect("world of one");
    let ctx = RunContext {
        args,
        dist,
        backend: "flex".into(),
        devices: "cpu".into(),
        show_progress: false,
    };
    let summary = run::<Autodiff<Flex>, _>(
        &ctx,
        &custom_model::SmallCnnConfig { width: 8 },
        Default::default(),
    )
    .expect("trains");
    assert_eq!(summary.epochs.len(), 2);
    let (first, second) = (&summary.epochs[0], &summary.epochs[1]);
    assert!(first.train_loss.is_finite());
    assert!(
        second.train_loss < first.train_loss,
        "{first:?} -> {second:?}"
    );
    // Below chance level's cross-entropy for 4 classes, ln 4.
    assert!(second.train_loss < 4f64.ln(), "{second:?}");
    assert_eq!(first.val_images, 24);
}
