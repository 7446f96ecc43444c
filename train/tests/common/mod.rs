//! Helpers for tests that run the real `train` binary on a small generated dataset.
#![allow(dead_code)]

use std::fs::File;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

use data::synthetic::{SyntheticConfig, generate};

#[path = "../../../burn-dist/tests/common/ports.rs"]
mod ports;
// Not every test binary that includes this module uses both.
#[allow(unused_imports)]
pub use ports::{free_port, job_token};

/// A small learnable dataset: 4 classes of small JPEGs.
pub fn small_dataset(
    root: &Path,
    train_per_class: usize,
    val_per_class: usize,
) -> (PathBuf, PathBuf) {
    let summary = generate(
        root,
        &SyntheticConfig {
            classes: 4,
            train_per_class,
            val_per_class,
            min_side: 40,
            max_side: 72,
            quality: 90,
            seed: 3,
        },
    )
    .expect("synthetic dataset");
    (summary.train_dir, summary.val_dir)
}

/// `train` on the CPU with a tiny ResNet-18 at 32 px, batch 8, no warmup, logs and checkpoints
/// under `run_dir`.
pub fn train_command(exe: &str, run_dir: &Path, train_dir: &Path, val_dir: &Path) -> Command {
    train_command_with_warmup(exe, run_dir, train_dir, val_dir, 0.0)
}

/// [`train_command`] with `--warmup-epochs warmup_epochs`.
pub fn train_command_with_warmup(
    exe: &str,
    run_dir: &Path,
    train_dir: &Path,
    val_dir: &Path,
    warmup_epochs: f64,
) -> Command {
    let mut command = Command::new(exe);
    command
        .args(small_run_args(
            train_dir,
            val_dir,
            &run_dir.join("logs"),
            &run_dir.join("checkpoint-{epoch}.ckpt"),
            warmup_epochs,
        ))
        .args(["--master-port", &free_port().to_string()])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("BURN_DIST_JOB_TOKEN", job_token("train-test"))
        .env("BURN_DIST_TIMEOUT_S", "60")
        .stdin(Stdio::null());
    command
}

/// The flags of a small CPU run: a tiny ResNet-18 at 32 px, batch 8, one decode worker, data
/// from `train_dir`/`val_dir`, logs in `log_dir`, checkpoints named by `checkpoint_format`.
pub fn small_run_args(
    train_dir: &Path,
    val_dir: &Path,
    log_dir: &Path,
    checkpoint_format: &Path,
    warmup_epochs: f64,
) -> Vec<std::ffi::OsString> {
    let mut args: Vec<std::ffi::OsString> = Vec::new();
    for (flag, path) in [
        ("--train-dir", train_dir),
        ("--val-dir", val_dir),
        ("--log-dir", log_dir),
        ("--checkpoint-format", checkpoint_format),
    ] {
        args.push(flag.into());
        args.push(path.into());
    }
    let warmup = warmup_epochs.to_string();
    for flag in [
        "--model",
        "resnet18",
        "--image-size",
        "32",
        "--batch-size",
        "8",
        "--val-batch-size",
        "16",
        "--workers",
        "1",
        "--no-cuda",
        "--warmup-epochs",
        &warmup,
    ] {
        args.push(flag.into());
    }
    args
}

/// `metrics.jsonl` without the fields that measure time.
pub fn metrics_without_timing(log_dir: &Path) -> Vec<serde_json::Value> {
    read_metrics(log_dir)
        .into_iter()
        .map(|mut line| {
            if let Some(fields) = line.as_object_mut() {
                fields.retain(|name, _| !name.contains("per_sec"));
            }
            line
        })
        .collect()
}

/// How long one `train` run of these tests may take before it counts as hung: the runs take
/// seconds to a minute alone; the bound allows for a loaded 2-core machine running several test
/// binaries' processes at once, and for the 60 s collective deadline set by [`train_command`].
pub const RUN_LIMIT: Duration = Duration::from_secs(600);

/// A child in a process group of its own (the launcher's workers join it), output to files.
/// Dropping it kills the whole group, so that no test leaves a process behind, even when it
/// fails or panics.
pub struct ChildGuard {
    child: Option<Child>,
    out: PathBuf,
    err: PathBuf,
    _dir: tempfile::TempDir,
}

impl ChildGuard {
    pub fn spawn(command: &mut Command) -> Self {
        let dir = tempfile::tempdir().expect("temp dir for output");
        let (out, err) = (dir.path().join("stdout"), dir.path().join("stderr"));
        // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
        // is async-signal-safe.
        unsafe {
            command.pre_exec(|| {
                // If this test process dies (killed by CI), the child dies with it.
                libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
                Ok(())
            });
        }
        let child = command
            .process_group(0)
            .stdout(Stdio::from(File::create(&out).expect("stdout file")))
            .stderr(Stdio::from(File::create(&err).expect("stderr file")))
            .spawn()
            .expect("spawn train");
        Self {
            child: Some(child),
            out,
            err,
            _dir: dir,
        }
    }

    pub fn pid(&self) -> u32 {
        self.child.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    /// The output so far.
    pub fn stdout(&self) -> String {
        std::fs::read_to_string(&self.out).unwrap_or_default()
    }

    /// Waits at most `limit`; past it, kills the group and fails with what the run printed.
    pub fn wait_at_most(mut self, limit: Duration) -> Output {
        let started = Instant::now();
        let mut child = self.child.take().expect("child");
        let status = loop {
            if let Some(status) = child.try_wait().expect("try_wait") {
                break status;
            }
            if started.elapsed() > limit {
                kill_group(&mut child);
                panic!(
                    "train did not finish within {limit:?}; killed its process group\n\
                     stdout:\n{}\nstderr:\n{}",
                    self.stdout(),
                    std::fs::read_to_string(&self.err).unwrap_or_default()
                );
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        // Workers a launcher left behind go with the group.
        kill_group(&mut child);
        Output {
            status,
            stdout: std::fs::read(&self.out).unwrap_or_default(),
            stderr: std::fs::read(&self.err).unwrap_or_default(),
        }
    }

    /// [`ChildGuard::wait_at_most`] [`RUN_LIMIT`].
    pub fn wait(self) -> Output {
        self.wait_at_most(RUN_LIMIT)
    }
}

/// SIGKILL to the child's process group (the child leads it), then reaps the child.
fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) with a negative pid signals the process group the child leads; the child
    // is not reaped yet, so its pid (the group id) has not been reused.
    unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
    let _ = child.wait();
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            kill_group(&mut child);
        }
    }
}

/// Runs to completion (within [`RUN_LIMIT`]) and insists on success, showing the output otherwise.
pub fn run_ok(command: &mut Command) -> Output {
    let output = ChildGuard::spawn(command).wait();
    assert!(
        output.status.success(),
        "train failed ({:?})\nstdout:\n{}\nstderr:\n{}",
        output.status,
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    output
}

/// The per-epoch lines of `metrics.jsonl`.
pub fn read_metrics(log_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(log_dir.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|line| serde_json::from_str(line).expect("json line"))
        .collect()
}

pub fn field(metrics: &serde_json::Value, name: &str) -> f64 {
    metrics[name]
        .as_f64()
        .unwrap_or_else(|| panic!("{name} in {metrics}"))
}

/// This crate's folder in the checkout under test. Cargo sets `CARGO_MANIFEST_DIR` when it runs
/// a test; the compile-time value names the checkout that built the binary, which differs when
/// checkouts share a target folder (`.ci/run` uses one under `~/.cache`) and cargo reuses it.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// `train/tests/fixtures`.
pub fn fixtures() -> PathBuf {
    manifest_dir().join("tests/fixtures")
}

/// The eight photo-like JPEGs shared with the data crate's fidelity test, sorted by name.
pub fn photos() -> Vec<PathBuf> {
    let dir = manifest_dir().join("../data/tests/fixtures/photos");
    let mut photos: Vec<PathBuf> = std::fs::read_dir(&dir)
        .expect("photo fixtures")
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "jpg"))
        .collect();
    photos.sort();
    assert_eq!(photos.len(), 8, "{photos:?}");
    photos
}

/// The fixture ResNet-18 (torchvision, 1000 classes, DDP's `module.` keys, fp16), unpacked into
/// `dir` as a plain safetensors file.
pub fn unpacked_resnet18(dir: &Path) -> PathBuf {
    use std::io::Read;
    let packed = std::fs::File::open(fixtures().join("resnet18_module.safetensors.gz"))
        .expect("ResNet-18 fixture");
    let mut bytes = Vec::new();
    flate2::read::GzDecoder::new(packed)
        .read_to_end(&mut bytes)
        .expect("gunzip");
    let path = dir.join("resnet18_module.safetensors");
    std::fs::write(&path, bytes).expect("write");
    path
}

/// An ImageFolder of the eight photos, photo i (sorted) in class folder `c{i}`.
pub fn photo_folder(root: &Path) -> PathBuf {
    for (i, photo) in photos().iter().enumerate() {
        let class = root.join(format!("c{i}"));
        std::fs::create_dir_all(&class).expect("mkdir");
        std::fs::copy(photo, class.join(photo.file_name().expect("name"))).expect("copy");
    }
    root.to_path_buf()
}

/// Rank `rank` of a world of `n` on 127.0.0.1 with its own port and job token: tests that run one
/// thread per rank over the real TCP ring.
pub fn local_world(rank: usize, n: usize, port: u16, token: &str) -> burn_dist::World {
    burn_dist::World {
        rank,
        world_size: n,
        local_rank: rank,
        local_world_size: n,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_token: token.into(),
        rendezvous: burn_dist::Rendezvous::OwnStore,
    }
}

/// The TCP ring, every collective bounded by `timeout`.
pub fn ring_options(timeout: Duration) -> burn_dist::DistOptions {
    burn_dist::DistOptions {
        backend: burn_dist::CommBackend::Ring,
        timeout,
        force_backend: false,
    }
}
