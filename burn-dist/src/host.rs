//! The host backend: a ring over TCP between processes (reduce-scatter then all-gather, as in
//! Baidu's ring all-reduce and NCCL's ring algorithm), chunked and pipelined: a sender thread
//! writes to the next rank while the calling thread reads from the previous one and reduces.

use crate::comm::{Communicator, DType, Element, HostBuf, ReduceOp, with_slice};
use crate::error::{DistError, Result};
use crate::failure::{self, Kind, Record};
use crate::store::Store;
use crate::wire::{self, ConnKind, HandshakeError};
use crate::world::World;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Bytes per pipelined chunk.
const CHUNK_BYTES: usize = 1 << 20;
/// How long rank 0 keeps serving the store after a failed collective.
const STORE_LINGER: Duration = Duration::from_secs(2);
/// Ring connections in their handshake at once; a new one beyond that closes the oldest.
const MAX_PENDING_HANDSHAKES: usize = 64;
/// IP address this rank advertises for its ring connections (default: the local address of its
/// connection to rank 0's store).
pub const ADDR_ENV: &str = "BURN_DIST_ADDR";

/// Largest per-step message sent from the calling thread (no sender thread): small enough that
/// the n-1 steps a rank may run ahead always fit in the socket buffers.
const INLINE_MAX_BYTES: usize = 16 << 10;
/// All-reduces from this size on go through shared memory when every rank is on one machine.
const SHM_MIN_BYTES: usize = 32 << 10;
/// Set to 0 to keep same-machine ranks on the TCP ring (no shared-memory segments).
pub const SHM_ENV: &str = "BURN_DIST_SHM";
/// Socket buffer size requested (the kernel may clamp it).
const SOCKET_BUFFER: libc::c_int = 8 << 20;

const OP_ALL_REDUCE: u8 = 1;
const OP_BROADCAST: u8 = 2;
const OP_ALL_GATHER: u8 = 3;

/// Longest single wait on a ring socket: between waits the deadline is checked again, so a peer
/// that trickles bytes cannot stretch a collective past it.
const WAIT_SLICE: Duration = Duration::from_secs(1);

/// A ring connection whose reads and writes fail once the current collective's deadline passes,
/// however the peer paces its bytes (a socket timeout alone restarts with every byte).
struct Link {
    stream: TcpStream,
    deadline: Instant,
    /// The socket timeout last set, to skip redundant `setsockopt` calls.
    read_wait: Option<Duration>,
    write_wait: Option<Duration>,
}

impl Link {
    fn new(stream: TcpStream) -> Self {
        Self {
            stream,
            deadline: Instant::now(),
            read_wait: None,
            write_wait: None,
        }
    }

    /// The wait for the next socket call: the time left, at most [`WAIT_SLICE`]; `None` once
    /// the deadline has passed.
    fn next_wait(&self) -> Option<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        (!left.is_zero()).then(|| left.min(WAIT_SLICE))
    }

    fn expired() -> io::Error {
        io::Error::new(io::ErrorKind::TimedOut, "the collective's deadline passed")
    }
}

impl Read for Link {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        loop {
            let wait = self.next_wait().ok_or_else(Self::expired)?;
            if self.read_wait != Some(wait) && (wait < WAIT_SLICE || self.read_wait.is_none()) {
                self.stream.set_read_timeout(Some(wait))?;
                self.read_wait = Some(wait);
            }
            match self.stream.read(buf) {
                Err(e) if is_timeout(&e) => continue,
                r => return r,
            }
        }
    }
}

impl Write for Link {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        loop {
            let wait = self.next_wait().ok_or_else(Self::expired)?;
            if self.write_wait != Some(wait) && (wait < WAIT_SLICE || self.write_wait.is_none()) {
                self.stream.set_write_timeout(Some(wait))?;
                self.write_wait = Some(wait);
            }
            match self.stream.write(buf) {
                Err(e) if is_timeout(&e) => continue,
                r => return r,
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.stream.flush()
    }
}

struct Links {
    /// To rank `rank + 1`.
    next: Link,
    /// From rank `rank - 1`.
    prev: Link,
    seq: u64,
    broken: Option<String>,
    /// Every rank's shared-memory segment, when all ranks are on this machine.
    shm: Option<crate::shm::Segments>,
}

/// Ring communicator over TCP; works on one machine and across machines.
pub struct Host {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    store: Option<Arc<Store>>,
    links: Option<Mutex<Links>>,
    /// The collective this rank is in, for the progress board.
    activity: Arc<failure::Activity>,
    /// Publishes `activity` while the communicator lives.
    _publisher: Option<failure::Publisher>,
}

impl std::fmt::Debug for Host {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Host")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

fn io_err(rank: usize, what: &str, addr: &str, source: io::Error) -> DistError {
    DistError::Io {
        rank,
        what: what.to_string(),
        addr: addr.to_string(),
        source,
    }
}

fn tune(s: &TcpStream, timeout: Duration) -> io::Result<()> {
    s.set_nodelay(true)?;
    s.set_read_timeout(Some(timeout))?;
    s.set_write_timeout(Some(timeout))?;
    use std::os::fd::AsRawFd;
    for opt in [libc::SO_SNDBUF, libc::SO_RCVBUF] {
        let v: libc::c_int = SOCKET_BUFFER;
        // SAFETY: `s` owns a valid socket fd for the duration of the call, and we pass a pointer to
        // a live c_int with its exact size, as setsockopt requires.
        unsafe {
            libc::setsockopt(
                s.as_raw_fd(),
                libc::SOL_SOCKET,
                opt,
                (&v as *const libc::c_int).cast(),
                std::mem::size_of::<libc::c_int>() as libc::socklen_t,
            );
        }
    }
    Ok(())
}

impl Host {
    /// A communicator for a world of one process: every collective is a no-op.
    pub fn single() -> Self {
        Self {
            rank: 0,
            world_size: 1,
            timeout: crate::comm::DEFAULT_TIMEOUT,
            store: None,
            links: None,
            activity: Arc::default(),
            _publisher: None,
        }
    }

    /// Connects the ring: every rank listens on an ephemeral port, publishes it through `store`,
    /// connects to rank `rank + 1` and accepts rank `rank - 1`. Connections to the listening port
    /// without the job's handshake are dropped and logged.
    ///
    /// # Errors
    /// [`DistError::StoreTimeout`]/[`DistError::RendezvousTimeout`] when a peer does not publish
    /// its address in time; [`DistError::Io`] naming the address that could not be reached.
    pub fn new(world: &World, store: Arc<Store>, timeout: Duration) -> Result<Self> {
        let rank = world.rank;
        let n = world.world_size;
        if n == 1 {
            return Ok(Self {
                rank,
                world_size: 1,
                timeout,
                store: Some(store),
                links: None,
                activity: Arc::default(),
                _publisher: None,
            });
        }
        // The interface that reaches rank 0 is the one peers can reach us on, unless overridden
        // (e.g. when a hostname resolves to 127.0.1.1 on a multi-node job).
        let ip = match std::env::var(ADDR_ENV) {
            Ok(a) => a.trim().parse().map_err(|_| DistError::InvalidEnv {
                var: ADDR_ENV.to_string(),
                value: a.clone(),
                reason: "expected an IP address of this host that the other ranks can reach".into(),
            })?,
            Err(_) => store
                .local_ip()
                .unwrap_or(std::net::IpAddr::from([127, 0, 0, 1])),
        };
        wire::require_token(
            &world.job_token,
            &[ip],
            "the ring (this rank's address for its peers)",
        )
        .map_err(|detail| DistError::NoJobToken { rank, detail })?;
        let listener = TcpListener::bind(SocketAddr::new(ip, 0))
            .map_err(|e| io_err(rank, "binding the ring port", &ip.to_string(), e))?;
        let me = listener
            .local_addr()
            .map_err(|e| io_err(rank, "reading the ring port", &ip.to_string(), e))?;
        store.set(
            &format!("burn-dist/host/addr/{rank}"),
            me.to_string().as_bytes(),
        )?;
        let next_rank = (rank + 1) % n;
        let prev_rank = (rank + n - 1) % n;
        let next_addr = store.get(&format!("burn-dist/host/addr/{next_rank}"), timeout)?;
        let next_addr = String::from_utf8_lossy(&next_addr).into_owned();
        let sa: SocketAddr = next_addr.parse().map_err(|_| DistError::Store {
            addr: store.addr().to_string(),
            detail: format!("rank {next_rank} published an invalid address {next_addr:?}"),
            source: None,
        })?;
        // Connect to next in a thread while accepting prev here (both must progress at once).
        let token = world.job_token.clone();
        let connector = std::thread::spawn(move || -> Result<TcpStream, HandshakeError> {
            let start = Instant::now();
            loop {
                let attempt = TcpStream::connect_timeout(&sa, Duration::from_secs(5))
                    .map_err(HandshakeError::Io)
                    .and_then(|s| {
                        tune(&s, timeout).map_err(HandshakeError::Io)?;
                        let mut timed = wire::Deadline {
                            stream: &s,
                            deadline: Instant::now() + wire::HANDSHAKE_TIMEOUT,
                        };
                        wire::client_handshake(&mut timed, ConnKind::Ring, rank, &token)?;
                        tune(&s, timeout).map_err(HandshakeError::Io)?;
                        Ok(s)
                    });
                match attempt {
                    Ok(s) => return Ok(s),
                    // Refused, or not a rank of this job: retrying will not help.
                    Err(e @ (HandshakeError::Rejected(_) | HandshakeError::Unproven(_))) => {
                        return Err(e);
                    }
                    Err(e) if start.elapsed() >= timeout => return Err(e),
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
            }
        });
        let prev = Self::accept_prev(&listener, rank, prev_rank, &world.job_token, timeout)?;
        let next = connector
            .join()
            .map_err(|_| {
                io_err(
                    rank,
                    "connecting to the next rank (thread panicked)",
                    &next_addr,
                    io::Error::other("panic"),
                )
            })?
            .map_err(|e| match e {
                HandshakeError::Io(e) => io_err(
                    rank,
                    &format!("connecting to rank {next_rank}"),
                    &next_addr,
                    e,
                ),
                HandshakeError::Rejected(reason) => DistError::Unproven {
                    addr: next_addr.clone(),
                    rank,
                    reason: format!("rank {next_rank} refused our handshake ({reason})"),
                },
                HandshakeError::Unproven(reason) => DistError::Unproven {
                    addr: next_addr.clone(),
                    rank,
                    reason: format!("the address rank {next_rank} published: {reason}"),
                },
            })?;
        let activity: Arc<failure::Activity> = Arc::default();
        let publisher = failure::Publisher::start(Arc::clone(&store), rank, Arc::clone(&activity));
        let host = Self {
            rank,
            world_size: n,
            timeout,
            activity,
            _publisher: Some(publisher),
            store: Some(store),
            links: Some(Mutex::new(Links {
                next: Link::new(next),
                prev: Link::new(prev),
                seq: 0,
                broken: None,
                shm: None,
            })),
        };
        host.barrier()?;
        let shm = host.map_shared_memory()?;
        if let Some(mut links) = host.links() {
            links.shm = shm;
        }
        Ok(host)
    }

    /// Accepts connections on the ring port until rank `prev_rank` completes the handshake. Each
    /// handshake runs on its own thread under [`wire::HANDSHAKE_TIMEOUT`], at most
    /// [`MAX_PENDING_HANDSHAKES`] at once (a new one closes the oldest), so idle or garbage
    /// connections cannot hold up the ring.
    fn accept_prev(
        listener: &TcpListener,
        rank: usize,
        prev_rank: usize,
        token: &str,
        timeout: Duration,
    ) -> Result<TcpStream> {
        let addr = listener
            .local_addr()
            .map(|a| a.to_string())
            .unwrap_or_default();
        listener
            .set_nonblocking(true)
            .map_err(|e| io_err(rank, "configuring the ring port", &addr, e))?;
        let pending = Arc::new(wire::Pending::new(MAX_PENDING_HANDSHAKES));
        let (done_tx, done_rx) = mpsc::channel::<(TcpStream, SocketAddr, Result<usize, String>)>();
        let start = Instant::now();
        loop {
            match listener.accept() {
                Ok((s, peer)) => {
                    let (ticket, evicted) = pending.admit(&s);
                    if let Some(old) = evicted {
                        eprintln!(
                            "[burn-dist rank {rank}] closed ring connection from {old}: \
                             {MAX_PENDING_HANDSHAKES} newer ones are in their handshake"
                        );
                    }
                    let (pending, done_tx, token) =
                        (Arc::clone(&pending), done_tx.clone(), token.to_string());
                    let spawned = std::thread::Builder::new()
                        .name("burn-dist-ring-handshake".into())
                        .spawn(move || {
                            let checked = s
                                .set_nonblocking(false)
                                .map_err(|e| e.to_string())
                                .and_then(|()| {
                                    let mut timed = wire::Deadline {
                                        stream: &s,
                                        deadline: Instant::now() + wire::HANDSHAKE_TIMEOUT,
                                    };
                                    wire::server_handshake(&mut timed, ConnKind::Ring, &token)
                                });
                            pending.done(ticket);
                            // The ring may be connected already; then nobody listens.
                            let _ = done_tx.send((s, peer, checked));
                        });
                    if let Err(e) = spawned {
                        eprintln!(
                            "[burn-dist rank {rank}] could not start a handshake thread: {e}"
                        );
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(io_err(rank, "accepting the previous rank", &addr, e)),
            }
            while let Ok((s, peer, checked)) = done_rx.try_recv() {
                match checked {
                    Ok(r) if r == prev_rank => {
                        tune(&s, timeout)
                            .map_err(|e| io_err(rank, "configuring a ring socket", &addr, e))?;
                        return Ok(s);
                    }
                    Ok(r) => eprintln!(
                        "[burn-dist rank {rank}] dropped ring connection from {peer}: rank {r}, expected {prev_rank}"
                    ),
                    Err(reason) => eprintln!(
                        "[burn-dist rank {rank}] dropped ring connection from {peer}: {reason}"
                    ),
                }
            }
            if start.elapsed() >= timeout {
                return Err(DistError::Timeout {
                    op: "connecting the ring",
                    rank,
                    peer: prev_rank,
                    deadline: timeout,
                });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
    }

    /// Decides (identically on every rank) whether large all-reduces go through shared memory:
    /// all ranks on one machine, and every rank created its segment and mapped everyone's. The
    /// segment names are drawn by rank 0 and travel through the store (authenticated by the job
    /// token); each rank unlinks its own once everyone has mapped it.
    fn map_shared_memory(&self) -> Result<Option<crate::shm::Segments>> {
        let Some(store) = &self.store else {
            return Ok(None);
        };
        // Every rank runs the same collectives below whatever it decides locally (the env may
        // differ between ranks); the all-reduces make each decision unanimous.
        let willing = !std::env::var(SHM_ENV).is_ok_and(|v| v == "0");
        let me = format!("{} {}", machine_id(), std::process::id());
        store.set(&format!("burn-dist/host/node/{}", self.rank), me.as_bytes())?;
        let mut machines = Vec::with_capacity(self.world_size);
        let mut pids = Vec::with_capacity(self.world_size);
        for r in 0..self.world_size {
            let v = store.get(&format!("burn-dist/host/node/{r}"), self.timeout)?;
            let v = String::from_utf8_lossy(&v).into_owned();
            let (machine, pid) = v.rsplit_once(' ').unwrap_or(("", "0"));
            machines.push(machine.to_string());
            pids.push(pid.parse::<i32>().unwrap_or(0));
        }
        let willing = willing && machines.iter().all(|m| !m.is_empty() && *m == machines[0]);
        let name_key = "burn-dist/host/shm-name";
        if self.rank == 0 {
            store.set(
                name_key,
                format!("{:032x}", rand::random::<u128>()).as_bytes(),
            )?;
        }
        let name = String::from_utf8_lossy(&store.get(name_key, self.timeout)?).into_owned();
        let unanimous = |ok: bool| -> Result<bool> {
            let mut all = [i64::from(ok)];
            self.all_reduce(HostBuf::I64(&mut all), ReduceOp::Min)?;
            Ok(all[0] == 1)
        };
        let own = willing.then(|| crate::shm::create(&name, self.rank));
        if let Some(Err(e)) = &own {
            eprintln!(
                "[burn-dist rank {}] no shared-memory segment in /dev/shm ({e}); same-machine \
                 all-reduces use the TCP ring",
                self.rank
            );
        }
        let created = unanimous(matches!(own, Some(Ok(_))))?;
        let maps: Option<Vec<memmap2::MmapMut>> = match own {
            Some(Ok(own)) if created => {
                let mut own = Some(own);
                (0..self.world_size)
                    .map(|q| {
                        if q == self.rank {
                            own.take()
                                .ok_or_else(|| std::io::Error::other("mapped twice"))
                        } else {
                            crate::shm::open(&name, q)
                        }
                    })
                    .collect::<std::io::Result<Vec<_>>>()
                    .ok()
            }
            _ => None,
        };
        let mapped = unanimous(maps.is_some())?;
        if willing {
            crate::shm::unlink(&name, self.rank);
        }
        Ok(maps
            .filter(|_| mapped)
            .map(|maps| crate::shm::Segments::new(self.rank, maps, pids)))
    }

    /// Changes the deadline of subsequent collectives.
    pub fn set_timeout(&mut self, timeout: Duration) -> Result<()> {
        self.timeout = timeout;
        if let Some(l) = &self.links {
            let l = l.lock().unwrap_or_else(|e| e.into_inner());
            for s in [&l.next.stream, &l.prev.stream] {
                tune(s, timeout)
                    .map_err(|e| io_err(self.rank, "setting socket timeouts", "", e))?;
            }
        }
        Ok(())
    }

    fn links(&self) -> Option<MutexGuard<'_, Links>> {
        self.links
            .as_ref()
            .map(|l| l.lock().unwrap_or_else(|e| e.into_inner()))
    }

    /// Runs `f` on the links with failure bookkeeping: a failed collective poisons the communicator
    /// and records the root cause in the store for the other ranks.
    fn run(
        &self,
        op: &'static str,
        f: impl FnOnce(&mut Links, &Fail<'_>) -> Result<(), DistError>,
    ) -> Result<()> {
        let Some(mut links) = self.links() else {
            return Ok(());
        };
        if let Some(first) = &links.broken {
            return Err(DistError::Broken {
                rank: self.rank,
                first: first.clone(),
            });
        }
        links.seq += 1;
        // One deadline for the whole collective, whatever the peers' pace.
        let deadline = Instant::now() + self.timeout;
        links.next.deadline = deadline;
        links.prev.deadline = deadline;
        let seq = links.seq;
        self.activity.set(seq, op, true);
        let fail = |e: RingError| self.explain(op, e);
        let result = f(&mut links, &fail);
        self.activity.set(seq, op, false);
        let Err(err) = result else { return Ok(()) };
        links.broken = Some(err.to_string());
        let _ = links.next.stream.shutdown(Shutdown::Both);
        let _ = links.prev.stream.shutdown(Shutdown::Both);
        if self.rank == 0 {
            // Rank 0 serves the store: keep it up a moment so the other ranks can read the root
            // cause before this process (typically) exits on the error.
            std::thread::sleep(STORE_LINGER.min(self.timeout));
        }
        Err(err)
    }

    /// Turns what this rank saw into the job's failure: the first record in the store wins, so
    /// every rank names the same root cause (see [`crate::failure`]).
    fn explain(&self, op: &'static str, e: RingError) -> DistError {
        let n = self.world_size;
        let (peer, detail, timed_out) = match e {
            RingError::Peer(q, e) => (q, e.to_string(), is_timeout(&e)),
            RingError::Recv(e) => ((self.rank + n - 1) % n, e.to_string(), is_timeout(&e)),
            RingError::Send(e) => ((self.rank + 1) % n, e.to_string(), is_timeout(&e)),
            RingError::Mismatch { ours, theirs } => {
                let peer = (self.rank + n - 1) % n;
                if let Some(store) = &self.store {
                    failure::publish(
                        store,
                        &Record {
                            kind: Kind::Mismatch,
                            rank: peer,
                            observer: self.rank,
                            detail: format!(
                                "rank {} runs {ours}, rank {peer} runs {theirs}",
                                self.rank
                            ),
                        },
                    );
                }
                return DistError::CollectiveMismatch {
                    rank: self.rank,
                    peer,
                    ours,
                    theirs,
                };
            }
        };
        let Some(store) = &self.store else {
            return DistError::PeerFailed {
                op,
                rank: self.rank,
                peer,
                detail,
            };
        };
        // An echo of a failure another rank already recorded: name its root cause.
        if let Some(first) = failure::recorded(store)
            && first.observer != self.rank
        {
            return self.error_for(op, first, &detail);
        }
        let ours = if timed_out {
            // Which rank holds the job up? The progress board knows; the neighbour we waited on
            // may itself be waiting.
            failure::diagnose(store, self.rank, n).unwrap_or(Record {
                kind: Kind::Unresponsive,
                rank: peer,
                observer: self.rank,
                detail: format!(
                    "did not answer within {}s (it may be waiting on another rank)",
                    self.timeout.as_secs_f64()
                ),
            })
        } else if store.try_get("burn-dist/rendezvous-probe").is_err()
            && peer != 0
            && self.rank != 0
        {
            // The store is gone: its server, rank 0, is down.
            Record {
                kind: Kind::Died,
                rank: 0,
                observer: self.rank,
                detail: format!(
                    "is unreachable (its rendezvous store is gone); this rank saw: {detail}"
                ),
            }
        } else {
            Record {
                kind: Kind::Died,
                rank: peer,
                observer: self.rank,
                detail: format!("closed the connection or died ({detail})"),
            }
        };
        let standing = failure::publish(store, &ours).unwrap_or(ours);
        self.error_for(op, standing, &detail)
    }

    /// The error this rank reports for the job's failure `record`.
    fn error_for(&self, op: &'static str, record: Record, seen: &str) -> DistError {
        let echo = if record.observer == self.rank {
            String::new()
        } else {
            format!(
                " (found by rank {}; this rank saw: {seen})",
                record.observer
            )
        };
        match record.kind {
            Kind::Mismatch => DistError::MismatchReported {
                rank: self.rank,
                observer: record.observer,
                detail: record.detail,
            },
            Kind::Unresponsive => DistError::Unresponsive {
                op,
                rank: self.rank,
                peer: record.rank,
                detail: format!("{}{echo}", record.detail),
                deadline: self.timeout,
            },
            Kind::Died => DistError::PeerFailed {
                op,
                rank: self.rank,
                peer: record.rank,
                detail: format!("{}{echo}", record.detail),
            },
            Kind::Local => DistError::PeerFailed {
                op,
                rank: self.rank,
                peer: record.rank,
                detail: format!("failed by itself: {}{echo}", record.detail),
            },
        }
    }
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// Turns a ring failure into the reported error, recording it for the other ranks.
type Fail<'a> = dyn Fn(RingError) -> DistError + Sync + 'a;

/// What went wrong inside a ring pass.
enum RingError {
    /// A cross-memory read from this rank failed.
    Peer(usize, io::Error),
    Recv(io::Error),
    Send(io::Error),
    Mismatch {
        ours: String,
        theirs: String,
    },
}

enum Msg<T> {
    Header([u8; 32]),
    Data(Vec<T>),
}

fn header(seq: u64, op: u8, dtype: DType, count: usize, extra: u64) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[0..8].copy_from_slice(&seq.to_le_bytes());
    h[8] = op;
    h[9] = dtype as u8;
    h[10..18].copy_from_slice(&(count as u64).to_le_bytes());
    h[18..26].copy_from_slice(&extra.to_le_bytes());
    h
}

fn describe(h: &[u8; 32]) -> String {
    let op = match h[8] {
        OP_ALL_REDUCE => "all_reduce",
        OP_BROADCAST => "broadcast",
        OP_ALL_GATHER => "all_gather",
        _ => "an unknown collective",
    };
    let u = |r: std::ops::Range<usize>| h[r].try_into().map(u64::from_le_bytes).unwrap_or(0);
    format!(
        "{op} #{} of {} elements (dtype {}, arg {})",
        u(0..8),
        u(10..18),
        h[9],
        u(18..26)
    )
}

/// Segment `i` of `n` of a buffer of `len` elements: the first `len % n` get one extra element.
pub(crate) fn segment(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

fn chunks(r: std::ops::Range<usize>, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let chunk = chunk.max(1);
    r.clone()
        .step_by(chunk)
        .map(move |s| s..(s + chunk).min(r.end))
}

/// One ring pass: a sender thread writes messages to `next` in FIFO order while `body` reads from
/// `prev`. Errors from either side stop both promptly (sockets are shut down).
fn ring_pass<T: Element>(
    links: &mut Links,
    hdr: [u8; 32],
    inline: bool,
    body: impl FnOnce(&mut Link, &mut Out<'_, T>, &mpsc::Receiver<Vec<T>>) -> Result<(), RingError>,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let next = &mut links.next;
    let prev = &mut links.prev;
    if inline {
        // Small messages: every step's sends fit in the socket buffers, so write them from this
        // thread before reading (no sender thread to start: lower latency).
        let (_keep, pool) = mpsc::channel::<Vec<T>>();
        let mut out = Out::Inline(next);
        let run = || -> Result<(), RingError> {
            out.send(Msg::Header(hdr))?;
            let mut theirs = [0u8; 32];
            prev.read_exact(&mut theirs).map_err(RingError::Recv)?;
            if theirs != hdr {
                return Err(RingError::Mismatch {
                    ours: describe(&hdr),
                    theirs: describe(&theirs),
                });
            }
            body(prev, &mut out, &pool)
        };
        return run().map_err(fail);
    }
    let prev_shut = prev
        .stream
        .try_clone()
        .map_err(|e| fail(RingError::Recv(e)))?;
    let next_shut = next
        .stream
        .try_clone()
        .map_err(|e| fail(RingError::Send(e)))?;
    let sender_failed = AtomicBool::new(false);
    let sender_failed = &sender_failed;
    let (tx, rx) = mpsc::channel::<Msg<T>>();
    let (ret_tx, ret_rx) = mpsc::channel::<Vec<T>>();
    std::thread::scope(|scope| {
        let sender = scope.spawn(move || -> Result<(), DistError> {
            for msg in rx {
                let r = match &msg {
                    Msg::Header(h) => next.write_all(h),
                    Msg::Data(v) => next.write_all(bytemuck::cast_slice(v)),
                };
                if let Err(e) = r {
                    sender_failed.store(true, Ordering::SeqCst);
                    // Record the cause first, then wake the reader so the whole pass stops now.
                    let err = fail(RingError::Send(e));
                    let _ = prev_shut.shutdown(Shutdown::Both);
                    return Err(err);
                }
                if let Msg::Data(v) = msg {
                    let _ = ret_tx.send(v);
                }
            }
            Ok(())
        });
        let run = || -> Result<(), RingError> {
            let mut out = Out::Thread(tx.clone());
            out.send(Msg::Header(hdr))?;
            let mut theirs = [0u8; 32];
            prev.read_exact(&mut theirs).map_err(RingError::Recv)?;
            if theirs != hdr {
                return Err(RingError::Mismatch {
                    ours: describe(&hdr),
                    theirs: describe(&theirs),
                });
            }
            body(prev, &mut out, &ret_rx)
        };
        let result = match run() {
            Ok(()) => Ok(()),
            // The sender failed first and woke us: its error is the one to report.
            Err(_) if sender_failed.load(Ordering::SeqCst) => Ok(()),
            Err(e) => {
                let err = fail(e);
                let _ = next_shut.shutdown(Shutdown::Both);
                Err(err)
            }
        };
        drop(tx);
        let sent = sender.join().unwrap_or_else(|_| {
            Err(fail(RingError::Send(io::Error::other(
                "sender thread panicked",
            ))))
        });
        sent.and(result)
    })
}

/// Where a ring pass's outgoing messages go: the sender thread, or straight to the socket.
enum Out<'a, T> {
    Thread(mpsc::Sender<Msg<T>>),
    Inline(&'a mut Link),
}

impl<T: Element> Out<'_, T> {
    fn send(&mut self, msg: Msg<T>) -> Result<(), RingError> {
        match self {
            Out::Thread(tx) => {
                // A closed channel means the sender failed; its error is reported instead.
                let _ = tx.send(msg);
                Ok(())
            }
            Out::Inline(next) => match msg {
                Msg::Header(h) => next.write_all(&h),
                Msg::Data(v) => next.write_all(bytemuck::cast_slice(&v)),
            }
            .map_err(RingError::Send),
        }
    }
}

fn take_buf<T: Element>(pool: &mpsc::Receiver<Vec<T>>, len: usize) -> Vec<T> {
    let mut v = pool.try_recv().unwrap_or_default();
    v.resize(len, T::zeroed());
    v
}

fn recv_into<T: Element>(prev: &mut Link, buf: &mut [T]) -> Result<(), RingError> {
    prev.read_exact(bytemuck::cast_slice_mut(buf))
        .map_err(RingError::Recv)
}

fn ring_all_reduce<T: Element>(
    links: &mut Links,
    rank: usize,
    n: usize,
    data: &mut [T],
    op: ReduceOp,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let hdr = header(links.seq, OP_ALL_REDUCE, T::DTYPE, data.len(), op as u64);
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    let len = data.len();
    let inline = len.div_ceil(n) * std::mem::size_of::<T>() <= INLINE_MAX_BYTES;
    ring_pass::<T>(
        links,
        hdr,
        inline,
        |prev, tx, pool| {
            let seg = |i: usize| segment(len, n, (i + n) % n);
            // Reduce-scatter, step 0 sends our own segment.
            for c in chunks(seg(rank), chunk) {
                let mut v = take_buf(pool, c.len());
                v.copy_from_slice(&data[c]);
                tx.send(Msg::Data(v))?;
            }
            for s in 0..n - 1 {
                let r = seg(rank + 2 * n - s - 1);
                for c in chunks(r, chunk) {
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    T::reduce(op, &mut v, &data[c.clone()]);
                    if s == n - 2 {
                        if op == ReduceOp::Avg {
                            T::divide(&mut v, n);
                        }
                        data[c].copy_from_slice(&v);
                    }
                    tx.send(Msg::Data(v))?;
                }
            }
            // All-gather.
            for s in 0..n - 1 {
                let r = seg(rank + n - s);
                for c in chunks(r, chunk) {
                    if s == n - 2 {
                        // Last step: nothing to forward, read straight into place.
                        recv_into(prev, &mut data[c])?;
                        continue;
                    }
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    data[c].copy_from_slice(&v);
                    tx.send(Msg::Data(v))?;
                }
            }
            Ok(())
        },
        fail,
    )
}

fn ring_broadcast(
    links: &mut Links,
    rank: usize,
    n: usize,
    data: &mut [u8],
    root: usize,
    dtype: DType,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let hdr = header(links.seq, OP_BROADCAST, dtype, data.len(), root as u64);
    let forward = (rank + 1) % n != root;
    let inline = data.len() <= INLINE_MAX_BYTES;
    ring_pass::<u8>(
        links,
        hdr,
        inline,
        |prev, tx, pool| {
            for c in chunks(0..data.len(), CHUNK_BYTES) {
                if rank == root {
                    let mut v = take_buf(pool, c.len());
                    v.copy_from_slice(&data[c]);
                    tx.send(Msg::Data(v))?;
                } else {
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    data[c].copy_from_slice(&v);
                    if forward {
                        tx.send(Msg::Data(v))?;
                    }
                }
            }
            Ok(())
        },
        fail,
    )
}

fn ring_all_gather(
    links: &mut Links,
    rank: usize,
    n: usize,
    data: &mut [u8],
    dtype: DType,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let hdr = header(links.seq, OP_ALL_GATHER, dtype, data.len(), 0);
    let block = data.len() / n;
    let inline = block <= INLINE_MAX_BYTES;
    ring_pass::<u8>(
        links,
        hdr,
        inline,
        |prev, tx, pool| {
            let blk = |i: usize| {
                let i = i % n;
                i * block..(i + 1) * block
            };
            for c in chunks(blk(rank), CHUNK_BYTES) {
                let mut v = take_buf(pool, c.len());
                v.copy_from_slice(&data[c]);
                tx.send(Msg::Data(v))?;
            }
            for s in 0..n - 1 {
                for c in chunks(blk(rank + 2 * n - s - 1), CHUNK_BYTES) {
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    data[c].copy_from_slice(&v);
                    if s < n - 2 {
                        tx.send(Msg::Data(v))?;
                    }
                }
            }
            Ok(())
        },
        fail,
    )
}

/// A shared-memory failure in the ring's terms (the peer, or the collective that differs).
fn shm_failure(e: crate::shm::ShmError) -> RingError {
    match e {
        crate::shm::ShmError::Peer(q, e) => RingError::Peer(q, e),
        crate::shm::ShmError::Mismatch { rank, ours, theirs } => RingError::Mismatch {
            ours: format!("collective #{} (all_reduce of {} elements)", ours.0, ours.1),
            theirs: format!(
                "collective #{} (all_reduce of {} elements) on rank {rank}",
                theirs.0, theirs.1
            ),
        },
    }
}

/// This machine's boot id (same on every process of one machine, across containers too).
fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

impl Communicator for Host {
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn backend_name(&self) -> &'static str {
        "host"
    }
    fn abort(&self, cause: &str) {
        if let Some(store) = &self.store {
            failure::publish(
                store,
                &Record {
                    kind: Kind::Local,
                    rank: self.rank,
                    observer: self.rank,
                    detail: cause.to_string(),
                },
            );
        }
        if let Some(mut links) = self.links() {
            links.broken.get_or_insert_with(|| cause.to_string());
            // The neighbours see the closed sockets at once and read the record.
            let _ = links.next.stream.shutdown(Shutdown::Both);
            let _ = links.prev.stream.shutdown(Shutdown::Both);
        }
        if self.rank == 0 {
            // As after a failed collective: the others read the record from rank 0's store.
            std::thread::sleep(STORE_LINGER.min(self.timeout));
        }
    }

    fn transport(&self) -> &'static str {
        match self.links() {
            Some(l) if l.shm.is_some() => "tcp ring + shared memory",
            Some(_) => "tcp ring",
            None => "none (one process)",
        }
    }

    fn all_reduce(&self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        let (rank, n) = (self.rank, self.world_size);
        let deadline = Instant::now() + self.timeout;
        let shared = buf.len() * buf.dtype().size() >= SHM_MIN_BYTES;
        self.run("all_reduce", |l, fail| {
            let seq = l.seq;
            match l.shm.as_mut().filter(|_| shared) {
                Some(shm) => with_slice!(buf, s => shm.all_reduce(s, op, seq, deadline))
                    .map_err(|e| fail(shm_failure(e))),
                None => with_slice!(buf, s => ring_all_reduce(l, rank, n, s, op, fail)),
            }
        })
    }

    fn broadcast(&self, mut buf: HostBuf<'_>, root: usize) -> Result<()> {
        if root >= self.world_size {
            return Err(DistError::InvalidBuffer {
                op: "broadcast",
                detail: format!("root {root} ≥ world size {}", self.world_size),
            });
        }
        let (rank, n, dtype) = (self.rank, self.world_size, buf.dtype());
        self.run("broadcast", |l, fail| {
            ring_broadcast(l, rank, n, buf.bytes_mut(), root, dtype, fail)
        })
    }

    fn all_gather(&self, mut buf: HostBuf<'_>) -> Result<()> {
        if !buf.len().is_multiple_of(self.world_size) {
            return Err(DistError::InvalidBuffer {
                op: "all_gather",
                detail: format!(
                    "length {} is not a multiple of the world size {}",
                    buf.len(),
                    self.world_size
                ),
            });
        }
        let (rank, n, dtype) = (self.rank, self.world_size, buf.dtype());
        self.run("all_gather", |l, fail| {
            ring_all_gather(l, rank, n, buf.bytes_mut(), dtype, fail)
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_cover_everything() {
        for len in [0usize, 1, 2, 5, 17, 1000] {
            for n in 1..6 {
                let mut next = 0;
                for i in 0..n {
                    let s = segment(len, n, i);
                    assert_eq!(s.start, next);
                    next = s.end;
                }
                assert_eq!(next, len);
            }
        }
    }

    fn world(rank: usize, n: usize, port: u16) -> World {
        World {
            rank,
            world_size: n,
            local_rank: rank,
            local_world_size: n,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            job_token: "t".into(),
            rendezvous: crate::world::Rendezvous::OwnStore,
        }
    }

    #[test]
    fn threads_all_reduce() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let n = 3;
        let t = Duration::from_secs(10);
        let handles: Vec<_> = (0..n)
            .map(|r| {
                std::thread::spawn(move || {
                    let w = world(r, n, port);
                    let store = Arc::new(Store::rendezvous(&w, t).expect("store"));
                    let h = Host::new(&w, store, t).expect("host");
                    let mut v: Vec<f32> = (0..1_000_003).map(|i| (i % 7 + r) as f32).collect();
                    h.all_reduce(HostBuf::F32(&mut v), ReduceOp::Sum)
                        .expect("allreduce");
                    let mut b = vec![r as u8; 10];
                    h.broadcast(HostBuf::U8(&mut b), 2).expect("bcast");
                    assert_eq!(b, vec![2u8; 10]);
                    h.barrier().expect("barrier");
                    v
                })
            })
            .collect();
        let res: Vec<Vec<f32>> = handles
            .into_iter()
            .map(|h| h.join().expect("join"))
            .collect();
        for (i, x) in res[0].iter().enumerate() {
            assert_eq!(*x, (3 * (i % 7) + 3) as f32);
        }
        assert!(res.iter().all(|r| r == &res[0]));
    }

    /// A socket peer that sends one byte every 200 ms, forever.
    fn trickler() -> (TcpStream, std::thread::JoinHandle<()>) {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addr = listener.local_addr().expect("addr");
        let handle = std::thread::spawn(move || {
            if let Ok((mut s, _)) = listener.accept() {
                while s.write_all(&[7]).is_ok() {
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
        });
        (TcpStream::connect(addr).expect("connect"), handle)
    }

    #[test]
    fn a_trickling_peer_cannot_stretch_a_read_past_the_deadline() {
        let (stream, _peer) = trickler();
        let mut link = Link::new(stream);
        link.deadline = Instant::now() + Duration::from_millis(1500);
        let start = Instant::now();
        let mut buf = [0u8; 64];
        let err = link
            .read_exact(&mut buf)
            .expect_err("64 bytes at 5 B/s cannot arrive in 1.5 s");
        let waited = start.elapsed();
        assert!(is_timeout(&err), "{err}");
        assert!(
            waited >= Duration::from_millis(1400) && waited < Duration::from_secs(4),
            "gave up after {waited:?}, deadline 1.5 s"
        );
    }

    /// Rank 0 is a real `Host`; the test plays rank 1 over the real protocol, then trickles the
    /// first collective's header one byte per 500 ms (32 bytes: 16 s). Rank 0 must fail at its
    /// deadline (plus the store's linger) and name rank 1, where a per-read socket timeout would
    /// have waited for the whole header and more.
    #[test]
    fn a_trickling_rank_fails_the_collective_at_its_deadline() {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
        let deadline = Duration::from_secs(3);
        let rank0 = std::thread::spawn(move || {
            let w = world(0, 2, port);
            let store = Arc::new(Store::rendezvous(&w, deadline).expect("store"));
            let start = Instant::now();
            let result = Host::new(&w, store, deadline);
            (result, start.elapsed())
        });
        let w1 = world(1, 2, port);
        let store = Store::rendezvous(&w1, deadline).expect("store");
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let me = listener.local_addr().expect("addr");
        store
            .set("burn-dist/host/addr/1", me.to_string().as_bytes())
            .expect("publish");
        let theirs = store
            .get("burn-dist/host/addr/0", deadline)
            .expect("rank 0's address");
        let theirs: SocketAddr = String::from_utf8_lossy(&theirs).parse().expect("address");
        let mut to_rank0 = TcpStream::connect(theirs).expect("connect");
        wire::client_handshake(&mut to_rank0, ConnKind::Ring, 1, &w1.job_token).expect("handshake");
        let (mut from_rank0, _) = listener.accept().expect("rank 0 connects");
        wire::server_handshake(&mut from_rank0, ConnKind::Ring, &w1.job_token)
            .expect("rank 0's handshake");
        let trickle = std::thread::spawn(move || {
            while to_rank0.write_all(&[0]).is_ok() {
                std::thread::sleep(Duration::from_millis(500));
            }
        });
        let (result, waited) = rank0.join().expect("rank 0");
        match result {
            // Whether the deadline reads as a plain timeout or as "never published its progress"
            // depends on whether the board was consulted in time; either way rank 1 is named.
            Err(DistError::Timeout { peer: 1, .. } | DistError::Unresponsive { peer: 1, .. }) => {}
            other => panic!("expected a timeout naming rank 1, got {other:?}"),
        }
        // Generous for a loaded machine, and still well short of the trickled header's 16 s.
        assert!(
            waited < deadline + STORE_LINGER + Duration::from_secs(5),
            "rank 0 gave up after {waited:?}, deadline {deadline:?}"
        );
        drop(store);
        drop(trickle);
    }
}
