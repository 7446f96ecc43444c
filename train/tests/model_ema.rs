//! `--model-ema` end to end: two processes train two epochs with torchvision's schedule flags; the
//! EMA is validated every epoch (metrics.jsonl and TensorBoard), checkpointed, resumed exactly,
//! exported beside the model, and evaluated by `--test-only --model-ema`.

mod common;

use std::path::Path;
use std::process::Command;

use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_train");

/// `train` on the CPU, two processes, a tiny ResNet-18 at 32 px, torchvision's schedule
/// (`--lr`), and the EMA every 2 steps; `--model-ema` unless `ema` is false.
fn command(run_dir: &Path, train_dir: &Path, val_dir: &Path, ema: bool) -> Command {
    let mut command = Command::new(EXE);
    command
        .arg("--train-dir")
        .arg(train_dir)
        .arg("--val-dir")
        .arg(val_dir)
        .arg("--output-dir")
        .arg(run_dir)
        .args([
            "--model",
            "resnet18",
            "--image-size",
            "32",
            "-b",
            "8",
            "-j",
            "1",
        ])
        .args(["--val-batch-size", "16", "--device", "cpu", "--epochs", "2"])
        .args(["--lr", "0.05", "--nproc-per-node", "2"])
        .args(["--model-ema-steps", "2", "--model-ema-decay", "0.99"])
        .args(["--master-port", &free_port().to_string()])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("BURN_DIST_JOB_TOKEN", job_token("train-test"))
        .env("BURN_DIST_TIMEOUT_S", "60")
        .stdin(std::process::Stdio::null());
    if ema {
        command.arg("--model-ema");
    }
    command
}

fn ema_lines(log_dir: &Path) -> Vec<(f64, f64, f64)> {
    read_metrics(log_dir)
        .iter()
        .map(|m| {
            (
                field(m, "val_accuracy_ema"),
                field(m, "val_loss_ema"),
                field(m, "val_loss"),
            )
        })
        .collect()
}

fn test_line(output: &std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&output.stdout);
    stdout
        .lines()
        .find(|l| l.starts_with("test: "))
        .unwrap_or_else(|| panic!("no test line in\n{stdout}"))
        .to_string()
}

#[test]
fn ema_is_validated_checkpointed_resumed_exported_and_tested() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 16, 5);
    let run_dir = dir.path().join("run");
    let logs = run_dir.join("logs");
    let output = run_ok(&mut command(&run_dir, &train_dir, &val_dir, true));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("EMA acc"), "{stdout}");
    assert!(stdout.contains("torchvision's: lr 0.05"), "{stdout}");
    let first = ema_lines(&logs);
    assert_eq!(first.len(), 2, "{first:?}");
    for (accuracy, loss, model_loss) in &first {
        assert!((0.0..=1.0).contains(accuracy) && loss.is_finite());
        assert_ne!(loss, model_loss, "the EMA is not the model");
    }

    // TensorBoard has the EMA's scalars per epoch.
    let events: Vec<_> = std::fs::read_dir(&logs)
        .expect("logs")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.to_string_lossy().contains("tfevents"))
        .collect();
    let scalars: Vec<_> = events
        .iter()
        .flat_map(|p| train::tensorboard::read_scalars(p).expect("events"))
        .filter(|s| s.tag == "val/accuracy_ema")
        .collect();
    assert_eq!(scalars.len(), 2, "{scalars:?}");
    assert!((f64::from(scalars[1].value) - first[1].0).abs() < 1e-6);

    // The EMA export sits beside the model's and holds other weights.
    let model_export = run_dir.join("checkpoint-2.safetensors");
    let ema_export = run_dir.join("checkpoint-2_ema.safetensors");
    let (model_bytes, ema_bytes) = (
        std::fs::read(&model_export).expect("model export"),
        std::fs::read(&ema_export).expect("EMA export"),
    );
    assert_eq!(model_bytes.len(), ema_bytes.len());
    assert_ne!(model_bytes, ema_bytes);

    // Epoch 2 again from checkpoint 1: the EMA resumes where it was, so epoch 2 is the same.
    std::fs::remove_file(run_dir.join("checkpoint-2.ckpt")).expect("remove");
    std::fs::remove_file(&model_export).expect("remove");
    std::fs::remove_file(&ema_export).expect("remove");
    let output = run_ok(&mut command(&run_dir, &train_dir, &val_dir, true));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("resuming from"), "{stdout}");
    let resumed = ema_lines(&logs);
    assert_eq!(resumed.len(), 2, "{resumed:?}");
    for (ours, theirs) in resumed.iter().zip(&first) {
        assert!(
            (ours.1 - theirs.1).abs() <= 1e-5 * theirs.1.abs(),
            "EMA val loss {} after resume vs {} uninterrupted",
            ours.1,
            theirs.1
        );
        assert_eq!(ours.0, theirs.0);
    }
    assert!(ema_export.exists());

    // --test-only: the EMA with --model-ema (as torchvision), the model without.
    let test = |ema: bool| {
        test_line(&run_ok(
            command(&run_dir, &train_dir, &val_dir, ema).arg("--test-only"),
        ))
    };
    let metrics = read_metrics(&logs);
    let last = metrics.last().expect("epoch 2");
    let ema_line = test(true);
    assert!(
        ema_line.contains(&format!(
            "top-1 {:.2}%",
            100.0 * field(last, "val_accuracy_ema")
        )) && ema_line.contains(&format!("(loss {:.4})", field(last, "val_loss_ema")))
            && ema_line.contains("(EMA)"),
        "{ema_line} vs {last}"
    );
    let model_line = test(false);
    assert!(
        model_line.contains(&format!("(loss {:.4})", field(last, "val_loss"))),
        "{model_line} vs {last}"
    );
}
