//! torchvision's learning-rate schedules and model EMA against torch (fixtures written by
//! `fixtures/make_schedule_ema_fixtures.py`).

mod common;

use burn::backend::Flex;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use serde_json::Value;
use train::ema::{ModelEma, adjusted_decay};
use train::{LrScheduler, TorchvisionSchedule, WarmupMethod};

fn fixture() -> Value {
    let text = std::fs::read_to_string(common::fixtures().join("schedule_ema.json"))
        .expect("schedule_ema.json");
    serde_json::from_str(&text).expect("json")
}

fn num(v: &Value, key: &str) -> f64 {
    v[key].as_f64().unwrap_or_else(|| panic!("{key} in {v}"))
}

fn int(v: &Value, key: &str) -> usize {
    v[key].as_u64().unwrap_or_else(|| panic!("{key} in {v}")) as usize
}

#[test]
fn per_epoch_rates_equal_torchs_chained_schedulers() {
    let fixture = fixture();
    let schedules = fixture["schedules"].as_array().expect("schedules");
    assert!(schedules.len() >= 8);
    for cfg in schedules {
        let scheduler = match cfg["scheduler"].as_str() {
            Some("steplr") => LrScheduler::Steplr,
            Some("cosineannealinglr") => LrScheduler::Cosineannealinglr,
            Some("exponentiallr") => LrScheduler::Exponentiallr,
            other => panic!("{other:?}"),
        };
        let method = match cfg["warmup_method"].as_str() {
            Some("linear") => WarmupMethod::Linear,
            _ => WarmupMethod::Constant,
        };
        let ours = TorchvisionSchedule::new(
            num(cfg, "lr"),
            scheduler,
            int(cfg, "step_size"),
            num(cfg, "gamma"),
            num(cfg, "lr_min"),
            (int(cfg, "warmup_epochs"), method, num(cfg, "warmup_decay")),
            int(cfg, "epochs"),
        );
        let theirs: Vec<f64> = cfg["values"]
            .as_array()
            .expect("values")
            .iter()
            .map(|v| v.as_f64().expect("f64"))
            .collect();
        assert_eq!(ours.per_epoch().len(), theirs.len());
        for (epoch, (a, b)) in ours.per_epoch().iter().zip(&theirs).enumerate() {
            assert!(
                (a - b).abs() <= 1e-12 * b.abs(),
                "{scheduler:?} {method:?} epoch {epoch}: {a} vs torch {b}"
            );
            assert_eq!(ours.lr(epoch), *a);
        }
    }
}

#[test]
fn adjusted_ema_decay_is_train_pys() {
    let fixture = fixture();
    for case in fixture["ema_decay"].as_array().expect("ema_decay") {
        let ours = adjusted_decay(
            num(case, "model_ema_decay"),
            int(case, "world_size"),
            int(case, "batch_size"),
            int(case, "model_ema_steps"),
            int(case, "epochs"),
        );
        let theirs = num(case, "decay");
        assert!((ours - theirs).abs() <= 1e-15, "{case}: {ours}");
    }
}

/// The fixture's tiny model: the same tensors in torch's `ORDER` (a conv weight, a BatchNorm with
/// its running statistics, a linear layer), as Burn parameters and running states.
#[derive(Module, Debug)]
struct Tiny<B: Backend> {
    conv: Param<Tensor<B, 4>>,
    bn: models::nn::BatchNorm<B>,
    fc_weight: Param<Tensor<B, 2>>,
    fc_bias: Param<Tensor<B, 1>>,
}

fn tiny() -> Tiny<Flex> {
    let device = Default::default();
    Tiny {
        conv: Param::from_tensor(Tensor::zeros([3, 2, 1, 1], &device)),
        bn: models::nn::BatchNormConfig::new(3).init(&device),
        fc_weight: Param::from_tensor(Tensor::zeros([2, 3], &device)),
        fc_bias: Param::from_tensor(Tensor::zeros([2], &device)),
    }
}

/// Sets every float tensor, in visit order, from the fixture's lists.
struct Load(std::vec::IntoIter<Vec<f32>>);

impl<B: Backend> ModuleMapper<B> for Load {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let values = self.0.next().expect("a list per tensor");
        let shape = tensor.shape();
        let loaded = Tensor::from_data(TensorData::new(values, shape), &tensor.device());
        Param::from_mapped_value(id, loaded, mapper)
    }
}

#[derive(Default)]
struct Read(Vec<Vec<f32>>);

impl<B: Backend> ModuleVisitor<B> for Read {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        self.0.push(param.val().into_data().to_vec().expect("f32"));
    }
}

fn lists(v: &Value) -> Vec<Vec<f32>> {
    v.as_array()
        .expect("lists")
        .iter()
        .map(|l| {
            l.as_array()
                .expect("list")
                .iter()
                .map(|x| x.as_f64().expect("f64") as f32)
                .collect()
        })
        .collect()
}

fn with_state(values: &Value) -> Tiny<Flex> {
    tiny().map(&mut Load(lists(values).into_iter()))
}

#[test]
fn ema_after_each_update_equals_torchs_averaged_model() {
    let fixture = fixture();
    let run = &fixture["ema"];
    let decay = adjusted_decay(
        num(run, "model_ema_decay"),
        int(run, "world_size"),
        int(run, "batch_size"),
        int(run, "model_ema_steps"),
        int(run, "epochs"),
    );
    assert!((decay - num(run, "decay")).abs() <= 1e-15);
    let mut ema = ModelEma::new(with_state(&run["initial"]), decay);
    let updates = run["updates"].as_array().expect("updates");
    assert!(updates.iter().any(|u| u["reset"] == true));
    assert!(updates.iter().filter(|u| u["reset"] == false).count() >= 3);
    let order = run["order"].as_array().expect("order");
    for update in updates {
        ema.update(&with_state(&update["current"]));
        if update["reset"] == true {
            ema.reset();
        }
        let mut ours = Read::default();
        ema.model.visit(&mut ours);
        let theirs = lists(&update["expected"]);
        assert_eq!(ours.0.len(), theirs.len());
        for ((name, a), b) in order.iter().zip(&ours.0).zip(&theirs) {
            for (x, y) in a.iter().zip(b) {
                assert!(
                    (x - y).abs() <= 1e-6 * y.abs().max(1.0),
                    "epoch {} step {} {name}: {a:?} vs torch {b:?}",
                    update["epoch"],
                    update["step"]
                );
            }
        }
    }
}
