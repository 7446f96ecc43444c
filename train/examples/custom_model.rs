//! Train your own model with `train`'s loop, flags and launcher: define the module, implement
//! `ImageClassifier` (one method) and `ClassifierConfig` (how to build it), call `main_with`.
//!
//! `cargo run --release -p train --example custom_model -- --epochs 1`
//! (no ImageNet at the default paths: it trains on the quickstart's synthetic dataset).

use std::process::ExitCode;

use burn::module::Module;
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Tensor, activation::relu};
use models::ImageClassifier;
use train::ClassifierConfig;

/// Three strided 3×3 conv blocks, global average pool, linear head.
#[derive(Module, Debug)]
pub struct SmallCnn<B: Backend> {
    convs: Vec<Conv2d<B>>,
    norms: Vec<BatchNorm<B>>,
    pool: AdaptiveAvgPool2d,
    fc: Linear<B>,
}

impl<B: Backend> ImageClassifier<B> for SmallCnn<B> {
    fn classify(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let mut x = images;
        for (conv, norm) in self.convs.iter().zip(&self.norms) {
            x = relu(norm.forward(conv.forward(x)));
        }
        self.fc.forward(self.pool.forward(x).flatten(1, 3))
    }
}

/// How to build a [`SmallCnn`].
#[derive(Debug, Clone, Copy)]
pub struct SmallCnnConfig {
    /// Channels of the first block; doubled by each next one.
    pub width: usize,
}

impl ClassifierConfig for SmallCnnConfig {
    type Model<B: AutodiffBackend> = SmallCnn<B>;

    fn init<B: AutodiffBackend>(&self, num_classes: usize, device: &B::Device) -> SmallCnn<B> {
        let channels = [3, self.width, self.width * 2, self.width * 4];
        let convs = channels
            .windows(2)
            .map(|c| {
                Conv2dConfig::new([c[0], c[1]], [3, 3])
                    .with_stride([2, 2])
                    .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                    .init(device)
            })
            .collect();
        let norms = channels[1..]
            .iter()
            .map(|&c| BatchNormConfig::new(c).init(device))
            .collect();
        SmallCnn {
            convs,
            norms,
            pool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(channels[3], num_classes).init(device),
        }
    }

    fn name(&self) -> String {
        format!("small-cnn-{}", self.width)
    }
}

#[allow(dead_code)]
fn main() -> ExitCode {
    train::main_with(|_args| Ok(SmallCnnConfig { width: 32 }))
}
