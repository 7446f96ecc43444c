//! The error file a launcher reads to name a failed job's root cause: torchrun's agent, which
//! shows it under "Root Cause", or burn-dist's own launcher. The format and the writing live in
//! `burn-dist` (`burn_dist::write_error_file`); this decides what `train`'s errors point at.

use crate::TrainError;
use std::path::PathBuf;

/// The variable a launcher sets to each worker's error file.
pub use burn_dist::ERROR_FILE_ENV;

/// Writes `error` (printed as `message`) to the launcher's error file, when there is one. A
/// distributed error names the rank it points at (the peer that died, the rank that stopped
/// making progress); every other error is this rank's own. Returns the file written, if any.
///
/// # Errors
/// The file cannot be written.
pub fn record_failure(error: &TrainError, message: &str) -> std::io::Result<Option<PathBuf>> {
    let rank = std::env::var("RANK")
        .ok()
        .and_then(|r| r.trim().parse().ok())
        .unwrap_or(0);
    burn_dist::write_error_file(message, rank, root_cause_rank(error, rank))
}

fn root_cause_rank(error: &TrainError, rank: usize) -> usize {
    match error {
        TrainError::Dist(e) => e.root_cause_rank(rank),
        _ => rank,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn_dist::DistError;

    #[test]
    fn distributed_errors_point_at_the_failed_rank_others_at_this_one() {
        let peer = TrainError::Dist(DistError::PeerFailed {
            op: "all_reduce",
            rank: 0,
            peer: 1,
            detail: "closed the connection".into(),
        });
        assert_eq!(root_cause_rank(&peer, 0), 1);
        let own = TrainError::Dist(DistError::ModelMismatch {
            rank: 0,
            other_rank: 1,
            difference: "fc".into(),
        });
        assert_eq!(root_cause_rank(&own, 0), 0);
        let args = TrainError::InvalidArgs(crate::cli::InvalidArgs {
            flag: "batch-size",
            reason: "must be at least 1".into(),
        });
        assert_eq!(root_cause_rank(&args, 3), 3);
    }
}
