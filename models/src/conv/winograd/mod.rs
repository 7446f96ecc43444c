//! Stride-1 3×3 convolutions by Winograd's minimal filtering, F(2×2, 3×3) (Lavin & Gray, "Fast
//! Algorithms for Convolutional Neural Networks", 2016): 16 multiply-adds per 2×2 output tile and
//! channel pair where im2col + GEMM does 36, in all three passes.
//!
//! The output is cut into 2×2 tiles, each reading a 4×4 input patch `d`. With the transforms
//! `Bᵀ`, `G`, `Aᵀ` below, a tile is `Y = Aᵀ [(G g Gᵀ) ⊙ (Bᵀ d B)] A`, and the sum over input
//! channels of the element-wise products is, for each of the 16 transformed points ξ, one GEMM
//! over channels: `M[ξ] = U[ξ] · V[ξ]`, `U[ξ]` `[Co, Ci]` (weights), `V[ξ]` `[Ci, tiles]` (input).
//!
//! - **Forward**: those GEMMs, then `Aᵀ M A` per tile.
//! - **Input gradient**: with stride 1, `dx` is the forward conv of `dy` with the kernel rotated
//!   by 180°, input and output channels swapped, and padding `2 − p`: the same code.
//! - **Weight gradient**: by the transposition principle the same tiles give
//!   `dW = Gᵀ [Σ_tiles (A e Aᵀ) ⊙ (Bᵀ d B)] G`, `e` the 2×2 tile of `dy` and `d` the 4×4 patch
//!   the forward read for it; per point, `Σ_tiles` is one GEMM over tiles.
//!
//! The transforms add, subtract and halve (exact in binary), so the results differ from the
//! direct conv's by rounding only. Images run in parallel groups as in [`super::cpu`], in chunks
//! whose transformed tiles stay under [`MAX_ELEMS`].

use std::cell::Cell;
use std::ops::Range;

use gemm::Parallelism;
use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;
mod tiles;

use tiles::{Kernel, Planes, Stack, transform_input, transform_output, transform_output_grad};

use super::cpu::{
    COL_SCRATCH, Geometry, Mat, Scratch, WIDE_SCRATCH, matmul, rows, split_by_ranges, transposed,
};

/// Transformed points per tile: 4 × 4.
const POINTS: usize = 16;
/// Tiles per GEMM that keep the micro-kernels busy.
const TARGET_TILES: usize = 512;
/// Upper bound on one chunk's transformed input or output, in `f32`s (16 MiB), per task.
const MAX_ELEMS: usize = 4 << 20;
/// Below this many input or output channels the transforms cost more than the saved products.
const MIN_CHANNELS: usize = 16;
/// Below this many tiles per GEMM the transformed weights (16 · Co · Ci values, 1.8× the
/// kernel's) serve too few products, and im2col wins.
const MIN_TILES: usize = 32;

/// Whether [`forward`] and [`input_grad`] take the conv: 3×3, stride 1, no dilation, padding at
/// most 2, an output of at least 2×2 pixels, and enough channels and tiles to gain.
pub(super) fn applies(g: &Geometry) -> bool {
    let shape = g.kernel == [3, 3]
        && g.stride == [1, 1]
        && g.dilation == [1, 1]
        && g.padding.iter().all(|&p| p <= 2)
        && g.out.iter().all(|&o| o >= 2);
    // One tile at a time the transforms cost more than the products they save.
    shape
        && g.c_in >= MIN_CHANNELS
        && g.c_out >= MIN_CHANNELS
        && Kernel::best() != Kernel::Scalar
        && tiles_per_gemm(g) >= MIN_TILES
}

/// Whether [`weight_grad`] takes the conv: as [`applies`], with at least half as many tiles per
/// GEMM as channels. Its GEMMs sum over tiles into 16 · Ci · Co values, which are then summed
/// and transformed back: with fewer tiles, that pass over them costs more than the products
/// saved (ResNet-50's 7×7 stage at batch 8: 128 tiles, 512 channels).
pub(super) fn applies_to_weight_grad(g: &Geometry) -> bool {
    applies(g) && 2 * tiles_per_gemm(g) >= g.c_in.max(g.c_out)
}

/// Tiles each of the 16 GEMMs gets: the batch's, or a group's ([`Schedule`]).
fn tiles_per_gemm(g: &Geometry) -> usize {
    let grid = Grid::forward(g);
    let images = match Schedule::of(g) {
        Schedule::ByPoints => g.batch,
        Schedule::ByImages => {
            let (ranges, _) = g.plan();
            ranges.iter().map(Range::len).min().unwrap_or(0)
        }
    };
    images * grid.per_image()
}

/// Forward: `y = conv(x, weight) (+ bias)`.
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `weight`: `[Co, Ci, 3, 3]`, `bias`: `[Co]`
/// - returns `[N, Co, Ho, Wo]`
pub(super) fn forward(g: &Geometry, x: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    forward_with(Kernel::best(), Schedule::of(g), g, x, weight, bias)
}

fn forward_with(
    kernel: Kernel,
    schedule: Schedule,
    g: &Geometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let u = TransformedWeight::new(weight, g.c_out, g.c_in, Pass::Forward);
    let grid = Grid::forward(g);
    match schedule {
        Schedule::ByImages => tiled_conv(kernel, g, &grid, [g.c_in, g.c_out], x, &u, bias),
        Schedule::ByPoints => {
            tiled_conv_by_points(kernel, g.batch, &grid, [g.c_in, g.c_out], x, &u, bias)
        }
    }
}

/// Input gradient: the forward conv of `dy` with the rotated, transposed kernel.
///
/// # Shapes
/// - `weight`: `[Co, Ci, 3, 3]`, `dy`: `[N, Co, Ho, Wo]`
/// - returns `[N, Ci, H, W]`
pub(super) fn input_grad(g: &Geometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    input_grad_with(Kernel::best(), Schedule::of(g), g, weight, dy)
}

fn input_grad_with(
    kernel: Kernel,
    schedule: Schedule,
    g: &Geometry,
    weight: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    let u = TransformedWeight::new(weight, g.c_out, g.c_in, Pass::InputGrad);
    let grid = Grid::input_grad(g);
    let channels = [g.c_out, g.c_in];
    match schedule {
        Schedule::ByImages => tiled_conv(kernel, g, &grid, channels, dy, &u, None),
        Schedule::ByPoints => tiled_conv_by_points(kernel, g.batch, &grid, channels, dy, &u, None),
    }
}

/// Weight gradient: per point, `Σ_tiles (A e Aᵀ)[ξ] (Bᵀ d B)[ξ]` as one GEMM over a chunk's
/// tiles, accumulated per parallel group; the groups' sums are added and transformed back.
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `dy`: `[N, Co, Ho, Wo]`
/// - returns `[Co, Ci, 3, 3]`
pub(super) fn weight_grad(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    weight_grad_with(Kernel::best(), Schedule::of(g), g, x, dy)
}

fn weight_grad_with(
    kernel: Kernel,
    schedule: Schedule,
    g: &Geometry,
    x: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    let grid = Grid::forward(g);
    if schedule == Schedule::ByPoints {
        return weight_grad_by_points(kernel, g, &grid, x, dy);
    }
    let planes = Planes::new(kernel, grid);
    let (c_in, c_out) = (g.c_in, g.c_out);
    let (ranges, parallelism) = g.plan();
    let per_image = grid.per_image();
    let partials: Vec<Vec<f32>> = ranges
        .par_iter()
        .map(|range| {
            let nb_max = grid.chunk(c_in.max(c_out), range.len());
            let mut v = Scratch::take(&COL_SCRATCH, POINTS * c_in * nb_max * per_image);
            let mut e = Scratch::take(&WIDE_SCRATCH, POINTS * c_out * nb_max * per_image);
            let mut padded = planes.padded();
            // [16, Ci, Co]
            let mut sums = vec![0.0f32; POINTS * c_out * c_in];
            for (k, start) in range.clone().step_by(nb_max).enumerate() {
                let nb = nb_max.min(range.end - start);
                let t = nb * per_image;
                let v = &mut v[..POINTS * c_in * t];
                let e = &mut e[..POINTS * c_out * t];
                for b in 0..nb {
                    for c in 0..c_in {
                        let plane = &x[((start + b) * c_in + c) * grid.in_len()..][..grid.in_len()];
                        let v = &mut v[c * t + b * per_image..];
                        transform_input(&planes, &mut padded, plane, v, c_in * t);
                    }
                    for o in 0..c_out {
                        let plane =
                            &dy[((start + b) * c_out + o) * grid.out_len()..][..grid.out_len()];
                        let e = &mut e[o * t + b * per_image..];
                        transform_output_grad(&planes, plane, e, c_out * t);
                    }
                }
                for xi in 0..POINTS {
                    let dst = &mut sums[xi * c_out * c_in..][..c_out * c_in];
                    let e = &e[xi * c_out * t..][..c_out * t];
                    let v = &v[xi * c_in * t..][..c_in * t];
                    // SAFETY: e is [Co, t] and v [Ci, t] inside their slices; vᵀ reads v with
                    // swapped strides.
                    unsafe {
                        matmul(
                            [c_in, t, c_out],
                            dst,
                            k > 0,
                            rows(v, t),
                            transposed(e, t),
                            parallelism,
                        );
                    }
                }
            }
            sums
        })
        .collect();
    kernel_grads(&partials, c_in, c_out)
}

/// `dW` `[Co, Ci, 3, 3]` from per-task sums `[16, Ci, Co]`: added, then `Gᵀ m G` per kernel.
fn kernel_grads(
    partials: &[impl std::ops::Deref<Target = [f32]> + Sync],
    c_in: usize,
    c_out: usize,
) -> Vec<f32> {
    let plane = c_out * c_in;
    let mut dw = vec![0.0f32; plane * 9];
    // Blocks of BLOCK output channels: the partials are [16, Ci, Co], dW [Co, Ci, 3, 3], so a
    // block reads BLOCK consecutive values per point and input channel, and transforms BLOCK
    // kernels side by side.
    dw.par_chunks_mut(BLOCK * c_in * 9)
        .enumerate()
        .for_each(|(block, dst)| {
            let o0 = block * BLOCK;
            let width = dst.len() / (c_in * 9);
            for i in 0..c_in {
                let mut m = [[0.0f32; BLOCK]; POINTS];
                for (xi, m) in m.iter_mut().enumerate() {
                    for partial in partials {
                        let sums = &partial[xi * plane + i * c_out + o0..][..width];
                        for (m, v) in m.iter_mut().zip(sums) {
                            *m += v;
                        }
                    }
                }
                let z = kernel_grad_transform(&m);
                for o in 0..width {
                    for (k, z) in z.iter().enumerate() {
                        dst[(o * c_in + i) * 9 + k] = z[o];
                    }
                }
            }
        });
    dw
}

/// How a pass spreads over the threads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Schedule {
    /// Groups of images per thread, each through transforms, 16 GEMMs and back (large planes:
    /// a whole batch's transformed tiles would not fit [`MAX_ELEMS`]).
    ByImages,
    /// The whole batch at once, each phase in parallel: the transforms over channels, the 16
    /// GEMMs over points. Small planes: each GEMM gets every tile of the batch, and each
    /// transformed weight is read once, not once per group.
    ByPoints,
}

impl Schedule {
    fn of(g: &Geometry) -> Self {
        let tiles = g.batch * Grid::forward(g).per_image();
        if POINTS * tiles * g.c_in.max(g.c_out) <= MAX_ELEMS {
            Schedule::ByPoints
        } else {
            Schedule::ByImages
        }
    }
}

/// [`tiled_conv`] for [`Schedule::ByPoints`]: `V` laid out `[Ci, 16, tiles]` (written per
/// channel), `M` `[16, Co, tiles]` (written per point).
fn tiled_conv_by_points(
    kernel: Kernel,
    batch: usize,
    grid: &Grid,
    [c_in, c_out]: [usize; 2],
    x: &[f32],
    u: &TransformedWeight,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (in_len, out_len) = (grid.in_len(), grid.out_len());
    let planes = Planes::stacked(
        kernel,
        *grid,
        Stack {
            count: batch,
            stride: c_in * in_len,
        },
        Stack {
            count: batch,
            stride: out_len,
        },
    );
    let v = transformed_planes(&planes, batch, c_in, x, transform_input, &COL_SCRATCH);
    let (per_image, t) = (grid.per_image(), batch * grid.per_image());
    let tp = point_stride(t);
    let mut m = Scratch::take(&WIDE_SCRATCH, POINTS * c_out * t);
    m.par_chunks_mut(c_out * t).enumerate().for_each(|(xi, m)| {
        // SAFETY: u is [Co, Ci]; V[ξ] is [Ci, t] with rows 16·tp apart from ξ·tp, its last
        // element at (Ci − 1)·16·tp + ξ·tp + t − 1 < Ci·16·tp, inside v.
        unsafe {
            matmul(
                [c_out, c_in, t],
                m,
                false,
                u.point(xi),
                rows(&v[xi * tp..], POINTS * tp),
                Parallelism::None,
            );
        }
    });
    drop(v);
    let mut y = vec![0.0f32; batch * c_out * out_len];
    let bias_of = |o: usize| bias.map_or(0.0, |bias| bias[o]);
    if planes.stacked {
        // Each output channel's planes of the whole batch in one call, into [Co, N, pixels],
        // then to [N, Co, pixels].
        let mut by_channel = Scratch::take(&COL_SCRATCH, c_out * batch * out_len);
        by_channel
            .par_chunks_mut(batch * out_len)
            .enumerate()
            .for_each(|(o, planes_o)| {
                transform_output(&planes, &m[o * t..], c_out * t, planes_o, bias_of(o));
            });
        y.par_chunks_mut(c_out * out_len)
            .enumerate()
            .for_each(|(n, image)| {
                for (o, plane) in image.chunks_exact_mut(out_len).enumerate() {
                    plane.copy_from_slice(&by_channel[(o * batch + n) * out_len..][..out_len]);
                }
            });
    } else {
        y.par_chunks_mut(out_len)
            .enumerate()
            .for_each(|(plane_index, plane)| {
                let (n, o) = (plane_index / c_out, plane_index % c_out);
                let m = &m[o * t + n * per_image..];
                transform_output(&planes, m, c_out * t, plane, bias_of(o));
            });
    }
    y
}

/// The distance between a channel's points in [`transformed_planes`]: at least `tiles`, and
/// odd, so that the GEMMs' rows (16 of these apart) do not all fall in the same cache sets, as
/// they would 16·2ᵏ floats apart.
fn point_stride(tiles: usize) -> usize {
    tiles | 1
}

/// The transformed tiles of every plane of `images` (`[batch, channels, plane]`), laid out
/// `[channels, 16, point_stride(batch · tiles)]`, in parallel over channels.
fn transformed_planes(
    planes: &Planes,
    batch: usize,
    channels: usize,
    images: &[f32],
    transform: fn(&Planes, &mut [f32], &[f32], &mut [f32], usize),
    slot: &'static std::thread::LocalKey<Cell<Vec<f32>>>,
) -> Scratch {
    let per_image = planes.grid.per_image();
    let t = batch * per_image;
    let plane_len = images.len() / (batch * channels).max(1);
    let tp = point_stride(t);
    let mut v = Scratch::take(slot, channels * POINTS * tp);
    v.par_chunks_mut(POINTS * tp).enumerate().for_each_init(
        || planes.padded(),
        |padded, (c, v)| {
            if planes.stacked {
                // The channel's planes of every image, `channels` planes apart.
                transform(planes, padded, &images[c * plane_len..], v, tp);
                return;
            }
            for n in 0..batch {
                let plane = &images[(n * channels + c) * plane_len..][..plane_len];
                transform(planes, padded, plane, &mut v[n * per_image..], tp);
            }
        },
    );
    v
}

/// [`weight_grad`] for [`Schedule::ByPoints`]: one GEMM per point over every tile of the batch,
/// `S[ξ] = V[ξ] · E[ξ]ᵀ`, no partial sums.
fn weight_grad_by_points(
    kernel: Kernel,
    g: &Geometry,
    grid: &Grid,
    x: &[f32],
    dy: &[f32],
) -> Vec<f32> {
    let (c_in, c_out) = (g.c_in, g.c_out);
    let planes = Planes::stacked(
        kernel,
        *grid,
        Stack {
            count: g.batch,
            stride: c_in * grid.in_len(),
        },
        Stack {
            count: g.batch,
            stride: c_out * grid.out_len(),
        },
    );
    let t = g.batch * grid.per_image();
    let tp = point_stride(t);
    let v = transformed_planes(&planes, g.batch, c_in, x, transform_input, &COL_SCRATCH);
    let e = transformed_planes(
        &planes,
        g.batch,
        c_out,
        dy,
        |planes, _, plane, e, stride| transform_output_grad(planes, plane, e, stride),
        &WIDE_SCRATCH,
    );
    let mut sums = vec![0.0f32; POINTS * c_in * c_out];
    sums.par_chunks_mut(c_in * c_out)
        .enumerate()
        .for_each(|(xi, s)| {
            // SAFETY: V[ξ] is [Ci, t] and E[ξ] [Co, t], rows 16·tp apart from ξ·tp (inside v
            // and e as in tiled_conv_by_points); E[ξ]ᵀ reads E[ξ] with swapped strides.
            unsafe {
                matmul(
                    [c_in, t, c_out],
                    s,
                    false,
                    rows(&v[xi * tp..], POINTS * tp),
                    transposed(&e[xi * tp..], POINTS * tp),
                    Parallelism::None,
                );
            }
        });
    kernel_grads(&[sums], c_in, c_out)
}

/// The tiles of one plane: a `[height, width]` input read with `pad` zeros around it, and the
/// `out` pixels of the output cut into `tiles` 2×2 tiles, row by row.
#[derive(Debug, Clone, Copy)]
struct Grid {
    height: usize,
    width: usize,
    pad: [usize; 2],
    out: [usize; 2],
    tiles: [usize; 2],
}

impl Grid {
    fn new(input: [usize; 2], pad: [usize; 2], out: [usize; 2]) -> Self {
        Self {
            height: input[0],
            width: input[1],
            pad,
            out,
            tiles: [out[0].div_ceil(2), out[1].div_ceil(2)],
        }
    }

    /// The forward conv's grid: `x` in, `y` out.
    fn forward(g: &Geometry) -> Self {
        Self::new([g.height, g.width], g.padding, g.out)
    }

    /// The input gradient's grid: `dy` in, padded by `2 − p`, `dx` out.
    fn input_grad(g: &Geometry) -> Self {
        Self::new(g.out, g.padding.map(|p| 2 - p), [g.height, g.width])
    }

    fn per_image(&self) -> usize {
        self.tiles[0] * self.tiles[1]
    }

    fn in_len(&self) -> usize {
        self.height * self.width
    }

    fn out_len(&self) -> usize {
        self.out[0] * self.out[1]
    }

    /// Images per chunk: enough tiles for the GEMMs, the transformed tiles of `channels` within
    /// the memory bound, at most the group's images.
    fn chunk(&self, channels: usize, group_len: usize) -> usize {
        let per_image = self.per_image().max(1);
        let wide = TARGET_TILES.div_ceil(per_image);
        let fits = (MAX_ELEMS / (POINTS * channels * per_image).max(1)).max(1);
        wide.min(fits).clamp(1, group_len.max(1))
    }
}

/// A conv whose output is cut into [`Grid`]'s tiles: `y[n]`'s `c_out` planes from `x[n]`'s
/// `c_in` planes through the transformed weights `u`, `[16, c_out, c_in]`.
fn tiled_conv(
    kernel: Kernel,
    g: &Geometry,
    grid: &Grid,
    [c_in, c_out]: [usize; 2],
    x: &[f32],
    u: &TransformedWeight,
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let (ranges, parallelism) = g.plan();
    let per_image = grid.per_image();
    let (in_len, out_len) = (grid.in_len(), grid.out_len());
    let planes = Planes::new(kernel, *grid);
    let mut y = vec![0.0f32; g.batch * c_out * out_len];
    let mut outputs = split_by_ranges(&mut y, &ranges, c_out * out_len);
    outputs
        .par_iter_mut()
        .zip(ranges.par_iter())
        .for_each(|(y, range)| {
            let nb_max = grid.chunk(c_in.max(c_out), range.len());
            let mut v = Scratch::take(&COL_SCRATCH, POINTS * c_in * nb_max * per_image);
            let mut m = Scratch::take(&WIDE_SCRATCH, POINTS * c_out * nb_max * per_image);
            let mut padded = planes.padded();
            for start in range.clone().step_by(nb_max) {
                let nb = nb_max.min(range.end - start);
                let t = nb * per_image;
                let v = &mut v[..POINTS * c_in * t];
                let m = &mut m[..POINTS * c_out * t];
                for b in 0..nb {
                    for c in 0..c_in {
                        let plane = &x[((start + b) * c_in + c) * in_len..][..in_len];
                        let v = &mut v[c * t + b * per_image..];
                        transform_input(&planes, &mut padded, plane, v, c_in * t);
                    }
                }
                for xi in 0..POINTS {
                    let v = &v[xi * c_in * t..][..c_in * t];
                    // SAFETY: u is [Co, Ci] and v [Ci, t], inside their slices.
                    unsafe {
                        matmul(
                            [c_out, c_in, t],
                            &mut m[xi * c_out * t..][..c_out * t],
                            false,
                            u.point(xi),
                            rows(v, t),
                            parallelism,
                        );
                    }
                }
                for b in 0..nb {
                    for o in 0..c_out {
                        let plane =
                            &mut y[((start - range.start + b) * c_out + o) * out_len..][..out_len];
                        let bias = bias.map_or(0.0, |bias| bias[o]);
                        let m = &m[o * t + b * per_image..];
                        transform_output(&planes, m, c_out * t, plane, bias);
                    }
                }
            }
        });
    y
}

/// Which matrices [`TransformedWeight::point`] gives.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// `U[ξ][o][i]` from `g[o][i]`.
    Forward,
    /// `U[ξ][i][o]` from `g[o][i]` rotated by 180°.
    InputGrad,
}

thread_local! {
    static WEIGHT_SCRATCH: Cell<Vec<f32>> = const { Cell::new(Vec::new()) };
}

/// The transformed weights `U = G g Gᵀ`: 16 matrices `[Co, Ci]`, stored row by row with a
/// row's 16 points side by side, so that one pass over the kernels, in order, writes them, each
/// row in parallel. The input gradient's matrices (see [`Pass`]) are views of the same values.
struct TransformedWeight {
    data: Scratch,
    c_in: usize,
    row_stride: usize,
    pass: Pass,
}

impl TransformedWeight {
    /// `[Co, Ci, 3, 3]` weights transformed for `pass`.
    fn new(weight: &[f32], c_out: usize, c_in: usize, pass: Pass) -> Self {
        // One cache line more than the 16 points: rows 16·2ᵏ floats apart would share cache
        // sets when gemm packs them.
        let row_stride = POINTS * c_in + 16;
        let mut data = Scratch::take(&WEIGHT_SCRATCH, c_out * row_stride);
        data.par_chunks_mut(row_stride)
            .enumerate()
            .for_each(|(o, row)| {
                for i in 0..c_in {
                    let k = &weight[(o * c_in + i) * 9..][..9];
                    let points = kernel_transform(std::array::from_fn(|a| {
                        [k[a * 3], k[a * 3 + 1], k[a * 3 + 2]]
                    }));
                    for (xi, value) in points.into_iter().enumerate() {
                        row[xi * c_in + i] = value;
                    }
                }
            });
        Self {
            data,
            c_in,
            row_stride,
            pass,
        }
    }

    /// `U[ξ]` for the GEMMs: `[Co, Ci]` for the forward pass; for the input gradient `[Ci, Co]`,
    /// the rotated kernels' point ξ. Rotating a kernel reverses its rows and columns, and
    /// `G J = Q G` (`J` reverses 3 values, `Q` swaps rows 0 and 3 of `G`), so its transform is
    /// `Q U Qᵀ`: point `(a, b)` is `U`'s point `(q(a), q(b))`, `q = [3, 1, 2, 0]`, read
    /// transposed.
    fn point(&self, xi: usize) -> Mat<*const f32> {
        match self.pass {
            Pass::Forward => rows(&self.data[xi * self.c_in..], self.row_stride),
            Pass::InputGrad => {
                const Q: [usize; 4] = [3, 1, 2, 0];
                let source = Q[xi / 4] * 4 + Q[xi % 4];
                transposed(&self.data[source * self.c_in..], self.row_stride)
            }
        }
    }
}

/// `G v` for `G = [[1, 0, 0], [½, ½, ½], [½, −½, ½], [0, 0, 1]]`.
fn by_g(v: [f32; 3]) -> [f32; 4] {
    [
        v[0],
        0.5 * (v[0] + v[1] + v[2]),
        0.5 * (v[0] - v[1] + v[2]),
        v[2],
    ]
}

/// `G g Gᵀ` of one 3×3 kernel, row-major 4×4.
fn kernel_transform(g: [[f32; 3]; 3]) -> [f32; POINTS] {
    let columns: [[f32; 4]; 3] = std::array::from_fn(|b| by_g([g[0][b], g[1][b], g[2][b]]));
    let mut out = [0.0f32; POINTS];
    for a in 0..4 {
        out[a * 4..][..4].copy_from_slice(&by_g([columns[0][a], columns[1][a], columns[2][a]]));
    }
    out
}

/// Kernels [`kernel_grad_transform`] transforms side by side.
const BLOCK: usize = 16;

/// Values of [`BLOCK`] kernels, one per lane.
type Lanes = [f32; BLOCK];

/// `Gᵀ v` for the `G` of [`by_g`], lane by lane.
fn by_g_transposed(v: [Lanes; 4]) -> [Lanes; 3] {
    let mut out = [[0.0f32; BLOCK]; 3];
    for l in 0..BLOCK {
        let middle = 0.5 * (v[1][l] + v[2][l]);
        out[0][l] = v[0][l] + middle;
        out[1][l] = 0.5 * (v[1][l] - v[2][l]);
        out[2][l] = middle + v[3][l];
    }
    out
}

/// `Gᵀ m G` of [`BLOCK`] kernels' 16 summed points (row-major, each a lane): their gradients,
/// row-major 3×3.
fn kernel_grad_transform(m: &[Lanes; POINTS]) -> [Lanes; 9] {
    let rows_: [[Lanes; 3]; 4] = std::array::from_fn(|a| {
        by_g_transposed([m[a * 4], m[a * 4 + 1], m[a * 4 + 2], m[a * 4 + 3]])
    });
    let mut out = [[0.0f32; BLOCK]; 9];
    for b in 0..3 {
        let column = by_g_transposed([rows_[0][b], rows_[1][b], rows_[2][b], rows_[3][b]]);
        for (a, v) in column.into_iter().enumerate() {
            out[a * 3 + b] = v;
        }
    }
    out
}

#[cfg(test)]
mod tests;
