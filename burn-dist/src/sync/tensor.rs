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
    /// Returns the tensor unchanged when the communicator skips collectives (a world of one that
    /// is not NCCL).
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

    /// [`CollectiveBackend::all_reduce_float`] of several tensors at once (the buckets of one
    /// step), so a backend can launch them together and wait once.
    ///
    /// # Errors
    /// As [`CollectiveBackend::all_reduce_float`].
    fn all_reduce_floats(
        comm: &dyn Communicator,
        tensors: Vec<Tensor<Self, 1>>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Vec<Tensor<Self, 1>>> {
        tensors
            .into_iter()
            .map(|t| Self::all_reduce_float(comm, t, op, compression))
            .collect()
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
    if comm.skips_collectives() {
        return Ok(tensor);
    }
    let device = tensor.device();
    let dtype = tensor.dtype();
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
    Ok(Tensor::from_data(TensorData::new(v, [n]), (&device, dtype)))
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
    if comm.skips_collectives() {
        return Ok(tensor);
    }
    let device = tensor.device();
    let dtype = tensor.dtype();
    let mut v = read_f32("broadcast", tensor)?;
    comm.broadcast(HostBuf::F32(&mut v), root)?;
    let n = v.len();
    Ok(Tensor::from_data(TensorData::new(v, [n]), (&device, dtype)))
}

impl CollectiveBackend for burn::backend::Flex {}

/// Collectives on an autodiff tensor run on its inner (detached) tensor, so a device backend's
/// fast path also serves parameter broadcasts and buffer averages.
impl<B: CollectiveBackend> CollectiveBackend for burn::backend::Autodiff<B> {
    fn all_reduce_floats(
        comm: &dyn Communicator,
        tensors: Vec<Tensor<Self, 1>>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Vec<Tensor<Self, 1>>> {
        let inner = tensors.into_iter().map(|t| t.inner()).collect();
        Ok(B::all_reduce_floats(comm, inner, op, compression)?
            .into_iter()
            .map(Tensor::from_inner)
            .collect())
    }

    fn all_reduce_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<Self, 1>> {
        B::all_reduce_float(comm, tensor.inner(), op, compression).map(Tensor::from_inner)
    }

    fn broadcast_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        root: usize,
    ) -> Result<Tensor<Self, 1>> {
        B::broadcast_float(comm, tensor.inner(), root).map(Tensor::from_inner)
    }
}

#[cfg(feature = "cuda")]
pub use crate::sync::cuda_tensor::{CubeAccess, CudaFused, CudaRaw};
