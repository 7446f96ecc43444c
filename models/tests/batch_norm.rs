//! Our BatchNorm (`models::nn::BatchNorm`, fused kernels on Flex) against Burn's own
//! `burn::nn::BatchNorm`: training output, the gradients of x, gamma and beta, the running
//! statistics (the variance against Burn's unbiased `var`: ours folds it as PyTorch does, Burn's
//! module the biased one), and inference with them; and against PyTorch's `BatchNorm2d`
//! (committed fixtures).

use burn::backend::{Autodiff, Flex};
use burn::module::Param;
use burn::tensor::{Distribution, Tensor};
use models::nn::{BatchNorm, BatchNormConfig};

type Inner = Flex;
type Ad = Autodiff<Inner>;

const RTOL: f32 = 1e-4;

fn values<const D: usize>(t: Tensor<Inner, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().expect("f32 tensor")
}

/// Largest |a − b| relative to the largest |b| (plus 1e-6, for all-zero references).
fn assert_close(what: &str, a: &[f32], b: &[f32]) {
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1e-6f32, |m, v| m.max(v.abs()));
    let err = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale;
    assert!(err <= RTOL, "{what}: relative error {err} (> {RTOL})");
}

/// Both modules with the same random gamma and beta and the same running statistics.
fn modules(channels: usize, seed: u64) -> (BatchNorm<Ad>, burn::nn::BatchNorm<Ad>) {
    let device = Default::default();
    <Inner as burn::tensor::backend::Backend>::seed(&device, seed);
    let ours: BatchNorm<Ad> = BatchNormConfig::new(channels)
        .with_momentum(0.3)
        .init(&device);
    let gamma = Tensor::<Ad, 1>::random([channels], Distribution::Normal(1.0, 0.5), &device);
    let beta = Tensor::<Ad, 1>::random([channels], Distribution::Normal(0.0, 0.5), &device);
    let ours = BatchNorm {
        gamma: Param::from_tensor(gamma.clone()),
        beta: Param::from_tensor(beta.clone()),
        ..ours
    };
    let mut burns: burn::nn::BatchNorm<Ad> = burn::nn::BatchNormConfig::new(channels)
        .with_momentum(0.3)
        .init(&device);
    burns.gamma = Param::from_tensor(gamma);
    burns.beta = Param::from_tensor(beta);
    (ours, burns)
}

/// Two training steps (the running statistics fold twice), the gradients of `sum(y · dy)` for
/// the second, then inference with the running statistics.
fn check(shape: [usize; 4], seed: u64) {
    let device = Default::default();
    let (ours, burns) = modules(shape[1], seed);
    // A mean far from 0 tests the centring of the statistics and of the gradient.
    let x1 = Tensor::<Inner, 4>::random(shape, Distribution::Normal(3.0, 2.0), &device);
    let x2 = Tensor::<Inner, 4>::random(shape, Distribution::Normal(-1.0, 0.5), &device);
    let dy = Tensor::<Inner, 4>::random(shape, Distribution::Normal(0.0, 1.0), &device);

    let _ = ours.forward(Tensor::<Ad, 4>::from_inner(x1.clone()));
    let _ = burns.forward(Tensor::<Ad, 4>::from_inner(x1.clone()));

    let run = |forward: &dyn Fn(Tensor<Ad, 4>) -> Tensor<Ad, 4>,
               gamma: &Param<Tensor<Ad, 1>>,
               beta: &Param<Tensor<Ad, 1>>| {
        let x = Tensor::<Ad, 4>::from_inner(x2.clone()).require_grad();
        let y = forward(x.clone());
        let grads = (y.clone() * Tensor::from_inner(dy.clone()))
            .sum()
            .backward();
        let grad = |t: &Tensor<Ad, 1>| values(t.grad(&grads).expect("gamma/beta gradient"));
        (
            values(y.inner()),
            values(x.grad(&grads).expect("input gradient")),
            grad(&gamma.val()),
            grad(&beta.val()),
        )
    };
    let (y, dx, dgamma, dbeta) = run(&|x| ours.forward(x), &ours.gamma, &ours.beta);
    let (y_ref, dx_ref, dgamma_ref, dbeta_ref) =
        run(&|x| burns.forward(x), &burns.gamma, &burns.beta);
    assert_close(&format!("{shape:?} output"), &y, &y_ref);
    assert_close(&format!("{shape:?} input gradient"), &dx, &dx_ref);
    assert_close(&format!("{shape:?} gamma gradient"), &dgamma, &dgamma_ref);
    assert_close(&format!("{shape:?} beta gradient"), &dbeta, &dbeta_ref);

    // `value_sync`: a RunningState keeps the newest update pending until it is read this way.
    let running = |m: Tensor<Ad, 1>| values(m.inner());
    assert_close(
        &format!("{shape:?} running mean"),
        &running(ours.running_mean.value_sync()),
        &running(burns.running_mean.value_sync()),
    );
    // Burn's folds the biased variance and ours PyTorch's unbiased one: the reference is the
    // fold of Burn's own unbiased `var` of each step's input, from the initial 1.
    let unbiased = |x: Tensor<Inner, 4>| {
        let c = shape[1];
        x.swap_dims(0, 1)
            .reshape([c, shape[0] * shape[2] * shape[3]])
            .var(1)
            .reshape([c])
    };
    let running_var = unbiased(x1)
        .mul_scalar(0.3)
        .add_scalar(0.7)
        .mul_scalar(0.7)
        .add(unbiased(x2.clone()).mul_scalar(0.3));
    assert_close(
        &format!("{shape:?} running var"),
        &running(ours.running_var.value_sync()),
        &values(running_var),
    );

    // Inference: the inner backend (no autodiff) normalises with the running statistics, Burn's
    // module given ours so that only the normalisation is compared.
    use burn::module::AutodiffModule;
    let burns = burn::nn::BatchNorm {
        running_var: burn::module::RunningState::new(ours.running_var.value_sync()),
        ..burns
    };
    let x3 = Tensor::<Inner, 4>::random(shape, Distribution::Normal(0.5, 1.5), &device);
    let y = values(ours.valid().forward(x3.clone()));
    let y_ref = values(burns.valid().forward(x3));
    assert_close(&format!("{shape:?} inference output"), &y, &y_ref);
}

#[test]
fn fused_batch_norm_matches_burns_on_resnet_like_shapes() {
    check([4, 8, 16, 16], 1);
    check([2, 32, 7, 7], 2);
}

#[test]
fn fused_batch_norm_matches_burns_on_odd_and_tiny_shapes() {
    // Odd plane (shorter than the 8-float lanes, with a tail), batch 1, and 1×1 planes.
    check([3, 5, 3, 5], 3);
    check([1, 4, 9, 11], 4);
    check([8, 6, 1, 1], 5);
}

/// `forward_relu` (one fused op on Flex) against Burn's module, the residual sum and `relu` as
/// separate ops: the output, the gradients of x, gamma, beta and the residual, the running mean,
/// and inference.
fn check_relu(shape: [usize; 4], seed: u64, with_residual: bool) {
    use burn::tensor::activation::relu;
    let device = Default::default();
    let (ours, burns) = modules(shape[1], seed);
    let what = |name: &str| format!("{shape:?}, residual {with_residual}: {name}");
    let random = |mean| Tensor::<Inner, 4>::random(shape, Distribution::Normal(mean, 1.5), &device);
    let (x, residual, dy) = (random(2.0), random(0.0), random(0.0));

    type Forward<'a> = &'a dyn Fn(Tensor<Ad, 4>, Option<Tensor<Ad, 4>>) -> Tensor<Ad, 4>;
    let run = |forward: Forward, gamma: &Param<Tensor<Ad, 1>>, beta: &Param<Tensor<Ad, 1>>| {
        let x = Tensor::<Ad, 4>::from_inner(x.clone()).require_grad();
        let r = with_residual.then(|| Tensor::<Ad, 4>::from_inner(residual.clone()).require_grad());
        let y = forward(x.clone(), r.clone());
        let grads = (y.clone() * Tensor::from_inner(dy.clone()))
            .sum()
            .backward();
        let grad = |t: &Tensor<Ad, 1>| values(t.grad(&grads).expect("gamma/beta gradient"));
        let dr = r.map(|r| values(r.grad(&grads).expect("residual gradient")));
        (
            values(y.inner()),
            values(x.grad(&grads).expect("input gradient")),
            grad(&gamma.val()),
            grad(&beta.val()),
            dr,
        )
    };
    let separate = |y: Tensor<Ad, 4>, r: Option<Tensor<Ad, 4>>| {
        relu(match r {
            Some(r) => y + r,
            None => y,
        })
    };
    let (y, dx, dgamma, dbeta, dr) = run(&|x, r| ours.forward_relu(x, r), &ours.gamma, &ours.beta);
    let (y_ref, dx_ref, dgamma_ref, dbeta_ref, dr_ref) = run(
        &|x, r| separate(burns.forward(x), r),
        &burns.gamma,
        &burns.beta,
    );
    // The ReLU must cut: a share of the outputs zero, a share positive.
    let zeros = y_ref.iter().filter(|&&v| v == 0.0).count();
    assert!(
        zeros > y_ref.len() / 10 && zeros < y_ref.len() * 9 / 10,
        "{}",
        what("the ReLU cuts")
    );
    assert_close(&what("output"), &y, &y_ref);
    assert_close(&what("input gradient"), &dx, &dx_ref);
    assert_close(&what("gamma gradient"), &dgamma, &dgamma_ref);
    assert_close(&what("beta gradient"), &dbeta, &dbeta_ref);
    assert_eq!(dr.is_some(), with_residual, "{}", what("residual gradient"));
    if let (Some(dr), Some(dr_ref)) = (dr, dr_ref) {
        assert_close(&what("residual gradient"), &dr, &dr_ref);
    }
    let running = |m: Tensor<Ad, 1>| values(m.inner());
    assert_close(
        &what("running mean"),
        &running(ours.running_mean.value_sync()),
        &running(burns.running_mean.value_sync()),
    );

    use burn::module::AutodiffModule;
    let burns = burn::nn::BatchNorm {
        running_var: burn::module::RunningState::new(ours.running_var.value_sync()),
        ..burns
    };
    let (ours, burns) = (ours.valid(), burns.valid());
    let r = with_residual.then(|| residual.clone());
    let y = ours.forward_relu(x.clone(), r.clone());
    let y_ref = relu(match r {
        Some(r) => burns.forward(x) + r,
        None => burns.forward(x),
    });
    assert_close(&what("inference output"), &values(y), &values(y_ref));
}

#[test]
fn fused_norm_sum_and_relu_match_burns_ops() {
    for with_residual in [false, true] {
        check_relu([4, 8, 16, 16], 11, with_residual);
        check_relu([3, 5, 3, 5], 12, with_residual);
        check_relu([2, 16, 7, 7], 13, with_residual);
    }
}

#[test]
fn other_ranks_run_burns_arithmetic() {
    let device = Default::default();
    let (ours, burns) = modules(6, 7);
    let x = Tensor::<Ad, 3>::random([5, 6, 10], Distribution::Normal(2.0, 1.0), &device);
    let y = ours.forward(x.clone());
    let y_ref = burns.forward(x);
    assert_close("3-D output", &values(y.inner()), &values(y_ref.inner()));
}

/// Our BatchNorm against PyTorch's `BatchNorm2d` in training mode (fixtures from
/// `fixtures/make_batch_norm_fixtures.py`): output, the three gradients, and the running mean
/// and variance after one step (PyTorch folds the unbiased batch variance, and so do we).
#[test]
fn matches_torch_fixtures() {
    let bytes = include_bytes!("fixtures/batch_norm_torch.safetensors");
    let file = safetensors::SafeTensors::deserialize(bytes).expect("fixture is valid safetensors");
    let device = Default::default();
    let load = |name: &str| -> Option<(Vec<f32>, Vec<usize>)> {
        let view = file.tensor(name).ok()?;
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        Some((data, view.shape().to_vec()))
    };
    let mut checked = 0;
    for i in 0.. {
        let Some((x, shape)) = load(&format!("case{i}.x")) else {
            break;
        };
        let get = |name: &str| load(&format!("case{i}.{name}")).expect(name).0;
        let channels = shape[1];
        let module: BatchNorm<Ad> = BatchNormConfig::new(channels).init(&device);
        let param = |name: &str| {
            Param::from_tensor(Tensor::<Ad, 1>::from_floats(get(name).as_slice(), &device))
        };
        let module = BatchNorm {
            gamma: param("gamma"),
            beta: param("beta"),
            ..module
        };
        let x = Tensor::<Ad, 4>::from_inner(Tensor::from_data(
            burn::tensor::TensorData::new(x, shape.clone()),
            &device,
        ))
        .require_grad();
        let dy = Tensor::<Inner, 4>::from_data(
            burn::tensor::TensorData::new(get("dy"), shape.clone()),
            &device,
        );
        let y = module.forward(x.clone());
        let grads = (y.clone() * Tensor::from_inner(dy)).sum().backward();
        let what = |name: &str| format!("case {i} {shape:?} {name}");
        assert_close(&what("output"), &values(y.inner()), &get("y"));
        assert_close(
            &what("input gradient"),
            &values(x.grad(&grads).expect("dx")),
            &get("dx"),
        );
        let grad = |p: &Param<Tensor<Ad, 1>>| values(p.val().grad(&grads).expect("param grad"));
        assert_close(
            &what("gamma gradient"),
            &grad(&module.gamma),
            &get("dgamma"),
        );
        assert_close(&what("beta gradient"), &grad(&module.beta), &get("dbeta"));
        assert_close(
            &what("running mean"),
            &values(module.running_mean.value_sync().inner()),
            &get("running_mean"),
        );
        assert_close(
            &what("running var"),
            &values(module.running_var.value_sync().inner()),
            &get("running_var"),
        );
        checked += 1;
    }
    assert_eq!(checked, 4, "every fixture case checked");
}
