use std::path::PathBuf;

/// Why a training run stopped.
#[derive(Debug, thiserror::Error)]
pub enum TrainError {
    /// A flag value that cannot work.
    #[error(transparent)]
    InvalidArgs(#[from] crate::cli::InvalidArgs),
    /// The input pipeline failed (missing folder, bad file under `--on-bad-image strict`, ...).
    #[error(transparent)]
    Data(#[from] data::DataError),
    /// A collective, the rendezvous or the launcher failed.
    #[error(transparent)]
    Dist(#[from] burn_dist::DistError),
    /// A checkpoint could not be written or read.
    #[error(transparent)]
    Checkpoint(#[from] crate::checkpoint::CheckpointError),
    /// The training and validation folders disagree on the classes.
    #[error(
        "{train} has {train_classes} classes but {val} has {val_classes}; both need the same class \
         sub-folders"
    )]
    ClassMismatch {
        /// Training folder.
        train: PathBuf,
        /// Its class count.
        train_classes: usize,
        /// Validation folder.
        val: PathBuf,
        /// Its class count.
        val_classes: usize,
    },
    /// A log or metrics file could not be written.
    #[error("cannot write {path}: {source}")]
    Log {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The loss became NaN or infinite.
    #[error(
        "the training loss is {value} at epoch {epoch}, step {step}; lower --base-lr or check the data"
    )]
    Diverged {
        /// 1-based epoch.
        epoch: usize,
        /// Step within the epoch.
        step: usize,
        /// The loss.
        value: f64,
    },
}
