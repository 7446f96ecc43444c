//! Loader: determinism, tensors, bad files, padding, partial batches.

mod common;

use std::collections::HashMap;

use burn::backend::Flex;
use data::{
    BadImagePolicy, BatchImages, DataError, DistributedSampler, ImageFolder, Loader, LoaderConfig,
    OutputFormat,
};

type TestBackend = Flex;

fn folder(classes: &[&str], per_class: usize) -> (tempfile::TempDir, ImageFolder) {
    let dir = tempfile::tempdir().expect("tempdir");
    common::make_folder(dir.path(), classes, per_class);
    let f = ImageFolder::new(dir.path()).expect("scan");
    (dir, f)
}

fn collect(loader: &mut Loader, epoch: u64) -> Vec<data::Batch> {
    loader.epoch(epoch).map(|b| b.expect("batch")).collect()
}

#[test]
fn batches_do_not_depend_on_worker_count() {
    let (_dir, f) = folder(&["a", "b", "c"], 7);
    let run = |workers, epoch| {
        let s = DistributedSampler::new(f.len(), 2, 1).expect("sampler");
        let cfg = LoaderConfig::train(24, 4)
            .with_workers(workers)
            .with_seed(5)
            .with_prefetch(1);
        let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
        collect(&mut l, epoch)
    };
    let one = run(1, 3);
    let four = run(4, 3);
    assert_eq!(one, four);
    // 21 samples over 2 ranks -> 11 per rank -> batches of 4, 4, 3 (last one partial).
    let sizes: Vec<usize> = one.iter().map(|b| b.len()).collect();
    assert_eq!(sizes, [4, 4, 3]);
    assert_eq!(one[0].shape(), [4, 3, 24, 24]);
    // Another epoch gives other crops and order.
    assert_ne!(one, run(1, 4));
}

#[test]
fn decoding_only_the_pixels_read_gives_the_same_batches_as_decoding_whole_images() {
    // Photo-like 500x375 and 375x500 JPEGs (4:2:0, as ImageNet's): the crops land anywhere, so
    // the region decode is exercised at every offset.
    let dir = tempfile::tempdir().expect("tempdir");
    data::synthetic::generate_imagenet_like(dir.path(), 24, 3).expect("generate");
    let f = ImageFolder::new(dir.path()).expect("scan");
    for config in [LoaderConfig::train(64, 8), LoaderConfig::val(64, 8)] {
        let run = |decode_region| {
            let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
            let cfg = config
                .with_workers(2)
                .with_seed(11)
                .with_decode_region(decode_region);
            let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
            collect(&mut l, 2)
        };
        let region = run(true);
        assert_eq!(region.iter().map(|b| b.len()).sum::<usize>(), 24);
        assert!(
            region == run(false),
            "region decoding changed the batches: {config:?}"
        );
    }
}

#[test]
fn later_epochs_give_the_same_batches_with_and_without_scan_indexes() {
    // Epochs 1 and 2 decode crops from the marks epoch 0 (and 1) left; the batches must be
    // those of a loader without marks. A budget too small for one file's marks keeps none.
    let dir = tempfile::tempdir().expect("tempdir");
    data::synthetic::generate_imagenet_like(dir.path(), 24, 3).expect("generate");
    let f = ImageFolder::new(dir.path()).expect("scan");
    for config in [LoaderConfig::train(64, 8), LoaderConfig::val(64, 8)] {
        let run = |budget| {
            let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
            let cfg = config
                .with_workers(2)
                .with_seed(3)
                .with_scan_index_budget(budget);
            let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
            let batches: Vec<_> = (0..3).flat_map(|epoch| collect(&mut l, epoch)).collect();
            (batches, l.scan_index_bytes())
        };
        let (indexed, bytes) = run(512 << 20);
        // ~1.3 KB of marks per 500 x 375 file.
        assert!(
            bytes > 24 * 500,
            "{config:?}: only {bytes} bytes of marks for 24 files"
        );
        let (plain, none) = run(0);
        assert_eq!(none, 0);
        assert!(
            indexed == plain,
            "scan indexes changed the batches: {config:?}"
        );
        let (tight, kept) = run(100);
        assert_eq!(kept, 0, "a 100-byte budget kept {kept} bytes");
        assert!(tight == plain);
        let (_, half) = run(bytes / 2);
        assert!(
            half > 0 && half <= bytes / 2,
            "{half} bytes kept of a {} budget",
            bytes / 2
        );
    }
}

#[test]
fn a_file_truncated_after_it_was_indexed_is_rejected_in_the_next_epoch() {
    // An indexed file is not walked for its end-of-image marker again while its length stays;
    // cutting it changes the length, so the next epoch checks it and names it.
    let (dir, f) = folder(&["a", "b"], 3);
    let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
    let cfg = LoaderConfig::val(32, 8).with_policy(BadImagePolicy::Strict);
    let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
    assert_eq!(collect(&mut l, 0).len(), 1);
    assert!(l.scan_index_bytes() > 0, "epoch 0 indexed the files");
    let victim = dir.path().join("b/img_001.jpg");
    let bytes = std::fs::read(&victim).expect("read");
    std::fs::write(&victim, &bytes[..bytes.len() - 100]).expect("write");
    let err = l
        .epoch(1)
        .find_map(Result::err)
        .expect("the cut file fails epoch 1");
    assert!(
        err.to_string().contains("img_001.jpg") && err.to_string().contains("truncated"),
        "{err}"
    );
}

#[test]
fn an_epoch_started_at_a_batch_continues_as_the_whole_epoch_would() {
    let (_dir, f) = folder(&["a", "b", "c"], 7);
    let s = DistributedSampler::new(f.len(), 2, 1)
        .expect("sampler")
        .with_seed(9);
    let cfg = LoaderConfig::train(24, 4).with_workers(2).with_seed(5);
    let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
    let whole = collect(&mut l, 2);
    // Another epoch in between: the resumed epoch must not depend on what ran before.
    collect(&mut l, 1);
    for first in 0..=whole.len() {
        let rest: Vec<_> = l.epoch_from(2, first).map(|b| b.expect("batch")).collect();
        assert_eq!(rest, whole[first..], "from batch {first}");
    }
    assert_eq!(l.epoch_from(2, whole.len() + 5).count(), 0);
}

#[test]
fn labels_follow_the_folder_and_the_sampler_order() {
    let (_dir, f) = folder(&["a", "b"], 5);
    let s = DistributedSampler::new(f.len(), 1, 0)
        .expect("sampler")
        .with_seed(3);
    let mut s_epoch = s.clone();
    s_epoch.set_epoch(2);
    let want: Vec<usize> = s_epoch.indices().iter().map(|p| p.index).collect();
    let mut l =
        Loader::new(f.clone(), s, LoaderConfig::val(16, 3).with_workers(2)).expect("loader");
    let batches = collect(&mut l, 2);
    let got: Vec<usize> = batches.iter().flat_map(|b| b.indices.clone()).collect();
    assert_eq!(got, want);
    for b in &batches {
        for (i, &label) in b.indices.iter().zip(&b.labels) {
            assert_eq!(label, f.samples()[*i].label as i64);
        }
    }
}

#[test]
fn u8_and_f32_paths_give_the_same_tensor() {
    let (_dir, f) = folder(&["a", "b"], 3);
    let device = Default::default();
    let make = |output| {
        let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
        let cfg = LoaderConfig::train(20, 6).with_output(output).with_seed(11);
        let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
        collect(&mut l, 0).remove(0)
    };
    let (bu, bf) = (make(OutputFormat::U8), make(OutputFormat::F32));
    assert!(matches!(bu.images, BatchImages::U8(_)));
    assert!(matches!(bf.images, BatchImages::F32(_)));
    let tu = bu.images_tensor::<TestBackend>(&device);
    let tf = bf.images_tensor::<TestBackend>(&device);
    assert_eq!(tu.dims(), [6, 3, 20, 20]);
    let (du, df) = (tu.into_data(), tf.into_data());
    let (su, sf) = (
        du.as_slice::<f32>().expect("f32"),
        df.as_slice::<f32>().expect("f32"),
    );
    let max = su
        .iter()
        .zip(sf)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(max <= 1e-6, "max difference {max}");
    // And it is really normalised: pixel 0 of channel 1.
    let BatchImages::U8(px) = &bu.images else {
        unreachable!()
    };
    let want = (f32::from(px[400]) / 255.0 - 0.456) / 0.224;
    assert!((su[400] - want).abs() < 1e-5);
    let labels = bu.labels_tensor::<TestBackend>(&device).into_data();
    assert_eq!(labels.shape.as_slice(), [6]);
}

/// A folder with good images plus one each of: zero-byte, truncated, random bytes, a PNG named
/// `.JPEG` (good) and a directory named like an image (unreadable).
fn folder_with_bad_files() -> (tempfile::TempDir, ImageFolder, Vec<String>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    common::make_folder(root, &["a", "b"], 6);
    std::fs::write(root.join("a/zero.jpg"), b"").expect("write");
    let good = std::fs::read(root.join("a/img_000.jpg")).expect("read");
    std::fs::write(root.join("b/truncated.jpg"), &good[..good.len() / 2]).expect("write");
    let noise: Vec<u8> = (0..2000u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    std::fs::write(root.join("b/random.JPEG"), noise).expect("write");
    std::fs::copy(
        common::fixtures().join("png_named.JPEG"),
        root.join("a/png.JPEG"),
    )
    .expect("copy");
    std::fs::create_dir(root.join("a/dir.jpg")).expect("mkdir");
    let f = ImageFolder::new(root).expect("scan");
    let bad = ["zero.jpg", "truncated.jpg", "random.JPEG", "dir.jpg"]
        .map(String::from)
        .to_vec();
    (dir, f, bad)
}

#[test]
fn skip_policy_replaces_and_counts_bad_files() {
    let (_dir, f, bad_names) = folder_with_bad_files();
    assert_eq!(f.len(), 12 + 5);
    let is_bad = |i: usize| {
        let name = f.samples()[i]
            .path
            .file_name()
            .expect("name")
            .to_string_lossy()
            .into_owned();
        bad_names.contains(&name)
    };
    let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
    let mut l =
        Loader::new(f.clone(), s, LoaderConfig::train(16, 4).with_workers(3)).expect("loader");
    for epoch in 0..2 {
        let mut it = l.epoch(epoch);
        let batches: Vec<_> = (&mut it)
            .map(|b| b.expect("skip never fails here"))
            .collect();
        assert_eq!(it.skipped(), 4, "epoch {epoch}: one skip per bad file");
        let sizes: Vec<usize> = batches.iter().map(|b| b.len()).collect();
        assert_eq!(sizes, [4, 4, 4, 4, 1], "batch shapes unchanged");
        let mut counted = 0;
        for b in &batches {
            assert!(
                b.indices.iter().all(|&i| !is_bad(i)),
                "no bad file is delivered"
            );
            counted += b.num_real();
        }
        assert_eq!(counted, f.len() - 4, "stand-ins are flagged as padding");
    }
    let bad: Vec<String> = l
        .bad_files()
        .iter()
        .map(|(p, _)| p.file_name().expect("name").to_string_lossy().into_owned())
        .collect();
    let mut want = bad_names.clone();
    want.sort();
    let mut bad_sorted = bad.clone();
    bad_sorted.sort();
    assert_eq!(bad_sorted, want);
}

#[test]
fn strict_policy_names_the_first_bad_file() {
    let (_dir, f, bad_names) = folder_with_bad_files();
    let s = DistributedSampler::new(f.len(), 1, 0)
        .expect("sampler")
        .with_shuffle(false);
    let cfg = LoaderConfig::val(16, 4).with_policy(BadImagePolicy::Strict);
    let mut l = Loader::new(f.clone(), s, cfg).expect("loader");
    let results: Vec<_> = l.epoch(0).collect();
    // Unshuffled order: a/dir.jpg sorts first among a's files.
    let err = results
        .iter()
        .find_map(|r| r.as_ref().err())
        .expect("an error");
    match err {
        DataError::BadImage { path, .. } => {
            assert!(path.ends_with("a/dir.jpg"), "{}", path.display());
            assert!(err.to_string().contains("dir.jpg"));
        }
        other => panic!("expected BadImage, got {other:?}"),
    }
    assert!(
        results.last().is_some_and(|r| r.is_err()),
        "the epoch stops at the error"
    );
    assert!(bad_names.contains(&"dir.jpg".to_string()));
}

#[test]
fn validation_counts_every_image_exactly_once_across_ranks() {
    let (_dir, f) = folder(&["a", "b", "c"], 4);
    let world = 5; // 12 images over 5 ranks: 3 padding positions.
    let mut seen: HashMap<usize, usize> = HashMap::new();
    let mut total_positions = 0;
    for rank in 0..world {
        let s = DistributedSampler::new(f.len(), world, rank).expect("sampler");
        let mut l =
            Loader::new(f.clone(), s, LoaderConfig::val(16, 2).with_workers(2)).expect("loader");
        for b in collect(&mut l, 0) {
            total_positions += b.len();
            for (k, &i) in b.indices.iter().enumerate() {
                if !b.is_padding[k] {
                    *seen.entry(i).or_default() += 1;
                }
            }
        }
    }
    assert_eq!(total_positions, 15);
    assert_eq!(seen.len(), 12);
    assert!(seen.values().all(|&c| c == 1));
}

#[test]
fn dropping_an_epoch_early_does_not_hang() {
    let (_dir, f) = folder(&["a"], 12);
    let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
    let mut l = Loader::new(f, s, LoaderConfig::train(16, 2).with_prefetch(1)).expect("loader");
    let first = l.epoch(0).next().expect("a batch").expect("ok");
    assert_eq!(first.len(), 2);
    assert_eq!(l.batches_per_epoch(), 6);
    assert_eq!(collect(&mut l, 1).len(), 6);
}

#[test]
fn invalid_configs_are_rejected() {
    let (_dir, f) = folder(&["a"], 2);
    let s = DistributedSampler::new(f.len(), 1, 0).expect("sampler");
    for cfg in [
        LoaderConfig::train(16, 0),
        LoaderConfig::train(16, 2).with_workers(0),
    ] {
        assert!(matches!(
            Loader::new(f.clone(), s.clone(), cfg),
            Err(DataError::InvalidConfig { .. })
        ));
    }
    let wrong = DistributedSampler::new(99, 1, 0).expect("sampler");
    assert!(Loader::new(f, wrong, LoaderConfig::train(16, 2)).is_err());
}
