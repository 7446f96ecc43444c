//! Our own BatchNorm over `[N, C, H, W]`: a backend extension ([`BatchNormBackend`]) with fused
//! CPU kernels for Flex and one autodiff node; [`crate::batch_norm_impl`] switches back to Burn's
//! arithmetic for comparison. [`crate::nn::BatchNorm`] is the module.

mod autodiff;
mod backend;
mod cpu;
pub(crate) mod dispatch;
pub(crate) mod reference;

pub use backend::{BatchNormBackend, BatchNormGrads, BatchNormOutput, BatchNormReluGrads};

/// What follows the normalisation in the same op: nothing, or a ReLU after adding `residual`
/// where there is one (`R`: a tensor, or its values).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Then<R> {
    Nothing,
    Relu { residual: Option<R> },
}

impl<R> Then<R> {
    pub(crate) fn map<S>(self, f: impl FnOnce(R) -> S) -> Then<S> {
        match self {
            Then::Nothing => Then::Nothing,
            Then::Relu { residual } => Then::Relu {
                residual: residual.map(f),
            },
        }
    }

    pub(crate) fn as_ref(&self) -> Then<&R> {
        match self {
            Then::Nothing => Then::Nothing,
            Then::Relu { residual } => Then::Relu {
                residual: residual.as_ref(),
            },
        }
    }

    pub(crate) fn residual(&self) -> Option<&R> {
        self.as_ref().into_residual()
    }

    pub(crate) fn into_residual(self) -> Option<R> {
        match self {
            Then::Nothing => None,
            Then::Relu { residual } => residual,
        }
    }
}
