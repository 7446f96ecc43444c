//! Length-prefixed frames and the versioned handshake shared by the store and the ring.
//!
//! The handshake proves, both ways, that each side holds the job token without sending it:
//! the client announces its kind, rank and a fresh nonce; the server answers with its own nonce;
//! the client sends HMAC-SHA256(token, both nonces, ...) and the server checks it in constant time
//! before it answers with its own HMAC, which the client checks the same way. A server that does
//! not hold the token learns nothing reusable (both nonces are fresh), and a client that does not
//! hold it never gets the server's proof.

use std::collections::VecDeque;
use std::io::{self, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Magic bytes opening every handshake.
pub(crate) const MAGIC: &[u8; 4] = b"BDST";
/// Protocol version; bump on any wire change.
pub(crate) const VERSION: u16 = 2;
/// Largest handshake frame accepted (token + fixed fields).
pub(crate) const MAX_HANDSHAKE: usize = 4096;

/// Connection kinds carried in the handshake.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum ConnKind {
    Store = 1,
    Ring = 2,
}

/// Writes one frame: u32 little-endian length, then the payload.
pub(crate) fn write_frame(w: &mut impl Write, payload: &[u8]) -> io::Result<()> {
    let len = u32::try_from(payload.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "frame too large"))?;
    let mut buf = Vec::with_capacity(4 + payload.len());
    buf.extend_from_slice(&len.to_le_bytes());
    buf.extend_from_slice(payload);
    w.write_all(&buf)?;
    w.flush()
}

/// Reads one frame of at most `max` bytes; a longer length is an `InvalidData` error.
pub(crate) fn read_frame(r: &mut impl Read, max: usize) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 4];
    r.read_exact(&mut len)?;
    let len = u32::from_le_bytes(len) as usize;
    if len > max {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("frame of {len} bytes exceeds the limit of {max}"),
        ));
    }
    let mut buf = vec![0u8; len];
    r.read_exact(&mut buf)?;
    Ok(buf)
}

/// The whole handshake's deadline, on both sides, in the store and the ring: it is a few small
/// frames, so a peer that takes longer is idle or hostile and must not hold a slot.
pub(crate) const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);

/// A stream whose reads and writes together must finish by `deadline` (a per-read socket
/// timeout alone lets a peer that trickles bytes stretch the handshake without bound).
pub(crate) struct Deadline<'a> {
    pub(crate) stream: &'a TcpStream,
    pub(crate) deadline: Instant,
}

impl Deadline<'_> {
    fn remaining(&self) -> io::Result<Duration> {
        let left = self.deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(io::Error::new(
                io::ErrorKind::TimedOut,
                "handshake deadline passed",
            ));
        }
        Ok(left)
    }
}

impl Read for Deadline<'_> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.stream.set_read_timeout(Some(self.remaining()?))?;
        (&mut &*self.stream).read(buf)
    }
}

impl Write for Deadline<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.stream.set_write_timeout(Some(self.remaining()?))?;
        (&mut &*self.stream).write(buf)
    }
    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The connections of one listener that are still in their handshake, at most `max`. A new one
/// beyond that closes the oldest: idle connections then cannot keep a rank out (only a flood
/// faster than one handshake's round trip could), and the handshake threads stay bounded.
pub(crate) struct Pending {
    max: usize,
    open: Mutex<VecDeque<(u64, Option<TcpStream>)>>,
    next: AtomicU64,
}

impl Pending {
    pub(crate) fn new(max: usize) -> Self {
        Self {
            max,
            open: Mutex::new(VecDeque::new()),
            next: AtomicU64::new(0),
        }
    }

    /// Registers `s`; returns its ticket for [`Pending::done`] and the peer of the connection
    /// closed to make room, if any.
    pub(crate) fn admit(&self, s: &TcpStream) -> (u64, Option<String>) {
        let ticket = self.next.fetch_add(1, Ordering::Relaxed);
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let mut evicted = None;
        if open.len() >= self.max
            && let Some((_, Some(old))) = open.pop_front()
        {
            evicted = Some(old.peer_addr().map(|a| a.to_string()).unwrap_or_default());
            // Its handshake thread's next read fails at once.
            let _ = old.shutdown(Shutdown::Both);
        }
        open.push_back((ticket, s.try_clone().ok()));
        (ticket, evicted)
    }

    /// The handshake of `ticket` ended; `false` when its connection had been closed to make room
    /// already. Calling it again is harmless.
    pub(crate) fn done(&self, ticket: u64) -> bool {
        let mut open = self.open.lock().unwrap_or_else(|e| e.into_inner());
        let before = open.len();
        open.retain(|(t, _)| *t != ticket);
        open.len() < before
    }

    #[cfg(test)]
    pub(crate) fn len(&self) -> usize {
        self.open.lock().unwrap_or_else(|e| e.into_inner()).len()
    }
}

/// Bytes of each side's nonce.
const NONCE: usize = 32;
/// Bytes of a proof (HMAC-SHA256).
const PROOF: usize = 32;
/// First byte of the server's frames in the handshake.
const HS_OK: u8 = 0;
const HS_CHALLENGE: u8 = 1;
const HS_REJECTED: u8 = 2;

/// Why a client's handshake failed.
#[derive(Debug)]
pub(crate) enum HandshakeError {
    /// The connection failed or timed out (worth retrying).
    Io(io::Error),
    /// The server refused us (wrong token, version or kind), with its reason.
    Rejected(String),
    /// The server is not of this job: it could not prove it holds the token, or does not speak
    /// the protocol.
    Unproven(String),
}

/// The proof that one side holds `token`: HMAC-SHA256 keyed by the token over both nonces, the
/// connection kind, the client's claimed rank and the side's role, so that no proof can be
/// replayed on another connection or reflected back as the other side's.
fn proof(
    token: &str,
    role: &[u8],
    kind: ConnKind,
    rank: u32,
    client: &[u8],
    server: &[u8],
) -> [u8; PROOF] {
    use hmac::Mac;
    // HMAC takes a key of any length (an empty token included), so this cannot fail.
    let mut mac = <hmac::Hmac<sha2::Sha256> as Mac>::new_from_slice(token.as_bytes())
        .unwrap_or_else(|_| unreachable!("HMAC accepts keys of every length"));
    mac.update(MAGIC);
    mac.update(&VERSION.to_le_bytes());
    mac.update(role);
    mac.update(&[kind as u8]);
    mac.update(&rank.to_le_bytes());
    mac.update(client);
    mac.update(server);
    mac.finalize().into_bytes().into()
}

fn same(a: &[u8], b: &[u8]) -> bool {
    use subtle::ConstantTimeEq;
    a.ct_eq(b).into()
}

/// The client's side of the handshake: announce kind, rank and a nonce; answer the server's
/// nonce with our proof of the token; accept the server only once it proved the token too. The
/// caller sets the stream's timeouts.
pub(crate) fn client_handshake(
    s: &mut (impl Read + Write),
    kind: ConnKind,
    rank: usize,
    token: &str,
) -> Result<(), HandshakeError> {
    let rank = u32::try_from(rank)
        .map_err(|_| HandshakeError::Rejected(format!("rank {rank} is too large")))?;
    let ours: [u8; NONCE] = rand::random();
    let mut hello = Vec::with_capacity(11 + NONCE);
    hello.extend_from_slice(MAGIC);
    hello.extend_from_slice(&VERSION.to_le_bytes());
    hello.push(kind as u8);
    hello.extend_from_slice(&rank.to_le_bytes());
    hello.extend_from_slice(&ours);
    write_frame(s, &hello).map_err(HandshakeError::Io)?;
    let challenge = read_frame(s, MAX_HANDSHAKE).map_err(HandshakeError::Io)?;
    let theirs = match challenge.split_first() {
        Some((&HS_CHALLENGE, nonce)) if nonce.len() == NONCE => nonce.to_vec(),
        Some((&HS_REJECTED, reason)) => {
            return Err(HandshakeError::Rejected(
                String::from_utf8_lossy(reason).into_owned(),
            ));
        }
        _ => {
            return Err(HandshakeError::Unproven(
                "it does not speak burn-dist's handshake".into(),
            ));
        }
    };
    write_frame(s, &proof(token, b"client", kind, rank, &ours, &theirs))
        .map_err(HandshakeError::Io)?;
    let verdict = read_frame(s, MAX_HANDSHAKE).map_err(HandshakeError::Io)?;
    match verdict.split_first() {
        Some((&HS_OK, server_proof))
            if same(
                server_proof,
                &proof(token, b"server", kind, rank, &ours, &theirs),
            ) =>
        {
            Ok(())
        }
        Some((&HS_OK, _)) => Err(HandshakeError::Unproven(
            "it could not prove it holds this job's token".into(),
        )),
        Some((&HS_REJECTED, reason)) => Err(HandshakeError::Rejected(
            String::from_utf8_lossy(reason).into_owned(),
        )),
        _ => Err(HandshakeError::Unproven(
            "it does not speak burn-dist's handshake".into(),
        )),
    }
}

/// The server's side of the handshake; returns the client's rank, or why it was refused (the
/// client is told too when it speaks the protocol). The caller sets the stream's timeouts.
/// (The listeners use [`server_handshake_admitted`]; the tests play a server with this one.)
#[cfg(test)]
pub(crate) fn server_handshake(
    s: &mut (impl Read + Write),
    kind: ConnKind,
    token: &str,
) -> Result<usize, String> {
    server_handshake_admitted(s, kind, token, || true)
}

/// [`server_handshake`] for a connection registered in [`Pending`]: `leave_pending` (its
/// [`Pending::done`]) runs before the server's proof is sent and aborts the handshake when the
/// connection was closed to make room already. Leaving afterwards would let a flood close a
/// connection whose client already holds the proof and takes it as set up: its first request
/// would then fail instead of its handshake, which the client retries.
pub(crate) fn server_handshake_admitted(
    s: &mut (impl Read + Write),
    kind: ConnKind,
    token: &str,
    leave_pending: impl FnOnce() -> bool,
) -> Result<usize, String> {
    let hello = read_frame(s, MAX_HANDSHAKE).map_err(|e| format!("no valid handshake ({e})"))?;
    if hello.len() != 11 + NONCE || &hello[..4] != MAGIC {
        // Not ours: an older burn-dist gets told, anything else gets nothing useful back.
        if hello.len() >= 6 && &hello[..4] == MAGIC {
            let version = u16::from_le_bytes([hello[4], hello[5]]);
            return Err(refuse(
                s,
                format!("protocol version {version}, expected {VERSION}"),
            ));
        }
        return Err("not a burn-dist handshake (bad magic or length)".to_string());
    }
    let version = u16::from_le_bytes([hello[4], hello[5]]);
    if version != VERSION {
        return Err(refuse(
            s,
            format!("protocol version {version}, expected {VERSION}"),
        ));
    }
    if hello[6] != kind as u8 {
        return Err(refuse(
            s,
            format!("connection kind {}, expected {}", hello[6], kind as u8),
        ));
    }
    let rank = u32::from_le_bytes([hello[7], hello[8], hello[9], hello[10]]);
    let theirs = &hello[11..];
    let ours: [u8; NONCE] = rand::random();
    let mut challenge = vec![HS_CHALLENGE];
    challenge.extend_from_slice(&ours);
    write_frame(s, &challenge).map_err(|e| format!("sending the challenge failed ({e})"))?;
    let answer =
        read_frame(s, MAX_HANDSHAKE).map_err(|e| format!("no answer to the challenge ({e})"))?;
    if !same(&answer, &proof(token, b"client", kind, rank, theirs, &ours)) {
        return Err(refuse(
            s,
            format!("unknown job token from a peer claiming rank {rank}"),
        ));
    }
    if !leave_pending() {
        return Err(format!(
            "rank {rank}'s connection was closed to make room for newer ones in their handshake"
        ));
    }
    let mut ok = vec![HS_OK];
    ok.extend_from_slice(&proof(token, b"server", kind, rank, theirs, &ours));
    write_frame(s, &ok).map_err(|e| format!("sending the proof failed ({e})"))?;
    Ok(rank as usize)
}

/// Tells a client why it is refused, and returns the reason.
fn refuse(s: &mut impl Write, reason: String) -> String {
    let mut r = vec![HS_REJECTED];
    r.extend_from_slice(reason.as_bytes());
    let _ = write_frame(s, &r);
    reason
}

/// Refuses an empty job token when the job listens or connects off loopback, where anyone who
/// reaches the port could otherwise join; `Err` holds the sentence to show.
pub(crate) fn require_token(
    token: &str,
    ips: &[std::net::IpAddr],
    what: &str,
) -> Result<(), String> {
    let Some(open) = ips.iter().find(|ip| !ip.is_loopback()) else {
        return Ok(());
    };
    if !token.is_empty() {
        return Ok(());
    }
    Err(format!(
        "{what} uses {open}, which is not a loopback address, and the job has no token, so anyone \
         who reaches the port could join: export the same secret BURN_DIST_JOB_TOKEN=<secret> for \
         every rank (under torchrun or SLURM, in the environment they pass to their workers), or \
         start the job with burn-dist's launcher and give every node the same --rdzv-id <ID>"
    ))
}

/// Little reader over a byte slice for message decoding.
pub(crate) struct Cursor<'a> {
    b: &'a [u8],
}

impl<'a> Cursor<'a> {
    pub(crate) fn new(b: &'a [u8]) -> Self {
        Self { b }
    }
    pub(crate) fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.b.len() < n {
            return None;
        }
        let (h, t) = self.b.split_at(n);
        self.b = t;
        Some(h)
    }
    pub(crate) fn u8(&mut self) -> Option<u8> {
        self.take(1).map(|b| b[0])
    }
    pub(crate) fn u32(&mut self) -> Option<u32> {
        self.take(4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
    }
    pub(crate) fn u64(&mut self) -> Option<u64> {
        self.take(8)
            .and_then(|b| b.try_into().ok())
            .map(u64::from_le_bytes)
    }
    pub(crate) fn bytes(&mut self) -> Option<&'a [u8]> {
        let n = self.u32()? as usize;
        self.take(n)
    }
    pub(crate) fn str(&mut self) -> Option<&'a str> {
        std::str::from_utf8(self.bytes()?).ok()
    }
    pub(crate) fn rest(&mut self) -> &'a [u8] {
        std::mem::take(&mut self.b)
    }
}

/// Appends a u32-length-prefixed byte string.
pub(crate) fn put_bytes(out: &mut Vec<u8>, b: &[u8]) {
    out.extend_from_slice(&(b.len() as u32).to_le_bytes());
    out.extend_from_slice(b);
}

/// Plays a server that does not hold the token: it challenges, then says "accepted" whatever
/// the client proves, with `server_proof(client's proof)` as its own proof.
#[cfg(test)]
pub(crate) fn pretend_server(
    s: &mut TcpStream,
    server_proof: fn(&[u8]) -> Vec<u8>,
) -> io::Result<()> {
    let _hello = read_frame(s, MAX_HANDSHAKE)?;
    let mut challenge = vec![HS_CHALLENGE];
    challenge.extend_from_slice(&[9u8; NONCE]);
    write_frame(s, &challenge)?;
    let client_proof = read_frame(s, MAX_HANDSHAKE)?;
    let mut ok = vec![HS_OK];
    ok.extend_from_slice(&server_proof(&client_proof));
    write_frame(s, &ok)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::net::TcpListener;
    use std::sync::Arc;

    /// A listener on 127.0.0.1 and a connected pair (client, server side).
    fn pair() -> (TcpStream, TcpStream) {
        let l = TcpListener::bind("127.0.0.1:0").expect("bind");
        let c = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
        let (s, _) = l.accept().expect("accept");
        for x in [&c, &s] {
            x.set_read_timeout(Some(Duration::from_secs(10)))
                .expect("timeout");
        }
        (c, s)
    }

    fn run_server(
        mut s: TcpStream,
        token: &'static str,
    ) -> std::thread::JoinHandle<Result<usize, String>> {
        std::thread::spawn(move || server_handshake(&mut s, ConnKind::Ring, token))
    }

    #[test]
    fn the_same_token_on_both_sides_connects() {
        let (mut c, s) = pair();
        let server = run_server(s, "secret");
        client_handshake(&mut c, ConnKind::Ring, 7, "secret").expect("client");
        assert_eq!(server.join().expect("join"), Ok(7));
    }

    #[test]
    fn a_client_with_the_wrong_token_is_refused() {
        let (mut c, s) = pair();
        let server = run_server(s, "secret");
        match client_handshake(&mut c, ConnKind::Ring, 1, "guess") {
            Err(HandshakeError::Rejected(r)) => assert!(r.contains("unknown job token"), "{r}"),
            other => panic!("expected a refusal, got {other:?}"),
        }
        let e = server.join().expect("join").expect_err("refused");
        assert!(e.contains("unknown job token"), "{e}");
    }

    fn fake_server(
        mut s: TcpStream,
        server_proof: fn(&[u8]) -> Vec<u8>,
    ) -> std::thread::JoinHandle<()> {
        std::thread::spawn(move || pretend_server(&mut s, server_proof).expect("fake server"))
    }

    #[test]
    fn a_server_that_cannot_prove_the_token_is_refused() {
        // A made-up proof, and the client's own proof reflected back.
        type Fake = fn(&[u8]) -> Vec<u8>;
        let fakes: [Fake; 2] = [|_| vec![0u8; PROOF], <[u8]>::to_vec];
        for fake in fakes {
            let (mut c, s) = pair();
            let server = fake_server(s, fake);
            match client_handshake(&mut c, ConnKind::Store, 0, "secret") {
                Err(HandshakeError::Unproven(r)) => assert!(r.contains("token"), "{r}"),
                other => panic!("expected the server to be refused, got {other:?}"),
            }
            server.join().expect("fake server");
        }
    }

    #[test]
    fn an_http_request_gets_no_proof_and_no_hang() {
        let (mut c, s) = pair();
        let server = std::thread::spawn(move || {
            let mut timed = Deadline {
                stream: &s,
                deadline: Instant::now() + Duration::from_millis(500),
            };
            server_handshake(&mut timed, ConnKind::Store, "secret")
        });
        // A plausible length prefix ("GET ") that then never completes.
        c.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .expect("write");
        let e = server.join().expect("join").expect_err("not a handshake");
        assert!(e.contains("no valid handshake"), "{e}");
    }

    #[test]
    fn a_full_pending_list_closes_its_oldest_connection() {
        let pending = Pending::new(2);
        let (mut c1, s1) = pair();
        let (_c2, s2) = pair();
        let (_c3, s3) = pair();
        let (t1, none) = pending.admit(&s1);
        assert!(none.is_none());
        pending.admit(&s2);
        let (_, evicted) = pending.admit(&s3);
        assert!(evicted.is_some());
        assert_eq!(pending.len(), 2);
        // The evicted connection is closed: its client reads the end of the stream.
        let mut b = [0u8; 1];
        assert_eq!(c1.read(&mut b).expect("read"), 0);
        assert!(!pending.done(t1), "t1 was closed to make room");
        assert_eq!(pending.len(), 2);
    }

    /// A flood may close a connection between the client's proof and the server's: the server
    /// must then not send its proof, so that the client's handshake fails (and is retried)
    /// rather than its first request.
    #[test]
    fn a_connection_closed_to_make_room_gets_no_proof() {
        let pending = Arc::new(Pending::new(1));
        let (mut c, s) = pair();
        let (ticket, _) = pending.admit(&s);
        let server = {
            let pending = Arc::clone(&pending);
            std::thread::spawn(move || {
                let mut s = s;
                server_handshake_admitted(&mut s, ConnKind::Store, "secret", || {
                    // The newer connection arrives just before the server's proof.
                    let (_c2, s2) = pair();
                    pending.admit(&s2);
                    pending.done(ticket)
                })
            })
        };
        match client_handshake(&mut c, ConnKind::Store, 3, "secret") {
            Err(HandshakeError::Io(_)) => {}
            other => panic!("expected the handshake to fail as a retryable error, got {other:?}"),
        }
        let e = server.join().expect("join").expect_err("closed");
        assert!(e.contains("rank 3") && e.contains("make room"), "{e}");
    }

    #[test]
    fn an_empty_token_is_refused_off_loopback_only() {
        let lo: std::net::IpAddr = "127.0.0.1".parse().expect("ip");
        let net: std::net::IpAddr = "192.0.2.1".parse().expect("ip");
        assert!(require_token("", &[lo], "the store").is_ok());
        assert!(require_token("t", &[net], "the store").is_ok());
        let e = require_token("", &[lo, net], "the store").expect_err("refused");
        assert!(
            e.contains("192.0.2.1") && e.contains("BURN_DIST_JOB_TOKEN") && e.contains("--rdzv-id"),
            "{e}"
        );
    }
}
