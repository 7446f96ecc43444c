/*
 * Copyright (c) 2023.
 *
 * This software is free software;
 *
 * You can redistribute it or modify it under terms of the MIT, Apache License or Zlib license
 */

//! This file contains a single struct `HuffmanTable` that
//! stores Huffman tables needed during `BitStream` decoding.
#![allow(clippy::similar_names, clippy::module_name_repetitions)]

use alloc::string::ToString;

use crate::errors::DecodeErrors;

/// Determines how many bits of lookahead we have for our bitstream decoder.
///
/// Not upstream: 11 instead of zune-jpeg's 9. Photo AC tables put the common (run, size)
/// codes at 10 and 11 bits, and a code resolved by one lookup saves the slow per-length walk;
/// measured on 2,000 photos, 10 and 11 decode about 5% faster than 9, and 12 is slower again
/// (its tables, 16 KiB each, spill the L1 cache).
pub const HUFF_LOOKAHEAD: u8 = 11;

/// Whether an `ac_lookup` entry decodes a whole coefficient (its code, run and value). Such an
/// entry's value byte is never zero; an entry whose value byte is zero is either 0 (the code is
/// longer than the lookahead, or the coefficient's value does not fit) or, not in upstream
/// zune-jpeg, the end-of-block code's length.
#[inline(always)]
#[allow(clippy::cast_sign_loss)]
pub(crate) const fn is_coefficient(entry: i16) -> bool {
    entry as u16 >= 256
}

/// A struct which contains necessary tables for decoding a JPEG
/// huffman encoded bitstream
#[derive(Clone)]
pub struct HuffmanTable {
    // element `[0]` of each array is unused
    /// largest code of length k
    pub(crate) maxcode: [i32; 18],
    /// offset for codes of length k
    /// Answers the question, where do code-lengths of length k end
    /// Element 0 is unused
    pub(crate) offset:  [i32; 18],
    /// lookup table for fast decoding
    ///
    /// top  bits above HUFF_LOOKAHEAD contain the code length.
    ///
    /// Lower (8) bits contain the symbol in order of increasing code length.
    pub(crate) lookup:  [i32; 1 << HUFF_LOOKAHEAD],

    /// A table which can be used to decode small AC coefficients and
    /// do an equivalent of receive_extend
    pub(crate) ac_lookup: Option<[i16; 1 << HUFF_LOOKAHEAD]>,

    /// For skipping an AC coefficient without its value (region decoding, not in upstream
    /// zune-jpeg): `(positions advanced << 5) | bits consumed`, code and magnitude bits
    /// together, for every code of at most `HUFF_LOOKAHEAD` bits; 0 where the code is longer.
    /// An end-of-block advances 64 positions, a run of sixteen zeros 16.
    pub(crate) ac_skip: Option<[u16; 1 << HUFF_LOOKAHEAD]>,

    /// Directly represent contents of a JPEG DHT marker
    ///
    /// \# number of symbols with codes of length `k` bits
    // bits[0] is unused
    /// Symbols in order of increasing code length
    pub(crate) values: [u8; 256]
}

impl HuffmanTable {
    pub fn new(
        codes: &[u8; 17], values: [u8; 256], is_dc: bool, is_progressive: bool
    ) -> Result<HuffmanTable, DecodeErrors> {
        let too_long_code = (i32::from(HUFF_LOOKAHEAD) + 1) << HUFF_LOOKAHEAD;
        let mut p = HuffmanTable {
            maxcode: [0; 18],
            offset: [0; 18],
            lookup: [too_long_code; 1 << HUFF_LOOKAHEAD],
            values,
            ac_lookup: None,
            ac_skip: None
        };

        p.make_derived_table(is_dc, is_progressive, codes)?;

        Ok(p)
    }

    /// [`HuffmanTable::new`] through a small per-thread cache of the tables built last.
    ///
    /// Not upstream. Nearly every file of a dataset carries the same four tables (its encoder's
    /// standard ones), and at `HUFF_LOOKAHEAD` 11 building one fills three 2048-entry lookup
    /// tables: 1.5–2% of a decode of a 500×375 photo. A cached table is copied instead. The key
    /// is the whole DHT content, so a hit is the table `new` would build.
    pub fn new_cached(
        codes: &[u8; 17], values: [u8; 256], is_dc: bool, is_progressive: bool
    ) -> Result<HuffmanTable, DecodeErrors> {
        #[cfg(feature = "std")]
        {
            cache::get_or_build(codes, values, is_dc, is_progressive)
        }
        #[cfg(not(feature = "std"))]
        {
            HuffmanTable::new(codes, values, is_dc, is_progressive)
        }
    }

    /// Create a new huffman tables with values that aren't fixed
    /// used by fill_mjpeg_tables
    pub fn new_unfilled(
        codes: &[u8; 17], values: &[u8], is_dc: bool, is_progressive: bool
    ) -> Result<HuffmanTable, DecodeErrors> {
        let mut buf = [0; 256];
        buf[..values.len()].copy_from_slice(values);
        HuffmanTable::new(codes, buf, is_dc, is_progressive)
    }

    /// Compute derived values for a Huffman table
    ///
    /// This routine performs some validation checks on the table
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_possible_wrap,
        clippy::cast_sign_loss,
        clippy::too_many_lines,
        clippy::needless_range_loop
    )]
    fn make_derived_table(
        &mut self, is_dc: bool, _is_progressive: bool, bits: &[u8; 17]
    ) -> Result<(), DecodeErrors> {
        // build a list of code size
        let mut huff_size = [0; 257];
        // Huffman code lengths
        let mut huff_code: [u32; 257] = [0; 257];
        // figure C.1 make table of Huffman code length for each symbol
        let mut p = 0;

        for l in 1..=16 {
            let mut i = i32::from(bits[l]);
            // table overrun is checked before ,so we dont need to check
            while i != 0 {
                huff_size[p] = l as u8;
                p += 1;
                i -= 1;
            }
        }

        huff_size[p] = 0;

        let num_symbols = p;
        // Generate the codes themselves
        // We also validate that the counts represent a legal Huffman code tree
        let mut code = 0;
        let mut si = i32::from(huff_size[0]);

        p = 0;

        while huff_size[p] != 0 {
            while i32::from(huff_size[p]) == si {
                huff_code[p] = code;
                code += 1;
                p += 1;
            }
            // maximum code of length si, pre-shifted by 16-k bits
            self.maxcode[si as usize] = (code << (16 - si)) as i32;
            // code is now 1 more than the last code used for code-length si; but
            // it must still fit in si bits, since no code is allowed to be all ones.
            if (code as i32) >= (1 << si) {
                return Err(DecodeErrors::HuffmanDecode("Bad Huffman Table".to_string()));
            }

            code <<= 1;
            si += 1;
        }

        // Figure F.15 generate decoding tables for bit-sequential decoding
        p = 0;

        for l in 0..=16 {
            if bits[l] == 0 {
                // -1 if no codes of this length
                self.maxcode[l] = -1;
            } else {
                // offset[l]=codes[index of 1st symbol of code length l
                // minus minimum code of length l]
                self.offset[l] = (p as i32) - (huff_code[p]) as i32;
                p += usize::from(bits[l]);
            }
        }

        self.offset[17] = 0;
        // we ensure that decode terminates
        self.maxcode[17] = 0x000F_FFFF;

        /*
         * Compute lookahead tables to speed up decoding.
         * First we set all the table entries to 0(left justified), indicating "too long";
         * (Note too long was set during initialization)
         * then we iterate through the Huffman codes that are short enough and
         * fill in all the entries that correspond to bit sequences starting
         * with that code.
         */

        p = 0;

        for l in 1..=HUFF_LOOKAHEAD {
            for _ in 1..=i32::from(bits[usize::from(l)]) {
                // l -> Current code length,
                // p => Its index in self.code and self.values
                // Generate left justified code followed by all possible bit sequences
                let mut look_bits = (huff_code[p] as usize) << (HUFF_LOOKAHEAD - l);

                for _ in 0..1 << (HUFF_LOOKAHEAD - l) {
                    self.lookup[look_bits] =
                        (i32::from(l) << HUFF_LOOKAHEAD) | i32::from(self.values[p]);
                    look_bits += 1;
                }

                p += 1;
            }
        }
        // build an ac table that does an equivalent of decode and receive_extend
        if !is_dc {
            let mut fast = [255; 1 << HUFF_LOOKAHEAD];
            // Iterate over number of symbols
            for i in 0..num_symbols {
                // get code size for an item
                let s = huff_size[i];

                if s <= HUFF_LOOKAHEAD {
                    // if it's lower than what we need for our lookup table create the table
                    let c = (huff_code[i] << (HUFF_LOOKAHEAD - s)) as usize;
                    let m = (1 << (HUFF_LOOKAHEAD - s)) as usize;

                    for j in 0..m {
                        fast[c + j] = i as i16;
                    }
                }
            }

            // build a table that decodes both magnitude and value of small ACs in
            // one go.
            let mut fast_ac = [0; 1 << HUFF_LOOKAHEAD];

            for i in 0..(1 << HUFF_LOOKAHEAD) {
                let fast_v = fast[i];

                if fast_v < 255 {
                    // get symbol value from AC table
                    let rs = self.values[fast_v as usize];
                    // shift by 4 to get run length
                    let run = i16::from((rs >> 4) & 15);
                    // get magnitude bits stored at the lower 3 bits
                    let mag_bits = i16::from(rs & 15);
                    // length of the bit we've read
                    let len = i16::from(huff_size[fast_v as usize]);

                    if rs == 0 {
                        // Not in upstream zune-jpeg: end of block, its code length alone (see
                        // `is_coefficient`), so that `decode_mcu_block` ends a block without
                        // the slow path's second lookup.
                        fast_ac[i] = len;
                    } else if mag_bits != 0 && (len + mag_bits) <= i16::from(HUFF_LOOKAHEAD) {
                        // magnitude code followed by receive_extend code
                        let mut k = (((i as i16) << len) & ((1 << HUFF_LOOKAHEAD) - 1))
                            >> (i16::from(HUFF_LOOKAHEAD) - mag_bits);
                        let m = 1 << (mag_bits - 1);

                        if k < m {
                            k += (!0_i16 << mag_bits) + 1;
                        };

                        // if result is small enough fit into fast ac table
                        if (-128..=127).contains(&k) {
                            fast_ac[i] = (k << 8) + (run << 4) + (len + mag_bits);
                        }
                    }
                }
            }
            self.ac_lookup = Some(fast_ac);

            // Not in upstream zune-jpeg: the skip table (see `ac_skip`).
            let mut ac_skip = [0_u16; 1 << HUFF_LOOKAHEAD];
            for (entry, &fast_v) in ac_skip.iter_mut().zip(fast.iter()) {
                if fast_v < 255 {
                    let rs = self.values[fast_v as usize];
                    let run = u16::from(rs >> 4);
                    let mag_bits = u16::from(rs & 15);
                    let len = u16::from(huff_size[fast_v as usize]);
                    let advance = match (run, mag_bits) {
                        (0, 0) => 64,
                        (15, 0) => 16,
                        _ => run + 1
                    };
                    *entry = (advance << 5) | (len + mag_bits);
                }
            }
            self.ac_skip = Some(ac_skip);
        }

        // Validate symbols as being reasonable
        // For AC tables, we make no check, but accept all byte values 0..255
        // For DC tables, we require symbols to be in range 0..15
        if is_dc {
            for i in 0..num_symbols {
                let sym = self.values[i];

                if sym > 15 {
                    return Err(DecodeErrors::HuffmanDecode("Bad Huffman Table".to_string()));
                }
            }
        }

        Ok(())
    }
}

#[cfg(feature = "std")]
mod cache {
    //! Not upstream: the per-thread cache behind [`HuffmanTable::new_cached`].
    use std::boxed::Box;
    use std::cell::RefCell;
    use std::vec::Vec;

    use super::HuffmanTable;
    use crate::errors::DecodeErrors;

    /// Tables kept per thread: a file has at most four (two DC, two AC) and a dataset from one
    /// encoder repeats them; a few more cover a mix of encoders and qualities.
    const ENTRIES: usize = 8;

    struct Entry {
        codes:          [u8; 17],
        values:         [u8; 256],
        is_dc:          bool,
        is_progressive: bool,
        table:          HuffmanTable
    }

    std::thread_local! {
        // Boxed: an entry holds a 16 KiB table, and keeping the most recent first moves
        // entries on every hit; a box moves as a pointer.
        static TABLES: RefCell<Vec<Box<Entry>>> = const { RefCell::new(Vec::new()) };
    }

    pub(super) fn get_or_build(
        codes: &[u8; 17], values: [u8; 256], is_dc: bool, is_progressive: bool
    ) -> Result<HuffmanTable, DecodeErrors> {
        let hit = TABLES.with(|tables| {
            let mut tables = tables.borrow_mut();
            let found = tables.iter().position(|e| {
                e.is_dc == is_dc
                    && e.is_progressive == is_progressive
                    && e.codes == *codes
                    && e.values == values
            })?;
            // Most recently used first, so the oldest falls off the end.
            let entry = tables.remove(found);
            let table = entry.table.clone();
            tables.insert(0, entry);
            Some(table)
        });
        if let Some(table) = hit {
            return Ok(table);
        }
        let table = HuffmanTable::new(codes, values, is_dc, is_progressive)?;
        TABLES.with(|tables| {
            let mut tables = tables.borrow_mut();
            tables.truncate(ENTRIES - 1);
            tables.insert(
                0,
                Box::new(Entry {
                    codes: *codes,
                    values,
                    is_dc,
                    is_progressive,
                    table: table.clone()
                })
            );
        });
        Ok(table)
    }
}
