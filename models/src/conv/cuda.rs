//! Burn's CUDA backends join [`ConvBackend`] with its defaults, i.e. Burn's own (autotuned) conv
//! and gradients, reached through our autodiff node.

use burn_cubecl::CubeBackend;
use cubecl::cuda::CudaRuntime;

use super::ConvBackend;

/// Burn's CUDA backend without fusion (the same type as `burn_dist::CudaRaw`).
pub(crate) type CudaRaw = CubeBackend<CudaRuntime, f32, i32, u8>;
/// Burn's CUDA backend with fusion (`burn::backend::Cuda` in this workspace).
pub(crate) type CudaFused = burn_fusion::Fusion<CudaRaw>;

impl ConvBackend for CudaRaw {}
impl ConvBackend for CudaFused {}
