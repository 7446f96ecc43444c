//! `BatchNorm` with the config, fields and record of `burn::nn::BatchNorm` (Burn 0.21), so that
//! saved records, torchvision weights and user code carry over; over `[N, C, H, W]` it runs our
//! fused op ([`crate::norm`]) where the backend has one and [`crate::batch_norm_impl`] says `fast`,
//! and Burn's arithmetic otherwise.

use burn::config::Config;
use burn::module::{Initializer, Module, Param, RunningState};
use burn::tensor::Tensor;
use burn::tensor::activation::relu;
use burn::tensor::backend::Backend;

use crate::norm::{Then, dispatch, reference};
use crate::switch::{OpImpl, batch_norm_impl, cast};

/// Configuration of a [`BatchNorm`]; the same fields and defaults as `burn::nn::BatchNormConfig`.
#[derive(Config, Debug)]
pub struct BatchNormConfig {
    /// Channels.
    pub num_features: usize,
    /// Added to the variance for numerical stability.
    #[config(default = 1e-5)]
    pub epsilon: f64,
    /// Weight of the newest batch in the running statistics.
    #[config(default = 0.1)]
    pub momentum: f64,
}

/// Batch normalisation over dimension 1 (Ioffe & Szegedy 2015); build it with [`BatchNormConfig`].
///
/// Training (an autodiff backend) normalises with the batch's mean and biased variance, as Burn's
/// and PyTorch's do, and folds the mean and the *unbiased* variance (`n/(n − 1)` times the biased
/// one, `n = N·H·W`) into the running statistics with `momentum`, as PyTorch's `BatchNorm2d` does
/// (Burn's folds the biased one); inference uses the running ones. The running variance is thus
/// the same quantity as torchvision's `running_var`, and loads and exports unchanged.
#[derive(Module, Debug)]
pub struct BatchNorm<B: Backend> {
    /// Scale, `[C]`.
    pub gamma: Param<Tensor<B, 1>>,
    /// Shift, `[C]`.
    pub beta: Param<Tensor<B, 1>>,
    /// Running mean, `[C]`.
    pub running_mean: RunningState<Tensor<B, 1>>,
    /// Running unbiased variance, `[C]` (PyTorch's `running_var`).
    pub running_var: RunningState<Tensor<B, 1>>,
    /// Weight of the newest batch in the running statistics.
    pub momentum: f64,
    /// Added to the variance for numerical stability.
    pub epsilon: f64,
}

impl BatchNormConfig {
    /// Builds the module: `gamma` 1, `beta` 0, running mean 0 and variance 1.
    pub fn init<B: Backend>(&self, device: &B::Device) -> BatchNorm<B> {
        let c = self.num_features;
        BatchNorm {
            gamma: Initializer::Ones.init([c], device),
            beta: Initializer::Zeros.init([c], device),
            running_mean: RunningState::new(Tensor::zeros([c], device)),
            running_var: RunningState::new(Tensor::ones([c], device)),
            momentum: self.momentum,
            epsilon: self.epsilon,
        }
    }
}

/// What [`BatchNorm::fused`] hands back when the backend has no fused op.
type Unfused<B> = (Tensor<B, 4>, Then<Tensor<B, 4>>);

impl<B: Backend> BatchNorm<B> {
    /// # Shapes
    /// - `input`: `[N, C, ...]`
    /// - returns: the same shape
    ///
    /// # Panics
    /// If the input has rank < 2 (as Burn's).
    pub fn forward<const D: usize>(&self, input: Tensor<B, D>) -> Tensor<B, D> {
        assert!(
            D >= 2,
            "BatchNorm needs a tensor of rank >= 2, [batch_size, channels, ...]; got rank {D}"
        );
        let training = B::ad_enabled(&input.device());
        let input = if batch_norm_impl() == OpImpl::Fast {
            match cast::<Tensor<B, D>, Tensor<B, 4>>(input) {
                Ok(x) => match self.fused(x, Then::Nothing) {
                    Ok(y) => return cast(y).unwrap_or_else(|_| unreachable!("D is 4")),
                    Err((x, _)) => cast(x).unwrap_or_else(|_| unreachable!("D is 4")),
                },
                Err(input) => input,
            }
        } else {
            input
        };
        if training {
            let (mean, var) = reference::batch_stats(&input);
            let dims = input.dims();
            let channels = dims[1];
            self.update_running(
                mean.clone().reshape([channels]),
                var.clone().reshape([channels]),
                dims[0] * dims[2..].iter().product::<usize>(),
            );
            reference::normalize(
                input,
                mean,
                var,
                self.gamma.val(),
                self.beta.val(),
                self.epsilon,
            )
        } else {
            let shape: [usize; D] =
                std::array::from_fn(|i| if i == 1 { input.dims()[1] } else { 1 });
            let device = input.device();
            let mean = self.running_mean.value().to_device(&device).reshape(shape);
            let var = self.running_var.value().to_device(&device).reshape(shape);
            reference::normalize(
                input,
                mean,
                var,
                self.gamma.val(),
                self.beta.val(),
                self.epsilon,
            )
        }
    }

    /// `relu(self.forward(input) + residual)`, the residual only where given: a ResNet block's
    /// norm, shortcut sum and ReLU, in one pass and one autodiff node where the backend has our
    /// fused op, else in Burn's ops.
    ///
    /// # Shapes
    /// - `input`, `residual`, returns: `[N, C, H, W]`
    pub fn forward_relu(
        &self,
        input: Tensor<B, 4>,
        residual: Option<Tensor<B, 4>>,
    ) -> Tensor<B, 4> {
        let (input, residual) = if batch_norm_impl() == OpImpl::Fast {
            match self.fused(input, Then::Relu { residual }) {
                Ok(y) => return y,
                Err((x, then)) => (x, then.into_residual()),
            }
        } else {
            (input, residual)
        };
        let y = self.forward(input);
        relu(match residual {
            Some(r) => y + r,
            None => y,
        })
    }

    /// The fused op followed by `then`, or the arguments back when the backend has none.
    fn fused(&self, x: Tensor<B, 4>, then: Then<Tensor<B, 4>>) -> Result<Tensor<B, 4>, Unfused<B>> {
        let (gamma, beta) = (self.gamma.val(), self.beta.val());
        if B::ad_enabled(&x.device()) {
            let [n, _, h, w] = x.dims();
            let (y, mean, var) = dispatch::train(((x, gamma, beta), then), self.epsilon)
                .map_err(|((x, _, _), then)| (x, then))?;
            self.update_running(mean, var, n * h * w);
            Ok(y)
        } else {
            let device = x.device();
            let mean = self.running_mean.value().to_device(&device);
            let var = self.running_var.value().to_device(&device);
            dispatch::eval(((x, gamma, beta, mean, var), then), self.epsilon)
                .map_err(|((x, ..), then)| (x, then))
        }
    }

    /// `running ← (1 − momentum)·running + momentum·batch`, with the batch's biased variance
    /// over `per_channel` values made unbiased first, as PyTorch's. A single value per channel
    /// (which PyTorch refuses to train on) has no unbiased variance; its biased one (0) is folded.
    fn update_running(&self, mean: Tensor<B, 1>, var: Tensor<B, 1>, per_channel: usize) {
        let momentum = self.momentum;
        let var = if per_channel > 1 {
            let n = per_channel as f64;
            var.mul_scalar(n / (n - 1.0))
        } else {
            var
        };
        let fold = |state: &RunningState<Tensor<B, 1>>, batch: Tensor<B, 1>| {
            let running = state.value_sync().to_device(&batch.device());
            let updated = running
                .mul_scalar(1.0 - momentum)
                .add(batch.detach().mul_scalar(momentum));
            state.update(updated.detach());
        };
        fold(&self.running_mean, mean);
        fold(&self.running_var, var);
    }
}
