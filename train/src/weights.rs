//! Weights in and out of a run as torchvision `state_dict`s: `--weights` to start from (fine-tuning
//! skips a head of another class count), and the final model exported next to the checkpoints.

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};

use burn::module::Module;
use burn::tensor::backend::Backend;
use models::torchvision::{self, LoadOptions, LoadReport};

use crate::TrainError;

/// Loads a torchvision `state_dict` (safetensors, DDP's `module.` prefix accepted) into `model`.
/// With `skip_head` (the head's module path, e.g. `fc`), a head whose shape differs keeps the
/// model's initial values; without it, every tensor must fit.
///
/// # Errors
/// [`TrainError::Weights`] naming the file and the keys that do not fit.
pub fn load_pretrained<B: Backend, M: Module<B>>(
    model: M,
    path: &Path,
    skip_head: Option<&str>,
    device: &B::Device,
) -> Result<(M, LoadReport), TrainError> {
    let options = LoadOptions {
        skip_mismatched: skip_head.map(str::to_string).into_iter().collect(),
    };
    Ok(torchvision::load_with(model, path, device, &options)?)
}

/// What a load did, in lines for rank 0 to print.
pub fn describe_load(path: &Path, report: &LoadReport, head: &str) -> Vec<String> {
    let mut lines = vec![format!(
        "weights: {}{}",
        path.display(),
        if report.stripped_ddp_prefix {
            " (DDP's `module.` prefix removed)"
        } else {
            ""
        }
    )];
    if !report.skipped.is_empty() {
        let classes = |shape: &[usize]| shape.first().copied().unwrap_or(0);
        let weight = report
            .skipped
            .iter()
            .find(|s| s.key.ends_with(".weight"))
            .unwrap_or(&report.skipped[0]);
        let keys: Vec<&str> = report.skipped.iter().map(|s| s.key.as_str()).collect();
        lines.push(format!(
            "weights: `{head}` skipped: the file's head has {} classes, the data {}; {} keep \
             their initial values (fine-tuning)",
            classes(&weight.file_shape),
            classes(&weight.model_shape),
            keys.join(", ")
        ));
    }
    lines
}

/// Writes `model` as a torchvision `state_dict` in safetensors, atomically (temp file, fsync,
/// rename), so that a reader never sees half a file.
///
/// # Errors
/// [`TrainError::Weights`] naming the file.
pub fn export<B: Backend, M: Module<B>>(model: &M, path: &Path) -> Result<(), TrainError> {
    let bytes = torchvision::to_safetensors_bytes(model)?;
    let io = |source| models::ModelError::Io {
        op: "write",
        path: path.to_path_buf(),
        source,
    };
    let dir = match path.parent() {
        Some(d) if !d.as_os_str().is_empty() => d.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&dir).map_err(io)?;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = dir.join(format!(".{name}.tmp.{}", std::process::id()));
    let written = (|| {
        let mut file = File::create(&tmp)?;
        file.write_all(&bytes)?;
        file.sync_all()?;
        std::fs::rename(&tmp, path)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    Ok(written.map_err(io)?)
}
