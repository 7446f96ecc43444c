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
        let prepared = NormBackward
            .prepare::<C>([x.node.clone(), gamma.node.clone(), beta.node.clone()])
            .compute_bound()
            .stateful();
        let forward = |x, gamma, beta| B::batch_norm_train(x, gamma, beta, epsilon);
        record(prepared, [x, gamma, beta], forward, false, epsilon)
    }

    fn batch_norm_relu_train(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        residual: Option<FloatTensor<Self>>,
        epsilon: f64,
    ) -> BatchNormOutput<Self> {
        let parents = [x.node.clone(), gamma.node.clone(), beta.node.clone()];
        let args = [x, gamma, beta];
        match residual {
            None => {
                let prepared = NormBackward
                    .prepare::<C>(parents)
                    .compute_bound()
                    .stateful();
                let forward =
                    |x, gamma, beta| B::batch_norm_relu_train(x, gamma, beta, None, epsilon);
                record(prepared, args, forward, true, epsilon)
            }
            Some(r) => {
                let [x_node, gamma_node, beta_node] = parents;
                let prepared = NormBackward
                    .prepare::<C>([x_node, gamma_node, beta_node, r.node.clone()])
                    .compute_bound()
                    .stateful();
                let r = r.primitive;
                let forward =
                    |x, gamma, beta| B::batch_norm_relu_train(x, gamma, beta, Some(r), epsilon);
                record(prepared, args, forward, true, epsilon)
            }
        }
    }
}

/// The node of a training forward: parents x, gamma, beta and, with four, the residual.
#[derive(Debug)]
struct NormBackward;

/// x and gamma (checkpointed), the batch's mean and variance, the ReLU's output where the norm
/// ends in one, epsilon.
type NormState<B> = (
    NodeId,
    NodeId,
    FloatTensor<B>,
    FloatTensor<B>,
    Option<FloatTensor<B>>,
    f64,
);

impl<B: BatchNormBackend> Backward<B, 3> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 3>, grads: &mut Gradients, ck: &mut Checkpointer) {
        norm_backward::<B, 3>(ops, grads, ck);
    }
}

impl<B: BatchNormBackend> Backward<B, 4> for NormBackward {
    type State = NormState<B>;

    fn backward(self, ops: Ops<Self::State, 4>, grads: &mut Gradients, ck: &mut Checkpointer) {
        norm_backward::<B, 4>(ops, grads, ck);
    }
}

/// The inner backend's gradients, registered with the parents that take one; the fourth, where
/// there is one, is the residual.
fn norm_backward<B: BatchNormBackend, const N: usize>(
    ops: Ops<NormState<B>, N>,
    grads: &mut Gradients,
    checkpointer: &mut Checkpointer,
) {
    let grad = grads.consume::<B>(&ops.node);
    let (x_state, gamma_state, mean, var, relu_output, epsilon) = ops.state;
    let x: FloatTensor<B> = checkpointer.retrieve_node_output(x_state);
    let gamma: FloatTensor<B> = checkpointer.retrieve_node_output(gamma_state);
    let (norm, residual) = match relu_output {
        None => (
            B::batch_norm_grads(x, gamma, mean, var, grad, epsilon),
            None,
        ),
        Some(output) => {
            let g = B::batch_norm_relu_grads(x, gamma, mean, var, output, grad, N == 4, epsilon);
            (g.norm, g.residual)
        }
    };
    let computed = [Some(norm.x), Some(norm.gamma), Some(norm.beta), residual];
    for (node, grad) in ops.parents.into_iter().zip(computed) {
        if let (Some(node), Some(grad)) = (node, grad) {
            grads.register::<B>(node.id, grad);
        }
    }
}

/// Runs the inner backend's `forward` on `[x, gamma, beta]` and records the node, keeping the
/// output for the backward when the norm ends in a ReLU (`relu`).
fn record<B: BatchNormBackend, C: CheckpointStrategy, const N: usize>(
    prepared: OpsKind<NormBackward, B, NormState<B>, C, N>,
    [x, gamma, beta]: [FloatTensor<Autodiff<B, C>>; 3],
    forward: impl FnOnce(FloatTensor<B>, FloatTensor<B>, FloatTensor<B>) -> BatchNormOutput<B>,
    relu: bool,
    epsilon: f64,
) -> BatchNormOutput<Autodiff<B, C>>
where
    NormBackward: Backward<B, N, State = NormState<B>>,
{
    let (output, mean, var) = match prepared {
        OpsKind::Tracked(mut prep) => {
            let x_state = prep.checkpoint(&x);
            let gamma_state = prep.checkpoint(&gamma);
            let inner = forward(x.primitive, gamma.primitive, beta.primitive);
            let state = (
                x_state,
                gamma_state,
                inner.mean.clone(),
                inner.var.clone(),
                relu.then(|| inner.output.clone()),
                epsilon,
            );
            (prep.finish(state, inner.output), inner.mean, inner.var)
        }
        OpsKind::UnTracked(prep) => {
            let inner = forward(x.primitive, gamma.primitive, beta.primitive);
            (prep.finish(inner.output), inner.mean, inner.var)
        }
    };
    BatchNormOutput {
        output,
        mean: <Autodiff<B, C> as AutodiffBackend>::from_inner(mean),
        var: <Autodiff<B, C> as AutodiffBackend>::from_inner(var),
    }
}
