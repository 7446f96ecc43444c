use std::path::PathBuf;

/// Errors from building models and moving their weights in and out of files.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    /// A ResNet depth that has no standard block layout.
    #[error("unsupported ResNet depth {depth}: choose one of 18, 34, 50, 101, 152")]
    UnsupportedDepth {
        /// The depth asked for.
        depth: usize,
    },
    /// A kernel choice (`--conv`, `--batch-norm`, `BURN_HOROVOD_CONV`, `BURN_HOROVOD_BATCHNORM`)
    /// that is neither `burn` nor `fast`.
    #[error("unknown kernel choice `{value}`: choose `burn` (Burn's own op) or `fast` (ours)")]
    UnknownOpImpl {
        /// The value given.
        value: String,
    },
    /// Reading or writing a weights file failed.
    #[error("cannot {op} weights file {path}: {source}")]
    Io {
        /// `read` or `write`.
        op: &'static str,
        /// The file.
        path: PathBuf,
        /// The underlying error.
        source: std::io::Error,
    },
    /// The file is not valid safetensors.
    #[error("{path} is not a valid safetensors file ({reason}); was it written completely?")]
    Format {
        /// The file.
        path: PathBuf,
        /// What the parser said.
        reason: String,
    },
    /// A tensor in the file does not fit the parameter of the same name.
    #[error(
        "{path}: tensor `{key}` has shape {got:?} ({dtype}) but the model expects {expected:?} (F32); \
         was the file saved from a model with another depth or class count?"
    )]
    ShapeMismatch {
        /// The file.
        path: PathBuf,
        /// The torchvision key.
        key: String,
        /// The shape the model has.
        expected: Vec<usize>,
        /// The shape in the file.
        got: Vec<usize>,
        /// The dtype in the file.
        dtype: String,
    },
    /// Keys that the model and the file do not share.
    #[error(
        "{path} does not match the model: {}; was it saved from another architecture or depth?",
        key_lists(missing, unexpected)
    )]
    KeyMismatch {
        /// The file.
        path: PathBuf,
        /// Model keys with no tensor in the file.
        missing: Vec<String>,
        /// File keys with no parameter in the model.
        unexpected: Vec<String>,
    },
}

/// How many keys of each list an error message names before it says "and N more".
const KEYS_SHOWN: usize = 12;

fn key_lists(missing: &[String], unexpected: &[String]) -> String {
    let list = |keys: &[String]| {
        let mut text = keys[..keys.len().min(KEYS_SHOWN)].join(", ");
        if keys.len() > KEYS_SHOWN {
            text.push_str(&format!(", and {} more", keys.len() - KEYS_SHOWN));
        }
        text
    };
    let mut parts = Vec::new();
    if !missing.is_empty() {
        parts.push(format!(
            "{} key(s) of the model missing from the file: {}",
            missing.len(),
            list(missing)
        ));
    }
    if !unexpected.is_empty() {
        parts.push(format!(
            "{} key(s) in the file unknown to the model: {}",
            unexpected.len(),
            list(unexpected)
        ));
    }
    parts.join("; ")
}
