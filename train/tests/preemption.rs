//! Preemption on 2 processes: `--checkpoint-every 3` writes checkpoints inside epochs, and a job
//! that stops in the middle of an epoch, by SIGKILL (a lost node) or by SIGTERM to the launcher
//! (a scheduler's notice), resumes from the step where its checkpoint stands:
//! - the final weights and every epoch's metrics equal an uninterrupted run's bit for bit;
//! - each rank trains on the same samples at the same steps, none skipped or seen twice
//!   (`TRAIN_TRACE_SAMPLES` records them);
//! - SIGTERM saves at the next step boundary and the launcher exits with code 75.
//!
//! The kills and the signal fall where a checkpoint file appears, not at a clock-drawn moment:
//! where after it the job dies does not change what a resume must produce.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_train");
const EPOCHS: usize = 3;
/// 4 classes × 40 images over 2 ranks at batch 8: 10 steps per epoch.
const STEPS_PER_EPOCH: usize = 10;

/// The job on 2 processes, or `regrouped` on 1 process × `--batches-per-allreduce 2` (the same
/// global batch and peak LR).
fn job(run_dir: &Path, data: &(PathBuf, PathBuf), trace_dir: &Path, regrouped: bool) -> Command {
    let mut command = train_command(EXE, run_dir, &data.0, &data.1);
    let world: &[&str] = if regrouped {
        &["--nproc-per-node", "1", "--batches-per-allreduce", "2"]
    } else {
        &["--nproc-per-node", "2"]
    };
    command
        .args(["--epochs", &EPOCHS.to_string(), "--base-lr", "0.02"])
        .args(world)
        .args(["--checkpoint-every", "3"])
        .env("TRAIN_TRACE_SAMPLES", trace_dir)
        // Time for a loaded machine to reach the next step and save after SIGTERM.
        .env("BURN_DIST_STOP_GRACE_S", "300");
    command
}

/// Each rank's trace: (epoch, step, sample index), in the order trained.
fn traces(trace_dir: &Path) -> [Vec<(usize, usize, usize)>; 2] {
    [0, 1].map(|rank| {
        let path = trace_dir.join(format!("rank{rank}.txt"));
        std::fs::read_to_string(&path)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()))
            .lines()
            .map(|line| {
                let n: Vec<usize> = line
                    .split(' ')
                    .map(|x| x.parse().expect("number"))
                    .collect();
                (n[0], n[1], n[2])
            })
            .collect()
    })
}

fn copy_dir(from: &Path, to: &Path) {
    std::fs::create_dir_all(to).expect("create copy");
    for entry in std::fs::read_dir(from).expect("read dir").flatten() {
        let target = to.join(entry.file_name());
        if entry.path().is_dir() {
            copy_dir(&entry.path(), &target);
        } else {
            std::fs::copy(entry.path(), &target).expect("copy");
        }
    }
}

fn wait_for(path: &Path, run: &ChildGuard) {
    let started = Instant::now();
    while !path.exists() {
        assert!(
            started.elapsed() < RUN_LIMIT,
            "no {} after {RUN_LIMIT:?}:\n{}",
            path.display(),
            run.stdout()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// "resuming from <path> (epoch E, step K: ...)": (E − 1, K), the position as completed epochs
/// and steps into the next one.
fn resumed_at(stdout: &str) -> (usize, usize) {
    let line = stdout
        .lines()
        .find(|l| l.contains("resuming from"))
        .unwrap_or_else(|| panic!("no resume line in\n{stdout}"));
    let after = |key: &str| -> usize {
        let rest = &line[line
            .find(key)
            .unwrap_or_else(|| panic!("{key:?} in {line}"))
            + key.len()..];
        rest.chars()
            .take_while(char::is_ascii_digit)
            .collect::<String>()
            .parse()
            .unwrap_or_else(|_| panic!("a number after {key:?} in {line}"))
    };
    (after("(epoch ") - 1, after(", step "))
}

struct Reference {
    weights: Vec<u8>,
    metrics: Vec<serde_json::Value>,
    traces: [Vec<(usize, usize, usize)>; 2],
}

/// How close a resumed run must come to the uninterrupted one.
#[derive(Clone, Copy, PartialEq)]
enum Expect {
    /// Bit for bit: the checkpoint stands at a step where the uninterrupted run also saved.
    Exact,
    /// A signal saved at a step the uninterrupted run did not, averaging the BatchNorm running
    /// statistics there (as every mid-epoch save does): the weights and the training figures are
    /// still bit for bit, the running statistics and the validation figures equal to rounding.
    RunningStatsRounded,
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn assert_same_weights(what: &str, got: &[u8], want: &[u8], expect: Expect) {
    if expect == Expect::Exact {
        assert!(
            got == want,
            "{what}: the final weights differ from the uninterrupted run's"
        );
        return;
    }
    let got = safetensors::SafeTensors::deserialize(got).expect("parse the export");
    let want = safetensors::SafeTensors::deserialize(want).expect("parse the reference");
    let mut names = want.names();
    names.sort();
    assert_eq!(got.names().len(), names.len(), "{what}: tensor count");
    for name in names {
        let (a, b) = (
            got.tensor(name).expect("tensor"),
            want.tensor(name).expect("tensor"),
        );
        if name.contains("running_") {
            let (a, b) = (f32s(a.data()), f32s(b.data()));
            let norm: f64 = b.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
            let diff: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (f64::from(*x) - f64::from(*y)).powi(2))
                .sum::<f64>()
                .sqrt();
            assert!(
                diff <= 1e-5 * norm.max(1e-12),
                "{what}: {name} differs beyond rounding ({diff:e} of {norm:e})"
            );
        } else {
            assert!(
                a.data() == b.data(),
                "{what}: {name} differs from the uninterrupted run's"
            );
        }
    }
}

/// The resumed job in `run_dir` ended where the uninterrupted one did, and the samples of the
/// stopped run up to its checkpoint plus the resumed run's are the reference's.
fn assert_resumed_exactly(
    what: &str,
    reference: &Reference,
    run_dir: &Path,
    stopped_trace: &Path,
    resumed_trace: &Path,
    (epochs, steps): (usize, usize),
    expect: Expect,
) {
    let weights = std::fs::read(run_dir.join(format!("checkpoint-{EPOCHS}.safetensors")))
        .expect("final weights");
    assert_same_weights(what, &weights, &reference.weights, expect);
    let metrics = metrics_without_timing(&run_dir.join("logs"));
    if expect == Expect::Exact {
        assert_eq!(metrics, reference.metrics, "{what}: metrics");
    } else {
        assert_eq!(metrics.len(), reference.metrics.len(), "{what}: epochs");
        for (got, want) in metrics.iter().zip(&reference.metrics) {
            for (name, value) in want.as_object().expect("object") {
                let close = match (value.as_f64(), got[name].as_f64()) {
                    // Validation sees the running statistics: equal to rounding (one image's
                    // prediction may flip at a tie).
                    (Some(w), Some(g)) if name.starts_with("val_") => {
                        let tolerance = if name.contains("accuracy") {
                            1.0 / field(want, "val_images")
                        } else {
                            1e-4 * w.abs().max(1e-9)
                        };
                        (w - g).abs() <= tolerance
                    }
                    _ => got[name] == *value,
                };
                assert!(close, "{what}: {name} {} against {value}", got[name]);
            }
        }
    }
    let before = traces(stopped_trace);
    let after = traces(resumed_trace);
    for rank in 0..2 {
        let mut trained: Vec<_> = before[rank]
            .iter()
            .copied()
            .filter(|&(e, s, _)| e < epochs || (e == epochs && s < steps))
            .collect();
        assert_eq!(
            after[rank].first().map(|&(e, s, _)| (e, s)),
            Some((epochs, steps)),
            "{what}: rank {rank} resumed elsewhere"
        );
        trained.extend(after[rank].iter().copied());
        assert!(
            trained == reference.traces[rank],
            "{what}: rank {rank} trained on other samples or at other steps than the \
             uninterrupted run ({} samples against {})",
            trained.len(),
            reference.traces[rank].len()
        );
    }
}

#[test]
fn a_job_stopped_mid_epoch_by_sigkill_or_sigterm_resumes_from_its_step_exactly() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = small_dataset(&dir.path().join("data"), 40, 6);
    let trace = |name: &str| dir.path().join("traces").join(name);

    let reference_dir = dir.path().join("reference");
    run_ok(&mut job(&reference_dir, &data, &trace("reference"), false));
    let reference = Reference {
        weights: std::fs::read(reference_dir.join(format!("checkpoint-{EPOCHS}.safetensors")))
            .expect("reference weights"),
        metrics: metrics_without_timing(&reference_dir.join("logs")),
        traces: traces(&trace("reference")),
    };
    assert_eq!(reference.metrics.len(), EPOCHS);
    for rank in 0..2 {
        // Every sample of the rank's shard once per epoch (80 per rank), at 8 per step.
        assert_eq!(reference.traces[rank].len(), EPOCHS * STEPS_PER_EPOCH * 8);
    }
    // The last mid-epoch checkpoint is kept, the ones before the one before it are pruned, and
    // epoch ends are never written twice under a step name.
    let kept: Vec<String> = std::fs::read_dir(&reference_dir)
        .expect("run dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.ends_with(".ckpt"))
        .collect();
    assert!(
        kept.iter().any(|n| n == "checkpoint-2-step7.ckpt"),
        "global step 27 of 30 is epoch 3's step 7: {kept:?}"
    );
    assert!(
        !kept.iter().any(|n| n == "checkpoint-0-step3.ckpt"),
        "old step checkpoints are pruned: {kept:?}"
    );

    // SIGKILL to every process right after the first step checkpoint of epoch 2 (global step 12).
    let killed_dir = dir.path().join("killed");
    let first = ChildGuard::spawn(&mut job(&killed_dir, &data, &trace("killed"), false));
    wait_for(&killed_dir.join("checkpoint-1-step2.ckpt"), &first);
    // SAFETY: kill(2) on the process group our unreaped child leads (its ranks are in it).
    unsafe { libc::kill(-(first.pid() as libc::pid_t), libc::SIGKILL) };
    let output = first.wait();
    assert!(!output.status.success(), "the job finished before the kill");
    // A copy of the stopped job resumes on 1 process × --batches-per-allreduce 2 below.
    let regrouped_dir = dir.path().join("regrouped");
    copy_dir(&killed_dir, &regrouped_dir);
    let output = run_ok(&mut job(
        &killed_dir,
        &data,
        &trace("killed-resumed"),
        false,
    ));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let at = resumed_at(&stdout);
    assert!(
        at.0 == 1 && at.1 >= 2 && at.1 < STEPS_PER_EPOCH,
        "resumes inside epoch 2: {at:?}\n{stdout}"
    );
    assert_resumed_exactly(
        "after SIGKILL",
        &reference,
        &killed_dir,
        &trace("killed"),
        &trace("killed-resumed"),
        at,
        Expect::Exact,
    );

    // The same global batch and peak LR on another world size: resumed without
    // --resume-anyway, at the same sample of the epoch, so that every step trains on the samples
    // the 2-process run's step did (their gradients are summed in another order: no bitwise
    // comparison of weights here).
    let output = run_ok(&mut job(
        &regrouped_dir,
        &data,
        &trace("regrouped-resumed"),
        true,
    ));
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        stdout.contains("world size"),
        "the change is reported:\n{stdout}"
    );
    let at = resumed_at(&stdout);
    let step_sets = |lines: &mut dyn Iterator<Item = (usize, usize, usize)>| {
        let mut sets = std::collections::BTreeMap::<(usize, usize), Vec<usize>>::new();
        for (e, s, i) in lines {
            sets.entry((e, s)).or_default().push(i);
        }
        sets.values_mut().for_each(|v| v.sort_unstable());
        sets
    };
    let reference_sets = step_sets(&mut reference.traces.iter().flatten().copied());
    let before = traces(&trace("killed"));
    let mut trained = before
        .iter()
        .flatten()
        .copied()
        .filter(|&(e, s, _)| e < at.0 || (e == at.0 && s < at.1));
    let after = std::fs::read_to_string(trace("regrouped-resumed").join("rank0.txt"))
        .expect("regrouped trace");
    let mut after_lines = after.lines().map(|line| {
        let n: Vec<usize> = line
            .split(' ')
            .map(|x| x.parse().expect("number"))
            .collect();
        (n[0], n[1], n[2])
    });
    let mut all = trained.by_ref().chain(after_lines.by_ref());
    assert!(
        step_sets(&mut all) == reference_sets,
        "regrouped onto 1 process: a step trained on other samples than the 2-process run's"
    );

    // SIGTERM to the launcher alone once epoch 2 runs: it passes the signal on, every rank stops
    // at the same next step, rank 0 saves there, and the launcher exits 75.
    let stopped_dir = dir.path().join("signalled");
    let first = ChildGuard::spawn(&mut job(&stopped_dir, &data, &trace("signalled"), false));
    wait_for(&stopped_dir.join("checkpoint-1.ckpt"), &first);
    // SAFETY: kill(2) on the pid of our own, not yet reaped, child.
    unsafe { libc::kill(first.pid() as libc::pid_t, libc::SIGTERM) };
    let output = first.wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert_eq!(
        output.status.code(),
        Some(75),
        "a saved stop exits 75\nstdout:\n{}\nstderr:\n{stderr}",
        String::from_utf8_lossy(&output.stdout)
    );
    assert!(
        stderr.contains("interrupted by signal 15; every rank exited with code 75"),
        "{stderr}"
    );
    let output = run_ok(&mut job(
        &stopped_dir,
        &data,
        &trace("signalled-resumed"),
        false,
    ));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let at = resumed_at(&stdout);
    assert!(
        (at.0 == 1 || at.0 == 2) && at.1 >= 1,
        "the stop saved inside an epoch after the first: {at:?}\n{stdout}"
    );
    assert_resumed_exactly(
        "after SIGTERM",
        &reference,
        &stopped_dir,
        &trace("signalled"),
        &trace("signalled-resumed"),
        at,
        // Unless the signal fell on a planned step (every 3rd of the run).
        if (at.0 * STEPS_PER_EPOCH + at.1).is_multiple_of(3) {
            Expect::Exact
        } else {
            Expect::RunningStatsRounded
        },
    );
}

/// torchrun from `BURN_DIST_TORCHRUN` or the `PATH`.
fn torchrun() -> Option<PathBuf> {
    if let Some(path) = std::env::var_os("BURN_DIST_TORCHRUN") {
        return Some(PathBuf::from(path));
    }
    std::env::split_paths(&std::env::var_os("PATH")?)
        .map(|dir| dir.join("torchrun"))
        .find(|p| p.is_file())
}

/// SIGTERM to every process of a torchrun job at once, as SLURM delivers it (the agent passes
/// it on too: each worker gets it twice, one request): both workers save at the same next step
/// and exit 75 before the agent's deadline, and the same torchrun command resumes there and
/// ends where an uninterrupted torchrun job does. (torchrun's own exit code after a signal is
/// its own, not the workers'.)
#[test]
#[ignore = "needs torchrun on PATH (pip install torch) or BURN_DIST_TORCHRUN=/path/to/torchrun"]
fn under_a_real_torchrun_sigterm_saves_mid_epoch_and_the_job_resumes_there() {
    let torchrun = torchrun().expect(
        "torchrun not found: pip install torch, or set BURN_DIST_TORCHRUN=/path/to/torchrun",
    );
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 40, 6);
    let trace = |name: &str| dir.path().join("traces").join(name);
    let command = |run_dir: &Path, trace_dir: &Path| {
        let mut command = Command::new(&torchrun);
        command
            .args(["--nproc-per-node", "2", "--master-addr", "127.0.0.1"])
            .args(["--master-port", &free_port().to_string()])
            .args(["--rdzv-id", &job_token("train-torchrun")])
            .arg("--no-python")
            .arg(EXE)
            .args(small_run_args(
                &train_dir,
                &val_dir,
                &run_dir.join("logs"),
                &run_dir.join("checkpoint-{epoch}.ckpt"),
                0.0,
            ))
            .args(["--epochs", &EPOCHS.to_string(), "--base-lr", "0.02"])
            .args(["--checkpoint-every", "3"])
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .env("BURN_DIST_TIMEOUT_S", "60")
            .env("TRAIN_TRACE_SAMPLES", trace_dir)
            .stdin(std::process::Stdio::null());
        command
    };
    let reference_dir = dir.path().join("reference");
    run_ok(&mut command(&reference_dir, &trace("reference")));
    let reference = Reference {
        weights: std::fs::read(reference_dir.join(format!("checkpoint-{EPOCHS}.safetensors")))
            .expect("reference weights"),
        metrics: metrics_without_timing(&reference_dir.join("logs")),
        traces: traces(&trace("reference")),
    };

    let run_dir = dir.path().join("run");
    let first = ChildGuard::spawn(&mut command(&run_dir, &trace("stopped")));
    wait_for(&run_dir.join("checkpoint-1.ckpt"), &first);
    // SAFETY: kill(2) on the process group our unreaped child (torchrun's agent) leads; its
    // workers are in it.
    unsafe { libc::kill(-(first.pid() as libc::pid_t), libc::SIGTERM) };
    let output = first.wait();
    let text = format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !output.status.success(),
        "torchrun reports the stop:\n{text}"
    );
    assert!(
        text.contains("stopped by a signal after writing"),
        "the workers saved before they exited:\n{text}"
    );
    let output = run_ok(&mut command(&run_dir, &trace("resumed")));
    let stdout = String::from_utf8_lossy(&output.stdout);
    let at = resumed_at(&stdout);
    assert!(
        at.0 >= 1 && at.1 >= 1,
        "resumed inside an epoch after the first: {stdout}"
    );
    assert_resumed_exactly(
        "under torchrun",
        &reference,
        &run_dir,
        &trace("stopped"),
        &trace("resumed"),
        at,
        if (at.0 * STEPS_PER_EPOCH + at.1).is_multiple_of(3) {
            Expect::Exact
        } else {
            Expect::RunningStatsRounded
        },
    );
}
