//! Mixup, CutMix and the soft-target loss against torchvision's `transforms.v2.MixUp` / `CutMix`
//! and torch's `F.cross_entropy`, from `fixtures/mix_torch.safetensors` (made by
//! `fixtures/make_mix_fixtures.py`, which runs the transforms with the random draws pinned).
//!
//! Then the `train` binary with both on for one epoch on generated data.
//!
//! Tolerances: the CutMix box and corrected λ exactly (integer arithmetic and one division, the
//! same in f64); the CutMix images and every soft target exactly up to one f32 rounding (1e-6);
//! the Mixup images 1e-6 absolute (the same two f32 products and one sum as torch, on values of
//! order 1); the losses 1e-5 relative (torch's and Burn's log-softmax round differently).

use burn::backend::Flex;
use burn::tensor::{Int, Tensor, TensorData};
use safetensors::{Dtype, SafeTensors};
use train::mix::{MixOp, Targets, apply, cutmix_box, mix_images, one_hot, soft_targets};
use train::{per_sample_loss, per_sample_soft_loss};

mod common;

type B = Flex;

const CLASSES: usize = 6;
/// The fixture's label smoothings, by key.
const SMOOTHING: [(&str, f64); 2] = [("0", 0.0), ("1", 0.1)];

struct Fixture(SafeTensors<'static>);

impl Fixture {
    fn load() -> Self {
        let bytes: &'static [u8] = include_bytes!("fixtures/mix_torch.safetensors");
        Self(SafeTensors::deserialize(bytes).expect("fixture is valid safetensors"))
    }

    fn has(&self, name: &str) -> bool {
        self.0.tensor(name).is_ok()
    }

    fn view(&self, name: &str) -> safetensors::tensor::TensorView<'_> {
        self.0
            .tensor(name)
            .unwrap_or_else(|_| panic!("{name} in the fixture"))
    }

    fn f32(&self, name: &str) -> (Vec<f32>, Vec<usize>) {
        let view = self.view(name);
        assert_eq!(view.dtype(), Dtype::F32, "{name}");
        let data = view
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes(b.try_into().expect("4 bytes")))
            .collect();
        (data, view.shape().to_vec())
    }

    fn i64(&self, name: &str) -> Vec<i64> {
        let view = self.view(name);
        assert_eq!(view.dtype(), Dtype::I64, "{name}");
        view.data()
            .chunks_exact(8)
            .map(|b| i64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect()
    }

    fn f64(&self, name: &str) -> f64 {
        let view = self.view(name);
        assert_eq!(view.dtype(), Dtype::F64, "{name}");
        f64::from_le_bytes(view.data().try_into().expect("one f64"))
    }

    fn tensor<const D: usize>(&self, name: &str) -> Tensor<B, D> {
        let (data, shape) = self.f32(name);
        Tensor::from_data(TensorData::new(data, shape), &Default::default())
    }

    fn labels(&self) -> (Vec<i64>, Tensor<B, 1, Int>) {
        let labels = self.i64("labels");
        let n = labels.len();
        let tensor = Tensor::from_data(TensorData::new(labels.clone(), [n]), &Default::default());
        (labels, tensor)
    }
}

fn values<const D: usize>(t: Tensor<B, D>) -> Vec<f32> {
    t.into_data().to_vec::<f32>().expect("f32")
}

fn assert_abs(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let err = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0, f32::max);
    assert!(err <= tol, "{what}: max |error| {err} (> {tol})");
}

fn assert_rel(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    for (a, b) in got.iter().zip(want) {
        assert!(
            (a - b).abs() <= tol * b.abs().max(1.0),
            "{what}: {got:?} vs {want:?} (relative {tol})"
        );
    }
}

/// The mixed images, the soft targets, the labels accuracy counts against, and the loss with
/// and without smoothing, for one case of the fixture.
fn check_case(fixture: &Fixture, prefix: &str, op: &MixOp, image_tol: f32) {
    let images: Tensor<B, 4> = fixture.tensor("images");
    let (host_labels, labels) = fixture.labels();
    let logits: Tensor<B, 2> = fixture.tensor("logits");

    let (mixed, targets) = apply(Some(op), images.clone(), labels.clone(), &host_labels);
    let want = fixture.f32(&format!("{prefix}.images"));
    assert_eq!(mixed.dims().to_vec(), want.1, "{prefix} image shape");
    assert_abs(
        &format!("{prefix} images"),
        &values(mixed),
        &want.0,
        image_tol,
    );
    assert_abs(
        &format!("{prefix} images (mix_images)"),
        &values(mix_images(images, op)),
        &want.0,
        image_tol,
    );

    let soft = soft_targets(labels, CLASSES, op.lam());
    assert_abs(
        &format!("{prefix} soft targets"),
        &values(soft),
        &fixture.f32(&format!("{prefix}.target")).0,
        1e-6,
    );
    let argmax: Vec<i64> = targets
        .accuracy_labels()
        .into_data()
        .iter::<i64>()
        .collect();
    assert_eq!(
        argmax,
        fixture.i64(&format!("{prefix}.argmax")),
        "{prefix}: the labels training accuracy counts against"
    );
    for (key, eps) in SMOOTHING {
        assert_rel(
            &format!("{prefix} loss, label smoothing {eps}"),
            &values(targets.loss(logits.clone(), eps)),
            &fixture.f32(&format!("{prefix}.loss{key}")).0,
            1e-5,
        );
    }
}

#[test]
fn mixup_matches_torchvision_for_fixed_lambdas() {
    let fixture = Fixture::load();
    let mut checked = 0;
    for i in 0.. {
        let prefix = format!("mixup{i}");
        if !fixture.has(&format!("{prefix}.lam")) {
            break;
        }
        let lam = fixture.f64(&format!("{prefix}.lam"));
        check_case(&fixture, &prefix, &MixOp::Mixup { lam }, 1e-6);
        checked += 1;
    }
    // λ 0.3, 0.5 (ties between two labels: torch's first maximum) and 0.85.
    assert_eq!(checked, 3, "every Mixup case checked");
}

#[test]
fn cutmix_matches_torchvision_for_fixed_lambdas_and_centres() {
    let fixture = Fixture::load();
    let (h, w) = {
        let shape = fixture.f32("images").1;
        (shape[2], shape[3])
    };
    let mut checked = 0;
    for i in 0.. {
        let prefix = format!("cutmix{i}");
        if !fixture.has(&format!("{prefix}.lam")) {
            break;
        }
        let lam = fixture.f64(&format!("{prefix}.lam"));
        let centre = fixture.i64(&format!("{prefix}.centre"));
        let op = cutmix_box(lam, centre[0] as usize, centre[1] as usize, h, w);
        let MixOp::Cutmix { cut, lam: adjusted } = op else {
            panic!("{op:?}")
        };
        let want_box = fixture.i64(&format!("{prefix}.box"));
        assert_eq!(
            [cut.x1, cut.y1, cut.x2, cut.y2].map(|v| v as i64).to_vec(),
            want_box,
            "{prefix}: box of λ {lam} at {centre:?}"
        );
        assert_eq!(
            adjusted,
            fixture.f64(&format!("{prefix}.lam_adjusted")),
            "{prefix}: corrected λ"
        );
        check_case(&fixture, &prefix, &op, 0.0);
        checked += 1;
    }
    // Inside, clipped at two sides, clipped everywhere, empty (λ = 1), odd centre.
    assert_eq!(checked, 5, "every CutMix case checked");
}

/// The soft-target loss of one-hot targets against `F.cross_entropy` with integer labels, and
/// the integer-label loss against the same: the two paths agree with torch and with each other.
#[test]
fn soft_loss_of_one_hot_targets_equals_the_label_loss_and_torchs() {
    let fixture = Fixture::load();
    let (_, labels) = fixture.labels();
    let logits: Tensor<B, 2> = fixture.tensor("logits");
    for (key, eps) in SMOOTHING {
        let want = fixture.f32(&format!("hard_loss{key}")).0;
        let soft = values(per_sample_soft_loss(
            logits.clone(),
            one_hot(labels.clone(), CLASSES),
            eps,
        ));
        let hard = values(per_sample_loss(logits.clone(), labels.clone(), eps));
        assert_rel(
            &format!("soft loss of one-hot, ε {eps}"),
            &soft,
            &want,
            1e-5,
        );
        assert_rel(&format!("label loss, ε {eps}"), &hard, &want, 1e-5);
        assert_rel(&format!("soft vs label loss, ε {eps}"), &soft, &hard, 1e-6);
        let unmixed = Targets::Labels(labels.clone()).loss(logits.clone(), eps);
        assert_eq!(values(unmixed), hard, "no mixing: the label path");
    }
}

/// The binary with both on, through the sub-batch path (`--batches-per-allreduce 2`): one epoch
/// trains, the config table names the mixing, a rerun with the same seed gives the same epoch
/// figures to the last bit, and the run without mixing gives others (the mixing did something).
#[test]
fn train_binary_runs_an_epoch_with_mixup_and_cutmix() {
    const EXE: &str = env!("CARGO_BIN_EXE_train");
    let dir = tempfile::tempdir().expect("temp dir");
    let (train_dir, val_dir) = common::small_dataset(&dir.path().join("data"), 8, 2);
    let run = |name: &str, mixing: &[&str]| {
        let run_dir = dir.path().join(name);
        let output = common::run_ok(
            common::train_command(EXE, &run_dir, &train_dir, &val_dir)
                .args(["--epochs", "1", "--batches-per-allreduce", "2"])
                .args(mixing),
        );
        let stdout = String::from_utf8_lossy(&output.stdout).to_string();
        let metrics = common::read_metrics(&run_dir.join("logs"));
        assert_eq!(metrics.len(), 1, "{stdout}");
        let figures = ["train_loss", "train_accuracy", "train_accuracy_top5"]
            .map(|name| common::field(&metrics[0], name));
        (stdout, figures)
    };
    let both = ["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"];
    let (stdout, mixed) = run("mixed", &both);
    assert!(
        stdout.contains("mixup α 0.2 or cutmix α 1 (p = 0.5 each)"),
        "{stdout}"
    );
    assert!(mixed[0].is_finite() && mixed[0] > 0.0, "{mixed:?}");
    assert!(
        mixed[1..].iter().all(|a| (0.0..=1.0).contains(a)),
        "{mixed:?}"
    );
    let (_, again) = run("again", &both);
    assert_eq!(mixed, again, "the same seed, the same draws");
    let (stdout, plain) = run("plain", &[]);
    assert!(!stdout.contains("batch mixing"), "{stdout}");
    assert_ne!(mixed[0], plain[0], "mixing changed nothing");
}
