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

/// CUDA: with the NCCL communicator and no compression, buckets go to NCCL by device pointer
/// (DESIGN.md §1: `CubeTensor` → `client.get_resource` → `GpuResource::ptr`); otherwise
/// host-staged.
#[cfg(feature = "cuda")]
impl CollectiveBackend for burn::backend::Cuda {
    fn all_reduce_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<Self, 1>> {
        match comm.as_nccl() {
            Some(nccl) if compression == Compression::None && comm.world_size() > 1 => {
                cuda_all_reduce(nccl, tensor, op)
            }
            _ => host_all_reduce(comm, tensor, op, compression),
        }
    }
}

/// NCCL all-reduce of a CUDA tensor into a fresh output tensor, without leaving the device.
#[cfg(feature = "cuda")]
fn cuda_all_reduce(
    nccl: &crate::Nccl,
    tensor: Tensor<burn::backend::Cuda, 1>,
    op: ReduceOp,
) -> Result<Tensor<burn::backend::Cuda, 1>> {
    use burn::tensor::TensorPrimitive;
    type Cuda = burn::backend::Cuda;

    let device = tensor.device();
    let n = tensor.dims()[0];
    let input = tensor.into_primitive().tensor();
    if !input.is_contiguous() || input.dtype != burn::tensor::DType::F32 {
        let tensor = Tensor::<Cuda, 1>::from_primitive(TensorPrimitive::Float(input));
        return host_all_reduce(nccl, tensor, op, Compression::None);
    }
    // A fresh output: the input's buffer may be shared with other tensors.
    let output = Tensor::<Cuda, 1>::empty([n], &device)
        .into_primitive()
        .tensor();
    let backend_error = |op: &'static str| {
        move |e: &dyn std::fmt::Debug| DistError::TensorData {
            op,
            detail: format!("{e:?}"),
        }
    };
    // NCCL runs on its own stream: the kernels that wrote the input must have finished.
    <Cuda as Backend>::sync(&device).map_err(|e| backend_error("synchronising before NCCL")(&e))?;
    let input_memory = input
        .client
        .get_resource(input.handle.clone())
        .map_err(|e| backend_error("resolving the input device pointer")(&e))?;
    let output_memory = output
        .client
        .get_resource(output.handle.clone())
        .map_err(|e| backend_error("resolving the output device pointer")(&e))?;
    // SAFETY: both resources are contiguous f32 buffers of at least `n` elements on this rank's
    // device, in the primary context that burn-cuda and our NCCL thread share; the managed
    // resources keep them allocated until after the call, which waits for NCCL's stream; the
    // device was synchronised above, so no kernel still writes the input.
    unsafe {
        nccl.all_reduce_device(
            input_memory.resource().ptr,
            output_memory.resource().ptr,
            n,
            crate::comm::DType::F32,
            op,
        )?;
    }
    drop((input_memory, output_memory, input));
    Ok(Tensor::from_primitive(TensorPrimitive::Float(output)))
}
