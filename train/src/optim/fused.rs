//! [`update::step`](super::update::step) on Flex in one pass over the buffers, in place.
//!
//! Written with Burn's tensor ops, an SGD step with momentum and weight decay makes five new
//! tensors per parameter (`param * wd`, `+ grad`, `buf * momentum`, `+ d_p`, `* lr`, `param -`),
//! each a fresh allocation that the kernel then fills; on the CPU that is page faults and memsets
//! for every parameter of every step. Here each element is read once and written once, into the
//! parameter's and the state's own storage (copied first only if something else shares it).
//!
//! Every element goes through the same `f32` operations in the same order as the tensor path,
//! with the same `f64` to `f32` rounding of the scalars, so the two agree bit for bit (tested
//! below); the tensor path stays for every other backend and as the reference.

use burn::tensor::{DType, Tensor, TensorPrimitive};
use burn_flex::{Flex, FlexTensor};
use rayon::prelude::*;

use super::update::{ParamState, Rule};

/// The arguments of a step, handed back when they are not Flex `f32` tensors.
pub(crate) type Args<B> = (Tensor<B, 1>, Tensor<B, 1>, Option<ParamState<B>>);

/// `a` as a `T` when they are the same type (the backend is known only at run time).
fn cast<A: 'static, T: 'static>(a: A) -> Result<T, A> {
    let mut slot = Some(a);
    match (&mut slot as &mut dyn std::any::Any).downcast_mut::<Option<T>>() {
        Some(t) => Ok(t.take().expect("the slot was filled above")),
        None => Err(slot.expect("the slot is only taken on a match")),
    }
}

/// One step of `rule` in place when `B` is Flex and every tensor is `f32`; the arguments back
/// otherwise.
pub(crate) fn step<B: burn::tensor::backend::Backend>(
    rule: Rule,
    lr: f64,
    wd: f64,
    args: Args<B>,
) -> Result<(Tensor<B, 1>, ParamState<B>), Args<B>> {
    let args = cast::<Args<B>, Args<Flex>>(args)?;
    if !usable(rule, &args) {
        return Err(cast(args).unwrap_or_else(|_| unreachable!("B is Flex")));
    }
    let out = step_flex(rule, lr, wd, args);
    Ok(cast(out).unwrap_or_else(|_| unreachable!("B is Flex")))
}

fn primitive(t: Tensor<Flex, 1>) -> FlexTensor {
    t.into_primitive().tensor()
}

fn tensor(t: FlexTensor) -> Tensor<Flex, 1> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// Contiguous, `f32`, and its storage exactly its `n` elements (what the loops index).
fn dense(t: FlexTensor, n: usize) -> Option<FlexTensor> {
    if t.dtype() != DType::F32 {
        return None;
    }
    let t = t.to_contiguous();
    (t.storage::<f32>().len() == n).then_some(t)
}

/// How many state buffers `rule` keeps (what `update::step` stores).
fn buffer_count(rule: Rule) -> usize {
    match rule {
        Rule::Sgd { momentum, .. } => usize::from(momentum != 0.0),
        Rule::RmsProp { momentum, .. } => 1 + usize::from(momentum > 0.0),
        Rule::AdamW { .. } => 2,
    }
}

/// Every tensor `f32` with the parameter's element count, and the state as `rule` keeps it.
fn usable(rule: Rule, (param, grad, state): &Args<Flex>) -> bool {
    let n = param.shape().num_elements();
    let fits = |t: &Tensor<Flex, 1>| t.dtype() == DType::F32 && t.shape().num_elements() == n;
    fits(param)
        && fits(grad)
        && state
            .as_ref()
            .is_none_or(|s| s.buffers.len() == buffer_count(rule) && s.buffers.iter().all(fits))
}

/// The update on arguments that passed [`usable`].
fn step_flex(
    rule: Rule,
    lr: f64,
    wd: f64,
    (param, grad, state): Args<Flex>,
) -> (Tensor<Flex, 1>, ParamState<Flex>) {
    let n = param.shape().num_elements();
    let wanted = buffer_count(rule);
    let step = state.as_ref().map_or(0, |s| s.step) + 1;
    let had_state = state.is_some();
    let (Some(mut p), Some(g)) = (dense(primitive(param), n), dense(primitive(grad), n)) else {
        unreachable!("f32 tensors of n elements are dense once contiguous")
    };
    // Missing state starts as zeros; `had_state` makes every rule's first step write torch's
    // first value (e.g. SGD's `buf = d_p`) instead of reading them.
    let mut buffers: Vec<FlexTensor> = match state {
        Some(s) => s
            .buffers
            .into_iter()
            .map(|b| dense(primitive(b), n).expect("checked by usable"))
            .collect(),
        None => (0..wanted)
            .map(|_| primitive(Tensor::<Flex, 1>::zeros([n], &Default::default())))
            .collect(),
    };
    let kernel = Kernel::new(rule, lr, wd, step, had_state);
    let params = p.storage_mut::<f32>();
    let grads = g.storage::<f32>();
    // Large tensors are split across the cores as Flex's own elementwise ops are; every element
    // is still computed by the same expression, so the split changes no bit.
    let chunk = n.div_ceil(rayon::current_num_threads()).max(CHUNK_MIN);
    let params = params.par_chunks_mut(chunk).zip(grads.par_chunks(chunk));
    match buffers.as_mut_slice() {
        [] => params.for_each(|(p, g)| kernel.run(p, g, &mut [], &mut [])),
        [b0] => params
            .zip(b0.storage_mut::<f32>().par_chunks_mut(chunk))
            .for_each(|((p, g), b0)| kernel.run(p, g, b0, &mut [])),
        [b0, b1] => params
            .zip(b0.storage_mut::<f32>().par_chunks_mut(chunk))
            .zip(b1.storage_mut::<f32>().par_chunks_mut(chunk))
            .for_each(|(((p, g), b0), b1)| kernel.run(p, g, b0, b1)),
        _ => unreachable!("no rule keeps more than two buffers"),
    }
    (
        tensor(p),
        ParamState {
            step,
            buffers: buffers.into_iter().map(tensor).collect(),
        },
    )
}

/// Elements below which a tensor is updated on one thread (spawning costs more).
const CHUNK_MIN: usize = 1 << 15;

/// A rule with its scalars rounded to `f32` as Burn's `mul_scalar`/`add_scalar` round them.
struct Kernel {
    rule: Rule,
    had_state: bool,
    lr: f32,
    /// Weight decay (`None`: zero, and then not added at all, as in `update::step`).
    wd: Option<f32>,
    momentum: f32,
    /// RMSprop's `alpha` and `1 - alpha`, or AdamW's `beta1` and `1 - beta1`.
    a: (f32, f32),
    /// AdamW's `beta2` and `1 - beta2`.
    b: (f32, f32),
    eps: f32,
    /// AdamW: `1 - lr * wd`, `lr / bias_correction1`, `sqrt(bias_correction2)`.
    decay: f32,
    step_size: f32,
    root2: f32,
}

impl Kernel {
    fn new(rule: Rule, lr: f64, wd: f64, step: u64, had_state: bool) -> Self {
        let s = |x: f64| x as f32;
        let mut k = Self {
            rule,
            had_state,
            lr: s(lr),
            wd: (wd != 0.0).then_some(s(wd)),
            momentum: 0.0,
            a: (0.0, 0.0),
            b: (0.0, 0.0),
            eps: 0.0,
            decay: s(1.0 - lr * wd),
            step_size: 0.0,
            root2: 0.0,
        };
        match rule {
            Rule::Sgd { momentum, .. } => k.momentum = s(momentum),
            Rule::RmsProp {
                alpha,
                eps,
                momentum,
            } => {
                (k.a, k.eps, k.momentum) = ((s(alpha), s(1.0 - alpha)), s(eps), s(momentum));
            }
            Rule::AdamW { beta1, beta2, eps } => {
                k.a = (s(beta1), s(1.0 - beta1));
                k.b = (s(beta2), s(1.0 - beta2));
                k.eps = s(eps);
                k.step_size = s(lr / (1.0 - beta1.powf(step as f64)));
                k.root2 = s((1.0 - beta2.powf(step as f64)).sqrt());
            }
        }
        k
    }

    /// L2 decay folded into the gradient (SGD, RMSprop), as `update::step` does.
    fn l2(&self, g: f32, p: f32) -> f32 {
        match self.wd {
            Some(wd) => g + p * wd,
            None => g,
        }
    }

    /// The update of one chunk: parameters `p`, gradients `g`, and the rule's buffers (empty
    /// when it keeps fewer).
    fn run(&self, p: &mut [f32], g: &[f32], b0: &mut [f32], b1: &mut [f32]) {
        let (lr, fresh) = (self.lr, !self.had_state);
        match self.rule {
            Rule::Sgd { momentum: 0.0, .. } => {
                for (p, &g) in p.iter_mut().zip(g) {
                    *p -= self.l2(g, *p) * lr;
                }
            }
            Rule::Sgd { nesterov, .. } => {
                let m = self.momentum;
                for ((p, &g), b) in p.iter_mut().zip(g).zip(b0.iter_mut()) {
                    let d_p = self.l2(g, *p);
                    *b = if fresh { d_p } else { *b * m + d_p };
                    let d_p = if nesterov { d_p + *b * m } else { *b };
                    *p -= d_p * lr;
                }
            }
            Rule::RmsProp { momentum, .. } => {
                let ((a, one_minus_a), m) = (self.a, self.momentum);
                for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                    let g = self.l2(g, *p);
                    let square = g * g * one_minus_a;
                    b0[i] = if fresh { square } else { b0[i] * a + square };
                    let scaled = g / (b0[i].sqrt() + self.eps);
                    if momentum > 0.0 {
                        b1[i] = if fresh { scaled } else { b1[i] * m + scaled };
                        *p -= b1[i] * lr;
                    } else {
                        *p -= scaled * lr;
                    }
                }
            }
            Rule::AdamW { .. } => {
                let ((b1c, one_minus_b1), (b2c, one_minus_b2)) = (self.a, self.b);
                for (i, (p, &g)) in p.iter_mut().zip(g).enumerate() {
                    if self.wd.is_some() {
                        *p *= self.decay;
                    }
                    let first = g * one_minus_b1;
                    let second = g * g * one_minus_b2;
                    b0[i] = if fresh { first } else { b0[i] * b1c + first };
                    b1[i] = if fresh { second } else { b1[i] * b2c + second };
                    let denom = b1[i].sqrt() / self.root2 + self.eps;
                    *p -= b0[i] / denom * self.step_size;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::optim::update::tensor_step;

    fn values(t: &Tensor<Flex, 1>) -> Vec<f32> {
        t.to_data().to_vec::<f32>().expect("f32")
    }

    fn data(n: usize, seed: u32, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|i| (i as f32 * 0.618 + seed as f32 * 1.7).sin() * scale)
            .collect()
    }

    /// Three steps of each rule, with and without weight decay, from no state: the fused update
    /// and the tensor path give the same bits for the parameter and every buffer.
    #[test]
    fn fused_updates_equal_the_tensor_path_bit_for_bit() {
        let rules = [
            Rule::Sgd {
                momentum: 0.0,
                nesterov: false,
            },
            Rule::Sgd {
                momentum: 0.9,
                nesterov: false,
            },
            Rule::Sgd {
                momentum: 0.9,
                nesterov: true,
            },
            Rule::RmsProp {
                alpha: 0.9,
                eps: 0.0316,
                momentum: 0.0,
            },
            Rule::RmsProp {
                alpha: 0.9,
                eps: 0.0316,
                momentum: 0.9,
            },
            Rule::AdamW {
                beta1: 0.9,
                beta2: 0.999,
                eps: 1e-8,
            },
        ];
        let device = Default::default();
        // One chunk, and several (split across the cores).
        for (n, rule) in [1037, 2 * CHUNK_MIN + 77]
            .into_iter()
            .flat_map(|n| rules.map(|rule| (n, rule)))
        {
            for wd in [0.0, 1e-4, 0.05] {
                let mut fused = (
                    Tensor::<Flex, 1>::from_floats(&data(n, 1, 1.0)[..], &device),
                    None,
                );
                let mut reference = fused.clone();
                for step in 0..3u32 {
                    let grad =
                        Tensor::<Flex, 1>::from_floats(&data(n, 10 + step, 0.1)[..], &device);
                    let lr = 0.1 / f64::from(step + 1);
                    let (p, s) = match super::step(rule, lr, wd, (fused.0, grad.clone(), fused.1)) {
                        Ok(out) => out,
                        Err(_) => panic!("{rule:?}: Flex f32 tensors take the fused path"),
                    };
                    fused = (p, Some(s));
                    let (p, s) = tensor_step(rule, lr, wd, reference.0, grad, reference.1);
                    reference = (p, Some(s));
                    let what = format!("{rule:?}, wd {wd}, {n} elements, step {}", step + 1);
                    let bits = |v: Vec<f32>| v.into_iter().map(f32::to_bits).collect::<Vec<_>>();
                    assert_eq!(
                        bits(values(&fused.0)),
                        bits(values(&reference.0)),
                        "param: {what}"
                    );
                    let (fs, rs) = (
                        fused.1.as_ref().expect("state"),
                        reference.1.as_ref().expect("state"),
                    );
                    assert_eq!(fs.step, rs.step, "{what}");
                    assert_eq!(fs.buffers.len(), rs.buffers.len(), "{what}");
                    for (k, (f, r)) in fs.buffers.iter().zip(&rs.buffers).enumerate() {
                        assert_eq!(bits(values(f)), bits(values(r)), "buffer {k}: {what}");
                    }
                }
            }
        }
    }

    /// The parameter's storage is updated in place when nothing else holds it.
    #[test]
    fn a_uniquely_held_parameter_is_updated_in_its_own_storage() {
        let device = Default::default();
        let param = Tensor::<Flex, 1>::from_floats(&data(64, 3, 1.0)[..], &device);
        let before = param.clone().into_primitive().tensor().bytes().as_ptr();
        let grad = Tensor::<Flex, 1>::from_floats(&data(64, 4, 0.1)[..], &device);
        let rule = Rule::Sgd {
            momentum: 0.0,
            nesterov: false,
        };
        let (after, _) = super::step(rule, 0.1, 0.0, (param, grad, None)).expect("fused");
        let after = after.into_primitive().tensor().bytes().as_ptr();
        assert_eq!(before, after, "the update allocated a new parameter buffer");
    }
}
