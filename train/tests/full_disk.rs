//! A full disk while a checkpoint is written in the background: the run stops at the next step
//! with one message that names the file and says "No space left on device" once, no partial
//! file is left, and the previous checkpoint stays intact (a resume reads it).
//!
//! It needs a small file system of its own: the test mounts a tmpfs, which takes root (or
//! CAP_SYS_ADMIN). `.ci/run` runs it where that works and says when it did not.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

use common::*;

const EXE: &str = env!("CARGO_BIN_EXE_train");

/// A tmpfs of `size` mounted on a fresh folder, unmounted when dropped (also on failure).
struct SmallDisk {
    mount: PathBuf,
    _dir: tempfile::TempDir,
}

impl SmallDisk {
    fn mount(size: &str) -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let mount = dir.path().join("disk");
        std::fs::create_dir(&mount).expect("mount point");
        let status = Command::new("mount")
            .args(["-t", "tmpfs", "-o", &format!("size={size}"), "tmpfs"])
            .arg(&mount)
            .status()
            .expect("run mount");
        assert!(
            status.success(),
            "cannot mount a tmpfs on {} (needs root or CAP_SYS_ADMIN)",
            mount.display()
        );
        Self { mount, _dir: dir }
    }
}

impl Drop for SmallDisk {
    fn drop(&mut self) {
        let _ = Command::new("umount").arg(&self.mount).status();
    }
}

fn files_in(dir: &Path) -> Vec<String> {
    let mut names: Vec<String> = std::fs::read_dir(dir)
        .expect("read dir")
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    names
}

#[test]
#[ignore = "mounts a tmpfs: needs root or CAP_SYS_ADMIN (.ci/run runs it where it can)"]
fn a_full_disk_stops_the_run_with_one_clear_message_and_keeps_the_last_checkpoint() {
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = small_dataset(&dir.path().join("data"), 8, 2);
    // A ResNet-18 checkpoint (weights + momentum) is ~90 MB: one fits, a second does not, the
    // final weights (~45 MB) do.
    let disk = SmallDisk::mount("160m");
    let run = |epochs: &str| {
        // Only the checkpoints on the small disk: a log write must not meet the full disk first.
        let mut command = Command::new(EXE);
        command
            .args(small_run_args(
                &train_dir,
                &val_dir,
                &dir.path().join("logs"),
                &disk.mount.join("checkpoint-{epoch}.ckpt"),
                0.0,
            ))
            .args(["--epochs", epochs])
            .env_remove("RANK")
            .env_remove("WORLD_SIZE")
            .stdin(std::process::Stdio::null());
        ChildGuard::spawn(&mut command).wait()
    };
    let output = run("3");
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "the run must stop:\n{stderr}");
    let path = disk.mount.join("checkpoint-2.ckpt");
    assert!(
        stderr.contains(&format!("cannot write checkpoint {}", path.display())),
        "the message names the file:\n{stderr}"
    );
    assert_eq!(
        stderr.matches("No space left on device").count(),
        1,
        "the cause is said once:\n{stderr}"
    );
    assert_eq!(
        files_in(&disk.mount),
        ["checkpoint-1.ckpt"],
        "no partial file, the previous checkpoint kept"
    );
    // The kept checkpoint is whole: a run with 1 epoch finds it done.
    let output = run("1");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(stdout.contains("all 1 epochs are done"), "{stdout}");
}
