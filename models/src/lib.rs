#![deny(missing_docs)]
//! The ResNet family (v1.5, as torchvision) as Burn modules, and the [`ImageClassifier`] trait that
//! lets `train` train any model.
//!
//! ```
//! use burn::backend::Flex;
//! use burn::tensor::Tensor;
//! use models::{ImageClassifier, ResNetConfig};
//!
//! let device = Default::default();
//! let model = ResNetConfig::resnet18(10).init::<Flex>(&device);
//! let images = Tensor::<Flex, 4>::zeros([2, 3, 32, 32], &device);
//! assert_eq!(model.classify(images).dims(), [2, 10]);
//! ```
//!
//! Convolutions run our own op ([`conv`]): im2col/col2im + GEMM kernels on the CPU (Flex),
//! cuDNN on CUDA (feature `cuda`; Burn's conv when `libcudnn` is missing). [`nn::Conv2d`] is a
//! drop-in for `burn::nn::conv::Conv2d`. BatchNorm runs our fused op ([`norm`]) on the CPU;
//! [`nn::BatchNorm`] is a drop-in for `burn::nn::BatchNorm`. `BURN_HOROVOD_CONV=burn` or
//! [`set_conv_impl`], and `BURN_HOROVOD_BATCHNORM=burn` or [`set_batch_norm_impl`], switch back to
//! Burn's own ops. [`nn::BatchNorm::forward_relu`] is a norm, a residual sum and a ReLU in one
//! op, and [`pool::max_pool2d`] the stem's max pool on the CPU (Burn's values to the bit).
//!
//! Parameter paths follow torchvision (`conv1`, `bn1`, `layer1.0.conv1`, `layer1.0.downsample.0`,
//! `fc`), so [`torchvision`] can save and load weights as a torchvision `state_dict` in safetensors.

mod block;
mod classifier;
pub mod conv;
mod error;
pub mod nn;
pub mod norm;
mod path;
pub mod pool;
mod primitive;
mod resnet;
mod switch;
pub mod torchvision;

pub use block::Block;
pub use classifier::ImageClassifier;
pub use conv::ConvBackend;
pub use error::ModelError;
pub use norm::BatchNormBackend;
pub use path::num_trainable_params;
pub use resnet::{BlockKind, ResNet, ResNetConfig};
pub use switch::{
    BATCH_NORM_ENV, CONV_ENV, ConvPrecision, OpImpl, batch_norm_impl, conv_impl, conv_precision,
    set_batch_norm_impl, set_conv_impl, set_conv_precision,
};
