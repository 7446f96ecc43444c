//! Weights by torchvision names, through safetensors.

use std::collections::HashMap;

use burn::backend::Flex;
use burn::tensor::{Distribution, Tensor, TensorData, Tolerance, backend::Backend};
use models::{ImageClassifier, ModelError, ResNetConfig, torchvision};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

type TestBackend = Flex;

/// torchvision's own `resnet50().state_dict()`: key, dtype, shape (written by torchvision 0.29).
const TORCHVISION_RESNET50: &str = include_str!("fixtures/torchvision_resnet50_state_dict.txt");

struct TorchEntry {
    key: String,
    dtype: String,
    shape: Vec<usize>,
}

fn torchvision_resnet50() -> Vec<TorchEntry> {
    TORCHVISION_RESNET50
        .lines()
        .filter(|line| !line.starts_with('#'))
        .map(|line| {
            let mut fields = line.split(' ');
            let key = fields.next().expect("key").to_string();
            let dtype = fields.next().expect("dtype").to_string();
            let shape = match fields.next().expect("shape") {
                "-" => Vec::new(),
                dims => dims.split('x').map(|d| d.parse().expect("dim")).collect(),
            };
            TorchEntry { key, dtype, shape }
        })
        .collect()
}

#[test]
fn resnet50_round_trip_is_bit_identical() {
    let device = Default::default();
    TestBackend::seed(&device, 1);
    let original = ResNetConfig::resnet50(1000).init::<TestBackend>(&device);
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("resnet50.safetensors");
    torchvision::save(&original, &path).expect("save");

    // A second model with other random weights, overwritten by the file.
    TestBackend::seed(&device, 2);
    let fresh = ResNetConfig::resnet50(1000).init::<TestBackend>(&device);
    let loaded = torchvision::load(fresh, &path, &device).expect("load");

    let images = Tensor::<TestBackend, 4>::random([2, 3, 64, 64], Distribution::Default, &device);
    let a = original.classify(images.clone()).into_data();
    let b = loaded.classify(images).into_data();
    assert_eq!(
        a.as_bytes(),
        b.as_bytes(),
        "outputs differ after the round trip"
    );

    // And every tensor survived byte for byte.
    let again = torchvision::to_safetensors_bytes(&loaded).expect("serialise");
    assert_eq!(std::fs::read(&path).expect("read"), again);
}

#[test]
fn our_keys_are_torchvisions_keys() {
    let device = Default::default();
    let model = ResNetConfig::resnet50(1000).init::<TestBackend>(&device);
    let ours = torchvision::state_dict_keys(&model);
    let theirs: Vec<String> = torchvision_resnet50().into_iter().map(|e| e.key).collect();
    assert_eq!(ours, theirs);
}

#[test]
fn a_torchvision_state_dict_loads_with_every_key_matched() {
    let device = Default::default();
    let entries = torchvision_resnet50();
    // Distinct, recognisable values per tensor: value = tensor index + position / 1e6.
    let mut buffers: Vec<Vec<u8>> = Vec::new();
    for (t, entry) in entries.iter().enumerate() {
        let n: usize = entry.shape.iter().product();
        let bytes = match entry.dtype.as_str() {
            "float32" => (0..n)
                .flat_map(|i| (t as f32 + (i % 1000) as f32 * 1e-3).to_le_bytes())
                .collect(),
            "int64" => 7i64.to_le_bytes().to_vec(),
            other => panic!("unexpected dtype {other}"),
        };
        buffers.push(bytes);
    }
    let views: Vec<(String, TensorView<'_>)> = entries
        .iter()
        .zip(&buffers)
        .map(|(entry, bytes)| {
            let dtype = if entry.dtype == "int64" {
                Dtype::I64
            } else {
                Dtype::F32
            };
            let view = TensorView::new(dtype, entry.shape.clone(), bytes).expect("view");
            (entry.key.clone(), view)
        })
        .collect();
    let file = safetensors::serialize(views, None).expect("serialise");
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("torchvision_resnet50.safetensors");
    std::fs::write(&path, &file).expect("write");

    let model = ResNetConfig::resnet50(1000).init::<TestBackend>(&device);
    let model = torchvision::load(model, &path, &device).expect("every key matches");

    // Spot checks: the values landed where torchvision's names say, with the layouts translated.
    let index: HashMap<&str, usize> = entries
        .iter()
        .enumerate()
        .map(|(i, e)| (e.key.as_str(), i))
        .collect();
    let expect_first = |key: &str| index[key] as f32;
    let gamma = model.layer2[0]
        .downsample
        .as_ref()
        .expect("downsample")
        .1
        .gamma
        .val();
    assert_eq!(
        gamma.into_data().to_vec::<f32>().expect("f32")[0],
        expect_first("layer2.0.downsample.1.weight")
    );
    let running_var = model.bn1.running_var.value();
    assert_eq!(
        running_var.into_data().to_vec::<f32>().expect("f32")[1],
        expect_first("bn1.running_var") + 1e-3
    );
    // fc.weight is [1000, 2048] in torch and [2048, 1000] in Burn: torch's row 0 is our column 0.
    let fc = model.fc.weight.val();
    assert_eq!(fc.dims(), [2048, 1000]);
    let column0 = fc.slice([0..2048, 0..1]).reshape([2048]).into_data();
    let expected: Vec<f32> = (0..2048)
        .map(|i| expect_first("fc.weight") + (i % 1000) as f32 * 1e-3)
        .collect();
    column0.assert_approx_eq::<f32>(
        &TensorData::new(expected, [2048]),
        Tolerance::absolute(1e-6),
    );

    // And what we write back is the same key set torchvision reads, num_batches_tracked included.
    let written = torchvision::to_safetensors_bytes(&model).expect("serialise");
    let parsed = SafeTensors::deserialize(&written).expect("parse");
    let mut names: Vec<String> = parsed.names().into_iter().map(str::to_string).collect();
    let mut expected: Vec<String> = entries.iter().map(|e| e.key.clone()).collect();
    names.sort();
    expected.sort();
    assert_eq!(names, expected);
}

/// A ResNet-18 with 10 classes saved in a temp dir (kept alive by the returned guard).
fn saved_resnet18_with_10_classes() -> (tempfile::TempDir, std::path::PathBuf) {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("r18.safetensors");
    let model = ResNetConfig::resnet18(10).init::<TestBackend>(&Default::default());
    torchvision::save(&model, &path).expect("save");
    (dir, path)
}

#[test]
fn wrong_class_count_is_a_shape_error_naming_the_key() {
    let device = Default::default();
    let (_dir, path) = saved_resnet18_with_10_classes();
    let error = torchvision::load(
        ResNetConfig::resnet18(1000).init::<TestBackend>(&device),
        &path,
        &device,
    )
    .expect_err("10 classes do not fit 1000");
    assert!(
        matches!(&error, ModelError::ShapeMismatch { key, .. } if key == "fc.weight"),
        "{error}"
    );
}

#[test]
fn other_depth_is_a_key_mismatch() {
    let device = Default::default();
    let (_dir, path) = saved_resnet18_with_10_classes();
    let error = torchvision::load(
        ResNetConfig::resnet34(10).init::<TestBackend>(&device),
        &path,
        &device,
    )
    .expect_err("ResNet-34 has more blocks");
    match error {
        ModelError::KeyMismatch {
            missing,
            unexpected,
            ..
        } => {
            assert!(
                missing.iter().any(|k| k.starts_with("layer1.2.")),
                "{missing:?}"
            );
            assert!(unexpected.is_empty(), "{unexpected:?}");
        }
        other => panic!("expected a key mismatch, got {other}"),
    }
}

#[test]
fn truncated_file_is_a_format_error() {
    let device = Default::default();
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("r18.safetensors");
    let model = ResNetConfig::resnet18(10).init::<TestBackend>(&device);
    let bytes = torchvision::to_safetensors_bytes(&model).expect("serialise");
    std::fs::write(&path, &bytes[..bytes.len() / 2]).expect("write");
    let error = torchvision::load(model, &path, &device).expect_err("truncated");
    assert!(matches!(error, ModelError::Format { .. }), "{error}");
    assert!(error.to_string().contains("r18.safetensors"));
}

/// The same tensors under other names: `rename(key)` gives the new key, `None` drops the tensor;
/// `extra` tensors (f32 zeros of the given shape) are added.
fn rewrite_keys(
    bytes: &[u8],
    rename: impl Fn(&str) -> Option<String>,
    extra: &[(&str, Vec<usize>)],
) -> Vec<u8> {
    let file = SafeTensors::deserialize(bytes).expect("parse");
    let extra_bytes: Vec<Vec<u8>> = extra
        .iter()
        .map(|(_, shape)| vec![0u8; 4 * shape.iter().product::<usize>()])
        .collect();
    let mut views: Vec<(String, TensorView<'_>)> = file
        .tensors()
        .into_iter()
        .filter_map(|(key, view)| rename(&key).map(|k| (k, view)))
        .collect();
    for ((key, shape), bytes) in extra.iter().zip(&extra_bytes) {
        views.push((
            key.to_string(),
            TensorView::new(Dtype::F32, shape.clone(), bytes).expect("view"),
        ));
    }
    safetensors::serialize(views, None).expect("serialise")
}

#[test]
fn ddp_module_prefix_is_accepted() {
    let device = Default::default();
    TestBackend::seed(&device, 5);
    let original = ResNetConfig::resnet18(10).init::<TestBackend>(&device);
    let plain = torchvision::to_safetensors_bytes(&original).expect("serialise");
    let ddp = rewrite_keys(&plain, |k| Some(format!("module.{k}")), &[]);
    let path = std::path::Path::new("ddp.safetensors");

    TestBackend::seed(&device, 6);
    let fresh = ResNetConfig::resnet18(10).init::<TestBackend>(&device);
    let (loaded, report) = torchvision::from_safetensors_bytes_with(
        fresh,
        &ddp,
        path,
        &device,
        &torchvision::LoadOptions::default(),
    )
    .expect("DDP keys load");
    assert!(report.stripped_ddp_prefix);
    assert!(report.skipped.is_empty());
    assert_eq!(
        torchvision::to_safetensors_bytes(&loaded).expect("serialise"),
        plain,
        "every tensor arrives under its unprefixed name"
    );

    // Only some keys prefixed: not DDP's layout, so they are unknown keys.
    let mixed = rewrite_keys(
        &plain,
        |k| {
            Some(if k == "conv1.weight" {
                format!("module.{k}")
            } else {
                k.to_string()
            })
        },
        &[],
    );
    let error = torchvision::from_safetensors_bytes(original, &mixed, path, &device)
        .expect_err("half-prefixed file");
    assert!(
        matches!(&error, ModelError::KeyMismatch { missing, unexpected, .. }
            if missing == &["conv1.weight"] && unexpected == &["module.conv1.weight"]),
        "{error}"
    );
}

#[test]
fn a_mismatched_head_is_skipped_only_when_asked_and_the_rest_loads() {
    let device = Default::default();
    TestBackend::seed(&device, 7);
    let pretrained = ResNetConfig::resnet18(1000).init::<TestBackend>(&device);
    let bytes = rewrite_keys(
        &torchvision::to_safetensors_bytes(&pretrained).expect("serialise"),
        |k| Some(format!("module.{k}")),
        &[],
    );
    let path = std::path::Path::new("imagenet.safetensors");

    TestBackend::seed(&device, 8);
    let target = ResNetConfig::resnet18(4).init::<TestBackend>(&device);
    let head_before = target.fc.weight.val().into_data();
    let strict = torchvision::from_safetensors_bytes(target.clone(), &bytes, path, &device)
        .expect_err("1000 classes do not fit 4 without skipping");
    assert!(
        matches!(&strict, ModelError::ShapeMismatch { key, .. } if key == "fc.weight"),
        "{strict}"
    );

    let options = torchvision::LoadOptions {
        skip_mismatched: vec!["fc".into()],
    };
    let (tuned, report) =
        torchvision::from_safetensors_bytes_with(target, &bytes, path, &device, &options)
            .expect("head skipped");
    let skipped: Vec<(&str, &[usize], &[usize])> = report
        .skipped
        .iter()
        .map(|s| (s.key.as_str(), &s.file_shape[..], &s.model_shape[..]))
        .collect();
    assert_eq!(
        skipped,
        vec![
            ("fc.weight", &[1000, 512][..], &[4, 512][..]),
            ("fc.bias", &[1000][..], &[4][..]),
        ]
    );
    // The head kept its initial values; the trunk is the file's.
    assert_eq!(tuned.fc.weight.val().into_data(), head_before);
    assert_eq!(
        tuned.conv1.weight.val().into_data(),
        pretrained.conv1.weight.val().into_data()
    );
    assert_eq!(
        tuned.layer4[1].bn2.running_var.value().into_data(),
        pretrained.layer4[1].bn2.running_var.value().into_data()
    );

    // A mismatch outside the skipped head is still an error.
    let target = ResNetConfig::resnet34(4).init::<TestBackend>(&device);
    let error = torchvision::from_safetensors_bytes_with(target, &bytes, path, &device, &options)
        .expect_err("ResNet-34 has more blocks than the file");
    assert!(matches!(error, ModelError::KeyMismatch { .. }), "{error}");
}

#[test]
fn a_key_mismatch_lists_every_missing_and_unknown_key() {
    let device = Default::default();
    let model = ResNetConfig::resnet18(10).init::<TestBackend>(&device);
    let bytes = rewrite_keys(
        &torchvision::to_safetensors_bytes(&model).expect("serialise"),
        |k| (!k.starts_with("layer4.1.")).then(|| k.to_string()),
        &[("aux_head.weight", vec![2, 2]), ("aux_head.bias", vec![2])],
    );
    let error = torchvision::from_safetensors_bytes(
        model,
        &bytes,
        std::path::Path::new("partial.safetensors"),
        &device,
    )
    .expect_err("keys differ");
    let message = error.to_string();
    for key in [
        "layer4.1.conv1.weight",
        "layer4.1.bn1.weight",
        "layer4.1.bn2.running_var",
        "aux_head.weight",
        "aux_head.bias",
        "partial.safetensors",
    ] {
        assert!(message.contains(key), "{key} missing from: {message}");
    }
    assert!(
        message.contains("10 key(s) of the model missing"),
        "{message}"
    );
    assert!(
        message.contains("2 key(s) in the file unknown"),
        "{message}"
    );
}

#[test]
fn export_right_after_a_training_step_holds_that_steps_running_statistics() {
    use burn::backend::Autodiff;
    type AB = Autodiff<Flex>;
    let device = Default::default();
    let model = ResNetConfig::resnet18(4).init::<AB>(&device);
    let images = Tensor::<AB, 4>::random([2, 3, 32, 32], Distribution::Default, &device);
    // Two training-mode passes: Burn keeps the latest running statistics per thread until a
    // sync, so an export that skips the sync shows the first pass's values.
    for _ in 0..2 {
        let _ = model.classify(images.clone());
    }
    let read = |bytes: &[u8]| -> Vec<f32> {
        let file = SafeTensors::deserialize(bytes).expect("parse");
        let view = file.tensor("bn1.running_mean").expect("bn1.running_mean");
        view.data()
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().expect("4 bytes")))
            .collect()
    };
    let exported = read(&torchvision::to_safetensors_bytes(&model).expect("export"));
    let synced: Vec<f32> = model
        .bn1
        .running_mean
        .value_sync()
        .into_data()
        .to_vec()
        .expect("f32");
    assert_eq!(exported, synced);
}
