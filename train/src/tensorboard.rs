//! TensorBoard event files: TFRecord framing (length, masked CRC32C) around `Event` protobufs
//! holding scalar `Summary` values. Small enough to write by hand; no protobuf dependency.

use std::fs::File;
use std::io::{BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

/// Events reach the file at most this long after they are written (TensorBoard reads while we
/// write; torch's `SummaryWriter` flushes every 120 s).
pub const FLUSH_INTERVAL: Duration = Duration::from_secs(30);

/// Writes scalars to `events.out.tfevents.<time>.<host>` in a log directory.
pub struct SummaryWriter {
    path: PathBuf,
    file: BufWriter<File>,
    flush_interval: Duration,
    /// When the oldest event not yet on disk was written.
    pending_since: Option<Instant>,
}

impl SummaryWriter {
    /// Creates the log directory if needed and a new event file in it.
    ///
    /// # Errors
    /// If the directory or file cannot be created.
    pub fn new(log_dir: &Path) -> std::io::Result<Self> {
        std::fs::create_dir_all(log_dir)?;
        let now = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .unwrap_or_default();
        let host = hostname();
        let path = log_dir.join(format!(
            "events.out.tfevents.{}.{host}.{}",
            now.as_secs(),
            std::process::id()
        ));
        let file = BufWriter::new(File::create(&path)?);
        let mut writer = Self {
            path,
            file,
            flush_interval: FLUSH_INTERVAL,
            pending_since: None,
        };
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_bytes(&mut event, 3, b"brain.Event:2");
        writer.write_record(&event)?;
        writer.flush()?;
        Ok(writer)
    }

    /// Sets how long an event may wait in the buffer (default [`FLUSH_INTERVAL`]).
    pub fn with_flush_interval(mut self, interval: Duration) -> Self {
        self.flush_interval = interval;
        self
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Flushes when the oldest buffered event is older than the flush interval. Writes call it;
    /// call it between writes too (the trainer does every step) so that no event waits longer.
    ///
    /// # Errors
    /// If the write fails.
    pub fn flush_if_due(&mut self) -> std::io::Result<()> {
        match self.pending_since {
            Some(since) if since.elapsed() >= self.flush_interval => self.flush(),
            _ => Ok(()),
        }
    }

    /// Marks a (re)start at `step`, as torch's `SummaryWriter(purge_step=step)`: TensorBoard hides
    /// the events of earlier files in this directory at steps `>= step` (those of a run that
    /// crashed after its last checkpoint and is being resumed). TensorBoard's current loader
    /// treats the first marker of a directory as the start, not a restart, so every event file
    /// should carry one.
    ///
    /// # Errors
    /// If the write fails.
    pub fn add_session_start(&mut self, step: i64) -> std::io::Result<()> {
        let mut session_log = Vec::new();
        put_varint_field(&mut session_log, 1, SESSION_START);
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 7, &session_log);
        self.write_record(&event)?;
        self.flush()
    }

    /// Appends a scalar at a step (TensorBoard's `add_scalar`).
    ///
    /// # Errors
    /// If the write fails.
    pub fn add_scalar(&mut self, tag: &str, value: f32, step: i64) -> std::io::Result<()> {
        let mut summary_value = Vec::new();
        put_bytes(&mut summary_value, 1, tag.as_bytes());
        put_fixed32(&mut summary_value, 2, value.to_bits());
        let mut summary = Vec::new();
        put_bytes(&mut summary, 1, &summary_value);
        let mut event = Vec::new();
        put_double(&mut event, 1, wall_time());
        put_varint_field(&mut event, 2, step as u64);
        put_bytes(&mut event, 5, &summary);
        self.write_record(&event)?;
        self.pending_since.get_or_insert_with(Instant::now);
        self.flush_if_due()
    }

    /// Pushes buffered events to the file (TensorBoard reads while we write).
    ///
    /// # Errors
    /// If the write fails.
    pub fn flush(&mut self) -> std::io::Result<()> {
        self.pending_since = None;
        self.file.flush()
    }

    fn write_record(&mut self, data: &[u8]) -> std::io::Result<()> {
        let len = (data.len() as u64).to_le_bytes();
        self.file.write_all(&len)?;
        self.file.write_all(&masked_crc32c(&len).to_le_bytes())?;
        self.file.write_all(data)?;
        self.file.write_all(&masked_crc32c(data).to_le_bytes())
    }
}

impl Drop for SummaryWriter {
    fn drop(&mut self) {
        let _ = self.file.flush();
    }
}

/// One scalar read back from an event file.
#[derive(Debug, Clone, PartialEq)]
pub struct ScalarEvent {
    /// The tag, e.g. `train/loss`.
    pub tag: String,
    /// The step.
    pub step: i64,
    /// The value.
    pub value: f32,
}

/// `SessionLog.SessionStatus.START` in TensorFlow's `event.proto`.
const SESSION_START: u64 = 1;

/// Errors reading an event file.
#[derive(Debug, thiserror::Error)]
pub enum EventFileError {
    /// The file could not be read.
    #[error("cannot read event file {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A record's framing or checksum is wrong.
    #[error("event file {path} is damaged at byte {offset}: {what}")]
    Corrupt {
        /// The file.
        path: PathBuf,
        /// Where the bad record starts.
        offset: usize,
        /// What is wrong.
        what: &'static str,
    },
}

/// Reads every scalar of an event file, checking the framing and both CRCs of every record.
///
/// # Errors
/// [`EventFileError`] naming the file and the offset of the first bad record.
pub fn read_scalars(path: &Path) -> Result<Vec<ScalarEvent>, EventFileError> {
    Ok(read_events(path)?.0)
}

/// The steps of the session-start (purge) events of an event file, in order.
///
/// # Errors
/// As [`read_scalars`].
pub fn read_session_starts(path: &Path) -> Result<Vec<i64>, EventFileError> {
    Ok(read_events(path)?.1)
}

fn read_events(path: &Path) -> Result<(Vec<ScalarEvent>, Vec<i64>), EventFileError> {
    let mut bytes = Vec::new();
    File::open(path)
        .and_then(|mut f| f.read_to_end(&mut bytes))
        .map_err(|source| EventFileError::Io {
            path: path.to_path_buf(),
            source,
        })?;
    let corrupt = |offset, what| EventFileError::Corrupt {
        path: path.to_path_buf(),
        offset,
        what,
    };
    let mut scalars = Vec::new();
    let mut session_starts = Vec::new();
    let mut at = 0;
    let mut first = true;
    while at < bytes.len() {
        let header = bytes
            .get(at..at + 12)
            .ok_or(corrupt(at, "truncated header"))?;
        let len_bytes: [u8; 8] = header[..8].try_into().map_err(|_| corrupt(at, "header"))?;
        let len_crc = u32::from_le_bytes(
            header[8..12]
                .try_into()
                .map_err(|_| corrupt(at, "header"))?,
        );
        if masked_crc32c(&len_bytes) != len_crc {
            return Err(corrupt(at, "length CRC mismatch"));
        }
        let len = u64::from_le_bytes(len_bytes) as usize;
        let data = bytes
            .get(at + 12..at + 12 + len)
            .ok_or(corrupt(at, "truncated record"))?;
        let crc_bytes = bytes
            .get(at + 12 + len..at + 16 + len)
            .ok_or(corrupt(at, "truncated record CRC"))?;
        let data_crc = u32::from_le_bytes(crc_bytes.try_into().map_err(|_| corrupt(at, "crc"))?);
        if masked_crc32c(data) != data_crc {
            return Err(corrupt(at, "data CRC mismatch"));
        }
        let event = decode_event(data).ok_or(corrupt(at, "not an Event protobuf"))?;
        if first && event.file_version.as_deref() != Some("brain.Event:2") {
            return Err(corrupt(at, "first record is not the file version"));
        }
        first = false;
        if event.session_start {
            session_starts.push(event.step);
        }
        for (tag, value) in event.values {
            scalars.push(ScalarEvent {
                tag,
                step: event.step,
                value,
            });
        }
        at += 16 + len;
    }
    Ok((scalars, session_starts))
}

/// TFRecord's checksum: CRC32C, rotated and offset so that CRCs of CRCs stay well distributed.
fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn wall_time() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .map(|h| h.trim().to_string())
        .ok()
        .filter(|h| !h.is_empty())
        .unwrap_or_else(|| "localhost".to_string())
}

// Protobuf wire format: key = field << 3 | wire type (0 varint, 1 fixed64, 2 bytes, 5 fixed32).

fn put_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

fn put_varint_field(out: &mut Vec<u8>, field: u32, value: u64) {
    put_varint(out, u64::from(field) << 3);
    put_varint(out, value);
}

fn put_double(out: &mut Vec<u8>, field: u32, value: f64) {
    put_varint(out, (u64::from(field) << 3) | 1);
    out.extend_from_slice(&value.to_le_bytes());
}

fn put_fixed32(out: &mut Vec<u8>, field: u32, bits: u32) {
    put_varint(out, (u64::from(field) << 3) | 5);
    out.extend_from_slice(&bits.to_le_bytes());
}

fn put_bytes(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    put_varint(out, (u64::from(field) << 3) | 2);
    put_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

struct DecodedEvent {
    step: i64,
    file_version: Option<String>,
    session_start: bool,
    values: Vec<(String, f32)>,
}

/// A protobuf field: number and payload.
enum Field<'a> {
    Varint(u64),
    /// Skipped (the event's wall time): only its length matters.
    Fixed64,
    Fixed32(u32),
    Bytes(&'a [u8]),
}

fn fields(mut data: &[u8]) -> Option<Vec<(u64, Field<'_>)>> {
    fn varint(data: &mut &[u8]) -> Option<u64> {
        let mut value = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = data.split_first()?;
            *data = rest;
            value |= u64::from(byte & 0x7f) << shift;
            if byte < 0x80 {
                return Some(value);
            }
        }
        None
    }
    let mut out = Vec::new();
    while !data.is_empty() {
        let key = varint(&mut data)?;
        let field = match key & 7 {
            0 => Field::Varint(varint(&mut data)?),
            1 => {
                let (_, rest) = data.split_at_checked(8)?;
                data = rest;
                Field::Fixed64
            }
            2 => {
                let len = varint(&mut data)? as usize;
                let (bytes, rest) = data.split_at_checked(len)?;
                data = rest;
                Field::Bytes(bytes)
            }
            5 => {
                let (bytes, rest) = data.split_at_checked(4)?;
                data = rest;
                Field::Fixed32(u32::from_le_bytes(bytes.try_into().ok()?))
            }
            _ => return None,
        };
        out.push((key >> 3, field));
    }
    Some(out)
}

fn decode_event(data: &[u8]) -> Option<DecodedEvent> {
    let mut event = DecodedEvent {
        step: 0,
        file_version: None,
        session_start: false,
        values: Vec::new(),
    };
    for (number, field) in fields(data)? {
        match (number, field) {
            (1, Field::Fixed64) => {}
            (2, Field::Varint(step)) => event.step = step as i64,
            (3, Field::Bytes(version)) => {
                event.file_version = Some(String::from_utf8_lossy(version).into_owned());
            }
            (7, Field::Bytes(session_log)) => {
                event.session_start = fields(session_log)?
                    .iter()
                    .any(|(n, f)| *n == 1 && matches!(f, Field::Varint(SESSION_START)));
            }
            (5, Field::Bytes(summary)) => {
                for (number, value) in fields(summary)? {
                    let (1, Field::Bytes(value)) = (number, value) else {
                        continue;
                    };
                    let mut tag = None;
                    let mut simple = None;
                    for (number, field) in fields(value)? {
                        match (number, field) {
                            (1, Field::Bytes(t)) => {
                                tag = Some(String::from_utf8_lossy(t).into_owned())
                            }
                            (2, Field::Fixed32(bits)) => simple = Some(f32::from_bits(bits)),
                            _ => {}
                        }
                    }
                    event.values.push((tag?, simple?));
                }
            }
            _ => {}
        }
    }
    Some(event)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn masked_crc_matches_tensorboard() {
        // crc32c("123456789") = 0xE3069283, the CRC-32C check value.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // Masked CRCs computed by TensorBoard's own record writer
        // (tests/fixtures/make_tensorboard_fixture.py), not by this code's expression.
        let reference: serde_json::Value =
            serde_json::from_str(include_str!("../tests/fixtures/tensorboard_reference.json"))
                .expect("fixture");
        let cases = reference["masked_crc32c"].as_array().expect("cases");
        assert!(cases.len() >= 5);
        for case in cases {
            let hex = case[0].as_str().expect("hex");
            let data: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex byte"))
                .collect();
            let want = case[1].as_u64().expect("crc") as u32;
            assert_eq!(masked_crc32c(&data), want, "input {hex:?}");
        }
    }

    #[test]
    fn scalars_round_trip_through_a_real_file() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut writer = SummaryWriter::new(dir.path()).expect("writer");
        let written = [
            ("train/loss", 2.5f32, 0i64),
            ("train/accuracy", 0.125, 0),
            ("val/loss", 1.75, 0),
            ("train/lr", 1e-4, 123_456_789_012),
        ];
        for (tag, value, step) in written {
            writer.add_scalar(tag, value, step).expect("write");
        }
        writer.flush().expect("flush");
        let path = writer.path().to_path_buf();
        let read = read_scalars(&path).expect("read back");
        let expected: Vec<ScalarEvent> = written
            .iter()
            .map(|&(tag, value, step)| ScalarEvent {
                tag: tag.to_string(),
                step,
                value,
            })
            .collect();
        assert_eq!(read, expected);
        assert!(
            path.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("events.out.tfevents."))
        );
    }

    #[test]
    fn a_flipped_bit_is_detected() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut writer = SummaryWriter::new(dir.path()).expect("writer");
        writer.add_scalar("train/loss", 1.0, 3).expect("write");
        writer.flush().expect("flush");
        let path = writer.path().to_path_buf();
        drop(writer);
        let mut bytes = std::fs::read(&path).expect("read");
        let last = bytes.len() - 6;
        bytes[last] ^= 0x01;
        std::fs::write(&path, &bytes).expect("write");
        let error = read_scalars(&path).expect_err("damaged");
        assert!(
            matches!(
                error,
                EventFileError::Corrupt {
                    what: "data CRC mismatch",
                    ..
                }
            ),
            "{error}"
        );
    }

    #[test]
    fn buffered_events_reach_the_file_once_the_interval_passes() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut writer = SummaryWriter::new(dir.path())
            .expect("writer")
            .with_flush_interval(Duration::from_millis(200));
        let path = writer.path().to_path_buf();
        writer.add_scalar("train/lr", 0.1, 1).expect("write");
        // Buffered: not on disk yet.
        assert!(read_scalars(&path).expect("read").is_empty());
        std::thread::sleep(Duration::from_millis(250));
        // Nothing else written: the periodic check pushes it out.
        writer.flush_if_due().expect("flush");
        assert_eq!(read_scalars(&path).expect("read").len(), 1);
        // And a write after the interval flushes itself.
        writer.add_scalar("train/lr", 0.2, 2).expect("write");
        std::thread::sleep(Duration::from_millis(250));
        writer.add_scalar("train/lr", 0.3, 3).expect("write");
        assert_eq!(read_scalars(&path).expect("read").len(), 3);
        // The default interval is the documented 30 s.
        assert_eq!(FLUSH_INTERVAL, Duration::from_secs(30));
    }

    #[test]
    fn a_session_start_reads_back_with_its_step() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut writer = SummaryWriter::new(dir.path()).expect("writer");
        writer.add_session_start(41).expect("purge marker");
        writer.add_scalar("train/lr", 0.5, 41).expect("write");
        writer.flush().expect("flush");
        assert_eq!(read_session_starts(writer.path()).expect("read"), vec![41]);
        assert_eq!(read_scalars(writer.path()).expect("read").len(), 1);
    }
}
