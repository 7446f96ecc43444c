//! Helpers for tests that run the real `train` binary on a small generated dataset.
#![allow(dead_code)]

use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use data::synthetic::{SyntheticConfig, generate};

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

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// `train` on the CPU with a tiny ResNet-18 at 32 px, logs and checkpoints under `run_dir`.
pub fn train_command(exe: &str, run_dir: &Path, train_dir: &Path, val_dir: &Path) -> Command {
    let mut command = Command::new(exe);
    command
        .arg("--train-dir")
        .arg(train_dir)
        .arg("--val-dir")
        .arg(val_dir)
        .arg("--log-dir")
        .arg(run_dir.join("logs"))
        .arg("--checkpoint-format")
        .arg(run_dir.join("checkpoint-{epoch}.ckpt"))
        .args([
            "--model",
            "resnet18",
            "--image-size",
            "32",
            "--batch-size",
            "8",
        ])
        .args([
            "--val-batch-size",
            "16",
            "--workers",
            "1",
            "--no-cuda",
            "--warmup-epochs",
            "0",
        ])
        .args(["--master-port", &free_port().to_string()])
        .env_remove("RANK")
        .env_remove("WORLD_SIZE")
        .env("BURN_DIST_TIMEOUT_S", "60")
        .stdin(Stdio::null());
    command
}

/// Kills the child on drop, so that no test leaves a process behind, even when it fails.
pub struct ChildGuard(pub Option<Child>);

impl ChildGuard {
    pub fn spawn(command: &mut Command) -> Self {
        Self(Some(
            command
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .expect("spawn train"),
        ))
    }

    pub fn pid(&self) -> u32 {
        self.0.as_ref().map(|c| c.id()).unwrap_or(0)
    }

    pub fn wait(mut self) -> Output {
        self.0
            .take()
            .expect("child")
            .wait_with_output()
            .expect("wait")
    }
}

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Some(mut child) = self.0.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Runs to completion and insists on success, showing the output otherwise.
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

/// `train/tests/fixtures`.
pub fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// The eight photo-like JPEGs shared with the data crate's fidelity test, sorted by name.
pub fn photos() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../data/tests/fixtures/photos");
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
