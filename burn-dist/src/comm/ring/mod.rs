//! [`TcpRing`], the communicator that needs no device: a ring over TCP between processes, with a
//! shared-memory path for the all-reduces of ranks on one machine.
//!
//! - [`connect`]: the set-up (listen, publish, connect, authenticated handshakes);
//! - [`collectives`]: the ring passes themselves, one deadline per collective;
//! - [`shm`]: same-machine all-reduce through shared-memory segments;
//! - [`failure`]: the job's failure record and progress board, which name the rank at fault.

mod collectives;
mod connect;
pub(crate) mod failure;
pub(crate) mod shm;
#[cfg(test)]
mod tests;

use collectives::{ring_all_gather, ring_all_reduce, ring_broadcast, shm_failure};

use crate::comm::{Communicator, DType, Element, HostBuf, ReduceOp, with_slice};
use crate::error::{DistError, Result};
use crate::rendezvous::store::Store;
use crate::rendezvous::wire::{self, ConnKind, HandshakeError};
use crate::rendezvous::world::World;
use failure::{Kind, Record};
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
    shm: Option<crate::comm::ring::shm::Segments>,
}

/// Ring communicator over TCP; works on one machine and across machines.
pub struct TcpRing {
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

impl std::fmt::Debug for TcpRing {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TcpRing")
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

impl TcpRing {
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
        if let Some(shm) = &links.shm {
            shm.announce(seq, op);
        }
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

impl Communicator for TcpRing {
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
        self.run("all_reduce", |l, fail| {
            let seq = l.seq;
            match l.shm.as_mut() {
                Some(shm) => with_slice!(buf, s => shm.all_reduce(s, op, seq, deadline))
                    .map_err(|e| fail(shm_failure(e))),
                None => with_slice!(buf, s => ring_all_reduce(l, rank, n, s, op, fail)),
            }
        })
    }

    fn broadcast(&self, mut buf: HostBuf<'_>, root: usize) -> Result<()> {
        crate::comm::check_root(root, self.world_size)?;
        let (rank, n, dtype) = (self.rank, self.world_size, buf.dtype());
        self.run("broadcast", |l, fail| {
            ring_broadcast(l, rank, n, buf.bytes_mut(), root, dtype, fail)
        })
    }

    fn all_gather(&self, mut buf: HostBuf<'_>) -> Result<()> {
        crate::comm::check_gather_len(buf.len(), self.world_size)?;
        let (rank, n, dtype) = (self.rank, self.world_size, buf.dtype());
        self.run("all_gather", |l, fail| {
            ring_all_gather(l, rank, n, buf.bytes_mut(), dtype, fail)
        })
    }
}
