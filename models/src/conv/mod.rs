//! Our own 2-D convolution: a backend extension ([`ConvBackend`]) with GEMM kernels on the CPU,
//! cuDNN on CUDA, and the run-time switch ([`ConvImpl`]) that keeps Burn's own conv for comparison.

mod backend;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cudnn;
mod dispatch;

pub use backend::ConvBackend;
pub use dispatch::{CONV_ENV, ConvImpl, conv_impl, conv2d, conv2d_with, set_conv_impl};
