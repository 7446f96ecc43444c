//! Our own 2-D convolution: a backend extension ([`ConvBackend`]) with GEMM kernels on the CPU,
//! cuDNN on CUDA; [`crate::conv_impl`] switches back to Burn's own conv for comparison.

mod backend;
mod cpu;
#[cfg(feature = "cuda")]
mod cuda;
#[cfg(feature = "cuda")]
mod cudnn;
mod dispatch;
#[cfg(feature = "cuda")]
mod layout;
mod live_taps;
mod narrow;
mod winograd;

pub use backend::ConvBackend;
pub(crate) use cpu::window_positions;

/// Why cuDNN does not run the CUDA convs in this process (missing or incomplete library, or an
/// earlier failure), or `None` when it does. Probes once, like the convs themselves.
#[cfg(feature = "cuda")]
pub fn cudnn_unavailable() -> Option<String> {
    cuda::unavailable_reason()
}
pub use dispatch::{conv2d, conv2d_with};
