//! [`BatchNormBackend`] for `Autodiff<B>`: one graph node per BatchNorm (and per BatchNorm with
//! its ReLU and residual sum) whose backward calls the inner backend's gradients, instead of a
//! node per broadcasting op of Burn's chain.

use burn::backend::Autodiff;
use burn::backend::autodiff::NodeId;
use burn::backend::autodiff::checkpoint::base::Checkpointer;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::autodiff::grads::Gradients;
use burn::backend::autodiff::ops::{Backward, Ops, OpsKind};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::ops::FloatTensor;

use super::{BatchNormBackend, BatchNormOutput};

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

    fn batch_norm_relu_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        let (x_node, gamma_node, beta_node) =
            (x.node.clone(), gamma.node.clone(), beta.node.clone());
        let (output, mean, var) = match residual {
            None => {
                let prepared = BatchNormReluBackward
                    .prepare::<C>([x_node, gamma_node, beta_node])
                    .compute_bound()
                    .stateful();
                relu_node(prepared, x, gamma, beta, None, epsilon)
            }
            Some(r) => {
                let prepared = BatchNormReluBackward
                    .prepare::<C>([x_node, gamma_node, beta_node, r.node.clone()])
                    .compute_bound()
                    .stateful();
                relu_node(prepared, x, gamma, beta, Some(r.primitive), epsilon)
            }
        };
        BatchNormOutput {
            output,
            mean: <Self as AutodiffBackend>::from_inner(mean),
            var: <Self as AutodiffBackend>::from_inner(var),
        }
    }
}

/// The node of [`BatchNormBackend::batch_norm_relu_train`]: parents x, gamma, beta and, with
/// four, the residual.
#[derive(Debug)]
struct BatchNormReluBackward;

/// x and gamma (checkpointed), the batch's mean and variance, the output, epsilon.
type ReluState<B> = (
    NodeId,
    NodeId,
    FloatTensor<B>,
    FloatTensor<B>,
    FloatTensor<B>,
    f64,
);

impl<B: BatchNormBackend> Backward<B, 3> for BatchNormReluBackward {
    type State = ReluState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, ck: &mut Checkpointer) {
        relu_backward::<B, 3>(ops, grads, ck);
    }
}

impl<B: BatchNormBackend> Backward<B, 4> for BatchNormReluBackward {
    type State = ReluState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, ck: &mut Checkpointer) {
        relu_backward::<B, 4>(ops, grads, ck);
    }
}

fn relu_backward<B: BatchNormBackend, const N: usize>(
    ops: Ops<ReluState<B>, N>,
    grads: &mut Gradients,
    checkpointer: &mut Checkpointer,
) {
    let grad = grads.consume::<B>(&ops.node);
    let (x_state, gamma_state, mean, var, output, epsilon) = ops.state;
    let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
    let gamma: FloatTensor<B> = checkpointer.retrieve_node_output(gamma_state);
    let g = B::batch_norm_relu_grads(x, gamma, mean, var, output, grad, N == 4, epsilon);
    let computed = [
        Some(g.norm.x),
        Some(g.norm.gamma),
        Some(g.norm.beta),
        g.residual,
    ];
    for (node, grad) in ops.parents.into_iter().zip(computed) {
        if let (Some(node), Some(grad)) = (node, grad) {
            grads.register::<B>(node.id, grad);
        }
    }
}

/// Runs the inner backend's fused forward and records the node: `(output, mean, var)`.
fn relu_node<B: BatchNormBackend, C: CheckpointStrategy, const N: usize>(
    prepared: OpsKind<BatchNormReluBackward, B, ReluState<B>, C, N>,
    x: FloatTensor<Autodiff<B, C>>,
    gamma: FloatTensor<Autodiff<B, C>>,
    beta: FloatTensor<Autodiff<B, C>>,
    residual: Option<FloatTensor<B>>,
    epsilon: f64,
) -> (FloatTensor<Autodiff<B, C>>, FloatTensor<B>, FloatTensor<B>)
where
    BatchNormReluBackward: Backward<B, N, State = ReluState<B>>,
{
    let forward = |x, gamma, beta| B::batch_norm_relu_train(x, gamma, beta, residual, epsilon);
    match prepared {
        OpsKind::Tracked(mut prep) => {
            let x_state = prep.checkpoint(&x);
            let gamma_state = prep.checkpoint(&gamma);
            let inner = forward(x.primitive, gamma.primitive, beta.primitive);
            let state = (
                x_state,
                gamma_state,
                inner.mean.clone(),
                inner.var.clone(),
                inner.output.clone(),
                epsilon,
            );
            (prep.finish(state, inner.output), inner.mean, inner.var)
        }
        OpsKind::UnTracked(prep) => {
            let inner = forward(x.primitive, gamma.primitive, beta.primitive);
            (prep.finish(inner.output), inner.mean, inner.var)
        }
    }
}
