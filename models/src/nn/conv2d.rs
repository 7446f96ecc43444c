//! `Conv2d` with the config, fields and record of `burn::nn::conv::Conv2d` (Burn 0.21), so that
//! saved records, torchvision weights and user code carry over; its forward runs
//! [`crate::conv::conv2d`].

use burn::config::Config;
use burn::module::{Initializer, Module, Param};
use burn::nn::PaddingConfig2d;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn::tensor::ops::PaddedConvOptions;

/// Configuration of a [`Conv2d`]; the same fields and defaults as `burn::nn::conv::Conv2dConfig`.
#[derive(Config, Debug)]
pub struct Conv2dConfig {
    /// Input and output channels.
    pub channels: [usize; 2],
    /// Kernel height and width.
    pub kernel_size: [usize; 2],
    /// Stride.
    #[config(default = "[1, 1]")]
    pub stride: [usize; 2],
    /// Spacing between kernel elements.
    #[config(default = "[1, 1]")]
    pub dilation: [usize; 2],
    /// Groups of channels convolved apart.
    #[config(default = "1")]
    pub groups: usize,
    /// Padding.
    #[config(default = "PaddingConfig2d::Valid")]
    pub padding: PaddingConfig2d,
    /// Whether a bias is added to the output.
    #[config(default = true)]
    pub bias: bool,
    /// Initialisation of weight and bias (Burn's default: Kaiming-uniform, gain 1/√3).
    #[config(default = "Initializer::KaimingUniform{gain:1.0/f64::sqrt(3.0),fan_out_only:false}")]
    pub initializer: Initializer,
}

/// A 2-D convolution; build it with [`Conv2dConfig`].
#[derive(Module, Debug)]
pub struct Conv2d<B: Backend> {
    /// `[channels_out, channels_in / groups, kernel_h, kernel_w]`.
    pub weight: Param<Tensor<B, 4>>,
    /// `[channels_out]`.
    pub bias: Option<Param<Tensor<B, 1>>>,
    /// Stride.
    pub stride: [usize; 2],
    /// Kernel height and width.
    pub kernel_size: [usize; 2],
    /// Spacing between kernel elements.
    pub dilation: [usize; 2],
    /// Groups of channels convolved apart.
    pub groups: usize,
    /// Padding.
    pub padding: PaddingConfig2d,
}

impl Conv2dConfig {
    /// Builds the module.
    ///
    /// # Panics
    /// If `groups` divides neither channel count (as Burn's).
    pub fn init<B: Backend>(&self, device: &B::Device) -> Conv2d<B> {
        let [c_in, c_out] = self.channels;
        assert!(
            self.groups > 0 && c_in % self.groups == 0 && c_out % self.groups == 0,
            "Conv2dConfig: groups ({}) must divide both channel counts ({c_in}, {c_out})",
            self.groups
        );
        let shape = [
            c_out,
            c_in / self.groups,
            self.kernel_size[0],
            self.kernel_size[1],
        ];
        let k = self.kernel_size[0] * self.kernel_size[1];
        let fan_in = c_in / self.groups * k;
        let fan_out = c_out / self.groups * k;
        let weight = self
            .initializer
            .init_with(shape, Some(fan_in), Some(fan_out), device);
        let bias = self.bias.then(|| {
            self.initializer
                .init_with([c_out], Some(fan_in), Some(fan_out), device)
        });
        Conv2d {
            weight,
            bias,
            stride: self.stride,
            kernel_size: self.kernel_size,
            dilation: self.dilation,
            groups: self.groups,
            padding: self.padding.clone(),
        }
    }
}

impl<B: Backend> Conv2d<B> {
    /// # Shapes
    /// - `input`: `[N, channels_in, H, W]`
    /// - returns: `[N, channels_out, H_out, W_out]`
    pub fn forward(&self, input: Tensor<B, 4>) -> Tensor<B, 4> {
        let [_, _, height, width] = input.dims();
        let ((top, bottom), (left, right)) = padding_pairs(
            &self.padding,
            [height, width],
            self.kernel_size,
            self.stride,
        );
        let options = PaddedConvOptions::asymmetric(
            self.stride,
            [top, left],
            [bottom, right],
            self.dilation,
            self.groups,
        );
        crate::conv::conv2d(
            input,
            self.weight.val(),
            self.bias.as_ref().map(|bias| bias.val()),
            options,
        )
    }
}

/// `((top, bottom), (left, right))`, as Burn's private `PaddingConfig2d::calculate_padding_2d_pairs`
/// (`Same`: the odd pixel goes to the end, ONNX's convention).
fn padding_pairs(
    padding: &PaddingConfig2d,
    size: [usize; 2],
    kernel: [usize; 2],
    stride: [usize; 2],
) -> ((usize, usize), (usize, usize)) {
    let same = |i: usize| {
        let out = size[i].div_ceil(stride[i]);
        let total = if out > 0 {
            ((out - 1) * stride[i] + kernel[i]).saturating_sub(size[i])
        } else {
            0
        };
        (total / 2, total - total / 2)
    };
    match padding {
        PaddingConfig2d::Valid => ((0, 0), (0, 0)),
        PaddingConfig2d::Same => (same(0), same(1)),
        PaddingConfig2d::Explicit(top, left, bottom, right) => ((*top, *bottom), (*left, *right)),
    }
}
