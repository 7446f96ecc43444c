//! A client of torch's `TCPStore`, for jobs started by torchrun: its agent already serves a
//! TCPStore on `MASTER_PORT` and tells the workers so (`TORCHELASTIC_USE_AGENT_STORE=True`), so the
//! workers must join that store rather than start their own.
//!
//! The protocol is torch's (`torch/csrc/distributed/c10d/TCPStore.cpp` for the client,
//! `TCPStoreLibUvBackend.cpp` and `TCPStoreBackend.cpp` for the two servers). A request is one
//! command byte then its arguments; integers are little-endian (torch writes them in host order, and
//! every platform torch ships on is little-endian); a key or a value is a u64 length then its
//! bytes. A new connection sends `VALIDATE` with a magic number (the libuv server ignores a client
//! until it does) and a `PING` whose nonce comes back. `SET` has no reply; `GET` answers a value;
//! `ADD` the new integer (stored as decimal text); `COMPARE_SET` (key, expected value, new value)
//! the value that stands after it, where an empty expected value means "only if unset"; `CHECK` one byte, 0 when every key is set; `WAIT`
//! one byte when every key is set, and a waiting client that gives up sends `CANCEL_WAIT`, answered
//! by `WAIT_CANCELED` (after a `STOP_WAITING` that crossed it on the way).
//!
//! `tests/fixtures/tcpstore/*.txt` hold the bytes of a real torch client and server, recorded by
//! `scripts/make_tcpstore_fixtures.py`; the tests below replay them.

use crate::error::{DistError, Result};
use std::io::{self, Read, Write};
use std::net::{IpAddr, TcpStream};
use std::time::{Duration, Instant};

const VALIDATE: u8 = 0;
const SET: u8 = 1;
const COMPARE_SET: u8 = 2;
const GET: u8 = 3;
const ADD: u8 = 4;
const CHECK: u8 = 5;
const WAIT: u8 = 6;
const CANCEL_WAIT: u8 = 12;
const PING: u8 = 13;
/// `validationMagicNumber` of `TCPStoreBackend.hpp`.
const VALIDATION_MAGIC: u32 = 0x3C85_F7CE;
const READY: u8 = 0;
const NOT_READY: u8 = 1;
const STOP_WAITING: u8 = 0;
const WAIT_CANCELED: u8 = 1;
/// The libuv server drops a client that sends a longer key or value (`MAX_STRING_LEN`,
/// `MAX_PAYLOAD_LEN`).
const MAX_KEY_BYTES: usize = 8 << 10;
const MAX_VALUE_BYTES: usize = 8 << 20;

/// One connection to a torch TCPStore. A request that fails midway drops the connection (its
/// reply could otherwise be read as the next request's), and the next request opens a new one.
pub(crate) struct TorchStore {
    /// Our rank, for messages.
    rank: usize,
    host: String,
    port: u16,
    /// `host:port`, for messages.
    addr: String,
    stream: Option<TcpStream>,
    /// Deadline of a reply, and of opening a connection.
    timeout: Duration,
    nonce: u32,
}

impl TorchStore {
    /// Connects to the store at `host:port` (every address `host` resolves to is tried) and checks
    /// it answers like a torch TCPStore, retrying until `timeout`.
    pub(crate) fn connect(host: &str, port: u16, rank: usize, timeout: Duration) -> Result<Self> {
        Self::connect_with_nonce(host, port, rank, timeout, std::process::id())
    }

    fn connect_with_nonce(
        host: &str,
        port: u16,
        rank: usize,
        timeout: Duration,
        nonce: u32,
    ) -> Result<Self> {
        let mut store = Self {
            rank,
            host: host.to_string(),
            port,
            addr: crate::rendezvous::store::endpoint(host, port),
            stream: None,
            timeout,
            nonce,
        };
        store.stream()?;
        Ok(store)
    }

    /// The local address of the connection: the interface that reaches the store's host.
    pub(crate) fn local_ip(&mut self) -> Option<IpAddr> {
        let stream = self.stream().ok()?;
        stream.local_addr().ok().map(|a| a.ip())
    }

    fn stream(&mut self) -> Result<&mut TcpStream> {
        if self.stream.is_none() {
            self.stream = Some(self.open()?);
        }
        self.stream.as_mut().ok_or_else(|| DistError::Store {
            addr: self.addr.clone(),
            detail: "no connection".into(),
            source: None,
        })
    }

    fn open(&self) -> Result<TcpStream> {
        let start = Instant::now();
        loop {
            let err = match self.try_open() {
                Ok(s) => return Ok(s),
                Err(e) => e,
            };
            if err.kind() == io::ErrorKind::InvalidData {
                return Err(DistError::Handshake {
                    addr: self.addr.clone(),
                    rank: self.rank,
                    reason: format!("{err}; is MASTER_PORT torchrun's store?"),
                });
            }
            if start.elapsed() >= self.timeout {
                return Err(DistError::StoreConnect {
                    rank: self.rank,
                    addr: self.addr.clone(),
                    waited: self.timeout,
                    source: err,
                });
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    fn try_open(&self) -> io::Result<TcpStream> {
        let mut s = crate::rendezvous::store::connect_any(&self.host, self.port, self.timeout)?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(self.timeout))?;
        s.set_write_timeout(Some(self.timeout))?;
        let mut hello = vec![VALIDATE];
        hello.extend_from_slice(&VALIDATION_MAGIC.to_le_bytes());
        hello.push(PING);
        hello.extend_from_slice(&self.nonce.to_le_bytes());
        s.write_all(&hello)?;
        let mut echo = [0u8; 4];
        s.read_exact(&mut echo)?;
        if u32::from_le_bytes(echo) != self.nonce {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                format!(
                    "the server answered the ping with {:08x} instead of {:08x}",
                    u32::from_le_bytes(echo),
                    self.nonce
                ),
            ));
        }
        Ok(s)
    }

    /// Runs one exchange; any failure drops the connection.
    fn exchange<T>(
        &mut self,
        what: &str,
        f: impl FnOnce(&mut TcpStream, Duration) -> io::Result<T>,
    ) -> Result<T> {
        let timeout = self.timeout;
        let stream = self.stream()?;
        match f(stream, timeout) {
            Ok(v) => Ok(v),
            Err(e) => {
                self.stream = None;
                Err(DistError::Store {
                    addr: self.addr.clone(),
                    detail: format!("{what} failed"),
                    source: Some(e),
                })
            }
        }
    }

    fn check_sizes(&self, key: &str, value: &[u8]) -> Result<()> {
        if key.len() > MAX_KEY_BYTES || value.len() > MAX_VALUE_BYTES {
            return Err(DistError::Store {
                addr: self.addr.clone(),
                detail: format!(
                    "key {key:?} with a value of {} bytes exceeds torch's TCPStore limits \
                     ({MAX_KEY_BYTES} bytes per key, {MAX_VALUE_BYTES} per value)",
                    value.len()
                ),
                source: None,
            });
        }
        Ok(())
    }

    /// Sets `key` to `value`.
    pub(crate) fn set(&mut self, key: &str, value: &[u8]) -> Result<()> {
        self.check_sizes(key, value)?;
        let mut req = vec![SET];
        put(&mut req, key.as_bytes());
        put(&mut req, value);
        self.exchange("set", |s, _| s.write_all(&req))
    }

    /// The value of `key`, which must be set (torch's servers answer an unset key with an empty
    /// value or by closing the connection).
    fn get_set_key(&mut self, key: &str) -> Result<Vec<u8>> {
        self.check_sizes(key, &[])?;
        let mut req = vec![GET];
        put(&mut req, key.as_bytes());
        self.exchange("get", |s, _| {
            s.write_all(&req)?;
            read_vec(s)
        })
    }

    /// Waits until `key` is set and returns its value, as torch's `get`.
    ///
    /// # Errors
    /// [`DistError::StoreTimeout`] after `timeout`.
    pub(crate) fn get(&mut self, key: &str, timeout: Duration) -> Result<Vec<u8>> {
        if !self.wait(&[key], timeout)? {
            return Err(DistError::StoreTimeout {
                key: key.to_string(),
                addr: self.addr.clone(),
                waited: timeout,
            });
        }
        self.get_set_key(key)
    }

    /// The value of `key`, or `None` when it is not set.
    pub(crate) fn try_get(&mut self, key: &str) -> Result<Option<Vec<u8>>> {
        if !self.check(&[key])? {
            return Ok(None);
        }
        self.get_set_key(key).map(Some)
    }

    /// Adds `delta` to the integer at `key` (0 when unset) and returns the new value.
    pub(crate) fn add(&mut self, key: &str, delta: i64) -> Result<i64> {
        self.check_sizes(key, &[])?;
        let mut req = vec![ADD];
        put(&mut req, key.as_bytes());
        req.extend_from_slice(&delta.to_le_bytes());
        self.exchange("add", |s, _| {
            s.write_all(&req)?;
            let mut v = [0u8; 8];
            s.read_exact(&mut v)?;
            Ok(i64::from_le_bytes(v))
        })
    }

    /// Sets `key` to `value` unless it is set, as one step on the server (torch's
    /// `compare_set` with an empty expected value); returns the value that stands.
    pub(crate) fn set_if_absent(&mut self, key: &str, value: &[u8]) -> Result<Vec<u8>> {
        self.check_sizes(key, value)?;
        let mut req = vec![COMPARE_SET];
        put(&mut req, key.as_bytes());
        put(&mut req, &[]);
        put(&mut req, value);
        self.exchange("compare_set", |s, _| {
            s.write_all(&req)?;
            read_vec(s)
        })
    }

    /// Whether every key is set, without waiting.
    pub(crate) fn check(&mut self, keys: &[&str]) -> Result<bool> {
        let req = keys_request(CHECK, keys);
        self.exchange("check", |s, _| {
            s.write_all(&req)?;
            match read_u8(s)? {
                READY => Ok(true),
                NOT_READY => Ok(false),
                other => Err(unexpected(other)),
            }
        })
    }

    /// Waits until every key is set; `false` when `timeout` passed first.
    pub(crate) fn wait(&mut self, keys: &[&str], timeout: Duration) -> Result<bool> {
        let req = keys_request(WAIT, keys);
        self.exchange("wait", |s, reply_timeout| {
            s.write_all(&req)?;
            // A zero read timeout means "no timeout" to the socket.
            s.set_read_timeout(Some(timeout.max(Duration::from_millis(1))))?;
            let answer = read_u8(s);
            s.set_read_timeout(Some(reply_timeout))?;
            match answer {
                Ok(STOP_WAITING) => return Ok(true),
                Ok(other) => return Err(unexpected(other)),
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::TimedOut => {}
                Err(e) => return Err(e),
            }
            s.write_all(&[CANCEL_WAIT])?;
            match read_u8(s)? {
                WAIT_CANCELED => Ok(false),
                // The keys were set while the cancel was on its way: STOP_WAITING first, then
                // WAIT_CANCELED.
                STOP_WAITING => match read_u8(s)? {
                    WAIT_CANCELED => Ok(true),
                    other => Err(unexpected(other)),
                },
                other => Err(unexpected(other)),
            }
        })
    }
}

fn unexpected(byte: u8) -> io::Error {
    io::Error::new(
        io::ErrorKind::InvalidData,
        format!("unexpected answer {byte}; is MASTER_ADDR:MASTER_PORT torchrun's store?"),
    )
}

fn put(out: &mut Vec<u8>, bytes: &[u8]) {
    out.extend_from_slice(&(bytes.len() as u64).to_le_bytes());
    out.extend_from_slice(bytes);
}

fn keys_request(command: u8, keys: &[&str]) -> Vec<u8> {
    let mut req = vec![command];
    req.extend_from_slice(&(keys.len() as u64).to_le_bytes());
    for k in keys {
        put(&mut req, k.as_bytes());
    }
    req
}

fn read_u8(s: &mut impl Read) -> io::Result<u8> {
    let mut b = [0u8; 1];
    s.read_exact(&mut b)?;
    Ok(b[0])
}

fn read_vec(s: &mut impl Read) -> io::Result<Vec<u8>> {
    let mut len = [0u8; 8];
    s.read_exact(&mut len)?;
    let len = u64::from_le_bytes(len);
    if len > MAX_VALUE_BYTES as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a value of {len} bytes exceeds torch's limit of {MAX_VALUE_BYTES}"),
        ));
    }
    let mut v = vec![0u8; len as usize];
    s.read_exact(&mut v)?;
    Ok(v)
}

#[cfg(test)]
#[path = "torch_store_tests.rs"]
mod tests;
