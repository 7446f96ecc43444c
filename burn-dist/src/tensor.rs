//! Moving Burn tensors through a [`Communicator`]: one small trait implemented per backend, so the
//! gradient sync is generic over `B: AutodiffBackend`.
//!
//! The default methods stage through host memory (`into_data` / `from_data`), which is what the
//! Flex backend is anyway. The CUDA backend overrides them to hand raw device pointers to NCCL
//! when the communicator is [`crate::Nccl`].

use crate::comm::{Communicator, HostBuf, ReduceOp};
use crate::error::{DistError, Result};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use half::{bf16, f16};

/// Element type used on the wire for float gradients.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Compression {
    /// Full precision (f32).
    #[default]
    None,
    /// IEEE half on the wire, back to f32 after (as DDP's `fp16_compress_hook`).
    Fp16,
    /// bfloat16 on the wire, back to f32 after.
    Bf16,
}

/// Backend tensor access for collectives.
pub trait CollectiveBackend: Backend {
    /// Reduces a flat float tensor across ranks with `op`, casting to `compression` on the wire.
    /// A world of one returns the tensor unchanged.
    ///
    /// # Errors
    /// The communicator's error, or [`DistError::TensorData`] when the tensor cannot be read.
    fn all_reduce_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<Self, 1>> {
        host_all_reduce(comm, tensor, op, compression)
    }

    /// Replaces `tensor` by `root`'s on every rank.
    ///
    /// # Errors
    /// As [`CollectiveBackend::all_reduce_float`].
    fn broadcast_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        root: usize,
    ) -> Result<Tensor<Self, 1>> {
        host_broadcast(comm, tensor, root)
    }
}

fn read_f32<B: Backend>(op: &'static str, tensor: Tensor<B, 1>) -> Result<Vec<f32>> {
    tensor
        .into_data()
        .convert::<f32>()
        .into_vec::<f32>()
        .map_err(|e| DistError::TensorData {
            op,
            detail: format!("{e:?}"),
        })
}

/// Host-staged all-reduce of a float tensor (the default of [`CollectiveBackend`]).
///
/// # Errors
/// As [`CollectiveBackend::all_reduce_float`].
pub fn host_all_reduce<B: Backend>(
    comm: &dyn Communicator,
    tensor: Tensor<B, 1>,
    op: ReduceOp,
    compression: Compression,
) -> Result<Tensor<B, 1>> {
    if comm.world_size() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let mut v = read_f32("all_reduce", tensor)?;
    match compression {
        Compression::None => comm.all_reduce(HostBuf::F32(&mut v), op)?,
        Compression::Fp16 => {
            let mut h: Vec<f16> = v.iter().map(|x| f16::from_f32(*x)).collect();
            comm.all_reduce(HostBuf::F16(&mut h), op)?;
            v.iter_mut().zip(&h).for_each(|(a, b)| *a = b.to_f32());
        }
        Compression::Bf16 => {
            let mut h: Vec<bf16> = v.iter().map(|x| bf16::from_f32(*x)).collect();
            comm.all_reduce(HostBuf::BF16(&mut h), op)?;
            v.iter_mut().zip(&h).for_each(|(a, b)| *a = b.to_f32());
        }
    }
    let n = v.len();
    Ok(Tensor::from_data(TensorData::new(v, [n]), &device))
}

/// Host-staged broadcast of a float tensor (the default of [`CollectiveBackend`]).
///
/// # Errors
/// As [`CollectiveBackend::broadcast_float`].
pub fn host_broadcast<B: Backend>(
    comm: &dyn Communicator,
    tensor: Tensor<B, 1>,
    root: usize,
) -> Result<Tensor<B, 1>> {
    if comm.world_size() == 1 {
        return Ok(tensor);
    }
    let device = tensor.device();
    let mut v = read_f32("broadcast", tensor)?;
    comm.broadcast(HostBuf::F32(&mut v), root)?;
    let n = v.len();
    Ok(Tensor::from_data(TensorData::new(v, [n]), &device))
}

impl CollectiveBackend for burn::backend::Flex {}

impl<B: CollectiveBackend> CollectiveBackend for burn::backend::Autodiff<B> {}

#[cfg(feature = "cuda")]
pub use crate::cuda_tensor::{CudaFused, CudaRaw};
