//! [`conv2d`], which reaches [`ConvBackend`] from any backend when [`conv_impl`] says `fast`.
//!
//! Models in this workspace are generic over `B: Backend` (train's model registry asks no more of
//! them), so a `B: ConvBackend` bound on `ResNet::forward` would ripple through every caller.
//! Instead [`conv2d`] recognises the backends that implement the extension (Flex, Burn's CUDA
//! backends, and `Autodiff` over them) by type at run time and calls it there; any other backend
//! gets Burn's op. Code that already has the bound calls [`conv2d_with`] directly.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, PaddedConvOptions};
use burn_flex::Flex;

use super::ConvBackend;
use crate::primitive::{float, primitive};
use crate::switch::{OpImpl, cast, conv_impl};

type Args<B> = (Tensor<B, 4>, Tensor<B, 4>, Option<Tensor<B, 1>>);

/// Runs [`conv2d_with`] if `B` is `E`, else hands the arguments back.
fn try_backend<B: Backend, E: ConvBackend>(
    args: Args<B>,
    options: &ConvOptions<2>,
) -> Result<Tensor<B, 4>, Args<B>> {
    let (x, weight, bias) = cast::<Args<B>, Args<E>>(args)?;
    let y = conv2d_with::<E>(x, weight, bias, options.clone());
    Ok(cast::<Tensor<E, 4>, Tensor<B, 4>>(y).unwrap_or_else(|_| unreachable!("B is E")))
}

/// 2-D convolution through [`ConvBackend`] where `B` implements it and [`conv_impl`] is
/// [`OpImpl::Fast`]; Burn's `conv2d` otherwise (and for asymmetric padding).
///
/// # Shapes
/// - `x`: `[N, Ci, H, W]`, `weight`: `[Co, Ci / groups, kh, kw]`, `bias`: `[Co]`
/// - returns `[N, Co, Ho, Wo]`
pub fn conv2d<B: Backend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    options: PaddedConvOptions<2>,
) -> Tensor<B, 4> {
    if conv_impl() == OpImpl::Burn || options.padding_end.is_some() {
        return burn::tensor::module::conv2d(x, weight, bias, options);
    }
    let conv = &options.options;
    let mut args = (x, weight, bias);
    macro_rules! try_each {
        ($($backend:ty),* $(,)?) => {$(
            args = match try_backend::<B, $backend>(args, conv) {
                Ok(y) => return y,
                Err(args) => args,
            };
        )*};
    }
    try_each!(Flex, Autodiff<Flex>);
    #[cfg(feature = "cuda")]
    {
        use super::cuda::{CudaFused, CudaRaw};
        try_each!(CudaFused, Autodiff<CudaFused>, CudaRaw, Autodiff<CudaRaw>);
    }
    let (x, weight, bias) = args;
    burn::tensor::module::conv2d(x, weight, bias, options)
}

/// 2-D convolution through [`ConvBackend`], whatever [`conv_impl`] says.
///
/// # Shapes
/// As [`conv2d`].
pub fn conv2d_with<B: ConvBackend>(
    x: Tensor<B, 4>,
    weight: Tensor<B, 4>,
    bias: Option<Tensor<B, 1>>,
    options: ConvOptions<2>,
) -> Tensor<B, 4> {
    let y = B::conv2d_forward(
        primitive(x),
        primitive(weight),
        bias.map(primitive),
        options,
    );
    float(y)
}
