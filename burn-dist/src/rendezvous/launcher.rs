//! The launcher: re-executes the current binary once per local rank with torchrun's environment,
//! prefixes the workers' output with their rank, forwards Ctrl-C, SIGTERM, SIGHUP and SIGUSR1/2
//! (a second request stops at once), and stops everyone as soon as one worker fails.

use crate::error::{DistError, Result};
use crate::rendezvous::world::{DEFAULT_MASTER_PORT, JOB_TOKEN_ENV, QUIET_ENV, World};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::os::unix::process::ExitStatusExt;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicI32, Ordering};
use std::time::{Duration, Instant};

/// How long workers get to exit after the launcher's own SIGTERM (a rank failed) before SIGKILL.
const GRACE: Duration = Duration::from_secs(5);
/// How long workers get after a forwarded SIGTERM/SIGINT/SIGHUP before SIGKILL, unless
/// [`STOP_GRACE_ENV`] says otherwise: time to reach a step boundary and save (torchrun's agent
/// and SLURM's default `KillWait` give 30 s too).
const STOP_GRACE: Duration = Duration::from_secs(30);
/// Seconds the workers get after a forwarded stop signal (default 30).
pub const STOP_GRACE_ENV: &str = "BURN_DIST_STOP_GRACE_S";
/// A signal this soon after the first is the same request (SLURM signals every process of a
/// step, the launcher too); a later one means "stop now".
const SAME_REQUEST: Duration = Duration::from_secs(2);
/// When a worker fails, how long the others may take to notice, report what they saw (their error
/// files name the root cause) and exit by themselves, before they get SIGTERM.
const REPORT_GRACE: Duration = Duration::from_secs(3);

/// Launcher options (torchrun's `--nproc-per-node --nnodes --node-rank --master-addr --master-port
/// --rdzv-id`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LaunchConfig {
    /// Processes on this node; `None` = number of visible CUDA devices (with the `cuda` feature and
    /// a driver), else 1.
    pub nproc_per_node: Option<usize>,
    /// Number of nodes.
    pub nnodes: usize,
    /// This node's index, `0..nnodes`.
    pub node_rank: usize,
    /// Host of rank 0 (node 0).
    pub master_addr: String,
    /// Port of rank 0's rendezvous store; 0 on a single node picks a free port.
    pub master_port: u16,
    /// Identity of the job, the same on every node (torchrun's `--rdzv-id`): the store admits only
    /// ranks of this job. Needed with several nodes unless `BURN_DIST_JOB_TOKEN` is set; it is
    /// not a secret (set `BURN_DIST_JOB_TOKEN` on networks shared with others).
    pub rdzv_id: Option<String>,
}

impl Default for LaunchConfig {
    fn default() -> Self {
        Self {
            nproc_per_node: None,
            nnodes: 1,
            node_rank: 0,
            master_addr: "127.0.0.1".into(),
            master_port: DEFAULT_MASTER_PORT,
            rdzv_id: None,
        }
    }
}

/// The token every rank of the job presents to the store: the same on every node, from
/// `--rdzv-id` and/or `BURN_DIST_JOB_TOKEN` (`env_token`); made up when the job has one node.
///
/// # Errors
/// [`DistError::Launch`] with several nodes and neither given (each node would make up its own).
fn job_token(config: &LaunchConfig, env_token: Option<String>) -> Result<String> {
    let rdzv_id = config
        .rdzv_id
        .as_deref()
        .map(str::trim)
        .filter(|id| !id.is_empty());
    let env_token = env_token.filter(|t| !t.is_empty());
    match (rdzv_id, env_token) {
        (Some(id), Some(secret)) => Ok(format!("{id}/{secret}")),
        (Some(id), None) => Ok(id.to_string()),
        (None, Some(secret)) => Ok(secret),
        (None, None) if config.nnodes > 1 => Err(DistError::Launch {
            detail: format!(
                "--nnodes {} needs one job identity shared by every node's launcher: pass the same \
                 --rdzv-id <ID> on every node (e.g. --rdzv-id $SLURM_JOB_ID, or any name unique to \
                 this job), or export the same BURN_DIST_JOB_TOKEN=<secret> on every node",
                config.nnodes
            ),
            source: None,
        }),
        (None, None) => Ok(format!(
            "{:016x}{:016x}",
            rand::random::<u64>(),
            rand::random::<u64>()
        )),
    }
}

/// Number of CUDA devices visible to this process (0 without the `cuda` feature or a driver).
/// Never panics: the driver library is probed before any call.
pub fn visible_cuda_devices() -> usize {
    #[cfg(feature = "cuda")]
    {
        crate::comm::nccl::cuda_device_count()
    }
    #[cfg(not(feature = "cuda"))]
    {
        0
    }
}

/// Whether this process was started as a worker (torchrun, SLURM, OpenMPI or our launcher's env).
pub fn is_worker_env() -> bool {
    ["RANK", "WORLD_SIZE", "OMPI_COMM_WORLD_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
        || (std::env::var_os("SLURM_PROCID").is_some()
            && std::env::var_os("SLURM_NTASKS").is_some())
}

/// Whether this rank should draw progress bars (false on every rank the launcher marked quiet).
pub fn should_draw_progress() -> bool {
    std::env::var_os(QUIET_ENV).is_none()
}

/// Entry point for binaries: when the environment says we are a worker, or the job has a single
/// process, returns this process's [`World`] so the caller runs the training. Otherwise acts as
/// the launcher: starts the workers, supervises them and exits the process with status 0 when
/// all succeed; on a failure it returns the error (print it and exit non-zero).
///
/// # Errors
/// Invalid worker environment; the launcher's errors ([`DistError::WorkerFailed`],
/// [`DistError::PortInUse`], [`DistError::Launch`]).
pub fn launch_or_run(config: &LaunchConfig) -> Result<World> {
    if is_worker_env() {
        return World::from_env();
    }
    let nproc = config
        .nproc_per_node
        .unwrap_or_else(|| visible_cuda_devices().max(1));
    if nproc * config.nnodes.max(1) <= 1 {
        return World::from_env();
    }
    launch(config, nproc)?;
    std::process::exit(0)
}

static SIGNAL: AtomicI32 = AtomicI32::new(0);

extern "C" fn on_signal(sig: libc::c_int) {
    SIGNAL.store(sig, Ordering::SeqCst);
}

/// Signals that stop the job; SIGUSR1/SIGUSR2 are only passed on (a worker may save on them).
const STOP_SIGNALS: [libc::c_int; 3] = [libc::SIGINT, libc::SIGTERM, libc::SIGHUP];

fn stop_grace() -> Duration {
    std::env::var(STOP_GRACE_ENV)
        .ok()
        .and_then(|s| s.trim().parse::<f64>().ok())
        .filter(|s| s.is_finite() && *s >= 0.0)
        .map_or(STOP_GRACE, Duration::from_secs_f64)
}

fn install_signal_handlers() {
    for sig in [
        libc::SIGINT,
        libc::SIGTERM,
        libc::SIGHUP,
        libc::SIGUSR1,
        libc::SIGUSR2,
    ] {
        let handler: extern "C" fn(libc::c_int) = on_signal;
        // SAFETY: the handler only stores into an atomic, which is async-signal-safe; `signal`
        // is called with a valid signal number and a valid function pointer.
        unsafe {
            libc::signal(sig, handler as libc::sighandler_t);
        }
    }
}

/// A worker gets SIGKILL when the launcher dies (even by SIGKILL, which leaves it no time to
/// stop them), instead of running on as an orphan until its collective deadline.
fn die_with_launcher(cmd: &mut Command) {
    use std::os::unix::process::CommandExt;
    let launcher = std::process::id() as libc::pid_t;
    // SAFETY: the closure runs in the forked child before exec and only calls prctl(2),
    // getppid(2) and _exit(2), which are async-signal-safe.
    unsafe {
        cmd.pre_exec(move || {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            // The launcher died before the prctl took effect.
            if libc::getppid() != launcher {
                libc::_exit(1);
            }
            Ok(())
        });
    }
}

fn send_signal(child: &Child, sig: libc::c_int) {
    // SAFETY: kill(2) on the pid of a child we spawned and have not reaped yet (callers check
    // `try_wait` first), so the pid cannot have been reused.
    unsafe {
        libc::kill(child.id() as libc::pid_t, sig);
    }
}

fn describe(status: ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exit code {code}");
    }
    match status.signal() {
        Some(s) => {
            let name = match s {
                libc::SIGKILL => " (SIGKILL: killed, e.g. out of memory)",
                libc::SIGSEGV => " (SIGSEGV)",
                libc::SIGABRT => " (SIGABRT)",
                libc::SIGTERM => " (SIGTERM)",
                libc::SIGINT => " (SIGINT)",
                libc::SIGBUS => " (SIGBUS)",
                _ => "",
            };
            format!("signal {s}{name}")
        }
        None => "an unknown status".to_string(),
    }
}

fn pump(
    rank: usize,
    src: impl Read + Send + 'static,
    to_stderr: bool,
) -> std::thread::JoinHandle<()> {
    std::thread::spawn(move || {
        let mut r = BufReader::new(src);
        let mut line = Vec::new();
        loop {
            line.clear();
            match r.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {
                    // Progress-bar redraws (\r) of quiet ranks are reduced to their last state.
                    let text = line
                        .rsplit(|b| *b == b'\r')
                        .find(|s| !s.is_empty() && *s != b"\n")
                        .unwrap_or(&line);
                    let mut out = Vec::with_capacity(text.len() + 12);
                    out.extend_from_slice(format!("[rank {rank}] ").as_bytes());
                    out.extend_from_slice(text);
                    if !out.ends_with(b"\n") {
                        out.push(b'\n');
                    }
                    let _ = if to_stderr {
                        std::io::stderr().lock().write_all(&out)
                    } else {
                        std::io::stdout().lock().write_all(&out)
                    };
                }
            }
        }
    })
}

/// Starts `nproc` workers on this node (re-executing the current binary with the same arguments)
/// and supervises them until all exit.
///
/// # Errors
/// [`DistError::PortInUse`] when node 0 cannot bind the master port; [`DistError::Launch`] when a
/// worker cannot be started or on Ctrl-C/SIGTERM; [`DistError::WorkerFailed`] naming the first
/// rank that failed (the others are stopped within seconds).
pub fn launch(config: &LaunchConfig, nproc: usize) -> Result<()> {
    let nnodes = config.nnodes.max(1);
    if config.node_rank >= nnodes {
        return Err(DistError::Launch {
            detail: format!(
                "--node-rank {} must be smaller than --nnodes {nnodes}",
                config.node_rank
            ),
            source: None,
        });
    }
    let token = job_token(config, std::env::var(JOB_TOKEN_ENV).ok())?;
    let mut port = config.master_port;
    if config.node_rank == 0 {
        let bind = format!("0.0.0.0:{port}");
        let l = TcpListener::bind(&bind).map_err(|source| DistError::PortInUse {
            addr: bind.clone(),
            source,
        })?;
        if port == 0 {
            port = l
                .local_addr()
                .map(|a| a.port())
                .map_err(|source| DistError::PortInUse { addr: bind, source })?;
        }
    } else if port == 0 {
        return Err(DistError::Launch {
            detail: "--master-port 0 (pick a free port) only works with a single node".into(),
            source: None,
        });
    }
    let exe = std::env::current_exe().map_err(|e| DistError::Launch {
        detail: "cannot find the current executable".into(),
        source: Some(e),
    })?;
    let args: Vec<std::ffi::OsString> = std::env::args_os().skip(1).collect();
    let world_size = nproc * nnodes;
    install_signal_handlers();
    let reports = ReportDir::create()?;
    let mut children: Vec<(usize, Child)> = Vec::with_capacity(nproc);
    let mut pumps = Vec::new();
    let mut spawn_err = None;
    for local in 0..nproc {
        let rank = config.node_rank * nproc + local;
        let mut cmd = Command::new(&exe);
        cmd.args(&args)
            .env("RANK", rank.to_string())
            .env("WORLD_SIZE", world_size.to_string())
            .env("LOCAL_RANK", local.to_string())
            .env("LOCAL_WORLD_SIZE", nproc.to_string())
            .env("GROUP_RANK", config.node_rank.to_string())
            .env("MASTER_ADDR", &config.master_addr)
            .env("MASTER_PORT", port.to_string())
            .env(JOB_TOKEN_ENV, &token)
            .env(crate::error_file::ERROR_FILE_ENV, reports.path(rank));
        die_with_launcher(&mut cmd);
        if rank != 0 {
            cmd.env(QUIET_ENV, "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
        }
        match cmd.spawn() {
            Ok(mut child) => {
                if let Some(o) = child.stdout.take() {
                    pumps.push(pump(rank, o, false));
                }
                if let Some(e) = child.stderr.take() {
                    pumps.push(pump(rank, e, true));
                }
                children.push((rank, child));
            }
            Err(e) => {
                spawn_err = Some(DistError::Launch {
                    detail: format!("could not start rank {rank} ({})", exe.display()),
                    source: Some(e),
                });
                break;
            }
        }
    }
    let mut statuses = vec![None; children.len()];
    let result = supervise(&mut children, &mut statuses, spawn_err);
    for p in pumps {
        let _ = p.join();
    }
    result.map_err(|e| blame_root_cause(e, &children, &statuses, &reports))
}

/// A private folder for the workers' error files, removed when the launcher returns.
struct ReportDir {
    dir: std::path::PathBuf,
}

impl ReportDir {
    fn create() -> Result<Self> {
        let dir = std::env::temp_dir().join(format!(
            "burn-dist-errors-{}-{:x}",
            std::process::id(),
            rand::random::<u64>()
        ));
        std::fs::create_dir(&dir).map_err(|e| DistError::Launch {
            detail: format!(
                "cannot create {} for the workers' error files",
                dir.display()
            ),
            source: Some(e),
        })?;
        Ok(Self { dir })
    }

    fn path(&self, rank: usize) -> std::path::PathBuf {
        self.dir.join(format!("rank-{rank}.json"))
    }
}

impl Drop for ReportDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Names the root cause of a failed job from the workers' own reports (what each one saw, see
/// [`crate::error_file`]) instead of the first worker that happened to exit.
fn blame_root_cause(
    error: DistError,
    children: &[(usize, Child)],
    statuses: &[Option<String>],
    reports: &ReportDir,
) -> DistError {
    let DistError::WorkerFailed { .. } = error else {
        return error;
    };
    let read: Vec<crate::error_file::Report> = children
        .iter()
        .filter_map(|(rank, _)| crate::error_file::read_report(&reports.path(*rank)))
        .collect();
    let Some(report) = crate::error_file::root_cause(&read) else {
        return error;
    };
    let blamed = report.root_cause;
    let words = report.message.lines().collect::<Vec<_>>().join(" / ");
    let cause = if report.rank == blamed {
        words
    } else {
        format!("rank {} reports: {words}", report.rank)
    };
    match children.iter().position(|(r, _)| *r == blamed) {
        Some(i) => DistError::WorkerFailed {
            rank: blamed,
            pid: children[i].1.id(),
            status: statuses[i].clone().unwrap_or_else(|| "no status".into()),
            cause,
        },
        // A rank of another node: its own launcher names how it ended.
        None => DistError::WorkerFailed {
            rank: blamed,
            pid: 0,
            status: "an unknown status (it runs on another node)".into(),
            cause,
        },
    }
}

fn supervise(
    children: &mut [(usize, Child)],
    statuses: &mut [Option<String>],
    mut failure: Option<DistError>,
) -> Result<()> {
    let mut running: Vec<bool> = vec![true; children.len()];
    let mut exit_codes: Vec<Option<i32>> = vec![None; children.len()];
    // The first signal the launcher got, and when.
    let mut signalled: Option<(libc::c_int, Instant)> = None;
    let mut stop_deadline: Option<Instant> = None;
    let mut killed = false;
    // When to send SIGTERM: at once for a launcher failure, after REPORT_GRACE for a worker's.
    let mut term_at = failure.is_some().then(Instant::now);
    loop {
        for (i, (rank, child)) in children.iter_mut().enumerate() {
            if !running[i] {
                continue;
            }
            match child.try_wait() {
                Ok(Some(status)) => {
                    running[i] = false;
                    statuses[i] = Some(describe(status));
                    exit_codes[i] = status.code();
                    if !status.success() && failure.is_none() {
                        failure = Some(DistError::WorkerFailed {
                            rank: *rank,
                            pid: child.id(),
                            status: describe(status),
                            cause: format!("see rank {rank}'s output above"),
                        });
                        // After a forwarded signal the others are stopping already (maybe
                        // saving): the stop deadline bounds them.
                        if signalled.is_none() {
                            term_at = Some(Instant::now() + REPORT_GRACE);
                        }
                    }
                }
                Ok(None) => {}
                Err(e) => {
                    running[i] = false;
                    failure.get_or_insert(DistError::Launch {
                        detail: format!("cannot wait for rank {rank}"),
                        source: Some(e),
                    });
                }
            }
        }
        if !running.iter().any(|r| *r) {
            break;
        }
        let sig = SIGNAL.swap(0, Ordering::SeqCst);
        match (sig, signalled) {
            (0, _) => {}
            (_, None) => {
                signalled = Some((sig, Instant::now()));
                terminate(children, &running, sig);
                if STOP_SIGNALS.contains(&sig) {
                    stop_deadline.get_or_insert(Instant::now() + stop_grace());
                }
            }
            // A second request: stop now, without waiting for a checkpoint.
            (_, Some((_, first))) if first.elapsed() >= SAME_REQUEST && !killed => {
                terminate(children, &running, libc::SIGKILL);
                killed = true;
            }
            _ => {}
        }
        if term_at.is_some_and(|t| Instant::now() >= t) {
            term_at = None;
            terminate(children, &running, libc::SIGTERM);
            stop_deadline.get_or_insert(Instant::now() + GRACE);
        }
        if let Some(d) = stop_deadline
            && !killed
            && Instant::now() >= d
        {
            terminate(children, &running, libc::SIGKILL);
            killed = true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    if let Some((signal, _)) = signalled {
        // Every rank exited with the same code after the signal (say, "saved, run me again"):
        // the launcher exits with it too, so a requeue script or torchrun sees what the ranks said.
        let same_code = exit_codes
            .first()
            .copied()
            .flatten()
            .filter(|c| exit_codes.iter().all(|e| *e == Some(*c)));
        if same_code == Some(0) {
            // The job had finished its work when the signal came.
            return Ok(());
        }
        // A forwarded SIGUSR1 that killed a rank is that rank's failure, named below.
        if same_code.is_some() || STOP_SIGNALS.contains(&signal) {
            return Err(DistError::Interrupted {
                signal,
                exit_code: same_code,
            });
        }
    }
    match failure {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

fn terminate(children: &[(usize, Child)], running: &[bool], sig: libc::c_int) {
    for (i, (_, child)) in children.iter().enumerate() {
        if running[i] {
            send_signal(child, sig);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn config(nnodes: usize, rdzv_id: Option<&str>) -> LaunchConfig {
        LaunchConfig {
            nnodes,
            rdzv_id: rdzv_id.map(str::to_string),
            ..LaunchConfig::default()
        }
    }

    #[test]
    fn every_node_derives_the_same_token() {
        let id = Some("job-42");
        assert_eq!(job_token(&config(2, id), None).expect("id"), "job-42");
        assert_eq!(
            job_token(&config(2, None), Some("s3cret".into())).expect("env"),
            "s3cret"
        );
        assert_eq!(
            job_token(&config(2, id), Some("s3cret".into())).expect("both"),
            "job-42/s3cret"
        );
        // One node: a fresh token per launch.
        let a = job_token(&config(1, None), None).expect("single node");
        let b = job_token(&config(1, None), None).expect("single node");
        assert_ne!(a, b);
        assert_eq!(a.len(), 32);
    }

    #[test]
    fn several_nodes_without_an_identity_say_how_to_fix_it() {
        for (cfg, env) in [
            (config(2, None), None),
            (config(3, Some("  ")), Some(String::new())),
        ] {
            let e = job_token(&cfg, env).expect_err("no identity");
            let text = e.to_string();
            assert!(
                text.contains("--rdzv-id") && text.contains("BURN_DIST_JOB_TOKEN"),
                "{text}"
            );
        }
    }
}
