//! Bad flags stop the binary before any work, with one error naming the flag.

mod common;

use std::process::Command;

const EXE: &str = env!("CARGO_BIN_EXE_train");

fn fails_naming(args: &[&str], needles: &[&str]) {
    let dir = tempfile::tempdir().expect("temp dir");
    let output = common::ChildGuard::spawn(
        Command::new(EXE)
            .args(args)
            .current_dir(dir.path())
            .env_remove("RANK"),
    )
    .wait();
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(!output.status.success(), "{args:?} should fail");
    for needle in needles {
        assert!(
            stderr.contains(needle),
            "{args:?}: expected {needle:?} in\n{stderr}"
        );
    }
    // Nothing was started: no logs, no checkpoints, no dataset written.
    assert_eq!(
        std::fs::read_dir(dir.path()).expect("ls").count(),
        0,
        "{args:?} left files"
    );
}

#[test]
fn bad_values_fail_before_any_work() {
    let data = tempfile::tempdir().expect("temp dir");
    let dir = data.path().to_str().expect("utf-8");
    let with_dirs = |extra: &[&'static str]| -> Vec<String> {
        let mut v: Vec<String> = ["--train-dir", dir, "--val-dir", dir]
            .iter()
            .map(|s| s.to_string())
            .collect();
        v.extend(extra.iter().map(|s| s.to_string()));
        v
    };
    for (extra, needles) in [
        (
            &["--batch-size", "0"][..],
            &["--batch-size", "at least 1"][..],
        ),
        (&["--base-lr=-0.5"][..], &["--base-lr"][..]),
        (&["--model", "vgg16"][..], &["--model", "vgg16"][..]),
        (&["--momentum", "1.5"][..], &["--momentum"][..]),
    ] {
        let args = with_dirs(extra);
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        fails_naming(&args, needles);
    }
    fails_naming(
        &[
            "--train-dir",
            "/nonexistent/imagenet/train",
            "--val-dir",
            dir,
        ],
        &["--train-dir", "/nonexistent/imagenet/train"],
    );
    fails_naming(&["--batch-size", "many"], &["--batch-size"]);
}
