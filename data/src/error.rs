//! The crate's error type.

use std::path::PathBuf;

/// Everything that can go wrong in the input pipeline.
///
/// Every variant names the file or folder involved and says what to do next.
#[derive(Debug, thiserror::Error)]
pub enum DataError {
    /// The dataset root does not exist or is not a directory.
    #[error(
        "dataset root {path} does not exist or is not a directory; expected {expected} \
         (pass the folder that holds one sub-folder per class, e.g. imagenet/train)"
    )]
    MissingRoot {
        /// The path that was given.
        path: PathBuf,
        /// What the folder should contain.
        expected: &'static str,
    },
    /// The root holds no class sub-directories.
    #[error(
        "dataset root {path} holds no class folders; expected one sub-directory per class \
         (torchvision ImageFolder layout: root/<class>/<image>.JPEG)"
    )]
    NoClassFolders {
        /// The dataset root.
        path: PathBuf,
    },
    /// A class folder holds no file with an image extension.
    #[error(
        "class folder {path} holds no images; expected at least one file ending in \
         .jpg, .jpeg or .png (any case); remove the folder or add its images"
    )]
    EmptyClassFolder {
        /// The class folder.
        path: PathBuf,
    },
    /// Listing a directory failed.
    #[error("cannot list directory {path}: {source}; check that it exists and is readable")]
    ReadDir {
        /// The directory.
        path: PathBuf,
        /// The operating system's reason.
        #[source]
        source: std::io::Error,
    },
    /// A file could not be read or decoded as an image (a "bad file").
    #[error(
        "bad image file {path}: {reason}; delete or replace the file, or use \
         BadImagePolicy::Skip to skip bad files"
    )]
    BadImage {
        /// The file.
        path: PathBuf,
        /// Why the file was rejected (the decoder's or the operating system's message).
        reason: String,
    },
    /// A configuration value is out of range.
    #[error("invalid configuration: {field} = {got}; expected {expected}")]
    InvalidConfig {
        /// The offending field.
        field: &'static str,
        /// The value given.
        got: String,
        /// What is accepted.
        expected: &'static str,
    },
    /// Writing a file (synthetic dataset, marker) failed.
    #[error("cannot write {path}: {source}; check free disk space and permissions")]
    Write {
        /// The file or folder.
        path: PathBuf,
        /// The underlying error.
        #[source]
        source: std::io::Error,
    },
    /// Encoding a synthetic JPEG failed.
    #[error("cannot encode synthetic image {path}: {reason}")]
    Encode {
        /// The file being written.
        path: PathBuf,
        /// The encoder's message.
        reason: String,
    },
    /// Every sample from a bad file onward was bad, so no replacement could be found.
    #[error(
        "no readable image left to replace bad file {path} (every following sample of this \
         rank is bad too); check the dataset"
    )]
    NoReplacement {
        /// The first bad file that could not be replaced.
        path: PathBuf,
    },
    /// A worker thread pool could not be created.
    #[error("cannot start {workers} worker threads: {reason}")]
    ThreadPool {
        /// The requested thread count.
        workers: usize,
        /// The reason given by rayon.
        reason: String,
    },
}
