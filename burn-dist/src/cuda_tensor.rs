//! CUDA tensors through NCCL by device pointer, with and without Burn's fusion.
//!
//! `burn::backend::Cuda` is `Fusion<CubeBackend<..>>` when Burn's `fusion` feature is on (it is,
//! in this workspace) and a bare `CubeBackend` otherwise. Both are named here ([`CudaFused`],
//! [`CudaRaw`]) so a program can pick either at run time; a fused tensor is resolved to its
//! `CubeTensor` through the fusion client (which first runs the fused work queued on it), and
//! the result is registered back as a fusion tensor.

use crate::comm::{Communicator, ReduceOp};
use crate::error::{DistError, Result};
use crate::tensor::{CollectiveBackend, Compression, host_all_reduce};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorPrimitive};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

/// Burn's CUDA backend without fusion: every op launches its own kernel.
pub type CudaRaw = CubeBackend<CudaRuntime, f32, i32, u8>;
/// Burn's CUDA backend with fusion (what `burn::backend::Cuda` is in this workspace).
pub type CudaFused = burn_fusion::Fusion<CudaRaw>;

/// A CUDA backend whose float tensors can be turned into a `CubeTensor` and back.
pub(crate) trait CubeAccess: Backend {
    /// The tensor's `CubeTensor`, after every queued op that writes it has been launched.
    fn into_cube(tensor: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime>;
    /// The backend's tensor for a `CubeTensor` on `device`.
    fn from_cube(
        tensor: CubeTensor<CudaRuntime>,
        device: &Self::Device,
    ) -> Self::FloatTensorPrimitive;
}

impl CubeAccess for CudaRaw {
    fn into_cube(tensor: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime> {
        tensor
    }
    fn from_cube(tensor: CubeTensor<CudaRuntime>, _: &Self::Device) -> Self::FloatTensorPrimitive {
        tensor
    }
}

impl CubeAccess for CudaFused {
    fn into_cube(tensor: Self::FloatTensorPrimitive) -> CubeTensor<CudaRuntime> {
        let client = tensor.client.clone();
        client.resolve_tensor_float::<CudaRaw>(tensor)
    }
    fn from_cube(
        tensor: CubeTensor<CudaRuntime>,
        device: &Self::Device,
    ) -> Self::FloatTensorPrimitive {
        use burn::backend::ir::{BackendIr, InitOperationIr, OperationIr, OperationOutput};
        let client = burn_fusion::get_client::<CudaRaw>(device);
        let shape = tensor.meta.shape().clone();
        let dtype = tensor.dtype;
        let handle = <CudaRaw as BackendIr>::float_tensor_handle(tensor);
        let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
        client
            .register(
                burn_fusion::stream::OperationStreams::default(),
                OperationIr::Init(init),
                burn_fusion::NoOp::<CudaRaw>::new(),
            )
            .output()
    }
}

impl CollectiveBackend for CudaRaw {
    fn all_reduce_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<Self, 1>> {
        device_all_reduce(comm, tensor, op, compression)
    }
}

impl CollectiveBackend for CudaFused {
    fn all_reduce_float(
        comm: &dyn Communicator,
        tensor: Tensor<Self, 1>,
        op: ReduceOp,
        compression: Compression,
    ) -> Result<Tensor<Self, 1>> {
        device_all_reduce(comm, tensor, op, compression)
    }
}

/// With the NCCL communicator and no compression, all-reduces by device pointer into a fresh
/// output tensor; otherwise host-staged.
fn device_all_reduce<B: CubeAccess>(
    comm: &dyn Communicator,
    tensor: Tensor<B, 1>,
    op: ReduceOp,
    compression: Compression,
) -> Result<Tensor<B, 1>> {
    let Some(nccl) = comm.as_nccl() else {
        return host_all_reduce(comm, tensor, op, compression);
    };
    if compression != Compression::None {
        return host_all_reduce(comm, tensor, op, compression);
    }
    let device = tensor.device();
    let n = tensor.dims()[0];
    let input = B::into_cube(tensor.into_primitive().tensor());
    if !input.is_contiguous() || input.dtype != burn::tensor::DType::F32 {
        let tensor =
            Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::from_cube(input, &device)));
        return host_all_reduce(comm, tensor, op, Compression::None);
    }
    let output = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        input.client.clone(),
        input.device.clone(),
        input.meta.shape().clone(),
        input.dtype,
    );
    let backend_error = |op: &'static str| {
        move |e: &dyn std::fmt::Debug| DistError::TensorData {
            op,
            detail: format!("{e:?}"),
        }
    };
    // NCCL runs on its own stream: the kernels that wrote the input must have finished.
    <B as Backend>::sync(&device).map_err(|e| backend_error("synchronising before NCCL")(&e))?;
    let input_memory = input
        .client
        .get_resource(input.handle.clone())
        .map_err(|e| backend_error("resolving the input device pointer")(&e))?;
    let output_memory = output
        .client
        .get_resource(output.handle.clone())
        .map_err(|e| backend_error("resolving the output device pointer")(&e))?;
    // SAFETY: both resources are contiguous f32 buffers of `n` elements (the pointers include
    // the handles' offsets) on this rank's device, in the primary context that burn-cuda and our
    // NCCL thread share; the managed resources keep them allocated until after the call, which
    // waits for NCCL's stream; the device was synchronised above, so no kernel still writes the
    // input.
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
    Ok(Tensor::from_primitive(TensorPrimitive::Float(
        B::from_cube(output, &device),
    )))
}
