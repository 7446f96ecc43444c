//! Kill -9 in the middle of epoch 2, start again: the run resumes from checkpoint 1 and its
//! epoch-2 and epoch-3 losses equal those of an uninterrupted run.

mod common;

use std::time::{Duration, Instant};

use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_train");

fn losses(log_dir: &std::path::Path) -> Vec<(u64, f64, f64)> {
    read_metrics(log_dir)
        .iter()
        .map(|m| {
            (
                m["epoch"].as_u64().expect("epoch"),
                field(m, "train_loss"),
                field(m, "val_loss"),
            )
        })
        .collect()
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-5 * a.abs().max(b.abs())
}

#[test]
fn killed_run_resumes_and_matches_an_uninterrupted_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 40, 6);
    let epochs = ["--epochs", "3", "--base-lr", "0.02"];

    let reference_dir = dir.path().join("reference");
    run_ok(train_command(EXE, &reference_dir, &train_dir, &val_dir).args(epochs));
    let reference = losses(&reference_dir.join("logs"));
    assert_eq!(reference.len(), 3);

    // The same run, killed at a random moment of epoch 2 (after checkpoint 1 is written).
    let run_dir = dir.path().join("killed");
    let first = ChildGuard::spawn(train_command(EXE, &run_dir, &train_dir, &val_dir).args(epochs));
    let checkpoint1 = run_dir.join("checkpoint-1.ckpt");
    let started = Instant::now();
    while !checkpoint1.exists() {
        assert!(
            started.elapsed() < RUN_LIMIT,
            "no checkpoint 1 after {RUN_LIMIT:?}:\n{}",
            first.stdout()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let epoch_time = started.elapsed();
    // The kill falls at a seeded fraction of epoch 2 (measured by epoch 1's length); a failure
    // prints the seed, and KILL_SEED=<seed> replays the same fraction.
    let seed = std::env::var("KILL_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) ^ started.elapsed().as_nanos() as u64);
    let fraction = 0.1 + 0.5 * ((seed % 1000) as f64 / 1000.0);
    println!(
        "kill seed {seed}: SIGKILL at {fraction:.3} of an epoch into epoch 2 (KILL_SEED={seed} replays it)"
    );
    std::thread::sleep(epoch_time.mul_f64(fraction));
    // SAFETY: kill(2) on the pid of our own child, which has not been reaped yet.
    unsafe { libc::kill(first.pid() as libc::pid_t, libc::SIGKILL) };
    let output = first.wait();
    assert!(
        !output.status.success(),
        "the run finished before it was killed (kill seed {seed})"
    );
    assert!(!run_dir.join("checkpoint-3.ckpt").exists());
    let before = losses(&run_dir.join("logs"));
    assert!(
        !before.is_empty() && before.len() < 3,
        "killed after {} epochs (kill seed {seed})",
        before.len()
    );

    // Checkpoint first, then log: the newest checkpoint may be one epoch ahead of the log when
    // the kill fell between the two.
    let resumed_at = (1..=3)
        .rev()
        .find(|e| run_dir.join(format!("checkpoint-{e}.ckpt")).exists())
        .expect("checkpoint 1 at least");
    let output = run_ok(train_command(EXE, &run_dir, &train_dir, &val_dir).args(epochs));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains(&format!(
            "resuming from {}",
            run_dir
                .join(format!("checkpoint-{resumed_at}.ckpt"))
                .display()
        )),
        "{stdout}"
    );

    let after = losses(&run_dir.join("logs"));
    assert_eq!(after.len(), 3, "{after:?}");
    for (epoch, (ours, theirs)) in after.iter().zip(&reference).enumerate() {
        assert_eq!(ours.0, theirs.0);
        assert!(
            close(ours.1, theirs.1),
            "epoch {}: train loss {} vs uninterrupted {}",
            epoch + 1,
            ours.1,
            theirs.1
        );
        assert!(
            close(ours.2, theirs.2),
            "epoch {}: val loss {} vs uninterrupted {}",
            epoch + 1,
            ours.2,
            theirs.2
        );
    }
}

#[test]
fn damaged_newest_checkpoint_falls_back_to_the_previous_one() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 8, 4);
    let run_dir = dir.path().join("run");
    run_ok(train_command(EXE, &run_dir, &train_dir, &val_dir).args(["--epochs", "2"]));
    let newest = run_dir.join("checkpoint-2.ckpt");
    let bytes = std::fs::read(&newest).expect("checkpoint 2");
    std::fs::write(&newest, &bytes[..bytes.len() * 2 / 3]).expect("truncate");

    let output = run_ok(train_command(EXE, &run_dir, &train_dir, &val_dir).args(["--epochs", "2"]));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("checkpoint-2.ckpt is damaged"), "{stdout}");
    assert!(
        stdout.contains("resuming from") && stdout.contains("checkpoint-1.ckpt"),
        "{stdout}"
    );
    // Epoch 2 was trained again, logged once (its first line dropped), and its checkpoint
    // rewritten whole.
    assert!(
        stdout.contains("removed 1 line(s) of epochs after 1"),
        "{stdout}"
    );
    let epochs: Vec<u64> = losses(&run_dir.join("logs")).iter().map(|l| l.0).collect();
    assert_eq!(epochs, vec![1, 2]);
    assert!(std::fs::read(&newest).expect("rewritten").len() >= bytes.len() - 64);
}
