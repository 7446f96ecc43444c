//! `--weights` and `--test-only` through the binary: ImageNet-shaped weights fine-tuned onto a
//! four-class folder (the head skipped), the export, and an evaluation of the export that agrees
//! with the last epoch's validation.

mod common;

use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_train");

#[test]
fn imagenet_weights_fine_tune_onto_four_classes_and_the_export_evaluates_the_same() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 12, 6);
    let weights = unpacked_resnet18(dir.path());

    let run_dir = dir.path().join("finetune");
    let output = run_ok(train_command(EXE, &run_dir, &train_dir, &val_dir).args([
        "--weights".as_ref(),
        weights.as_os_str(),
        "--epochs".as_ref(),
        "1".as_ref(),
        "--base-lr".as_ref(),
        "0.01".as_ref(),
    ]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("DDP's `module.` prefix removed"),
        "{stdout}"
    );
    assert!(
        stdout.contains("`fc` skipped: the file's head has 1000 classes, the data 4"),
        "{stdout}"
    );
    let metrics = read_metrics(&run_dir.join("logs"));
    assert_eq!(metrics.len(), 1, "{stdout}");
    assert!(field(&metrics[0], "train_loss").is_finite());
    let exported = run_dir.join("checkpoint-1.safetensors");
    assert!(
        stdout.contains(&format!("final weights: {}", exported.display())),
        "{stdout}"
    );

    // The export is a torchvision state_dict of a 4-class ResNet-18 ...
    let device = Default::default();
    let model = models::ResNetConfig::resnet18(4).init::<burn::backend::Flex>(&device);
    models::torchvision::load(model, &exported, &device).expect("a 4-class ResNet-18");

    // ... and evaluating it alone gives the epoch's validation figures.
    let output = run_ok(
        train_command(EXE, &dir.path().join("test"), &train_dir, &val_dir).args([
            "--weights".as_ref(),
            exported.as_os_str(),
            "--test-only".as_ref(),
        ]),
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    let expected = format!(
        "top-1 {:.2}% top-5 {:.2}% on 24 images",
        100.0 * field(&metrics[0], "val_accuracy"),
        100.0 * field(&metrics[0], "val_accuracy_top5")
    );
    assert!(stdout.contains(&expected), "{expected:?} not in\n{stdout}");
    assert!(
        !dir.path().join("test/checkpoint-1.ckpt").exists(),
        "--test-only trains nothing"
    );
}

#[test]
fn test_only_refuses_weights_of_another_class_count_and_needs_something_to_evaluate() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 2, 2);
    let weights = unpacked_resnet18(dir.path());

    let output = ChildGuard::spawn(
        train_command(EXE, &dir.path().join("a"), &train_dir, &val_dir).args([
            "--weights".as_ref(),
            weights.as_os_str(),
            "--test-only".as_ref(),
        ]),
    )
    .wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("fc.weight") && stderr.contains("[1000, 512]"),
        "{stderr}"
    );

    let output = ChildGuard::spawn(
        train_command(EXE, &dir.path().join("b"), &train_dir, &val_dir).arg("--test-only"),
    )
    .wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success());
    assert!(
        stderr.contains("--test-only has nothing to evaluate"),
        "{stderr}"
    );
}
