//! Rendezvous key-value store served by rank 0 over TCP, like torch's `TCPStore`.
//!
//! Every connection starts with a versioned handshake carrying the job token; then the client sends
//! length-prefixed requests (`set`, `get`, `wait`, `add`) and reads one reply each. A connection
//! that sends garbage, an unknown token or an oversized frame is dropped and logged; the job goes on.

use crate::error::{DistError, Result};
use crate::wire::{self, ConnKind, Cursor};
use crate::world::World;
use std::collections::HashMap;
use std::io;
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Largest request or value the store accepts (values are small: addresses, ids, fingerprints).
pub const MAX_STORE_MESSAGE: usize = 16 << 20;

const OP_SET: u8 = 1;
const OP_GET: u8 = 2;
const OP_WAIT: u8 = 3;
const OP_ADD: u8 = 4;
const REPLY_OK: u8 = 0;
const REPLY_MISSING: u8 = 1;
const REPLY_REJECTED: u8 = 2;

/// Time a new connection has to complete its handshake.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);

#[derive(Default)]
struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A poisoned lock only means a connection thread panicked; the map itself is consistent.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The server side, running on rank 0. Stops accepting when dropped.
struct Server {
    stop: Arc<AtomicBool>,
    addr: SocketAddr,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loop.
        let wake: SocketAddr = if self.addr.ip().is_unspecified() {
            SocketAddr::from(([127, 0, 0, 1], self.addr.port()))
        } else {
            self.addr
        };
        let _ = TcpStream::connect_timeout(&wake, Duration::from_millis(200));
    }
}

fn log(msg: &str) {
    eprintln!("[burn-dist store] {msg}");
}

fn serve(listener: TcpListener, token: String, stop: Arc<AtomicBool>) {
    let shared = Arc::new(Shared::default());
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else { continue };
        let shared = Arc::clone(&shared);
        let token = token.clone();
        let spawned = std::thread::Builder::new()
            .name("burn-dist-store-conn".into())
            .spawn(move || handle_conn(stream, &token, &shared));
        if let Err(e) = spawned {
            log(&format!("could not start a connection thread: {e}"));
        }
    }
}

fn handle_conn(mut stream: TcpStream, token: &str, shared: &Shared) {
    let peer = stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into());
    let _ = stream.set_nodelay(true);
    let _ = stream.set_read_timeout(Some(HANDSHAKE_TIMEOUT));
    let hs = match wire::read_frame(&mut stream, wire::MAX_HANDSHAKE) {
        Ok(hs) => hs,
        Err(e) => {
            log(&format!(
                "dropped connection from {peer}: no valid handshake ({e})"
            ));
            return;
        }
    };
    let rank = match wire::check_handshake(&hs, ConnKind::Store, token) {
        Ok(r) => r,
        Err(reason) => {
            log(&format!("dropped connection from {peer}: {reason}"));
            let mut reply = vec![REPLY_REJECTED];
            reply.extend_from_slice(reason.as_bytes());
            let _ = wire::write_frame(&mut stream, &reply);
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    };
    if wire::write_frame(&mut stream, &[REPLY_OK]).is_err() {
        return;
    }
    let _ = stream.set_read_timeout(None);
    loop {
        let req = match wire::read_frame(&mut stream, MAX_STORE_MESSAGE) {
            Ok(r) => r,
            Err(e)
                if e.kind() == io::ErrorKind::UnexpectedEof
                    || e.kind() == io::ErrorKind::ConnectionReset =>
            {
                return;
            }
            Err(e) => {
                log(&format!(
                    "dropped connection of rank {rank} from {peer}: {e}"
                ));
                return;
            }
        };
        let Some(reply) = handle_request(&req, shared) else {
            log(&format!(
                "dropped connection of rank {rank} from {peer}: malformed request"
            ));
            return;
        };
        if wire::write_frame(&mut stream, &reply).is_err() {
            return;
        }
    }
}

fn handle_request(req: &[u8], shared: &Shared) -> Option<Vec<u8>> {
    let mut c = Cursor::new(req);
    match c.u8()? {
        OP_SET => {
            let key = c.str()?.to_string();
            let value = c.rest().to_vec();
            shared.lock().insert(key, value);
            shared.changed.notify_all();
            Some(vec![REPLY_OK])
        }
        OP_GET => {
            let key = c.str()?;
            match shared.lock().get(key) {
                Some(v) => {
                    let mut r = vec![REPLY_OK];
                    r.extend_from_slice(v);
                    Some(r)
                }
                None => Some(vec![REPLY_MISSING]),
            }
        }
        OP_WAIT => {
            let timeout = Duration::from_millis(c.u64()?);
            let n = c.u32()? as usize;
            let mut keys = Vec::with_capacity(n.min(1 << 16));
            for _ in 0..n {
                keys.push(c.str()?.to_string());
            }
            let deadline = Instant::now() + timeout;
            let mut map = shared.lock();
            loop {
                let missing: Vec<&String> = keys.iter().filter(|k| !map.contains_key(*k)).collect();
                if missing.is_empty() {
                    return Some(vec![REPLY_OK]);
                }
                let now = Instant::now();
                if now >= deadline {
                    let mut r = vec![REPLY_MISSING];
                    r.extend_from_slice(&(missing.len() as u32).to_le_bytes());
                    for k in missing {
                        wire::put_bytes(&mut r, k.as_bytes());
                    }
                    return Some(r);
                }
                map = shared
                    .changed
                    .wait_timeout(map, deadline - now)
                    .map(|(g, _)| g)
                    .unwrap_or_else(|e| e.into_inner().0);
            }
        }
        OP_ADD => {
            let key = c.str()?.to_string();
            let delta = c.u64()? as i64;
            let mut map = shared.lock();
            let cur = map
                .get(&key)
                .and_then(|v| <[u8; 8]>::try_from(v.as_slice()).ok())
                .map(i64::from_le_bytes)
                .unwrap_or(0);
            let new = cur.wrapping_add(delta);
            map.insert(key, new.to_le_bytes().to_vec());
            drop(map);
            shared.changed.notify_all();
            let mut r = vec![REPLY_OK];
            r.extend_from_slice(&new.to_le_bytes());
            Some(r)
        }
        _ => None,
    }
}

/// A client of the job's store (and, on rank 0, its server).
pub struct Store {
    stream: Mutex<TcpStream>,
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    barrier_gen: AtomicU64,
    _server: Option<Server>,
}

impl std::fmt::Debug for Store {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Store")
            .field("addr", &self.addr)
            .field("rank", &self.rank)
            .finish()
    }
}

impl Store {
    /// Starts the store on rank 0 (listening on all interfaces at `MASTER_PORT`), connects every
    /// rank to it, and waits until all `world_size` ranks have arrived.
    ///
    /// # Errors
    /// [`DistError::PortInUse`] on rank 0 when the port is taken; [`DistError::StoreConnect`] when
    /// rank 0 cannot be reached within `timeout`; [`DistError::RendezvousTimeout`] naming the ranks
    /// that never arrived.
    pub fn rendezvous(world: &World, timeout: Duration) -> Result<Self> {
        let store = Self::connect(world, timeout)?;
        store.barrier("rendezvous", timeout)?;
        Ok(store)
    }

    /// Like [`Store::rendezvous`] without waiting for the other ranks.
    ///
    /// # Errors
    /// As [`Store::rendezvous`], without the rendezvous timeout.
    pub fn connect(world: &World, timeout: Duration) -> Result<Self> {
        let addr = world.master_endpoint();
        let server = if world.rank == 0 {
            let bind = format!("0.0.0.0:{}", world.master_port);
            let listener = TcpListener::bind(&bind).map_err(|source| DistError::PortInUse {
                addr: bind.clone(),
                source,
            })?;
            let local = listener
                .local_addr()
                .map_err(|source| DistError::PortInUse {
                    addr: bind.clone(),
                    source,
                })?;
            let stop = Arc::new(AtomicBool::new(false));
            let stop2 = Arc::clone(&stop);
            let token = world.job_token.clone();
            std::thread::Builder::new()
                .name("burn-dist-store".into())
                .spawn(move || serve(listener, token, stop2))
                .map_err(|source| DistError::Io {
                    rank: 0,
                    what: "starting the store thread".into(),
                    addr: bind,
                    source,
                })?;
            Some(Server { stop, addr: local })
        } else {
            None
        };
        let start = Instant::now();
        let stream = loop {
            match Self::try_connect(&addr, world, timeout) {
                Ok(s) => break s,
                Err(ConnectError::Rejected(reason)) => {
                    return Err(DistError::Handshake {
                        addr,
                        rank: world.rank,
                        reason,
                    });
                }
                Err(ConnectError::Io(e)) => {
                    if start.elapsed() >= timeout {
                        return Err(DistError::StoreConnect {
                            rank: world.rank,
                            addr,
                            waited: timeout,
                            source: e,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        };
        Ok(Self {
            stream: Mutex::new(stream),
            addr,
            rank: world.rank,
            world_size: world.world_size,
            timeout,
            barrier_gen: AtomicU64::new(0),
            _server: server,
        })
    }

    fn try_connect(
        addr: &str,
        world: &World,
        timeout: Duration,
    ) -> Result<TcpStream, ConnectError> {
        let sa = addr
            .to_socket_addrs()
            .map_err(ConnectError::Io)?
            .next()
            .ok_or_else(|| {
                ConnectError::Io(io::Error::new(
                    io::ErrorKind::NotFound,
                    "address did not resolve",
                ))
            })?;
        let mut s =
            TcpStream::connect_timeout(&sa, Duration::from_secs(5)).map_err(ConnectError::Io)?;
        s.set_nodelay(true).map_err(ConnectError::Io)?;
        s.set_read_timeout(Some(timeout.max(Duration::from_secs(1))))
            .map_err(ConnectError::Io)?;
        s.set_write_timeout(Some(timeout.max(Duration::from_secs(1))))
            .map_err(ConnectError::Io)?;
        wire::write_frame(
            &mut s,
            &wire::handshake_bytes(ConnKind::Store, world.rank, &world.job_token),
        )
        .map_err(ConnectError::Io)?;
        let reply = wire::read_frame(&mut s, wire::MAX_HANDSHAKE).map_err(ConnectError::Io)?;
        match reply.first() {
            Some(&REPLY_OK) => Ok(s),
            Some(&REPLY_REJECTED) => Err(ConnectError::Rejected(
                String::from_utf8_lossy(&reply[1..]).into_owned(),
            )),
            _ => Err(ConnectError::Rejected("unexpected handshake reply".into())),
        }
    }

    /// The store address (`host:port`).
    pub fn addr(&self) -> &str {
        &self.addr
    }

    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks in the job.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Default deadline of this store's waits.
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Local address of the connection to the store: the interface peers can reach us on.
    pub(crate) fn local_ip(&self) -> Option<std::net::IpAddr> {
        self.lock().local_addr().ok().map(|a| a.ip())
    }

    fn lock(&self) -> MutexGuard<'_, TcpStream> {
        self.stream.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn request(&self, req: &[u8], read_timeout: Duration) -> Result<Vec<u8>> {
        let mut s = self.lock();
        let io_err = |what: &str, e: io::Error| DistError::Store {
            addr: self.addr.clone(),
            detail: format!("{what} failed"),
            source: Some(e),
        };
        s.set_read_timeout(Some(read_timeout))
            .map_err(|e| io_err("setting a timeout", e))?;
        wire::write_frame(&mut *s, req).map_err(|e| io_err("sending a request", e))?;
        let reply = wire::read_frame(&mut *s, MAX_STORE_MESSAGE + 16)
            .map_err(|e| io_err("reading a reply", e))?;
        if reply.is_empty() {
            return Err(DistError::Store {
                addr: self.addr.clone(),
                detail: "empty reply".into(),
                source: None,
            });
        }
        Ok(reply)
    }

    /// Sets `key` to `value`.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable or the value exceeds [`MAX_STORE_MESSAGE`].
    pub fn set(&self, key: &str, value: &[u8]) -> Result<()> {
        if value.len() + key.len() + 16 > MAX_STORE_MESSAGE {
            return Err(DistError::Store {
                addr: self.addr.clone(),
                detail: format!(
                    "value of {} bytes for key {key:?} exceeds the store limit of {MAX_STORE_MESSAGE}",
                    value.len()
                ),
                source: None,
            });
        }
        let mut req = vec![OP_SET];
        wire::put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(value);
        self.request(&req, self.timeout)?;
        Ok(())
    }

    /// Returns the value of `key`, or `None` when it is not set.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        let mut req = vec![OP_GET];
        wire::put_bytes(&mut req, key.as_bytes());
        let r = self.request(&req, self.timeout)?;
        Ok((r[0] == REPLY_OK).then(|| r[1..].to_vec()))
    }

    /// Waits until all `keys` are set; returns the keys still missing when `timeout` passes.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable.
    pub fn wait_missing(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let mut req = vec![OP_WAIT];
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            wire::put_bytes(&mut req, k.as_bytes());
        }
        let r = self.request(&req, timeout + Duration::from_secs(10))?;
        if r[0] == REPLY_OK {
            return Ok(Vec::new());
        }
        let mut c = Cursor::new(&r[1..]);
        let bad = || DistError::Store {
            addr: self.addr.clone(),
            detail: "malformed wait reply".into(),
            source: None,
        };
        let n = c.u32().ok_or_else(bad)? as usize;
        (0..n)
            .map(|_| c.str().map(str::to_string).ok_or_else(bad))
            .collect()
    }

    /// Waits for `key` and returns its value.
    ///
    /// # Errors
    /// [`DistError::StoreTimeout`] after `timeout`; [`DistError::Store`] when unreachable.
    pub fn get(&self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        let missing = self.wait_missing(&[key.to_string()], timeout)?;
        if !missing.is_empty() {
            return Err(DistError::StoreTimeout {
                key: key.to_string(),
                addr: self.addr.clone(),
                waited: timeout,
            });
        }
        self.try_get(key)?.ok_or_else(|| DistError::Store {
            addr: self.addr.clone(),
            detail: format!("key {key:?} vanished"),
            source: None,
        })
    }

    /// Atomically adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable.
    pub fn add(&self, key: &str, delta: i64) -> Result<i64> {
        let mut req = vec![OP_ADD];
        wire::put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&(delta as u64).to_le_bytes());
        let r = self.request(&req, self.timeout)?;
        let v: [u8; 8] =
            r.get(1..9)
                .and_then(|b| b.try_into().ok())
                .ok_or_else(|| DistError::Store {
                    addr: self.addr.clone(),
                    detail: "malformed add reply".into(),
                    source: None,
                })?;
        Ok(i64::from_le_bytes(v))
    }

    /// Blocks until every rank called `barrier` with the same `name` (the n-th call of each rank
    /// meets the n-th call of the others).
    ///
    /// # Errors
    /// [`DistError::RendezvousTimeout`] naming the ranks that did not arrive within `timeout`.
    pub fn barrier(&self, name: &str, timeout: Duration) -> Result<()> {
        let generation = self.barrier_gen.fetch_add(1, Ordering::SeqCst);
        let prefix = format!("barrier/{name}/{generation}");
        self.set(&format!("{prefix}/{}", self.rank), &[1])?;
        let keys: Vec<String> = (0..self.world_size)
            .map(|r| format!("{prefix}/{r}"))
            .collect();
        // Rank 0 serves the store: it waits a little longer so that the others get their answer
        // before it (typically) exits on the same timeout.
        let wait = if self.rank == 0 {
            timeout + Duration::from_secs(1)
        } else {
            timeout
        };
        let missing = self.wait_missing(&keys, wait)?;
        if missing.is_empty() {
            return Ok(());
        }
        let missing: Vec<usize> = missing
            .iter()
            .filter_map(|k| k.rsplit('/').next().and_then(|r| r.parse().ok()))
            .collect();
        let what = if name == "rendezvous" {
            "the rendezvous".to_string()
        } else {
            format!("barrier {name:?}")
        };
        Err(DistError::RendezvousTimeout {
            what,
            missing,
            addr: self.addr.clone(),
            waited: timeout,
        })
    }
}

enum ConnectError {
    Io(io::Error),
    Rejected(String),
}

#[cfg(test)]
mod tests {
    use super::*;

    fn free_port() -> u16 {
        TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port")
    }

    fn world(rank: usize, n: usize, port: u16) -> World {
        World {
            rank,
            world_size: n,
            local_rank: rank,
            local_world_size: n,
            master_addr: "127.0.0.1".into(),
            master_port: port,
            job_token: "tok".into(),
        }
    }

    #[test]
    fn set_get_add_wait_barrier() {
        let port = free_port();
        let t = Duration::from_secs(5);
        let s0 = Store::connect(&world(0, 2, port), t).expect("rank 0");
        let h = std::thread::spawn(move || {
            let s1 = Store::connect(&world(1, 2, port), t).expect("rank 1");
            s1.set("k", b"v").expect("set");
            s1.barrier("b", t).expect("barrier");
            s1.add("c", 2).expect("add")
        });
        assert_eq!(s0.get("k", t).expect("get"), b"v");
        s0.barrier("b", t).expect("barrier");
        let a = s0.add("c", 3).expect("add");
        let b = h.join().expect("join");
        assert_eq!(a.max(b), 5);
        assert_eq!(s0.try_get("nope").expect("try_get"), None);
    }

    #[test]
    fn missing_rank_is_named_and_bad_clients_are_dropped() {
        let port = free_port();
        let s0 = Store::connect(&world(0, 3, port), Duration::from_secs(5)).expect("rank 0");
        // Garbage and a wrong token.
        let mut g = TcpStream::connect(("127.0.0.1", port)).expect("connect");
        io::Write::write_all(&mut g, b"\xff\xff\xff\x7fgarbage").expect("write");
        let mut w = world(1, 3, port);
        w.job_token = "wrong".into();
        let e = Store::connect(&w, Duration::from_secs(2)).expect_err("wrong token");
        assert!(e.to_string().contains("token"), "{e}");
        let e = s0
            .barrier("rendezvous", Duration::from_millis(300))
            .expect_err("missing");
        match e {
            DistError::RendezvousTimeout { missing, .. } => assert_eq!(missing, vec![1, 2]),
            e => panic!("unexpected {e}"),
        }
        // The store still works.
        s0.set("x", b"1").expect("set after garbage");
    }

    #[test]
    fn port_in_use_is_named() {
        let l = TcpListener::bind("0.0.0.0:0").expect("bind");
        let port = l.local_addr().expect("addr").port();
        let e = Store::connect(&world(0, 2, port), Duration::from_secs(1)).expect_err("in use");
        assert!(e.to_string().contains(&port.to_string()), "{e}");
    }
}
