//! CUDA tensors through NCCL by device pointer, with and without Burn's fusion.
//!
//! `burn::backend::Cuda` is `Fusion<CubeBackend<..>>` when Burn's `fusion` feature is on (it is,
//! in this workspace) and a bare `CubeBackend` otherwise. Both are named here ([`CudaFused`],
//! [`CudaRaw`]) so a program can pick either at run time; a fused tensor is resolved to its
//! `CubeTensor` through the fusion client (which first runs the fused work queued on it), and
//! the result is registered back as a fusion tensor.

use crate::comm::device_call::{Collective, DeviceCall};
use crate::comm::{Communicator, ReduceOp};
use crate::error::{DistError, Result};
use crate::sync::tensor::{CollectiveBackend, Compression, host_all_reduce, host_broadcast};
use burn::tensor::backend::Backend;
use burn::tensor::{DType, FloatDType, Tensor, TensorPrimitive};
use burn_cubecl::CubeBackend;
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

/// Burn's CUDA backend without fusion: every op launches its own kernel.
pub type CudaRaw = CubeBackend<CudaRuntime, f32, i32, u8>;
/// Burn's CUDA backend with fusion (what `burn::backend::Cuda` is in this workspace).
pub type CudaFused = burn_fusion::Fusion<CudaRaw>;

/// A CUDA backend whose float tensors can be turned into a `CubeTensor` and back: how the NCCL
/// path here and the cuDNN conv in `models` reach raw device buffers, with or without fusion.
pub trait CubeAccess: Backend {
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

macro_rules! device_collectives {
    ($backend:ty) => {
        impl CollectiveBackend for $backend {
            fn all_reduce_float(
                comm: &dyn Communicator,
                tensor: Tensor<Self, 1>,
                op: ReduceOp,
                compression: Compression,
            ) -> Result<Tensor<Self, 1>> {
                let mut out = device_all_reduce(comm, vec![tensor], op, compression)?;
                out.pop().ok_or(DistError::InvalidBuffer {
                    op: "all_reduce",
                    detail: "no tensor came back".into(),
                })
            }

            fn all_reduce_floats(
                comm: &dyn Communicator,
                tensors: Vec<Tensor<Self, 1>>,
                op: ReduceOp,
                compression: Compression,
            ) -> Result<Vec<Tensor<Self, 1>>> {
                device_all_reduce(comm, tensors, op, compression)
            }

            fn broadcast_float(
                comm: &dyn Communicator,
                tensor: Tensor<Self, 1>,
                root: usize,
            ) -> Result<Tensor<Self, 1>> {
                device_broadcast(comm, tensor, root)
            }
        }
    };
}

device_collectives!(CudaRaw);
device_collectives!(CudaFused);

fn backend_error(op: &'static str) -> impl Fn(&dyn std::fmt::Debug) -> DistError {
    move |e| DistError::TensorData {
        op,
        detail: format!("{e:?}"),
    }
}

/// The wire type of a compression, as Burn and as NCCL name it.
fn wire_dtype(compression: Compression) -> (FloatDType, crate::comm::DType) {
    match compression {
        Compression::None => (FloatDType::F32, crate::comm::DType::F32),
        Compression::Fp16 => (FloatDType::F16, crate::comm::DType::F16),
        Compression::Bf16 => (FloatDType::BF16, crate::comm::DType::BF16),
    }
}

fn nccl_dtype(dtype: DType) -> Option<crate::comm::DType> {
    match dtype {
        DType::F32 => Some(crate::comm::DType::F32),
        DType::F16 => Some(crate::comm::DType::F16),
        DType::BF16 => Some(crate::comm::DType::BF16),
        DType::F64 => Some(crate::comm::DType::F64),
        _ => None,
    }
}

/// A contiguous `CubeTensor` of `tensor`, launching a copy kernel if it is a strided view.
fn contiguous_cube<B: CubeAccess>(tensor: Tensor<B, 1>) -> CubeTensor<CudaRuntime> {
    let cube = B::into_cube(tensor.into_primitive().tensor());
    if cube.is_contiguous() {
        cube
    } else {
        burn_cubecl::kernel::into_contiguous(cube)
    }
}

/// The raw address of a contiguous `CubeTensor`'s first element (the handle's offset included,
/// so views that start inside a larger allocation work).
fn device_address(tensor: &CubeTensor<CudaRuntime>, op: &'static str) -> Result<u64> {
    let resource = tensor
        .client
        .get_resource(tensor.handle.clone())
        .map_err(|e| backend_error(op)(&e))?;
    Ok(resource.resource().ptr)
}

/// The element count of a tensor NCCL may address as `count` packed elements from its first
/// address: strides packed (length-1 dimensions aside) and the buffer at least that long. cubecl
/// pads rows of most CUDA allocations (see `models`' conv layout), so a tensor is never assumed
/// packed because of its shape alone.
fn packed_count(
    shape: &[usize],
    strides: &[usize],
    buffer_bytes: usize,
    elem_bytes: usize,
) -> std::result::Result<usize, String> {
    if shape.len() != strides.len() {
        return Err(format!(
            "shape {shape:?} and strides {strides:?} differ in rank"
        ));
    }
    let count: usize = shape.iter().product();
    let mut expected = 1usize;
    for (&dim, &stride) in shape.iter().zip(strides).rev() {
        if dim != 1 && stride != expected {
            return Err(format!(
                "shape {shape:?} with strides {strides:?} is not packed; NCCL reads elements back to back"
            ));
        }
        expected *= dim;
    }
    if count * elem_bytes > buffer_bytes {
        return Err(format!(
            "{count} elements of {elem_bytes} bytes need {} bytes, the buffer holds {buffer_bytes}",
            count * elem_bytes
        ));
    }
    Ok(count)
}

fn nccl_count(tensor: &CubeTensor<CudaRuntime>, op: &'static str) -> Result<usize> {
    packed_count(
        tensor.meta.shape(),
        tensor.meta.strides(),
        tensor.handle.size_in_used() as usize,
        tensor.dtype.size(),
    )
    .map_err(|detail| DistError::InvalidBuffer { op, detail })
}

/// Runs `make(input, output)` for each pair on NCCL, after one device synchronisation, and keeps
/// every buffer alive until NCCL is done with it.
fn run_on_nccl<B: CubeAccess>(
    nccl: &crate::Nccl,
    name: &'static str,
    device: &B::Device,
    pairs: &[(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)],
    make: impl Fn(u64, u64, usize, crate::comm::DType) -> DeviceCall,
) -> Result<()> {
    let mut calls = Vec::with_capacity(pairs.len());
    for (input, output) in pairs {
        let dtype = nccl_dtype(input.dtype).ok_or(DistError::TensorData {
            op: name,
            detail: format!("NCCL cannot reduce {:?} tensors", input.dtype),
        })?;
        let count = nccl_count(input, name)?;
        if nccl_count(output, name)? != count || output.dtype != input.dtype {
            return Err(DistError::InvalidBuffer {
                op: name,
                detail: "the output is not the input's size and dtype".into(),
            });
        }
        calls.push(make(
            device_address(input, name)?,
            device_address(output, name)?,
            count,
            dtype,
        ));
    }
    // NCCL runs on its own stream: every kernel that wrote an input must have finished. Burn's
    // compute stream is not reachable from here to wait on an event, so this is a device-wide
    // synchronisation, once per call (all buckets of a step share it).
    <B as Backend>::sync(device).map_err(|e| backend_error("synchronising before NCCL")(&e))?;
    let keep_alive: Box<dyn Send> = Box::new(pairs.to_vec());
    // SAFETY: every address is the first element of a contiguous tensor with `count` elements of
    // `dtype` on this rank's device (the primary context, which burn-cuda and the NCCL thread
    // share); `keep_alive` holds those tensors' handles, so cubecl does not reuse the memory
    // until the NCCL thread drops them; the device was synchronised above, so no kernel still
    // writes an input; the outputs are fresh tensors nothing else reads before we return.
    unsafe { nccl.run_device(name, calls, keep_alive) }
}

/// With the NCCL communicator, all-reduces by device pointer into fresh output tensors, casting
/// to the compression's type on the device; otherwise host-staged.
fn device_all_reduce<B: CubeAccess>(
    comm: &dyn Communicator,
    tensors: Vec<Tensor<B, 1>>,
    op: ReduceOp,
    compression: Compression,
) -> Result<Vec<Tensor<B, 1>>> {
    let Some(nccl) = comm.as_nccl() else {
        return tensors
            .into_iter()
            .map(|t| host_all_reduce(comm, t, op, compression))
            .collect();
    };
    let Some(device) = tensors.first().map(Tensor::device) else {
        return Ok(tensors);
    };
    let (wire, _) = wire_dtype(compression);
    let originals: Vec<DType> = tensors.iter().map(Tensor::dtype).collect();
    let pairs: Vec<(CubeTensor<CudaRuntime>, CubeTensor<CudaRuntime>)> = tensors
        .into_iter()
        .map(|t| {
            let t = if compression == Compression::None {
                t
            } else {
                t.cast(wire)
            };
            let input = contiguous_cube(t);
            let output = empty_like(&input);
            (input, output)
        })
        .collect();
    run_on_nccl::<B>(
        nccl,
        "ncclAllReduce",
        &device,
        &pairs,
        |send, recv, count, dtype| DeviceCall {
            collective: Collective::AllReduce(op),
            send,
            recv,
            count,
            dtype,
        },
    )?;
    Ok(pairs
        .into_iter()
        .zip(originals)
        .map(|((_, output), original)| {
            let t = Tensor::<B, 1>::from_primitive(TensorPrimitive::Float(B::from_cube(
                output, &device,
            )));
            if compression == Compression::None {
                t
            } else {
                t.cast(original)
            }
        })
        .collect())
}

/// With the NCCL communicator, broadcasts by device pointer; otherwise host-staged.
fn device_broadcast<B: CubeAccess>(
    comm: &dyn Communicator,
    tensor: Tensor<B, 1>,
    root: usize,
) -> Result<Tensor<B, 1>> {
    let Some(nccl) = comm.as_nccl() else {
        return host_broadcast(comm, tensor, root);
    };
    let device = tensor.device();
    let input = contiguous_cube(tensor);
    let output = empty_like(&input);
    let pairs = [(input, output)];
    run_on_nccl::<B>(
        nccl,
        "ncclBroadcast",
        &device,
        &pairs,
        |send, recv, count, dtype| DeviceCall {
            collective: Collective::Broadcast { root },
            send,
            recv,
            count,
            dtype,
        },
    )?;
    let [(_, output)] = pairs;
    Ok(Tensor::from_primitive(TensorPrimitive::Float(
        B::from_cube(output, &device),
    )))
}

fn empty_like(tensor: &CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
    burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        tensor.client.clone(),
        tensor.device.clone(),
        tensor.meta.shape().clone(),
        tensor.dtype,
    )
}

#[cfg(test)]
mod tests {
    use super::packed_count;

    #[test]
    fn only_packed_buffers_of_the_right_size_reach_nccl() {
        assert_eq!(packed_count(&[10], &[1], 40, 4), Ok(10));
        assert_eq!(packed_count(&[2, 1, 5], &[5, 99, 1], 40, 4), Ok(10));
        // A pitched [3, 7] f32 tensor (cubecl pads 28-byte rows to 32 bytes).
        let pitched = packed_count(&[3, 7], &[8, 1], 96, 4).expect_err("pitched");
        assert!(pitched.contains("not packed"), "{pitched}");
        // A strided view of every other element.
        assert!(packed_count(&[5], &[2], 40, 4).is_err());
        // A buffer shorter than the count says.
        let short = packed_count(&[10], &[1], 36, 4).expect_err("short");
        assert!(short.contains("36"), "{short}");
        assert_eq!(packed_count(&[0], &[1], 0, 2), Ok(0));
    }
}
