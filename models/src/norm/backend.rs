//! [`BatchNormBackend`]: BatchNorm over `[N, C, H, W]` as a backend extension, its CPU kernels
//! for Flex, and its autodiff (one graph node instead of Burn's chain of broadcasting ops).

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::ops::FloatTensor;
use burn::tensor::{DType, Tensor, TensorMetadata};
use burn_flex::{Flex, FlexTensor};

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
        let Some(p) = flex_planes(&x, &[&gamma, &beta]) else {
            return reference_train::<Self>(x, gamma, beta, epsilon);
        };
        let shape = x.shape().to_vec();
        let [x, gamma, beta] = [x, gamma, beta].map(contiguous);
        let (y, mean, var) =
            cpu::train_forward(&p, values(&x), values(&gamma), values(&beta), epsilon);
        BatchNormOutput {
            output: flex_f32(y, &shape),
            mean: flex_f32(mean, &[p.channels]),
            var: flex_f32(var, &[p.channels]),
        }
    }

    fn batch_norm_grads(
        x: FlexTensor,
        gamma: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        output_grad: FlexTensor,
        epsilon: f64,
    ) -> BatchNormGrads<Self> {
        let planes = flex_planes(&x, &[&gamma, &mean, &var])
            .filter(|_| output_grad.dtype() == DType::F32 && output_grad.shape() == x.shape());
        let Some(p) = planes else {
            return reference_grads::<Self>(x, gamma, mean, var, output_grad, epsilon);
        };
        let shape = x.shape().to_vec();
        let [x, gamma, mean, var, dy] = [x, gamma, mean, var, output_grad].map(contiguous);
        let (dx, dgamma, dbeta) = cpu::backward(
            &p,
            values(&x),
            values(&dy),
            values(&gamma),
            values(&mean),
            values(&var),
            epsilon,
        );
        BatchNormGrads {
            x: flex_f32(dx, &shape),
            gamma: flex_f32(dgamma, &[p.channels]),
            beta: flex_f32(dbeta, &[p.channels]),
        }
    }

    fn batch_norm_eval(
        x: FlexTensor,
        gamma: FlexTensor,
        beta: FlexTensor,
        mean: FlexTensor,
        var: FlexTensor,
        epsilon: f64,
    ) -> FlexTensor {
        let Some(p) = flex_planes(&x, &[&gamma, &beta, &mean, &var]) else {
            return reference_eval::<Self>(x, gamma, beta, mean, var, epsilon);
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
        flex_f32(cpu::scale_shift(&p, values(&x), &scale, &shift), &shape)
    }
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

impl<B: BatchNormBackend, C: CheckpointStrategy> BatchNormBackend for Autodiff<B, C> {
    fn batch_norm_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        #[derive(Debug)]
        struct BatchNormBackward;

        impl<B: BatchNormBackend> Backward<B, 3> for BatchNormBackward {
            type State = (NodeId, NodeId, FloatTensor<B>, FloatTensor<B>, f64);

            fn backward(
                self,
                ops: Ops<Self::State, 3>,
                grads: &mut Gradients,
                checkpointer: &mut Checkpointer,
            ) {
                let [node_x, node_gamma, node_beta] = ops.parents;
                let grad = grads.consume::<B>(&ops.node);
                let (x_state, gamma_state, mean, var, epsilon) = ops.state;
                let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
                let gamma: FloatTensor<B> = checkpointer.retrieve_node_output(gamma_state);
                let g = B::batch_norm_grads(x, gamma, mean, var, grad, epsilon);
                for (node, grad) in [(node_x, g.x), (node_gamma, g.gamma), (node_beta, g.beta)] {
                    if let Some(node) = node {
                        grads.register::<B>(node.id, grad);
                    }
                }
            }
        }

        let prepared = BatchNormBackward
            .prepare::<C>([x.node.clone(), gamma.node.clone(), beta.node.clone()])
            .compute_bound()
            .stateful();
        let (output, mean, var) = match prepared {
            OpsKind::Tracked(mut prep) => {
                let x_state = prep.checkpoint(&x);
                let gamma_state = prep.checkpoint(&gamma);
                let inner =
                    B::batch_norm_train(x.primitive, gamma.primitive, beta.primitive, epsilon);
                let state = (
                    x_state,
                    gamma_state,
                    inner.mean.clone(),
                    inner.var.clone(),
                    epsilon,
                );
                (prep.finish(state, inner.output), inner.mean, inner.var)
            }
            OpsKind::UnTracked(prep) => {
                let inner =
                    B::batch_norm_train(x.primitive, gamma.primitive, beta.primitive, epsilon);
                (prep.finish(inner.output), inner.mean, inner.var)
            }
        };
        BatchNormOutput {
            output,
            mean: <Self as AutodiffBackend>::from_inner(mean),
            var: <Self as AutodiffBackend>::from_inner(var),
        }
    }
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
