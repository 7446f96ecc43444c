//! Burn's CUDA backends (with and without fusion) implement [`ConvBackend`] with cuDNN
//! ([`super::cudnn`]); when `libcudnn` cannot be loaded, or for a case cuDNN is not used for
//! (groups ≠ 1, not f32), they keep Burn's own conv, saying so once.
//!
//! With [`ConvPrecision::Bf16`] (`--amp bf16`) each pass casts its f32 operands to bf16 on the
//! device, runs cuDNN on bf16 with f32 accumulation, and casts the result back to f32: the model,
//! its gradients and the optimizer never see bf16, as with PyTorch's autocast.

use std::sync::{Once, OnceLock};

use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, ModuleOps};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::ConvBackend;
use super::cpu::Geometry;
use super::cudnn::{self, Layouts, Pass, Pointers, Problem};
use super::layout::{LayoutError, TensorLayout};
use crate::switch::{ConvPrecision, conv_precision};

pub(crate) use burn_dist::{CubeAccess, CudaFused, CudaRaw};

/// The first cuDNN failure of the process. Once set, every conv goes to Burn's kernels: a call
/// that failed is not retried (each retry would cost a device sync, and cuDNN fails the same way).
pub(crate) struct FirstFailure(OnceLock<String>);

impl FirstFailure {
    pub(crate) const fn new() -> Self {
        Self(OnceLock::new())
    }

    /// Records `error`; `true` the first time (the caller says it, once).
    pub(crate) fn record(&self, error: &str) -> bool {
        self.0.set(error.to_string()).is_ok()
    }

    pub(crate) fn get(&self) -> Option<&str> {
        self.0.get().map(String::as_str)
    }
}

static FAILED: FirstFailure = FirstFailure::new();

/// Whether cuDNN can be used: it loads with its sub-libraries and has not failed yet. The first
/// `false` for a missing cuDNN prints the one line that says why and how to fix it.
fn cudnn_ready() -> bool {
    static SAID: Once = Once::new();
    if FAILED.get().is_some() {
        return false;
    }
    match cudnn::unavailable() {
        None => true,
        Some(reason) => {
            SAID.call_once(|| eprintln!("{}", cudnn::fallback_message(reason)));
            false
        }
    }
}

/// Why cuDNN is not used (see [`super::cudnn_unavailable`]).
pub(crate) fn unavailable_reason() -> Option<String> {
    if let Some(failure) = FAILED.get() {
        return Some(format!("cuDNN failed earlier: {failure}"));
    }
    cudnn::unavailable().map(str::to_string)
}

/// Records the first cuDNN failure, says it once; this and every later conv use Burn's kernels.
fn warn_failure(error: &cudnn::CudnnFailure) {
    if FAILED.record(&error.0) {
        eprintln!(
            "--conv fast on CUDA: cuDNN failed ({}); Burn's conv runs this and every later conv",
            error.0
        );
    }
}

fn dims4(shape: &Shape) -> Option<[usize; 4]> {
    (shape.num_dims() == 4).then(|| [shape[0], shape[1], shape[2], shape[3]])
}

/// The cuDNN problem, when cuDNN takes this case: f32 tensors, groups 1, a non-empty output;
/// computed in `precision`.
fn problem(
    x: &Shape,
    w: &Shape,
    dtypes: &[DType],
    options: &ConvOptions<2>,
    precision: ConvPrecision,
) -> Option<Problem> {
    if options.groups != 1 || dtypes.iter().any(|d| *d != DType::F32) {
        return None;
    }
    let (x, w) = (dims4(x)?, dims4(w)?);
    if x[1] != w[1] {
        return None;
    }
    let g = Geometry::new(x, w, options.stride, options.padding, options.dilation)?;
    Some(Problem {
        x,
        w,
        y: [x[0], w[0], g.out[0], g.out[1]],
        stride: options.stride,
        padding: options.padding,
        dilation: options.dilation,
        bf16: precision == ConvPrecision::Bf16,
    })
}

/// A tensor cuDNN reads or writes, with the layout its descriptor gets.
struct Operand {
    tensor: CubeTensor<CudaRuntime>,
    layout: TensorLayout,
}

fn refused(what: &'static str) -> impl Fn(LayoutError) -> cudnn::CudnnFailure {
    move |e| cudnn::CudnnFailure(format!("cuDNN cannot describe {what}'s layout: {e}"))
}

/// The layout of `t` as its strides and buffer say (cubecl pads rows: never assume packed).
fn layout_of(t: &CubeTensor<CudaRuntime>) -> Result<TensorLayout, LayoutError> {
    TensorLayout::describe(t.meta.shape(), t.meta.strides(), elems_in_buffer(t))
}

fn filter_layout_of(t: &CubeTensor<CudaRuntime>) -> Result<TensorLayout, LayoutError> {
    TensorLayout::filter(t.meta.shape(), t.meta.strides(), elems_in_buffer(t))
}

fn elems_in_buffer(t: &CubeTensor<CudaRuntime>) -> usize {
    t.handle.size_in_used() as usize / t.dtype.size()
}

fn in_precision(t: CubeTensor<CudaRuntime>, p: &Problem) -> CubeTensor<CudaRuntime> {
    if p.bf16 {
        CudaRaw::float_cast(t, FloatDType::BF16)
    } else {
        t
    }
}

/// How a pass's activations (x, y, dx, dy) are handed to cuDNN.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Packing {
    /// As cubecl lays them out, pitched rows described by their strides (no copy).
    AsTheyLie,
    /// Packed NCHW: a copy of each input, a packed output.
    Packed,
}

/// `BURN_HOROVOD_CUDNN_PACKED=1` hands cuDNN packed copies of every activation from the first
/// try; anything else describes pitched rows by their strides (no copy). On an H200 our fp32
/// step took 4× PyTorch's time with the GPU busy: cuDNN's fast kernels may want packed tensors,
/// and the switch lets one run compare the two (`scripts/gpu-check.sh` speed group).
fn first_packing(value: Option<&str>) -> Packing {
    if value.is_some_and(|v| v.trim() == "1") {
        Packing::Packed
    } else {
        Packing::AsTheyLie
    }
}

/// The layout a pass tries first in this process ([`first_packing`] of the environment).
fn preferred_packing() -> Packing {
    static FIRST: OnceLock<Packing> = OnceLock::new();
    *FIRST.get_or_init(|| first_packing(std::env::var("BURN_HOROVOD_CUDNN_PACKED").ok().as_deref()))
}

/// Runs `attempt` with the operands laid out as `first` says; after a failure with pitched
/// operands, once more with packed ones: cuDNN 9.14 on an H200 found no backward-data algorithm
/// for some row-padded dx/dy (cubecl pads W = 7, 14, 28, 56 rows) that it had for their packed
/// twins. Only a failure of the packed pass turns cuDNN off.
fn in_layouts<T>(
    first: Packing,
    attempt: impl Fn(Packing) -> Result<T, cudnn::CudnnFailure>,
) -> Result<T, cudnn::CudnnFailure> {
    match first {
        Packing::Packed => attempt(Packing::Packed),
        Packing::AsTheyLie => attempt(Packing::AsTheyLie).or_else(|first| {
            attempt(Packing::Packed).map_err(|again| {
                cudnn::CudnnFailure(format!(
                    "{} (with packed operands too: {})",
                    first.0, again.0
                ))
            })
        }),
    }
}

/// x or dy as cuDNN reads it, in the problem's precision: as it lies when cuDNN can describe its
/// strides (pitched rows included: no copy) and `packing` allows, else a packed copy.
fn activation(
    t: CubeTensor<CudaRuntime>,
    p: &Problem,
    packing: Packing,
) -> Result<Operand, cudnn::CudnnFailure> {
    let t = in_precision(t, p);
    if let Ok(layout) = layout_of(&t)
        && (packing == Packing::AsTheyLie || layout.is_packed())
    {
        return Ok(Operand { tensor: t, layout });
    }
    let tensor = contiguous(t);
    let layout = layout_of(&tensor).map_err(refused("an input"))?;
    Ok(Operand { tensor, layout })
}

/// The weight as cuDNN reads it: packed NCHW (filter descriptors take no strides), copied when
/// cubecl padded its rows (3×3 and 7×7 filters are).
fn filter(t: CubeTensor<CudaRuntime>, p: &Problem) -> Result<Operand, cudnn::CudnnFailure> {
    let t = in_precision(t, p);
    let tensor = if filter_layout_of(&t).is_ok() {
        t
    } else {
        contiguous(t)
    };
    let layout = filter_layout_of(&tensor).map_err(refused("the weight"))?;
    Ok(Operand { tensor, layout })
}

fn dtype_of(p: &Problem) -> FloatDType {
    if p.bf16 {
        FloatDType::BF16
    } else {
        FloatDType::F32
    }
}

/// A fresh y or dx on `like`'s device: as cubecl lays it out (pitched rows, described with its
/// real strides), or packed.
fn fresh_activation(
    shape: [usize; 4],
    like: &CubeTensor<CudaRuntime>,
    p: &Problem,
    packing: Packing,
) -> Result<Operand, cudnn::CudnnFailure> {
    let tensor = match packing {
        Packing::AsTheyLie => CudaRaw::float_empty(Shape::new(shape), &like.device, dtype_of(p)),
        Packing::Packed => burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
            like.client.clone(),
            like.device.clone(),
            Shape::new(shape),
            dtype_of(p).into(),
        ),
    };
    let layout = layout_of(&tensor).map_err(refused("the output"))?;
    Ok(Operand { tensor, layout })
}

/// A fresh dw, packed (a filter descriptor has no strides; cubecl would pad its rows).
fn fresh_filter(
    shape: [usize; 4],
    like: &CubeTensor<CudaRuntime>,
    p: &Problem,
) -> Result<Operand, cudnn::CudnnFailure> {
    let tensor = burn_cubecl::ops::numeric::empty_device_contiguous_dtype(
        like.client.clone(),
        like.device.clone(),
        Shape::new(shape),
        dtype_of(p).into(),
    );
    let layout = filter_layout_of(&tensor).map_err(refused("the weight gradient"))?;
    Ok(Operand { tensor, layout })
}

/// A pass's result back in f32.
fn to_f32(t: CubeTensor<CudaRuntime>, p: &Problem) -> CubeTensor<CudaRuntime> {
    if p.bf16 {
        CudaRaw::float_cast(t, FloatDType::F32)
    } else {
        t
    }
}

fn contiguous(t: CubeTensor<CudaRuntime>) -> CubeTensor<CudaRuntime> {
    burn_cubecl::kernel::into_contiguous(t)
}

fn address(t: &CubeTensor<CudaRuntime>) -> Result<u64, cudnn::CudnnFailure> {
    t.client
        .get_resource(t.handle.clone())
        .map(|r| r.resource().ptr)
        .map_err(|e| cudnn::CudnnFailure(format!("reaching a tensor's buffer: {e:?}")))
}

/// Runs `pass` in place (`y` is dy for the gradients).
fn run_pass(
    pass: Pass,
    problem: &Problem,
    x: &Operand,
    w: &Operand,
    y: &Operand,
) -> Result<(), cudnn::CudnnFailure> {
    let pointers = Pointers {
        x: address(&x.tensor)?,
        w: address(&w.tensor)?,
        y: address(&y.tensor)?,
    };
    let layouts = Layouts {
        x: x.layout,
        w: w.layout,
        y: y.layout,
    };
    // cuDNN runs on its own stream: whatever Burn queued that writes an input must be done.
    CudaRaw::sync(&x.tensor.device)
        .map_err(|e| cudnn::CudnnFailure(format!("synchronising Burn's work: {e:?}")))?;
    // SAFETY: each layout was computed from its tensor's shape, strides and buffer size (every
    // element it reaches is inside the buffer), the tensors are of the problem's dtype (cast by
    // the callers) on `x.device`, borrowed for the whole call so cubecl cannot reuse their
    // memory; Burn's work was synchronised above, and the output is a fresh tensor nothing reads
    // before `run` returns (it synchronises its stream).
    unsafe { cudnn::run(x.tensor.device.index, pass, problem, &layouts, &pointers) }
}

fn forward<B: CubeAccess>(
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    bias: Option<FloatTensor<B>>,
    options: ConvOptions<2>,
) -> FloatTensor<B> {
    let dtypes = [x.dtype(), weight.dtype()];
    let Some(p) = problem(
        &x.shape(),
        &weight.shape(),
        &dtypes,
        &options,
        conv_precision(),
    )
    .filter(|_| cudnn_ready()) else {
        return B::conv2d(x, weight, bias, options);
    };
    let device = B::float_device(&x);
    let (x, w) = (B::into_cube(x), B::into_cube(weight));
    let attempt = |packed: Packing| -> Result<CubeTensor<CudaRuntime>, cudnn::CudnnFailure> {
        let y = fresh_activation(p.y, &x, &p, packed)?;
        run_pass(
            Pass::Forward,
            &p,
            &activation(x.clone(), &p, packed)?,
            &filter(w.clone(), &p)?,
            &y,
        )?;
        Ok(y.tensor)
    };
    let ran = in_layouts(preferred_packing(), attempt);
    let y = match ran {
        Ok(y) => to_f32(y, &p),
        Err(e) => {
            warn_failure(&e);
            CudaRaw::conv2d(x, w, None, options)
        }
    };
    let y = B::from_cube(y, &device);
    match bias {
        Some(bias) => {
            let bias = B::float_reshape(bias, Shape::new([1, p.y[1], 1, 1]));
            B::float_add(y, bias)
        }
        None => y,
    }
}

/// Burn's own op for a gradient pass.
fn burn_gradient<C: Backend>(
    pass: Pass,
    x: FloatTensor<C>,
    weight: FloatTensor<C>,
    output_grad: FloatTensor<C>,
    options: ConvOptions<2>,
) -> FloatTensor<C> {
    match pass {
        Pass::InputGrad => C::conv2d_x_backward(x, weight, output_grad, options),
        Pass::WeightGrad => C::conv2d_weight_backward(x, weight, output_grad, options),
        Pass::Forward => unreachable!("the forward pass is not a gradient"),
    }
}

/// The input gradient (`Pass::InputGrad`) or weight gradient (`Pass::WeightGrad`) on cuDNN, or
/// Burn's op when cuDNN does not take the case or fails.
fn gradient<B: CubeAccess>(
    pass: Pass,
    x: FloatTensor<B>,
    weight: FloatTensor<B>,
    output_grad: FloatTensor<B>,
    options: ConvOptions<2>,
) -> FloatTensor<B> {
    let dtypes = [x.dtype(), weight.dtype(), output_grad.dtype()];
    let Some(p) = problem(
        &x.shape(),
        &weight.shape(),
        &dtypes,
        &options,
        conv_precision(),
    )
    .filter(|p| dims4(&output_grad.shape()) == Some(p.y) && cudnn_ready()) else {
        return burn_gradient::<B>(pass, x, weight, output_grad, options);
    };
    let device = B::float_device(&x);
    let (x, w, dy) = (
        B::into_cube(x),
        B::into_cube(weight),
        B::into_cube(output_grad),
    );
    let attempt = |packed: Packing| -> Result<CubeTensor<CudaRuntime>, cudnn::CudnnFailure> {
        let dy_operand = activation(dy.clone(), &p, packed)?;
        // cuDNN writes the gradient where that pass's output tensor (dx or dw) goes.
        if pass == Pass::InputGrad {
            let dx = fresh_activation(p.x, &x, &p, packed)?;
            run_pass(pass, &p, &dx, &filter(w.clone(), &p)?, &dy_operand)?;
            Ok(dx.tensor)
        } else {
            let dw = fresh_filter(p.w, &w, &p)?;
            run_pass(
                pass,
                &p,
                &activation(x.clone(), &p, packed)?,
                &dw,
                &dy_operand,
            )?;
            Ok(dw.tensor)
        }
    };
    let ran = in_layouts(preferred_packing(), attempt);
    let grad = match ran {
        Ok(grad) => to_f32(grad, &p),
        Err(e) => {
            warn_failure(&e);
            burn_gradient::<CudaRaw>(pass, x, w, dy, options)
        }
    };
    B::from_cube(grad, &device)
}

macro_rules! cudnn_conv_backend {
    ($backend:ty) => {
        impl ConvBackend for $backend {
            fn conv2d_forward(
                x: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                bias: Option<FloatTensor<Self>>,
                options: ConvOptions<2>,
            ) -> FloatTensor<Self> {
                forward::<Self>(x, weight, bias, options)
            }

            fn conv2d_input_grad(
                x: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                output_grad: FloatTensor<Self>,
                options: ConvOptions<2>,
            ) -> FloatTensor<Self> {
                gradient::<Self>(Pass::InputGrad, x, weight, output_grad, options)
            }

            fn conv2d_weight_grad(
                x: FloatTensor<Self>,
                weight: FloatTensor<Self>,
                output_grad: FloatTensor<Self>,
                options: ConvOptions<2>,
            ) -> FloatTensor<Self> {
                gradient::<Self>(Pass::WeightGrad, x, weight, output_grad, options)
            }
        }
    };
}

cudnn_conv_backend!(CudaRaw);
cudnn_conv_backend!(CudaFused);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_first_cudnn_failure_is_kept_and_said_once() {
        let failed = FirstFailure::new();
        assert_eq!(failed.get(), None);
        assert!(failed.record("cudnnConvolutionForward: CUDNN_STATUS_EXECUTION_FAILED"));
        assert!(!failed.record("a later failure"), "said once");
        assert_eq!(
            failed.get(),
            Some("cudnnConvolutionForward: CUDNN_STATUS_EXECUTION_FAILED"),
            "the first cause is the one kept"
        );
    }

    #[test]
    fn packed_operands_come_first_only_when_asked_for() {
        assert_eq!(first_packing(None), Packing::AsTheyLie);
        assert_eq!(first_packing(Some("0")), Packing::AsTheyLie);
        assert_eq!(first_packing(Some("yes")), Packing::AsTheyLie);
        assert_eq!(first_packing(Some("1")), Packing::Packed);
        assert_eq!(first_packing(Some(" 1\n")), Packing::Packed);
    }

    #[test]
    fn a_pitched_failure_is_retried_packed_and_a_packed_one_is_final() {
        use std::cell::RefCell;
        let fail = |what: &str| cudnn::CudnnFailure(what.to_string());
        // Pitched fails, packed works: the packed result, after two tries.
        let tried = RefCell::new(Vec::new());
        let ran = in_layouts(Packing::AsTheyLie, |p| {
            tried.borrow_mut().push(p);
            if p == Packing::AsTheyLie {
                Err(fail("no InputGrad algorithm"))
            } else {
                Ok(7)
            }
        });
        assert_eq!(ran.ok(), Some(7));
        assert_eq!(*tried.borrow(), [Packing::AsTheyLie, Packing::Packed]);
        // Both fail: one error naming both causes.
        let ran = in_layouts(Packing::AsTheyLie, |p| {
            Err::<(), _>(fail(if p == Packing::Packed {
                "packed: no"
            } else {
                "pitched: no"
            }))
        });
        let message = ran.expect_err("both failed").0;
        assert!(
            message.contains("pitched: no") && message.contains("packed: no"),
            "{message}"
        );
        // Packed first: one try, its error as it is.
        let tried = RefCell::new(Vec::new());
        let ran = in_layouts(Packing::Packed, |p| {
            tried.borrow_mut().push(p);
            Err::<(), _>(fail("packed: no"))
        });
        assert_eq!(ran.expect_err("failed").0, "packed: no");
        assert_eq!(*tried.borrow(), [Packing::Packed]);
    }

    #[test]
    fn cudnn_takes_f32_groups_one_only() {
        let options = ConvOptions::new([2, 2], [1, 1], [1, 1], 1);
        let (x, w) = (Shape::new([2, 4, 9, 9]), Shape::new([8, 4, 3, 3]));
        let f32s = [DType::F32, DType::F32];
        let p = problem(&x, &w, &f32s, &options, ConvPrecision::F32).expect("a cuDNN case");
        assert_eq!(p.y, [2, 8, 5, 5]);
        assert!(!p.bf16);
        let p = problem(&x, &w, &f32s, &options, ConvPrecision::Bf16).expect("a bf16 case");
        assert!(p.bf16, "--amp bf16 makes a bf16 problem of f32 tensors");
        let f16 = [DType::F16, DType::F32];
        assert!(problem(&x, &w, &f16, &options, ConvPrecision::F32).is_none());
        let grouped = ConvOptions::new([1, 1], [1, 1], [1, 1], 2);
        let w2 = Shape::new([8, 2, 3, 3]);
        assert!(problem(&x, &w2, &f32s, &grouped, ConvPrecision::F32).is_none());
    }
}
