//! im2col and col2im for output rows narrower than [`NARROW`] pixels.
//!
//! With AVX-512, a unit stride along x and rows of at most 16 values, a row is one register:
//! im2col is a masked load per output row (the mask zeroes the padding), col2im sums each input
//! row's taps in a register and stores it once. Otherwise one gather per output pixel through a
//! table of input offsets ([`tap_offsets`]). Both give the same values, to the bit.

use super::cpu::{Geometry, valid_range};

/// Below this output width, im2col and col2im go through this module: a row of a few floats
/// costs more in bounds arithmetic than in copying (ResNet at 32 px has rows of 8, 4, 2 and 1
/// pixels).
pub(super) const NARROW: usize = 16;

/// Marks an output pixel whose input falls in the padding.
const PADDED: u32 = u32::MAX;

/// For each kernel tap `(ki, kj)` (row-major) and output pixel: the offset of its input pixel
/// within an `H×W` plane, or [`PADDED`].
fn tap_offsets(g: &Geometry) -> Vec<u32> {
    let [kh, kw] = g.kernel;
    let [ho, wo] = g.out;
    let mut taps = Vec::with_capacity(kh * kw * ho * wo);
    for ki in 0..kh {
        for kj in 0..kw {
            for oy in 0..ho {
                for ox in 0..wo {
                    let iy =
                        (oy * g.stride[0] + ki * g.dilation[0]) as isize - g.padding[0] as isize;
                    let ix =
                        (ox * g.stride[1] + kj * g.dilation[1]) as isize - g.padding[1] as isize;
                    let inside =
                        (0..g.height as isize).contains(&iy) && (0..g.width as isize).contains(&ix);
                    taps.push(if inside {
                        (iy as usize * g.width + ix as usize) as u32
                    } else {
                        PADDED
                    });
                }
            }
        }
    }
    taps
}

/// Writes the column matrix of images `x` (`nb` images) into `col` laid out `[K, nb·P]`.
pub(super) fn im2col(g: &Geometry, x: &[f32], nb: usize, col: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512::applies(g) {
        // SAFETY: `applies` checked AVX-512F, the row widths and the unit x stride.
        return unsafe { avx512::im2col(g, x, nb, col) };
    }
    im2col_table(g, x, nb, col)
}

/// Adds the column matrix `col` (`[K, nb·P]`) back into the images `dx` (`nb` images, zeroed
/// by the caller): the adjoint of [`im2col`].
pub(super) fn col2im(g: &Geometry, col: &[f32], nb: usize, dx: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if avx512::applies(g) {
        // SAFETY: as in `im2col`; the caller zeroed `dx`.
        return unsafe { avx512::col2im(g, col, nb, dx) };
    }
    col2im_table(g, col, nb, dx)
}

/// im2col through the offset table: one gather per output pixel.
fn im2col_table(g: &Geometry, x: &[f32], nb: usize, col: &mut [f32]) {
    let taps = tap_offsets(g);
    let (p, plane_len) = (g.pixels(), g.height * g.width);
    let cols = nb * p;
    let per_channel = g.kernel[0] * g.kernel[1];
    for (row, dst_row) in col[..g.k() * cols].chunks_exact_mut(cols).enumerate() {
        let (c, tap) = (row / per_channel, row % per_channel);
        let offsets = &taps[tap * p..(tap + 1) * p];
        for (b, dst) in dst_row.chunks_exact_mut(p).enumerate() {
            let plane = &x[b * g.image_len() + c * plane_len..][..plane_len];
            for (d, &o) in dst.iter_mut().zip(offsets) {
                // PADDED is past any plane, so `get` gives the zero padding.
                *d = plane.get(o as usize).copied().unwrap_or(0.0);
            }
        }
    }
}

/// col2im through the offset table.
fn col2im_table(g: &Geometry, col: &[f32], nb: usize, dx: &mut [f32]) {
    let taps = tap_offsets(g);
    let (p, plane_len) = (g.pixels(), g.height * g.width);
    let cols = nb * p;
    let per_channel = g.kernel[0] * g.kernel[1];
    for (row, src_row) in col[..g.k() * cols].chunks_exact(cols).enumerate() {
        let (c, tap) = (row / per_channel, row % per_channel);
        let offsets = &taps[tap * p..(tap + 1) * p];
        for (b, src) in src_row.chunks_exact(p).enumerate() {
            let plane = &mut dx[b * g.image_len() + c * plane_len..][..plane_len];
            for (&v, &o) in src.iter().zip(offsets) {
                if let Some(d) = plane.get_mut(o as usize) {
                    *d += v;
                }
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use std::arch::x86_64::{
        __m512, __mmask16, _mm512_add_ps, _mm512_mask_storeu_ps, _mm512_maskz_loadu_ps,
        _mm512_setzero_ps, _mm512_storeu_ps,
    };

    use super::{Geometry, NARROW, valid_range};

    /// Lanes per register.
    const LANES: usize = 16;

    /// AVX-512F is there, an output row and an input row each fit one register, and input x
    /// advances with output x.
    pub(super) fn applies(g: &Geometry) -> bool {
        g.out[1] < NARROW
            && g.width <= LANES
            && g.stride[1] == 1
            && std::arch::is_x86_feature_detected!("avx512f")
    }

    /// Lanes `lo..hi` set (`lo <= hi <= 16`).
    fn lanes(lo: usize, hi: usize) -> __mmask16 {
        let upto = |n: usize| ((1u32 << n) - 1) as __mmask16;
        upto(hi) & !upto(lo)
    }

    /// Stores lanes `0..width` of `v` at `buf[at..]`. The whole register when it fits in `buf`:
    /// the callers write `buf` in increasing order, so the extra lanes land where a later store
    /// writes, and a masked store is slower on some CPUs (AMD Zen 4) than a plain one.
    ///
    /// # Safety
    /// AVX-512F; `at + width <= buf.len()`.
    #[target_feature(enable = "avx512f")]
    unsafe fn store_row(buf: &mut [f32], at: usize, width: usize, v: __m512) {
        debug_assert!(at + width <= buf.len());
        // SAFETY: the full store stays inside `buf`; the masked one writes lanes 0..width only.
        unsafe {
            let dst = buf.as_mut_ptr().add(at);
            if at + LANES <= buf.len() {
                _mm512_storeu_ps(dst, v);
            } else {
                _mm512_mask_storeu_ps(dst, lanes(0, width), v);
            }
        }
    }

    /// The input row `iy` that output row `oy` reads at kernel row `ki`; `None` in the padding.
    fn input_row(g: &Geometry, oy: usize, ki: usize) -> Option<usize> {
        let iy = (oy * g.stride[0] + ki * g.dilation[0]) as isize - g.padding[0] as isize;
        (0..g.height as isize).contains(&iy).then_some(iy as usize)
    }

    /// The output row that reads input row `iy` at kernel row `ki`, if any.
    fn output_row(g: &Geometry, iy: usize, ki: usize) -> Option<usize> {
        let t = iy as isize + g.padding[0] as isize - (ki * g.dilation[0]) as isize;
        let s = g.stride[0] as isize;
        (t >= 0 && t % s == 0 && ((t / s) as usize) < g.out[0]).then(|| (t / s) as usize)
    }

    /// Output column 0's input column at kernel column `kj` (input x = output x + this).
    fn x_offset(g: &Geometry, kj: usize) -> isize {
        (kj * g.dilation[1]) as isize - g.padding[1] as isize
    }

    /// One masked load per output row: lane `i` of row `oy` reads input column `x0 + i` of its
    /// input row, the lanes outside the input read nothing and give the padding's zero.
    ///
    /// # Safety
    /// AVX-512F, and [`applies`].
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn im2col(g: &Geometry, x: &[f32], nb: usize, col: &mut [f32]) {
        let [kh, kw] = g.kernel;
        let [ho, wo] = g.out;
        let (p, plane_len) = (g.pixels(), g.height * g.width);
        let cols = nb * p;
        let col = &mut col[..g.k() * cols];
        for c in 0..g.c_in {
            for ki in 0..kh {
                for kj in 0..kw {
                    let row = (c * kh + ki) * kw + kj;
                    let x0 = x_offset(g, kj);
                    let (lo, hi) = valid_range(x0, 1, g.width, wo);
                    let in_mask = lanes(lo, hi);
                    for b in 0..nb {
                        let plane = &x[b * g.image_len() + c * plane_len..][..plane_len];
                        for oy in 0..ho {
                            let v = match input_row(g, oy, ki) {
                                Some(iy) if lo < hi => {
                                    let src = plane[iy * g.width..].as_ptr().wrapping_offset(x0);
                                    // SAFETY: the lanes in `in_mask` read input columns
                                    // x0 + lo .. x0 + hi, inside row iy; the others read nothing.
                                    unsafe { _mm512_maskz_loadu_ps(in_mask, src) }
                                }
                                _ => _mm512_setzero_ps(),
                            };
                            // SAFETY: row oy's Wo values lie inside `col`.
                            unsafe { store_row(col, row * cols + b * p + oy * wo, wo, v) };
                        }
                    }
                }
            }
        }
    }

    /// Each input row in one register, summed over the taps that reach it in the order the
    /// offset table adds them (so the results are the same to the bit) and stored once: adding
    /// tap by tap into memory reloaded each row right after a masked store to it, and AMD Zen 4
    /// cannot forward a masked store to a load (a stall per row, slower than the table).
    ///
    /// # Safety
    /// AVX-512F, [`applies`], and `dx` zeroed (as the caller's is): rows no tap reaches are
    /// stored as zeros, the others overwritten.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn col2im(g: &Geometry, col: &[f32], nb: usize, dx: &mut [f32]) {
        let [kh, kw] = g.kernel;
        let wo = g.out[1];
        let (p, plane_len) = (g.pixels(), g.height * g.width);
        let cols = nb * p;
        let col = &col[..g.k() * cols];
        let dx = &mut dx[..nb * g.image_len()];
        // For each kernel column: the offset x0 (input x = output x + x0) and the lanes of the
        // input columns x0 + lo .. x0 + hi that output columns lo..hi reach (none: no lanes).
        let taps_x = (0..kw)
            .map(|kj| {
                let x0 = x_offset(g, kj);
                let (lo, hi) = valid_range(x0, 1, g.width, wo);
                let input_x = |ox: usize| (x0 + ox as isize) as usize;
                (
                    x0,
                    if lo < hi {
                        lanes(input_x(lo), input_x(hi))
                    } else {
                        0
                    },
                )
            })
            .collect::<Vec<_>>();
        for b in 0..nb {
            for c in 0..g.c_in {
                let plane = b * g.image_len() + c * plane_len;
                for iy in 0..g.height {
                    let mut acc = _mm512_setzero_ps();
                    for ki in 0..kh {
                        let Some(oy) = output_row(g, iy, ki) else {
                            continue;
                        };
                        for (kj, &(x0, in_mask)) in taps_x.iter().enumerate() {
                            if in_mask == 0 {
                                continue;
                            }
                            let row = (c * kh + ki) * kw + kj;
                            let out_row = &col[row * cols + b * p + oy * wo..][..wo];
                            let src = out_row.as_ptr().wrapping_offset(-x0);
                            // SAFETY: lane ix in `in_mask` reads out_row[ix − x0], with
                            // 0 <= ix − x0 < Wo; the other lanes read nothing.
                            let v = unsafe { _mm512_maskz_loadu_ps(in_mask, src) };
                            acc = _mm512_add_ps(acc, v);
                        }
                    }
                    // SAFETY: row iy's W values lie inside `dx`.
                    unsafe { store_row(dx, plane + iy * g.width, g.width, acc) };
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The vector path against the offset table, bit for bit, on every narrow shape ResNet at
    /// 32 px has and on odd ones (padding wider than the kernel's reach, dilation, tall strides).
    #[test]
    fn the_vector_path_matches_the_offset_table() {
        #[cfg(target_arch = "x86_64")]
        let vector = |g: &Geometry| avx512::applies(g);
        #[cfg(not(target_arch = "x86_64"))]
        let vector = |_: &Geometry| false;
        let shapes = [
            ([8, 8], 3, [1, 1], [1, 1], [1, 1]),
            ([4, 4], 3, [1, 1], [1, 1], [1, 1]),
            ([2, 2], 3, [1, 1], [1, 1], [1, 1]),
            ([9, 7], 3, [2, 1], [1, 1], [1, 1]),
            ([6, 5], 5, [1, 1], [2, 3], [1, 1]),
            ([7, 9], 3, [1, 1], [2, 2], [2, 2]),
            ([1, 15], 1, [1, 1], [0, 0], [1, 1]),
            ([3, 3], 3, [1, 1], [4, 4], [1, 1]),
            // Input rows wider than a register: the table only.
            ([9, 20], 7, [1, 1], [0, 0], [1, 1]),
        ];
        for (size, kernel, stride, padding, dilation) in shapes {
            let g = Geometry::new(
                [2, 3, size[0], size[1]],
                [4, 3, kernel, kernel],
                stride,
                padding,
                dilation,
            )
            .expect("a non-empty output");
            if !vector(&g) {
                eprintln!("the vector path does not apply here to {g:?}");
                continue;
            }
            let x: Vec<f32> = (0..2 * g.image_len())
                .map(|i| (i as f32 * 0.37).sin())
                .collect();
            let len = g.k() * 2 * g.pixels();
            let (mut table, mut vector_col) = (vec![f32::NAN; len], vec![f32::NAN; len]);
            im2col_table(&g, &x, 2, &mut table);
            im2col(&g, &x, 2, &mut vector_col);
            assert_eq!(table, vector_col, "im2col {g:?}");

            let col: Vec<f32> = (0..len).map(|i| (i as f32 * 0.11).cos()).collect();
            let (mut table, mut vector_dx) = (vec![0.0; x.len()], vec![0.0; x.len()]);
            col2im_table(&g, &col, 2, &mut table);
            col2im(&g, &col, 2, &mut vector_dx);
            assert_eq!(table, vector_dx, "col2im {g:?}");
        }
    }
}
