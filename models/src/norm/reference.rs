//! Burn 0.21's BatchNorm arithmetic (`burn-nn`, `modules/norm/batch.rs`) as functions: the `burn`
//! choice of the switch runs exactly these ops, and [`super::BatchNormBackend`]'s defaults build
//! on them. [`grads`] is the closed-form gradient of the same forward.

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// `[1, C, 1, ...]` for a rank-`D` input with `C` channels.
fn channel_shape<const D: usize>(channels: usize) -> [usize; D] {
    let mut shape = [1; D];
    shape[1] = channels;
    shape
}

/// Per-channel mean and biased variance, each `[1, C, 1, ...]`, as Burn's `forward_train`.
pub(crate) fn batch_stats<B: Backend, const D: usize>(
    x: &Tensor<B, D>,
) -> (Tensor<B, D>, Tensor<B, D>) {
    let dims = x.dims();
    let channels = dims[1];
    let per_channel: usize = dims[0] * dims.iter().skip(2).product::<usize>();
    let shape = channel_shape::<D>(channels);
    let mean = x
        .clone()
        .swap_dims(0, 1)
        .reshape([channels, per_channel])
        .mean_dim(1)
        .reshape(shape);
    let var = x
        .clone()
        .sub(mean.clone())
        .square()
        .swap_dims(0, 1)
        .reshape([channels, per_channel])
        .mean_dim(1)
        .reshape(shape);
    (mean, var)
}

/// `(x − mean) / √(var + ε) · gamma + beta`, as Burn's `forward_shared`.
pub(crate) fn normalize<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    mean: Tensor<B, D>,
    var: Tensor<B, D>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    epsilon: f64,
) -> Tensor<B, D> {
    let shape = channel_shape::<D>(x.dims()[1]);
    let std = var.add_scalar(epsilon).sqrt();
    x.sub(mean)
        .div(std)
        .mul(gamma.reshape(shape))
        .add(beta.reshape(shape))
}

/// `(dx, dgamma, dbeta)` of a training forward over `[N, C, H, W]`, with `x̂ = (x − mean)·r`,
/// `r = 1/√(var + ε)`, `M = N·H·W`: `dbeta = Σ dy`, `dgamma = Σ dy·x̂`,
/// `dx = gamma·r/M · (M·dy − dbeta − x̂·dgamma)`.
pub(crate) fn grads<B: Backend>(
    x: Tensor<B, 4>,
    gamma: Tensor<B, 1>,
    mean: Tensor<B, 1>,
    var: Tensor<B, 1>,
    dy: Tensor<B, 4>,
    epsilon: f64,
) -> (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) {
    let [n, c, h, w] = x.dims();
    let m = (n * h * w) as f64;
    let shape = [1, c, 1, 1];
    let r = var.add_scalar(epsilon).sqrt().recip().reshape(shape);
    let x_hat = x.sub(mean.reshape(shape)).mul(r.clone());
    let sum = |t: Tensor<B, 4>| t.sum_dim(0).sum_dim(2).sum_dim(3);
    let dbeta = sum(dy.clone());
    let dgamma = sum(dy.clone().mul(x_hat.clone()));
    let dx = dy
        .mul_scalar(m)
        .sub(dbeta.clone())
        .sub(x_hat.mul(dgamma.clone()))
        .mul(gamma.reshape(shape).mul(r).div_scalar(m));
    (dx, dgamma.reshape([c]), dbeta.reshape([c]))
}
