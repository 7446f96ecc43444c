//! Checkpoints: written by rank 0 after every epoch (and, with `--checkpoint-every` or on a stop
//! signal, in the middle of one) to a temp file, fsynced, renamed, so that a crash never leaves a
//! damaged newest file; every section carries a CRC32C so that resume can tell a damaged file from
//! a good one and fall back to the previous one. Their names and which one resumes: [`files`].
//!
//! Layout: `BURNCKPT` magic, u32 format version, u64 header length, the JSON header
//! ([`CheckpointHeader`]), u32 CRC32C of the header, then the sections the header lists (model
//! record and optimizer record, Burn's bincode records at full precision, and with `--model-ema`
//! an `ema` section, the averaged model's record; files without it read as before).

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::optim::Optimizer;
use burn::record::{BinBytesRecorder, FullPrecisionSettings, Recorder};
use burn::tensor::backend::{AutodiffBackend, Backend};
use serde::{Deserialize, Serialize};

use crate::cli::TrainArgs;
use crate::metrics::EpochMetrics;
use crate::preemption::MidEpoch;

mod files;
pub mod training;
pub mod writer;

pub use files::{Position, ResumeScan, path_at, prune, scan_for_resume};

const MAGIC: &[u8; 8] = b"BURNCKPT";
/// 2: the optimizer section is `train::optim::TorchOptimizer`'s record. 1 (still read): it was
/// Burn's SGD adaptor record, which no optimizer of this version loads.
const FORMAT_VERSION: u32 = 2;

type Bytes = BinBytesRecorder<FullPrecisionSettings>;

/// Errors saving or loading a checkpoint.
#[derive(Debug, thiserror::Error)]
pub enum CheckpointError {
    /// The file system refused.
    #[error("cannot {op} checkpoint {path}: {source}")]
    Io {
        /// What we tried.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The cause.
        source: std::io::Error,
    },
    /// The checkpoint-writing thread panicked or could not be started.
    #[error(
        "the checkpoint-writing thread failed (see the panic above, or the system is out of \
         threads); the last checkpoint on disk is intact"
    )]
    WriterGone,
    /// The file is not a checkpoint, is truncated, or a checksum does not match.
    #[error("checkpoint {path} is damaged: {what}")]
    Damaged {
        /// The file.
        path: PathBuf,
        /// What is wrong.
        what: String,
    },
    /// The checkpoint was written for another model.
    #[error(
        "checkpoint {path} holds another model ({saved}) than this run ({current}); \
         pass the same --model, or another --checkpoint-format to start afresh"
    )]
    OtherModel {
        /// The file.
        path: PathBuf,
        /// What the file holds.
        saved: String,
        /// What this run trains.
        current: String,
    },
    /// Burn could not encode or decode a record.
    #[error("checkpoint {path}: cannot {op} the {section} record: {reason}")]
    Record {
        /// The file.
        path: PathBuf,
        /// `encode` or `decode`.
        op: &'static str,
        /// `model` or `optimizer`.
        section: &'static str,
        /// What Burn said.
        reason: String,
    },
}

/// Where a section lies in the file.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Section {
    /// `model`, `optimizer` or `ema`.
    pub name: String,
    /// Byte length.
    pub len: u64,
    /// CRC32C of the bytes.
    pub crc32c: u32,
}

/// Everything in a checkpoint besides the tensors.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CheckpointHeader {
    /// Completed epochs: training resumes at this 0-based epoch.
    pub epoch: usize,
    /// The run's flags (the config).
    pub args: TrainArgs,
    /// Processes in the run that wrote it.
    pub world_size: usize,
    /// Data-order state: the sampler's permutation is a function of (seed, epoch), and the
    /// augmentations of (seed, epoch, sample index), so these two restore the data order exactly.
    pub data_seed: u64,
    /// Parameter paths, shapes and dtypes in visit order, to refuse a checkpoint of another model
    /// before decoding.
    pub model_fingerprint: String,
    /// The sections that follow the header.
    pub sections: Vec<Section>,
    /// Every epoch's figures up to this one: on resume, `metrics.jsonl` and TensorBoard are
    /// repaired from it (an epoch checkpointed but not yet logged when the run died).
    #[serde(default)]
    pub history: Vec<EpochMetrics>,
    /// `--model-ema`: the EMA's update count since its last reset (torchvision's `n_averaged`);
    /// present exactly when the file has an `ema` section.
    #[serde(default)]
    pub ema_n_averaged: Option<u64>,
    /// A checkpoint written in the middle of epoch `epoch` (0-based: `epoch` epochs are done):
    /// where, and the epoch's figures so far. `None` at the end of an epoch.
    #[serde(default)]
    pub mid_epoch: Option<MidEpoch>,
}

impl CheckpointHeader {
    /// Where in training the checkpoint stands.
    pub fn position(&self) -> Position {
        Position {
            epochs: self.epoch,
            steps: self.mid_epoch.map_or(0, |m| m.step),
        }
    }
}

/// A checkpoint read from disk and checked, not yet decoded into a model.
#[derive(Debug)]
pub struct Checkpoint {
    /// The file.
    pub path: PathBuf,
    /// Its header.
    pub header: CheckpointHeader,
    version: u32,
    model: Vec<u8>,
    optimizer: Vec<u8>,
    ema: Option<Vec<u8>>,
}

/// Parameter paths, shapes and dtypes in visit order: burn-dist's cross-rank model check, reused
/// to refuse a checkpoint of another model before decoding it.
pub fn model_fingerprint<B: Backend, M: Module<B>>(model: &M) -> String {
    burn_dist::Fingerprint::of::<B, M>(model).entries.join(";")
}

/// Writes a checkpoint atomically: temp file in the same directory, fsync, rename, fsync the
/// directory. `ema` (the averaged model of `--model-ema`) becomes an `ema` section.
///
/// # Errors
/// [`CheckpointError`] naming the file.
pub fn save<B, M, O>(
    path: &Path,
    header: CheckpointHeader,
    model: &M,
    optimizer: &O,
    ema: Option<&M::InnerModule>,
) -> Result<(), CheckpointError>
where
    B: AutodiffBackend,
    M: Module<B> + burn::module::AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    encode(path, header, model, optimizer, ema)?.write()
}

/// A checkpoint in host memory, ready to be written (on another thread, see [`writer`]).
pub struct Encoded {
    path: PathBuf,
    header: CheckpointHeader,
    sections: Vec<(&'static str, Vec<u8>)>,
}

impl Encoded {
    /// The file it goes to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes it atomically (see [`save`]).
    ///
    /// # Errors
    /// [`CheckpointError`] naming the file.
    pub fn write(self) -> Result<(), CheckpointError> {
        let sections: Vec<(&str, &[u8])> = self
            .sections
            .iter()
            .map(|(name, bytes)| (*name, bytes.as_slice()))
            .collect();
        write_sections(&self.path, self.header, &sections)
    }
}

/// Copies the model, the optimizer state and the EMA to host memory as the file's sections: the
/// part of a checkpoint that must happen at the step boundary.
///
/// # Errors
/// [`CheckpointError::Record`] when Burn cannot encode a record.
pub fn encode<B, M, O>(
    path: &Path,
    header: CheckpointHeader,
    model: &M,
    optimizer: &O,
    ema: Option<&M::InnerModule>,
) -> Result<Encoded, CheckpointError>
where
    B: AutodiffBackend,
    M: Module<B> + burn::module::AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    let record_error = |section, reason: String| CheckpointError::Record {
        path: path.to_path_buf(),
        op: "encode",
        section,
        reason,
    };
    let model_bytes = Recorder::<B>::record(&Bytes::default(), model.clone().into_record(), ())
        .map_err(|e| record_error("model", e.to_string()))?;
    let optimizer_bytes = Recorder::<B>::record(&Bytes::default(), optimizer.to_record(), ())
        .map_err(|e| record_error("optimizer", e.to_string()))?;
    let mut sections = vec![("model", model_bytes), ("optimizer", optimizer_bytes)];
    if let Some(ema) = ema {
        let bytes =
            Recorder::<B::InnerBackend>::record(&Bytes::default(), ema.clone().into_record(), ())
                .map_err(|e| record_error("ema", e.to_string()))?;
        sections.push(("ema", bytes));
    }
    Ok(Encoded {
        path: path.to_path_buf(),
        header,
        sections,
    })
}

#[cfg(test)]
fn write_file(
    path: &Path,
    header: CheckpointHeader,
    model: &[u8],
    optimizer: &[u8],
) -> Result<(), CheckpointError> {
    write_sections(path, header, &[("model", model), ("optimizer", optimizer)])
}

fn write_sections(
    path: &Path,
    mut header: CheckpointHeader,
    sections: &[(&str, &[u8])],
) -> Result<(), CheckpointError> {
    let io = |op, source| CheckpointError::Io {
        op,
        path: path.to_path_buf(),
        source,
    };
    header.sections = sections
        .iter()
        .map(|(name, bytes)| Section {
            name: name.to_string(),
            len: bytes.len() as u64,
            crc32c: crc32c::crc32c(bytes),
        })
        .collect();
    let json = serde_json::to_vec(&header).map_err(|e| io("encode", std::io::Error::other(e)))?;

    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(|e| io("create the directory of", e))?;
    let file_name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{file_name}.tmp.{}", std::process::id()));
    let result = (|| {
        let mut file = File::create(&tmp)?;
        file.write_all(MAGIC)?;
        file.write_all(&FORMAT_VERSION.to_le_bytes())?;
        file.write_all(&(json.len() as u64).to_le_bytes())?;
        file.write_all(&json)?;
        file.write_all(&crc32c::crc32c(&json).to_le_bytes())?;
        for (_, bytes) in sections {
            file.write_all(bytes)?;
        }
        file.sync_all()?;
        std::fs::rename(&tmp, path)?;
        // The rename is durable only once the directory entry is.
        File::open(&dir)?.sync_all()
    })();
    if result.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    result.map_err(|e| io("write", e))
}

/// Reads a checkpoint and checks magic, version, header and section checksums.
///
/// # Errors
/// [`CheckpointError::Io`] if unreadable, [`CheckpointError::Damaged`] if anything is off.
pub fn read(path: &Path) -> Result<Checkpoint, CheckpointError> {
    let bytes = std::fs::read(path).map_err(|source| CheckpointError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    let damaged = |what: &str| CheckpointError::Damaged {
        path: path.to_path_buf(),
        what: what.to_string(),
    };
    if bytes.len() < 20 || &bytes[..8] != MAGIC {
        return Err(damaged("not a checkpoint file (bad magic or too short)"));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().map_err(|_| damaged("version"))?);
    if !(1..=FORMAT_VERSION).contains(&version) {
        return Err(damaged(&format!(
            "format version {version}, expected {FORMAT_VERSION}"
        )));
    }
    let header_len =
        u64::from_le_bytes(bytes[12..20].try_into().map_err(|_| damaged("length"))?) as usize;
    let json = bytes
        .get(20..20usize.saturating_add(header_len))
        .ok_or_else(|| damaged("truncated header"))?;
    let crc_at = 20 + header_len;
    let crc = bytes
        .get(crc_at..crc_at + 4)
        .ok_or_else(|| damaged("truncated header checksum"))?;
    if crc32c::crc32c(json).to_le_bytes() != crc {
        return Err(damaged("header checksum mismatch"));
    }
    let header: CheckpointHeader =
        serde_json::from_slice(json).map_err(|e| damaged(&format!("header: {e}")))?;
    let mut at = crc_at + 4;
    let mut sections = Vec::new();
    for section in &header.sections {
        let end = at.saturating_add(section.len as usize);
        let data = bytes
            .get(at..end)
            .ok_or_else(|| damaged(&format!("truncated in section `{}`", section.name)))?;
        if crc32c::crc32c(data) != section.crc32c {
            return Err(damaged(&format!(
                "checksum mismatch in section `{}`",
                section.name
            )));
        }
        sections.push((section.name.clone(), data.to_vec()));
        at = end;
    }
    if at != bytes.len() {
        return Err(damaged("trailing bytes after the last section"));
    }
    let mut take = |name: &str| {
        sections
            .iter()
            .position(|(n, _)| n == name)
            .map(|i| sections.swap_remove(i).1)
    };
    let (Some(model), Some(optimizer)) = (take("model"), take("optimizer")) else {
        return Err(damaged("model or optimizer section missing"));
    };
    let ema = take("ema");
    Ok(Checkpoint {
        path: path.to_path_buf(),
        header,
        version,
        model,
        optimizer,
        ema,
    })
}

impl Checkpoint {
    /// Whether the optimizer section is in this version's format (files written before the
    /// optimizer choice hold Burn's SGD record, which is not read back).
    pub fn has_current_optimizer_format(&self) -> bool {
        self.version == FORMAT_VERSION
    }

    /// Loads the weights and the optimizer state into `model` and `optimizer`.
    ///
    /// # Errors
    /// [`CheckpointError::OtherModel`] when the file holds another architecture.
    pub fn restore<B, M, O>(
        &self,
        model: M,
        optimizer: O,
        device: &B::Device,
    ) -> Result<(M, O), CheckpointError>
    where
        B: AutodiffBackend,
        M: Module<B> + burn::module::AutodiffModule<B>,
        O: Optimizer<M, B>,
    {
        let current = model_fingerprint(&model);
        if current != self.header.model_fingerprint {
            return Err(CheckpointError::OtherModel {
                path: self.path.clone(),
                saved: self.header.args.model.clone(),
                current: "the model of this run".to_string(),
            });
        }
        let decode = |section, reason: String| CheckpointError::Record {
            path: self.path.clone(),
            op: "decode",
            section,
            reason,
        };
        let model_record = Recorder::<B>::load(&Bytes::default(), self.model.clone(), device)
            .map_err(|e| decode("model", e.to_string()))?;
        let optimizer_record =
            Recorder::<B>::load(&Bytes::default(), self.optimizer.clone(), device)
                .map_err(|e| decode("optimizer", e.to_string()))?;
        Ok((
            model.load_record(model_record),
            optimizer.load_record(optimizer_record),
        ))
    }

    /// Loads only the weights (evaluation needs no optimizer state).
    ///
    /// # Errors
    /// [`CheckpointError::OtherModel`] when the file holds another architecture.
    pub fn restore_model<B, M>(&self, model: M, device: &B::Device) -> Result<M, CheckpointError>
    where
        B: Backend,
        M: Module<B>,
    {
        self.restore_section(model, &self.model, "model", device)
    }

    /// Whether the file holds an EMA (`--model-ema`), and its update count.
    pub fn ema_n_averaged(&self) -> Option<u64> {
        self.ema
            .as_ref()
            .map(|_| self.header.ema_n_averaged.unwrap_or(1))
    }

    /// Loads the EMA's weights and buffers into `model` (any backend: the record is the same),
    /// or `None` when the file has no EMA.
    ///
    /// # Errors
    /// [`CheckpointError::OtherModel`] when the file holds another architecture.
    pub fn restore_ema<B, M>(
        &self,
        model: M,
        device: &B::Device,
    ) -> Result<Option<M>, CheckpointError>
    where
        B: Backend,
        M: Module<B>,
    {
        self.ema
            .as_ref()
            .map(|bytes| self.restore_section(model, bytes, "ema", device))
            .transpose()
    }

    fn restore_section<B, M>(
        &self,
        model: M,
        bytes: &[u8],
        section: &'static str,
        device: &B::Device,
    ) -> Result<M, CheckpointError>
    where
        B: Backend,
        M: Module<B>,
    {
        if model_fingerprint(&model) != self.header.model_fingerprint {
            return Err(CheckpointError::OtherModel {
                path: self.path.clone(),
                saved: self.header.args.model.clone(),
                current: "the model of this run".to_string(),
            });
        }
        let record =
            Recorder::<B>::load(&Bytes::default(), bytes.to_vec(), device).map_err(|e| {
                CheckpointError::Record {
                    path: self.path.clone(),
                    op: "decode",
                    section,
                    reason: e.to_string(),
                }
            })?;
        Ok(model.load_record(record))
    }
}

#[cfg(test)]
pub(super) mod tests {
    use super::*;
    use clap::Parser;

    fn header(epoch: usize) -> CheckpointHeader {
        header_at(Position::epoch_end(epoch))
    }

    /// A header of a default run at `at` (a mid-epoch position when `at.steps > 0`).
    pub(super) fn header_at(at: Position) -> CheckpointHeader {
        CheckpointHeader {
            epoch: at.epochs,
            args: TrainArgs::parse_from(["train"]),
            world_size: 1,
            data_seed: 42,
            model_fingerprint: "[2, 2]".into(),
            sections: Vec::new(),
            history: Vec::new(),
            ema_n_averaged: None,
            mid_epoch: (at.steps > 0).then(|| crate::preemption::MidEpoch {
                step: at.steps,
                samples: at.steps * 8,
                totals: Default::default(),
                elapsed_s: 1.0,
                data_wait_s: 0.0,
            }),
        }
    }

    #[test]
    fn written_file_reads_back_and_any_damage_is_detected() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("checkpoint-3.ckpt");
        write_file(&path, header(3), b"model-bytes", b"optimizer-bytes").expect("write");
        let checkpoint = read(&path).expect("reads back");
        assert_eq!(checkpoint.header.epoch, 3);
        assert_eq!(checkpoint.model, b"model-bytes");
        assert_eq!(checkpoint.optimizer, b"optimizer-bytes");
        // No temp file is left behind.
        let names: Vec<_> = std::fs::read_dir(dir.path()).expect("ls").collect();
        assert_eq!(names.len(), 1);

        let good = std::fs::read(&path).expect("read");
        for (what, bytes) in [
            ("truncated", good[..good.len() - 3].to_vec()),
            ("flipped bit in the optimizer", {
                let mut b = good.clone();
                let last = b.len() - 1;
                b[last] ^= 0x10;
                b
            }),
            ("flipped bit in the header", {
                let mut b = good.clone();
                b[30] ^= 0x01;
                b
            }),
            ("empty", Vec::new()),
        ] {
            std::fs::write(&path, &bytes).expect("write");
            let error = read(&path).expect_err(what);
            assert!(
                matches!(error, CheckpointError::Damaged { .. }),
                "{what}: {error}"
            );
            assert!(error.to_string().contains("checkpoint-3.ckpt"), "{error}");
        }
    }

    #[test]
    fn the_ema_section_is_optional_and_older_files_read() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("checkpoint-1.ckpt");
        let mut with_ema = header(1);
        with_ema.ema_n_averaged = Some(7);
        write_sections(
            &path,
            with_ema,
            &[("model", b"m"), ("optimizer", b"o"), ("ema", b"e")],
        )
        .expect("write");
        let checkpoint = read(&path).expect("reads back");
        assert_eq!(checkpoint.ema.as_deref(), Some(&b"e"[..]));
        assert_eq!(checkpoint.ema_n_averaged(), Some(7));
        assert_eq!(
            (checkpoint.model.as_slice(), checkpoint.optimizer.as_slice()),
            (&b"m"[..], &b"o"[..])
        );

        // A file from before the EMA: no section, no count in its header.
        write_file(&path, header(1), b"m", b"o").expect("write");
        let mut json = serde_json::to_value(read(&path).expect("reads").header).expect("json");
        json.as_object_mut()
            .expect("object")
            .remove("ema_n_averaged");
        let old: CheckpointHeader = serde_json::from_value(json).expect("old header reads");
        assert!(old.ema_n_averaged.is_none());
        assert!(read(&path).expect("reads").ema_n_averaged().is_none());
    }
}
