//! The one error type of `burn-dist`.

use std::time::Duration;

/// Everything that can go wrong in `burn-dist`. Every message says what to check or do next.
#[derive(Debug, thiserror::Error)]
pub enum DistError {
    /// An environment variable has a value that cannot be used.
    #[error("environment variable {var}={value:?} is invalid: {reason}")]
    InvalidEnv {
        /// The variable name.
        var: String,
        /// Its value.
        value: String,
        /// Why it cannot be used.
        reason: String,
    },
    /// A required environment variable is missing.
    #[error("environment variable {var} is not set: {reason}")]
    MissingEnv {
        /// The variable name.
        var: String,
        /// Why it is needed.
        reason: String,
    },
    /// The store address of rank 0 could not be reached.
    #[error(
        "rank {rank} could not connect to the rendezvous store at {addr} within {}s: {source}; \
         check MASTER_ADDR/MASTER_PORT, that rank 0 is running and that port {port} is open on rank 0's host",
        waited.as_secs_f64(), port = addr.rsplit(':').next().unwrap_or("?")
    )]
    StoreConnect {
        /// This process's rank.
        rank: usize,
        /// The address tried.
        addr: String,
        /// How long we tried.
        waited: Duration,
        /// The last I/O error.
        source: std::io::Error,
    },
    /// Rank 0 could not listen on the store port.
    #[error(
        "rank 0 could not listen on {addr} for the rendezvous store: {source}; the port is probably in use \
         (another job?): choose another MASTER_PORT / --master-port"
    )]
    PortInUse {
        /// The address that failed to bind.
        addr: String,
        /// The bind error.
        source: std::io::Error,
    },
    /// The host of the rendezvous store does not resolve to an address.
    #[error(
        "MASTER_ADDR {host:?} does not resolve to an address on this host ({source}); set MASTER_ADDR \
         (--master-addr) to a name or IP address of rank 0's host that every node can resolve"
    )]
    Resolve {
        /// The host name.
        host: String,
        /// The resolver's error.
        source: std::io::Error,
    },
    /// Some ranks never arrived at a rendezvous point (store barrier, wait).
    #[error(
        "ranks {missing:?} did not reach {what} at {addr} within {}s; check that they were started, \
         MASTER_ADDR and that the port is open on rank 0's host",
        waited.as_secs_f64()
    )]
    RendezvousTimeout {
        /// What was waited for (e.g. "the rendezvous", "barrier 'init'").
        what: String,
        /// Ranks that did not arrive.
        missing: Vec<usize>,
        /// The store address.
        addr: String,
        /// How long we waited.
        waited: Duration,
    },
    /// A store key did not appear in time.
    #[error("store key {key:?} did not appear within {}s at {addr}; the rank that should set it may have died or hung", waited.as_secs_f64())]
    StoreTimeout {
        /// The key.
        key: String,
        /// The store address.
        addr: String,
        /// How long we waited.
        waited: Duration,
    },
    /// The store connection failed or the server answered something unexpected.
    #[error(
        "rendezvous store at {addr}: {detail}; the process serving the store (rank 0, or torchrun's \
         agent) may have exited"
    )]
    Store {
        /// The store address.
        addr: String,
        /// What happened.
        detail: String,
        /// The I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The store rejected the handshake (wrong token or version).
    #[error(
        "rendezvous store at {addr} rejected rank {rank}'s handshake ({reason}); was this process \
         started by the same job (on several nodes, give every node's launcher the same --rdzv-id or \
         BURN_DIST_JOB_TOKEN) and the same burn-dist version?"
    )]
    Handshake {
        /// The store address.
        addr: String,
        /// Our rank.
        rank: usize,
        /// The reason.
        reason: String,
    },
    /// A server (the store, or the next rank's ring port) could not prove that it holds the job
    /// token, or does not speak burn-dist's handshake.
    #[error(
        "rank {rank} refused {addr}: {reason}; is another job or program listening there (a \
         different BURN_DIST_JOB_TOKEN or --rdzv-id, or a stale MASTER_PORT)?"
    )]
    Unproven {
        /// The address we connected to.
        addr: String,
        /// Our rank.
        rank: usize,
        /// What was wrong.
        reason: String,
    },
    /// The job would be reachable off loopback with an empty token.
    #[error("rank {rank}: {detail}")]
    NoJobToken {
        /// Our rank.
        rank: usize,
        /// Which address, and how to set a token.
        detail: String,
    },
    /// A peer rank died, hung or closed its connection during a collective.
    #[error(
        "{op} failed on rank {rank}: peer rank {peer} {detail}; check rank {peer}'s output \
         (crashed, killed, out of memory?) and the network between the hosts"
    )]
    PeerFailed {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank that failed (root cause when known).
        peer: usize,
        /// What was observed.
        detail: String,
    },
    /// A collective did not complete before its deadline.
    #[error("{op} on rank {rank} did not complete within {}s waiting for rank {peer}; rank {peer} may be hung, slower, or running a different collective", deadline.as_secs_f64())]
    Timeout {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank we were waiting for.
        peer: usize,
        /// The deadline.
        deadline: Duration,
    },
    /// An NCCL operation did not complete before its deadline; the communicator was aborted.
    #[error(
        "{op} on rank {rank} did not complete within {}s and the NCCL communicator was aborted; NCCL does not \
         say which rank is missing: look for a rank that died, hung or runs a different collective \
         (NCCL_DEBUG=INFO helps)",
        deadline.as_secs_f64()
    )]
    NcclTimeout {
        /// The operation.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The deadline.
        deadline: Duration,
    },
    /// Ranks called different collectives, or with different sizes/types.
    #[error(
        "collective mismatch on rank {rank}: this rank runs {ours}, rank {peer} runs {theirs}; every rank must issue the same collectives in the same order"
    )]
    CollectiveMismatch {
        /// This rank.
        rank: usize,
        /// The peer.
        peer: usize,
        /// Our description.
        ours: String,
        /// Theirs.
        theirs: String,
    },
    /// Another rank found a collective mismatch; this rank saw its echo.
    #[error(
        "collective mismatch found by rank {observer}: {detail}; every rank must issue the same collectives in the same order (seen from rank {rank})"
    )]
    MismatchReported {
        /// This rank.
        rank: usize,
        /// The rank that found the mismatch.
        observer: usize,
        /// Which ranks ran what.
        detail: String,
    },
    /// A collective passed its deadline and the progress board names the rank holding it up.
    #[error(
        "{op} on rank {rank} did not complete within {}s: rank {peer} {detail}; look at rank {peer} (a debugger, py-spy-like stack dump, or its last output)",
        deadline.as_secs_f64()
    )]
    Unresponsive {
        /// The collective.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The rank holding the job up.
        peer: usize,
        /// What the progress board shows about it.
        detail: String,
        /// The deadline.
        deadline: Duration,
    },
    /// The communicator is unusable after an earlier failure.
    #[error(
        "the communicator of rank {rank} is broken after an earlier error ({first}); restart the job (resume from the last checkpoint)"
    )]
    Broken {
        /// This rank.
        rank: usize,
        /// The first error.
        first: String,
    },
    /// The models differ across ranks.
    #[error(
        "model mismatch between rank {rank} and rank {other_rank}: {difference}; every rank must build the same model (same config, same code)"
    )]
    ModelMismatch {
        /// This rank.
        rank: usize,
        /// The rank compared with.
        other_rank: usize,
        /// The first difference.
        difference: String,
    },
    /// Buffers passed to a collective have inconsistent sizes.
    #[error("{op}: invalid buffer sizes: {detail}")]
    InvalidBuffer {
        /// The collective.
        op: &'static str,
        /// What is wrong.
        detail: String,
    },
    /// A tensor could not be read back from the backend.
    #[error("could not read tensor data from the backend during {op}: {detail}")]
    TensorData {
        /// The operation.
        op: &'static str,
        /// The backend's message.
        detail: String,
    },
    /// Optimizer state could not be (de)serialised for a broadcast.
    #[error("optimizer state broadcast: {detail}")]
    Record {
        /// What happened.
        detail: String,
    },
    /// The NCCL backend was asked for but the crate was built without the `cuda` feature.
    #[error(
        "the NCCL backend needs burn-dist built with the `cuda` cargo feature; rebuild with `--features cuda` or use the host backend"
    )]
    NotCompiledWithCuda,
    /// NCCL (or the CUDA driver) cannot be loaded.
    #[error("{library} could not be loaded (tried {tried:?}); {hint}")]
    LibraryMissing {
        /// "NCCL" or "the CUDA driver".
        library: &'static str,
        /// The file names tried.
        tried: Vec<String>,
        /// How to fix it.
        hint: String,
    },
    /// An NCCL or CUDA call failed.
    #[error(
        "{op} failed on rank {rank}: {detail}; set NCCL_DEBUG=INFO for details (and NCCL_SOCKET_IFNAME if the wrong network interface is used)"
    )]
    Nccl {
        /// The call.
        op: &'static str,
        /// This rank.
        rank: usize,
        /// The error.
        detail: String,
    },
    /// The launcher could not start or supervise workers.
    #[error("launcher: {detail}")]
    Launch {
        /// What happened.
        detail: String,
        /// The I/O error, if any.
        #[source]
        source: Option<std::io::Error>,
    },
    /// The launcher got a signal (Ctrl-C, SIGTERM from a scheduler) and passed it to the workers.
    #[error("launcher: interrupted by signal {signal}; {}", match exit_code {
        Some(code) => format!("every rank exited with code {code}, which the launcher exits with"),
        None => "stopped all ranks".to_string(),
    })]
    Interrupted {
        /// The first signal the launcher got.
        signal: i32,
        /// The exit code every rank exited with, when they all agree (75: saved and stopped).
        exit_code: Option<i32>,
    },
    /// A worker exited with failure.
    #[error(
        "rank {rank} (pid {pid}) exited with {status}; root cause: {cause}; the other ranks were stopped"
    )]
    WorkerFailed {
        /// The rank the failure is blamed on (the workers' own reports decide; else the first
        /// rank to exit non-zero).
        rank: usize,
        /// Its process id.
        pid: u32,
        /// How it exited.
        status: String,
        /// What happened to it, in its own words or another rank's.
        cause: String,
    },
    /// Network I/O failed outside a collective (setting up peer connections).
    #[error("rank {rank}: {what} ({addr}): {source}")]
    Io {
        /// This rank.
        rank: usize,
        /// What was being done.
        what: String,
        /// The address involved.
        addr: String,
        /// The error.
        source: std::io::Error,
    },
}

impl DistError {
    /// Whether this error is this rank's own (bad data, a record that does not load), as opposed
    /// to a failure of the job seen through the communicator: the other ranks do not know about
    /// it unless told ([`crate::Communicator::abort`]).
    pub fn is_local(&self) -> bool {
        matches!(
            self,
            DistError::TensorData { .. }
                | DistError::Record { .. }
                | DistError::InvalidBuffer { .. }
        )
    }
}

/// Result alias of `burn-dist`.
pub type Result<T, E = DistError> = std::result::Result<T, E>;
