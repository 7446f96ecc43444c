//! `torch.nn.utils.clip_grad_norm_` over a whole model: the L2 norm of all gradients together,
//! and the factor `min(1, max_norm / (norm + 1e-6))` every gradient is multiplied by. Both stay on
//! the device (no sync): the trainer reads the norm with the step's other figures.
//!
//! The optimizer computes it from the gradients it is handed, which under
//! `burn_dist::DistributedOptimizer` are the all-reduced ones: every rank clips by the same
//! factor (Horovod's `synchronize()` before clipping, then `skip_synchronize()` for the step).

use burn::module::{AutodiffModule, ModuleVisitor, Param};
use burn::optim::GradientsParams;
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;

/// torch's guard against a zero norm.
pub const CLIP_EPS: f64 = 1e-6;

/// The L2 norm over every gradient in `grads` of `module`'s parameters, shape `[1]`, or `None`
/// when no parameter has a gradient.
pub fn global_grad_norm<B, M>(
    module: &M,
    grads: &GradientsParams,
) -> Option<Tensor<B::InnerBackend, 1>>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    struct SumOfSquares<'a, B: AutodiffBackend> {
        grads: &'a GradientsParams,
        total: Option<Tensor<B::InnerBackend, 1>>,
    }
    impl<B: AutodiffBackend> ModuleVisitor<B> for SumOfSquares<'_, B> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let Some(grad) = self.grads.get::<B::InnerBackend, D>(param.id) else {
                return;
            };
            let squares = grad.square().sum();
            self.total = Some(match self.total.take() {
                Some(total) => total + squares,
                None => squares,
            });
        }
    }
    let mut visitor = SumOfSquares::<B> { grads, total: None };
    module.visit(&mut visitor);
    visitor.total.map(Tensor::sqrt)
}

/// `clip_grad_norm_`'s factor for a total norm: `min(1, max_norm / (norm + 1e-6))`, shape `[1]`.
pub fn clip_factor<B: burn::tensor::backend::Backend>(
    norm: Tensor<B, 1>,
    max_norm: f64,
) -> Tensor<B, 1> {
    norm.add_scalar(CLIP_EPS)
        .recip()
        .mul_scalar(max_norm)
        .clamp_max(1.0)
}
