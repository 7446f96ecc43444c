//! Checkpoint file names, which one a run resumes from, and which old ones go.
//!
//! `--checkpoint-format`'s `{epoch}` becomes the number of completed epochs at the end of an
//! epoch (`checkpoint-3.ckpt`), and `<epochs>-step<steps>` in the middle of one
//! (`checkpoint-3-step500.ckpt`: 3 epochs and 500 steps of the fourth done).

use std::path::{Path, PathBuf};

use crate::cli::{TrainArgs, expand_home};

use super::{Checkpoint, CheckpointError, read};

/// Where in training a checkpoint stands: completed epochs, then steps into the next one.
/// Ordered as training goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Position {
    /// Completed epochs.
    pub epochs: usize,
    /// Optimizer steps of the next epoch done (0 at the end of an epoch).
    pub steps: usize,
}

impl Position {
    /// The end of epoch `epochs`.
    pub fn epoch_end(epochs: usize) -> Self {
        Self { epochs, steps: 0 }
    }

    /// What replaces `{epoch}` in `--checkpoint-format`.
    fn name(self) -> String {
        if self.steps == 0 {
            self.epochs.to_string()
        } else {
            format!("{}-step{}", self.epochs, self.steps)
        }
    }

    fn parse(name: &str) -> Option<Self> {
        let number = |s: &str| {
            (!s.is_empty() && s.bytes().all(|b| b.is_ascii_digit()))
                .then(|| s.parse().ok())
                .flatten()
        };
        match name.split_once("-step") {
            None => Some(Self::epoch_end(number(name)?)),
            Some((epochs, steps)) => {
                let steps = number(steps)?;
                (steps > 0).then_some(Self {
                    epochs: number(epochs)?,
                    steps,
                })
            }
        }
    }
}

impl std::fmt::Display for Position {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        if self.steps == 0 {
            write!(f, "the end of epoch {}", self.epochs)
        } else {
            write!(f, "epoch {}, step {}", self.epochs + 1, self.steps)
        }
    }
}

/// The checkpoint file of `at`.
pub fn path_at(args: &TrainArgs, at: Position) -> PathBuf {
    args.checkpoint_named(&at.name())
}

/// Every checkpoint file of `--checkpoint-format` on disk with the position its name says,
/// newest first. Listed from the folder when `{epoch}` is in the file name; otherwise only the
/// epochs' files are probed (no mid-epoch ones: `--checkpoint-every` needs `{epoch}` in the file
/// name).
fn on_disk(args: &TrainArgs) -> Vec<(Position, PathBuf)> {
    let template = expand_home(Path::new(&args.checkpoint_format));
    let name = template.file_name().and_then(|n| n.to_str()).unwrap_or("");
    let mut found = Vec::new();
    if let Some((prefix, suffix)) = name.split_once("{epoch}") {
        let dir = match template.parent() {
            Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
            _ => PathBuf::from("."),
        };
        for entry in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
            let file = entry.file_name();
            let Some(file) = file.to_str() else { continue };
            let at = file
                .strip_prefix(prefix)
                .and_then(|rest| rest.strip_suffix(suffix))
                .and_then(Position::parse);
            if let Some(at) = at.filter(|at| path_at(args, *at) == dir.join(file)) {
                found.push((at, dir.join(file)));
            }
        }
    } else {
        for epochs in 1..=args.epochs {
            let at = Position::epoch_end(epochs);
            let path = path_at(args, at);
            if path.exists() {
                found.push((at, path));
            }
        }
    }
    found.sort_by_key(|entry| std::cmp::Reverse(entry.0));
    found
}

/// What resume found: the newest checkpoint that reads back intact, and the damaged ones newer
/// than it (reported, then skipped).
#[derive(Debug, Default)]
pub struct ResumeScan {
    /// The checkpoint to resume from, if any.
    pub newest_valid: Option<Checkpoint>,
    /// Newer files that failed to read, with the reason.
    pub damaged: Vec<CheckpointError>,
}

/// Takes the newest checkpoint of `--checkpoint-format` that is valid, as Horovod's example takes
/// the newest that exists, mid-epoch ones included; files past `--epochs` are not considered.
pub fn scan_for_resume(args: &TrainArgs) -> ResumeScan {
    let mut scan = ResumeScan::default();
    let last = Position::epoch_end(args.epochs);
    for (at, path) in on_disk(args).into_iter().filter(|(at, _)| *at <= last) {
        match read(&path) {
            Ok(checkpoint) if checkpoint.header.position() == at => {
                scan.newest_valid = Some(checkpoint);
                break;
            }
            Ok(checkpoint) => scan.damaged.push(CheckpointError::Damaged {
                path,
                what: format!(
                    "says {} but is named for {at}",
                    checkpoint.header.position()
                ),
            }),
            Err(error) => scan.damaged.push(error),
        }
    }
    scan
}

/// After the checkpoint at `newest` was written and read back: with `--keep-checkpoints N`,
/// deletes every older one but the newest N − 1 (mid-epoch ones counted); without it, deletes the
/// mid-epoch ones older than the one before `newest` (each epoch's checkpoint stays). Newer files
/// (of a run resumed from an older `--resume`) are left alone.
pub fn prune(args: &TrainArgs, newest: Position) -> Vec<PathBuf> {
    let older = on_disk(args).into_iter().filter(|(at, _)| *at < newest);
    let keep_older = args
        .keep_checkpoints
        .map_or(1, |keep| keep.saturating_sub(1));
    let mut removed = Vec::new();
    for (at, path) in older.skip(keep_older) {
        let goes = args.keep_checkpoints.is_some() || at.steps > 0;
        if goes && std::fs::remove_file(&path).is_ok() {
            removed.push(path);
        }
    }
    removed
}

#[cfg(test)]
mod tests {
    use super::super::{CheckpointHeader, write_file};
    use super::*;
    use clap::Parser;

    fn header(at: Position) -> CheckpointHeader {
        super::super::tests::header_at(at)
    }

    fn args_in(dir: &Path, epochs: usize) -> TrainArgs {
        let mut args = TrainArgs::parse_from(["train", "--epochs", &epochs.to_string()]);
        args.checkpoint_format = dir.join("ckpt-{epoch}.ckpt").to_string_lossy().into_owned();
        args
    }

    fn at(epochs: usize, steps: usize) -> Position {
        Position { epochs, steps }
    }

    #[test]
    fn names_round_trip_and_order_as_training_goes() {
        for p in [at(0, 7), at(3, 0), at(3, 500), at(12, 1)] {
            assert_eq!(Position::parse(&p.name()), Some(p));
        }
        for bad in [
            "", "x", "3-step", "3-step0", "-step4", "3-stepx", "+3", "3.5",
        ] {
            assert_eq!(Position::parse(bad), None, "{bad:?}");
        }
        assert!(at(1, 0) < at(1, 5) && at(1, 5) < at(2, 0) && at(2, 0) < at(2, 1));
        assert_eq!(at(3, 500).name(), "3-step500");
    }

    #[test]
    fn resume_takes_the_newest_valid_checkpoint_mid_epoch_ones_included() {
        let dir = tempfile::tempdir().expect("temp dir");
        let args = args_in(dir.path(), 5);
        for p in [at(1, 0), at(1, 4), at(2, 0), at(2, 3), at(2, 6)] {
            write_file(&path_at(&args, p), header(p), b"m", b"o").expect("write");
        }
        // Not checkpoints of this format: ignored.
        for stray in ["ckpt-2-step6.ckpt.tmp", "ckpt-latest.ckpt", "other-9.ckpt"] {
            std::fs::write(dir.path().join(stray), b"x").expect("write");
        }
        let newest = |args: &TrainArgs| {
            scan_for_resume(args)
                .newest_valid
                .map(|c| c.header.position())
        };
        assert_eq!(newest(&args), Some(at(2, 6)));

        // A damaged newest falls back to the one before; one whose header says another
        // position than its name is damaged too.
        let bytes = std::fs::read(path_at(&args, at(2, 6))).expect("read");
        std::fs::write(path_at(&args, at(2, 6)), &bytes[..bytes.len() / 2]).expect("truncate");
        std::fs::copy(path_at(&args, at(1, 4)), path_at(&args, at(2, 3))).expect("copy");
        let scan = scan_for_resume(&args);
        assert_eq!(
            scan.newest_valid.map(|c| c.header.position()),
            Some(at(2, 0))
        );
        assert_eq!(scan.damaged.len(), 2, "{:?}", scan.damaged);
        assert!(scan.damaged[0].to_string().contains("ckpt-2-step6.ckpt"));
        assert!(
            scan.damaged[1].to_string().contains("says epoch 2, step 4"),
            "{}",
            scan.damaged[1]
        );

        // Past --epochs: not a checkpoint of this run.
        assert_eq!(newest(&args_in(dir.path(), 1)), Some(at(1, 0)));
    }

    #[test]
    fn pruning_keeps_every_epoch_and_one_older_mid_epoch_checkpoint_by_default() {
        let dir = tempfile::tempdir().expect("temp dir");
        let mut args = args_in(dir.path(), 5);
        let all = [at(1, 0), at(1, 2), at(1, 4), at(2, 0), at(2, 2), at(2, 4)];
        for p in all {
            write_file(&path_at(&args, p), header(p), b"m", b"o").expect("write");
        }
        let left = |args: &TrainArgs| {
            on_disk(args)
                .into_iter()
                .map(|(p, _)| p)
                .collect::<Vec<_>>()
        };

        let removed = prune(&args, at(2, 4));
        assert_eq!(
            removed,
            vec![path_at(&args, at(1, 4)), path_at(&args, at(1, 2))]
        );
        assert_eq!(left(&args), [at(2, 4), at(2, 2), at(2, 0), at(1, 0)]);

        // --keep-checkpoints counts every kind; newer files are not this run's to remove.
        args.keep_checkpoints = Some(2);
        assert_eq!(prune(&args, at(2, 2)), vec![path_at(&args, at(1, 0))]);
        assert_eq!(left(&args), [at(2, 4), at(2, 2), at(2, 0)]);
    }
}
