//! Faults on real processes and sockets: whoever failed, every rank and the launcher must name
//! the same root cause, and stop (by the collective deadline, or before it when the failure is
//! reported), never hang. No test measures speed: a failure reported by the failing rank must
//! stop the others long before their deadline, which is set far beyond the test's own bound.

mod common;

use common::{Guard, Outcome, WORKER, clean_command, free_port, read, spawn_processes, wait};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Bound on one job, for a loaded 2-core machine; a hung job costs this, never CI's limit.
const JOB_LIMIT: Duration = Duration::from_secs(120);
/// A collective deadline no test can reach within [`JOB_LIMIT`]: a job that stops within the
/// bound did not wait the deadline out.
const UNREACHED_DEADLINE_S: &str = "600";

/// `n` worker processes in `mode`, with the world in their environment and `extra` variables.
fn ranks(n: usize, mode: &str, extra: &[(&str, &str)]) -> common::Job {
    let port = free_port();
    let token = format!("faults-{}-{port}", std::process::id());
    let port = port.to_string();
    let extra: Vec<(String, String)> = extra
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    spawn_processes(
        WORKER,
        &(0..n).collect::<Vec<_>>(),
        &|rank| {
            let mut env = vec![
                ("RANK".to_string(), rank.to_string()),
                ("WORLD_SIZE".to_string(), n.to_string()),
                ("LOCAL_RANK".to_string(), rank.to_string()),
                ("LOCAL_WORLD_SIZE".to_string(), n.to_string()),
                ("MASTER_ADDR".to_string(), "127.0.0.1".to_string()),
                ("MASTER_PORT".to_string(), port.clone()),
                ("BURN_DIST_JOB_TOKEN".to_string(), token.clone()),
            ];
            env.extend(extra.iter().cloned());
            env
        },
        &|_| vec![mode.to_string()],
    )
}

/// Waits until every process printed `READY`.
fn until_ready(job: &common::Job, limit: Duration) {
    let start = Instant::now();
    while !job.procs.iter().all(|p| read(&p.out).contains("READY")) {
        assert!(start.elapsed() < limit, "the ranks never got ready");
        std::thread::sleep(Duration::from_millis(20));
    }
}

fn assert_every_rank_says(out: &[Outcome], needles: &[&str]) {
    for (rank, o) in out.iter().enumerate() {
        assert!(!o.status.success(), "rank {rank} succeeded");
        for needle in needles {
            assert!(
                o.stderr.contains(needle),
                "rank {rank} does not say {needle:?}:\n{}",
                o.stderr
            );
        }
    }
}

/// Rank 1 of three is SIGSTOPped in the middle of a loop of all-reduces. Its neighbours and the
/// rank beyond them must all blame rank 1 (not each other) once the 6 s deadline passes, and so
/// must the launcher's last line.
#[test]
fn a_stopped_rank_is_named_by_every_rank_and_by_the_launcher() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("out");
    // The launcher and its workers share a process group, killed when `launcher` drops.
    let mut launcher = Guard::spawn(
        clean_command(WORKER)
            .args(["launch-loop", "3", "1000000", "4096"])
            .env("BURN_DIST_TIMEOUT_S", "6")
            .stdout(Stdio::from(std::fs::File::create(&log).expect("log")))
            .stderr(Stdio::from(
                std::fs::File::create(dir.path().join("err")).expect("log"),
            )),
    );
    let start = Instant::now();
    // Every rank has finished one all-reduce (so each has published a collective on the
    // progress board) before rank 1 is stopped.
    let pid = loop {
        let text = read(&log);
        if text.matches("LOOPING").count() == 3 {
            let line = text
                .lines()
                .find(|l| l.contains("READY rank=1 "))
                .expect("rank 1 ready");
            let pid: i32 = line
                .rsplit("pid=")
                .next()
                .and_then(|p| p.trim().parse().ok())
                .expect("pid");
            break pid;
        }
        assert!(start.elapsed() < JOB_LIMIT, "never ready: {text}");
        std::thread::sleep(Duration::from_millis(20));
    };
    // SAFETY: plain signal to a child process of this test.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let status = launcher.wait_at_most(JOB_LIMIT, || format!("the job hung: {}", read(&log)));
    // The stopped rank goes with the process group when `launcher` drops.
    let err = read(&dir.path().join("err"));
    let out = read(&log);
    assert!(!status.success());
    for rank in [0, 2] {
        // Rank 0 writes to the launcher's own stderr; the others' lines carry a `[rank R]` prefix.
        let prefix = format!("[rank {rank}] ");
        let said = err
            .lines()
            .find(|l| {
                let l = if rank == 0 {
                    *l
                } else {
                    l.strip_prefix(&prefix).unwrap_or("")
                };
                l.starts_with("DIST ERROR") && !l.contains("root cause")
            })
            .unwrap_or_else(|| panic!("rank {rank} reported nothing:\n{out}\n{err}"));
        assert!(
            said.contains("rank 1 stopped making progress") && said.contains("all_reduce"),
            "rank {rank} blames someone else: {said}"
        );
    }
    let last = err
        .lines()
        .rev()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("");
    assert!(
        last.contains("rank 1 (pid ") && last.contains("root cause"),
        "the launcher's last line must name rank 1: {last}"
    );
}

/// Loading the optimizer state fails on rank 1 alone, inside `broadcast_optimizer_state`; the
/// others are already in the next collective. They must stop before their deadline (which the
/// test's bound never reaches) and name rank 1 and its cause.
#[test]
fn a_rank_failing_inside_a_broadcast_is_named_by_every_rank_before_the_deadline() {
    let mut job = ranks(
        3,
        "bad-state",
        &[("BURN_DIST_TIMEOUT_S", UNREACHED_DEADLINE_S)],
    );
    until_ready(&job, JOB_LIMIT);
    let out = wait(&mut job, JOB_LIMIT);
    assert!(
        out[1].stderr.contains("optimizer state"),
        "{}",
        out[1].stderr
    );
    for rank in [0, 2] {
        let err = &out[rank].stderr;
        assert!(
            err.contains("peer rank 1 failed by itself") && err.contains("optimizer state"),
            "rank {rank}: {err}"
        );
    }
}

/// Rank 1 broadcasts where the others all-reduce: every rank reports a collective mismatch (the
/// ones that saw it directly, and the ones that saw only their neighbour leave).
#[test]
fn collectives_in_another_order_are_a_mismatch_named_on_every_rank() {
    let mut job = ranks(3, "order", &[("BURN_DIST_TIMEOUT_S", UNREACHED_DEADLINE_S)]);
    until_ready(&job, JOB_LIMIT);
    let out = wait(&mut job, JOB_LIMIT);
    assert_every_rank_says(&out, &["collective mismatch"]);
    assert!(
        out.iter().any(|o| o.stderr.contains("broadcast")),
        "the report says which collectives differ"
    );
}
