//! `scripts/gpu-check.sh`'s `row()` keeps going under `set -euo pipefail` when a step prints
//! nothing, fails or runs out of time (it used to stop the whole check at a silent step).

#[test]
fn gpu_check_rows_survive_silent_failing_and_slow_steps() {
    // The checkout under test (cargo sets it at run time); the compile-time value names the
    // checkout that built this binary, which differs when checkouts share a target folder.
    let manifest_dir = std::env::var_os("CARGO_MANIFEST_DIR").map_or_else(
        || env!("CARGO_MANIFEST_DIR").into(),
        std::path::PathBuf::from,
    );
    let script = manifest_dir.join("../scripts/gpu-check.sh");
    let out = std::process::Command::new("bash")
        .arg(&script)
        .arg("selftest")
        .output()
        .expect("runs bash");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert!(stdout.contains("selftest: every row recorded"), "{stdout}");
    assert!(stdout.contains("| silent | pass"), "{stdout}");
}
