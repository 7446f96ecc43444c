//! `train::optim` against `torch.optim`, `clip_grad_norm_` and torchvision's `set_weight_decay`
//! (fixture made by `fixtures/make_optim_fixtures.py`).
//!
//! Every case starts from the same weights and applies the same gradients with a learning rate
//! that changes each step; after 5 steps each parameter must equal torch's within
//! `|ours − torch| ≤ 1e-5·|torch| + 1e-6` (f32 arithmetic on both sides, in another order).

mod common;

use burn::backend::{Autodiff, Flex};
use burn::module::{Module, Param};
use burn::nn::conv::{Conv2d, Conv2dConfig};
use burn::nn::{BatchNorm, BatchNormConfig, Linear, LinearConfig};
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use serde_json::Value;
use train::optim::clip::{clip_factor, global_grad_norm};
use train::optim::{DecayGroups, OptimizerKind, OptimizerSettings, TorchOptimizer, param_roles};

/// The derive names the backend generic `B`: this alias takes another name.
type AB = Autodiff<Flex>;
type Inner = <AB as AutodiffBackend>::InnerBackend;

const RTOL: f64 = 1e-5;
const ATOL: f64 = 1e-6;

/// torchvision's parameter kinds in one small model: a conv with bias, a BatchNorm, a linear.
#[derive(Module, Debug)]
struct Tiny<B: burn::tensor::backend::Backend> {
    conv: Conv2d<B>,
    bn: BatchNorm<B>,
    fc: Linear<B>,
}

fn fixture() -> Value {
    let text = std::fs::read_to_string(common::fixtures().join("optim_reference.json"))
        .expect("optim_reference.json");
    serde_json::from_str(&text).expect("json")
}

fn floats(value: &Value) -> Vec<f32> {
    value
        .as_array()
        .expect("array")
        .iter()
        .map(|v| v.as_f64().expect("number") as f32)
        .collect()
}

fn shape(fixture: &Value, name: &str) -> Vec<usize> {
    fixture["shapes"][name]
        .as_array()
        .expect("shape")
        .iter()
        .map(|d| d.as_u64().expect("dim") as usize)
        .collect()
}

/// The fixture's tensor `name` from `values` in Burn's layout (a Linear weight transposed).
fn tensor<Bk: burn::tensor::backend::Backend, const D: usize>(
    fixture: &Value,
    values: &Value,
    name: &str,
) -> Tensor<Bk, D> {
    let shape = shape(fixture, name);
    let t = Tensor::<Bk, D>::from_data(
        TensorData::new(floats(&values[name]), shape),
        &Default::default(),
    );
    if name == "fc.weight" {
        t.transpose()
    } else {
        t
    }
}

fn flat<Bk: burn::tensor::backend::Backend, const D: usize>(
    t: Tensor<Bk, D>,
    name: &str,
) -> Vec<f32> {
    let t = if name == "fc.weight" {
        Tensor::<Bk, 2>::from_data(t.into_data(), &Default::default())
            .transpose()
            .into_data()
    } else {
        t.into_data()
    };
    t.to_vec().expect("f32")
}

fn tiny(fixture: &Value) -> Tiny<AB> {
    let device = Default::default();
    let start = &fixture["start"];
    let mut model = Tiny {
        conv: Conv2dConfig::new([3, 2], [2, 2]).init(&device),
        bn: BatchNormConfig::new(2).init(&device),
        fc: LinearConfig::new(3, 2).init(&device),
    };
    model.conv.weight = Param::from_tensor(tensor(fixture, start, "conv.weight"));
    model.conv.bias = Some(Param::from_tensor(tensor(fixture, start, "conv.bias")));
    model.bn.gamma = Param::from_tensor(tensor(fixture, start, "bn.weight"));
    model.bn.beta = Param::from_tensor(tensor(fixture, start, "bn.bias"));
    model.fc.weight = Param::from_tensor(tensor(fixture, start, "fc.weight"));
    model.fc.bias = Some(Param::from_tensor(tensor(fixture, start, "fc.bias")));
    model
}

/// (torch name, our tensor flattened in torch's layout).
fn params(model: &Tiny<AB>) -> Vec<(&'static str, Vec<f32>)> {
    let bias = |p: &Option<Param<Tensor<AB, 1>>>| p.as_ref().expect("bias").val();
    vec![
        ("conv.weight", flat(model.conv.weight.val(), "conv.weight")),
        ("conv.bias", flat(bias(&model.conv.bias), "conv.bias")),
        ("bn.weight", flat(model.bn.gamma.val(), "bn.weight")),
        ("bn.bias", flat(model.bn.beta.val(), "bn.bias")),
        ("fc.weight", flat(model.fc.weight.val(), "fc.weight")),
        ("fc.bias", flat(bias(&model.fc.bias), "fc.bias")),
    ]
}

/// The fixture's gradients of one step, keyed by our parameter ids.
fn gradients(fixture: &Value, model: &Tiny<AB>, step: usize) -> GradientsParams {
    let values = &fixture["grads"][step];
    let mut grads = GradientsParams::new();
    grads.register::<Inner, 4>(model.conv.weight.id, tensor(fixture, values, "conv.weight"));
    let ids = [
        (model.conv.bias.as_ref().expect("bias").id, "conv.bias"),
        (model.bn.gamma.id, "bn.weight"),
        (model.bn.beta.id, "bn.bias"),
        (model.fc.bias.as_ref().expect("bias").id, "fc.bias"),
    ];
    for (id, name) in ids {
        grads.register::<Inner, 1>(id, tensor(fixture, values, name));
    }
    grads.register::<Inner, 2>(model.fc.weight.id, tensor(fixture, values, "fc.weight"));
    grads
}

fn assert_close(ours: &[f32], theirs: &[f32], what: &str) -> f64 {
    assert_eq!(ours.len(), theirs.len(), "{what}: length");
    let mut worst = 0.0f64;
    for (i, (&a, &b)) in ours.iter().zip(theirs).enumerate() {
        let (a, b) = (f64::from(a), f64::from(b));
        let err = (a - b).abs();
        assert!(
            err <= RTOL * b.abs() + ATOL,
            "{what}[{i}]: ours {a}, torch {b} (error {err:e})"
        );
        worst = worst.max(err / b.abs().max(1e-3));
    }
    worst
}

fn settings(case: &Value) -> OptimizerSettings {
    let kind = match case["opt"].as_str().expect("opt") {
        "sgd" => OptimizerKind::Sgd,
        "sgd_nesterov" => OptimizerKind::SgdNesterov,
        "rmsprop" => OptimizerKind::RmsProp,
        "adamw" => OptimizerKind::AdamW,
        other => panic!("unknown optimizer {other}"),
    };
    OptimizerSettings {
        kind,
        momentum: 0.9,
        decay: DecayGroups {
            weight_decay: case["weight_decay"].as_f64().expect("wd"),
            norm: case["norm_weight_decay"].as_f64(),
            bias: case["bias_weight_decay"].as_f64(),
        },
        clip_grad_norm: case["clip_grad_norm"].as_f64(),
    }
}

#[test]
fn each_optimizer_matches_torch_optim_after_five_steps() {
    let fixture = fixture();
    let lrs = floats(&fixture["lrs"]);
    let cases = fixture["trajectories"].as_array().expect("cases");
    assert_eq!(
        cases.len(),
        12,
        "4 optimizers × (plain, groups, groups + clip)"
    );
    for case in cases {
        let settings = settings(case);
        let label = format!(
            "{} wd {} norm {:?} bias {:?} clip {:?}",
            settings.kind.name(),
            settings.decay.weight_decay,
            settings.decay.norm,
            settings.decay.bias,
            settings.clip_grad_norm
        );
        let mut model = tiny(&fixture);
        let mut optimizer = TorchOptimizer::<Tiny<AB>, AB>::new(settings);
        let torch_norms = floats(&case["grad_norms"]);
        for (step, &lr) in lrs.iter().enumerate() {
            let grads = gradients(&fixture, &model, step);
            model = optimizer.step(f64::from(lr), model, grads);
            if let Some(norm) = optimizer.grad_norm() {
                let norm: Vec<f32> = norm.into_data().to_vec().expect("f32");
                assert_close(
                    &norm,
                    &torch_norms[step..=step],
                    &format!("{label} norm {step}"),
                );
            }
        }
        assert_eq!(
            optimizer.grad_norm().is_some(),
            settings.clip_grad_norm.is_some(),
            "{label}: the norm is computed exactly when clipping"
        );
        let mut worst = 0.0f64;
        for (name, ours) in params(&model) {
            worst = worst.max(assert_close(
                &ours,
                &floats(&case["params"][name]),
                &format!("{label} {name}"),
            ));
        }
        println!("{label}: worst relative error {worst:.2e}");
    }
}

#[test]
fn global_norm_and_clip_factor_match_clip_grad_norm() {
    let fixture = fixture();
    let model = tiny(&fixture);
    for case in fixture["clip"].as_array().expect("clip cases") {
        let max_norm = case["max_norm"].as_f64().expect("max norm");
        let grads = gradients(&fixture, &model, 0);
        let norm = global_grad_norm::<AB, _>(&model, &grads).expect("gradients");
        let ours: Vec<f32> = norm.clone().into_data().to_vec().expect("f32");
        let total = case["total_norm"].as_f64().expect("norm") as f32;
        assert_close(&ours, &[total], &format!("total norm, max {max_norm}"));
        let factor = clip_factor(norm, max_norm);
        let conv: Tensor<Inner, 4> = grads.get(model.conv.weight.id).expect("grad");
        let fc: Tensor<Inner, 2> = grads.get(model.fc.weight.id).expect("grad");
        let clipped = |t: Vec<f32>| {
            let f: Vec<f32> = factor.clone().into_data().to_vec().expect("f32");
            t.into_iter().map(|v| v * f[0]).collect::<Vec<_>>()
        };
        assert_close(
            &clipped(flat(conv, "conv.weight")),
            &floats(&case["grads"]["conv.weight"]),
            "clipped conv.weight",
        );
        assert_close(
            &clipped(flat(fc, "fc.weight")),
            &floats(&case["grads"]["fc.weight"]),
            "clipped fc.weight",
        );
    }
}

#[test]
fn resnet18_groups_are_torchvisions() {
    let fixture = fixture();
    let reference = &fixture["resnet18_groups"];
    let decay = DecayGroups {
        weight_decay: reference["weight_decay"].as_f64().expect("wd"),
        norm: reference["norm_weight_decay"].as_f64(),
        bias: reference["bias_weight_decay"].as_f64(),
    };
    let model = models::ResNetConfig::resnet18(10).init::<AB>(&Default::default());
    let roles = param_roles(&model);
    let group = |wanted: f64| -> Vec<String> {
        roles
            .iter()
            .filter(|(_, role)| decay.decay(*role) == wanted)
            .map(|(name, _)| name.clone())
            .collect()
    };
    let names = |key: &str| -> Vec<String> {
        reference[key]
            .as_array()
            .expect("names")
            .iter()
            .map(|n| n.as_str().expect("name").to_string())
            .collect()
    };
    assert_eq!(group(decay.weight_decay), names("other"));
    assert_eq!(group(decay.norm.expect("norm")), names("norm"));
    assert_eq!(group(decay.bias.expect("bias")), names("bias"));
    // Exactly the BatchNorms' γ and β and fc.bias are kept out of --wd (ResNet convs have no bias).
    let names_all: Vec<String> = roles.iter().map(|(n, _)| n.clone()).collect();
    assert_eq!(
        names_all,
        models::torchvision::state_dict_keys(&model)
            .into_iter()
            .filter(|k| !k.contains("running_") && !k.ends_with("num_batches_tracked"))
            .collect::<Vec<_>>()
    );
}

/// Two steps, a checkpoint written and read back (and the broadcast's MessagePack round trip),
/// then a third step: the restored optimizer's step equals the uninterrupted one's exactly.
#[test]
fn adamw_and_rmsprop_state_survive_a_checkpoint() {
    use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
    use clap::Parser;
    use train::checkpoint::{self, CheckpointHeader};

    let fixture = fixture();
    let lrs = floats(&fixture["lrs"]);
    let dir = tempfile::tempdir().expect("temp dir");
    for opt in ["adamw", "rmsprop", "sgd_nesterov"] {
        let args = train::TrainArgs::parse_from(["train", "--opt", opt, "--clip-grad-norm", "2"]);
        let settings = OptimizerSettings::from_args(&args);
        let mut model = tiny(&fixture);
        let mut optimizer = TorchOptimizer::<Tiny<AB>, AB>::new(settings);
        for (step, &lr) in lrs.iter().enumerate().take(2) {
            let grads = gradients(&fixture, &model, step);
            model = optimizer.step(f64::from(lr), model, grads);
        }
        let path = dir.path().join(format!("{opt}.ckpt"));
        let header = CheckpointHeader {
            epoch: 1,
            args: args.clone(),
            world_size: 1,
            data_seed: 0,
            model_fingerprint: checkpoint::model_fingerprint(&model),
            sections: Vec::new(),
            history: Vec::new(),
            ema_n_averaged: None,
            mid_epoch: None,
        };
        checkpoint::save(&path, header, &model, &optimizer, None).expect("save");
        let read = checkpoint::read(&path).expect("read");
        assert!(read.has_current_optimizer_format());
        let fresh = TorchOptimizer::<Tiny<AB>, AB>::new(settings);
        let (restored_model, restored) = read
            .restore(tiny(&fixture), fresh, &Default::default())
            .expect("restore");
        // The broadcast path: rank 0's record through burn-dist's recorder.
        let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::default();
        let bytes = Recorder::<AB>::record(&recorder, restored.to_record(), ()).expect("encode");
        let record = Recorder::<AB>::load(&recorder, bytes, &Default::default()).expect("decode");
        let mut restored = TorchOptimizer::<Tiny<AB>, AB>::new(settings).load_record(record);

        let grads = gradients(&fixture, &model, 2);
        let next = optimizer.step(f64::from(lrs[2]), model, grads);
        let same_weights = restored_model.clone();
        let grads = gradients(&fixture, &restored_model, 2);
        let resumed = restored.step(f64::from(lrs[2]), restored_model, grads);
        for ((name, a), (_, b)) in params(&next).into_iter().zip(params(&resumed)) {
            assert_eq!(a, b, "{opt} {name}: the resumed step differs");
        }
        // A fresh optimizer's step would differ: the state is what makes them equal.
        let mut plain = TorchOptimizer::<Tiny<AB>, AB>::new(settings);
        let grads = gradients(&fixture, &same_weights, 2);
        let unstated = plain.step(f64::from(lrs[2]), same_weights, grads);
        assert_ne!(params(&unstated)[0].1, params(&resumed)[0].1, "{opt}");

        // Another --opt does not take this state.
        let other = OptimizerSettings {
            kind: OptimizerKind::Sgd,
            ..settings
        };
        let sgd = TorchOptimizer::<Tiny<AB>, AB>::new(other).load_record(optimizer.to_record());
        assert!(
            sgd.to_record().states.is_empty(),
            "{opt} state loaded into sgd"
        );
    }
}
