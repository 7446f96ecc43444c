//! 2-D convolution and its two gradients on the CPU, on contiguous NCHW `f32` slices: im2col +
//! GEMM forward, GEMM + col2im input gradient, and a weight gradient that is one GEMM per chunk of
//! images, `dW[Co, K] += dY[Co, cols] · col(x)ᵀ[cols, K]` (K = Ci·kh·kw), accumulated in place.
//!
//! Images are processed in chunks whose column matrix stays under [`MAX_COL_ELEMS`] (never a full
//! im2col of a batch), and chunks are wide enough ([`TARGET_COLS`]) that the GEMMs stay efficient
//! when the spatial size is small (ResNet's last stage at 32 px is 1×1). Disjoint groups of images
//! run in parallel over rayon; a batch of one gives its threads to the GEMM instead.
//!
//! Groups = 1 only (the caller falls back to Burn's op otherwise); any stride, padding, dilation.

use std::borrow::Cow;
use std::cell::Cell;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicUsize, Ordering};

use gemm::Parallelism;
use rayon::prelude::*;

use super::live_taps::{full_rows, live_weight, without_dead_taps};
use super::narrow;
use super::winograd;

/// Columns (images × output pixels) per GEMM that keep the micro-kernels busy.
const TARGET_COLS: usize = 512;
/// Upper bound on one chunk's column matrix, in `f32`s (16 MiB), per parallel task.
const MAX_COL_ELEMS: usize = 4 << 20;

/// Shapes and options of one convolution (NCHW, weight `[Co, Ci, kh, kw]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Geometry {
    pub batch: usize,
    pub c_in: usize,
    pub height: usize,
    pub width: usize,
    pub c_out: usize,
    pub kernel: [usize; 2],
    pub stride: [usize; 2],
    pub padding: [usize; 2],
    pub dilation: [usize; 2],
    pub out: [usize; 2],
}

/// How many positions a window of `kernel` taps `dilation` apart takes along an axis of `len`
/// elements with `padding` on both sides, `stride` apart (floor mode, as Burn's conv and pool);
/// `None` where none fits, or for a zero kernel or stride.
pub(crate) fn window_positions(
    len: usize,
    kernel: usize,
    stride: usize,
    padding: usize,
    dilation: usize,
) -> Option<usize> {
    let span = dilation * kernel.checked_sub(1)? + 1;
    let padded = len + 2 * padding;
    (padded >= span && stride > 0).then(|| (padded - span) / stride + 1)
}

impl Geometry {
    /// `None` when the output would be empty (the caller falls back to Burn's op, which reports it).
    pub fn new(
        x: [usize; 4],
        weight: [usize; 4],
        stride: [usize; 2],
        padding: [usize; 2],
        dilation: [usize; 2],
    ) -> Option<Self> {
        let out_dim =
            |i| window_positions(x[2 + i], weight[2 + i], stride[i], padding[i], dilation[i]);
        let out = [out_dim(0)?, out_dim(1)?];
        Some(Self {
            batch: x[0],
            c_in: x[1],
            height: x[2],
            width: x[3],
            c_out: weight[0],
            kernel: [weight[2], weight[3]],
            stride,
            padding,
            dilation,
            out,
        })
    }

    /// The input's height (axis 0) or width (axis 1).
    pub(crate) fn input_extent(&self, axis: usize) -> usize {
        [self.height, self.width][axis]
    }

    /// Rows of the column matrix: Ci·kh·kw.
    pub(crate) fn k(&self) -> usize {
        self.c_in * self.kernel[0] * self.kernel[1]
    }

    /// Output pixels per image.
    pub(crate) fn pixels(&self) -> usize {
        self.out[0] * self.out[1]
    }

    pub(crate) fn image_len(&self) -> usize {
        self.c_in * self.height * self.width
    }

    fn out_image_len(&self) -> usize {
        self.c_out * self.pixels()
    }

    /// A 1×1 conv with stride 1 and no padding: an image is already its own column matrix.
    fn pointwise(&self) -> bool {
        self.kernel == [1, 1] && self.stride == [1, 1] && self.padding == [0, 0]
    }

    /// Scratch for the column matrix of `nb_max` images; none when [`columns`] never needs it.
    fn col_scratch(&self, nb_max: usize) -> Scratch {
        let len = if self.pointwise() && nb_max == 1 {
            0
        } else {
            self.k() * nb_max * self.pixels()
        };
        Scratch::take(&COL_SCRATCH, len)
    }

    /// Scratch for `nb_max` images of `[Co, P]` side by side; none for one image at a time, which
    /// is its own `[Co, P]` matrix.
    fn wide_scratch(&self, nb_max: usize) -> Scratch {
        let len = if nb_max == 1 {
            0
        } else {
            self.out_image_len() * nb_max
        };
        Scratch::take(&WIDE_SCRATCH, len)
    }

    /// Images per GEMM: wide enough for the kernels, within the memory bound, and at most the
    /// group's size.
    fn chunk(&self, group_len: usize) -> usize {
        let per_image = (self.k() * self.pixels()).max(1);
        let wide = TARGET_COLS.div_ceil(self.pixels().max(1));
        let fits = (MAX_COL_ELEMS / per_image).max(1);
        wide.min(fits).clamp(1, group_len.max(1))
    }

    /// Contiguous image ranges run as parallel tasks, and the GEMM parallelism inside each.
    pub(super) fn plan(&self) -> (Vec<std::ops::Range<usize>>, Parallelism) {
        let threads = rayon::current_num_threads().max(1);
        let groups = threads.min(self.batch).max(1);
        let per = self.batch.div_ceil(groups);
        let ranges = (0..groups)
            .map(|g| (g * per).min(self.batch)..((g + 1) * per).min(self.batch))
            .filter(|r| !r.is_empty())
            .collect::<Vec<_>>();
        let inner = if ranges.len() > 1 || threads == 1 {
            Parallelism::None
        } else {
            Parallelism::Rayon(threads)
        };
        (ranges, inner)
    }
}

thread_local! {
    pub(super) static COL_SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
    pub(super) static WIDE_SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// A scratch buffer kept by its thread between calls. A fresh column matrix per conv (up to
/// [`MAX_COL_ELEMS`] floats, 9× the output for a 3×3 conv) cost page faults and zeroing, ~10% of a
/// ResNet-50 step; reused, it costs neither. Its contents are stale: every user overwrites the
/// part it reads. A nested use on the same thread (rayon work stealing) finds the slot empty and
/// allocates its own, so nothing is shared.
pub(super) struct Scratch {
    slot: &'static std::thread::LocalKey<Cell<Vec<f32>>>,
    buf: Vec<f32>,
    len: usize,
}

impl Scratch {
    pub(super) fn take(slot: &'static std::thread::LocalKey<Cell<Vec<f32>>>, len: usize) -> Self {
        let mut buf = slot.take();
        if buf.len() < len {
            buf.resize(len, 0.0);
        }
        Self { slot, buf, len }
    }
}

impl std::ops::Deref for Scratch {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        &self.buf[..self.len]
    }
}

impl std::ops::DerefMut for Scratch {
    fn deref_mut(&mut self) -> &mut [f32] {
        &mut self.buf[..self.len]
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let buf = std::mem::take(&mut self.buf);
        // Keep the larger of this buffer and one a nested use may have put back.
        let other = self.slot.take();
        self.slot
            .set(if other.len() > buf.len() { other } else { buf });
    }
}

/// Writes the column matrix of images `x` (`nb` images) into `col` laid out `[K, nb·P]`.
fn im2col(g: &Geometry, x: &[f32], nb: usize, col: &mut [f32]) {
    if g.out[1] < narrow::NARROW {
        return narrow::im2col(g, x, nb, col);
    }
    let [kh, kw] = g.kernel;
    let [ho, wo] = g.out;
    let p = g.pixels();
    let cols = nb * p;
    for c in 0..g.c_in {
        for ki in 0..kh {
            for kj in 0..kw {
                let row = (c * kh + ki) * kw + kj;
                let dst_row = &mut col[row * cols..(row + 1) * cols];
                for b in 0..nb {
                    let plane =
                        &x[b * g.image_len() + c * g.height * g.width..][..g.height * g.width];
                    let dst = &mut dst_row[b * p..(b + 1) * p];
                    for oy in 0..ho {
                        let out_row = &mut dst[oy * wo..(oy + 1) * wo];
                        let iy = (oy * g.stride[0] + ki * g.dilation[0]) as isize
                            - g.padding[0] as isize;
                        if iy < 0 || iy >= g.height as isize {
                            out_row.fill(0.0);
                            continue;
                        }
                        let src = &plane[iy as usize * g.width..][..g.width];
                        let x0 = (kj * g.dilation[1]) as isize - g.padding[1] as isize;
                        let (lo, hi) = valid_range(x0, g.stride[1], g.width, wo);
                        out_row[..lo].fill(0.0);
                        out_row[hi..].fill(0.0);
                        if g.stride[1] == 1 {
                            let start = (x0 + lo as isize) as usize;
                            out_row[lo..hi].copy_from_slice(&src[start..start + hi - lo]);
                        } else {
                            for (ox, v) in out_row[lo..hi].iter_mut().enumerate() {
                                *v = src[(x0 + ((lo + ox) * g.stride[1]) as isize) as usize];
                            }
                        }
                    }
                }
            }
        }
    }
}

/// The output columns `lo..hi` whose input column `x0 + ox·stride` lies inside `0..width`.
pub(super) fn valid_range(x0: isize, stride: usize, width: usize, out: usize) -> (usize, usize) {
    let s = stride as isize;
    let lo = if x0 >= 0 {
        0
    } else {
        ((-x0 + s - 1) / s) as usize
    };
    let last = width as isize - 1 - x0;
    let hi = if last < 0 { 0 } else { (last / s + 1) as usize };
    let hi = hi.min(out);
    (lo.min(hi), hi)
}

/// Adds the column matrix `col` (`[K, nb·P]`) back into the images `dx` (`nb` images, zeroed by
/// the caller): the adjoint of [`im2col`].
fn col2im(g: &Geometry, col: &[f32], nb: usize, dx: &mut [f32]) {
    if g.out[1] < narrow::NARROW {
        return narrow::col2im(g, col, nb, dx);
    }
    let [kh, kw] = g.kernel;
    let [ho, wo] = g.out;
    let p = g.pixels();
    let cols = nb * p;
    for c in 0..g.c_in {
        for ki in 0..kh {
            for kj in 0..kw {
                let row = (c * kh + ki) * kw + kj;
                let src_row = &col[row * cols..(row + 1) * cols];
                for b in 0..nb {
                    let plane =
                        &mut dx[b * g.image_len() + c * g.height * g.width..][..g.height * g.width];
                    let src = &src_row[b * p..(b + 1) * p];
                    for oy in 0..ho {
                        let iy = (oy * g.stride[0] + ki * g.dilation[0]) as isize
                            - g.padding[0] as isize;
                        if iy < 0 || iy >= g.height as isize {
                            continue;
                        }
                        let dst = &mut plane[iy as usize * g.width..][..g.width];
                        let x0 = (kj * g.dilation[1]) as isize - g.padding[1] as isize;
                        let (lo, hi) = valid_range(x0, g.stride[1], g.width, wo);
                        let src = &src[oy * wo + lo..oy * wo + hi];
                        if g.stride[1] == 1 {
                            let start = (x0 + lo as isize) as usize;
                            for (d, v) in dst[start..start + src.len()].iter_mut().zip(src) {
                                *d += v;
                            }
                        } else {
                            for (ox, v) in src.iter().enumerate() {
                                dst[(x0 + ((lo + ox) * g.stride[1]) as isize) as usize] += v;
                            }
                        }
                    }
                }
            }
        }
    }
}

/// A row-major matrix view for [`matmul`]: element `(i, j)` at `ptr[i·rs + j·cs]`.
#[derive(Clone, Copy)]
pub(super) struct Mat<T> {
    ptr: T,
    rs: isize,
    cs: isize,
}

pub(super) fn rows(data: &[f32], row_stride: usize) -> Mat<*const f32> {
    Mat {
        ptr: data.as_ptr(),
        rs: row_stride as isize,
        cs: 1,
    }
}

pub(super) fn transposed(data: &[f32], row_stride: usize) -> Mat<*const f32> {
    Mat {
        ptr: data.as_ptr(),
        rs: 1,
        cs: row_stride as isize,
    }
}

/// `dst[m, n] (+)= lhs[m, k] · rhs[k, n]`, `dst` row-major with `n` columns; `accumulate` adds to
/// what `dst` holds.
///
/// # Safety
/// `lhs` and `rhs` must address `m×k` and `k×n` elements inside live allocations with their
/// strides, and must not overlap `dst`.
pub(super) unsafe fn matmul(
    dims: [usize; 3],
    dst: &mut [f32],
    accumulate: bool,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    parallelism: Parallelism,
) {
    let [m, _, n] = dims;
    assert!(dst.len() >= m * n, "matmul: destination too small");
    // SAFETY: `dst` holds `m×n` elements (checked above); the caller vouches for the operands.
    unsafe { gemm_into(dims, dst.as_mut_ptr(), accumulate, lhs, rhs, parallelism) }
}

/// `dst[m, n] = lhs[m, k] · rhs[k, n]` into memory not yet written: gemm, not reading `dst`,
/// writes every element, so a fresh buffer needs no zeroing first (a `memset` per call).
///
/// # Safety
/// As [`matmul`].
unsafe fn matmul_uninit(
    dims: [usize; 3],
    dst: &mut [MaybeUninit<f32>],
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    parallelism: Parallelism,
) {
    let [m, k, n] = dims;
    assert!(dst.len() >= m * n, "matmul: destination too small");
    if k == 0 {
        // An empty sum: gemm may leave `dst` as it is.
        dst[..m * n].fill(MaybeUninit::new(0.0));
        return;
    }
    // SAFETY: as in `matmul`; gemm writes `dst` without reading it when not accumulating.
    unsafe { gemm_into(dims, dst.as_mut_ptr().cast(), false, lhs, rhs, parallelism) }
}

/// # Safety
/// `dst` must address `m×n` writable elements, initialised where `accumulate`; the operands as
/// in [`matmul`].
unsafe fn gemm_into(
    [m, k, n]: [usize; 3],
    dst: *mut f32,
    accumulate: bool,
    lhs: Mat<*const f32>,
    rhs: Mat<*const f32>,
    parallelism: Parallelism,
) {
    // SAFETY: the callers' contract, `dst` row-major. gemm computes dst := 1·dst + 1·lhs·rhs
    // when reading dst, else lhs·rhs.
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            dst,
            1,
            n as isize,
            accumulate,
            lhs.ptr,
            lhs.cs,
            lhs.rs,
            rhs.ptr,
            rhs.cs,
            rhs.rs,
            1.0f32,
            1.0f32,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// A convolution's weight as the `[Co, K]` matrix the GEMMs read: element `(o, j)` at
/// `data[o·row_stride + j·col_stride]`.
struct WeightMatrix<'a> {
    data: Cow<'a, [f32]>,
    row_stride: usize,
    col_stride: usize,
}

impl<'a> WeightMatrix<'a> {
    /// `[Co, Ci, kh, kw]` as stored: `[Co, K]` row-major.
    fn dense(data: impl Into<Cow<'a, [f32]>>, g: &Geometry) -> Self {
        Self::strided(data.into(), [g.c_out, g.k()], g.k(), 1)
    }

    /// Panics unless every element of the `[rows, cols]` matrix lies inside `data`: the GEMMs
    /// read it through raw pointers.
    fn strided(
        data: Cow<'a, [f32]>,
        [rows, cols]: [usize; 2],
        row_stride: usize,
        col_stride: usize,
    ) -> Self {
        let last = (rows.max(1) - 1) * row_stride + (cols.max(1) - 1) * col_stride;
        assert!(
            rows == 0 || cols == 0 || last < data.len(),
            "conv weight: a {rows}×{cols} matrix with strides ({row_stride}, {col_stride}) \
             does not fit in {} values",
            data.len()
        );
        Self {
            data,
            row_stride,
            col_stride,
        }
    }

    fn as_rows(&self) -> Mat<*const f32> {
        Mat {
            ptr: self.data.as_ptr(),
            rs: self.row_stride as isize,
            cs: self.col_stride as isize,
        }
    }

    fn as_transposed(&self) -> Mat<*const f32> {
        Mat {
            ptr: self.data.as_ptr(),
            rs: self.col_stride as isize,
            cs: self.row_stride as isize,
        }
    }
}

/// The convolution the GEMMs run ([`without_dead_taps`]) and its weight matrix. A single live
/// tap's `[Co, Ci]` weight is read in place (ResNet's 3×3 convs over 1×1 pixel: every
/// `kh·kw`-th value from the tap on): gathering it into a copy read the same cache lines and
/// wrote the copy, twice a step. Several live taps are gathered.
fn live_conv<'a>(g: &Geometry, weight: &'a [f32]) -> (Geometry, WeightMatrix<'a>) {
    let Some((live_g, live)) = without_dead_taps(g) else {
        return (*g, WeightMatrix::dense(weight, g));
    };
    if live[0].len() == 1 && live[1].len() == 1 {
        let tap = live[0].start * g.kernel[1] + live[1].start;
        let per_channel = g.kernel[0] * g.kernel[1];
        let from_tap = Cow::Borrowed(&weight[tap.min(weight.len())..]);
        let w = WeightMatrix::strided(from_tap, [g.c_out, g.c_in], g.k(), per_channel);
        return (live_g, w);
    }
    let copied = live_weight(g, weight, &live);
    let w = WeightMatrix::dense(copied, &live_g);
    (live_g, w)
}

/// Copies `nb` images of `[C, P]` into one `[C, nb·P]` matrix.
fn gather(images: &[f32], wide: &mut [f32], channels: usize, p: usize, nb: usize) {
    if p == 1 {
        // A transpose: one `memcpy` call per float would cost more than the float.
        for (c, dst) in wide[..channels * nb].chunks_exact_mut(nb).enumerate() {
            dst.iter_mut()
                .zip(images[c..].iter().step_by(channels))
                .for_each(|(d, &v)| *d = v);
        }
        return;
    }
    for b in 0..nb {
        for c in 0..channels {
            wide[c * nb * p + b * p..][..p].copy_from_slice(&images[(b * channels + c) * p..][..p]);
        }
    }
}

/// The inverse of [`gather`].
fn scatter(wide: &[f32], images: &mut [MaybeUninit<f32>], channels: usize, p: usize, nb: usize) {
    if p == 1 {
        for (c, src) in wide[..channels * nb].chunks_exact(nb).enumerate() {
            images[c..]
                .iter_mut()
                .step_by(channels)
                .zip(src)
                .for_each(|(d, &v)| {
                    d.write(v);
                });
        }
        return;
    }
    for b in 0..nb {
        for c in 0..channels {
            let src = &wide[c * nb * p + b * p..][..p];
            for (d, &v) in images[(b * channels + c) * p..][..p].iter_mut().zip(src) {
                d.write(v);
            }
        }
    }
}

/// The column matrix `[K, nb·P]` of `nb` images: the image itself for one image of a pointwise
/// conv, else built in `col`.
fn columns<'a>(g: &Geometry, x: &'a [f32], nb: usize, col: &'a mut [f32]) -> &'a [f32] {
    let len = g.k() * nb * g.pixels();
    if g.pointwise() {
        if nb == 1 {
            return x;
        }
        gather(x, &mut col[..len], g.c_in, g.pixels(), nb);
    } else {
        im2col(g, x, nb, &mut col[..len]);
    }
    &col[..len]
}

/// `nb` images of `[Co, P]` as one `[Co, nb·P]` matrix: the image itself when `nb` is 1, else
/// gathered into `wide`.
fn side_by_side<'a>(g: &Geometry, dy: &'a [f32], nb: usize, wide: &'a mut [f32]) -> &'a [f32] {
    if nb == 1 {
        return dy;
    }
    let len = g.c_out * nb * g.pixels();
    gather(dy, &mut wide[..len], g.c_out, g.pixels(), nb);
    &wide[..len]
}

/// One parallel task's share of a pass: a contiguous group of images, processed in chunks of at
/// most `nb_max`, with its own scratch buffers.
struct Group {
    /// The group's first image.
    first: usize,
    end: usize,
    nb_max: usize,
    col: Scratch,
    wide: Scratch,
    /// Threads inside each GEMM ([`Geometry::plan`]).
    parallelism: Parallelism,
}

impl Group {
    fn new(g: &Geometry, images: std::ops::Range<usize>, parallelism: Parallelism) -> Self {
        let nb_max = g.chunk(images.len());
        Self {
            first: images.start,
            end: images.end,
            nb_max,
            col: g.col_scratch(nb_max),
            wide: g.wide_scratch(nb_max),
            parallelism,
        }
    }

    /// `(first image, images)` of each chunk, in order.
    fn chunks(&self) -> impl Iterator<Item = (usize, usize)> + use<> {
        let (end, nb_max) = (self.end, self.nb_max);
        (self.first..end)
            .step_by(nb_max)
            .map(move |start| (start, nb_max.min(end - start)))
    }
}

/// Splits the batch into [`Geometry::plan`]'s groups and runs `pass` on each in parallel, with the
/// group's slice of `out` (`item` elements per image).
fn for_each_group<T: Send>(
    g: &Geometry,
    out: &mut [T],
    item: usize,
    pass: impl Fn(&mut [T], Group) + Sync,
) {
    let (ranges, parallelism) = g.plan();
    let mut outputs = split_by_ranges(out, &ranges, item);
    outputs
        .par_iter_mut()
        .zip(ranges.par_iter())
        .for_each(|(out, range)| pass(out, Group::new(g, range.clone(), parallelism)));
}

/// Forward: `y[n] = W · col(x[n]) (+ bias)`.
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `weight`: `[Co, Ci, kh, kw]`, `bias`: `[Co]`
/// - returns `[N, Co, Ho, Wo]`
pub(crate) fn forward(g: &Geometry, x: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    if winograd::applies(g) {
        return winograd::forward(g, x, weight, bias);
    }
    let (g, weight) = live_conv(g, weight);
    let g = &g;
    let (k, p) = (g.k(), g.pixels());
    let len = g.batch * g.out_image_len();
    // Each image's outputs are written whole below (by its GEMM or the scatter after a wide
    // one), so the buffer is not zeroed first: counted, and the count checked.
    let written = AtomicUsize::new(0);
    let mut y: Vec<f32> = Vec::with_capacity(len);
    let out = &mut y.spare_capacity_mut()[..len];
    for_each_group(g, out, g.out_image_len(), |y, mut group| {
        for (start, nb) in group.chunks() {
            let cols = nb * p;
            let x = &x[start * g.image_len()..][..nb * g.image_len()];
            let col = columns(g, x, nb, &mut group.col);
            let y = &mut y[(start - group.first) * g.out_image_len()..][..nb * g.out_image_len()];
            // One image is its own [Co, P] matrix: the GEMM writes it in place.
            let (dims, lhs, rhs) = ([g.c_out, k, cols], weight.as_rows(), rows(col, cols));
            // SAFETY: weight is [Co, K] (checked by WeightMatrix) and col [K, cols], both inside
            // their slices.
            unsafe {
                if nb == 1 {
                    matmul_uninit(dims, y, lhs, rhs, group.parallelism);
                } else {
                    let wide = &mut group.wide[..g.c_out * cols];
                    matmul(dims, wide, false, lhs, rhs, group.parallelism);
                }
            }
            if nb > 1 {
                scatter(&group.wide[..g.c_out * cols], y, g.c_out, p, nb);
            }
            written.fetch_add(y.len(), Ordering::Relaxed);
            // SAFETY: every element of `y` was written just above.
            let y = unsafe { &mut *(std::ptr::from_mut(y) as *mut [f32]) };
            if let Some(bias) = bias {
                for (plane, b) in y.chunks_mut(p).zip(bias.iter().cycle()) {
                    plane.iter_mut().for_each(|v| *v += b);
                }
            }
        }
    });
    assert_eq!(
        written.into_inner(),
        len,
        "conv forward: every image written"
    );
    // SAFETY: the chunks of all groups cover the batch, each written whole (counted above).
    unsafe { y.set_len(len) };
    y
}

/// Input gradient: `dx[n] = col2im(Wᵀ · dy[n])`.
///
/// # Shapes
/// - `weight`: `[Co, Ci, kh, kw]`, `dy`: `[N, Co, Ho, Wo]`
/// - returns `[N, Ci, H, W]`
pub(crate) fn input_grad(g: &Geometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    if winograd::applies(g) {
        return winograd::input_grad(g, weight, dy);
    }
    let (g, weight) = live_conv(g, weight);
    let g = &g;
    let (k, p) = (g.k(), g.pixels());
    let mut dx = vec![0.0f32; g.batch * g.image_len()];
    for_each_group(g, &mut dx, g.image_len(), |dx, mut group| {
        for (start, nb) in group.chunks() {
            let cols = nb * p;
            let dy = &dy[start * g.out_image_len()..][..nb * g.out_image_len()];
            let dy = side_by_side(g, dy, nb, &mut group.wide);
            let dx = &mut dx[(start - group.first) * g.image_len()..][..nb * g.image_len()];
            // For one image of a pointwise conv col2im is the identity: the GEMM writes dx.
            let in_place = g.pointwise() && nb == 1;
            let dst = if in_place {
                &mut *dx
            } else {
                &mut group.col[..k * cols]
            };
            // SAFETY: Wᵀ is [K, Co] (weight read with swapped strides, checked by
            // WeightMatrix), dy [Co, cols].
            unsafe {
                matmul(
                    [k, g.c_out, cols],
                    dst,
                    false,
                    weight.as_transposed(),
                    rows(dy, cols),
                    group.parallelism,
                );
            }
            if !in_place {
                col2im(g, &group.col[..k * cols], nb, dx);
            }
        }
    });
    dx
}

/// Weight gradient: `dW = Σ_chunks dy[Co, cols] · col(x)ᵀ[cols, K]`, one partial per parallel
/// task, summed at the end.
///
/// gemm packs the operand it streams along its output's rows into panels. In the `dW` order
/// that operand is the column matrix, read across its rows: a transposing copy of the largest
/// operand, as much time as the multiply-adds (10% of a ResNet-18 step at 32 px). So where the
/// columns (images × pixels) outnumber the output channels, each partial is computed
/// transposed, `dWᵀ[K, Co] += col(x)[K, cols] · dyᵀ[cols, Co]`: gemm then packs `dy`, and
/// the sum is transposed once, a pass over `dW`. Where they do not (a 1×1-pixel last stage),
/// the column matrix is smaller than `dW`, and packing it costs less than that pass.
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `dy`: `[N, Co, Ho, Wo]`
/// - returns `[Co, Ci, kh, kw]`
pub(crate) fn weight_grad(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    if winograd::applies_to_weight_grad(g) {
        return winograd::weight_grad(g, x, dy);
    }
    let (live_g, full_rows) = match without_dead_taps(g) {
        Some((live_g, live)) => (live_g, Some(full_rows(g, &live))),
        None => (*g, None),
    };
    let order = if live_g.batch * live_g.pixels() >= live_g.c_out {
        Order::Transposed
    } else {
        Order::Direct
    };
    let partials = weight_grad_partials(&live_g, x, dy, order);
    combine_partials(partials, g, full_rows.as_deref(), order)
}

/// How [`weight_grad_partials`] lays out each partial: `[Co, K]` or `[K, Co]`.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Order {
    Direct,
    Transposed,
}

/// One partial weight gradient per parallel group, in `order`.
fn weight_grad_partials(g: &Geometry, x: &[f32], dy: &[f32], order: Order) -> Vec<Vec<f32>> {
    let (k, p) = (g.k(), g.pixels());
    let (ranges, parallelism) = g.plan();
    ranges
        .par_iter()
        .map(|range| {
            let mut group = Group::new(g, range.clone(), parallelism);
            let len = k * g.c_out;
            // The first chunk's GEMM writes the partial, the others add to it.
            let mut dw: Vec<f32> = Vec::with_capacity(len);
            for (start, nb) in group.chunks() {
                let cols = nb * p;
                let x = &x[start * g.image_len()..][..nb * g.image_len()];
                let col = columns(g, x, nb, &mut group.col);
                let dy = &dy[start * g.out_image_len()..][..nb * g.out_image_len()];
                let dy = side_by_side(g, dy, nb, &mut group.wide);
                // colᵀ and dyᵀ read col [K, cols] and dy [Co, cols] with swapped strides.
                let (dims, lhs, rhs) = match order {
                    Order::Transposed => {
                        ([k, cols, g.c_out], rows(col, cols), transposed(dy, cols))
                    }
                    Order::Direct => ([g.c_out, cols, k], rows(dy, cols), transposed(col, cols)),
                };
                // SAFETY: the operands lie inside col and dy as described above.
                unsafe {
                    if dw.is_empty() {
                        matmul_uninit(
                            dims,
                            &mut dw.spare_capacity_mut()[..len],
                            lhs,
                            rhs,
                            group.parallelism,
                        );
                        // SAFETY: `matmul_uninit` wrote all `len` elements.
                        dw.set_len(len);
                    } else {
                        matmul(dims, &mut dw, true, lhs, rhs, group.parallelism);
                    }
                }
            }
            // A group without images (none is planned) contributes nothing.
            dw.resize(len, 0.0);
            dw
        })
        .collect()
}

/// `dW[Co, Ci·kh·kw]` from the groups' partials, summed (and transposed) in one pass over them.
/// With `full_rows` the partials are a live convolution's ([`without_dead_taps`]): their row `r`
/// of K goes to the full kernel's row `full_rows[r]`, and the dead taps stay zero.
fn combine_partials(
    partials: Vec<Vec<f32>>,
    g: &Geometry,
    full_rows: Option<&[usize]>,
    order: Order,
) -> Vec<f32> {
    let (k_full, c_out) = (g.k(), g.c_out);
    // The partials' K: the live kernel's rows, or the full kernel's.
    let k = full_rows.map_or(k_full, <[usize]>::len);
    if order == Order::Direct && full_rows.is_none() {
        // Already [Co, K]: sum into the first partial.
        let mut partials = partials.into_iter();
        let mut dw = partials.next().unwrap_or_else(|| vec![0.0; c_out * k_full]);
        for partial in partials {
            dw.iter_mut().zip(partial).for_each(|(a, b)| *a += b);
        }
        return dw;
    }
    let full_row = |r: usize| full_rows.map_or(r, |rows| rows[r]);
    // The dead taps' rows of the full kernel (none without `full_rows`): zero.
    let dead: Vec<usize> = full_rows.map_or_else(Vec::new, |rows| {
        (0..k_full).filter(|r| !rows.contains(r)).collect()
    });
    let len = c_out * k_full;
    // Every element is written below (a live row's sum or a dead row's zero), so the buffer is
    // not zeroed first.
    let mut dw: Vec<f32> = Vec::with_capacity(len);
    // Blocks of 16 output channels (rows of dW) in parallel: the sum is a pass over every
    // partial, as much memory traffic as the GEMMs' output.
    const BLOCK: usize = 16;
    dw.spare_capacity_mut()[..len]
        .par_chunks_mut(BLOCK * k_full)
        .enumerate()
        .for_each(|(block, dst)| {
            let c0 = block * BLOCK;
            let width = dst.len() / k_full;
            match order {
                Order::Direct => {
                    for (c, dst) in (c0..).zip(dst.chunks_exact_mut(k_full)) {
                        for r in 0..k {
                            dst[full_row(r)].write(partials.iter().map(|p| p[c * k + r]).sum());
                        }
                    }
                }
                Order::Transposed => {
                    for r in 0..k {
                        // Summed from zero, not copied from the first partial: a 16-float copy
                        // is a `memcpy` call.
                        let mut sums = [0.0f32; BLOCK];
                        let sums = &mut sums[..width];
                        for partial in &partials {
                            let row = &partial[r * c_out + c0..][..width];
                            sums.iter_mut().zip(row).for_each(|(s, v)| *s += v);
                        }
                        let dst_row = full_row(r);
                        for (i, &v) in sums.iter().enumerate() {
                            dst[i * k_full + dst_row].write(v);
                        }
                    }
                }
            }
            for dst in dst.chunks_exact_mut(k_full) {
                for &r in &dead {
                    dst[r].write(0.0);
                }
            }
        });
    // SAFETY: each block wrote all its rows' `k_full` elements: the live rows above (`full_row`
    // maps the `k` live rows onto distinct rows) and the dead ones, which are the rest.
    unsafe { dw.set_len(len) };
    dw
}

/// Bias gradient: `db[c] = Σ_{n, pixels} dy[n, c]`.
pub(crate) fn bias_grad(g: &Geometry, dy: &[f32]) -> Vec<f32> {
    let p = g.pixels();
    (0..g.c_out)
        .into_par_iter()
        .map(|c| {
            (0..g.batch)
                .map(|n| dy[(n * g.c_out + c) * p..][..p].iter().sum::<f32>())
                .sum()
        })
        .collect()
}

/// Splits `data` into the disjoint slices of `ranges` (in images of `item` elements).
pub(super) fn split_by_ranges<'a, T>(
    mut data: &'a mut [T],
    ranges: &[std::ops::Range<usize>],
    item: usize,
) -> Vec<&'a mut [T]> {
    ranges
        .iter()
        .map(|r| {
            let (head, tail) = std::mem::take(&mut data).split_at_mut(r.len() * item);
            data = tail;
            head
        })
        .collect()
}
