//! Each worker's last words, in torchrun's error-file format, so that a launcher (torchrun's agent
//! or ours) can name the root cause of a failed job.
//!
//! torchrun sets `TORCHELASTIC_ERROR_FILE` for every worker and, when the job fails, shows the
//! message of the file with the smallest timestamp (seconds; lowest rank on a tie) under "Root
//! Cause". Our launcher sets the same variable and also reads `rootCauseRank`, an extra field
//! torch ignores: the rank this worker's error points at (itself, or the peer it saw fail).

use crate::error::DistError;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable naming a worker's error file (torchrun's name).
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

impl DistError {
    /// The rank this error points at as the job's root cause, from `rank`'s point of view: the
    /// peer it saw fail, or `rank` itself for its own errors.
    pub fn root_cause_rank(&self, rank: usize) -> usize {
        match self {
            DistError::PeerFailed { peer, .. }
            | DistError::Timeout { peer, .. }
            | DistError::Unresponsive { peer, .. } => *peer,
            DistError::RendezvousTimeout { missing, .. } => {
                missing.first().copied().unwrap_or(rank)
            }
            // The store is served by rank 0.
            DistError::Store { .. } | DistError::StoreTimeout { .. } => 0,
            _ => rank,
        }
    }
}

/// Writes this worker's error file when a launcher asked for one (`TORCHELASTIC_ERROR_FILE`):
/// `message` (the whole error chain, as printed), this `rank`, and the `root_cause` rank. An
/// error that reports another rank's failure is dated one second later, so that torchrun keeps
/// the rank that failed first as the root cause even when it died by a signal and left no file.
///
/// # Errors
/// The file cannot be written.
pub fn write_error_file(
    message: &str,
    rank: usize,
    root_cause: usize,
) -> std::io::Result<Option<PathBuf>> {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV).map(PathBuf::from) else {
        return Ok(None);
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    write_to(
        &path,
        message,
        rank,
        root_cause,
        now + u64::from(root_cause != rank),
    )?;
    Ok(Some(path))
}

fn write_to(
    path: &Path,
    message: &str,
    rank: usize,
    root_cause: usize,
    timestamp_s: u64,
) -> std::io::Result<()> {
    // torch shows `extraInfo.py_callstack` as the failure's "traceback" and orders failures by
    // `extraInfo.timestamp` (seconds, as a string).
    let json = format!(
        "{{\"message\":{{\"message\":{m},\"extraInfo\":{{\"py_callstack\":{m},\"timestamp\":\"{timestamp_s}\",\"rank\":{rank},\"rootCauseRank\":{root_cause}}}}}}}",
        m = json_string(message)
    );
    std::fs::write(path, json)
}

/// What a worker's error file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Report {
    pub rank: usize,
    pub root_cause: usize,
    pub message: String,
}

/// Reads an error file written by [`write_error_file`].
pub(crate) fn read_report(path: &Path) -> Option<Report> {
    let text = std::fs::read_to_string(path).ok()?;
    let number = |key: &str| -> Option<usize> {
        let at = text.find(&format!("\"{key}\":"))? + key.len() + 3;
        let digits: String = text[at..]
            .chars()
            .take_while(char::is_ascii_digit)
            .collect();
        digits.parse().ok()
    };
    let at = text.find("\"message\":{\"message\":")? + "\"message\":{\"message\":".len();
    Some(Report {
        rank: number("rank")?,
        root_cause: number("rootCauseRank")?,
        message: parse_json_string(&text[at..])?,
    })
}

/// The root cause among the reports of a failed job: the rank most reports point at (a rank's
/// own failure counts as a report about itself); the lowest rank on a tie.
pub(crate) fn root_cause(reports: &[Report]) -> Option<&Report> {
    let mut votes: std::collections::BTreeMap<usize, usize> = Default::default();
    for r in reports {
        *votes.entry(r.root_cause).or_default() += 1;
    }
    let (&blamed, _) = votes
        .iter()
        .max_by(|a, b| a.1.cmp(b.1).then(b.0.cmp(a.0)))?;
    // Its own words when it left any, else what another rank saw.
    reports
        .iter()
        .find(|r| r.rank == blamed && r.root_cause == blamed)
        .or_else(|| reports.iter().find(|r| r.root_cause == blamed))
}

fn json_string(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The JSON string at the start of `s` (as [`json_string`] writes them).
fn parse_json_string(s: &str) -> Option<String> {
    let mut chars = s.strip_prefix('"')?.chars();
    let mut out = String::new();
    while let Some(c) = chars.next() {
        match c {
            '"' => return Some(out),
            '\\' => match chars.next()? {
                'n' => out.push('\n'),
                'r' => out.push('\r'),
                't' => out.push('\t'),
                'u' => {
                    let hex: String = chars.by_ref().take(4).collect();
                    out.push(char::from_u32(u32::from_str_radix(&hex, 16).ok()?)?);
                }
                other => out.push(other),
            },
            c => out.push(c),
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reports_round_trip_and_stay_valid_for_torch() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("error.json");
        let message = "error: rank 1: \"quoted\"\nsecond line\\ \u{1}";
        write_to(&path, message, 2, 1, 1_700_000_000).expect("write");
        let report = read_report(&path).expect("read");
        assert_eq!(
            report,
            Report {
                rank: 2,
                root_cause: 1,
                message: message.into()
            }
        );
        let text = std::fs::read_to_string(&path).expect("text");
        assert!(text.contains("\"timestamp\":\"1700000000\""), "{text}");
    }

    #[test]
    fn the_rank_most_reports_blame_is_the_root_cause() {
        let r = |rank, root_cause, message: &str| Report {
            rank,
            root_cause,
            message: message.into(),
        };
        let reports = [
            r(0, 2, "rank 2 stopped making progress"),
            r(1, 0, "rank 0 closed the connection"),
            r(3, 2, "rank 2 stopped making progress"),
        ];
        assert_eq!(root_cause(&reports).map(|r| r.root_cause), Some(2));
        let with_own = [r(0, 1, "peer 1 died"), r(1, 1, "bad data in rank 1")];
        let found = root_cause(&with_own).expect("found");
        assert_eq!(
            (found.rank, found.message.as_str()),
            (1, "bad data in rank 1")
        );
        assert_eq!(root_cause(&[]), None);
    }
}
