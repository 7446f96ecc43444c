use burn::module::Module;
use burn::nn::{Initializer, PaddingConfig2d};
use burn::tensor::{Tensor, backend::Backend};

use crate::nn::{BatchNorm, BatchNormConfig, Conv2d, Conv2dConfig};

/// One residual block, basic (two 3×3 convs, ResNet-18/34) or bottleneck (1×1, 3×3, 1×1,
/// ResNet-50/101/152).
///
/// One struct serves both so that parameter paths are exactly torchvision's (`layer1.0.conv1`, no
/// enum variant in the path); a basic block has no `conv3`/`bn3`. ResNet v1.5: the stride sits on
/// the 3×3 conv, as torchvision.
#[derive(Module, Debug)]
pub struct Block<B: Backend> {
    /// 3×3 (basic) or 1×1 reduction (bottleneck).
    pub conv1: Conv2d<B>,
    /// Norm after `conv1`.
    pub bn1: BatchNorm<B>,
    /// 3×3 conv, carries the stride.
    pub conv2: Conv2d<B>,
    /// Norm after `conv2`.
    pub bn2: BatchNorm<B>,
    /// 1×1 expansion (bottleneck only).
    pub conv3: Option<Conv2d<B>>,
    /// Norm after `conv3` (bottleneck only).
    pub bn3: Option<BatchNorm<B>>,
    /// 1×1 strided conv and norm on the shortcut when the shape changes (torchvision's
    /// `downsample.0`, `downsample.1`).
    pub downsample: Option<(Conv2d<B>, BatchNorm<B>)>,
}

/// torchvision's `kaiming_normal_(mode="fan_out", nonlinearity="relu")`.
pub(crate) fn conv_initializer() -> Initializer {
    Initializer::KaimingNormal {
        gain: std::f64::consts::SQRT_2,
        fan_out_only: true,
    }
}

pub(crate) fn conv(
    channels: [usize; 2],
    kernel: usize,
    stride: usize,
    padding: usize,
) -> Conv2dConfig {
    Conv2dConfig::new(channels, [kernel, kernel])
        .with_stride([stride, stride])
        .with_padding(PaddingConfig2d::Explicit(
            padding, padding, padding, padding,
        ))
        .with_bias(false)
        .with_initializer(conv_initializer())
}

/// torchvision's BatchNorm2d: eps 1e-5, momentum 0.1.
pub(crate) fn batch_norm<B: Backend>(features: usize, device: &B::Device) -> BatchNorm<B> {
    BatchNormConfig::new(features)
        .with_epsilon(1e-5)
        .with_momentum(0.1)
        .init(device)
}

impl<B: Backend> Block<B> {
    /// A basic block (expansion 1).
    pub(crate) fn basic(
        in_planes: usize,
        planes: usize,
        stride: usize,
        device: &B::Device,
    ) -> Self {
        Self {
            conv1: conv([in_planes, planes], 3, stride, 1).init(device),
            bn1: batch_norm(planes, device),
            conv2: conv([planes, planes], 3, 1, 1).init(device),
            bn2: batch_norm(planes, device),
            conv3: None,
            bn3: None,
            downsample: downsample(in_planes, planes, stride, device),
        }
    }

    /// A bottleneck block (expansion 4), stride on the 3×3 conv (v1.5).
    pub(crate) fn bottleneck(
        in_planes: usize,
        planes: usize,
        stride: usize,
        device: &B::Device,
    ) -> Self {
        let out = planes * 4;
        Self {
            conv1: conv([in_planes, planes], 1, 1, 0).init(device),
            bn1: batch_norm(planes, device),
            conv2: conv([planes, planes], 3, stride, 1).init(device),
            bn2: batch_norm(planes, device),
            conv3: Some(conv([planes, out], 1, 1, 0).init(device)),
            bn3: Some(batch_norm(out, device)),
            downsample: downsample(in_planes, out, stride, device),
        }
    }

    /// Sets the weight of the block's last norm to zero, so that the block starts as the identity
    /// (Goyal et al. §5.1; torchvision's `zero_init_residual`).
    pub(crate) fn zero_init_last_norm(mut self) -> Self {
        let last = self.bn3.as_mut().unwrap_or(&mut self.bn2);
        last.gamma = last.gamma.clone().map(|gamma| gamma.zeros_like());
        self
    }

    /// # Shapes
    /// - `x`: `[N, C_in, H, W]`
    /// - returns: `[N, C_out, H / stride, W / stride]`
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let identity = match &self.downsample {
            Some((conv, bn)) => bn.forward(conv.forward(x.clone())),
            None => x.clone(),
        };
        // Each norm with the ReLU after it (and the last with the shortcut sum before that) is
        // one op: `relu(bn(x) + identity)`, a pass over the activations instead of three.
        let out = self.bn1.forward_relu(self.conv1.forward(x), None);
        match (&self.conv3, &self.bn3) {
            (Some(conv3), Some(bn3)) => {
                let out = self.bn2.forward_relu(self.conv2.forward(out), None);
                bn3.forward_relu(conv3.forward(out), Some(identity))
            }
            _ => self
                .bn2
                .forward_relu(self.conv2.forward(out), Some(identity)),
        }
    }
}

fn downsample<B: Backend>(
    in_planes: usize,
    out_planes: usize,
    stride: usize,
    device: &B::Device,
) -> Option<(Conv2d<B>, BatchNorm<B>)> {
    (stride != 1 || in_planes != out_planes).then(|| {
        (
            conv([in_planes, out_planes], 1, stride, 0).init(device),
            batch_norm(out_planes, device),
        )
    })
}
