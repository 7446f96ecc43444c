//! "Training here is PyTorch's training": five optimizer steps of a ResNet-18 from the same start
//! on the same fixed batches, against torchvision's `train.py` in PyTorch
//! (`fixtures/make_trajectory_fixture.py` made `fixtures/trajectory_torch.safetensors`; read its
//! docstring for the setup and for the size of float32's own noise, against which the tolerances
//! below are stated).
//!
//! The start and the batches are formulas (SplitMix64 streams) that the script and this file both
//! evaluate; the start enters through the torchvision `state_dict` loader, as `--weights` does.

use std::collections::HashMap;
use std::path::Path;

use burn::backend::Autodiff;
use burn_flex::Flex;
use data::{Batch, BatchImages};
use models::{ImageClassifier, OpImpl, ResNet, ResNetConfig};
use safetensors::{Dtype, SafeTensors};

type B = Autodiff<Flex>;

const STEPS: usize = 5;
const BATCH: usize = 8;
const SIZE: usize = 64;
const CLASSES: usize = 10;
const BATCH_SEED: u64 = 10_000;
const LABEL_SMOOTHING: f64 = 0.1;

/// `n` outputs of SplitMix64 from `state`, as the fixture script computes them.
fn splitmix64(state: u64, n: usize) -> impl Iterator<Item = u64> {
    (1..=n as u64).map(move |i| {
        let mut z = state.wrapping_add(i.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    })
}

fn fnv1a64(text: &str) -> u64 {
    text.bytes().fold(0xCBF2_9CE4_8422_2325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01B3)
    })
}

/// The start of `key` with `shape`: the script's `initial_state` formula.
fn initial_values(key: &str, shape: &[usize]) -> Vec<f32> {
    let n = shape.iter().product();
    let fan_in: usize = shape.iter().skip(1).product();
    splitmix64(fnv1a64(key), n)
        .map(|z| {
            let u = (z >> 11) as f64 * 2f64.powi(-53) * 2.0 - 1.0;
            let v = if key.ends_with("running_mean") {
                u / 8.0
            } else if key.ends_with("running_var") {
                1.0 + u / 4.0
            } else if shape.len() > 1 {
                u * (6.0 / fan_in as f64).sqrt()
            } else if key.ends_with("weight") {
                0.5 + u / 4.0
            } else {
                u / 4.0
            };
            v as f32
        })
        .collect()
}

/// Our ResNet-18 with the script's start, loaded through the torchvision `state_dict` reader.
fn start_model(dir: &Path) -> ResNet<B> {
    let device = Default::default();
    let model = ResNetConfig::resnet18(CLASSES).init::<B>(&device);
    // Names and shapes from our own export, values from the formula.
    let exported = models::torchvision::to_safetensors_bytes(&model).expect("export");
    let exported = SafeTensors::deserialize(&exported).expect("parse the export");
    let mut tensors: Vec<(String, Vec<usize>, Dtype, Vec<u8>)> = Vec::new();
    for (key, view) in exported.tensors() {
        let bytes = if view.dtype() == Dtype::F32 {
            initial_values(&key, view.shape())
                .iter()
                .flat_map(|v| v.to_le_bytes())
                .collect()
        } else {
            view.data().to_vec()
        };
        tensors.push((key, view.shape().to_vec(), view.dtype(), bytes));
    }
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = tensors
        .iter()
        .map(|(k, shape, dtype, bytes)| {
            let view = safetensors::tensor::TensorView::new(*dtype, shape.clone(), bytes)
                .expect("tensor view");
            (k.clone(), view)
        })
        .collect();
    let path = dir.join("start.safetensors");
    safetensors::serialize_to_file(views, None, &path).expect("write the start");
    let (model, report) = models::torchvision::load_with(
        model,
        &path,
        &device,
        &models::torchvision::LoadOptions::default(),
    )
    .expect("load the start");
    assert!(report.skipped.is_empty(), "{:?}", report.skipped);
    model
}

/// The batch of `step`, samples `range` of its 8 (the script's `batches`).
fn batch(step: usize, range: std::ops::Range<usize>) -> Batch {
    let per_image = 3 * SIZE * SIZE;
    let pixels: Vec<u8> = splitmix64(BATCH_SEED, STEPS * BATCH * per_image)
        .skip((step * BATCH + range.start) * per_image)
        .take(range.len() * per_image)
        .map(|z| (z >> 56) as u8)
        .collect();
    let labels: Vec<i64> = splitmix64(BATCH_SEED + 1, STEPS * BATCH)
        .skip(step * BATCH + range.start)
        .take(range.len())
        .map(|z| (z % CLASSES as u64) as i64)
        .collect();
    let n = labels.len();
    Batch {
        images: BatchImages::U8(pixels),
        labels,
        indices: range.collect(),
        is_padding: vec![false; n],
        size: SIZE,
        erase: vec![None; n],
    }
}

/// The fixture's tensors, as f64.
fn fixture() -> HashMap<String, Vec<f64>> {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/trajectory_torch.safetensors");
    let bytes = std::fs::read(&path).expect("trajectory fixture");
    let file = SafeTensors::deserialize(&bytes).expect("parse the fixture");
    file.tensors()
        .into_iter()
        .map(|(key, view)| {
            assert_eq!(view.dtype(), Dtype::F64, "{key}");
            let values = view
                .data()
                .chunks_exact(8)
                .map(|c| f64::from_le_bytes(c.try_into().expect("8 bytes")))
                .collect();
            (key, values)
        })
        .collect()
}

/// The mean loss of `batch` under `model` in training mode (BatchNorm on the batch's statistics).
fn mean_loss<M: ImageClassifier<B>>(model: &M, batch: &Batch) -> f64 {
    let device = Default::default();
    let logits = model.classify(batch.images_tensor::<B>(&device));
    let loss = train::per_sample_loss(logits, batch.labels_tensor::<B>(&device), LABEL_SMOOTHING);
    f64::from(loss.mean().into_scalar())
}

#[test]
fn the_start_and_the_batches_are_the_scripts() {
    // The first step's loss sees only the start, the batch and the forward pass: it checks the
    // formulas on both sides before the trajectories are compared.
    models::set_conv_impl(OpImpl::Fast);
    models::set_batch_norm_impl(OpImpl::Fast);
    let dir = tempfile::tempdir().expect("tempdir");
    let model = start_model(dir.path());
    let torch = fixture();
    let ours = mean_loss(&model, &batch(0, 0..BATCH));
    let want = torch["world1/loss"][0];
    assert!(
        (ours - want).abs() < 1e-5,
        "step 1 loss {ours} vs torch {want}"
    );
    let halves = (mean_loss(&model, &batch(0, 0..4)) + mean_loss(&model, &batch(0, 4..8))) / 2.0;
    let want = torch["world2/loss"][0];
    assert!(
        (halves - want).abs() < 1e-5,
        "step 1 loss over two halves {halves} vs torch {want}"
    );
}
