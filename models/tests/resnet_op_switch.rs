//! A whole ResNet-18 train step (forward, backward, one SGD step) with our conv and BatchNorm
//! equals the same step with Burn's, one op at a time and both together. Its own test binary: the
//! choices are process-wide.

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Int, Tensor, backend::Backend};
use models::{ImageClassifier, OpImpl, ResNet, ResNetConfig, set_batch_norm_impl, set_conv_impl};

type TestBackend = Flex;
type Ad = Autodiff<TestBackend>;

/// Every float parameter's gradient, in visit order.
struct CollectGrads<'a> {
    grads: &'a <Ad as AutodiffBackend>::Gradients,
    out: Vec<Vec<f32>>,
}

impl ModuleVisitor<Ad> for CollectGrads<'_> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
        if let Some(grad) = param.val().grad(self.grads) {
            self.out
                .push(grad.into_data().to_vec::<f32>().expect("f32 gradient"));
        }
    }
}

/// Every trainable parameter's value, in visit order. BatchNorm's running statistics are left
/// out: they live in state shared between a module and its clones, so the first step would
/// leak into the second.
struct CollectValues(Vec<Vec<f32>>);

impl ModuleVisitor<Ad> for CollectValues {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<Ad, D>>) {
        let value = param.val();
        if value.is_require_grad() {
            self.0
                .push(value.into_data().to_vec::<f32>().expect("f32 value"));
        }
    }
}

struct Step {
    loss: f32,
    grads: Vec<Vec<f32>>,
    after: Vec<Vec<f32>>,
}

fn step(
    (conv, batch_norm): (OpImpl, OpImpl),
    model: ResNet<Ad>,
    images: Tensor<Ad, 4>,
    labels: Tensor<Ad, 1, Int>,
) -> Step {
    set_conv_impl(conv);
    set_batch_norm_impl(batch_norm);
    let logits = model.classify(images);
    let loss = CrossEntropyLossConfig::new()
        .init(&logits.device())
        .forward(logits, labels);
    let loss_value = loss.clone().into_scalar();
    let grads = loss.backward();
    let mut collect = CollectGrads {
        grads: &grads,
        out: Vec::new(),
    };
    model.visit(&mut collect);
    let grads_out = collect.out;
    let params = GradientsParams::from_grads(grads, &model);
    let mut optim = SgdConfig::new().init::<Ad, ResNet<Ad>>();
    let model = optim.step(0.1, model, params);
    let mut after = CollectValues(Vec::new());
    model.visit(&mut after);
    Step {
        loss: loss_value,
        grads: grads_out,
        after: after.0,
    }
}

/// Largest |a − b| over the tensor, relative to the largest |b| (so near-zero elements of a
/// large gradient do not dominate).
fn relative_error(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(1e-12f32, |m, v| m.max(v.abs()));
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
        / scale
}

/// Loss, gradients and updated parameters of `fast` against `burn`, each within 1e-4 relative.
fn assert_same_step(what: &str, fast: &Step, burn: &Step) {
    let loss_err = (fast.loss - burn.loss).abs() / burn.loss.abs();
    assert!(
        loss_err <= 1e-4,
        "{what}: loss {} vs Burn's {}",
        fast.loss,
        burn.loss
    );
    // 20 convs + 20 BatchNorm (weight, bias) + fc (weight, bias) = 62 trainable tensors.
    assert_eq!(
        fast.grads.len(),
        62,
        "{what}: one gradient per trainable tensor"
    );
    assert_eq!(fast.grads.len(), burn.grads.len());
    for (i, (f, b)) in fast.grads.iter().zip(&burn.grads).enumerate() {
        let err = relative_error(f, b);
        assert!(
            err <= 1e-4,
            "{what}: gradient {i} ({} values): relative error {err}",
            b.len()
        );
    }
    assert_eq!(
        fast.after.len(),
        62,
        "{what}: one value per trainable tensor"
    );
    for (i, (f, b)) in fast.after.iter().zip(&burn.after).enumerate() {
        let err = relative_error(f, b);
        assert!(
            err <= 1e-4,
            "{what}: parameter {i} after SGD: relative error {err}"
        );
    }
}

#[test]
fn resnet18_train_step_with_our_ops_matches_burns() {
    let device = Default::default();
    // Two correct float implementations differ by rounding (here ≤ 1.4e-5 relative), except
    // where an activation sits within rounding of a ReLU or max-pool kink: there the two paths
    // can route one element's gradient differently, a discrete ~1e-2 change upstream of it
    // (seeds 11 and 12 hit one in layer2, at the same place with 1 and 3 threads, so it is a
    // kink and not a race). Where the kinks fall also depends on the CPU: Flex rounds Burn's conv
    // differently with AVX-512 than with AVX2, so seed 13, kink-free on an AVX2 machine, hits one
    // on an AVX-512 one (as do 14, 16, 19, 20, 21 there). Seed 17 has none on the AVX-512 Xeon
    // (15 and 18 neither; not yet re-checked on AVX2), so the
    // comparison measures the ops themselves.
    Ad::seed(&device, 17);
    let model: ResNet<Ad> = ResNetConfig::resnet18(10).init(&device);
    let images = Tensor::<Ad, 4>::random([8, 3, 64, 64], Distribution::Normal(0.0, 1.0), &device);
    let labels = Tensor::<Ad, 1, Int>::from_ints([1, 7, 3, 9, 0, 2, 5, 7], &device);
    // Params initialise lazily, and a clone would draw its own values: draw them once here.
    model.visit(&mut CollectValues(Vec::new()));
    let run = |choice| step(choice, model.clone(), images.clone(), labels.clone());

    let burn = run((OpImpl::Burn, OpImpl::Burn));
    let conv = run((OpImpl::Fast, OpImpl::Burn));
    assert_same_step("our conv", &conv, &burn);
    let batch_norm = run((OpImpl::Burn, OpImpl::Fast));
    assert_same_step("our BatchNorm", &batch_norm, &burn);
    let both = run((OpImpl::Fast, OpImpl::Fast));
    assert_same_step("our conv and BatchNorm", &both, &burn);
}
