//! Pretrained weights against torchvision: a torchvision ResNet-18 saved as a DDP state_dict
//! (`module.` keys, fp16) and torchvision's logits for eight JPEGs, both committed and made by
//! `tests/fixtures/make_resnet18_fixture.py`.

mod common;

use burn::backend::{Autodiff, Flex};
use burn_dist::{DistOptions, World};
use clap::Parser;
use data::{DistributedSampler, ImageFolder, Loader, LoaderConfig};
use models::{ImageClassifier, ResNet, ResNetConfig};
use safetensors::SafeTensors;
use train::{RunContext, TrainArgs};

type TestBackend = Flex;

/// torchvision's eval-mode logits `[8, 1000]` for the photos, and the photo names in order.
fn torchvision_logits() -> (Vec<f32>, Vec<String>) {
    let bytes = std::fs::read(common::fixtures().join("resnet18_logits.safetensors"))
        .expect("logits fixture");
    let (_, metadata) = SafeTensors::read_metadata(&bytes).expect("header");
    let names = metadata
        .metadata()
        .as_ref()
        .and_then(|m| m.get("images"))
        .expect("image names")
        .split(',')
        .map(str::to_string)
        .collect();
    let file = SafeTensors::deserialize(&bytes).expect("parse");
    let view = file.tensor("logits").expect("logits");
    assert_eq!(view.shape(), [8, 1000]);
    let logits = view
        .data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    (logits, names)
}

fn load_fixture_model(dir: &std::path::Path) -> ResNet<TestBackend> {
    let path = common::unpacked_resnet18(dir);
    let device = Default::default();
    let model = ResNetConfig::resnet18(1000).init::<TestBackend>(&device);
    // The call `train --weights` makes.
    let (model, report) =
        train::weights::load_pretrained(model, &path, None, &device).expect("loads");
    assert!(report.stripped_ddp_prefix, "the fixture has DDP's keys");
    assert!(report.skipped.is_empty());
    model
}

fn argmax(row: &[f32]) -> usize {
    (0..row.len()).fold(0, |best, i| if row[i] > row[best] { i } else { best })
}

/// max |ours − theirs| / max |theirs|: the error relative to the logits' scale.
fn relative_error(ours: &[f32], theirs: &[f32]) -> f32 {
    let scale = theirs.iter().fold(0f32, |m, v| m.max(v.abs()));
    let diff = ours
        .iter()
        .zip(theirs)
        .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

#[test]
fn logits_match_torchvision_on_its_inputs_and_predictions_through_our_pipeline() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = load_fixture_model(dir.path());
    let (theirs, names) = torchvision_logits();
    let device = Default::default();

    // 1. torchvision's own val-transform output (the committed 8-bit crops, normalised as
    //    ToTensor + Normalize do): the model alone against torch, within 1e-3 relative.
    let photos = common::photos();
    let mut pixels = Vec::new();
    for (photo, name) in photos.iter().zip(&names) {
        assert_eq!(
            photo.file_name().and_then(|n| n.to_str()),
            Some(name.as_str())
        );
        let png = photo
            .parent()
            .expect("dir")
            .join("val224")
            .join(name.replace(".jpg", ".png"));
        let crop = image::open(&png).expect("torchvision crop").into_rgb8();
        let mut chw = vec![0u8; 3 * 224 * 224];
        data::transform::hwc_to_chw(crop.as_raw(), 224, 224, false, &mut chw);
        pixels.extend(chw);
    }
    let images = data::u8_images_to_tensor::<TestBackend>(&pixels, [8, 3, 224, 224], &device);
    let ours: Vec<f32> = model.classify(images).into_data().to_vec().expect("f32");
    let error = relative_error(&ours, &theirs);
    eprintln!("logits on torchvision's inputs: max error {error:.2e} of the logit scale");
    assert!(
        error < 1e-3,
        "logits differ from torchvision's by {error:.2e}"
    );

    // 2. Our decode and validation transform of the JPEGs: the same predictions.
    let folder =
        ImageFolder::new(common::photo_folder(&dir.path().join("photos"))).expect("photo folder");
    let sampler = DistributedSampler::new(folder.len(), 1, 0)
        .expect("sampler")
        .with_shuffle(false);
    let mut loader = Loader::new(folder, sampler, LoaderConfig::val(224, 8)).expect("loader");
    let batch = loader.epoch(0).next().expect("a batch").expect("decodes");
    let ours: Vec<f32> = model
        .classify(batch.images_tensor::<TestBackend>(&device))
        .into_data()
        .to_vec()
        .expect("f32");
    let error = relative_error(&ours, &theirs);
    eprintln!("logits through our JPEG pipeline: max error {error:.2e} of the logit scale");
    for i in 0..8 {
        let (a, b) = (&ours[i * 1000..][..1000], &theirs[i * 1000..][..1000]);
        assert_eq!(argmax(a), argmax(b), "{}: prediction differs", names[i]);
        assert_eq!(argmax(b), i, "the fixture predicts photo i as class i");
    }
    assert!(
        error < 3e-2,
        "pipeline pixels moved the logits by {error:.2e}"
    );
}

#[test]
fn evaluate_scores_the_photos_like_torchvision() {
    let dir = tempfile::tempdir().expect("temp dir");
    let model = load_fixture_model(dir.path());
    let (theirs, _) = torchvision_logits();
    // torchvision's top-1 and top-5 hits with photo i labelled class i.
    let (mut top1, mut top5) = (0, 0);
    for i in 0..8 {
        let row = &theirs[i * 1000..][..1000];
        let above = row.iter().filter(|&&v| v > row[i]).count();
        top1 += usize::from(above == 0);
        top5 += usize::from(above < 5);
    }

    let root = common::photo_folder(&dir.path().join("photos"));
    let args = TrainArgs::try_parse_from([
        "train",
        "--val-dir",
        root.to_str().expect("utf-8"),
        "--val-batch-size",
        "3",
        "--workers",
        "2",
    ])
    .expect("flags");
    let folder = ImageFolder::new(&root).expect("folder");
    let sampler = DistributedSampler::new(folder.len(), 1, 0)
        .expect("sampler")
        .with_shuffle(false);
    let mut loader = Loader::new(folder, sampler, LoaderConfig::val(224, 3)).expect("loader");
    let ctx = RunContext {
        args,
        dist: burn_dist::init(&World::single(), &DistOptions::default()).expect("world of one"),
        backend: "flex".into(),
        devices: "cpu".into(),
        show_progress: false,
    };
    let metrics = train::evaluate::<Autodiff<TestBackend>, ResNet<Autodiff<TestBackend>>>(
        &ctx,
        &model,
        &mut loader,
        None,
        &Default::default(),
    )
    .expect("evaluates");
    assert_eq!(metrics.count, 8);
    assert_eq!(metrics.accuracy, top1 as f64 / 8.0);
    assert_eq!(metrics.accuracy_top5, top5 as f64 / 8.0);
    // And the loss is torch's cross-entropy of its logits, up to the pipeline's pixel error.
    let torch_loss: f64 = (0..8)
        .map(|i| {
            let row = &theirs[i * 1000..][..1000];
            let max = row.iter().fold(f32::MIN, |m, &v| m.max(v));
            let lse = f64::from(max)
                + row
                    .iter()
                    .map(|&v| f64::from(v - max).exp())
                    .sum::<f64>()
                    .ln();
            lse - f64::from(row[i])
        })
        .sum::<f64>()
        / 8.0;
    assert!(
        (metrics.loss - torch_loss).abs() < 0.05 * torch_loss.max(0.1),
        "loss {} vs torchvision's {torch_loss}",
        metrics.loss
    );
}
