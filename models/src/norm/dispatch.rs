//! Reaches [`BatchNormBackend`] from generic model code: the backends with fused kernels (Flex,
//! and `Autodiff` over it) are recognised by type at run time, as the conv op does; every other
//! backend, and the `burn` choice, keeps Burn's arithmetic.

use burn::backend::Autodiff;
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;
use burn_flex::Flex;

use super::{BatchNormBackend, Then};
use crate::primitive::{float, primitive};
use crate::switch::cast;

/// `(output, mean, biased var)` of a training forward.
pub(crate) type TrainOutput<B> = (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>);
/// `(x, gamma, beta)` and what follows the normalisation.
pub(crate) type TrainArgs<B> = (
    (Tensor<B, 4>, Tensor<B, 1>, Tensor<B, 1>),
    Then<Tensor<B, 4>>,
);

fn train_on<B: Backend, E: BatchNormBackend>(
    args: TrainArgs<B>,
    epsilon: f64,
) -> Result<TrainOutput<B>, TrainArgs<B>> {
    let ((x, gamma, beta), then) = cast::<TrainArgs<B>, TrainArgs<E>>(args)?;
    let (x, gamma, beta) = (primitive(x), primitive(gamma), primitive(beta));
    let out = match then {
        Then::Nothing => E::batch_norm_train(x, gamma, beta, epsilon),
        Then::Relu { residual } => {
            E::batch_norm_relu_train(x, gamma, beta, residual.map(primitive), epsilon)
        }
    };
    let out: TrainOutput<E> = (float(out.output), float(out.mean), float(out.var));
    Ok(cast(out).unwrap_or_else(|_| unreachable!("B is E")))
}

/// A training forward through the fused kernels, or the arguments back when `B` has none.
pub(crate) fn train<B: Backend>(
    args: TrainArgs<B>,
    epsilon: f64,
) -> Result<TrainOutput<B>, TrainArgs<B>> {
    let args = match train_on::<B, Flex>(args, epsilon) {
        Ok(out) => return Ok(out),
        Err(args) => args,
    };
    train_on::<B, Autodiff<Flex>>(args, epsilon)
}

/// `(x, gamma, beta, mean, var)` and what follows the normalisation.
pub(crate) type EvalArgs<B> = (
    (
        Tensor<B, 4>,
        Tensor<B, 1>,
        Tensor<B, 1>,
        Tensor<B, 1>,
        Tensor<B, 1>,
    ),
    Then<Tensor<B, 4>>,
);

/// Normalisation with given statistics through the fused kernel, or the arguments back when `B`
/// has none.
pub(crate) fn eval<B: Backend>(
    args: EvalArgs<B>,
    epsilon: f64,
) -> Result<Tensor<B, 4>, EvalArgs<B>> {
    let ((x, gamma, beta, mean, var), then) = cast::<EvalArgs<B>, EvalArgs<Flex>>(args)?;
    let [x, gamma, beta, mean, var] = [
        primitive(x),
        primitive(gamma),
        primitive(beta),
        primitive(mean),
        primitive(var),
    ];
    let y = match then {
        Then::Nothing => Flex::batch_norm_eval(x, gamma, beta, mean, var, epsilon),
        Then::Relu { residual } => {
            Flex::batch_norm_relu_eval(x, gamma, beta, mean, var, residual.map(primitive), epsilon)
        }
    };
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
        let relu = |x: &Tensor<Flex, 4>| Then::Relu {
            residual: Some(x.clone()),
        };
        assert!(train((args::<Flex>(), Then::Nothing), 1e-5).is_ok(), "Flex");
        let (x, g, b) = args::<Flex>();
        assert!(
            train(((x.clone(), g, b), relu(&x)), 1e-5).is_ok(),
            "Flex, ReLU"
        );
        let ad = args::<Autodiff<Flex>>();
        assert!(train((ad, Then::Nothing), 1e-5).is_ok(), "Autodiff<Flex>");
        let other = args::<Autodiff<Flex, BalancedCheckpointing>>();
        assert!(
            train((other, Then::Nothing), 1e-5).is_err(),
            "a backend without the kernels"
        );
        let (x, g, b) = args::<Flex>();
        let (m, v) = (
            Tensor::zeros([3], &x.device()),
            Tensor::ones([3], &x.device()),
        );
        let eval_args = (x.clone(), g, b, m, v);
        assert!(
            eval((eval_args.clone(), Then::Nothing), 1e-5).is_ok(),
            "Flex inference"
        );
        assert!(
            eval((eval_args, relu(&x)), 1e-5).is_ok(),
            "Flex inference, ReLU"
        );
    }
}
