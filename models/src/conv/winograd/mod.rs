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

use std::ops::Range;

use rayon::prelude::*;

#[cfg(target_arch = "x86_64")]
mod avx512;
mod tiles;

use tiles::{Kernel, Planes, transform_input, transform_output, transform_output_grad};

use super::cpu::{
    COL_SCRATCH, Geometry, Scratch, WIDE_SCRATCH, matmul, rows, split_by_ranges, transposed,
};

/// Transformed points per tile: 4 × 4.
const POINTS: usize = 16;
/// Tiles per GEMM that keep the micro-kernels busy.
const TARGET_TILES: usize = 512;
/// Upper bound on one chunk's transformed input or output, in `f32`s (16 MiB), per task.
const MAX_ELEMS: usize = 4 << 20;
/// Below this many input or output channels the transforms cost more than the saved products.
const MIN_CHANNELS: usize = 16;
/// Below this many tiles per parallel task the transformed weights (16 · Co · Ci values, 1.8×
/// the kernel's) are read for too few tiles: the GEMMs wait on memory, and im2col wins
/// (ResNet-50's 7×7-pixel stage at batch 8, ResNet-18's 4×4 stage at 32 px).
const MIN_TASK_TILES: usize = 128;

/// Whether [`forward`], [`input_grad`] and [`weight_grad`] take the conv: 3×3, stride 1, no
/// dilation, padding at most 2, an output of at least 2×2 pixels, and enough channels and tiles
/// to gain.
pub(super) fn applies(g: &Geometry) -> bool {
    let shape = g.kernel == [3, 3]
        && g.stride == [1, 1]
        && g.dilation == [1, 1]
        && g.padding.iter().all(|&p| p <= 2)
        && g.out.iter().all(|&o| o >= 2);
    // One tile at a time the transforms cost more than the products they save.
    if !shape || g.c_in < MIN_CHANNELS || g.c_out < MIN_CHANNELS || Kernel::best() == Kernel::Scalar
    {
        return false;
    }
    let (ranges, _) = g.plan();
    let images = ranges.iter().map(Range::len).min().unwrap_or(0);
    images * Grid::forward(g).per_image() >= MIN_TASK_TILES
}

/// Forward: `y = conv(x, weight) (+ bias)`.
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `weight`: `[Co, Ci, 3, 3]`, `bias`: `[Co]`
/// - returns `[N, Co, Ho, Wo]`
pub(super) fn forward(g: &Geometry, x: &[f32], weight: &[f32], bias: Option<&[f32]>) -> Vec<f32> {
    forward_with(Kernel::best(), g, x, weight, bias)
}

fn forward_with(
    kernel: Kernel,
    g: &Geometry,
    x: &[f32],
    weight: &[f32],
    bias: Option<&[f32]>,
) -> Vec<f32> {
    let u = transform_weight(weight, g.c_out, g.c_in, Pass::Forward);
    tiled_conv(kernel, g, &Grid::forward(g), [g.c_in, g.c_out], x, &u, bias)
}

/// Input gradient: the forward conv of `dy` with the rotated, transposed kernel.
///
/// # Shapes
/// - `weight`: `[Co, Ci, 3, 3]`, `dy`: `[N, Co, Ho, Wo]`
/// - returns `[N, Ci, H, W]`
pub(super) fn input_grad(g: &Geometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    input_grad_with(Kernel::best(), g, weight, dy)
}

fn input_grad_with(kernel: Kernel, g: &Geometry, weight: &[f32], dy: &[f32]) -> Vec<f32> {
    let u = transform_weight(weight, g.c_out, g.c_in, Pass::InputGrad);
    tiled_conv(
        kernel,
        g,
        &Grid::input_grad(g),
        [g.c_out, g.c_in],
        dy,
        &u,
        None,
    )
}

/// Weight gradient: per point, `Σ_tiles (A e Aᵀ)[ξ] (Bᵀ d B)[ξ]` as one GEMM over a chunk's
/// tiles, accumulated per parallel group; the groups' sums are added and transformed back.
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `dy`: `[N, Co, Ho, Wo]`
/// - returns `[Co, Ci, 3, 3]`
pub(super) fn weight_grad(g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    weight_grad_with(Kernel::best(), g, x, dy)
}

fn weight_grad_with(kernel: Kernel, g: &Geometry, x: &[f32], dy: &[f32]) -> Vec<f32> {
    let grid = Grid::forward(g);
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
            // [16, Co, Ci]
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
    let plane = c_out * c_in;
    let mut dw = vec![0.0f32; plane * 9];
    // Blocks of 16 output channels: the partials are [16, Ci, Co], dW [Co, Ci, 3, 3], so a
    // block reads 16 consecutive values per point and input channel.
    const BLOCK: usize = 16;
    dw.par_chunks_mut(BLOCK * c_in * 9)
        .enumerate()
        .for_each(|(block, dst)| {
            let o0 = block * BLOCK;
            let width = dst.len() / (c_in * 9);
            for i in 0..c_in {
                let mut m = [[0.0f32; POINTS]; BLOCK];
                for xi in 0..POINTS {
                    for partial in &partials {
                        let sums = &partial[xi * plane + i * c_out + o0..][..width];
                        for (m, v) in m.iter_mut().zip(sums) {
                            m[xi] += v;
                        }
                    }
                }
                for (o, m) in m[..width].iter().enumerate() {
                    dst[(o * c_in + i) * 9..][..9].copy_from_slice(&kernel_grad_transform(m));
                }
            }
        });
    dw
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
    u: &[f32],
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
                    let u = &u[xi * c_out * c_in..][..c_out * c_in];
                    let v = &v[xi * c_in * t..][..c_in * t];
                    // SAFETY: u is [Co, Ci] and v [Ci, t], inside their slices.
                    unsafe {
                        matmul(
                            [c_out, c_in, t],
                            &mut m[xi * c_out * t..][..c_out * t],
                            false,
                            rows(u, c_in),
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

/// Which kernel [`transform_weight`] transforms.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Pass {
    /// `U[ξ][o][i]` from `g[o][i]`.
    Forward,
    /// `U[ξ][i][o]` from `g[o][i]` rotated by 180°.
    InputGrad,
}

/// `[Co, Ci, 3, 3]` weights to `U = G g Gᵀ`, `[16, rows, cols]` (see [`Pass`]).
fn transform_weight(weight: &[f32], c_out: usize, c_in: usize, pass: Pass) -> Vec<f32> {
    let (n_rows, n_cols) = match pass {
        Pass::Forward => (c_out, c_in),
        Pass::InputGrad => (c_in, c_out),
    };
    let plane = n_rows * n_cols;
    // Each kernel's 16 points together, then spread over the 16 planes: two parallel passes.
    let mut points = vec![[0.0f32; POINTS]; plane];
    points
        .par_chunks_mut(n_cols)
        .enumerate()
        .for_each(|(r, row)| {
            for (c, dst) in row.iter_mut().enumerate() {
                let (o, i) = match pass {
                    Pass::Forward => (r, c),
                    Pass::InputGrad => (c, r),
                };
                let k = &weight[(o * c_in + i) * 9..][..9];
                let tap = |a: usize, b: usize| match pass {
                    Pass::Forward => k[a * 3 + b],
                    Pass::InputGrad => k[(2 - a) * 3 + (2 - b)],
                };
                *dst =
                    kernel_transform(std::array::from_fn(|a| std::array::from_fn(|b| tap(a, b))));
            }
        });
    let mut u = vec![0.0f32; POINTS * plane];
    u.par_chunks_mut(plane).enumerate().for_each(|(xi, dst)| {
        dst.iter_mut().zip(&points).for_each(|(d, p)| *d = p[xi]);
    });
    u
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

/// `Gᵀ v` for the `G` of [`by_g`].
fn by_g_transposed(v: [f32; 4]) -> [f32; 3] {
    let middle = 0.5 * (v[1] + v[2]);
    [v[0] + middle, 0.5 * (v[1] - v[2]), middle + v[3]]
}

/// `Gᵀ m G` of one tile's 16 summed points: a 3×3 kernel's gradient, row-major.
fn kernel_grad_transform(m: &[f32; POINTS]) -> [f32; 9] {
    let rows_: [[f32; 3]; 4] = std::array::from_fn(|a| {
        by_g_transposed([m[a * 4], m[a * 4 + 1], m[a * 4 + 2], m[a * 4 + 3]])
    });
    let mut out = [0.0f32; 9];
    for b in 0..3 {
        let column = by_g_transposed([rows_[0][b], rows_[1][b], rows_[2][b], rows_[3][b]]);
        for (a, v) in column.into_iter().enumerate() {
            out[a * 3 + b] = v;
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A direct convolution, the definition written out: the reference for every pass.
    fn direct(g: &Geometry, x: &[f32], w: &[f32]) -> Vec<f32> {
        let [oh, ow] = g.out;
        let mut y = vec![0.0f32; g.batch * g.c_out * oh * ow];
        for n in 0..g.batch {
            for o in 0..g.c_out {
                for r in 0..oh {
                    for c in 0..ow {
                        let mut sum = 0.0f64;
                        for i in 0..g.c_in {
                            for a in 0..3 {
                                for b in 0..3 {
                                    let (xr, xc) = (r + a, c + b);
                                    let (Some(xr), Some(xc)) = (
                                        xr.checked_sub(g.padding[0]),
                                        xc.checked_sub(g.padding[1]),
                                    ) else {
                                        continue;
                                    };
                                    if xr >= g.height || xc >= g.width {
                                        continue;
                                    }
                                    let xv = x[((n * g.c_in + i) * g.height + xr) * g.width + xc];
                                    sum += f64::from(xv * w[((o * g.c_in + i) * 3 + a) * 3 + b]);
                                }
                            }
                        }
                        y[((n * g.c_out + o) * oh + r) * ow + c] = sum as f32;
                    }
                }
            }
        }
        y
    }

    /// `Σ y · dy` of the direct conv, differentiated one variable at a time through linearity:
    /// dx[j] = Σ_y dy · ∂y/∂x[j], obtained by convolving unit inputs.
    fn direct_grads(g: &Geometry, x: &[f32], w: &[f32], dy: &[f32]) -> (Vec<f32>, Vec<f32>) {
        let dot = |y: &[f32]| y.iter().zip(dy).map(|(a, b)| f64::from(a * b)).sum::<f64>() as f32;
        let mut unit = vec![0.0f32; x.len()];
        let dx = (0..x.len())
            .map(|j| {
                unit[j] = 1.0;
                let v = dot(&direct(g, &unit, w));
                unit[j] = 0.0;
                v
            })
            .collect();
        let mut unit = vec![0.0f32; w.len()];
        let dw = (0..w.len())
            .map(|j| {
                unit[j] = 1.0;
                let v = dot(&direct(g, x, &unit));
                unit[j] = 0.0;
                v
            })
            .collect();
        (dx, dw)
    }

    /// Deterministic values in [−1, 1).
    fn values(len: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        (0..len)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
            })
            .collect()
    }

    fn assert_close(what: &str, g: &Geometry, got: &[f32], want: &[f32]) {
        assert_eq!(got.len(), want.len(), "{what} of {g:?}: lengths differ");
        let scale = want.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        for (i, (a, b)) in got.iter().zip(want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "{what} of {g:?}: element {i} is {a}, the direct conv says {b} (scale {scale})"
            );
        }
    }

    #[test]
    fn all_three_passes_match_the_direct_conv() {
        // Odd and even sizes (tiles cut by the edge), each padding, channels in and out unequal,
        // and a batch of 400 small images split into several chunks of TARGET_TILES.
        let cases = [
            ([2, 3, 7, 9], 4, [1, 1]),
            ([1, 2, 6, 6], 3, [0, 0]),
            ([3, 4, 5, 4], 2, [2, 2]),
            ([2, 3, 2, 3], 2, [1, 0]),
            ([400, 1, 4, 5], 2, [1, 1]),
        ];
        for ([batch, c_in, height, width], c_out, padding) in cases {
            let g = Geometry::new(
                [batch, c_in, height, width],
                [c_out, c_in, 3, 3],
                [1, 1],
                padding,
                [1, 1],
            )
            .expect("a valid conv");
            let x = values(batch * c_in * height * width, 1);
            let w = values(c_out * c_in * 9, 2);
            let bias = values(c_out, 3);
            let dy = values(batch * c_out * g.pixels(), 4);
            let mut want = direct(&g, &x, &w);
            for (plane, b) in want.chunks_mut(g.pixels()).zip(bias.iter().cycle()) {
                plane.iter_mut().for_each(|v| *v += b);
            }
            assert_close("forward", &g, &forward(&g, &x, &w, Some(&bias)), &want);
            if batch > 3 {
                continue; // The unit-vector gradients below are quadratic in the sizes.
            }
            let (dx, dw) = direct_grads(&g, &x, &w, &dy);
            assert_close("input gradient", &g, &input_grad(&g, &w, &dy), &dx);
            assert_close("weight gradient", &g, &weight_grad(&g, &x, &dy), &dw);
        }
    }

    /// The AVX-512 transforms against the scalar reference, to the bit: by gathers (narrow
    /// planes) and by rows (from ROW_TILES tiles per row on), every padding, odd sizes, and a
    /// row of tiles that ends inside a group of 16.
    #[test]
    #[cfg(target_arch = "x86_64")]
    fn the_vector_transforms_match_the_scalar_ones() {
        if Kernel::best() != Kernel::Avx512 {
            eprintln!("skipped: this CPU has no AVX-512F");
            return;
        }
        let cases = [
            ([2, 3, 7, 9], 4, [1, 1]),
            ([1, 2, 20, 37], 3, [1, 1]),
            ([2, 2, 17, 40], 2, [0, 0]),
            ([1, 3, 16, 33], 2, [2, 2]),
            ([3, 2, 9, 16], 3, [1, 0]),
            ([1, 2, 34, 66], 2, [0, 1]),
        ];
        for ([batch, c_in, height, width], c_out, padding) in cases {
            let g = Geometry::new(
                [batch, c_in, height, width],
                [c_out, c_in, 3, 3],
                [1, 1],
                padding,
                [1, 1],
            )
            .expect("a valid conv");
            let x = values(batch * c_in * height * width, 5);
            let w = values(c_out * c_in * 9, 6);
            let bias = values(c_out, 7);
            let dy = values(batch * c_out * g.pixels(), 8);
            for (what, vector, scalar) in [
                (
                    "forward",
                    forward_with(Kernel::Avx512, &g, &x, &w, Some(&bias)),
                    forward_with(Kernel::Scalar, &g, &x, &w, Some(&bias)),
                ),
                (
                    "input gradient",
                    input_grad_with(Kernel::Avx512, &g, &w, &dy),
                    input_grad_with(Kernel::Scalar, &g, &w, &dy),
                ),
                (
                    "weight gradient",
                    weight_grad_with(Kernel::Avx512, &g, &x, &dy),
                    weight_grad_with(Kernel::Scalar, &g, &x, &dy),
                ),
            ] {
                assert_eq!(vector.len(), scalar.len());
                if let Some(i) = (0..vector.len()).find(|&i| vector[i] != scalar[i]) {
                    panic!(
                        "{what} of {g:?}: element {i} is {} with AVX-512, {} without",
                        vector[i], scalar[i]
                    );
                }
            }
        }
    }

    #[test]
    fn resnet_shapes_take_it_and_others_do_not() {
        let geometry = |batch, c, size, kernel, stride| {
            Geometry::new(
                [batch, c, size, size],
                [c, c, kernel, kernel],
                [stride; 2],
                [kernel / 2; 2],
                [1, 1],
            )
            .expect("a valid conv")
        };
        let vectors = Kernel::best() != Kernel::Scalar;
        assert_eq!(applies(&geometry(8, 64, 56, 3, 1)), vectors);
        assert_eq!(applies(&geometry(1, 64, 28, 3, 1)), vectors);
        assert!(!applies(&geometry(1, 512, 7, 3, 1)), "16 tiles");
        assert!(!applies(&geometry(8, 64, 56, 3, 2)), "stride 2");
        assert!(!applies(&geometry(8, 64, 56, 1, 1)), "1×1");
        assert!(!applies(&geometry(8, 3, 56, 3, 1)), "3 channels");
        assert!(!applies(&geometry(32, 512, 1, 3, 1)), "a 1×1 output");
    }
}
