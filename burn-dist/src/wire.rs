//! Length-prefixed frames and the versioned handshake shared by the store and the host backend.

use std::io::{self, Read, Write};

/// Magic bytes opening every handshake.
pub(crate) const MAGIC: &[u8; 4] = b"BDST";
/// Protocol version; bump on any wire change.
pub(crate) const VERSION: u16 = 1;
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

/// Handshake payload: magic, version, kind, rank, token.
pub(crate) fn handshake_bytes(kind: ConnKind, rank: usize, token: &str) -> Vec<u8> {
    let mut b = Vec::with_capacity(16 + token.len());
    b.extend_from_slice(MAGIC);
    b.extend_from_slice(&VERSION.to_le_bytes());
    b.push(kind as u8);
    b.extend_from_slice(&(rank as u32).to_le_bytes());
    b.extend_from_slice(token.as_bytes());
    b
}

/// Parses and checks a handshake; returns the peer's rank or why it is rejected.
pub(crate) fn check_handshake(b: &[u8], kind: ConnKind, token: &str) -> Result<usize, String> {
    if b.len() < 11 || &b[..4] != MAGIC {
        return Err("not a burn-dist handshake (bad magic)".to_string());
    }
    let version = u16::from_le_bytes([b[4], b[5]]);
    if version != VERSION {
        return Err(format!("protocol version {version}, expected {VERSION}"));
    }
    if b[6] != kind as u8 {
        return Err(format!("connection kind {}, expected {}", b[6], kind as u8));
    }
    let rank = u32::from_le_bytes([b[7], b[8], b[9], b[10]]) as usize;
    if &b[11..] != token.as_bytes() {
        return Err(format!(
            "unknown job token from a peer claiming rank {rank}"
        ));
    }
    Ok(rank)
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
