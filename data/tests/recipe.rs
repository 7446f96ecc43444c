//! torchvision's recipe pieces against its own outputs (fixtures from
//! `tests/fixtures/make_augment_fixtures.py`): RandomResizedCrop + flip at fixed boxes and the
//! Resize + CenterCrop size combinations with bilinear, bicubic and nearest; Resize(232) +
//! CenterCrop(224) of a photo; RandomErasing at a fixed box; RASampler's indices.

mod common;

use data::transform::{CropBox, hwc_to_chw, resized_crop};
use data::{
    Batch, BatchImages, DistributedSampler, ImageFolder, Interpolation, Loader, LoaderConfig,
    Resampler, Transform, decode_file, repeated_augmentation_indices,
};
use image::RgbImage;

type TestBackend = burn::backend::Flex;

fn fixture(name: &str) -> std::path::PathBuf {
    common::fixtures().join("augment").join(name)
}

fn png(name: &str) -> RgbImage {
    image::open(fixture(name)).expect(name).into_rgb8()
}

fn interpolation(name: &str) -> Interpolation {
    match name {
        "bilinear" => Interpolation::Bilinear,
        "bicubic" => Interpolation::Bicubic,
        _ => Interpolation::Nearest,
    }
}

/// (max, mean) absolute difference of a CHW buffer against an HWC image.
fn error_chw_vs_hwc(chw: &[u8], hwc: &RgbImage) -> (u8, f64) {
    let plane = (hwc.width() * hwc.height()) as usize;
    let (mut max, mut sum) = (0u8, 0u64);
    for (i, px) in hwc.pixels().enumerate() {
        for c in 0..3 {
            let d = chw[c * plane + i].abs_diff(px.0[c]);
            max = max.max(d);
            sum += u64::from(d);
        }
    }
    (max, sum as f64 / (3 * plane) as f64)
}

/// The existing bilinear fidelity bound (`tests/fidelity.rs`): resizers round differently.
const RESIZE_MAX_ERROR: u8 = 2;

#[test]
fn crops_and_size_combinations_match_torchvision_per_filter() {
    let src = png("resize_src.png");
    let strip = png("resize.png");
    let index = std::fs::read_to_string(fixture("resize.txt")).expect("resize.txt");
    let mut y = 0u32;
    let mut failures = Vec::new();
    eprintln!("# case                          max   mean   (1/255 steps)");
    for line in index.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let interp = interpolation(f[2]);
        let (ours, side) = match f[1] {
            "crop" => {
                let n: Vec<u32> = f[3..8].iter().map(|v| v.parse().expect("int")).collect();
                let crop = CropBox {
                    top: n[0],
                    left: n[1],
                    height: n[2],
                    width: n[3],
                };
                let hwc = resized_crop(&src, crop, (48, 48), interp, Resampler::default());
                let mut chw = vec![0u8; 3 * 48 * 48];
                hwc_to_chw(&hwc, 48, 48, n[4] == 1, &mut chw);
                (chw, 48)
            }
            _ => {
                let resize: u32 = f[3].parse().expect("resize");
                let crop: u32 = f[4].parse().expect("crop");
                let t = Transform::val_sizes(resize, crop).with_interpolation(interp);
                let mut chw = vec![0u8; (3 * crop * crop) as usize];
                let mut rng = data::sample_rng(0, 0, 0);
                let erase = t.apply_into(&src, &mut rng, Resampler::default(), &mut chw);
                assert!(erase.is_none());
                (chw, crop)
            }
        };
        let theirs = image::imageops::crop_imm(&strip, 0, y, side, side).to_image();
        y += side;
        let (max, mean) = error_chw_vs_hwc(&ours, &theirs);
        eprintln!("  {:<30} {max:>3} {mean:>6.3}", f[1..].join(" "));
        // Nearest and bicubic run ports of Pillow's code: bit-exact. Bilinear runs
        // fast_image_resize, which rounds its coefficients differently.
        let bound = if interp == Interpolation::Bilinear {
            RESIZE_MAX_ERROR
        } else {
            0
        };
        if max > bound || mean > 0.35 {
            failures.push(format!("{line}: max {max}, mean {mean:.3}"));
        }
    }
    assert_eq!(y, strip.height(), "every fixture row checked");
    assert!(failures.is_empty(), "off torchvision: {failures:#?}");
}

#[test]
fn val_232_then_224_matches_torchvision_on_a_photo() {
    let image = decode_file(&common::fixtures().join("photos/baseline_444.jpg")).expect("photo");
    for name in ["bilinear", "bicubic"] {
        let t = Transform::val_sizes(232, 224).with_interpolation(interpolation(name));
        let mut ours = vec![0u8; 3 * 224 * 224];
        let mut rng = data::sample_rng(0, 0, 0);
        let _ = t.apply_into(&image, &mut rng, Resampler::default(), &mut ours);
        let theirs = png(&format!("val232_{name}.png"));
        let (max, mean) = error_chw_vs_hwc(&ours, &theirs);
        eprintln!("val 232/224 {name}: max {max}, mean {mean:.4}");
        // Decoder and resizer rounding together, as the 4:4:4 files of tests/fidelity.rs.
        assert!(
            max <= RESIZE_MAX_ERROR && mean < 0.35,
            "{name}: max {max}, mean {mean}"
        );
    }
}

#[test]
fn erased_values_are_exactly_zero_after_normalisation_as_torchvisions() {
    let src = png("erase_src.png");
    let mut chw = vec![0u8; 3 * 16 * 16];
    hwc_to_chw(src.as_raw(), 16, 16, false, &mut chw);
    let erase = CropBox {
        top: 3,
        left: 5,
        height: 7,
        width: 4,
    };
    let bytes = std::fs::read(fixture("erase.bin")).expect("erase.bin");
    let theirs: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect();
    let batch = Batch {
        images: BatchImages::U8(chw),
        labels: vec![0],
        indices: vec![0],
        is_padding: vec![false],
        size: 16,
        erase: vec![Some(erase)],
    };
    let device = Default::default();
    let ours: Vec<f32> = batch
        .images_tensor::<TestBackend>(&device)
        .into_data()
        .to_vec()
        .expect("f32");
    let mut erased = 0;
    for (i, (a, b)) in ours.iter().zip(&theirs).enumerate() {
        let (y, x) = ((i % 256) / 16, i % 16);
        if (3..10).contains(&y) && (5..9).contains(&x) {
            assert_eq!(*b, 0.0, "torchvision's erased value");
            assert_eq!(*a, 0.0, "erased value at {i}");
            erased += 1;
        } else {
            assert!((a - b).abs() < 1e-5, "value {i}: {a} vs {b}");
        }
    }
    assert_eq!(erased, 3 * 7 * 4);
}

#[test]
fn ra_sampler_indices_are_torchvisions_for_the_same_permutation() {
    let text = std::fs::read_to_string(fixture("ra_sampler.txt")).expect("ra_sampler.txt");
    let mut lines = text.lines();
    let mut checked = 0;
    while let Some(line) = lines.next() {
        let f: Vec<usize> = line
            .split_whitespace()
            .skip(1)
            .map(|v| v.parse().expect("int"))
            .collect();
        let (reps, world, perm) = (f[1], f[2], &f[3..]);
        assert_eq!(perm.len(), f[0]);
        for rank in 0..world {
            let want: Vec<usize> = lines
                .next()
                .expect("rank line")
                .split_whitespace()
                .skip(2)
                .map(|v| v.parse().expect("int"))
                .collect();
            let ours = repeated_augmentation_indices(perm, reps, world, rank);
            // Same order, hence the same multiset.
            assert_eq!(
                ours, want,
                "len {} reps {reps} world {world} rank {rank}",
                f[0]
            );
            checked += 1;
        }
    }
    assert_eq!(checked, 2 + 3 + 4 + 1);
}

#[test]
fn ra_sampler_epoch_has_torchvisions_length_and_each_repeat_its_own_augmentation() {
    let s = DistributedSampler::new(700, 3, 1)
        .expect("sampler")
        .with_repeated_augmentation(4)
        .expect("ra");
    // floor(700 // 256 * 256 / 3) = 170.
    assert_eq!((s.num_samples(), s.indices().len()), (170, 170));
    assert!(
        DistributedSampler::new(255, 1, 0)
            .expect("sampler")
            .with_repeated_augmentation(3)
            .is_err(),
        "fewer than 256 images leave an empty epoch"
    );

    let dir = tempfile::tempdir().expect("tempdir");
    common::make_folder(dir.path(), &["a"], 256);
    let folder = ImageFolder::new(dir.path()).expect("folder");
    let sampler = DistributedSampler::new(256, 1, 0)
        .expect("sampler")
        .with_repeated_augmentation(3)
        .expect("ra");
    let cfg = LoaderConfig::train(16, 3).with_workers(2);
    let mut loader = Loader::new(folder, sampler, cfg).expect("loader");
    let first = loader.epoch(0).next().expect("a batch").expect("batch");
    // The first three positions are one image's three repeats.
    assert!(first.indices.iter().all(|&i| i == first.indices[0]));
    let BatchImages::U8(px) = &first.images else {
        panic!("u8 batch")
    };
    let n = 3 * 16 * 16;
    assert_ne!(px[..n], px[n..2 * n]);
    assert_ne!(px[n..2 * n], px[2 * n..]);
}
