//! Shared by the multi-process tests: starting worker processes (src/bin/burn-dist-test-worker.rs)
//! with a clean environment, and collecting their output. Every child is killed when its [`Job`]
//! is dropped, whatever the exit path of the test.
#![allow(dead_code)]

use std::fs::File;
use std::io::Read;
use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

pub const WORKER: &str = env!("CARGO_BIN_EXE_burn-dist-test-worker");

/// A port nobody listens on right now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
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
            let _ = p.child.kill();
            let _ = p.child.wait();
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
            let child = clean_command(program)
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
