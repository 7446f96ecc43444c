//! `ImageFolder`: torchvision's class-per-folder dataset layout.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use rayon::prelude::*;

use crate::DataError;

/// File extensions recognised as images (compared case-insensitively), as torchvision's
/// `IMG_EXTENSIONS` restricted to what this crate decodes.
pub const IMAGE_EXTENSIONS: [&str; 3] = ["jpg", "jpeg", "png"];

/// One sample of an [`ImageFolder`]: a file and its class index.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sample {
    /// The image file.
    pub path: PathBuf,
    /// Index into [`ImageFolder::classes`].
    pub label: usize,
}

/// A dataset laid out as `root/<class>/<image>`, scanned like torchvision's `ImageFolder`.
///
/// Classes are the sub-directory names sorted byte-wise (so `class_to_idx` matches torchvision's),
/// samples are sorted by class then by file name. Files count as images when their extension is
/// `.jpg`, `.jpeg` or `.png` in any case; the decoder then sniffs the content (magic bytes), so a
/// PNG named `.JPEG` decodes. The class folders are listed in parallel (rayon).
#[derive(Debug, Clone)]
pub struct ImageFolder {
    root: PathBuf,
    classes: Vec<String>,
    samples: Vec<Sample>,
}

/// Whether `path` has an image extension (case-insensitive).
pub fn has_image_extension(path: &Path) -> bool {
    path.extension()
        .and_then(|e| e.to_str())
        .is_some_and(|e| IMAGE_EXTENSIONS.iter().any(|x| e.eq_ignore_ascii_case(x)))
}

impl ImageFolder {
    /// Scans `root`.
    ///
    /// # Errors
    /// [`DataError::MissingRoot`] if `root` is not a directory, [`DataError::NoClassFolders`] if it
    /// has no sub-directories, [`DataError::EmptyClassFolder`] naming the first (sorted) class
    /// folder without any image file, [`DataError::ReadDir`] if a directory cannot be listed.
    pub fn new(root: impl AsRef<Path>) -> Result<Self, DataError> {
        let root = root.as_ref().to_path_buf();
        if !root.is_dir() {
            return Err(DataError::MissingRoot {
                path: root,
                expected: "a directory with one sub-directory per class",
            });
        }
        let read_dir = |dir: &Path| {
            std::fs::read_dir(dir).map_err(|source| DataError::ReadDir {
                path: dir.to_path_buf(),
                source,
            })
        };
        let mut classes = Vec::new();
        for entry in read_dir(&root)? {
            let entry = entry.map_err(|source| DataError::ReadDir {
                path: root.clone(),
                source,
            })?;
            // Follow symlinks, as torchvision's os.scandir(..).is_dir() does.
            if entry.path().is_dir() {
                classes.push(entry.file_name().to_string_lossy().into_owned());
            }
        }
        classes.sort();
        if classes.is_empty() {
            return Err(DataError::NoClassFolders { path: root });
        }
        let per_class: Vec<Result<Vec<PathBuf>, DataError>> = classes
            .par_iter()
            .map(|class| {
                let dir = root.join(class);
                let mut files = Vec::new();
                for entry in read_dir(&dir)? {
                    let entry = entry.map_err(|source| DataError::ReadDir {
                        path: dir.clone(),
                        source,
                    })?;
                    let path = entry.path();
                    // A directory named like an image is kept (it fails at decode time, like an
                    // unreadable file); sub-directories are otherwise not walked.
                    if has_image_extension(&path) {
                        files.push(path);
                    }
                }
                if files.is_empty() {
                    return Err(DataError::EmptyClassFolder { path: dir });
                }
                files.sort();
                Ok(files)
            })
            .collect();
        let mut samples = Vec::new();
        for (label, files) in per_class.into_iter().enumerate() {
            samples.extend(files?.into_iter().map(|path| Sample { path, label }));
        }
        Ok(Self {
            root,
            classes,
            samples,
        })
    }

    /// A folder from its parts (read back from an index, see [`ImageFolder::with_index`]).
    pub(crate) fn from_parts(root: PathBuf, classes: Vec<String>, samples: Vec<Sample>) -> Self {
        Self {
            root,
            classes,
            samples,
        }
    }

    /// The folder that was scanned.
    pub fn root(&self) -> &Path {
        &self.root
    }

    /// Class names, sorted; the label of a sample is an index into this list.
    pub fn classes(&self) -> &[String] {
        &self.classes
    }

    /// torchvision's `class_to_idx`.
    pub fn class_to_idx(&self) -> HashMap<String, usize> {
        self.classes
            .iter()
            .enumerate()
            .map(|(i, c)| (c.clone(), i))
            .collect()
    }

    /// All samples, sorted by class then file name.
    pub fn samples(&self) -> &[Sample] {
        &self.samples
    }

    /// Number of samples.
    pub fn len(&self) -> usize {
        self.samples.len()
    }

    /// Whether the dataset is empty (never true for a successfully scanned folder).
    pub fn is_empty(&self) -> bool {
        self.samples.is_empty()
    }

    /// Number of classes.
    pub fn num_classes(&self) -> usize {
        self.classes.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn extensions_are_case_insensitive() {
        assert!(has_image_extension(Path::new("a/b.JPEG")));
        assert!(has_image_extension(Path::new("a/b.Jpg")));
        assert!(has_image_extension(Path::new("b.png")));
        assert!(!has_image_extension(Path::new("b.txt")));
        assert!(!has_image_extension(Path::new("jpeg")));
    }
}
