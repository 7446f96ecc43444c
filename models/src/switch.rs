//! Which kernels run: Burn's own ops or ours ([`OpImpl`]), chosen per op family at run time, and
//! the type test that lets generic model code reach our backend extensions.

use std::any::Any;
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};

use crate::ModelError;

/// Environment variable that picks the conv at start-up: `burn` or `fast`.
pub const CONV_ENV: &str = "BURN_HOROVOD_CONV";
/// Environment variable that picks the BatchNorm at start-up: `burn` or `fast`.
pub const BATCH_NORM_ENV: &str = "BURN_HOROVOD_BATCHNORM";

/// Burn's own op or ours.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OpImpl {
    /// Burn's own op and its default gradients.
    Burn,
    /// Our backend extension: fused kernels on Flex, cuDNN on CUDA where it exists, Burn's op
    /// elsewhere.
    #[default]
    Fast,
}

impl std::str::FromStr for OpImpl {
    type Err = ModelError;

    fn from_str(s: &str) -> Result<Self, ModelError> {
        match s {
            "burn" => Ok(Self::Burn),
            "fast" => Ok(Self::Fast),
            other => Err(ModelError::UnknownOpImpl {
                value: other.to_string(),
            }),
        }
    }
}

impl std::fmt::Display for OpImpl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Burn => "burn",
            Self::Fast => "fast",
        })
    }
}

/// One process-wide choice, read from an environment variable the first time it is asked for.
struct Switch {
    env: &'static str,
    choice: AtomicU8,
}

const UNSET: u8 = 0;
const BURN: u8 = 1;
const FAST: u8 = 2;

impl Switch {
    const fn new(env: &'static str) -> Self {
        Self {
            env,
            choice: AtomicU8::new(UNSET),
        }
    }

    fn set(&self, choice: OpImpl) {
        let v = match choice {
            OpImpl::Burn => BURN,
            OpImpl::Fast => FAST,
        };
        self.choice.store(v, Ordering::Relaxed);
    }

    /// An unreadable variable prints one line on stderr and keeps the default.
    fn get(&self) -> OpImpl {
        match self.choice.load(Ordering::Relaxed) {
            BURN => OpImpl::Burn,
            FAST => OpImpl::Fast,
            _ => {
                let choice = match std::env::var(self.env) {
                    Ok(value) => value.parse().unwrap_or_else(|e| {
                        eprintln!("{}: {e}; using the default, fast", self.env);
                        OpImpl::Fast
                    }),
                    Err(_) => OpImpl::Fast,
                };
                self.set(choice);
                choice
            }
        }
    }
}

static CONV: Switch = Switch::new(CONV_ENV);
static BATCH_NORM: Switch = Switch::new(BATCH_NORM_ENV);

/// Chooses the conv for every model in this process (overrides [`CONV_ENV`]).
pub fn set_conv_impl(choice: OpImpl) {
    CONV.set(choice);
}

/// The conv in use: the last [`set_conv_impl`], else [`CONV_ENV`], else [`OpImpl::Fast`].
pub fn conv_impl() -> OpImpl {
    CONV.get()
}

/// Chooses the BatchNorm for every model in this process (overrides [`BATCH_NORM_ENV`]).
pub fn set_batch_norm_impl(choice: OpImpl) {
    BATCH_NORM.set(choice);
}

/// The BatchNorm in use: the last [`set_batch_norm_impl`], else [`BATCH_NORM_ENV`], else
/// [`OpImpl::Fast`].
pub fn batch_norm_impl() -> OpImpl {
    BATCH_NORM.get()
}

/// Moves `a` into a `T` when they are the same type (how generic model code finds out that its
/// `B: Backend` is one that implements our extensions).
pub(crate) fn cast<A: 'static, T: 'static>(a: A) -> Result<T, A> {
    let mut slot = Some(a);
    match (&mut slot as &mut dyn Any).downcast_mut::<Option<T>>() {
        Some(t) => Ok(t.take().expect("the slot was filled above")),
        None => Err(slot.expect("the slot is only taken on a match")),
    }
}

/// Precision of the convs' arithmetic (`--amp`): what PyTorch's autocast does for convs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum ConvPrecision {
    /// f32 in, f32 arithmetic, f32 out.
    #[default]
    F32,
    /// Inputs cast to bf16 inside the op, f32 accumulation, f32 out; parameters, gradients and
    /// optimizer state stay f32. cuDNN on CUDA only: elsewhere the convs stay f32.
    Bf16,
}

static CONV_BF16: AtomicBool = AtomicBool::new(false);

/// Sets the precision of every conv in this process (default [`ConvPrecision::F32`]).
pub fn set_conv_precision(precision: ConvPrecision) {
    CONV_BF16.store(precision == ConvPrecision::Bf16, Ordering::Relaxed);
}

/// The conv precision in use.
pub fn conv_precision() -> ConvPrecision {
    if CONV_BF16.load(Ordering::Relaxed) {
        ConvPrecision::Bf16
    } else {
        ConvPrecision::F32
    }
}
