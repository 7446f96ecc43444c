//! Jobs started the ways people start them: several nodes of our launcher, SLURM's environment,
//! `MASTER_ADDR=localhost` and an IPv6 master, and (when it is installed) a real torchrun. Real
//! processes on 127.0.0.1 with ports picked free.
#![allow(clippy::unwrap_used)]

mod common;

use common::{
    Outcome, WORKER, assert_all_succeeded, clean_command, free_port, job_token, output_within,
    spawn_processes, wait,
};
use std::net::TcpListener;
use std::time::Duration;

const LIMIT: Duration = Duration::from_secs(60);

fn strings(v: &[&str]) -> Vec<String> {
    v.iter().map(|s| s.to_string()).collect()
}

fn vars(v: &[(&str, String)]) -> Vec<(String, String)> {
    v.iter().map(|(k, v)| (k.to_string(), v.clone())).collect()
}

/// The `JOB ...` line a worker printed (see the test worker's `job` mode).
fn job_line(o: &Outcome) -> &str {
    o.stdout
        .lines()
        .find(|l| l.contains("JOB rank="))
        .unwrap_or_else(|| panic!("no JOB line:\n{}\n{}", o.stdout, o.stderr))
}

/// Runs our launcher on two "nodes" of this host, one worker each.
fn two_node_launchers(port: u16, rdzv_ids: [Option<&str>; 2], timeout_s: &str) -> Vec<Outcome> {
    let env = |_| vars(&[("BURN_DIST_TIMEOUT_S", timeout_s.to_string())]);
    let args = |node: usize| {
        let mut a = strings(&["launch-job", "--nproc", "1", "--nnodes", "2"]);
        a.extend(strings(&["--node-rank", &node.to_string()]));
        a.extend(strings(&["--master-addr", "127.0.0.1"]));
        a.extend(strings(&["--master-port", &port.to_string()]));
        if let Some(id) = rdzv_ids[node] {
            a.extend(strings(&["--rdzv-id", id]));
        }
        a
    };
    let mut job = spawn_processes(WORKER, &[0, 1], &env, &args);
    wait(&mut job, LIMIT)
}

#[test]
fn two_launchers_with_one_rdzv_id_form_one_job() {
    let id = job_token("job-17");
    let out = two_node_launchers(free_port(), [Some(id.as_str()), Some(id.as_str())], "20");
    assert_all_succeeded(&out);
    // Worker output of node 0 is its rank 0's own; node 1's rank 1 is prefixed by its launcher.
    assert!(
        job_line(&out[0]).contains("rank=0 world=2 local=0/1"),
        "{}",
        out[0].stdout
    );
    assert!(
        out[1]
            .stdout
            .contains("[rank 1] JOB rank=1 world=2 local=0/1"),
        "{}",
        out[1].stdout
    );
    for o in &out {
        assert!(job_line(o).ends_with("sum=3"), "{}", o.stdout);
    }
}

#[test]
fn several_nodes_without_a_job_identity_stop_at_once_with_the_fix() {
    let out = output_within(
        clean_command(WORKER)
            .args([
                "launch-job",
                "--nproc",
                "1",
                "--nnodes",
                "2",
                "--node-rank",
                "1",
            ])
            .args(["--master-port", &free_port().to_string()]),
        LIMIT,
    );
    let stderr = &out.stderr;
    assert!(!out.status.success());
    assert!(
        stderr.contains("--rdzv-id") && stderr.contains("BURN_DIST_JOB_TOKEN"),
        "{stderr}"
    );
    assert!(!out.stdout.contains("JOB"), "no worker may start");
}

#[test]
fn launchers_of_different_jobs_do_not_mix() {
    let (a, b) = (job_token("job-a"), job_token("job-b"));
    let out = two_node_launchers(free_port(), [Some(a.as_str()), Some(b.as_str())], "3");
    assert!(out.iter().all(|o| !o.status.success()));
    assert!(
        out[1].stderr.contains("rejected rank 1's handshake")
            && out[1].stderr.contains("--rdzv-id"),
        "{}",
        out[1].stderr
    );
    assert!(
        out[0]
            .stderr
            .contains("ranks [1] did not reach the rendezvous"),
        "{}",
        out[0].stderr
    );
}

/// Two ranks in torchrun's environment with `MASTER_ADDR=master`.
fn pair_at(master: &str) -> Vec<Outcome> {
    let port = free_port();
    let token = job_token("pair");
    let env = |rank: usize| {
        vars(&[
            ("RANK", rank.to_string()),
            ("WORLD_SIZE", "2".into()),
            ("LOCAL_RANK", rank.to_string()),
            ("LOCAL_WORLD_SIZE", "2".into()),
            ("MASTER_ADDR", master.into()),
            ("MASTER_PORT", port.to_string()),
            ("BURN_DIST_JOB_TOKEN", token.clone()),
            ("BURN_DIST_TIMEOUT_S", "20".into()),
        ])
    };
    let mut job = spawn_processes(WORKER, &[0, 1], &env, &|_| strings(&["job"]));
    wait(&mut job, LIMIT)
}

#[test]
fn master_addr_localhost_and_ipv6() {
    for (master, endpoint) in [("localhost", "localhost:"), ("::1", "[::1]:")] {
        let out = pair_at(master);
        assert_all_succeeded(&out);
        for o in &out {
            let line = job_line(o);
            assert!(line.contains(&format!("master={endpoint}")), "{line}");
            assert!(line.ends_with("sum=3"), "{line}");
        }
    }
}

/// A SLURM job id whose derived port (15000 + the last four digits) is free here.
fn slurm_job_id_with_a_free_port() -> u64 {
    let start = u64::from(free_port());
    (start..start + 10_000)
        .find(|id| TcpListener::bind(("0.0.0.0", 15000 + (id % 10000) as u16)).is_ok())
        .expect("a free port in 15000..25000")
}

#[test]
fn slurm_variables_alone_start_a_job() {
    let job_id = slurm_job_id_with_a_free_port();
    let env = |rank: usize| {
        vars(&[
            ("SLURM_PROCID", rank.to_string()),
            ("SLURM_LOCALID", rank.to_string()),
            ("SLURM_NTASKS", "2".into()),
            ("SLURM_NODEID", "0".into()),
            ("SLURM_TASKS_PER_NODE", "2".into()),
            ("SLURM_JOB_NODELIST", "localhost".into()),
            ("SLURM_JOB_ID", job_id.to_string()),
            ("BURN_DIST_TIMEOUT_S", "20".into()),
        ])
    };
    let mut job = spawn_processes(WORKER, &[0, 1], &env, &|_| strings(&["job"]));
    let out = wait(&mut job, LIMIT);
    assert_all_succeeded(&out);
    let port = 15000 + job_id % 10000;
    for (rank, o) in out.iter().enumerate() {
        let line = job_line(o);
        assert!(
            line.contains(&format!(
                "rank={rank} world=2 local={rank}/2 master=localhost:{port} store=own"
            )),
            "{line}"
        );
        assert!(line.ends_with("sum=3"), "{line}");
    }
}

/// torchrun from `BURN_DIST_TORCHRUN` or the `PATH`.
fn torchrun() -> Option<String> {
    if let Ok(path) = std::env::var("BURN_DIST_TORCHRUN") {
        return Some(path);
    }
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join("torchrun"))
        .find(|p| p.is_file())
        .map(|p| p.to_string_lossy().into_owned())
}

/// Ignored by default (`cargo test` cannot provide torchrun); `.ci/run` runs it when torchrun is
/// on the PATH, and `cargo test -p burn-dist --test launchers -- --ignored` by hand.
#[test]
#[ignore = "needs torchrun on PATH (pip install torch) or BURN_DIST_TORCHRUN=/path/to/torchrun"]
fn a_real_torchrun_runs_two_ranks_on_its_own_store() {
    let torchrun = torchrun().expect(
        "torchrun not found: pip install torch, or set BURN_DIST_TORCHRUN=/path/to/torchrun",
    );
    let port = free_port();
    let rdzv_id = job_token("burn-test");
    let out = output_within(
        clean_command(&torchrun)
            .args(["--nproc-per-node", "2", "--master-addr", "localhost"])
            .args(["--master-port", &port.to_string(), "--rdzv-id", &rdzv_id])
            .args(["--no-python", WORKER, "job"])
            .env("BURN_DIST_TIMEOUT_S", "30"),
        LIMIT,
    );
    let (stdout, stderr) = (&out.stdout, &out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    for rank in 0..2 {
        let line = format!(
            "JOB rank={rank} world=2 local={rank}/2 master=localhost:{port} \
             store=torch-agent:/burn-dist/{rdzv_id}/attempt_0/ sum=3"
        );
        assert!(
            stdout.contains(&line),
            "missing {line:?} in\n{stdout}\n{stderr}"
        );
    }
}
