//! Multi-process tests: real worker processes (src/bin/burn-dist-test-worker.rs) on 127.0.0.1.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    Guard, Job, Outcome, WORKER, clean_command, free_port, output_within, read, spawn_processes,
    wait,
};
use std::fs::File;
use std::io::Write;
use std::net::TcpStream;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Bound on one job of these tests: their collective deadlines are 2 to 20 s; the rest allows
/// for a loaded 2-core machine. A hung job costs this, never the CI's limit.
const JOB_LIMIT: Duration = Duration::from_secs(120);

/// Starts `ranks` of a world of `n` running `args`.
fn spawn(
    n: usize,
    ranks: &[usize],
    port: u16,
    timeout_s: f64,
    args: &dyn Fn(usize) -> Vec<String>,
) -> Job {
    spawn_env(n, ranks, port, timeout_s, &[], args)
}

/// [`spawn`] with extra environment variables.
fn spawn_env(
    n: usize,
    ranks: &[usize],
    port: u16,
    timeout_s: f64,
    env: &[(&str, &str)],
    args: &dyn Fn(usize) -> Vec<String>,
) -> Job {
    let env = |rank: usize| {
        let mut vars: Vec<(String, String)> = env
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect();
        vars.extend(
            [
                ("RANK", rank.to_string()),
                ("WORLD_SIZE", n.to_string()),
                ("LOCAL_RANK", rank.to_string()),
                ("LOCAL_WORLD_SIZE", n.to_string()),
                ("MASTER_ADDR", "127.0.0.1".to_string()),
                ("MASTER_PORT", port.to_string()),
                // One token per job (its port is unique to it in this process).
                (
                    "BURN_DIST_JOB_TOKEN",
                    format!("multiprocess-{}-{port}", std::process::id()),
                ),
                ("BURN_DIST_TIMEOUT_S", timeout_s.to_string()),
            ]
            .map(|(k, v)| (k.to_string(), v)),
        );
        vars
    };
    spawn_processes(WORKER, ranks, &env, args)
}

fn run_ok(n: usize, args: &dyn Fn(usize) -> Vec<String>) -> Vec<Outcome> {
    run_ok_env(n, &[], args)
}

fn run_ok_env(n: usize, env: &[(&str, &str)], args: &dyn Fn(usize) -> Vec<String>) -> Vec<Outcome> {
    let ranks: Vec<usize> = (0..n).collect();
    let mut job = spawn_env(n, &ranks, free_port(), 20.0, env, args);
    let out = wait(&mut job, JOB_LIMIT);
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.status.success(),
            "rank {r} failed: {}\n{}",
            o.stdout,
            o.stderr
        );
    }
    out
}

/// Every rank printed the same `CHECKSUM` line of the collectives it ran.
fn assert_same_checksum(n: usize, out: &[Outcome]) {
    let sums: Vec<&str> = out
        .iter()
        .map(|o| {
            o.stdout
                .lines()
                .find(|l| l.starts_with("CHECKSUM"))
                .unwrap_or("none")
        })
        .collect();
    assert!(
        sums.iter().all(|s| *s == sums[0] && *s != "none"),
        "n={n}: {sums:?}"
    );
}

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

/// Every rank reported `transport` for its communicator.
fn assert_transport(out: &[Outcome], transport: &str) {
    for o in out {
        let line = o.stdout.lines().find(|l| l.starts_with("TRANSPORT "));
        assert_eq!(
            line,
            Some(format!("TRANSPORT {transport}").as_str()),
            "{}",
            o.stderr
        );
    }
}

#[test]
fn collectives_agree_with_reference_on_2_3_4_processes() {
    for n in [2, 3, 4] {
        let out = run_ok(n, &|_| strings(&["collectives"]));
        assert_same_checksum(n, &out);
        // Same machine: the all-reduces went through shared memory (buffers of up to 8 MB, many
        // 256 KiB slots, are in the checksum).
        assert_transport(&out, "tcp ring + shared memory");
    }
}

#[test]
fn collectives_over_the_tcp_ring_without_shared_memory() {
    for n in [2, 3] {
        let out = run_ok_env(n, &[("BURN_DIST_SHM", "0")], &|_| strings(&["collectives"]));
        assert_same_checksum(n, &out);
        assert_transport(&out, "tcp ring");
    }
}

#[test]
fn shared_memory_segments_are_unlinked_once_mapped() {
    let n = 3;
    let out = run_ok(n, &|_| strings(&["collectives"]));
    assert_transport(&out, "tcp ring + shared memory");
    // Each worker looks at its own mappings (other jobs' segments in /dev/shm do not matter):
    // one segment per rank, every one already unlinked.
    for (rank, o) in out.iter().enumerate() {
        let line = o.stdout.lines().find(|l| l.starts_with("SHM_MAPS"));
        assert_eq!(
            line,
            Some(format!("SHM_MAPS mapped={n} unlinked={n}").as_str()),
            "rank {rank}: {}",
            o.stdout
        );
    }
}

fn params(o: &Outcome) -> Vec<f32> {
    let line = o
        .stdout
        .lines()
        .find(|l| l.starts_with("PARAMS "))
        .expect("PARAMS line");
    line[7..]
        .split(',')
        .map(|v| v.parse().expect("float"))
        .collect()
}

fn single_process_params(args: &[&str]) -> Vec<f32> {
    let out = output_within(clean_command(WORKER).args(args), JOB_LIMIT);
    assert!(out.status.success(), "{}", out.stderr);
    params(&out)
}

fn assert_close(a: &[f32], b: &[f32], rel: f32, abs: f32, what: &str) {
    assert_eq!(a.len(), b.len(), "{what}: parameter count");
    for (i, (x, y)) in a.iter().zip(b).enumerate() {
        assert!(
            (x - y).abs() <= abs + rel * y.abs(),
            "{what}: parameter {i}: {x} vs {y}"
        );
    }
}

#[test]
fn data_parallel_matches_single_process_with_double_batch() {
    let reference = single_process_params(&["train", "8", "1", "none"]);
    // World 2, per-rank batch 4, plain.
    let out = run_ok(2, &|_| strings(&["train", "4", "1", "none"]));
    let (p0, p1) = (params(&out[0]), params(&out[1]));
    assert_eq!(p0, p1, "ranks must end with identical parameters");
    assert_close(&p0, &reference, 1e-5, 1e-7, "world 2 vs world 1");
    // backward_passes_per_step = 2 (two passes of 2 samples per rank, loss scaled by 1/2).
    let out = run_ok(2, &|_| strings(&["train", "4", "2", "none"]));
    assert_eq!(params(&out[0]), params(&out[1]));
    assert_close(
        &params(&out[0]),
        &reference,
        1e-5,
        1e-7,
        "backward_passes_per_step=2",
    );
    // fp16 on the wire: looser tolerance (half has an 11-bit mantissa; 5 steps at lr 0.1).
    let out = run_ok(2, &|_| strings(&["train", "4", "1", "fp16"]));
    assert_eq!(params(&out[0]), params(&out[1]));
    assert_close(&params(&out[0]), &reference, 1e-3, 1e-4, "fp16 compression");
}

#[test]
fn killed_rank_is_named_by_every_other_rank() {
    killed_rank_is_named(&[]);
}

#[test]
fn killed_rank_is_named_over_the_tcp_ring() {
    killed_rank_is_named(&[("BURN_DIST_SHM", "0")]);
}

fn killed_rank_is_named(env: &[(&str, &str)]) {
    let n = 4;
    let ranks: Vec<usize> = (0..n).collect();
    let mut job = spawn_env(n, &ranks, free_port(), 10.0, env, &|_| {
        strings(&["loop", "1000000", "100000"])
    });
    let start = Instant::now();
    while !read(&job.procs[1].out).contains("READY") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "rank 1 never became ready: {}",
            read(&job.procs[1].err)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    std::thread::sleep(Duration::from_millis(500));
    job.procs[1].child.kill().expect("kill rank 1");
    // Deadline 10 s; the rest is the allowance for a loaded machine.
    let out = wait(&mut job, JOB_LIMIT);
    for (r, o) in out.iter().enumerate() {
        if r == 1 {
            continue;
        }
        assert!(!o.status.success(), "rank {r} should fail");
        assert!(
            o.stderr.contains("peer rank 1 "),
            "rank {r} must name rank 1: {}",
            o.stderr
        );
    }
}

#[test]
fn rank_that_never_starts_is_named() {
    let mut job = spawn(3, &[0, 2], free_port(), 2.0, &|_| strings(&["init"]));
    let out = wait(&mut job, JOB_LIMIT);
    for o in &out {
        assert!(!o.status.success());
        assert!(
            o.stderr.contains("ranks [1] did not reach the rendezvous"),
            "{}",
            o.stderr
        );
    }
}

#[test]
fn mismatched_models_fail_on_every_rank() {
    let ranks = [0, 1];
    let mut job = spawn(2, &ranks, free_port(), 10.0, &|r| {
        strings(&["train", "4", "1", "none", if r == 0 { "16" } else { "17" }])
    });
    let out = wait(&mut job, JOB_LIMIT);
    for (r, o) in out.iter().enumerate() {
        assert!(!o.status.success(), "rank {r} should fail");
        assert!(
            o.stderr.contains("model mismatch") && o.stderr.contains("fc1.weight"),
            "rank {r}: {}",
            o.stderr
        );
    }
}

#[test]
fn garbage_and_wrong_token_on_the_store_port_are_dropped() {
    let port = free_port();
    let mut job = spawn(2, &[0, 1], port, 20.0, &|_| {
        strings(&["loop", "300", "10000"])
    });
    let start = Instant::now();
    while !read(&job.procs[0].out).contains("READY") {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "rank 0 not ready: {}",
            read(&job.procs[0].err)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // Garbage bytes.
    let mut g = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _ = g.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n");
    // An oversized frame.
    let mut o = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let _ = o.write_all(&u32::MAX.to_le_bytes());
    // A handshake of an older protocol version.
    let mut v1 = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    let mut hs = b"BDST".to_vec();
    hs.extend_from_slice(&1u16.to_le_bytes());
    hs.push(1);
    hs.extend_from_slice(&1u32.to_le_bytes());
    hs.extend_from_slice(b"test-token");
    let mut frame = (hs.len() as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&hs);
    let _ = v1.write_all(&frame);
    // A client of this protocol with the wrong token.
    let wrong = burn_dist::World {
        rank: 1,
        world_size: 2,
        local_rank: 1,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_token: "wrong-token".into(),
        rendezvous: burn_dist::Rendezvous::OwnStore,
    };
    let e = burn_dist::Store::connect(&wrong, Duration::from_secs(5)).expect_err("wrong token");
    assert!(e.to_string().contains("unknown job token"), "{e}");
    let out = wait(&mut job, JOB_LIMIT);
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.status.success() && o.stdout.contains("LOOP OK"),
            "rank {r}: {}\n{}",
            o.stdout,
            o.stderr
        );
    }
    assert!(
        out[0].stderr.contains("dropped connection"),
        "rank 0 logs the drops: {}",
        out[0].stderr
    );
    for needle in ["unknown job token", "protocol version 1"] {
        assert!(
            out[0].stderr.contains(needle),
            "rank 0 logs {needle:?}: {}",
            out[0].stderr
        );
    }
}

/// The healthy ranks sleep an hour: the launcher returning within [`JOB_LIMIT`] at all shows
/// that it stopped them (an ordering, not a speed).
#[test]
fn launcher_stops_everyone_when_a_rank_fails() {
    let out = output_within(clean_command(WORKER).args(["launch", "3", "2"]), JOB_LIMIT);
    let stderr = &out.stderr;
    assert!(!out.status.success());
    assert!(
        stderr.contains("rank 2 (pid ") && stderr.contains("exited with exit code 7"),
        "{stderr}"
    );
}

#[test]
fn launcher_runs_workers_with_prefixed_output() {
    let out = output_within(clean_command(WORKER).args(["launch", "2", "-1"]), JOB_LIMIT);
    let stdout = &out.stdout;
    assert!(out.status.success(), "{stdout}\n{}", out.stderr);
    assert!(stdout.contains("worker 0 of 2 quiet=false"), "{stdout}");
    assert!(
        stdout.contains("[rank 1] worker 1 of 2 quiet=true"),
        "{stdout}"
    );
}

fn line_floats(o: &Outcome, label: &str) -> Vec<f32> {
    let prefix = format!("{label} ");
    let line = o
        .stdout
        .lines()
        .find(|l| l.starts_with(&prefix))
        .unwrap_or_else(|| panic!("no {label} in {}\n{}", o.stdout, o.stderr));
    line[prefix.len()..]
        .split(',')
        .map(|v| v.parse().expect("float"))
        .collect()
}

#[test]
fn parameters_buffers_and_optimizer_state_are_broadcast_and_buffers_averaged() {
    let n = 3;
    let out = run_ok(n, &|_| strings(&["state"]));
    let bcast: Vec<Vec<f32>> = out.iter().map(|o| line_floats(o, "AFTER_BCAST")).collect();
    assert!(
        bcast.iter().all(|b| *b == bcast[0]),
        "parameters and BN buffers equal rank 0's after broadcast"
    );
    let stepped: Vec<Vec<f32>> = out
        .iter()
        .map(|o| line_floats(o, "AFTER_STATE_STEP"))
        .collect();
    assert!(
        stepped.iter().all(|s| *s == stepped[0]),
        "momentum state equal after broadcast_optimizer_state"
    );
    let before: Vec<Vec<f32>> = out
        .iter()
        .map(|o| line_floats(o, "BUFFERS_BEFORE"))
        .collect();
    assert!(
        before[0] != before[1],
        "buffers must differ before averaging (test precondition)"
    );
    let after: Vec<Vec<f32>> = out
        .iter()
        .map(|o| line_floats(o, "BUFFERS_AFTER"))
        .collect();
    assert!(after.iter().all(|a| *a == after[0]));
    let mean: Vec<f32> = (0..before[0].len())
        .map(|i| before.iter().map(|b| b[i]).sum::<f32>() / n as f32)
        .collect();
    assert_close(&after[0], &mean, 1e-6, 1e-7, "average_buffers");
    // Negative control: without the state broadcast, the identical step gives different results.
    let out = run_ok_env(2, &[("SKIP_STATE_BROADCAST", "1")], &|_| {
        strings(&["state"])
    });
    assert_ne!(
        line_floats(&out[0], "AFTER_STATE_STEP"),
        line_floats(&out[1], "AFTER_STATE_STEP")
    );
}

#[test]
fn launcher_forwards_sigterm_and_stops_all_ranks() {
    let dir = tempfile::tempdir().expect("tempdir");
    let out_path = dir.path().join("out");
    let err_path = dir.path().join("err");
    let mut launcher = Guard::spawn(
        clean_command(WORKER)
            .args(["launch", "3", "99"]) // no rank fails; all would sleep an hour
            .stdout(Stdio::from(File::create(&out_path).expect("out")))
            .stderr(Stdio::from(File::create(&err_path).expect("err"))),
    );
    let start = Instant::now();
    while read(&out_path)
        .lines()
        .filter(|l| l.contains("worker "))
        .count()
        < 3
    {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "workers did not start: {}",
            read(&err_path)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    // SAFETY: kill(2) on the pid of our own, not yet reaped, child.
    unsafe {
        libc::kill(launcher.0.id() as libc::pid_t, libc::SIGTERM);
    }
    let status = launcher.wait_at_most(JOB_LIMIT, || {
        format!("the launcher ignored SIGTERM: {}", read(&err_path))
    });
    assert!(!status.success());
    // The workers were in the launcher's process group: none of them outlives it (a moment
    // for the last ones to be reaped).
    let group = -(launcher.0.id() as libc::pid_t);
    let exited = Instant::now();
    // SAFETY: signal 0 only checks whether the group has members.
    while unsafe { libc::kill(group, 0) } == 0 {
        assert!(
            exited.elapsed() < JOB_LIMIT,
            "workers outlived the launcher"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        read(&err_path).contains("interrupted by signal 15"),
        "{}",
        read(&err_path)
    );
}

#[test]
fn parameters_without_a_gradient_contribute_zeros_or_get_none() {
    let out = run_ok(3, &|_| strings(&["unused"]));
    let p: Vec<Vec<f32>> = out.iter().map(params).collect();
    assert!(p.iter().all(|x| *x == p[0]), "ranks must agree");
    for o in &out {
        assert!(
            o.stdout.contains("HEAD_CHANGED true"),
            "the head gets rank 0's averaged gradient everywhere: {}",
            o.stdout
        );
        assert!(
            o.stdout.contains("SPARE_CHANGED false"),
            "a parameter no rank used gets no gradient, so weight decay leaves it alone: {}",
            o.stdout
        );
    }
}

/// Rank 0 serves the store and waits in the rendezvous; garbage, an HTTP request and more idle
/// connections than the store keeps in their handshake arrive first, then rank 1 starts. The job
/// must set up and sum as usual (the ring port's turn is in `tests/intruders.rs`).
#[test]
fn strangers_on_the_store_port_during_the_rendezvous_leave_the_job_unharmed() {
    let port = free_port();
    let args = |_| strings(&["loop", "20", "1000"]);
    let mut rank0 = spawn(2, &[0], port, 20.0, &args);
    let at = std::net::SocketAddr::from(([127, 0, 0, 1], port));
    let start = Instant::now();
    while TcpStream::connect_timeout(&at, Duration::from_secs(1)).is_err() {
        assert!(
            start.elapsed() < Duration::from_secs(30),
            "rank 0 never served the store: {}",
            read(&rank0.procs[0].err)
        );
        std::thread::sleep(Duration::from_millis(20));
    }
    let mut held = Vec::new();
    for payload in [
        &b"\x00\x00\x00\x01\xff garbage"[..],
        &b"GET / HTTP/1.1\r\nHost: burn-dist\r\n\r\n"[..],
    ] {
        let mut s = TcpStream::connect(at).expect("connect");
        s.write_all(payload).expect("write");
        held.push(s);
    }
    for _ in 0..100 {
        held.push(TcpStream::connect(at).expect("connect"));
    }
    let mut rank1 = spawn(2, &[1], port, 20.0, &args);
    let mut out = wait(&mut rank0, JOB_LIMIT);
    out.extend(wait(&mut rank1, JOB_LIMIT));
    for (r, o) in out.iter().enumerate() {
        assert!(
            o.status.success() && o.stdout.contains("LOOP OK"),
            "rank {r}: {}\n{}",
            o.stdout,
            o.stderr
        );
    }
    drop(held);
}
