//! The server side of burn-dist's own rendezvous store, run by rank 0 when no launcher serves one.
//!
//! It listens on `MASTER_PORT` at every address `MASTER_ADDR` resolves to on rank 0's host, and
//! nowhere else (a name such as `localhost` often resolves to `::1` before `127.0.0.1`, and clients
//! try the addresses in order). Every connection starts with a versioned handshake in which both
//! sides prove they hold the job token ([`crate::rendezvous::wire`]), on its own thread and under a short
//! deadline; at most a few dozen connections wait in it, and at most one per rank plus a few are
//! served past it. Then the client sends length-prefixed requests (`set`, `set_if_absent`, `get`,
//! `wait`, `add`) and reads one reply each. A connection that sends garbage, an unknown token or
//! an oversized frame is dropped and logged; the job goes on.

use crate::error::{DistError, Result};
use crate::rendezvous::wire::{self, ConnKind, Cursor, Pending};
use socket2::{Domain, Socket, Type};
use std::collections::HashMap;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

pub(crate) const OP_SET: u8 = 1;
pub(crate) const OP_GET: u8 = 2;
pub(crate) const OP_WAIT: u8 = 3;
pub(crate) const OP_ADD: u8 = 4;
/// Sets a key only when it is unset, as one step; answers the value that stands.
pub(crate) const OP_SET_IF_ABSENT: u8 = 5;
pub(crate) const REPLY_OK: u8 = 0;
pub(crate) const REPLY_MISSING: u8 = 1;

/// Connections in their handshake at once (or one per rank, when more): a new one beyond that
/// closes the oldest. One per rank lets a whole large job connect at the same instant.
const MAX_PENDING: usize = 64;
/// Connections past the handshake beyond one per rank: reconnects after a timeout, launchers.
const SPARE_CONNECTIONS: usize = 64;
/// Pending connections the kernel queues per listener (a large job connects all at once).
const BACKLOG: i32 = 1024;

struct Shared {
    map: Mutex<HashMap<String, Vec<u8>>>,
    changed: Condvar,
    /// Connections in their handshake.
    pending: Pending,
    /// Connections past it.
    live: AtomicUsize,
    /// Most connections past the handshake at once.
    max_live: usize,
}

/// Takes a slot of `count` (below `max`) until dropped.
struct Slot<'a>(&'a AtomicUsize);

impl<'a> Slot<'a> {
    fn take(count: &'a AtomicUsize, max: usize) -> Option<Self> {
        count
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .ok()
            .map(|_| Self(count))
    }
}

impl Drop for Slot<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Shared {
    fn new(world_size: usize) -> Self {
        Self {
            map: Mutex::default(),
            changed: Condvar::new(),
            pending: Pending::new(MAX_PENDING.max(world_size)),
            live: AtomicUsize::new(0),
            max_live: world_size.saturating_add(SPARE_CONNECTIONS),
        }
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<String, Vec<u8>>> {
        // A poisoned lock only means a connection thread panicked; the map itself is consistent.
        self.map.lock().unwrap_or_else(|e| e.into_inner())
    }
}

/// The running server. Stops accepting when dropped.
pub(crate) struct Server {
    stop: Arc<AtomicBool>,
    /// The listening addresses (one per address family).
    addrs: Vec<SocketAddr>,
}

impl Drop for Server {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
        // Wake the accept loops.
        for addr in &self.addrs {
            let _ = TcpStream::connect_timeout(addr, Duration::from_millis(200));
        }
    }
}

fn log(msg: &str) {
    eprintln!("[burn-dist store] {msg}");
}

impl Server {
    /// Starts serving on `port` at each address `addrs` names (the addresses `MASTER_ADDR`
    /// resolves to), and nowhere else: a store on `127.0.0.1` is not reachable from the network.
    /// Port 0 picks a free port, the same at every address. At most `world_size` plus a few
    /// connections are served at once.
    ///
    /// # Errors
    /// [`DistError::PortInUse`] when the port is taken at one of the addresses.
    pub(crate) fn start(
        addrs: &[SocketAddr],
        port: u16,
        token: &str,
        world_size: usize,
    ) -> Result<Self> {
        let mut families: Vec<IpAddr> = Vec::new();
        for a in addrs {
            if !families.contains(&a.ip()) {
                families.push(a.ip());
            }
        }
        if families.is_empty() {
            families.push(IpAddr::V4(Ipv4Addr::LOCALHOST));
        }
        let mut listeners = Vec::with_capacity(families.len());
        let mut unsupported = None;
        let mut port = port;
        for any in &families {
            let at = SocketAddr::new(*any, port);
            match listen(at) {
                Ok(l) => {
                    let local = l.local_addr().map_err(|source| DistError::PortInUse {
                        addr: at.to_string(),
                        source,
                    })?;
                    port = local.port();
                    listeners.push((l, local));
                }
                // A host without IPv6 (or IPv4) still serves in the other family; an address of
                // the name that is not this host's is skipped.
                Err(e)
                    if matches!(
                        e.raw_os_error(),
                        Some(libc::EAFNOSUPPORT) | Some(libc::EADDRNOTAVAIL)
                    ) =>
                {
                    log(&format!("not listening on {at}: {e}"));
                    unsupported = Some((at, e));
                }
                Err(source) => {
                    return Err(DistError::PortInUse {
                        addr: at.to_string(),
                        source,
                    });
                }
            }
        }
        if listeners.is_empty()
            && let Some((at, source)) = unsupported
        {
            return Err(DistError::PortInUse {
                addr: at.to_string(),
                source,
            });
        }
        let stop = Arc::new(AtomicBool::new(false));
        let shared = Arc::new(Shared::new(world_size));
        let mut bound = Vec::with_capacity(listeners.len());
        for (listener, local) in listeners {
            let (stop, shared, token) = (Arc::clone(&stop), Arc::clone(&shared), token.to_string());
            std::thread::Builder::new()
                .name("burn-dist-store".into())
                .spawn(move || serve(listener, &token, &stop, &shared))
                .map_err(|source| DistError::Io {
                    rank: 0,
                    what: "starting the store thread".into(),
                    addr: local.to_string(),
                    source,
                })?;
            bound.push(local);
        }
        Ok(Self { stop, addrs: bound })
    }

    /// The listening addresses, one per address family.
    #[cfg(test)]
    pub(crate) fn addrs(&self) -> &[SocketAddr] {
        &self.addrs
    }
}

/// A listener on `at`; an IPv6 one takes IPv6 only, so that the IPv4 listener can share the port.
fn listen(at: SocketAddr) -> io::Result<TcpListener> {
    let socket = Socket::new(Domain::for_address(at), Type::STREAM, None)?;
    if at.is_ipv6() {
        socket.set_only_v6(true)?;
    }
    // As std's TcpListener::bind: a restarted job can reuse the port at once.
    socket.set_reuse_address(true)?;
    socket.bind(&at.into())?;
    socket.listen(BACKLOG)?;
    Ok(socket.into())
}

fn serve(listener: TcpListener, token: &str, stop: &AtomicBool, shared: &Arc<Shared>) {
    for conn in listener.incoming() {
        if stop.load(Ordering::SeqCst) {
            break;
        }
        let Ok(stream) = conn else { continue };
        // The handshake runs on the connection's own thread, so a slow peer never holds up the
        // accept loop; the number of those threads waiting on a peer is capped.
        let (ticket, evicted) = shared.pending.admit(&stream);
        if let Some(old) = evicted {
            log(&format!(
                "closed the connection from {old}: too many newer ones are in their handshake"
            ));
        }
        let conn_shared = Arc::clone(shared);
        let token = token.to_string();
        let spawned = std::thread::Builder::new()
            .name("burn-dist-store-conn".into())
            .spawn(move || handle_conn(stream, &token, &conn_shared, ticket));
        if let Err(e) = spawned {
            shared.pending.done(ticket);
            log(&format!("could not start a connection thread: {e}"));
        }
    }
}

fn peer_of(stream: &TcpStream) -> String {
    stream
        .peer_addr()
        .map(|a| a.to_string())
        .unwrap_or_else(|_| "?".into())
}

fn handle_conn(mut stream: TcpStream, token: &str, shared: &Shared, ticket: u64) {
    let peer = peer_of(&stream);
    let _ = stream.set_nodelay(true);
    let mut timed = wire::Deadline {
        stream: &stream,
        deadline: Instant::now() + wire::HANDSHAKE_TIMEOUT,
    };
    let checked = wire::server_handshake_admitted(&mut timed, ConnKind::Store, token, || {
        shared.pending.done(ticket)
    });
    shared.pending.done(ticket);
    let rank = match checked {
        Ok(r) => r,
        Err(reason) => {
            log(&format!("dropped connection from {peer}: {reason}"));
            let _ = stream.shutdown(Shutdown::Both);
            return;
        }
    };
    let Some(_live) = Slot::take(&shared.live, shared.max_live) else {
        log(&format!(
            "closed the connection of rank {rank} from {peer}: {} connections are open already",
            shared.max_live
        ));
        return;
    };
    let _ = stream.set_read_timeout(None);
    let _ = stream.set_write_timeout(Some(wire::HANDSHAKE_TIMEOUT));
    loop {
        let req = match wire::read_frame(&mut stream, crate::rendezvous::store::MAX_STORE_MESSAGE) {
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
        OP_SET_IF_ABSENT => {
            let key = c.str()?.to_string();
            let value = c.rest();
            let mut map = shared.lock();
            let stands = map.entry(key).or_insert_with(|| value.to_vec()).clone();
            drop(map);
            shared.changed.notify_all();
            let mut r = vec![REPLY_OK];
            r.extend_from_slice(&stands);
            Some(r)
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

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::Ipv6Addr;

    #[test]
    fn listens_in_every_family_of_the_master_address() {
        // As `localhost` resolving to both `::1` and `127.0.0.1`.
        let both: Vec<SocketAddr> = vec![
            SocketAddr::from((Ipv6Addr::LOCALHOST, 1)),
            SocketAddr::from((Ipv4Addr::LOCALHOST, 1)),
        ];
        let server = Server::start(&both, 0, "t", 2).expect("start");
        let port = server.addrs()[0].port();
        assert_eq!(server.addrs().len(), 2, "{:?}", server.addrs());
        assert!(server.addrs().iter().all(|a| a.port() == port));
        for ip in [
            IpAddr::V6(Ipv6Addr::LOCALHOST),
            IpAddr::V4(Ipv4Addr::LOCALHOST),
        ] {
            TcpStream::connect_timeout(&SocketAddr::new(ip, port), Duration::from_secs(2))
                .unwrap_or_else(|e| panic!("{ip} must reach the store: {e}"));
        }
        drop(server);
        // An IPv4-only name listens on IPv4 only.
        let v4 = Server::start(&both[1..], 0, "t", 2).expect("start");
        assert_eq!(v4.addrs().len(), 1);
        assert!(v4.addrs()[0].is_ipv4());
    }

    #[test]
    fn listens_only_at_the_address_it_is_given() {
        let server =
            Server::start(&[SocketAddr::from((Ipv4Addr::LOCALHOST, 0))], 0, "t", 2).expect("start");
        let port = server.addrs()[0].port();
        // 127.0.0.2 is this host too; a listener on 0.0.0.0 would accept there.
        let other = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), port));
        let e = TcpStream::connect_timeout(&other, Duration::from_secs(2))
            .expect_err("not listening on 127.0.0.2");
        assert_eq!(e.kind(), io::ErrorKind::ConnectionRefused, "{e}");
        TcpStream::connect_timeout(&server.addrs()[0], Duration::from_secs(2))
            .expect("listening on 127.0.0.1");
    }

    #[test]
    fn set_if_absent_keeps_the_first_value_and_answers_it() {
        let shared = Shared::new(2);
        let request = |value: &[u8]| {
            let mut req = vec![OP_SET_IF_ABSENT];
            wire::put_bytes(&mut req, b"failure");
            req.extend_from_slice(value);
            handle_request(&req, &shared).expect("well-formed")
        };
        assert_eq!(request(b"first"), b"\x00first");
        assert_eq!(request(b"second"), b"\x00first");
        let mut get = vec![OP_GET];
        wire::put_bytes(&mut get, b"failure");
        assert_eq!(handle_request(&get, &shared).expect("get"), b"\x00first");
    }
}
