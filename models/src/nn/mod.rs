//! Modules with the same API as `burn::nn`'s, running our own ops: switch by changing the import.

mod batch_norm;
mod conv2d;

pub use batch_norm::{BatchNorm, BatchNormConfig};
pub use conv2d::{Conv2d, Conv2dConfig};
