//! The transforms 16 tiles at a time: masked gathers read the patches (masked-off lanes
//! read as zero: the padding), masked stores and scatters write the last group's tiles.

use std::arch::x86_64::*;

use super::POINTS;
use super::tiles::{
    LANES, Lane, Taps, WINDOW, Window, first_lanes, input_points, output_grad_points, output_values,
};

impl Lane for __m512 {
    #[inline(always)]
    fn add(self, other: Self) -> Self {
        // SAFETY: only reached from functions compiled with AVX-512F.
        unsafe { _mm512_add_ps(self, other) }
    }
    #[inline(always)]
    fn sub(self, other: Self) -> Self {
        // SAFETY: as above.
        unsafe { _mm512_sub_ps(self, other) }
    }
    #[inline(always)]
    fn neg(self) -> Self {
        // SAFETY: as above. Flipping the sign bit is what `-x` does to an f32.
        unsafe {
            _mm512_castsi512_ps(_mm512_xor_si512(
                _mm512_castps_si512(self),
                _mm512_set1_epi32(i32::MIN),
            ))
        }
    }
}

#[inline(always)]
unsafe fn gather(taps: &Taps, plane: &[f32], group: usize, pos: usize) -> __m512 {
    let at = group * taps.positions + pos;
    // SAFETY: every unmasked offset lies inside `plane` (Taps::new built them for a plane
    // of this size; the callers check the length).
    unsafe {
        let offsets = _mm512_loadu_si512(taps.offsets[at].as_ptr().cast());
        _mm512_mask_i32gather_ps::<4>(_mm512_setzero_ps(), taps.masks[at], offsets, plane.as_ptr())
    }
}

/// The planes of `group` side by side in four registers, zero past the last plane.
///
/// # Safety
/// The CPU must have AVX-512F; `plane` must hold `window.extent()` values (checked by the
/// callers).
#[inline(always)]
unsafe fn load_window(window: &Window, plane: &[f32], group: usize) -> [__m512; 4] {
    let start = |local: usize| window.start(group, local);
    // Plain loops, not closures: a closure is compiled without AVX-512, and the intrinsics in
    // it become calls.
    // SAFETY (every arm): each read lies inside one of the group's planes, inside `plane` by
    // the callers' check; the CPU has AVX-512F (the caller's contract).
    unsafe {
        let mut z = [_mm512_setzero_ps(); 4];
        match (window.planes, window.plane_len) {
            (1, len) => {
                if let Some(at) = start(0) {
                    for (q, z) in z.iter_mut().enumerate() {
                        let n = len.saturating_sub(q * LANES);
                        if n > 0 {
                            let from = plane.as_ptr().add(at + q * LANES);
                            *z = _mm512_maskz_loadu_ps(first_lanes(n), from);
                        }
                    }
                }
            }
            (_, LANES) => {
                for (q, z) in z.iter_mut().enumerate() {
                    let Some(at) = start(q) else { break };
                    *z = _mm512_loadu_ps(plane.as_ptr().add(at));
                }
            }
            (planes, 4) => {
                for local in 0..planes {
                    let Some(at) = start(local) else { break };
                    let four = _mm_loadu_ps(plane.as_ptr().add(at));
                    let q = local / 4;
                    z[q] = match local % 4 {
                        0 => _mm512_insertf32x4::<0>(z[q], four),
                        1 => _mm512_insertf32x4::<1>(z[q], four),
                        2 => _mm512_insertf32x4::<2>(z[q], four),
                        _ => _mm512_insertf32x4::<3>(z[q], four),
                    };
                }
            }
            (planes, len) => {
                let mut values = [0.0f32; WINDOW];
                for local in 0..planes {
                    let Some(at) = start(local) else { break };
                    values[local * len..][..len].copy_from_slice(&plane[at..][..len]);
                }
                for (q, z) in z.iter_mut().enumerate() {
                    *z = _mm512_loadu_ps(values.as_ptr().add(q * LANES));
                }
            }
        }
        z
    }
}

/// `values` back into the planes of `group`: the inverse of [`load_window`].
///
/// # Safety
/// As [`load_window`].
#[inline(always)]
unsafe fn store_window(window: &Window, plane: &mut [f32], group: usize, values: [__m512; 4]) {
    let start = |local: usize| window.start(group, local);
    // SAFETY (every arm): each write lies inside one of the group's planes, inside `plane` by
    // the callers' check.
    unsafe {
        match (window.planes, window.plane_len) {
            (1, len) => {
                let Some(at) = start(0) else { return };
                for (q, value) in values.into_iter().enumerate() {
                    let n = len.saturating_sub(q * LANES);
                    if n > 0 {
                        let to = plane.as_mut_ptr().add(at + q * LANES);
                        _mm512_mask_storeu_ps(to, first_lanes(n), value);
                    }
                }
            }
            (planes, LANES) => {
                for (local, value) in values.into_iter().enumerate().take(planes) {
                    let Some(at) = start(local) else { break };
                    _mm512_storeu_ps(plane.as_mut_ptr().add(at), value);
                }
            }
            (planes, 4) => {
                for local in 0..planes {
                    let Some(at) = start(local) else { break };
                    let value = values[local / 4];
                    let four = match local % 4 {
                        0 => _mm512_extractf32x4_ps::<0>(value),
                        1 => _mm512_extractf32x4_ps::<1>(value),
                        2 => _mm512_extractf32x4_ps::<2>(value),
                        _ => _mm512_extractf32x4_ps::<3>(value),
                    };
                    _mm_storeu_ps(plane.as_mut_ptr().add(at), four);
                }
            }
            (planes, len) => {
                let mut all = [0.0f32; WINDOW];
                for (q, value) in values.into_iter().enumerate() {
                    _mm512_storeu_ps(all.as_mut_ptr().add(q * LANES), value);
                }
                for local in 0..planes {
                    let Some(at) = start(local) else { break };
                    plane[at..][..len].copy_from_slice(&all[local * len..][..len]);
                }
            }
        }
    }
}

/// Each lane's value at its place in `window` (`places`), zero off `lanes`: a permute from
/// each half of the window and a blend.
#[inline(always)]
unsafe fn pick(window: &[__m512; 4], places: &[i32; LANES], lanes: __mmask16) -> __m512 {
    // SAFETY: only reached from functions compiled with AVX-512F; `places` is 16 i32s.
    unsafe {
        let places = _mm512_loadu_si512(places.as_ptr().cast());
        let low = _mm512_permutex2var_ps(window[0], places, window[1]);
        let high = _mm512_permutex2var_ps(window[2], places, window[3]);
        let in_high = _mm512_test_epi32_mask(places, _mm512_set1_epi32(2 * LANES as i32));
        _mm512_maskz_mov_ps(lanes, _mm512_mask_blend_ps(in_high, low, high))
    }
}

/// The 2×2 outputs of `group`'s tiles (16 per vector, zero off `lanes`) from their 16 points
/// in `m` (point ξ of tile `t` at `m[ξ·stride + t]`), plus `bias`.
#[inline(always)]
unsafe fn group_outputs(
    m: &[f32],
    stride: usize,
    group: usize,
    lanes: __mmask16,
    bias: __m512,
) -> [__m512; 4] {
    // SAFETY: only reached from functions compiled with AVX-512F; the loads are checked by
    // `load`.
    let points = std::array::from_fn(|xi| unsafe { load(m, xi * stride + group * LANES, lanes) });
    output_values(points, bias)
}

/// `len` values from `at` in `v`: a 16-lane store, masked to `lanes`.
#[inline(always)]
unsafe fn store(v: &mut [f32], at: usize, lanes: __mmask16, value: __m512) {
    let len = 16 - lanes.leading_zeros() as usize;
    assert!(at + len <= v.len(), "winograd: a store past its matrix");
    // SAFETY: lanes `len..` are masked off; the others lie inside `v` (asserted).
    unsafe { _mm512_mask_storeu_ps(v.as_mut_ptr().add(at), lanes, value) }
}

/// `len` values from `at` in `m`, zero in lanes off `lanes`.
#[inline(always)]
unsafe fn load(m: &[f32], at: usize, lanes: __mmask16) -> __m512 {
    let len = 16 - lanes.leading_zeros() as usize;
    assert!(at + len <= m.len(), "winograd: a load past its matrix");
    // SAFETY: as in `store`.
    unsafe { _mm512_maskz_loadu_ps(lanes, m.as_ptr().add(at)) }
}

/// Position `pos` of `group`'s tiles' patches, 16 tiles per vector, zero off the plane: picked
/// from the group's [`Window`] where the taps have one, gathered otherwise.
///
/// # Safety
/// As [`transform_input`].
#[inline(always)]
unsafe fn patches<const N: usize>(taps: &Taps, plane: &[f32], group: usize) -> [__m512; N] {
    // SAFETY: only reached from functions compiled with AVX-512F; the caller vouches for the
    // plane (its windows' extent where the taps have them).
    unsafe {
        match &taps.window {
            Some(window) => {
                // A loop, not `from_fn`'s closure (see `load_window`).
                let values = load_window(window, plane, group);
                let mut d = [_mm512_setzero_ps(); N];
                for (pos, d) in d.iter_mut().enumerate() {
                    let at = group * taps.positions + pos;
                    *d = pick(&values, &window.places[at], taps.masks[at]);
                }
                d
            }
            None => std::array::from_fn(|pos| gather(taps, plane, group, pos)),
        }
    }
}

/// See [`super::tiles::transform_input`].
///
/// # Safety
/// The CPU must have AVX-512F; `plane` must be the plane (or stack) `taps` was built for,
/// `window.extent()` long where the taps have a [`Window`].
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transform_input(taps: &Taps, plane: &[f32], v: &mut [f32], stride: usize) {
    for group in 0..taps.groups() {
        let lanes = taps.lanes(group);
        // SAFETY: the caller vouches for the CPU and the plane; `store` checks its bounds.
        unsafe {
            let d = patches::<POINTS>(taps, plane, group);
            for (xi, value) in input_points(d).into_iter().enumerate() {
                store(v, xi * stride + group * LANES, lanes, value);
            }
        }
    }
}

/// See [`super::tiles::transform_output_grad`].
///
/// # Safety
/// As [`transform_input`].
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transform_output_grad(
    taps: &Taps,
    plane: &[f32],
    e: &mut [f32],
    stride: usize,
) {
    for group in 0..taps.groups() {
        let lanes = taps.lanes(group);
        // SAFETY: as in transform_input.
        unsafe {
            let d = patches::<4>(taps, plane, group);
            for (xi, value) in output_grad_points(d).into_iter().enumerate() {
                store(e, xi * stride + group * LANES, lanes, value);
            }
        }
    }
}

/// See [`super::tiles::transform_output`]. Where the taps have a [`Window`], each group's
/// 2×2 outputs are placed into it by permutes (the inverse picks, `sources`) and stored plane
/// by plane; otherwise scattered.
///
/// # Safety
/// As [`transform_input`], `plane` the output plane (or stack) `taps` was built for.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transform_output(
    taps: &Taps,
    m: &[f32],
    stride: usize,
    plane: &mut [f32],
    bias: f32,
) {
    let bias = _mm512_set1_ps(bias);
    for group in 0..taps.groups() {
        let lanes = taps.lanes(group);
        // SAFETY: as in transform_input; every unmasked offset lies inside `plane`.
        unsafe {
            let values = group_outputs(m, stride, group, lanes, bias);
            if let Some(window) = &taps.window {
                let mut placed = [_mm512_setzero_ps(); 4];
                for (placed, sources) in placed.iter_mut().zip(&window.sources[group]) {
                    *placed = pick(&values, sources, !0);
                }
                store_window(window, plane, group, placed);
                continue;
            }
            for (pos, value) in values.into_iter().enumerate() {
                let at = group * taps.positions + pos;
                let offsets = _mm512_loadu_si512(taps.offsets[at].as_ptr().cast());
                _mm512_mask_i32scatter_ps::<4>(plane.as_mut_ptr(), taps.masks[at], offsets, value);
            }
        }
    }
}

/// Lane `l` takes element `2l + first` of the 32 in `(lo, hi)`.
#[inline(always)]
unsafe fn every_other(lo: __m512, hi: __m512, first: i32) -> __m512 {
    // SAFETY: only reached from functions compiled with AVX-512F.
    unsafe {
        let idx = _mm512_add_epi32(
            _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30),
            _mm512_set1_epi32(first),
        );
        _mm512_permutex2var_ps(lo, idx, hi)
    }
}

/// See [`super::tiles::transform_input`], for planes of at least [`super::tiles::ROW_TILES`] tiles per
/// row: the plane is copied into `padded` (`[rows, width]`, its padding zero), and each
/// group of 16 tiles of a row reads its 4×4 patches as 4 × 4 loads of 16 even or odd
/// columns.
///
/// # Safety
/// The CPU must have AVX-512F; `padded` must hold `[rows, width]` from
/// [`super::tiles::Planes::padded_shape`], zero outside the plane's place.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transform_input_rows(
    grid: &super::Grid,
    [n_rows, width]: [usize; 2],
    padded: &mut [f32],
    plane: &[f32],
    v: &mut [f32],
    stride: usize,
) {
    let [th, tw] = grid.tiles;
    let (h, w) = (grid.height, grid.width);
    assert!(
        padded.len() >= n_rows * width && h + grid.pad[0] <= n_rows && w + grid.pad[1] <= width
    );
    for r in 0..h {
        padded[(r + grid.pad[0]) * width + grid.pad[1]..][..w]
            .copy_from_slice(&plane[r * w..][..w]);
    }
    for i in 0..th {
        for j0 in (0..tw).step_by(LANES) {
            let lanes = first_lanes(tw - j0);
            let mut d = [_mm512_setzero_ps(); POINTS];
            for r in 0..4 {
                let at = (2 * i + r) * width + 2 * j0;
                // Columns 2j0 .. 2j0 + 34 of the row: inside it by padded_shape.
                let row = &padded[at..at + 2 * LANES + 2];
                // SAFETY: each load reads 16 floats inside `row` (34 long).
                unsafe {
                    let lo = _mm512_loadu_ps(row.as_ptr());
                    let hi = _mm512_loadu_ps(row.as_ptr().add(LANES));
                    let lo2 = _mm512_loadu_ps(row.as_ptr().add(2));
                    let hi2 = _mm512_loadu_ps(row.as_ptr().add(LANES + 2));
                    d[r * 4] = every_other(lo, hi, 0);
                    d[r * 4 + 1] = every_other(lo, hi, 1);
                    d[r * 4 + 2] = every_other(lo2, hi2, 0);
                    d[r * 4 + 3] = every_other(lo2, hi2, 1);
                }
            }
            for (xi, value) in input_points(d).into_iter().enumerate() {
                // SAFETY: masked to the row's tiles, inside `v` (asserted by `store`).
                unsafe { store(v, xi * stride + i * tw + j0, lanes, value) };
            }
        }
    }
}

/// See [`super::tiles::transform_output`], for planes of at least [`super::tiles::ROW_TILES`] tiles per
/// row: a group of 16 tiles of a row gives 32 consecutive pixels of two output rows.
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transform_output_rows(
    grid: &super::Grid,
    m: &[f32],
    stride: usize,
    plane: &mut [f32],
    bias: f32,
) {
    let [th, tw] = grid.tiles;
    let [out_h, out_w] = grid.out;
    assert!(plane.len() >= out_h * out_w);
    let bias = _mm512_set1_ps(bias);
    let first_half = _mm512_setr_epi32(0, 16, 1, 17, 2, 18, 3, 19, 4, 20, 5, 21, 6, 22, 7, 23);
    let second_half = _mm512_add_epi32(first_half, _mm512_set1_epi32(8));
    for i in 0..th {
        for j0 in (0..tw).step_by(LANES) {
            let lanes = first_lanes(tw - j0);
            // SAFETY: loads masked to the row's tiles, inside `m` (asserted by `load`).
            let points: [__m512; POINTS] =
                std::array::from_fn(|xi| unsafe { load(m, xi * stride + i * tw + j0, lanes) });
            let [y00, y01, y10, y11] = output_values(points, bias);
            for (r, left, right) in [(2 * i, y00, y01), (2 * i + 1, y10, y11)] {
                if r >= out_h {
                    continue;
                }
                let col = 2 * j0;
                let count = (out_w - col).min(2 * LANES);
                let row = &mut plane[r * out_w + col..][..count];
                // SAFETY: each store is masked to `row`'s length.
                unsafe {
                    let lo = _mm512_permutex2var_ps(left, first_half, right);
                    _mm512_mask_storeu_ps(row.as_mut_ptr(), first_lanes(count), lo);
                    if count > LANES {
                        let hi = _mm512_permutex2var_ps(left, second_half, right);
                        _mm512_mask_storeu_ps(
                            row.as_mut_ptr().add(LANES),
                            first_lanes(count - LANES),
                            hi,
                        );
                    }
                }
            }
        }
    }
}

/// See [`super::tiles::transform_output_grad`], for planes of at least [`super::tiles::ROW_TILES`] tiles
/// per row: a group of 16 tiles reads 32 consecutive pixels of two rows, masked at the
/// plane's edges.
///
/// # Safety
/// The CPU must have AVX-512F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn transform_output_grad_rows(
    grid: &super::Grid,
    plane: &[f32],
    e: &mut [f32],
    stride: usize,
) {
    let [th, tw] = grid.tiles;
    let [out_h, out_w] = grid.out;
    assert!(plane.len() >= out_h * out_w);
    for i in 0..th {
        for j0 in (0..tw).step_by(LANES) {
            let lanes = first_lanes(tw - j0);
            let mut d = [_mm512_setzero_ps(); 4];
            for r in 0..2 {
                let y = 2 * i + r;
                if y >= out_h {
                    continue;
                }
                let col = 2 * j0;
                let count = (out_w - col).min(2 * LANES);
                let row = &plane[y * out_w + col..][..count];
                // SAFETY: each load is masked to `row`'s length.
                unsafe {
                    let lo = _mm512_maskz_loadu_ps(first_lanes(count), row.as_ptr());
                    let hi = if count > LANES {
                        _mm512_maskz_loadu_ps(first_lanes(count - LANES), row.as_ptr().add(LANES))
                    } else {
                        _mm512_setzero_ps()
                    };
                    d[2 * r] = every_other(lo, hi, 0);
                    d[2 * r + 1] = every_other(lo, hi, 1);
                }
            }
            for (xi, value) in output_grad_points(d).into_iter().enumerate() {
                // SAFETY: masked to the row's tiles, inside `e` (asserted by `store`).
                unsafe { store(e, xi * stride + i * tw + j0, lanes, value) };
            }
        }
    }
}
