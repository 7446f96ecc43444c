//! Shared by the multi-process tests: starting worker processes (src/bin/burn-dist-test-worker.rs)
//! with a clean environment, and collecting their output. Every child leads a process group of
//! its own (a launcher's workers join it) and gets SIGKILL if the test process dies; the group
//! is killed when its [`Job`] or [`Guard`] is dropped, whatever the exit path of the test.
#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

mod ports;
// Not every test binary that includes this module uses both.
#[allow(unused_imports)]
pub use ports::{free_port, job_token};

pub const WORKER: &str = env!("CARGO_BIN_EXE_burn-dist-test-worker");

/// Puts the child in a process group of its own and makes it die with this test process.
pub fn isolate(cmd: &mut Command) -> &mut Command {
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2), which
    // is async-signal-safe.
    unsafe {
        cmd.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    cmd.process_group(0)
}

/// SIGKILL to the process group `child` leads, then reaps it.
pub fn kill_group(child: &mut Child) {
    // SAFETY: kill(2) with a negative pid signals the group the child leads; the child is not
    // reaped yet, so its pid (the group id) has not been reused.
    unsafe { libc::kill(-(child.id() as libc::pid_t), libc::SIGKILL) };
    let _ = child.wait();
}

/// One child started with [`isolate`]; its process group is killed on drop.
pub struct Guard(pub Child);

impl Guard {
    pub fn spawn(cmd: &mut Command) -> Self {
        Self(isolate(cmd).spawn().expect("spawn"))
    }

    /// Waits at most `limit`; past it, kills the group and fails with `what` and `context()`.
    pub fn wait_at_most(&mut self, limit: Duration, context: impl Fn() -> String) -> ExitStatus {
        let start = Instant::now();
        loop {
            if let Some(status) = self.0.try_wait().expect("try_wait") {
                return status;
            }
            if start.elapsed() > limit {
                kill_group(&mut self.0);
                panic!("did not finish within {limit:?} (hang): {}", context());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Guard {
    fn drop(&mut self) {
        kill_group(&mut self.0);
    }
}

/// A command that inherits none of the launcher variables of the shell running the tests.
pub fn clean_command(program: &str) -> Command {
    let mut cmd = Command::new(program);
    for (key, _) in std::env::vars_os() {
        let key_text = key.to_string_lossy();
        let launcher = ["SLURM_", "OMPI_", "PMI_", "TORCHELASTIC_", "BURN_DIST_"]
            .iter()
            .any(|p| key_text.starts_with(p))
            || [
                "RANK",
                "WORLD_SIZE",
                "LOCAL_RANK",
                "LOCAL_WORLD_SIZE",
                "GROUP_RANK",
                "ROLE_RANK",
                "MASTER_ADDR",
                "MASTER_PORT",
            ]
            .contains(&key_text.as_ref());
        if launcher {
            cmd.env_remove(&key);
        }
    }
    cmd
}

pub struct Proc {
    pub rank: usize,
    pub child: Child,
    pub out: PathBuf,
    pub err: PathBuf,
}

/// Processes of one test; killed on drop.
pub struct Job {
    pub procs: Vec<Proc>,
    _dir: tempfile::TempDir,
}

impl Drop for Job {
    fn drop(&mut self) {
        for p in &mut self.procs {
            kill_group(&mut p.child);
        }
    }
}

pub struct Outcome {
    pub status: ExitStatus,
    pub stdout: String,
    pub stderr: String,
}

pub fn read(p: &PathBuf) -> String {
    let mut s = String::new();
    let _ = File::open(p).and_then(|mut f| f.read_to_string(&mut s));
    s
}

/// Starts one process per entry of `ranks`: `program` with `args(rank)` and `env(rank)`, in a
/// clean environment, output to files.
pub fn spawn_processes(
    program: &str,
    ranks: &[usize],
    env: &dyn Fn(usize) -> Vec<(String, String)>,
    args: &dyn Fn(usize) -> Vec<String>,
) -> Job {
    let dir = tempfile::tempdir().expect("tempdir");
    let procs = ranks
        .iter()
        .map(|&rank| {
            let out = dir.path().join(format!("out{rank}"));
            let err = dir.path().join(format!("err{rank}"));
            let child = isolate(&mut clean_command(program))
                .args(args(rank))
                .envs(env(rank))
                .stdout(Stdio::from(File::create(&out).expect("out")))
                .stderr(Stdio::from(File::create(&err).expect("err")))
                .spawn()
                .expect("spawn worker");
            Proc {
                rank,
                child,
                out,
                err,
            }
        })
        .collect();
    Job { procs, _dir: dir }
}

/// Waits for every process; a process still running after `limit` fails the test (a hang).
pub fn wait(job: &mut Job, limit: Duration) -> Vec<Outcome> {
    let start = Instant::now();
    let mut statuses: Vec<Option<ExitStatus>> = vec![None; job.procs.len()];
    while statuses.iter().any(Option::is_none) {
        for (i, p) in job.procs.iter_mut().enumerate() {
            if statuses[i].is_none() {
                statuses[i] = p.child.try_wait().expect("try_wait");
            }
        }
        if start.elapsed() > limit {
            let dump: Vec<String> = job
                .procs
                .iter()
                .map(|p| format!("rank {}: {}{}", p.rank, read(&p.out), read(&p.err)))
                .collect();
            for p in &mut job.procs {
                kill_group(&mut p.child);
            }
            panic!("workers did not finish within {limit:?} (hang): {dump:#?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    job.procs
        .iter()
        .zip(statuses)
        .map(|(p, s)| Outcome {
            status: s.expect("status"),
            stdout: read(&p.out),
            stderr: read(&p.err),
        })
        .collect()
}

/// Every process exited 0.
pub fn assert_all_succeeded(out: &[Outcome]) {
    for (i, o) in out.iter().enumerate() {
        assert!(
            o.status.success(),
            "process {i} failed: {}\n{}",
            o.stdout,
            o.stderr
        );
    }
}

/// Runs `cmd` (isolated, output to files) to completion within `limit`, or kills its process
/// group and fails with what it printed: a bounded `Command::output`.
pub fn output_within(cmd: &mut Command, limit: Duration) -> Outcome {
    let dir = tempfile::tempdir().expect("tempdir");
    let (out, err) = (dir.path().join("out"), dir.path().join("err"));
    cmd.stdout(Stdio::from(File::create(&out).expect("out")))
        .stderr(Stdio::from(File::create(&err).expect("err")));
    let mut guard = Guard::spawn(cmd);
    let status = guard.wait_at_most(limit, || format!("{}\n{}", read(&out), read(&err)));
    drop(guard);
    Outcome {
        status,
        stdout: read(&out),
        stderr: read(&err),
    }
}
