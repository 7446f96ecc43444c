//! Our own BatchNorm over `[N, C, H, W]`: a backend extension ([`BatchNormBackend`]) with fused
//! CPU kernels for Flex and one autodiff node; [`crate::batch_norm_impl`] switches back to Burn's
//! arithmetic for comparison. [`crate::nn::BatchNorm`] is the module.

mod autodiff;
mod backend;
mod cpu;
pub(crate) mod dispatch;
pub(crate) mod reference;

pub use backend::{BatchNormBackend, BatchNormGrads, BatchNormOutput, BatchNormReluGrads};
