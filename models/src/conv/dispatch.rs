//! Which conv runs: [`ConvImpl`], and [`conv2d`], which reaches [`ConvBackend`] from any backend.
//!
//! Models in this workspace are generic over `B: Backend` (train's model registry asks no more of
//! them), so a `B: ConvBackend` bound on `ResNet::forward` would ripple through every caller.
//! Instead [`conv2d`] recognises the backends that implement the extension (Flex, Burn's CUDA
//! backends, and `Autodiff` over them) by type at run time and calls it there; any other backend
//! gets Burn's op. Code that already has the bound calls [`conv2d_with`] directly.

use std::any::Any;
use std::sync::atomic::{AtomicU8, Ordering};

use burn::backend::Autodiff;
use burn::tensor::backend::Backend;
use burn::tensor::ops::{ConvOptions, PaddedConvOptions};
use burn::tensor::{Tensor, TensorPrimitive};
use burn_flex::Flex;

use super::ConvBackend;
use crate::ModelError;

/// Environment variable that picks the conv at start-up: `burn` or `fast`.
pub const CONV_ENV: &str = "BURN_HOROVOD_CONV";

/// Which convolution the models run.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvImpl {
    /// Burn's own `conv2d` and its default gradients.
    Burn,
    /// Our [`ConvBackend`] op: GEMM kernels on Flex, Burn's op elsewhere.
    #[default]
    Fast,
}

impl std::str::FromStr for ConvImpl {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "burn" => Ok(Self::Burn),
            "fast" => Ok(Self::Fast),
            other => Err(ModelError::UnknownConv {
                value: other.to_string(),
            }),
        }
    }
}

impl std::fmt::Display for ConvImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Burn => "burn",
            Self::Fast => "fast",
        })
    }
}

const UNSET: u8 = 0;
const BURN: u8 = 1;
const FAST: u8 = 2;
static CHOICE: AtomicU8 = AtomicU8::new(UNSET);

/// Chooses the conv for every model in this process (overrides [`CONV_ENV`]).
pub fn set_conv_impl(choice: ConvImpl) {
    let v = match choice {
        ConvImpl::Burn => BURN,
        ConvImpl::Fast => FAST,
    };
    CHOICE.store(v, Ordering::Relaxed);
}

/// The conv in use: the last [`set_conv_impl`], else [`CONV_ENV`], else [`ConvImpl::Fast`].
///
/// An unreadable [`CONV_ENV`] prints one line on stderr and keeps the default.
pub fn conv_impl() -> ConvImpl {
    match CHOICE.load(Ordering::Relaxed) {
        BURN => ConvImpl::Burn,
        FAST => ConvImpl::Fast,
        _ => {
            let choice = match std::env::var(CONV_ENV) {
                Ok(value) => value.parse().unwrap_or_else(|e| {
                    eprintln!("{e}; using the default, fast");
                    ConvImpl::Fast
                }),
                Err(_) => ConvImpl::Fast,
            };
            set_conv_impl(choice);
            choice
        }
    }
}

/// Moves `a` into a `T` when they are the same type.
fn cast<A: 'static, T: 'static>(a: A) -> Result<T, A> {
    let mut slot = Some(a);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<T>>() {
        Some(t) => Ok(t.take().expect("the slot was filled above")),
        None => Err(slot.expect("the slot is only taken on a match")),
    }
}

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
/// [`ConvImpl::Fast`]; Burn's `conv2d` otherwise (and for asymmetric padding).
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
    if conv_impl() == ConvImpl::Burn || options.padding_end.is_some() {
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
        x.into_primitive().tensor(),
        weight.into_primitive().tensor(),
        bias.map(|b| b.into_primitive().tensor()),
        options,
    );
    Tensor::from_primitive(TensorPrimitive::Float(y))
}
