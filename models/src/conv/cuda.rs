//! Burn's CUDA backends (with and without fusion) implement [`ConvBackend`] with cuDNN
//! ([`super::cudnn`]); when `libcudnn` cannot be loaded, or for a case cuDNN is not used for
//! (groups ≠ 1, not f32), they keep Burn's own conv, saying so once.
//!
//! With [`ConvPrecision::Bf16`] (`--amp bf16`) each pass casts its f32 operands to bf16 on the
//! device, runs cuDNN on bf16 with f32 accumulation, and casts the result back to f32: the model,
//! its gradients and the optimizer never see bf16, as with PyTorch's autocast.

use std::sync::Once;

use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, FloatTensor, FloatTensorOps, ModuleOps};
use burn::tensor::{DType, FloatDType, Shape, TensorMetadata};
use burn_cubecl::tensor::CubeTensor;
use cubecl::cuda::CudaRuntime;

use super::ConvBackend;
use super::cpu::Geometry;
use super::cudnn::{self, Pass, Pointers, Problem};
use crate::switch::{ConvPrecision, conv_precision};

pub(crate) use burn_dist::{CubeAccess, CudaFused, CudaRaw};

/// Whether cuDNN can be used; the first `false` prints the one line that says why and how to
/// fix it.
fn cudnn_ready() -> bool {
    static SAID: Once = Once::new();
    match cudnn::unavailable() {
        None => true,
        Some(reason) => {
            SAID.call_once(|| eprintln!("{}", cudnn::fallback_message(reason)));
            false
        }
    }
}

/// The first cuDNN failure at run time, printed once; that call and later ones fall back.
fn warn_failure(error: &cudnn::CudnnFailure) {
    static SAID: Once = Once::new();
    SAID.call_once(|| {
        eprintln!(
            "--conv fast on CUDA: cuDNN failed ({}); falling back to Burn's conv for that call",
            error.0
        )
    });
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

/// An operand as cuDNN reads it: contiguous, cast to bf16 on the device for a bf16 problem.
fn operand(t: CubeTensor<CudaRuntime>, p: &Problem) -> CubeTensor<CudaRuntime> {
    let t = contiguous(t);
    if p.bf16 {
        contiguous(CudaRaw::float_cast(t, FloatDType::BF16))
    } else {
        t
    }
}

/// A fresh output of `shape` in the problem's precision.
fn output(
    shape: [usize; 4],
    device: &<CudaRuntime as cubecl::Runtime>::Device,
    p: &Problem,
) -> CubeTensor<CudaRuntime> {
    let dtype = if p.bf16 {
        FloatDType::BF16
    } else {
        FloatDType::F32
    };
    CudaRaw::float_empty(Shape::new(shape), device, dtype)
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

/// Runs `pass` in place on contiguous `CubeTensor`s (`y` is dy for the gradients).
fn run_pass(
    pass: Pass,
    problem: &Problem,
    x: &CubeTensor<CudaRuntime>,
    w: &CubeTensor<CudaRuntime>,
    y: &CubeTensor<CudaRuntime>,
) -> Result<(), cudnn::CudnnFailure> {
    let pointers = Pointers {
        x: address(x)?,
        w: address(w)?,
        y: address(y)?,
    };
    // cuDNN runs on its own stream: whatever Burn queued that writes an input must be done.
    CudaRaw::sync(&x.device)
        .map_err(|e| cudnn::CudnnFailure(format!("synchronising Burn's work: {e:?}")))?;
    // SAFETY: the three tensors are contiguous, of the problem's shapes and dtype, on `x.device`
    // (checked by `problem`, made contiguous and cast by the callers), they are borrowed for the whole
    // call so cubecl cannot reuse their memory, Burn's work was synchronised above, and the
    // output is a fresh tensor nothing reads before `run` returns (it synchronises its stream).
    unsafe { cudnn::run(x.device.index, pass, problem, &pointers) }
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
    let (x, w) = (
        contiguous(B::into_cube(x)),
        contiguous(B::into_cube(weight)),
    );
    let y = output(p.y, &x.device, &p);
    let y = match run_pass(
        Pass::Forward,
        &p,
        &operand(x.clone(), &p),
        &operand(w.clone(), &p),
        &y,
    ) {
        Ok(()) => to_f32(y, &p),
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
    let input = pass == Pass::InputGrad;
    // cuDNN writes the gradient where that pass's output tensor (dx or dw) goes.
    let grad = output(if input { p.x } else { p.w }, &x.device, &p);
    let dy_operand = operand(dy.clone(), &p);
    let ran = if input {
        run_pass(pass, &p, &grad, &operand(w.clone(), &p), &dy_operand)
    } else {
        run_pass(pass, &p, &operand(x.clone(), &p), &grad, &dy_operand)
    };
    let grad = match ran {
        Ok(()) => to_f32(grad, &p),
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

    /// On a machine without libcudnn (CI, this CPU machine) the probe says so, and the one line
    /// names the library and the fix; with libcudnn present the probe passes.
    #[test]
    fn missing_cudnn_is_reported_with_the_fix() {
        // SAFETY: only tries to dlopen the library.
        let present = unsafe { cudarc::cudnn::sys::is_culib_present() };
        match cudnn::unavailable() {
            None => assert!(present, "the probe passed without libcudnn"),
            Some(reason) => {
                assert!(!present);
                let line = cudnn::fallback_message(reason);
                assert!(!line.contains('\n'), "one line: {line}");
                for needle in ["libcudnn.so.9", "LD_LIBRARY_PATH", "Burn's own kernels"] {
                    assert!(line.contains(needle), "{needle:?} missing from: {line}");
                }
                assert!(!cudnn_ready(), "without libcudnn the CUDA convs fall back");
            }
        }
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
