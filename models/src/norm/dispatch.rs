//! Reaches [`BatchNormBackend`] from generic model code: the backends with fused kernels (Flex,
//! and `Autodiff` over it) are recognised by type at run time, as the conv op does; every other
//! backend, and the `burn` choice, keeps Burn's arithmetic.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_flex::Flex;

use super::BatchNormBackend;
use crate::primitive::{float, primitive};
use crate::switch::cast;

/// `(output, mean, biased var)` of a training forward.
pub(crate) type TrainOutput<B> = (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>);
type TrainArgs<B> = (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>);

fn train_on<B: Backend, E: BatchNormBackend>(
    args: TrainArgs<B>,
    epsilon: f64,
) -> Result<TrainOutput<B>, TrainArgs<B>> {
    let (x, gamma, beta) = cast::<TrainArgs<B>, TrainArgs<E>>(args)?;
    let out = E::batch_norm_train(primitive(x), primitive(gamma), primitive(beta), epsilon);
    let out: TrainOutput<E> = (float(out.output), float(out.mean), float(out.var));
    Ok(cast(out).unwrap_or_else(|_| unreachable!("B is E")))
}

/// A training forward through the fused kernels, or the arguments back when `B` has none.
pub(crate) fn train<B: Backend>(
    x: Tensor<B, 4>,
    gamma: Tensor<B, 1>,
    beta: Tensor<B, 1>,
    epsilon: f64,
) -> Result<TrainOutput<B>, TrainArgs<B>> {
    let args = (x, gamma, beta);
    let args = match train_on::<B, Flex>(args, epsilon) {
        Ok(out) => return Ok(out),
        Err(args) => args,
    };
    train_on::<B, Autodiff<Flex>>(args, epsilon)
}

type ReluArgs<B> = (TrainArgs<B>, Option<Tensor<B, 4>>);

fn train_relu_on<B: Backend, E: BatchNormBackend>(
    args: ReluArgs<B>,
    epsilon: f64,
) -> Result<TrainOutput<B>, ReluArgs<B>> {
    let ((x, gamma, beta), residual) = cast::<ReluArgs<B>, ReluArgs<E>>(args)?;
    let out = E::batch_norm_relu_train(
        primitive(x),
        primitive(gamma),
        primitive(beta),
        residual.map(primitive),
        epsilon,
    );
    let out: TrainOutput<E> = (float(out.output), float(out.mean), float(out.var));
    Ok(cast(out).unwrap_or_else(|_| unreachable!("B is E")))
}

/// `relu(batch_norm(x) + residual)` (the residual where given) in training, through the fused
/// kernels, or the arguments back when `B` has none.
pub(crate) fn train_relu<B: Backend>(
    args: ReluArgs<B>,
    epsilon: f64,
) -> Result<TrainOutput<B>, ReluArgs<B>> {
    let args = match train_relu_on::<B, Flex>(args, epsilon) {
        Ok(out) => return Ok(out),
        Err(args) => args,
    };
    train_relu_on::<B, Autodiff<Flex>>(args, epsilon)
}

type EvalArgs<B> = (
    Tensor<B, 4>,
    Tensor<B, 1>,
    Tensor<B, 1>,
    Tensor<B, 1>,
    Tensor<B, 1>,
);

/// Normalisation with given statistics through the fused kernel, or the arguments back when `B`
/// has none.
pub(crate) fn eval<B: Backend>(
    args: EvalArgs<B>,
    epsilon: f64,
) -> Result<Tensor<B, 4>, EvalArgs<B>> {
    let (x, gamma, beta, mean, var) = cast::<EvalArgs<B>, EvalArgs<Flex>>(args)?;
    let y = Flex::batch_norm_eval(
        primitive(x),
        primitive(gamma),
        primitive(beta),
        primitive(mean),
        primitive(var),
        epsilon,
    );
    Ok(cast(float::<Flex, 4>(y)).unwrap_or_else(|_| unreachable!("B is Flex")))
}

type ReluEvalArgs<B> = (EvalArgs<B>, Option<Tensor<B, 4>>);

/// [`eval`] with the residual added where given and a ReLU, in one pass.
pub(crate) fn eval_relu<B: Backend>(
    args: ReluEvalArgs<B>,
    epsilon: f64,
) -> Result<Tensor<B, 4>, ReluEvalArgs<B>> {
    let ((x, gamma, beta, mean, var), residual) =
        cast::<ReluEvalArgs<B>, ReluEvalArgs<Flex>>(args)?;
    let y = Flex::batch_norm_relu_eval(
        primitive(x),
        primitive(gamma),
        primitive(beta),
        primitive(mean),
        primitive(var),
        residual.map(primitive),
        epsilon,
    );
    Ok(cast(float::<Flex, 4>(y)).unwrap_or_else(|_| unreachable!("B is Flex")))
}

#[cfg(test)]
mod tests {
    use burn::backend::autodiff::checkpoint::strategy::BalancedCheckpointing;

    use super::*;

    fn args<B: Backend>() -> (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>) {
        let device = Default::default();
        (
            Tensor::ones([2, 3, 4, 4], &device),
            Tensor::ones([3], &device),
            Tensor::zeros([3], &device),
        )
    }

    #[test]
    fn flex_and_autodiff_flex_reach_the_kernels_and_others_get_their_arguments_back() {
        let (x, g, b) = args::<Flex>();
        assert!(train(x, g, b, 1e-5).is_ok(), "Flex");
        let (x, g, b) = args::<Autodiff<Flex>>();
        assert!(train(x, g, b, 1e-5).is_ok(), "Autodiff<Flex>");
        let (x, g, b) = args::<Autodiff<Flex, BalancedCheckpointing>>();
        assert!(
            train(x, g, b, 1e-5).is_err(),
            "a backend without the kernels"
        );
        let (x, g, b) = args::<Flex>();
        let (m, v) = (
            Tensor::zeros([3], &x.device()),
            Tensor::ones([3], &x.device()),
        );
        assert!(eval((x, g, b, m, v), 1e-5).is_ok(), "Flex inference");
    }
}
