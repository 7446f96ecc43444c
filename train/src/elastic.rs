//! torchrun's error file. When a worker fails, torchrun's agent reads the JSON file named by
//! `TORCHELASTIC_ERROR_FILE` (what torch's `@record` decorator writes) and prints its message
//! under "Root Cause"; without it, torchrun shows only an exit code and a link. We write the same
//! format (`torch/distributed/elastic/multiprocessing/errors/error_handler.py`).

use crate::TrainError;
use burn_dist::DistError;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

/// The variable torchrun sets to the error file of each worker.
pub const ERROR_FILE_ENV: &str = "TORCHELASTIC_ERROR_FILE";

/// Writes `error` (printed as `message`) to torchrun's error file when running under torchrun.
/// Returns the file written, if any.
///
/// torchrun names the failure with the smallest timestamp, in whole seconds, its root cause, and
/// takes the lowest rank on a tie. An error that reports another rank's failure (a dead peer, a
/// store that went away) happened after that failure, so it is dated one second later: the rank
/// that failed first stays the root cause even when it died by a signal and left no file.
///
/// # Errors
/// The file cannot be written.
pub fn record_failure(error: &TrainError, message: &str) -> std::io::Result<Option<PathBuf>> {
    let Some(path) = std::env::var_os(ERROR_FILE_ENV).map(PathBuf::from) else {
        return Ok(None);
    };
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let timestamp = now + u64::from(reports_another_ranks_failure(error));
    write_error_file(&path, message, timestamp)?;
    Ok(Some(path))
}

/// Whether `error` is this rank noticing that another rank (or the process serving the store)
/// failed, rather than a failure of its own.
fn reports_another_ranks_failure(error: &TrainError) -> bool {
    matches!(
        error,
        TrainError::Dist(
            DistError::PeerFailed { .. }
                | DistError::Timeout { .. }
                | DistError::Broken { .. }
                | DistError::RendezvousTimeout { .. }
                | DistError::StoreTimeout { .. }
                | DistError::Store { .. }
        )
    )
}

/// torchrun's format: torch shows `extraInfo.py_callstack` as the failure's "traceback" (our
/// whole error chain) and orders failures by `extraInfo.timestamp` (seconds, as a string) to pick
/// the root cause.
fn write_error_file(path: &Path, message: &str, timestamp_s: u64) -> std::io::Result<()> {
    let json = serde_json::json!({
        "message": {
            "message": message,
            "extraInfo": {
                "py_callstack": message,
                "timestamp": timestamp_s.to_string(),
            },
        }
    });
    std::fs::write(path, json.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_error_file_has_torchruns_fields() {
        let dir = tempfile::tempdir().expect("tempdir");
        let path = dir.path().join("error.json");
        let message = "error: rank 1: \"quoted\"\nsecond line";
        write_error_file(&path, message, 1_700_000_000).expect("write");
        let text = std::fs::read_to_string(&path).expect("read");
        let v: serde_json::Value = serde_json::from_str(&text).expect("valid JSON");
        let m = &v["message"];
        assert_eq!(m["message"], message);
        assert_eq!(m["extraInfo"]["py_callstack"], message);
        // torch parses it with int(...).
        let ts = m["extraInfo"]["timestamp"].as_str().expect("a string");
        assert_eq!(ts.parse::<i64>().expect("an integer"), 1_700_000_000);
    }

    #[test]
    fn only_failures_of_other_ranks_are_dated_later() {
        let peer = TrainError::Dist(DistError::PeerFailed {
            op: "all_reduce",
            rank: 0,
            peer: 1,
            detail: "closed the connection".into(),
        });
        assert!(reports_another_ranks_failure(&peer));
        let own = TrainError::Dist(DistError::ModelMismatch {
            rank: 0,
            other_rank: 1,
            difference: "fc".into(),
        });
        assert!(!reports_another_ranks_failure(&own));
        let args = TrainError::InvalidArgs(crate::cli::InvalidArgs {
            flag: "batch-size",
            reason: "must be at least 1".into(),
        });
        assert!(!reports_another_ranks_failure(&args));
    }
}
