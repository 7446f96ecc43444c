//! Entry points into a baseline scan (not in upstream zune-jpeg).
//!
//! A JPEG without restart markers must be entropy-decoded from the scan's first bit up to any
//! pixel it wants: DC coefficients are coded as differences, and Huffman codes have no byte
//! boundaries. A [`ScanIndex`] remembers, for a few MCUs of every MCU row, where that MCU's first
//! bit is and the DC predictions before it, as a decode passes them: evenly spaced ones, and
//! the first column of the last region decoded in that row (a validation crop's columns are
//! the same every epoch). A later region decode of
//! the same file (the next epoch's random crop) then starts each row at the mark left of its
//! region and jumps to the next row's mark after the region's last column, instead of
//! entropy-decoding every block above and beside the region.

use alloc::vec;
use alloc::vec::Vec;

/// Marks per MCU row, at evenly spaced MCU columns starting at 0.
const MARKS_PER_ROW: usize = 4;

/// Where an MCU's first bit is and the DC predictions (scan order) before it, in 8 bytes: the
/// position `byte << 3 | bit` (the byte of the file holding the MCU's first bit and how many of
/// its high bits precede it) in bits 0..27, then three 12-bit signed predictions (an 8-bit
/// JPEG's quantised DC coefficients fit in 12 bits). All ones for a mark not seen yet.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Mark(u64);

const UNKNOWN: Mark = Mark(u64::MAX);
const POSITION_BITS: u32 = 27;

impl Mark {
    /// `None` past the first 16 MiB of a file or for a prediction outside 12 bits.
    pub(crate) fn new(bit: u32, dc: &[i32]) -> Option<Mark> {
        let mut packed = u64::from(bit);
        if packed >> POSITION_BITS != 0 || dc.len() > 3 {
            return None;
        }
        for (i, &d) in dc.iter().enumerate() {
            if !(-2048..2048).contains(&d) {
                return None;
            }
            packed |= (d as u64 & 0xFFF) << (POSITION_BITS + 12 * i as u32);
        }
        (packed != u64::MAX).then_some(Mark(packed))
    }

    const fn known(self) -> bool {
        self.0 != u64::MAX
    }

    /// The position `byte << 3 | bit`.
    pub(crate) const fn bit(self) -> u32 {
        (self.0 & ((1 << POSITION_BITS) - 1)) as u32
    }

    /// The DC predictions, in scan order.
    pub(crate) fn dc(self) -> [i32; 3] {
        core::array::from_fn(|i| {
            let field = (self.0 >> (POSITION_BITS + 12 * i as u32)) & 0xFFF;
            // Sign-extend 12 bits.
            ((field << 52) as i64 >> 52) as i32
        })
    }
}

/// Entry points into one file's baseline scan, filled in by every decode that uses it (see
/// [`crate::JpegDecoder::use_scan_index`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ScanIndex {
    /// The scan it belongs to: where its data starts, the image's width and height, and the
    /// MCU grid. A decode of anything else ignores the index and starts a new one.
    pub(crate) key:           [usize; 5],
    pub(crate) cols_per_mark: usize,
    pub(crate) marks_per_row: usize,
    pub(crate) marks:         Vec<Mark>,
    /// Per row: the column of the last region's first MCU and its mark (`u16::MAX`: none).
    region_cols:              Vec<u16>,
    region_marks:             Vec<Mark>,
    known:                    usize
}

impl ScanIndex {
    pub(crate) fn new(key: [usize; 5], mcu_cols: usize, mcu_rows: usize) -> ScanIndex {
        let cols_per_mark = mcu_cols.div_ceil(MARKS_PER_ROW).max(1);
        let marks_per_row = mcu_cols.div_ceil(cols_per_mark).max(1);
        ScanIndex {
            key,
            cols_per_mark,
            marks_per_row,
            marks: vec![UNKNOWN; marks_per_row * mcu_rows],
            region_cols: vec![u16::MAX; mcu_rows],
            region_marks: vec![UNKNOWN; mcu_rows],
            known: 0
        }
    }

    /// Bytes this index holds on the heap.
    #[must_use]
    pub fn heap_bytes(&self) -> usize {
        (self.marks.capacity() + self.region_marks.capacity()) * core::mem::size_of::<Mark>()
            + self.region_cols.capacity() * 2
    }

    /// How many marks are known (a decode that stops at its region's last row leaves the rows
    /// below unknown until a later decode passes them).
    #[must_use]
    pub fn known_marks(&self) -> usize {
        self.known
    }

    /// Whether to mark `col` of `row`: an evenly spaced column not marked yet, or `region_col`
    /// (the first column of the region this decode is for) where the row has another.
    pub(crate) fn wants(&self, row: usize, col: usize, region_col: Option<usize>) -> bool {
        if col % self.cols_per_mark == 0 {
            self.slot(row, col).is_some_and(|s| !self.marks[s].known())
        } else {
            region_col == Some(col)
                && self.region_cols.get(row).is_some_and(|&c| usize::from(c) != col)
        }
    }

    pub(crate) fn set(&mut self, row: usize, col: usize, mark: Mark) {
        if !mark.known() {
            return;
        }
        if col % self.cols_per_mark == 0 {
            if let Some(s) = self.slot(row, col) {
                if !self.marks[s].known() {
                    self.known += 1;
                }
                self.marks[s] = mark;
            }
        } else if let (Some(c), Ok(col)) = (self.region_cols.get_mut(row), u16::try_from(col)) {
            *c = col;
            self.region_marks[row] = mark;
        }
    }

    /// The known mark of `row` at the greatest marked column at or left of `col`, with its
    /// column.
    pub(crate) fn at_or_before(&self, row: usize, col: usize) -> Option<(usize, Mark)> {
        let last = (col / self.cols_per_mark).min(self.marks_per_row - 1);
        let even = (0..=last).rev().find_map(|m| {
            let mark = *self.marks.get(row * self.marks_per_row + m)?;
            mark.known().then_some((m * self.cols_per_mark, mark))
        });
        let region = self
            .region_cols
            .get(row)
            .map(|&c| usize::from(c))
            .filter(|&c| c <= col && even.is_none_or(|(e, _)| e < c))
            .map(|c| (c, self.region_marks[row]));
        region.or(even)
    }

    /// Whether the mark at the start of `row` is known.
    pub(crate) fn row_start_known(&self, row: usize) -> bool {
        self.marks.get(row * self.marks_per_row).is_some_and(|m| m.known())
    }

    fn slot(&self, row: usize, col: usize) -> Option<usize> {
        let m = col / self.cols_per_mark;
        let s = row * self.marks_per_row + m;
        (m < self.marks_per_row && s < self.marks.len()).then_some(s)
    }
}
