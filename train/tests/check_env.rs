//! `train --check-env` as a user runs it, on a machine without a GPU: it says so, lists the
//! libraries it finds (here fake ones in a fake Python environment), and exits 0; asked for what
//! the CPU cannot do, it exits 1 with the reason.

use std::path::Path;
use std::process::Command;

fn touch(path: &Path) {
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(path, b"").expect("write");
}

/// The train binary with an environment of our making: no library folders of the machine's
/// user leak in (HOME, LD_LIBRARY_PATH, Python environments).
fn train(home: &Path, venv: Option<&Path>) -> Command {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_train"));
    for var in [
        "LD_LIBRARY_PATH",
        "VIRTUAL_ENV",
        "CONDA_PREFIX",
        "PYTHONUSERBASE",
        "CUDA_HOME",
        "CUDA_PATH",
        "CUDA_VISIBLE_DEVICES",
        "BURN_DIST_CUDA_LIBS",
    ] {
        cmd.env_remove(var);
    }
    cmd.env("HOME", home);
    if let Some(venv) = venv {
        cmd.env("VIRTUAL_ENV", venv);
    }
    cmd
}

#[test]
fn check_env_reports_the_libraries_of_a_machine_without_a_gpu() {
    let dir = tempfile::tempdir().expect("tempdir");
    let venv = dir.path().join("venv");
    let nccl = venv.join("lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2");
    touch(&nccl);
    let out = train(dir.path(), Some(&venv))
        .arg("--check-env")
        .output()
        .expect("runs train");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    let has_driver = stdout.starts_with("driver:");
    if !has_driver {
        assert!(stdout.contains("no NVIDIA GPU"), "{stdout}");
    }
    // Found in the wheel, not in our link folder (which the re-exec put first on the path).
    let nccl_line = stdout
        .lines()
        .find(|l| l.trim_start().starts_with("NCCL"))
        .expect("an NCCL line");
    assert!(nccl_line.contains(&nccl.display().to_string()), "{stdout}");
    if cfg!(feature = "cuda") {
        // The one guarded re-exec happened: the run sees the private folder of links.
        assert!(
            stdout.contains("names cudarc loads are linked in"),
            "{stdout}"
        );
    }
    assert!(stdout.contains("a run would use: backend"), "{stdout}");
}

#[test]
fn check_env_fails_with_the_reason_when_the_run_cannot_work() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out = train(dir.path(), None)
        .args(["--check-env", "--no-cuda", "--amp", "bf16"])
        .output()
        .expect("runs train");
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(out.status.code(), Some(1), "{stdout}");
    assert!(stdout.contains("missing: --amp bf16"), "{stdout}");
}
