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
        "{path} does not match the model: {} key(s) in the model missing from the file (first: {:?}), \
         {} key(s) in the file unknown to the model (first: {:?})",
        missing.len(), missing.first(), unexpected.len(), unexpected.first()
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
