//! `--batches-per-allreduce 2` through the binary: one process accumulating two passes per
//! optimizer step trains exactly like two processes of one pass each, when the passes are the
//! same images. With `--batch-size 1` they are: rank r of 2 takes sample 2s + r of the shuffled
//! epoch at step s, and the single process takes samples 2s and 2s + 1 as its two passes, and
//! BatchNorm normalises each image alone in both jobs. Same samples per step, same peak rate
//! (Horovod's base · world · batches_per_allreduce), and the same weights up to the order of one
//! float sum. A pass counted twice, a sum where a mean belongs, a pass dropped, an unscaled rate
//! or a sampler that moves with the accumulation each fail it.
//!
//! It also holds the start to the same weights: before `draw_parameters`, Burn's lazy
//! initialisation drew one process's weights in another order than the broadcast of a
//! two-process job, so the same `--seed` gave other weights at another world size.
//!
//! Why not against a doubled batch (`--batch-size 2` in one pass): BatchNorm then normalises the
//! two images together, which changes the gradient as much as the gradient itself at the start of
//! training (measured 2026-12-04 on this data, one step: the update of 8 × 2 passes against 16 × 1
//! differs by 1.2–1.5 of its norm at 32–128 px, while a 1% change of the rate moves it by 1%).
//! `tests/equivalence.rs` compares against a doubled batch with a BatchNorm-free model.

mod common;

use std::collections::BTreeMap;
use std::path::Path;

use common::*;
use safetensors::{Dtype, SafeTensors};

const EXE: &str = env!("CARGO_BIN_EXE_train");
const BASE_LR: f64 = 0.005;
const STEPS: usize = 3;

/// What a finished job left: its exported weights by name (running statistics left out), its
/// stdout, and the samples of each step over every rank, sorted.
struct Job {
    weights: BTreeMap<String, Vec<f32>>,
    stdout: String,
    steps: BTreeMap<usize, Vec<usize>>,
}

/// The parameters of `run_dir`'s exported `checkpoint-1.safetensors`, without BatchNorm's running
/// statistics (they follow the batch statistics, not the update).
fn read_weights(run_dir: &Path) -> BTreeMap<String, Vec<f32>> {
    let bytes = std::fs::read(run_dir.join("checkpoint-1.safetensors")).expect("exported weights");
    let file = SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut weights = BTreeMap::new();
    for (name, view) in file.tensors() {
        if name.contains("running_") || name.contains("num_batches") {
            continue;
        }
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let values = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        weights.insert(name, values);
    }
    weights
}

/// A job of `nproc` processes × `bpa` passes of one image at 64 px (ResNet-18's last stage is
/// then 2 × 2, so BatchNorm over one image has a variance), `STEPS` optimizer steps.
fn run(
    dir: &Path,
    name: &str,
    data: &(std::path::PathBuf, std::path::PathBuf),
    nproc: usize,
    bpa: usize,
) -> Job {
    let run_dir = dir.join(name);
    let trace = run_dir.join("trace");
    let template = train_command(EXE, &run_dir, &data.0, &data.1);
    // `train_command` passes --batch-size 8 and --image-size 32; clap refuses a flag given
    // twice, so rewrite the values in place (its environment is set again below).
    let mut args: Vec<std::ffi::OsString> = template.get_args().map(|a| a.to_owned()).collect();
    for (flag, value) in [("--batch-size", "1"), ("--image-size", "64")] {
        let at = args
            .iter()
            .position(|a| a == flag)
            .unwrap_or_else(|| panic!("train_command passes {flag}"));
        args[at + 1] = value.into();
    }
    let mut command = std::process::Command::new(EXE);
    command
        .args(args)
        .args([
            "--epochs",
            "1",
            "--max-steps-per-epoch",
            &STEPS.to_string(),
            "--base-lr",
            &BASE_LR.to_string(),
            "--batches-per-allreduce",
            &bpa.to_string(),
            "--nproc-per-node",
            &nproc.to_string(),
        ])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("BURN_DIST_JOB_TOKEN", job_token("train-accumulation"))
        .env("BURN_DIST_TIMEOUT_S", "60")
        .env("TRAIN_TRACE_SAMPLES", &trace)
        .stdin(std::process::Stdio::null());
    let output = run_ok(&mut command);

    let mut steps: BTreeMap<usize, Vec<usize>> = BTreeMap::new();
    for rank in 0..nproc {
        let text = std::fs::read_to_string(trace.join(format!("rank{rank}.txt")))
            .unwrap_or_else(|e| panic!("rank {rank}'s sample trace: {e}"));
        for line in text.lines() {
            let n: Vec<usize> = line
                .split_whitespace()
                .map(|x| x.parse().expect("a number"))
                .collect();
            steps.entry(n[1]).or_default().push(n[2]);
        }
    }
    for samples in steps.values_mut() {
        samples.sort_unstable();
    }
    Job {
        weights: read_weights(&run_dir),
        stdout: String::from_utf8_lossy(&output.stdout).into_owned(),
        steps,
    }
}

/// `after − before` over every parameter, in name order.
fn update(after: &BTreeMap<String, Vec<f32>>, before: &BTreeMap<String, Vec<f32>>) -> Vec<f64> {
    assert_eq!(
        after.keys().collect::<Vec<_>>(),
        before.keys().collect::<Vec<_>>()
    );
    after
        .iter()
        .flat_map(|(name, a)| {
            a.iter()
                .zip(&before[name])
                .map(|(a, b)| f64::from(*a) - f64::from(*b))
        })
        .collect()
}

fn norm(v: &[f64]) -> f64 {
    v.iter().map(|x| x * x).sum::<f64>().sqrt()
}

#[test]
fn two_passes_per_allreduce_train_like_two_processes_on_the_same_images() {
    let dir = tempfile::tempdir().expect("temp dir");
    let data = small_dataset(&dir.path().join("data"), 4, 2);

    // The starting weights: one process, one pass, one step at a rate no f32 weight moves by
    // (0 is refused; weight decay is scaled by the rate too).
    let start_dir = dir.path().join("start");
    run_ok(train_command(EXE, &start_dir, &data.0, &data.1).args([
        "--epochs",
        "1",
        "--max-steps-per-epoch",
        "1",
        "--base-lr",
        "1e-30",
    ]));
    let start = read_weights(&start_dir);

    let two_procs = run(dir.path(), "world2", &data, 2, 1);
    let accumulated = run(dir.path(), "bpa2", &data, 1, 2);

    assert!(
        accumulated
            .stdout
            .contains("1 per process x 2 per allreduce = 2 global"),
        "{}",
        accumulated.stdout
    );
    assert!(
        two_procs
            .stdout
            .contains("1 per process x 1 per allreduce = 2 global"),
        "{}",
        two_procs.stdout
    );
    for job in [&two_procs, &accumulated] {
        assert!(job.stdout.contains("-> peak 0.01 "), "{}", job.stdout);
    }
    assert_eq!(accumulated.steps.len(), STEPS, "{:?}", accumulated.steps);
    assert!(accumulated.steps.values().all(|s| s.len() == 2));
    assert_eq!(
        accumulated.steps, two_procs.steps,
        "each optimizer step trains on the same two samples"
    );

    let two = update(&two_procs.weights, &start);
    let acc = update(&accumulated.weights, &start);
    let diff: Vec<f64> = two.iter().zip(&acc).map(|(a, b)| a - b).collect();
    let relative = norm(&diff) / norm(&two);
    eprintln!(
        "update norms: 2 processes {:.4e}, 1 process x 2 passes {:.4e}, relative difference \
         {relative:.3e}",
        norm(&two),
        norm(&acc)
    );
    assert!(norm(&two) > 1e-4, "the runs trained ({:e})", norm(&two));
    // Bitwise equal when written (2026-12-04); the allowance is for a ring that one day sums the
    // two gradients in another order than the accumulation (rounding, amplified by three steps).
    assert!(relative < 1e-5, "relative difference {relative:e}");
}
