//! The edges that used to go wrong silently: validation classes named differently, a resume with
//! another world size, an epoch checkpointed but not logged when the run died.

mod common;

use common::*;
use train::tensorboard::{read_scalars, read_session_starts};

const EXE: &str = env!("CARGO_BIN_EXE_train");

fn epochs_logged(run_dir: &std::path::Path) -> Vec<u64> {
    read_metrics(&run_dir.join("logs"))
        .iter()
        .map(|m| m["epoch"].as_u64().expect("epoch"))
        .collect()
}

#[test]
fn validation_classes_must_have_the_training_classes_names() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 2, 2);
    // Same number of classes, one of them named differently.
    std::fs::rename(val_dir.join("class_003"), val_dir.join("class_xyz")).expect("rename");
    let run_dir = dir.path().join("run");
    let output = ChildGuard::spawn(&mut train_command(EXE, &run_dir, &train_dir, &val_dir)).wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("only in the training folder: class_003")
            && stderr.contains("only in the validation folder: class_xyz"),
        "{stderr}"
    );
    assert!(!run_dir.join("checkpoint-1.ckpt").exists());
}

#[test]
fn resume_with_another_world_size_is_refused_unless_asked_and_rank_0_alone_speaks() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 8, 2);
    let run_dir = dir.path().join("run");
    let command = |extra: &[&str]| {
        let mut c = train_command(EXE, &run_dir, &train_dir, &val_dir);
        c.args(["--keep-checkpoints", "2"]).args(extra);
        c
    };
    run_ok(&mut command(&["--epochs", "1"]));

    let output =
        ChildGuard::spawn(&mut command(&["--epochs", "3", "--nproc-per-node", "2"])).wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{stderr}");
    assert!(
        stderr.contains("world size 1 -> 2, global batch 8 -> 16")
            && stderr.contains("--resume-anyway"),
        "{stderr}"
    );
    assert!(!run_dir.join("checkpoint-2.ckpt").exists());
    assert_eq!(epochs_logged(&run_dir), vec![1]);

    let output = run_ok(&mut command(&[
        "--epochs",
        "3",
        "--nproc-per-node",
        "2",
        "--resume-anyway",
    ]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(
            "resuming with changed settings (--resume-anyway): world size 1 -> 2, global batch 8 -> 16"
        ),
        "{stdout}"
    );
    assert_eq!(epochs_logged(&run_dir), vec![1, 2, 3]);
    // Job-level lines come from rank 0 only.
    for line in ["resuming from", "world size       2", "done: resnet18"] {
        assert_eq!(stdout.matches(line).count(), 1, "{line:?} in\n{stdout}");
    }
    // --keep-checkpoints 2: the oldest went once the newest read back whole.
    assert!(!run_dir.join("checkpoint-1.ckpt").exists());
    assert!(
        run_dir.join("checkpoint-2.ckpt").exists() && run_dir.join("checkpoint-3.ckpt").exists()
    );
    assert!(run_dir.join("checkpoint-3.safetensors").exists());
}

#[test]
fn an_epoch_checkpointed_but_not_logged_is_restored_on_resume() {
    let dir = tempfile::tempdir().expect("temp dir");
    // 4 classes x 8 images at batch 8: 4 steps per epoch.
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 8, 2);
    let run_dir = dir.path().join("run");
    run_ok(train_command(EXE, &run_dir, &train_dir, &val_dir).args([
        "--label-smoothing",
        "0.1",
        "--lr-schedule",
        "cosine",
        "--epochs",
        "3",
        "--max-steps-per-epoch",
        "4",
    ]));
    // That ran 3 epochs; drop checkpoint 3 and epoch 3's line (a run that died after checkpoint
    // 2), then epoch 2's line too: the run died between checkpoint 2 and its log.
    let log_dir = run_dir.join("logs");
    let metrics_path = log_dir.join("metrics.jsonl");
    let lines: Vec<String> = std::fs::read_to_string(&metrics_path)
        .expect("metrics")
        .lines()
        .map(str::to_string)
        .collect();
    assert_eq!(lines.len(), 3);
    std::fs::remove_file(run_dir.join("checkpoint-3.ckpt")).expect("rm");
    std::fs::write(&metrics_path, format!("{}\n", lines[0])).expect("write");
    let old_events: Vec<_> = std::fs::read_dir(&log_dir)
        .expect("ls")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_none_or(|x| x != "jsonl"))
        .collect();
    // A fresh run's event file starts with the restart marker at step 0.
    assert_eq!(old_events.len(), 1, "{old_events:?}");
    assert_eq!(read_session_starts(&old_events[0]).expect("read"), vec![0]);

    let output = run_ok(train_command(EXE, &run_dir, &train_dir, &val_dir).args([
        "--label-smoothing",
        "0.1",
        "--lr-schedule",
        "cosine",
        "--epochs",
        "3",
        "--max-steps-per-epoch",
        "4",
    ]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("restored epoch(s) [2]"), "{stdout}");
    assert_eq!(epochs_logged(&run_dir), vec![1, 2, 3]);
    let repaired: Vec<String> = std::fs::read_to_string(&metrics_path)
        .expect("metrics")
        .lines()
        .map(str::to_string)
        .collect();
    let parse = |l: &str| serde_json::from_str::<serde_json::Value>(l).expect("json");
    assert_eq!(
        parse(&repaired[1]),
        parse(&lines[1]),
        "epoch 2 as it was trained"
    );

    // The new event file: the purge marker at the first step of epoch 3 (2 x 4 + 1), epoch 2's
    // scalars restored, then epoch 3's.
    let new_events = std::fs::read_dir(&log_dir)
        .expect("ls")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| {
            !old_events.contains(p)
                && p.file_name()
                    .and_then(|n| n.to_str())
                    .is_some_and(|n| n.starts_with("events.out.tfevents."))
        })
        .expect("a new event file");
    assert_eq!(read_session_starts(&new_events).expect("read"), vec![9]);
    let steps: Vec<i64> = read_scalars(&new_events)
        .expect("read")
        .iter()
        .filter(|s| s.tag == "val/accuracy_top5")
        .map(|s| s.step)
        .collect();
    assert_eq!(steps, vec![1, 2]);
}
