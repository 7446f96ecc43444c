//! Faults on real processes and sockets: whoever failed, every rank and the launcher must name
//! the same root cause, within the deadline or within seconds, never after a hang.

mod common;

use common::{Outcome, WORKER, clean_command, free_port, read, spawn_processes, wait};
use std::process::Stdio;
use std::time::{Duration, Instant};

/// `n` worker processes in `mode`, with the world in their environment and `extra` variables.
fn ranks(n: usize, mode: &str, extra: &[(&str, &str)]) -> common::Job {
    let port = free_port().to_string();
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
            ];
            env.extend(extra.iter().cloned());
            env
        },
        &|_| vec![mode.to_string()],
    )
}

/// Waits until every process printed `READY`; returns when that happened.
fn until_ready(job: &common::Job, limit: Duration) -> Instant {
    let start = Instant::now();
    while !job.procs.iter().all(|p| read(&p.out).contains("READY")) {
        assert!(start.elapsed() < limit, "the ranks never got ready");
        std::thread::sleep(Duration::from_millis(20));
    }
    Instant::now()
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
/// rank beyond them must all blame rank 1 (not each other) soon after the 6 s deadline, and so
/// must the launcher's last line.
#[test]
fn a_stopped_rank_is_named_by_every_rank_and_by_the_launcher() {
    let dir = tempfile::tempdir().expect("tempdir");
    let log = dir.path().join("out");
    let mut launcher = clean_command(WORKER)
        .args(["launch-loop", "3", "1000000", "4096"])
        .env("BURN_DIST_TIMEOUT_S", "6")
        .stdout(Stdio::from(std::fs::File::create(&log).expect("log")))
        .stderr(Stdio::from(
            std::fs::File::create(dir.path().join("err")).expect("log"),
        ))
        .spawn()
        .expect("launcher");
    let start = Instant::now();
    let pid = loop {
        let text = read(&log);
        if text.matches("READY").count() == 3 {
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
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "never ready: {text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    // Long enough for every rank to have published a collective on the progress board.
    std::thread::sleep(Duration::from_millis(1200));
    // SAFETY: plain signal to a child process of this test.
    unsafe { libc::kill(pid, libc::SIGSTOP) };
    let stopped_at = Instant::now();
    let status = loop {
        if let Some(s) = launcher.try_wait().expect("wait") {
            break s;
        }
        if stopped_at.elapsed() > Duration::from_secs(40) {
            let _ = launcher.kill();
            // SAFETY: as above.
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the job hung: {}", read(&log));
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    let took = stopped_at.elapsed();
    // SAFETY: as above (the launcher normally killed it already).
    unsafe { libc::kill(pid, libc::SIGKILL) };
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
    assert!(
        took < Duration::from_secs(6 + 12),
        "named after {took:?}, deadline 6 s"
    );
}

/// Loading the optimizer state fails on rank 1 alone, inside `broadcast_optimizer_state`; the
/// others are already in the next collective. With a 60 s deadline, they must still stop within
/// 5 s and name rank 1 and its cause.
#[test]
fn a_rank_failing_inside_a_broadcast_is_named_by_every_rank_within_5_s() {
    let mut job = ranks(3, "bad-state", &[("BURN_DIST_TIMEOUT_S", "60")]);
    let ready = until_ready(&job, Duration::from_secs(60));
    let out = wait(&mut job, Duration::from_secs(30));
    let took = ready.elapsed();
    assert!(took < Duration::from_secs(5), "took {took:?}");
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
    let mut job = ranks(3, "order", &[("BURN_DIST_TIMEOUT_S", "60")]);
    let ready = until_ready(&job, Duration::from_secs(60));
    let out = wait(&mut job, Duration::from_secs(30));
    assert!(ready.elapsed() < Duration::from_secs(5));
    assert_every_rank_says(&out, &["collective mismatch"]);
    assert!(
        out.iter().any(|o| o.stderr.contains("broadcast")),
        "the report says which collectives differ"
    );
}
