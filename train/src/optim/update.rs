//! One parameter's update, as `torch.optim`'s single-tensor implementations write it
//! (`_single_tensor_sgd`, `_single_tensor_rmsprop`, `_single_tensor_adamw`), on flattened
//! tensors so that one state layout serves every rank of parameter.

use std::sync::atomic::{AtomicBool, Ordering};

use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// An update rule and its constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub(crate) enum Rule {
    /// `torch.optim.SGD`, dampening 0.
    Sgd { momentum: f64, nesterov: bool },
    /// `torch.optim.RMSprop`, not centered.
    RmsProp { alpha: f64, eps: f64, momentum: f64 },
    /// `torch.optim.AdamW`, no amsgrad.
    AdamW { beta1: f64, beta2: f64, eps: f64 },
}

/// A parameter's optimizer state: torch's `state[p]`.
#[derive(Debug, Clone)]
pub struct ParamState<B: Backend> {
    /// Steps taken (AdamW's bias corrections need it).
    pub step: u64,
    /// SGD: `[momentum_buffer]` (empty without momentum); RMSprop: `[square_avg]` and
    /// `momentum_buffer` with momentum; AdamW: `[exp_avg, exp_avg_sq]`. Flattened.
    pub buffers: Vec<Tensor<B, 1>>,
}

/// Whether [`step`] takes the fused in-place update where it exists (Flex); on by default.
static FUSED: AtomicBool = AtomicBool::new(true);

/// Turns the fused in-place update on Flex on or off for this process (off: Burn's tensor ops on
/// every backend), for comparison; the two give the same bits.
pub fn set_fused_update(on: bool) {
    FUSED.store(on, Ordering::Relaxed);
}

/// One step of `rule` on `param` (flattened) with gradient `grad`, learning rate `lr` and this
/// parameter's weight decay `wd`. Returns the new parameter and state. On Flex the update runs
/// fused and in place ([`super::fused`]); elsewhere as [`tensor_step`].
pub(crate) fn step<B: Backend>(
    rule: Rule,
    lr: f64,
    wd: f64,
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    state: Option<ParamState<B>>,
) -> (Tensor<B, 1>, ParamState<B>) {
    let (param, grad, state) = if FUSED.load(Ordering::Relaxed) {
        match super::fused::step(rule, lr, wd, (param, grad, state)) {
            Ok(out) => return out,
            Err(args) => args,
        }
    } else {
        (param, grad, state)
    };
    tensor_step(rule, lr, wd, param, grad, state)
}

/// [`step`] written with Burn's tensor ops, for every backend.
pub(crate) fn tensor_step<B: Backend>(
    rule: Rule,
    lr: f64,
    wd: f64,
    param: Tensor<B, 1>,
    grad: Tensor<B, 1>,
    state: Option<ParamState<B>>,
) -> (Tensor<B, 1>, ParamState<B>) {
    let step = state.as_ref().map_or(0, |s| s.step) + 1;
    let mut buffers = state.map(|s| s.buffers).unwrap_or_default().into_iter();
    // L2 decay folded into the gradient (SGD, RMSprop); AdamW decays the weights instead.
    let l2 = |grad: Tensor<B, 1>, param: &Tensor<B, 1>| {
        if wd != 0.0 {
            grad + param.clone().mul_scalar(wd)
        } else {
            grad
        }
    };
    match rule {
        Rule::Sgd { momentum, nesterov } => {
            let d_p = l2(grad, &param);
            if momentum == 0.0 {
                let param = param - d_p.mul_scalar(lr);
                return (
                    param,
                    ParamState {
                        step,
                        buffers: vec![],
                    },
                );
            }
            let buf = match buffers.next() {
                Some(buf) => buf.mul_scalar(momentum) + d_p.clone(),
                None => d_p.clone(),
            };
            let d_p = if nesterov {
                d_p + buf.clone().mul_scalar(momentum)
            } else {
                buf.clone()
            };
            let param = param - d_p.mul_scalar(lr);
            (
                param,
                ParamState {
                    step,
                    buffers: vec![buf],
                },
            )
        }
        Rule::RmsProp {
            alpha,
            eps,
            momentum,
        } => {
            let grad = l2(grad, &param);
            let square = grad.clone().square().mul_scalar(1.0 - alpha);
            let square_avg = match buffers.next() {
                Some(avg) => avg.mul_scalar(alpha) + square,
                None => square,
            };
            let avg = square_avg.clone().sqrt().add_scalar(eps);
            let scaled = grad / avg;
            if momentum > 0.0 {
                // torch's buffer starts at zero, so the first step's buffer is the scaled grad.
                let buf = match buffers.next() {
                    Some(buf) => buf.mul_scalar(momentum) + scaled,
                    None => scaled,
                };
                let param = param - buf.clone().mul_scalar(lr);
                (
                    param,
                    ParamState {
                        step,
                        buffers: vec![square_avg, buf],
                    },
                )
            } else {
                let param = param - scaled.mul_scalar(lr);
                (
                    param,
                    ParamState {
                        step,
                        buffers: vec![square_avg],
                    },
                )
            }
        }
        Rule::AdamW { beta1, beta2, eps } => {
            let param = if wd != 0.0 {
                param.mul_scalar(1.0 - lr * wd)
            } else {
                param
            };
            let first = grad.clone().mul_scalar(1.0 - beta1);
            let second = grad.square().mul_scalar(1.0 - beta2);
            let (exp_avg, exp_avg_sq) = match (buffers.next(), buffers.next()) {
                (Some(m), Some(v)) => (m.mul_scalar(beta1) + first, v.mul_scalar(beta2) + second),
                _ => (first, second),
            };
            let bias_correction1 = 1.0 - beta1.powf(step as f64);
            let bias_correction2 = 1.0 - beta2.powf(step as f64);
            let step_size = lr / bias_correction1;
            let denom = exp_avg_sq
                .clone()
                .sqrt()
                .div_scalar(bias_correction2.sqrt())
                .add_scalar(eps);
            let param = param - (exp_avg.clone() / denom).mul_scalar(step_size);
            (
                param,
                ParamState {
                    step,
                    buffers: vec![exp_avg, exp_avg_sq],
                },
            )
        }
    }
}
