use burn::config::Config;
use burn::module::Module;
use burn::nn::pool::{AdaptiveAvgPool2d, AdaptiveAvgPool2dConfig, MaxPool2d, MaxPool2dConfig};
use burn::nn::{Linear, LinearConfig, PaddingConfig2d};
use burn::tensor::{Tensor, backend::Backend};

use crate::block::{Block, batch_norm, conv};
use crate::nn::{BatchNorm, Conv2d};
use crate::{ImageClassifier, ModelError};

/// Which residual block a ResNet stacks.
#[derive(Config, Debug, Copy, PartialEq, Eq)]
pub enum BlockKind {
    /// Two 3×3 convs, expansion 1 (ResNet-18/34).
    Basic,
    /// 1×1, 3×3, 1×1 convs, expansion 4 (ResNet-50/101/152).
    Bottleneck,
}

impl BlockKind {
    /// Output channels of a block over its `planes`.
    pub fn expansion(self) -> usize {
        match self {
            BlockKind::Basic => 1,
            BlockKind::Bottleneck => 4,
        }
    }
}

/// Configuration of a [`ResNet`] (He et al. 2015, v1.5 as torchvision).
#[derive(Config, Debug)]
pub struct ResNetConfig {
    /// Number of blocks in `layer1` .. `layer4`.
    pub layers: [usize; 4],
    /// The residual block.
    pub block: BlockKind,
    /// Number of output classes of `fc`.
    #[config(default = 1000)]
    pub num_classes: usize,
    /// Start every block's last BatchNorm at weight 0, so that each block starts as the identity
    /// (Goyal et al. 2017 §5.1; torchvision's `zero_init_residual`).
    #[config(default = false)]
    pub zero_init_residual: bool,
}

impl ResNetConfig {
    /// The standard layout for a depth: 18, 34, 50, 101 or 152.
    ///
    /// # Errors
    /// [`ModelError::UnsupportedDepth`] for any other depth.
    pub fn from_depth(depth: usize, num_classes: usize) -> Result<Self, ModelError> {
        let (layers, block) = match depth {
            18 => ([2, 2, 2, 2], BlockKind::Basic),
            34 => ([3, 4, 6, 3], BlockKind::Basic),
            50 => ([3, 4, 6, 3], BlockKind::Bottleneck),
            101 => ([3, 4, 23, 3], BlockKind::Bottleneck),
            152 => ([3, 8, 36, 3], BlockKind::Bottleneck),
            _ => return Err(ModelError::UnsupportedDepth { depth }),
        };
        Ok(Self::new(layers, block).with_num_classes(num_classes))
    }

    /// ResNet-18.
    pub fn resnet18(num_classes: usize) -> Self {
        Self::new([2, 2, 2, 2], BlockKind::Basic).with_num_classes(num_classes)
    }

    /// ResNet-34.
    pub fn resnet34(num_classes: usize) -> Self {
        Self::new([3, 4, 6, 3], BlockKind::Basic).with_num_classes(num_classes)
    }

    /// ResNet-50.
    pub fn resnet50(num_classes: usize) -> Self {
        Self::new([3, 4, 6, 3], BlockKind::Bottleneck).with_num_classes(num_classes)
    }

    /// ResNet-101.
    pub fn resnet101(num_classes: usize) -> Self {
        Self::new([3, 4, 23, 3], BlockKind::Bottleneck).with_num_classes(num_classes)
    }

    /// ResNet-152.
    pub fn resnet152(num_classes: usize) -> Self {
        Self::new([3, 8, 36, 3], BlockKind::Bottleneck).with_num_classes(num_classes)
    }

    /// Builds the model with torchvision's initialisation: Kaiming-normal (fan-out, ReLU gain)
    /// convs, BatchNorm weight 1 and bias 0, PyTorch's default `Linear` init for `fc`.
    pub fn init<B: Backend>(&self, device: &B::Device) -> ResNet<B> {
        let mut in_planes = 64;
        let mut stage = |planes: usize, blocks: usize, stride: usize| -> Vec<Block<B>> {
            (0..blocks)
                .map(|i| {
                    let stride = if i == 0 { stride } else { 1 };
                    let block = match self.block {
                        BlockKind::Basic => Block::basic(in_planes, planes, stride, device),
                        BlockKind::Bottleneck => {
                            Block::bottleneck(in_planes, planes, stride, device)
                        }
                    };
                    in_planes = planes * self.block.expansion();
                    if self.zero_init_residual {
                        block.zero_init_last_norm()
                    } else {
                        block
                    }
                })
                .collect()
        };
        let layer1 = stage(64, self.layers[0], 1);
        let layer2 = stage(128, self.layers[1], 2);
        let layer3 = stage(256, self.layers[2], 2);
        let layer4 = stage(512, self.layers[3], 2);

        ResNet {
            conv1: conv([3, 64], 7, 2, 3).init(device),
            bn1: batch_norm(64, device),
            maxpool: MaxPool2dConfig::new([3, 3])
                .with_strides([2, 2])
                .with_padding(PaddingConfig2d::Explicit(1, 1, 1, 1))
                .init(),
            layer1,
            layer2,
            layer3,
            layer4,
            avgpool: AdaptiveAvgPool2dConfig::new([1, 1]).init(),
            fc: LinearConfig::new(512 * self.block.expansion(), self.num_classes).init(device),
        }
    }
}

/// A residual network with torchvision's structure and parameter names.
#[derive(Module, Debug)]
pub struct ResNet<B: Backend> {
    /// 7×7 stem conv, stride 2.
    pub conv1: Conv2d<B>,
    /// Stem norm.
    pub bn1: BatchNorm<B>,
    /// 3×3 max pool, stride 2.
    pub maxpool: MaxPool2d,
    /// Stage 1 (64 planes, stride 1).
    pub layer1: Vec<Block<B>>,
    /// Stage 2 (128 planes, stride 2).
    pub layer2: Vec<Block<B>>,
    /// Stage 3 (256 planes, stride 2).
    pub layer3: Vec<Block<B>>,
    /// Stage 4 (512 planes, stride 2).
    pub layer4: Vec<Block<B>>,
    /// Global average pool.
    pub avgpool: AdaptiveAvgPool2d,
    /// Classifier head.
    pub fc: Linear<B>,
}

impl<B: Backend> ResNet<B> {
    /// Class logits.
    ///
    /// # Shapes
    /// - `images`: `[N, 3, H, W]` (any `H, W` ≥ 32)
    /// - returns: `[N, num_classes]`
    pub fn forward(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        let x = self.bn1.forward_relu(self.conv1.forward(images), None);
        let mut x = crate::pool::max_pool2d(&self.maxpool, x);
        for block in self
            .layer1
            .iter()
            .chain(&self.layer2)
            .chain(&self.layer3)
            .chain(&self.layer4)
        {
            x = block.forward(x);
        }
        let x: Tensor<B, 2> = self.avgpool.forward(x).flatten(1, 3);
        self.fc.forward(x)
    }
}

impl<B: Backend> ImageClassifier<B> for ResNet<B> {
    fn classify(&self, images: Tensor<B, 4>) -> Tensor<B, 2> {
        self.forward(images)
    }
}
