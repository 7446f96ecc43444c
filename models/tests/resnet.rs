//! ResNet structure, shapes, and that a ResNet can learn.

use burn::backend::{Autodiff, Flex};
use burn::module::{AutodiffModule, Module};
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, Optimizer, SgdConfig, momentum::MomentumConfig};
use burn::tensor::{Distribution, Int, Tensor, backend::Backend};
use models::{ImageClassifier, ResNetConfig, num_trainable_params};

type TestBackend = Flex;

#[test]
fn parameter_counts_match_torchvision() {
    let device = Default::default();
    // torchvision: sum(p.numel() for p in resnetN().parameters())
    for (depth, expected) in [
        (18, 11_689_512),
        (34, 21_797_672),
        (50, 25_557_032),
        (101, 44_549_160),
        (152, 60_192_808),
    ] {
        let model = ResNetConfig::from_depth(depth, 1000)
            .expect("standard depth")
            .init::<TestBackend>(&device);
        assert_eq!(num_trainable_params(&model), expected, "ResNet-{depth}");
    }
}

#[test]
fn unsupported_depth_is_an_error_naming_it() {
    let error = ResNetConfig::from_depth(42, 10).expect_err("42 is no ResNet");
    assert!(error.to_string().contains("42"), "{error}");
}

#[test]
fn output_shapes_at_64_and_224() {
    let device = Default::default();
    for (config, name) in [
        (ResNetConfig::resnet18(10), "resnet18"),
        (ResNetConfig::resnet50(1000), "resnet50"),
    ] {
        let model = config.init::<TestBackend>(&device);
        for (batch, size) in [(2, 64), (1, 224)] {
            let images = Tensor::<TestBackend, 4>::random(
                [batch, 3, size, size],
                Distribution::Normal(0.0, 1.0),
                &device,
            );
            let logits = model.classify(images);
            assert_eq!(
                logits.dims(),
                [batch, config.num_classes],
                "{name} at {size}x{size}"
            );
        }
    }
}

#[test]
fn zero_init_residual_zeroes_each_blocks_last_norm() {
    let device = Default::default();
    let model = ResNetConfig::resnet50(10)
        .with_zero_init_residual(true)
        .init::<TestBackend>(&device);
    for block in model.layer1.iter().chain(&model.layer4) {
        let bn3 = block.bn3.as_ref().expect("bottleneck has bn3");
        assert_eq!(bn3.gamma.val().abs().sum().into_scalar(), 0.0);
        // The other norms keep torchvision's weight 1.
        let bn2 = block.bn2.gamma.val();
        assert_eq!(bn2.clone().sum().into_scalar(), bn2.dims()[0] as f32);
    }
}

#[test]
fn conv_init_is_kaiming_normal_fan_out() {
    let device = Default::default();
    TestBackend::seed(&device, 7);
    let model = ResNetConfig::resnet18(10).init::<TestBackend>(&device);
    // layer4.0.conv2: 512 -> 512, 3x3; torchvision std = sqrt(2 / (512 * 9)).
    let weight = model.layer4[0].conv2.weight.val();
    let n = weight.shape().num_elements() as f64;
    let mean = weight.clone().sum().into_scalar() as f64 / n;
    let var = weight.powf_scalar(2.0).sum().into_scalar() as f64 / n - mean * mean;
    let expected = 2.0 / (512.0 * 9.0);
    assert!(mean.abs() < 1e-3, "mean {mean}");
    assert!(
        (var / expected - 1.0).abs() < 0.02,
        "var {var}, expected {expected}"
    );
}

#[test]
fn resnet18_overfits_a_fixed_batch() {
    type B = Autodiff<Flex>;
    let device = Default::default();
    B::seed(&device, 42);
    let mut model = ResNetConfig::resnet18(10).init::<B>(&device);
    let images = Tensor::<B, 4>::random([8, 3, 32, 32], Distribution::Normal(0.0, 1.0), &device);
    let labels = Tensor::<B, 1, Int>::from_data([3, 1, 4, 1, 5, 9, 2, 6], &device);
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut optimizer = SgdConfig::new()
        .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
        .init();

    let mut losses = Vec::new();
    for _ in 0..50 {
        let logits = model.classify(images.clone());
        let loss = loss_fn.forward(logits, labels.clone());
        losses.push(loss.clone().into_scalar());
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = optimizer.step(0.05, model, grads);
    }
    let (first, last) = (losses[0], losses[losses.len() - 1]);
    assert!(first.is_finite() && first > 1.0, "initial loss {first}");
    assert!(
        last < 0.1 * first,
        "loss fell only from {first} to {last}: {losses:?}"
    );
    // The trained model is also usable for inference.
    let eval = model.valid();
    assert_eq!(eval.classify(images.inner()).dims(), [8, 10]);
    let _ = eval.num_params();
}
