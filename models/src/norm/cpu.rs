//! BatchNorm on the CPU over contiguous NCHW `f32` slices: batch statistics, the normalisation as
//! one multiply-add per element, and the backward as one reduction pass plus one multiply-add pass.
//!
//! Burn's BatchNorm is a chain of broadcasting tensor ops (and their gradients), each a full pass
//! over the activations through a strided iterator; here every pass is a contiguous loop over one
//! `H·W` plane with per-channel constants. Reductions run in parallel over channels, element-wise
//! passes in parallel over planes. Sums accumulate in eight `f32` lanes per plane (vectorised) and
//! in `f64` across planes, so a 100 k-element channel loses no precision to the order.
//!
//! No `f32::mul_add` here: without the `fma` target feature (not in the x86-64 baseline) it is a
//! libm call per element.

use rayon::prelude::*;

use super::Then;

/// The layout of a batch: `[batch, channels, plane]` with `plane = H·W` contiguous.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Planes {
    pub batch: usize,
    pub channels: usize,
    pub plane: usize,
}

impl Planes {
    /// Elements per channel: the `M` the statistics divide by.
    fn per_channel(&self) -> usize {
        self.batch * self.plane
    }

    /// Plane `i` of `data` in batch-then-channel order.
    fn plane_at<'a>(&self, data: &'a [f32], i: usize) -> &'a [f32] {
        &data[i * self.plane..][..self.plane]
    }

    fn plane_of<'a>(&self, data: &'a [f32], n: usize, c: usize) -> &'a [f32] {
        self.plane_at(data, n * self.channels + c)
    }

    /// Planes per parallel task: enough elements that rayon's overhead stays small.
    fn min_planes_per_task(&self) -> usize {
        (16 * 1024 / self.plane.max(1)).max(1)
    }
}

const LANES: usize = 8;

/// `Σ f(a[i], b[i])` in eight `f32` lanes, returned as `f64`.
fn lane_sum(a: &[f32], b: &[f32], f: impl Fn(f32, f32) -> f32) -> f64 {
    lane_sum3(a, b, b, |x, y, _| f(x, y))
}

/// `Σ f(a[i], b[i], c[i])` in eight `f32` lanes, returned as `f64`.
fn lane_sum3(a: &[f32], b: &[f32], c: &[f32], f: impl Fn(f32, f32, f32) -> f32) -> f64 {
    let mut acc = [0f32; LANES];
    let body = a.len() - a.len() % LANES;
    let (b, c) = (&b[..a.len()], &c[..a.len()]);
    let chunks = a[..body]
        .chunks_exact(LANES)
        .zip(b[..body].chunks_exact(LANES))
        .zip(c[..body].chunks_exact(LANES));
    for ((ca, cb), cc) in chunks {
        for l in 0..LANES {
            acc[l] += f(ca[l], cb[l], cc[l]);
        }
    }
    let tail: f32 = (a[body..].iter().zip(&b[body..]).zip(&c[body..]))
        .map(|((&x, &y), &z)| f(x, y, z))
        .sum();
    acc.iter().map(|&v| f64::from(v)).sum::<f64>() + f64::from(tail)
}

/// The gradient that passes a ReLU whose output was `y` (Burn's rule: where `y > 0`).
#[inline(always)]
fn through_relu(y: f32, dy: f32) -> f32 {
    if y > 0.0 { dy } else { 0.0 }
}

/// Per-channel mean and biased variance (Burn's, and what normalises a batch in training).
pub(crate) fn batch_stats(p: &Planes, x: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let m = p.per_channel() as f64;
    (0..p.channels)
        .into_par_iter()
        .map(|c| {
            let sum: f64 = (0..p.batch)
                .map(|n| {
                    let plane = p.plane_of(x, n, c);
                    lane_sum(plane, plane, |v, _| v)
                })
                .sum();
            let mean = (sum / m) as f32;
            let squares: f64 = (0..p.batch)
                .map(|n| {
                    let plane = p.plane_of(x, n, c);
                    lane_sum(plane, plane, |v, _| (v - mean) * (v - mean))
                })
                .sum();
            (mean, (squares / m) as f32)
        })
        .unzip()
}

/// `y = x · scale[c] + shift[c]`.
pub(crate) fn scale_shift(p: &Planes, x: &[f32], scale: &[f32], shift: &[f32]) -> Vec<f32> {
    planes_into_new(x.len(), p, |i| {
        let (a, b) = (scale[i % p.channels], shift[i % p.channels]);
        p.plane_at(x, i).iter().map(move |&x| x * a + b)
    })
}

/// `y = max(x · scale[c] + shift[c] (+ residual), 0)`: the normalisation, a residual sum and the
/// ReLU after it in one pass (each a pass over the activations of its own otherwise, on one
/// thread in Flex). The same arithmetic, in the same order, as the three ops.
pub(crate) fn scale_shift_relu(
    p: &Planes,
    x: &[f32],
    scale: &[f32],
    shift: &[f32],
    residual: Option<&[f32]>,
) -> Vec<f32> {
    match residual {
        None => planes_into_new(x.len(), p, |i| {
            let (a, b) = (scale[i % p.channels], shift[i % p.channels]);
            p.plane_at(x, i).iter().map(move |&x| (x * a + b).max(0.0))
        }),
        Some(r) => {
            assert_eq!(r.len(), x.len(), "BatchNorm: residual size");
            planes_into_new(x.len(), p, |i| {
                let (a, b) = (scale[i % p.channels], shift[i % p.channels]);
                (p.plane_at(x, i).iter())
                    .zip(p.plane_at(r, i))
                    .map(move |(&x, &r)| (x * a + b + r).max(0.0))
            })
        }
    }
}

/// A new `len`-element buffer whose plane `i` (of `p.plane` elements) holds the values
/// `plane(i)` yields, planes in parallel. The buffer is not zeroed first: a pass over every
/// output that is then overwritten was 1-2% of a step.
///
/// # Panics
/// If `len` is not whole planes, or `plane(i)` yields fewer than `p.plane` values.
fn planes_into_new<I: Iterator<Item = f32>>(
    len: usize,
    p: &Planes,
    plane: impl Fn(usize) -> I + Sync,
) -> Vec<f32> {
    assert_eq!(len % p.plane, 0, "BatchNorm: not whole planes");
    let mut out = Vec::with_capacity(len);
    out.spare_capacity_mut()[..len]
        .par_chunks_mut(p.plane)
        .enumerate()
        .with_min_len(p.min_planes_per_task())
        .for_each(|(i, out)| {
            let mut written = 0;
            for (o, v) in out.iter_mut().zip(plane(i)) {
                o.write(v);
                written += 1;
            }
            assert_eq!(written, out.len(), "BatchNorm: plane {i} short");
        });
    // SAFETY: the chunks cover the first `len` elements and each was written whole (asserted;
    // a panic above leaves the length 0).
    unsafe { out.set_len(len) };
    out
}

/// [`planes_into_new`] for two buffers filled in the same pass from pairs of values.
fn plane_pairs_into_new<I: Iterator<Item = (f32, f32)>>(
    len: usize,
    p: &Planes,
    plane: impl Fn(usize) -> I + Sync,
) -> (Vec<f32>, Vec<f32>) {
    assert_eq!(len % p.plane, 0, "BatchNorm: not whole planes");
    let (mut first, mut second) = (Vec::with_capacity(len), Vec::with_capacity(len));
    (first.spare_capacity_mut()[..len].par_chunks_mut(p.plane))
        .zip(second.spare_capacity_mut()[..len].par_chunks_mut(p.plane))
        .enumerate()
        .with_min_len(p.min_planes_per_task())
        .for_each(|(i, (a, b))| {
            let mut written = 0;
            for ((a, b), (u, v)) in a.iter_mut().zip(b.iter_mut()).zip(plane(i)) {
                a.write(u);
                b.write(v);
                written += 1;
            }
            assert_eq!(written, a.len(), "BatchNorm: plane {i} short");
        });
    // SAFETY: as in `planes_into_new`, for both buffers.
    unsafe {
        first.set_len(len);
        second.set_len(len);
    }
    (first, second)
}

/// `1 / √(var + ε)` per channel, in `f64`.
fn inv_std(var: &[f32], epsilon: f64) -> Vec<f64> {
    var.iter()
        .map(|&v| 1.0 / (f64::from(v) + epsilon).sqrt())
        .collect()
}

/// The per-channel `(scale, shift)` that normalise with `mean`/`var` then apply `gamma`/`beta`.
pub(crate) fn affine(
    mean: &[f32],
    var: &[f32],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f64,
) -> (Vec<f32>, Vec<f32>) {
    inv_std(var, epsilon)
        .into_iter()
        .enumerate()
        .map(|(c, r)| {
            let scale = f64::from(gamma[c]) * r;
            let shift = f64::from(beta[c]) - f64::from(mean[c]) * scale;
            (scale as f32, shift as f32)
        })
        .unzip()
}

/// Training forward: `(y, mean, biased var)`.
pub(crate) fn train_forward(
    p: &Planes,
    x: &[f32],
    gamma: &[f32],
    beta: &[f32],
    epsilon: f64,
    then: Then<&[f32]>,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let (mean, var) = batch_stats(p, x);
    let (scale, shift) = affine(&mean, &var, gamma, beta, epsilon);
    let y = match then {
        Then::Nothing => scale_shift(p, x, &scale, &shift),
        Then::Relu { residual } => scale_shift_relu(p, x, &scale, &shift, residual),
    };
    (y, mean, var)
}

/// Gradients of a training forward: `(dx, dgamma, dbeta)`, with `x̂ = (x − mean)·r`,
/// `r = 1/√(var + ε)` and `M` elements per channel:
/// - `dbeta = Σ dy`, `dgamma = Σ dy·x̂`
/// - `dx = gamma·r·(dy − dbeta/M − x̂·dgamma/M)`, one multiply-add per element:
///   `dx = k1·dy + k2·(x − mean) + k3`.
///
/// With `relu`, the forward ended in a ReLU: `dy` is masked where its output was not positive,
/// inside both passes (no masked copy of `dy` is made), and the masked `dy`, the residual's
/// gradient, is returned too when asked, written in the same pass as `dx`.
#[allow(clippy::too_many_arguments)]
pub(crate) fn backward(
    p: &Planes,
    x: &[f32],
    dy: &[f32],
    relu: Option<Relu<'_>>,
    gamma: &[f32],
    mean: &[f32],
    var: &[f32],
    epsilon: f64,
) -> Grads {
    match relu {
        Some(relu) => {
            assert_eq!(relu.output.len(), dy.len(), "BatchNorm: ReLU output size");
            let masked = relu.residual_grad;
            backward_masked::<true>(p, x, dy, relu.output, masked, gamma, mean, var, epsilon)
        }
        // `y` is then `dy` itself, and unread: `RELU` is a constant the loops are compiled for.
        None => backward_masked::<false>(p, x, dy, dy, false, gamma, mean, var, epsilon),
    }
}

/// The ReLU a training forward ended in, as its backward needs it.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Relu<'a> {
    /// What the ReLU returned.
    pub output: &'a [f32],
    /// Whether to return the gradient at its input (the residual's, where one was added).
    pub residual_grad: bool,
}

/// [`backward`]'s gradients.
#[derive(Debug)]
pub(crate) struct Grads {
    pub x: Vec<f32>,
    pub gamma: Vec<f32>,
    pub beta: Vec<f32>,
    /// The output gradient through the ReLU, when asked.
    pub residual: Option<Vec<f32>>,
}

#[allow(clippy::too_many_arguments)]
fn backward_masked<const RELU: bool>(
    p: &Planes,
    x: &[f32],
    dy: &[f32],
    y: &[f32],
    masked_dy: bool,
    gamma: &[f32],
    mean: &[f32],
    var: &[f32],
    epsilon: f64,
) -> Grads {
    let grad = |y: f32, d: f32| if RELU { through_relu(y, d) } else { d };
    let r = inv_std(var, epsilon);
    let (sum_dy, sum_dy_centred): (Vec<f64>, Vec<f64>) = (0..p.channels)
        .into_par_iter()
        .map(|c| {
            let mu = mean[c];
            (0..p.batch).fold((0f64, 0f64), |(s, t), n| {
                let (xp, dp, yp) = (
                    p.plane_of(x, n, c),
                    p.plane_of(dy, n, c),
                    p.plane_of(y, n, c),
                );
                (
                    s + lane_sum(dp, yp, |d, y| grad(y, d)),
                    t + lane_sum3(xp, dp, yp, |x, d, y| (x - mu) * grad(y, d)),
                )
            })
        })
        .unzip();
    let m = p.per_channel() as f64;
    let mut dgamma = Vec::with_capacity(p.channels);
    let mut dbeta = Vec::with_capacity(p.channels);
    let mut k = Vec::with_capacity(p.channels);
    for c in 0..p.channels {
        let (g, r) = (f64::from(gamma[c]), r[c]);
        let dg = sum_dy_centred[c] * r;
        dgamma.push(dg as f32);
        dbeta.push(sum_dy[c] as f32);
        let k1 = g * r;
        let k2 = -g * r * r * dg / m;
        let k3 = -g * r * sum_dy[c] / m;
        // x enters as x·k2 − mean·k2, folded into the constant.
        k.push((k1 as f32, k2 as f32, (k3 - k2 * f64::from(mean[c])) as f32));
    }
    let plane = |i: usize| {
        let (k1, k2, k0) = k[i % p.channels];
        (p.plane_at(x, i).iter())
            .zip(p.plane_at(dy, i))
            .zip(p.plane_at(y, i))
            .map(move |((&x, &dy), &y)| {
                let d = grad(y, dy);
                (d * k1 + x * k2 + k0, d)
            })
    };
    let (dx, residual) = if masked_dy {
        let (dx, masked) = plane_pairs_into_new(x.len(), p, plane);
        (dx, Some(masked))
    } else {
        (
            planes_into_new(x.len(), p, |i| plane(i).map(|(dx, _)| dx)),
            None,
        )
    };
    Grads {
        x: dx,
        gamma: dgamma,
        beta: dbeta,
        residual,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Direct `f64` BatchNorm for a handful of values: the textbook formulas, no folding.
    fn naive(
        p: &Planes,
        x: &[f32],
        dy: &[f32],
        gamma: &[f32],
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>) {
        let m = p.per_channel() as f64;
        let mut y = vec![0.0; x.len()];
        let mut dx = vec![0.0; x.len()];
        let mut dgamma = vec![0.0; p.channels];
        for c in 0..p.channels {
            let idx: Vec<usize> = (0..p.batch)
                .flat_map(|n| {
                    let s = (n * p.channels + c) * p.plane;
                    s..s + p.plane
                })
                .collect();
            let mean = idx.iter().map(|&i| f64::from(x[i])).sum::<f64>() / m;
            let var = idx
                .iter()
                .map(|&i| (f64::from(x[i]) - mean).powi(2))
                .sum::<f64>()
                / m;
            let r = 1.0 / (var + eps).sqrt();
            let g = f64::from(gamma[c]);
            let xhat = |i: usize| (f64::from(x[i]) - mean) * r;
            let db: f64 = idx.iter().map(|&i| f64::from(dy[i])).sum();
            let dg: f64 = idx.iter().map(|&i| f64::from(dy[i]) * xhat(i)).sum();
            dgamma[c] = dg;
            for &i in &idx {
                y[i] = xhat(i) * g;
                dx[i] = g * r * (f64::from(dy[i]) - db / m - xhat(i) * dg / m);
            }
        }
        (y, dx, dgamma)
    }

    #[test]
    fn kernels_match_the_textbook_formulas() {
        // Odd plane (3×5) and a tail shorter than a lane; a shifted mean tests the centring.
        let p = Planes {
            batch: 3,
            channels: 2,
            plane: 15,
        };
        let len = p.batch * p.channels * p.plane;
        let x: Vec<f32> = (0..len)
            .map(|i| 40.0 + ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let dy: Vec<f32> = (0..len)
            .map(|i| ((i * 53 % 89) as f32 - 44.0) / 13.0)
            .collect();
        let gamma = [0.5f32, -1.5];
        let beta = [0.0f32, 0.0];
        let eps = 1e-5;
        let (y, mean, var) = train_forward(&p, &x, &gamma, &beta, eps, Then::Nothing);
        let Grads {
            x: dx,
            gamma: dgamma,
            beta: dbeta,
            ..
        } = backward(&p, &x, &dy, None, &gamma, &mean, &var, eps);
        let (y_ref, dx_ref, dgamma_ref) = naive(&p, &x, &dy, &gamma, eps);
        let close = |a: f32, b: f64, what: &str| {
            assert!(
                (f64::from(a) - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{what}: {a} vs {b}"
            );
        };
        for i in 0..len {
            close(y[i], y_ref[i], "y");
            close(dx[i], dx_ref[i], "dx");
        }
        for c in 0..p.channels {
            close(dgamma[c], dgamma_ref[c], "dgamma");
            let db: f64 = (0..p.batch)
                .flat_map(|n| p.plane_of(&dy, n, c).iter().map(|&v| f64::from(v)))
                .sum();
            close(dbeta[c], db, "dbeta");
        }
    }
}
