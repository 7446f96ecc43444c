//! Max pooling over `[N, C, H, W]` on the CPU: ResNet's stem pool (3×3, stride 2, on 112×112
//! planes at 224 px) without Flex's generic 3-D loop.
//!
//! Flex runs a 2-D max pool as a 3-D one, one output at a time, with a bounds check per tap and
//! an `i64` index per output: about 3% of a ResNet-50 step at 224 px. Here each output row is
//! filled tap by tap over whole rows (the border columns cut off once per tap, not checked per
//! element; compiled for AVX2 where the CPU has it, eight outputs per compare and blend), and
//! where each maximum came from is kept as a `u32` offset in its plane, in our autodiff node's
//! state, instead of an index tensor beside a checkpoint of the input: 0.6% of the step.
//!
//! Values and gradients are Burn's to the bit: the taps are visited in Burn's order, and the first
//! of equal maxima wins as in `max_pool2d_with_indices` (a NaN is kept only when it is the first
//! tap, as there); the gradient is summed into each input in the same output order.

use std::sync::Arc;

use burn::backend::Autodiff;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::NoCheckpointing;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::nn::PaddingConfig2d;
use burn::nn::pool::MaxPool2d;
use burn::tensor::backend::Backend;
use burn::tensor::{DType, Tensor};
use burn_flex::Flex;
use rayon::prelude::*;

use crate::conv::window_positions;
use crate::primitive::{contiguous, flex_f32, float, primitive, values};
use crate::switch::cast;

/// An output whose window held no input element (only padding): it is `-∞` and gets no gradient.
const NO_INPUT: u32 = u32::MAX;

/// `burn::nn::pool::MaxPool2d::forward`, through our kernels where `B` is Flex or `Autodiff` over
/// it and the pool is one they handle (f32, symmetric padding, `ceil_mode` off); Burn's op
/// otherwise.
pub fn max_pool2d<B: Backend>(pool: &MaxPool2d, x: Tensor<B, 4>) -> Tensor<B, 4> {
    let Some(g) = Window::of(pool).and_then(|w| Geometry::of(x.dims(), x.dtype(), w)) else {
        return pool.forward(x);
    };
    let x = match cast::<Tensor<B, 4>, Tensor<Flex, 4>>(x) {
        Ok(x) => return back(on_flex(x, g)),
        Err(x) => x,
    };
    match cast::<Tensor<B, 4>, Tensor<Autodiff<Flex>, 4>>(x) {
        Ok(x) => back(on_autodiff(x, g)),
        Err(x) => pool.forward(x),
    }
}

fn back<B: Backend, E: Backend>(y: Tensor<E, 4>) -> Tensor<B, 4> {
    cast(y).unwrap_or_else(|_| unreachable!("B is E"))
}

fn on_flex(x: Tensor<Flex, 4>, g: Geometry) -> Tensor<Flex, 4> {
    let x = contiguous(primitive(x));
    let (y, _) = forward(&g, values(&x), false);
    float(flex_f32(y, &g.output_shape()))
}

fn on_autodiff(x: Tensor<Autodiff<Flex>, 4>, g: Geometry) -> Tensor<Autodiff<Flex>, 4> {
    #[derive(Debug)]
    struct MaxPoolBackward;

    impl Backward<Flex, 1> for MaxPoolBackward {
        // Autodiff states are `Clone`: an `Arc` keeps a clone cheap, and around a `Vec` it takes
        // the forward's buffer as it is (`Arc<[u32]>` would copy it).
        type State = (Geometry, Arc<Vec<u32>>);

        fn backward(self, ops: Ops<Self::State, 1>, grads: &mut Gradients, _: &mut Checkpointer) {
            let [node] = ops.parents;
            let dy = grads.consume::<Flex>(&ops.node);
            let Some(node) = node else { return };
            let (g, sources) = ops.state;
            let dy = contiguous(dy);
            let dx = input_grad(&g, values(&dy), &sources);
            grads.register::<Flex>(node.id, flex_f32(dx, &g.input_shape()));
        }
    }

    let x = primitive(x);
    let prepared = MaxPoolBackward
        .prepare::<NoCheckpointing>([x.node.clone()])
        .compute_bound()
        .stateful();
    let input = contiguous(x.primitive);
    let y = match prepared {
        OpsKind::Tracked(prep) => {
            let (y, sources) = forward(&g, values(&input), true);
            prep.finish((g, Arc::new(sources)), flex_f32(y, &g.output_shape()))
        }
        OpsKind::UnTracked(prep) => {
            let (y, _) = forward(&g, values(&input), false);
            prep.finish(flex_f32(y, &g.output_shape()))
        }
    };
    float(y)
}

/// A pool's window as the kernels take it: `[height, width]` each.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Window {
    kernel: [usize; 2],
    stride: [usize; 2],
    padding: [usize; 2],
    dilation: [usize; 2],
}

impl Window {
    /// `None` for what Burn's op pads itself (`Same`, asymmetric) and for `ceil_mode`.
    fn of(pool: &MaxPool2d) -> Option<Self> {
        let padding = match pool.padding {
            PaddingConfig2d::Valid => [0, 0],
            PaddingConfig2d::Explicit(top, left, bottom, right)
                if top == bottom && left == right =>
            {
                [top, left]
            }
            _ => return None,
        };
        let positive = |v: [usize; 2]| v.iter().all(|&d| d > 0);
        let ok = !pool.ceil_mode
            && positive(pool.kernel_size)
            && positive(pool.stride)
            && positive(pool.dilation);
        ok.then_some(Self {
            kernel: pool.kernel_size,
            stride: pool.stride,
            padding,
            dilation: pool.dilation,
        })
    }

    /// The first input row (or column) tap `k` of output `o` reads, if it is inside `len`.
    fn tap(&self, axis: usize, o: usize, k: usize, len: usize) -> Option<usize> {
        (o * self.stride[axis] + k * self.dilation[axis])
            .checked_sub(self.padding[axis])
            .filter(|&i| i < len)
    }

    /// The outputs along `axis` whose tap `k` reads inside `len` elements: a range, since the
    /// position grows with the output.
    fn inside(&self, axis: usize, k: usize, len: usize, outputs: usize) -> std::ops::Range<usize> {
        let (s, offset, pad) = (
            self.stride[axis],
            k * self.dilation[axis],
            self.padding[axis],
        );
        let first = pad.saturating_sub(offset).div_ceil(s);
        let end = match (len + pad).checked_sub(offset + 1) {
            Some(last_input) => (last_input / s + 1).min(outputs),
            None => 0,
        };
        first.min(end)..end
    }
}

/// One pool call's shapes.
#[derive(Debug, Clone, Copy)]
struct Geometry {
    batch: usize,
    channels: usize,
    input: [usize; 2],
    output: [usize; 2],
    window: Window,
}

impl Geometry {
    /// `None` where the kernels do not apply: not f32, an empty output, or planes too large for
    /// `u32` offsets.
    fn of(shape: [usize; 4], dtype: DType, window: Window) -> Option<Self> {
        if dtype != DType::F32 {
            return None;
        }
        let input = [shape[2], shape[3]];
        let w = &window;
        let size = |i: usize| {
            window_positions(
                input[i],
                w.kernel[i],
                w.stride[i],
                w.padding[i],
                w.dilation[i],
            )
        };
        let output = [size(0)?, size(1)?];
        let fits = input[0]
            .checked_mul(input[1])
            .is_some_and(|n| n < NO_INPUT as usize);
        (fits && shape[0] * shape[1] > 0).then_some(Self {
            batch: shape[0],
            channels: shape[1],
            input,
            output,
            window,
        })
    }

    fn planes(&self) -> usize {
        self.batch * self.channels
    }

    fn input_plane(&self) -> usize {
        self.input[0] * self.input[1]
    }

    fn output_plane(&self) -> usize {
        self.output[0] * self.output[1]
    }

    fn input_shape(&self) -> [usize; 4] {
        [self.batch, self.channels, self.input[0], self.input[1]]
    }

    fn output_shape(&self) -> [usize; 4] {
        [self.batch, self.channels, self.output[0], self.output[1]]
    }
}

/// The pooled values and, with `keep_sources`, each one's input offset in its plane (else an
/// empty vector), planes in parallel.
fn forward(g: &Geometry, x: &[f32], keep_sources: bool) -> (Vec<f32>, Vec<u32>) {
    let (in_plane, out_plane) = (g.input_plane(), g.output_plane());
    assert_eq!(x.len(), g.planes() * in_plane, "max pool: input size");
    let mut y = vec![0.0; g.planes() * out_plane];
    let mut sources = vec![NO_INPUT; if keep_sources { y.len() } else { 0 }];
    let columns = g.window.column_taps(g.input[1], g.output[1]);
    let columns = &columns[..];
    // Planes per task: small planes (8×8 outputs at 32 px) in batches, or rayon's splitting
    // costs as much as the pooling.
    let per_task = (4096 / out_plane.max(1)).max(1);
    if keep_sources {
        y.par_chunks_mut(out_plane)
            .zip(sources.par_chunks_mut(out_plane))
            .zip(x.par_chunks(in_plane))
            .with_min_len(per_task)
            .for_each(|((y, sources), x)| pool_plane(g, columns, x, y, sources));
    } else {
        y.par_chunks_mut(out_plane)
            .zip(x.par_chunks(in_plane))
            .with_min_len(per_task)
            .for_each_init(
                || vec![NO_INPUT; out_plane],
                |sources, (y, x)| pool_plane(g, columns, x, y, sources),
            );
    }
    (y, sources)
}

/// Where a column tap reads: the outputs whose tap `kw` is inside the row, and the input column
/// the first of them reads.
#[derive(Debug, Clone)]
struct ColumnTap {
    outputs: std::ops::Range<usize>,
    first: usize,
}

impl Window {
    /// Each column tap's [`ColumnTap`], the same for every row: computed once per call.
    fn column_taps(&self, in_w: usize, out_w: usize) -> Vec<ColumnTap> {
        (0..self.kernel[1])
            .map(|kw| {
                let outputs = self.inside(1, kw, in_w, out_w);
                // Unused when the range is empty (then the tap reads nothing).
                let first = (outputs.start * self.stride[1] + kw * self.dilation[1])
                    .saturating_sub(self.padding[1]);
                ColumnTap { outputs, first }
            })
            .collect()
    }
}

fn pool_plane(g: &Geometry, columns: &[ColumnTap], x: &[f32], y: &mut [f32], sources: &mut [u32]) {
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { pool_plane_avx2(g, columns, x, y, sources) };
        return;
    }
    pool_rows(g, columns, x, y, sources);
}

/// [`pool_rows`] compiled for AVX2: eight outputs per compare and blend (the baseline build has
/// SSE2 only, without a blend or a masked store).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn pool_plane_avx2(
    g: &Geometry,
    columns: &[ColumnTap],
    x: &[f32],
    y: &mut [f32],
    sources: &mut [u32],
) {
    pool_rows(g, columns, x, y, sources);
}

/// Each output row: each tap in Burn's order (rows, then columns) over the whole row, so the
/// compiler sees one branch-free loop per tap.
#[inline(always)]
fn pool_rows(g: &Geometry, columns: &[ColumnTap], x: &[f32], y: &mut [f32], sources: &mut [u32]) {
    let (w, [in_h, in_w], width) = (&g.window, g.input, g.output[1]);
    let rows = y.chunks_mut(width).zip(sources.chunks_mut(width));
    for (r, (best, source)) in rows.enumerate() {
        best.fill(f32::NEG_INFINITY);
        source.fill(NO_INPUT);
        for kh in 0..w.kernel[0] {
            let Some(ih) = w.tap(0, r, kh, in_h) else {
                continue;
            };
            let row = &x[ih * in_w..][..in_w];
            for tap in columns {
                let outputs = tap.outputs.clone();
                if outputs.is_empty() {
                    continue;
                }
                let (best, source) = (&mut best[outputs.clone()], &mut source[outputs]);
                let (taps, base) = (&row[tap.first..], (ih * in_w + tap.first) as u32);
                // A stride known at compile time lets the loop run on vectors (ResNet's is 2).
                match w.stride[1] {
                    1 => take_greater::<1>(best, source, taps, base),
                    2 => take_greater::<2>(best, source, taps, base),
                    s => take_greater_strided(best, source, taps, base, s),
                }
            }
        }
    }
}

/// One tap over a row of outputs: output `i` reads `taps[i·S]`, at plane offset `base + i·S`.
/// Burn's rule: the first tap is taken whatever it holds, later ones when greater. Written as
/// selects over whole chunks so that it compiles to vector blends, not a branch per element
/// (taking or not is a coin toss on real activations).
#[inline(always)]
fn take_greater<const S: usize>(best: &mut [f32], source: &mut [u32], taps: &[f32], base: u32) {
    let n = best.len().min(source.len());
    let mut done = 0;
    for ((best, source), chunk) in best
        .iter_mut()
        .zip(source.iter_mut())
        .zip(taps.chunks_exact(S))
    {
        let v = chunk[0];
        let take = (v > *best) | (*source == NO_INPUT);
        *best = if take { v } else { *best };
        *source = if take {
            base + (done * S) as u32
        } else {
            *source
        };
        done += 1;
    }
    // The last output's tap can be the row's last element, with no whole chunk after it.
    if done < n {
        let v = taps[done * S];
        if v > best[done] || source[done] == NO_INPUT {
            best[done] = v;
            source[done] = base + (done * S) as u32;
        }
    }
}

fn take_greater_strided(best: &mut [f32], source: &mut [u32], taps: &[f32], base: u32, s: usize) {
    for (i, ((best, source), &v)) in best
        .iter_mut()
        .zip(source)
        .zip(taps.iter().step_by(s))
        .enumerate()
    {
        if v > *best || *source == NO_INPUT {
            *best = v;
            *source = base + (i * s) as u32;
        }
    }
}

/// The input gradient: each output's gradient added to the input it came from, in output order.
fn input_grad(g: &Geometry, dy: &[f32], sources: &[u32]) -> Vec<f32> {
    let (in_plane, out_plane) = (g.input_plane(), g.output_plane());
    assert_eq!(dy.len(), g.planes() * out_plane, "max pool: gradient size");
    assert_eq!(sources.len(), dy.len(), "max pool: sources");
    let mut dx = vec![0.0; g.planes() * in_plane];
    dx.par_chunks_mut(in_plane)
        .zip(dy.par_chunks(out_plane).zip(sources.par_chunks(out_plane)))
        .for_each(|(dx, (dy, sources))| {
            for (&d, &s) in dy.iter().zip(sources) {
                if s != NO_INPUT {
                    dx[s as usize] += d;
                }
            }
        });
    dx
}

#[cfg(test)]
mod tests {
    use burn::nn::pool::MaxPool2dConfig;
    use burn::tensor::{Distribution, TensorData};

    use super::*;

    type Ad = Autodiff<Flex>;

    fn bits<const D: usize, B: Backend>(t: Tensor<B, D>) -> Vec<u32> {
        let v = t.into_data().to_vec::<f32>().expect("f32");
        v.into_iter().map(f32::to_bits).collect()
    }

    /// `n` values of `value` over an xorshift sequence from `seed`: the same for the same
    /// arguments, whatever else draws random numbers meanwhile.
    fn sequence(n: usize, seed: u32, value: impl Fn(u32) -> f32) -> Vec<f32> {
        let mut state = seed;
        (0..n)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                value(state)
            })
            .collect()
    }

    /// Values with many equal maxima (small integers), so the first-of-equals rule is exercised,
    /// with a `-∞` and, where asked, a NaN among them.
    fn input(shape: [usize; 4], nan: bool) -> TensorData {
        let n: usize = shape.iter().product();
        let mut v = sequence(n, 0x2545_f491, |s| (s % 7) as f32 - 3.0);
        v[n / 3] = f32::NEG_INFINITY;
        if nan {
            v[n / 2] = f32::NAN;
        }
        TensorData::new(v, shape)
    }

    /// Weights in (-1, 1) with fractional parts, the same for the same shape.
    fn weights(shape: [usize; 4]) -> TensorData {
        let n = shape.iter().product();
        let v = sequence(n, 0x9e37_79b9, |s| (s % 2001) as f32 / 1000.0 - 1.0);
        TensorData::new(v, shape)
    }

    fn pools() -> Vec<MaxPool2d> {
        let p = |k: [usize; 2], s: [usize; 2], pad: PaddingConfig2d| {
            MaxPool2dConfig::new(k).with_strides(s).with_padding(pad)
        };
        vec![
            // ResNet's stem.
            p([3, 3], [2, 2], PaddingConfig2d::Explicit(1, 1, 1, 1)).init(),
            p([2, 2], [2, 2], PaddingConfig2d::Valid).init(),
            p([3, 2], [1, 3], PaddingConfig2d::Explicit(1, 1, 1, 1)).init(),
            p([3, 3], [3, 2], PaddingConfig2d::Explicit(1, 0, 1, 0))
                .with_dilation([1, 2])
                .init(),
            p([1, 1], [2, 2], PaddingConfig2d::Valid).init(),
        ]
    }

    #[test]
    fn outputs_match_burns_op_to_the_bit() {
        let device = Default::default();
        for pool in pools() {
            for shape in [[2, 3, 7, 9], [1, 2, 8, 8], [3, 1, 5, 4]] {
                for nan in [false, true] {
                    let x = Tensor::<Flex, 4>::from_data(input(shape, nan), &device);
                    assert!(Window::of(&pool).is_some(), "{pool:?} runs our kernel");
                    let ours = bits(max_pool2d(&pool, x.clone()));
                    let burn = bits(pool.forward(x));
                    assert_eq!(ours, burn, "{pool:?} on {shape:?}, NaN: {nan}");
                }
            }
        }
    }

    #[test]
    fn gradients_match_burns_op_to_the_bit() {
        let device = Default::default();
        for pool in pools() {
            for shape in [[2, 3, 7, 9], [1, 2, 8, 8]] {
                let data = input(shape, false);
                let grad = |ours: bool| {
                    let x = Tensor::<Ad, 4>::from_data(data.clone(), &device).require_grad();
                    let y = if ours {
                        max_pool2d(&pool, x.clone())
                    } else {
                        pool.forward(x.clone())
                    };
                    // Output weights from our own generator, not the backend's shared one that
                    // tests running beside this one draw from too.
                    let w = Tensor::<Ad, 4>::from_data(weights(y.dims()), &device);
                    let grads = (y * w).sum().backward();
                    let dx = x.grad(&grads).expect("x takes a gradient");
                    bits(dx)
                };
                let ours = grad(true);
                let burn = grad(false);
                assert_eq!(ours, burn, "{pool:?} on {shape:?}");
            }
        }
    }

    #[test]
    fn untracked_inputs_and_other_pools_give_burns_values() {
        let device = Default::default();
        let x = Tensor::<Ad, 4>::random([2, 3, 9, 6], Distribution::Default, &device);
        let stem = &pools()[0];
        assert_eq!(
            bits(max_pool2d(stem, x.clone())),
            bits(stem.forward(x.clone()))
        );
        // What Burn's module pads itself, and ceil mode, go to Burn's op.
        let same = MaxPool2dConfig::new([2, 2])
            .with_strides([1, 1])
            .with_padding(PaddingConfig2d::Same)
            .init();
        let ceil = MaxPool2dConfig::new([3, 3]).with_ceil_mode(true).init();
        for pool in [same, ceil] {
            assert!(Window::of(&pool).is_none());
            assert_eq!(
                bits(max_pool2d(&pool, x.clone())),
                bits(pool.forward(x.clone()))
            );
        }
    }

    #[test]
    fn inside_is_the_range_of_outputs_whose_tap_is_in_bounds() {
        for stride in 1..4 {
            for dilation in 1..3 {
                for padding in 0..3 {
                    let w = Window {
                        kernel: [3, 3],
                        stride: [stride; 2],
                        padding: [padding; 2],
                        dilation: [dilation; 2],
                    };
                    for len in 1..9 {
                        for k in 0..3 {
                            let outputs = 7;
                            let expected: Vec<usize> = (0..outputs)
                                .filter(|&o| w.tap(1, o, k, len).is_some())
                                .collect();
                            let got: Vec<usize> = w.inside(1, k, len, outputs).collect();
                            assert_eq!(got, expected, "{w:?}, len {len}, tap {k}");
                        }
                    }
                }
            }
        }
    }
}
