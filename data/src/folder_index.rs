//! A cached [`ImageFolder`] index, so that only one process per machine lists a 1.28 M-file tree.
//!
//! Every rank of a job used to scan the whole tree at start-up: 1.28 M directory entries for
//! ImageNet's train split, per rank, per run, which on a network file system is minutes. Instead,
//! the first process to take the index's lock scans and writes the index (atomically: a temporary
//! file, fsynced, then renamed); every other process waits for the lock and reads it. A later run
//! reads it too, as long as it still describes the tree: the index records the modification time
//! and size of the root and of every class folder, and any file added, removed or renamed in one
//! of them changes its folder's modification time, which makes the index stale and the next run
//! scan again. Changing a file's content in place is not noticed, and need not be: the index holds
//! names, and images are read at load time.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::time::UNIX_EPOCH;

use crate::DataError;
use crate::folder::{ImageFolder, Sample};

/// The first bytes of an index file; a change of the format or of what counts as an image
/// changes it, so an old index is rescanned rather than misread.
const MAGIC: &[u8; 16] = b"bh-imgfolder-v1\n";
const END: &[u8; 4] = b"end\n";

/// Where an [`ImageFolder`] from [`ImageFolder::with_index`] came from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IndexSource {
    /// Read from this index file, which still described the tree.
    Read(PathBuf),
    /// Scanned, and the index written to this file.
    Scanned(PathBuf),
    /// Scanned; the index could not be written (the reason). Start-up still works, only slower.
    ScannedNotCached(String),
}

/// Modification time (ns since the epoch) and size of a folder.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Stamp {
    mtime_ns: i128,
    size: u64,
}

fn stamp(dir: &Path) -> std::io::Result<Stamp> {
    let meta = std::fs::metadata(dir)?;
    let mtime_ns = match meta.modified()?.duration_since(UNIX_EPOCH) {
        Ok(after) => after.as_nanos() as i128,
        Err(before) => -(before.duration().as_nanos() as i128),
    };
    Ok(Stamp {
        mtime_ns,
        size: meta.len(),
    })
}

impl ImageFolder {
    /// [`ImageFolder::new`] through an index cached in `index_dir` (one file per dataset root,
    /// named after a hash of its absolute path): read when it still describes `root`, else
    /// scanned and written, by one process at a time.
    ///
    /// # Errors
    /// As [`ImageFolder::new`]; a failure to read or write the index is not an error (the tree is
    /// scanned instead, see [`IndexSource::ScannedNotCached`]).
    pub fn with_index(
        root: impl AsRef<Path>,
        index_dir: &Path,
    ) -> Result<(Self, IndexSource), DataError> {
        let root = root.as_ref();
        let absolute = std::path::absolute(root).unwrap_or_else(|_| root.to_path_buf());
        let Some(key) = absolute.to_str() else {
            let folder = Self::new(root)?;
            return Ok((
                folder,
                IndexSource::ScannedNotCached(format!("{} is not UTF-8", root.display())),
            ));
        };
        let index = index_dir.join(format!("{:016x}.idx", fnv1a64(key)));
        if let Some(folder) = read_index(&index, root, key) {
            return Ok((folder, IndexSource::Read(index)));
        }
        // One process scans; the others wait here, then find the index it wrote.
        let lock = std::fs::create_dir_all(index_dir)
            .and_then(|()| File::create(index.with_extension("lock")))
            .and_then(|lock| lock.lock().map(|()| lock));
        let lock = match lock {
            Ok(lock) => lock,
            Err(error) => {
                let folder = Self::new(root)?;
                let why = format!("cannot lock {}: {error}", index.display());
                return Ok((folder, IndexSource::ScannedNotCached(why)));
            }
        };
        if let Some(folder) = read_index(&index, root, key) {
            return Ok((folder, IndexSource::Read(index)));
        }
        // Stamps before the scan: a change during the scan then makes the index stale, never wrong.
        let stamps = folder_stamps(root);
        let folder = Self::new(root)?;
        let source = match stamps.and_then(|(root_stamp, class_stamps)| {
            write_index(&index, key, &folder, root_stamp, &class_stamps)
        }) {
            Ok(()) => IndexSource::Scanned(index),
            Err(error) => IndexSource::ScannedNotCached(format!(
                "cannot write the index {}: {error}",
                index.display()
            )),
        };
        drop(lock);
        Ok((folder, source))
    }
}

/// The root's stamp and each sub-folder's (name, stamp), names sorted.
fn folder_stamps(root: &Path) -> std::io::Result<(Stamp, Vec<(String, Stamp)>)> {
    let root_stamp = stamp(root)?;
    let mut classes = Vec::new();
    for entry in std::fs::read_dir(root)? {
        let path = entry?.path();
        if path.is_dir() {
            let name = path
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| std::io::Error::other("a class folder name is not UTF-8"))?
                .to_string();
            classes.push((name, stamp(&path)?));
        }
    }
    classes.sort_by(|a, b| a.0.cmp(&b.0));
    Ok((root_stamp, classes))
}

fn fnv1a64(text: &str) -> u64 {
    text.bytes().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3)
    })
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u32).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_stamp(out: &mut Vec<u8>, s: Stamp) {
    out.extend_from_slice(&s.mtime_ns.to_le_bytes());
    out.extend_from_slice(&s.size.to_le_bytes());
}

fn write_index(
    index: &Path,
    key: &str,
    folder: &ImageFolder,
    root_stamp: Stamp,
    class_stamps: &[(String, Stamp)],
) -> std::io::Result<()> {
    let names: Vec<&String> = class_stamps.iter().map(|(n, _)| n).collect();
    if names
        .iter()
        .map(|n| n.as_str())
        .ne(folder.classes().iter().map(String::as_str))
    {
        return Err(std::io::Error::other(
            "the class folders changed during the scan",
        ));
    }
    let mut out = Vec::with_capacity(64 + folder.len() * 32);
    out.extend_from_slice(MAGIC);
    put_str(&mut out, key);
    put_stamp(&mut out, root_stamp);
    out.extend_from_slice(&(class_stamps.len() as u32).to_le_bytes());
    let mut samples = folder.samples().iter().peekable();
    for (label, (name, class_stamp)) in class_stamps.iter().enumerate() {
        put_str(&mut out, name);
        put_stamp(&mut out, *class_stamp);
        let mut files = Vec::new();
        while let Some(sample) = samples.next_if(|s| s.label == label) {
            let file = sample
                .path
                .file_name()
                .and_then(|n| n.to_str())
                .ok_or_else(|| std::io::Error::other("a file name is not UTF-8"))?;
            files.push(file);
        }
        out.extend_from_slice(&(files.len() as u32).to_le_bytes());
        for file in files {
            put_str(&mut out, file);
        }
    }
    out.extend_from_slice(END);
    let tmp = index.with_extension(format!("tmp{}", std::process::id()));
    let written = (|| {
        let mut file = BufWriter::new(File::create(&tmp)?);
        file.write_all(&out)?;
        file.into_inner().map_err(|e| e.into_error())?.sync_all()?;
        std::fs::rename(&tmp, index)
    })();
    if written.is_err() {
        let _ = std::fs::remove_file(&tmp);
    }
    written
}

/// A cursor over the index's bytes; `None` on any truncation.
struct Reader<'a>(&'a [u8]);

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Option<&'a [u8]> {
        if self.0.len() < n {
            return None;
        }
        let (head, tail) = self.0.split_at(n);
        self.0 = tail;
        Some(head)
    }
    fn u32(&mut self) -> Option<u32> {
        Some(u32::from_le_bytes(self.take(4)?.try_into().ok()?))
    }
    fn str(&mut self) -> Option<&'a str> {
        let n = self.u32()? as usize;
        std::str::from_utf8(self.take(n)?).ok()
    }
    fn stamp(&mut self) -> Option<Stamp> {
        Some(Stamp {
            mtime_ns: i128::from_le_bytes(self.take(16)?.try_into().ok()?),
            size: u64::from_le_bytes(self.take(8)?.try_into().ok()?),
        })
    }
}

/// The folder the index at `index` describes, when it exists, is whole, is for `key`, and every
/// folder stamp still matches; `None` otherwise (the caller scans).
fn read_index(index: &Path, root: &Path, key: &str) -> Option<ImageFolder> {
    let bytes = std::fs::read(index).ok()?;
    let mut r = Reader(&bytes);
    if r.take(MAGIC.len())? != MAGIC || r.str()? != key || r.stamp()? != stamp(root).ok()? {
        return None;
    }
    let num_classes = r.u32()? as usize;
    let mut classes = Vec::with_capacity(num_classes);
    let mut samples = Vec::new();
    for label in 0..num_classes {
        let name = r.str()?;
        let dir = root.join(name);
        if r.stamp()? != stamp(&dir).ok()? {
            return None;
        }
        let count = r.u32()? as usize;
        samples.reserve(count);
        for _ in 0..count {
            samples.push(Sample {
                path: dir.join(r.str()?),
                label,
            });
        }
        classes.push(name.to_string());
    }
    if r.take(END.len())? != END || !r.0.is_empty() {
        return None;
    }
    // A class folder added since (its own stamp is new, but the root's changed too) is caught
    // above by the root's stamp; nothing else can appear without changing a stamp.
    Some(ImageFolder::from_parts(
        root.to_path_buf(),
        classes,
        samples,
    ))
}
