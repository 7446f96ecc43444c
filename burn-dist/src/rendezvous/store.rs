//! The job's rendezvous store: a small key-value store (`set`, `get`, `wait`, `add`, `barrier`)
//! that the ranks use to find each other, like torch's `TCPStore`.
//!
//! Who serves it depends on the launcher: torchrun's agent already serves a torch TCPStore, which
//! every rank joins as a client ([`crate::rendezvous::torch_store`]) with its keys under a prefix of the run and
//! restart; otherwise rank 0 serves burn-dist's own store ([`crate::rendezvous::store_server`]), whose
//! connections start with a handshake in which both sides prove they hold the job token
//! ([`crate::rendezvous::wire`]).

use crate::error::{DistError, Result};
use crate::rendezvous::store_server::{
    OP_ADD, OP_GET, OP_SET, OP_SET_IF_ABSENT, OP_WAIT, REPLY_OK, Server,
};
use crate::rendezvous::torch_store::TorchStore;
use crate::rendezvous::wire::{self, ConnKind, Cursor};
use crate::rendezvous::world::{Rendezvous, World};
use std::io;
use std::net::{IpAddr, SocketAddr, TcpStream, ToSocketAddrs};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// Largest request or value the store accepts (values are small: addresses, ids, fingerprints).
pub const MAX_STORE_MESSAGE: usize = 16 << 20;

/// `host:port`, with IPv6 literals in brackets.
pub(crate) fn endpoint(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// Every address `host` resolves to, in the resolver's order.
pub(crate) fn resolve(host: &str, port: u16) -> io::Result<Vec<SocketAddr>> {
    let host = host.trim_start_matches('[').trim_end_matches(']');
    let addrs: Vec<SocketAddr> = (host, port).to_socket_addrs()?.collect();
    if addrs.is_empty() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("{host} resolves to no address"),
        ));
    }
    Ok(addrs)
}

/// Connects to the first of `addrs` that accepts within `per_address` each; the last error when
/// none does.
pub(crate) fn connect_first(addrs: &[SocketAddr], per_address: Duration) -> io::Result<TcpStream> {
    let mut last = io::Error::new(io::ErrorKind::NotFound, "no address to connect to");
    for a in addrs {
        match TcpStream::connect_timeout(a, per_address) {
            Ok(s) => return Ok(s),
            Err(e) => last = io::Error::new(e.kind(), format!("{a}: {e}")),
        }
    }
    Err(last)
}

/// Connects to `host:port`, trying every address `host` resolves to (a name such as `localhost`
/// may resolve to `::1` first while the server listens on `127.0.0.1` only).
pub(crate) fn connect_any(host: &str, port: u16, timeout: Duration) -> io::Result<TcpStream> {
    let per_address = timeout.clamp(Duration::from_millis(100), Duration::from_secs(5));
    connect_first(&resolve(host, port)?, per_address)
}

enum Client {
    /// burn-dist's own store; rank 0 also runs the server.
    Own {
        conn: Mutex<OwnConn>,
        _server: Option<Server>,
    },
    /// torchrun's agent store, keys under `prefix`.
    Torch {
        client: Mutex<TorchStore>,
        prefix: String,
    },
}

/// The connection to burn-dist's own store. A request that times out or fails midway drops the
/// stream: its late reply would otherwise be read as the next request's. The next request opens
/// a new one (a single attempt, so that a store that is gone is reported at once).
struct OwnConn {
    world: World,
    stream: Option<TcpStream>,
    /// The local address of the first connection: the interface that reaches the store, known
    /// even while a dropped connection waits for the next request to reopen it.
    local_ip: Option<IpAddr>,
}

/// A client of the job's store (and, on rank 0 of a job without torchrun, its server).
pub struct Store {
    client: Client,
    addr: String,
    rank: usize,
    world_size: usize,
    timeout: Duration,
    barrier_gen: AtomicU64,
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
    /// Joins the job's store (started first on rank 0 when no launcher serves one) and waits until
    /// all `world_size` ranks have arrived.
    ///
    /// # Errors
    /// [`DistError::PortInUse`] on rank 0 when the port is taken; [`DistError::StoreConnect`] when
    /// the store cannot be reached within `timeout`; [`DistError::RendezvousTimeout`] naming the
    /// ranks that never arrived.
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
        let client = match &world.rendezvous {
            Rendezvous::TorchAgentStore { key_prefix } => Client::Torch {
                client: Mutex::new(TorchStore::connect(
                    &world.master_addr,
                    world.master_port,
                    world.rank,
                    timeout,
                )?),
                prefix: key_prefix.clone(),
            },
            Rendezvous::OwnStore => {
                let addrs = resolve(&world.master_addr, world.master_port).map_err(|source| {
                    DistError::Resolve {
                        host: world.master_addr.clone(),
                        source,
                    }
                })?;
                let ips: Vec<IpAddr> = addrs.iter().map(SocketAddr::ip).collect();
                wire::require_token(&world.job_token, &ips, "the rendezvous store (MASTER_ADDR)")
                    .map_err(|detail| DistError::NoJobToken {
                    rank: world.rank,
                    detail,
                })?;
                if world.rank == 0
                    && world.local_world_size < world.world_size
                    && ips.iter().all(IpAddr::is_loopback)
                {
                    // Several hosts, yet the store is reachable from this one only (a host name
                    // that /etc/hosts maps to 127.0.1.1, say). Not refused: several "nodes" on one
                    // machine is a legitimate test set-up.
                    eprintln!(
                        "[burn-dist rank 0] warning: MASTER_ADDR {} resolves to loopback only \
                         ({ips:?}) but the job has {} ranks and {} on this host: ranks on other \
                         hosts cannot reach the store; set MASTER_ADDR to an address of this host \
                         that they can reach",
                        world.master_addr, world.world_size, world.local_world_size
                    );
                }
                let server = if world.rank == 0 {
                    Some(Server::start(
                        &addrs,
                        world.master_port,
                        &world.job_token,
                        world.world_size,
                    )?)
                } else {
                    None
                };
                let stream = Self::connect_own(world, &addr, timeout)?;
                Client::Own {
                    conn: Mutex::new(OwnConn {
                        world: world.clone(),
                        local_ip: stream.local_addr().ok().map(|a| a.ip()),
                        stream: Some(stream),
                    }),
                    _server: server,
                }
            }
        };
        Ok(Self {
            client,
            addr,
            rank: world.rank,
            world_size: world.world_size,
            timeout,
            barrier_gen: AtomicU64::new(0),
        })
    }

    fn connect_own(world: &World, addr: &str, timeout: Duration) -> Result<TcpStream> {
        let start = Instant::now();
        loop {
            match Self::try_connect(world, timeout) {
                Ok(s) => return Ok(s),
                Err(ConnectError::Rejected(reason)) => {
                    return Err(DistError::Handshake {
                        addr: addr.to_string(),
                        rank: world.rank,
                        reason,
                    });
                }
                Err(ConnectError::Unproven(reason)) => {
                    return Err(DistError::Unproven {
                        addr: addr.to_string(),
                        rank: world.rank,
                        reason,
                    });
                }
                Err(ConnectError::Io(e)) => {
                    if start.elapsed() >= timeout {
                        return Err(DistError::StoreConnect {
                            rank: world.rank,
                            addr: addr.to_string(),
                            waited: timeout,
                            source: e,
                        });
                    }
                    std::thread::sleep(Duration::from_millis(100));
                }
            }
        }
    }

    fn try_connect(world: &World, timeout: Duration) -> Result<TcpStream, ConnectError> {
        let s = connect_any(&world.master_addr, world.master_port, timeout)
            .map_err(ConnectError::Io)?;
        s.set_nodelay(true).map_err(ConnectError::Io)?;
        // The handshake is small: a server that takes long over it is not a healthy store.
        let mut timed = wire::Deadline {
            stream: &s,
            deadline: Instant::now() + wire::HANDSHAKE_TIMEOUT,
        };
        wire::client_handshake(&mut timed, ConnKind::Store, world.rank, &world.job_token).map_err(
            |e| match e {
                wire::HandshakeError::Io(e) => ConnectError::Io(e),
                wire::HandshakeError::Rejected(r) => ConnectError::Rejected(r),
                wire::HandshakeError::Unproven(r) => ConnectError::Unproven(r),
            },
        )?;
        let t = timeout.max(Duration::from_secs(1));
        s.set_read_timeout(Some(t)).map_err(ConnectError::Io)?;
        s.set_write_timeout(Some(t)).map_err(ConnectError::Io)?;
        Ok(s)
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
        match &self.client {
            Client::Own { conn, .. } => lock(conn).local_ip,
            Client::Torch { client, .. } => lock(client).local_ip(),
        }
    }

    fn request(
        &self,
        conn: &Mutex<OwnConn>,
        req: &[u8],
        read_timeout: Duration,
    ) -> Result<Vec<u8>> {
        let mut conn = lock(conn);
        let io_err = |what: &str, e: io::Error| DistError::Store {
            addr: self.addr.clone(),
            detail: format!("{what} failed"),
            source: Some(e),
        };
        let mut stream = match conn.stream.take() {
            Some(s) => s,
            None => Self::try_connect(&conn.world, self.timeout).map_err(|e| match e {
                ConnectError::Io(e) => io_err("reconnecting", e),
                ConnectError::Rejected(reason) => DistError::Handshake {
                    addr: self.addr.clone(),
                    rank: self.rank,
                    reason,
                },
                ConnectError::Unproven(reason) => DistError::Unproven {
                    addr: self.addr.clone(),
                    rank: self.rank,
                    reason,
                },
            })?,
        };
        stream
            .set_read_timeout(Some(read_timeout))
            .map_err(|e| io_err("setting a timeout", e))?;
        wire::write_frame(&mut stream, req).map_err(|e| io_err("sending a request", e))?;
        let reply = wire::read_frame(&mut stream, MAX_STORE_MESSAGE + 16)
            .map_err(|e| io_err("reading a reply", e))?;
        // Only a stream whose exchange completed is kept.
        conn.stream = Some(stream);
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
        self.check_size(key, value)?;
        match &self.client {
            Client::Own { conn, .. } => {
                let mut req = vec![OP_SET];
                wire::put_bytes(&mut req, key.as_bytes());
                req.extend_from_slice(value);
                self.request(conn, &req, self.timeout)?;
                Ok(())
            }
            Client::Torch { client, prefix } => lock(client).set(&format!("{prefix}{key}"), value),
        }
    }

    fn check_size(&self, key: &str, value: &[u8]) -> Result<()> {
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
        Ok(())
    }

    /// Sets `key` to `value` unless it is already set, as one step on the server, and returns the
    /// value that stands: `value` when this call set it, the earlier value otherwise. Two ranks
    /// racing see the same winner.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable or the value is too large.
    pub fn set_if_absent(&self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        self.check_size(key, value)?;
        match &self.client {
            Client::Own { conn, .. } => {
                let mut req = vec![OP_SET_IF_ABSENT];
                wire::put_bytes(&mut req, key.as_bytes());
                req.extend_from_slice(value);
                let r = self.request(conn, &req, self.timeout)?;
                Ok(r[1..].to_vec())
            }
            Client::Torch { client, prefix } => {
                lock(client).set_if_absent(&format!("{prefix}{key}"), value)
            }
        }
    }

    /// Returns the value of `key`, or `None` when it is not set.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable.
    pub fn try_get(&self, key: &str) -> Result<Option<Vec<u8>>> {
        match &self.client {
            Client::Own { conn, .. } => {
                let mut req = vec![OP_GET];
                wire::put_bytes(&mut req, key.as_bytes());
                let r = self.request(conn, &req, self.timeout)?;
                Ok((r[0] == REPLY_OK).then(|| r[1..].to_vec()))
            }
            Client::Torch { client, prefix } => lock(client).try_get(&format!("{prefix}{key}")),
        }
    }

    /// Waits until all `keys` are set; returns the keys still missing when `timeout` passes.
    ///
    /// # Errors
    /// [`DistError::Store`] when the store is unreachable.
    pub fn wait_missing(&self, keys: &[String], timeout: Duration) -> Result<Vec<String>> {
        let conn = match &self.client {
            Client::Own { conn, .. } => conn,
            Client::Torch { client, prefix } => {
                let full: Vec<String> = keys.iter().map(|k| format!("{prefix}{k}")).collect();
                let refs: Vec<&str> = full.iter().map(String::as_str).collect();
                let mut client = lock(client);
                if client.wait(&refs, timeout)? {
                    return Ok(Vec::new());
                }
                let mut missing = Vec::new();
                for (key, full) in keys.iter().zip(&refs) {
                    if !client.check(&[full])? {
                        missing.push(key.clone());
                    }
                }
                return Ok(missing);
            }
        };
        let mut req = vec![OP_WAIT];
        req.extend_from_slice(&(timeout.as_millis() as u64).to_le_bytes());
        req.extend_from_slice(&(keys.len() as u32).to_le_bytes());
        for k in keys {
            wire::put_bytes(&mut req, k.as_bytes());
        }
        let r = self.request(conn, &req, timeout + Duration::from_secs(10))?;
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
        if let Client::Torch { client, prefix } = &self.client {
            return lock(client)
                .get(&format!("{prefix}{key}"), timeout)
                .map_err(|e| match e {
                    DistError::StoreTimeout { addr, waited, .. } => DistError::StoreTimeout {
                        key: key.to_string(),
                        addr,
                        waited,
                    },
                    e => e,
                });
        }
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
        let conn = match &self.client {
            Client::Own { conn, .. } => conn,
            Client::Torch { client, prefix } => {
                return lock(client).add(&format!("{prefix}{key}"), delta);
            }
        };
        let mut req = vec![OP_ADD];
        wire::put_bytes(&mut req, key.as_bytes());
        req.extend_from_slice(&(delta as u64).to_le_bytes());
        let r = self.request(conn, &req, self.timeout)?;
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
    Unproven(String),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // A poisoned lock only means another thread panicked mid-request; requests are independent.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

#[cfg(test)]
#[path = "store_tests.rs"]
mod tests;
