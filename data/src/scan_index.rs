//! Entry points into each file's JPEG scan, kept from one epoch to the next.
//!
//! A JPEG without restart markers (nearly every camera and ImageNet file) must be
//! entropy-decoded from its first bit up to any pixel: a crop at the bottom right costs nearly
//! a whole decode. While decoding, the patched zune-jpeg marks where a few MCUs of every row
//! start (4 per MCU row and one at the last crop's first column, 8 bytes each: 1.2 KB for a
//! 500 × 375 file); the next time the loader
//! decodes that file, a crop starts each of its rows at the mark left of it and skips the rows
//! above and the columns beside it. The first epoch builds the marks, later epochs use and
//! complete them. The pixels are the same with or without them
//! (`data/tests/decode_region.rs`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};

use zune_jpeg::ScanIndex;

/// What the marks of one file cost beyond their own heap bytes (the slot's box and the key).
const ENTRY_OVERHEAD: usize = std::mem::size_of::<Entry>() + 16;

struct Entry {
    /// The file's length when it was indexed: a file rewritten since is indexed anew.
    file_len: usize,
    index: ScanIndex,
}

impl Entry {
    fn bytes(&self) -> usize {
        ENTRY_OVERHEAD + self.index.heap_bytes()
    }
}

/// The scan indexes of a dataset's files, by dataset index, within a memory budget: files
/// beyond it are decoded without marks.
pub struct ScanIndexCache {
    slots: Vec<Mutex<Option<Box<Entry>>>>,
    bytes: AtomicUsize,
    budget: usize,
}

impl std::fmt::Debug for ScanIndexCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScanIndexCache")
            .field("files", &self.slots.len())
            .field("bytes", &self.bytes())
            .field("budget", &self.budget)
            .finish()
    }
}

impl ScanIndexCache {
    /// An empty cache for `files` files holding at most `budget` bytes of marks (the slots
    /// themselves cost 16 bytes per file more).
    pub fn new(files: usize, budget: usize) -> Self {
        Self {
            slots: (0..files).map(|_| Mutex::new(None)).collect(),
            bytes: AtomicUsize::new(0),
            budget,
        }
    }

    /// Bytes of marks held.
    pub fn bytes(&self) -> usize {
        self.bytes.load(Ordering::Relaxed)
    }

    /// Takes file `file`'s index out for a decode of its `file_len` bytes; `None` for a file
    /// without one or rewritten since.
    pub(crate) fn take(&self, file: usize, file_len: usize) -> Option<ScanIndex> {
        let entry = self.lock(file)?.take()?;
        self.bytes.fetch_sub(entry.bytes(), Ordering::Relaxed);
        (entry.file_len == file_len).then_some(entry.index)
    }

    /// Whether file `file` holds an index made from `file_len` bytes: the file decoded
    /// cleanly at that length before.
    pub(crate) fn holds(&self, file: usize, file_len: usize) -> bool {
        self.lock(file)
            .is_some_and(|slot| slot.as_ref().is_some_and(|e| e.file_len == file_len))
    }

    /// Puts back the index a decode of file `file` returned, if the budget allows. Where a
    /// concurrent decode of the same file put one back first, the one with more marks stays.
    pub(crate) fn put(&self, file: usize, file_len: usize, index: ScanIndex) {
        let Some(mut slot) = self.lock(file) else {
            return;
        };
        let entry = Box::new(Entry { file_len, index });
        let freed = match slot.as_ref() {
            Some(old) if old.index.known_marks() >= entry.index.known_marks() => return,
            Some(old) => old.bytes(),
            None => 0,
        };
        let added = entry.bytes();
        if self.bytes().saturating_sub(freed) + added > self.budget {
            return;
        }
        self.bytes.fetch_add(added, Ordering::Relaxed);
        self.bytes.fetch_sub(freed, Ordering::Relaxed);
        *slot = Some(entry);
    }

    fn lock(&self, file: usize) -> Option<std::sync::MutexGuard<'_, Option<Box<Entry>>>> {
        Some(
            self.slots
                .get(file)?
                .lock()
                .unwrap_or_else(PoisonError::into_inner),
        )
    }
}
