//! torchvision's recipe end to end: `--recipe torchvision-resnet50-v2` (TrivialAugmentWide,
//! RandomErasing, the repeated-augmentation sampler, Mixup/CutMix, label smoothing, weight-decay
//! groups, linear warmup + cosine, EMA) with AdamW trains 2 processes on the quickstart's
//! synthetic JPEGs. The job is killed (SIGKILL to every process, as a lost node) in the middle of
//! its second epoch and started again: the resumed run's weights, EMA weights and metrics equal an
//! uninterrupted run's bit for bit, which they cannot unless AdamW's moments, its step count, the
//! EMA and its update counter all came back from the checkpoint.

mod common;

use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_train");
const EPOCHS: usize = 3;

/// The recipe, shrunk to a ResNet-18 at 32 px for 3 epochs, with AdamW instead of its SGD.
fn command(run_dir: &Path, train_dir: &Path, val_dir: &Path) -> Command {
    let mut command = Command::new(EXE);
    command
        .arg("--train-dir")
        .arg(train_dir)
        .arg("--val-dir")
        .arg(val_dir)
        .arg("--output-dir")
        .arg(run_dir)
        .args(["--recipe", "torchvision-resnet50-v2"])
        .args(["--model", "resnet18", "--image-size", "32"])
        .args(["--train-crop-size", "32", "--val-resize-size", "36"])
        .args(["--epochs", &EPOCHS.to_string(), "-b", "8", "-j", "1"])
        .args(["--val-batch-size", "16", "--device", "cpu"])
        .args(["--lr", "0.002", "--lr-warmup-epochs", "1"])
        .args(["--opt", "adamw", "--weight-decay", "0.05"])
        .args(["--model-ema-steps", "2", "--nproc-per-node", "2"])
        .args(["--master-port", &free_port().to_string()])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("BURN_DIST_JOB_TOKEN", job_token("train-test"))
        .env("BURN_DIST_TIMEOUT_S", "60")
        .stdin(std::process::Stdio::null());
    command
}

fn exports(run_dir: &Path) -> (Vec<u8>, Vec<u8>) {
    let read =
        |name: String| std::fs::read(run_dir.join(&name)).unwrap_or_else(|e| panic!("{name}: {e}"));
    (
        read(format!("checkpoint-{EPOCHS}.safetensors")),
        read(format!("checkpoint-{EPOCHS}_ema.safetensors")),
    )
}

#[test]
fn recipe_with_adamw_and_ema_on_two_processes_resumes_exactly_after_a_kill() {
    let dir = tempfile::tempdir().expect("temp dir");
    // 256 training images: the repeated-augmentation sampler, like torchvision's, keeps
    // len // 256 * 256 of them per epoch.
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 64, 8);

    let reference_dir = dir.path().join("reference");
    let output = run_ok(&mut command(&reference_dir, &train_dir, &val_dir));
    let stdout = String::from_utf8_lossy(&output.stdout);
    for shown in [
        "world size       2",
        "TrivialAugmentWide, erase 0.1, RASampler x4",
        "optimizer        adamw",
        "mixup α 0.2 or cutmix α 1",
        "label smoothing 0.1",
        "ema              every 2 steps",
    ] {
        assert!(stdout.contains(shown), "no {shown:?} in\n{stdout}");
    }
    let reference = metrics_without_timing(&reference_dir.join("logs"));
    assert_eq!(reference.len(), EPOCHS, "{reference:?}");
    let (reference_model, reference_ema) = exports(&reference_dir);
    assert_ne!(reference_model, reference_ema, "the EMA is not the model");

    // The same job, every process killed at a seeded moment of epoch 2.
    let run_dir = dir.path().join("killed");
    let first = ChildGuard::spawn(&mut command(&run_dir, &train_dir, &val_dir));
    let started = Instant::now();
    while !run_dir.join("checkpoint-1.ckpt").exists() {
        assert!(
            started.elapsed() < RUN_LIMIT,
            "no checkpoint 1 after {RUN_LIMIT:?}:\n{}",
            first.stdout()
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let seed = std::env::var("KILL_SEED")
        .ok()
        .and_then(|s| s.parse::<u64>().ok())
        .unwrap_or_else(|| u64::from(std::process::id()) ^ started.elapsed().as_nanos() as u64);
    let fraction = 0.1 + 0.6 * ((seed % 1000) as f64 / 1000.0);
    println!(
        "kill seed {seed}: SIGKILL to the job at {fraction:.3} of an epoch into epoch 2 \
         (KILL_SEED={seed} replays it)"
    );
    std::thread::sleep(started.elapsed().mul_f64(fraction));
    // SAFETY: kill(2) on the process group our unreaped child leads (its ranks are in it).
    unsafe { libc::kill(-(first.pid() as libc::pid_t), libc::SIGKILL) };
    let output = first.wait();
    assert!(
        !output.status.success(),
        "the job finished before it was killed (kill seed {seed})"
    );
    assert!(
        !run_dir.join(format!("checkpoint-{EPOCHS}.ckpt")).exists(),
        "killed after the last epoch (kill seed {seed})"
    );

    let output = run_ok(&mut command(&run_dir, &train_dir, &val_dir));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(stdout.contains("resuming from"), "{stdout}");
    for restart in ["optimizer state not restored", "holds no EMA"] {
        assert!(
            !stdout.contains(restart),
            "AdamW's state and the EMA must resume, not restart:\n{stdout}"
        );
    }

    let (model, ema) = exports(&run_dir);
    assert!(
        model == reference_model,
        "the resumed run's weights differ from the uninterrupted run's (kill seed {seed})"
    );
    assert!(
        ema == reference_ema,
        "the resumed run's EMA weights differ from the uninterrupted run's (kill seed {seed})"
    );
    assert_eq!(
        metrics_without_timing(&run_dir.join("logs")),
        reference,
        "metrics after the resume (kill seed {seed})"
    );
}
