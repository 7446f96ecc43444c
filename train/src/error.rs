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
    /// The training and validation folders disagree on the classes. Labels are indices into the
    /// sorted class names, so a val folder with other names would be scored with wrong labels.
    #[error(
        "{train} and {val} do not hold the same classes ({train_classes} and {val_classes} class \
         folders; only in the training folder: {}; only in the validation folder: {}); labels are \
         indices into the sorted class names, so both need the same class sub-folders",
        names_or_none(only_in_train),
        names_or_none(only_in_val)
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
        /// Class names only the training folder has (sorted).
        only_in_train: Vec<String>,
        /// Class names only the validation folder has (sorted).
        only_in_val: Vec<String>,
    },
    /// `--weights` could not be loaded or the final weights exported.
    #[error(transparent)]
    Weights(#[from] models::ModelError),
    /// The newest checkpoint was written with other learning-rate settings.
    #[error(
        "{path} was written with other training settings: {changes}. Resuming would silently \
         change how the run optimises (learning rate, global batch, regularisation). Run with the saved values, start \
         afresh with another --checkpoint-format, or pass --resume-anyway to go on with the new ones"
    )]
    ResumeChanged {
        /// The checkpoint.
        path: PathBuf,
        /// `setting: saved -> now`, comma-separated.
        changes: String,
    },
    /// Rank 0 could not start the job (it prints why); the other ranks stop with this.
    #[error("rank 0 could not start the run (its error says why); rank {rank} stops too")]
    StoppedByRankZero {
        /// This rank.
        rank: usize,
    },
    /// `--test-only` without weights to evaluate.
    #[error(
        "--test-only has nothing to evaluate: pass --weights <file.safetensors>, or point \
         --checkpoint-format at the checkpoints of a run (none found, e.g. {checkpoint})"
    )]
    NothingToEvaluate {
        /// The path of the last epoch's checkpoint under `--checkpoint-format`.
        checkpoint: PathBuf,
    },
    /// The quickstart's dataset did not appear while this process waited for local rank 0 to
    /// write it.
    #[error(
        "waited {seconds} s for local rank 0 to write the quickstart dataset (marker {marker}); \
         check that rank's output, or delete {root} and start again"
    )]
    QuickstartTimeout {
        /// The dataset folder.
        root: PathBuf,
        /// The marker file written last.
        marker: PathBuf,
        /// How long this process waited.
        seconds: u64,
    },
    /// A log or metrics file could not be written.
    #[error("cannot write {path}: {source}")]
    Log {
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// A stop signal (SIGTERM, `--save-on-signal`): every rank saved at the same step and stops;
    /// the binary exits with [`crate::preemption::PREEMPTED_EXIT_CODE`].
    #[error(
        "stopped by a signal after writing {checkpoint}; run the same command again to resume \
         from it (rank {rank})"
    )]
    Preempted {
        /// This rank.
        rank: usize,
        /// The checkpoint written (by rank 0).
        checkpoint: std::path::PathBuf,
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

fn names_or_none(names: &[String]) -> String {
    const SHOWN: usize = 10;
    if names.is_empty() {
        return "none".into();
    }
    let mut text = names[..names.len().min(SHOWN)].join(", ");
    if names.len() > SHOWN {
        text.push_str(&format!(" and {} more", names.len() - SHOWN));
    }
    text
}
