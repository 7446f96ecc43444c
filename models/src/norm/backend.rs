//! [`BatchNormBackend`]: BatchNorm over `[N, C, H, W]` as a backend extension, and its CPU
//! kernels for Flex (its autodiff is in `autodiff.rs`).

use burn::tensor::backend::Backend;
use burn::tensor::ops::{ActivationOps, FloatTensor};
use burn::tensor::{DType, Tensor, TensorMetadata};
use burn_flex::{Flex, FlexTensor};

use super::Then;
use super::cpu::{self, Planes};
use super::reference;
use crate::primitive::{contiguous, flex_f32, float, primitive, values};

/// A training forward: the output and the batch statistics it normalised with.
#[derive(Debug)]
pub struct BatchNormOutput<B: Backend> {
    /// `[N, C, H, W]`.
    pub output: FloatTensor<B>,
    /// Per-channel mean, `[C]` (not tracked by autodiff).
    pub mean: FloatTensor<B>,
    /// Per-channel biased variance, `[C]` (not tracked by autodiff).
    pub var: FloatTensor<B>,
}

/// Gradients of a training forward.
#[derive(Debug)]
pub struct BatchNormGrads<B: Backend> {
    /// `[N, C, H, W]`.
    pub x: FloatTensor<B>,
    /// `[C]`.
    pub gamma: FloatTensor<B>,
    /// `[C]`.
    pub beta: FloatTensor<B>,
}

/// Gradients of a training forward that ended in a ReLU
/// ([`BatchNormBackend::batch_norm_relu_train`]).
#[derive(Debug)]
pub struct BatchNormReluGrads<B: Backend> {
    /// The BatchNorm's inputs' gradients.
    pub norm: BatchNormGrads<B>,
    /// The residual's gradient (the output gradient where the output was positive), when asked.
    pub residual: Option<FloatTensor<B>>,
}

/// A backend with its own BatchNorm over `[N, C, H, W]`.
///
/// Every method defaults to Burn's BatchNorm arithmetic in tensor ops, so any backend joins with
/// an empty `impl`; Flex overrides them with fused kernels, and `Autodiff<B>` records one node
/// whose backward calls the inner backend's [`batch_norm_grads`](Self::batch_norm_grads).
pub trait BatchNormBackend: Backend {
    /// Normalises with the batch's own statistics (training), then applies `gamma` and `beta`.
    ///
    /// # Shapes
    /// - `x`: `[N, C, H, W]`, `gamma`, `beta`: `[C]`
    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        reference_train::<Self>(x, gamma, beta, epsilon)
    }

    /// Gradients of [`batch_norm_train`](Self::batch_norm_train) given the output gradient and
    /// the statistics it returned.
    fn batch_norm_grads(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        var: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormGrads<Self> {
        reference_grads::<Self>(x, gamma, mean, var, output_grad, epsilon)
    }

    /// Normalises with given statistics (inference: the running ones).
    fn batch_norm_eval(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        var: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        reference_eval::<Self>(x, gamma, beta, mean, var, epsilon)
    }

    /// `relu(batch_norm_train(x) + residual)`, the residual only where given: a ResNet block's
    /// BatchNorm, shortcut sum and ReLU. `output` is the ReLU's.
    fn batch_norm_relu_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        let out = Self::batch_norm_train(x, gamma, beta, epsilon);
        BatchNormOutput {
            output: relu_of_sum::<Self>(out.output, residual),
            ..out
        }
    }

    /// Gradients of [`batch_norm_relu_train`](Self::batch_norm_relu_train) given its output
    /// and output gradient; the residual's too when `residual`.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_relu_grads(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        var: FloatTensor<Self>,
        output: FloatTensor<Self>,
        output_grad: FloatTensor<Self>,
        residual: bool,
        epsilon: f64,
    ) -> BatchNormReluGrads<Self> {
        let dy = Self::relu_backward(output, output_grad);
        BatchNormReluGrads {
            residual: residual.then(|| dy.clone()),
            norm: Self::batch_norm_grads(x, gamma, mean, var, dy, epsilon),
        }
    }

    /// [`batch_norm_eval`](Self::batch_norm_eval), the residual added where given, then a ReLU.
    #[allow(clippy::too_many_arguments)]
    fn batch_norm_relu_eval(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        mean: FloatTensor<Self>,
        var: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        let y = Self::batch_norm_eval(x, gamma, beta, mean, var, epsilon);
        relu_of_sum::<Self>(y, residual)
    }
}

/// What follows the normalised `y`, in Burn's ops.
fn then_in_burns_ops<B: Backend>(y: FloatTensor<B>, then: Then<FloatTensor<B>>) -> FloatTensor<B> {
    match then {
        Then::Nothing => y,
        Then::Relu { residual } => relu_of_sum::<B>(y, residual),
    }
}

/// `relu(y + residual)` in Burn's ops.
fn relu_of_sum<B: Backend>(y: FloatTensor<B>, residual: Option<FloatTensor<B>>) -> FloatTensor<B> {
    let sum = match residual {
        Some(r) => B::float_add(y, r),
        None => y,
    };
    B::relu(sum)
}

/// The layout when our kernels handle the case (4-D `f32` input, `[C]` `f32` parameters).
fn flex_planes(x: &FlexTensor, per_channel: &[&FlexTensor]) -> Option<Planes> {
    let shape = x.shape();
    if x.dtype() != DType::F32 || shape.num_dims() != 4 {
        return None;
    }
    let ok = per_channel
        .iter()
        .all(|t| t.dtype() == DType::F32 && t.shape().as_slice() == [shape[1]]);
    ok.then(|| Planes {
        batch: shape[0],
        channels: shape[1],
        plane: shape[2] * shape[3],
    })
}

impl BatchNormBackend for Flex {
    fn batch_norm_train(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        flex_train(x, gamma, beta, Then::Nothing, epsilon)
    }

    fn batch_norm_grads(
        x: FlexTensor,
        gamma: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        output_grad: FlexTensor,
        epsilon: f64,
    ) -> BatchNormGrads<Self> {
        flex_grads(x, gamma, mean, var, output_grad, None, epsilon).norm
    }

    fn batch_norm_eval(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        epsilon: f64,
    ) -> FlexTensor {
        flex_eval([x, gamma, beta, mean, var], Then::Nothing, epsilon)
    }

    fn batch_norm_relu_train(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        residual: Option<FlexTensor>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        flex_train(x, gamma, beta, Then::Relu { residual }, epsilon)
    }

    fn batch_norm_relu_grads(
        x: FlexTensor,
        gamma: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        output: FlexTensor,
        output_grad: FlexTensor,
        residual: bool,
        epsilon: f64,
    ) -> BatchNormReluGrads<Self> {
        let relu = Some((output, residual));
        flex_grads(x, gamma, mean, var, output_grad, relu, epsilon)
    }

    fn batch_norm_relu_eval(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        residual: Option<FlexTensor>,
        epsilon: f64,
    ) -> FlexTensor {
        flex_eval(
            [x, gamma, beta, mean, var],
            Then::Relu { residual },
            epsilon,
        )
    }
}

/// Flex's training forward, with or without the ReLU; Burn's arithmetic where the kernels do
/// not apply.
fn flex_train(
    x: FlexTensor,
    gamma: FlexTensor,
    beta: FlexTensor,
    then: Then<FlexTensor>,
    epsilon: f64,
) -> BatchNormOutput<Flex> {
    let planes = flex_planes(&x, &[&gamma, &beta]).filter(|_| same_as(then.residual(), &x));
    let Some(p) = planes else {
        let out = reference_train::<Flex>(x, gamma, beta, epsilon);
        return BatchNormOutput {
            output: then_in_burns_ops::<Flex>(out.output, then),
            ..out
        };
    };
    let shape = x.shape().to_vec();
    let [x, gamma, beta] = [x, gamma, beta].map(contiguous);
    let then = then.map(contiguous);
    let (y, mean, var) = cpu::train_forward(
        &p,
        values(&x),
        values(&gamma),
        values(&beta),
        epsilon,
        then.as_ref().map(values),
    );
    BatchNormOutput {
        output: flex_f32(y, &shape),
        mean: flex_f32(mean, &[p.channels]),
        var: flex_f32(var, &[p.channels]),
    }
}

/// Flex's gradients; with `relu`, `(its output, whether the residual's gradient is wanted)`.
fn flex_grads(
    x: FlexTensor,
    gamma: FlexTensor,
    mean: FlexTensor,
    var: FlexTensor,
    dy: FlexTensor,
    relu: Option<(FlexTensor, bool)>,
    epsilon: f64,
) -> BatchNormReluGrads<Flex> {
    let planes = flex_planes(&x, &[&gamma, &mean, &var])
        .filter(|_| same_as(Some(&dy), &x) && same_as(relu.as_ref().map(|(y, _)| y), &x));
    let Some(p) = planes else {
        let (dy, residual) = match relu {
            Some((y, residual)) => {
                let dy = Flex::relu_backward(y, dy);
                (dy.clone(), residual.then_some(dy))
            }
            None => (dy, None),
        };
        return BatchNormReluGrads {
            norm: reference_grads::<Flex>(x, gamma, mean, var, dy, epsilon),
            residual,
        };
    };
    let shape = x.shape().to_vec();
    let [x, gamma, mean, var, dy] = [x, gamma, mean, var, dy].map(contiguous);
    let relu = relu.map(|(y, residual)| (contiguous(y), residual));
    let g = cpu::backward(
        &p,
        values(&x),
        values(&dy),
        relu.as_ref().map(|(y, residual_grad)| cpu::Relu {
            output: values(y),
            residual_grad: *residual_grad,
        }),
        values(&gamma),
        values(&mean),
        values(&var),
        epsilon,
    );
    BatchNormReluGrads {
        norm: BatchNormGrads {
            x: flex_f32(g.x, &shape),
            gamma: flex_f32(g.gamma, &[p.channels]),
            beta: flex_f32(g.beta, &[p.channels]),
        },
        residual: g.residual.map(|r| flex_f32(r, &shape)),
    }
}

/// Flex's inference with `[x, gamma, beta, mean, var]`, with or without the ReLU.
fn flex_eval(args: [FlexTensor; 5], then: Then<FlexTensor>, epsilon: f64) -> FlexTensor {
    let [x, gamma, beta, mean, var] = args;
    let planes =
        flex_planes(&x, &[&gamma, &beta, &mean, &var]).filter(|_| same_as(then.residual(), &x));
    let Some(p) = planes else {
        let y = reference_eval::<Flex>(x, gamma, beta, mean, var, epsilon);
        return then_in_burns_ops::<Flex>(y, then);
    };
    let shape = x.shape().to_vec();
    let [x, gamma, beta, mean, var] = [x, gamma, beta, mean, var].map(contiguous);
    let (scale, shift) = cpu::affine(
        values(&mean),
        values(&var),
        values(&gamma),
        values(&beta),
        epsilon,
    );
    let y = match then.map(contiguous) {
        Then::Nothing => cpu::scale_shift(&p, values(&x), &scale, &shift),
        Then::Relu { residual } => {
            let r = residual.as_ref().map(values);
            cpu::scale_shift_relu(&p, values(&x), &scale, &shift, r)
        }
    };
    flex_f32(y, &shape)
}

/// Whether `t`, where given, is an f32 tensor of `x`'s shape (what the fused passes read beside
/// `x`).
fn same_as(t: Option<&FlexTensor>, x: &FlexTensor) -> bool {
    t.is_none_or(|t| t.dtype() == DType::F32 && t.shape() == x.shape())
}

// The trait's default bodies, as functions so that an override can fall back to them.

fn reference_train<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    epsilon: f64,
) -> BatchNormOutput<B> {
    let x = float::<B, 4>(x);
    let (mean, var) = reference::batch_stats(&x);
    let output = reference::normalize(
        x,
        mean.clone(),
        var.clone(),
        float(gamma),
        float(beta),
        epsilon,
    );
    let flat = |t: Tensor<B, 4>| {
        let c = t.dims()[1];
        primitive(t.reshape([c]))
    };
    BatchNormOutput {
        output: primitive(output),
        mean: flat(mean),
        var: flat(var),
    }
}

fn reference_grads<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    mean: FloatTensor<B>,
    var: FloatTensor<B>,
    output_grad: FloatTensor<B>,
    epsilon: f64,
) -> BatchNormGrads<B> {
    let (x, gamma, beta) = reference::grads(
        float::<B, 4>(x),
        float(gamma),
        float(mean),
        float(var),
        float(output_grad),
        epsilon,
    );
    BatchNormGrads {
        x: primitive(x),
        gamma: primitive(gamma),
        beta: primitive(beta),
    }
}

fn reference_eval<B: Backend>(
    x: FloatTensor<B>,
    gamma: FloatTensor<B>,
    beta: FloatTensor<B>,
    mean: FloatTensor<B>,
    var: FloatTensor<B>,
    epsilon: f64,
) -> FloatTensor<B> {
    let x = float::<B, 4>(x);
    let c = x.dims()[1];
    let mean = float::<B, 1>(mean).reshape([1, c, 1, 1]);
    let var = float::<B, 1>(var).reshape([1, c, 1, 1]);
    primitive(reference::normalize(
        x,
        mean,
        var,
        float(gamma),
        float(beta),
        epsilon,
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::Distribution;

    use super::*;

    fn vals<const D: usize>(t: FlexTensor) -> Vec<f32> {
        float::<Flex, D>(t)
            .into_data()
            .to_vec::<f32>()
            .expect("f32")
    }

    fn assert_close(what: &str, a: &[f32], b: &[f32]) {
        let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
        let err = a
            .iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs())
            .fold(0.0, f32::max)
            / scale;
        assert!(err <= 1e-4, "{what}: relative error {err}");
    }

    /// The kernels against the trait's default bodies (Burn's arithmetic in tensor ops), which
    /// every backend without kernels of its own runs.
    #[test]
    fn flex_kernels_match_the_default_bodies() {
        let device = Default::default();
        let t = |shape: [usize; 4], mean| {
            Tensor::<Flex, 4>::random(shape, Distribution::Normal(mean, 1.5), &device)
        };
        let c = |mean| Tensor::<Flex, 1>::random([6], Distribution::Normal(mean, 0.5), &device);
        let (x, dy) = (t([3, 6, 5, 9], 2.0), t([3, 6, 5, 9], 0.0));
        let (gamma, beta) = (c(1.0), c(0.0));
        let p = |t: &Tensor<Flex, 4>| primitive(t.clone());
        let q = |t: &Tensor<Flex, 1>| primitive(t.clone());

        let fused = Flex::batch_norm_train(p(&x), q(&gamma), q(&beta), 1e-5);
        let refd = reference_train::<Flex>(p(&x), q(&gamma), q(&beta), 1e-5);
        assert_close("output", &vals::<4>(fused.output), &vals::<4>(refd.output));
        assert_close(
            "mean",
            &vals::<1>(fused.mean.clone()),
            &vals::<1>(refd.mean),
        );
        assert_close("var", &vals::<1>(fused.var.clone()), &vals::<1>(refd.var));

        let (mean, var) = (fused.mean, fused.var);
        let g = Flex::batch_norm_grads(p(&x), q(&gamma), mean.clone(), var.clone(), p(&dy), 1e-5);
        let r = reference_grads::<Flex>(p(&x), q(&gamma), mean.clone(), var.clone(), p(&dy), 1e-5);
        assert_close("dx", &vals::<4>(g.x), &vals::<4>(r.x));
        assert_close("dgamma", &vals::<1>(g.gamma), &vals::<1>(r.gamma));
        assert_close("dbeta", &vals::<1>(g.beta), &vals::<1>(r.beta));

        let e = Flex::batch_norm_eval(p(&x), q(&gamma), q(&beta), mean.clone(), var.clone(), 1e-5);
        let re = reference_eval::<Flex>(p(&x), q(&gamma), q(&beta), mean, var, 1e-5);
        assert_close("eval", &vals::<4>(e), &vals::<4>(re));
    }
}
