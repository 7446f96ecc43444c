//! Transform geometry and statistics.

mod common;

use data::transform::{
    CropBox, Resampler, center_crop_box, random_resized_crop_params, resize_shorter_side,
    resized_crop,
};
use data::{Interpolation, Transform};
use image::RgbImage;
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;

#[test]
fn random_resized_crop_statistics_stay_in_range() {
    let mut rng = ChaCha8Rng::seed_from_u64(2024);
    let (w, h) = (500u32, 375u32);
    let area = f64::from(w * h);
    let (mut min_a, mut max_a, mut min_r, mut max_r) = (f64::MAX, 0.0f64, f64::MAX, 0.0f64);
    let mut log_ratio_sum = 0.0;
    let draws = 20_000;
    for _ in 0..draws {
        let c = random_resized_crop_params(&mut rng, w, h, (0.08, 1.0), (3.0 / 4.0, 4.0 / 3.0));
        assert!(c.width >= 1 && c.height >= 1);
        assert!(
            c.left + c.width <= w && c.top + c.height <= h,
            "{c:?} inside"
        );
        let a = f64::from(c.width * c.height) / area;
        let r = f64::from(c.width) / f64::from(c.height);
        // Rounding w and h to integers moves area and ratio by at most about 1 px per side.
        let slack_a = (f64::from(c.width) + f64::from(c.height) + 1.0) / area;
        let slack_r = r * (1.0 / f64::from(c.width) + 1.0 / f64::from(c.height));
        assert!(a >= 0.08 - slack_a && a <= 1.0, "area fraction {a}");
        assert!(
            r >= 0.75 - slack_r && r <= 4.0 / 3.0 + slack_r,
            "ratio {r} of {c:?}"
        );
        min_a = min_a.min(a);
        max_a = max_a.max(a);
        min_r = min_r.min(r);
        max_r = max_r.max(r);
        log_ratio_sum += r.ln();
    }
    // The draws cover the ranges (they are not stuck at the fallback).
    assert!(min_a < 0.09 && max_a > 0.7, "area range {min_a}..{max_a}");
    assert!(min_r < 0.76 && max_r > 1.32, "ratio range {min_r}..{max_r}");
    // Log-uniform ratio: log mean near 0 (rejection of tall crops in a wide image skews it a little).
    let mean = log_ratio_sum / f64::from(draws);
    assert!(mean.abs() < 0.1, "mean log ratio {mean}");
}

#[test]
fn random_resized_crop_is_seeded() {
    let draw = |seed| {
        let mut rng = ChaCha8Rng::seed_from_u64(seed);
        (0..10)
            .map(|_| random_resized_crop_params(&mut rng, 300, 200, (0.08, 1.0), (0.75, 4.0 / 3.0)))
            .collect::<Vec<CropBox>>()
    };
    assert_eq!(draw(1), draw(1));
    assert_ne!(draw(1), draw(2));
}

#[test]
fn val_transform_is_resize_then_hand_computed_center_crop() {
    // 50x40, size 16: resize = round(16*256/224) = 18 -> 22x18 (int(18*50/40) = 22);
    // center crop: left = round((22-16)/2) = 3, top = round((18-16)/2) = 1.
    let t = Transform::val(16);
    assert_eq!(
        t,
        Transform::Val {
            resize: 18,
            size: 16,
            interpolation: Interpolation::Bilinear,
        }
    );
    assert_eq!(
        Transform::val(224),
        Transform::Val {
            resize: 256,
            size: 224,
            interpolation: Interpolation::Bilinear,
        }
    );
    assert_eq!(resize_shorter_side(50, 40, 18), (22, 18));
    let c = center_crop_box(22, 18, 16, 16).expect("fits");
    assert_eq!((c.left, c.top), (3, 1));

    let img = RgbImage::from_raw(50, 40, common::pattern(50, 40, 3)).expect("buffer");
    let full = CropBox {
        top: 0,
        left: 0,
        height: 40,
        width: 50,
    };
    let resized = resized_crop(
        &img,
        full,
        (22, 18),
        Interpolation::Bilinear,
        Resampler::FastImageResize,
    );
    let mut out = vec![0u8; 3 * 16 * 16];
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    t.apply_into(&img, &mut rng, Resampler::FastImageResize, &mut out);
    for y in 0..16 {
        for x in 0..16 {
            for ch in 0..3 {
                let want = resized[((y + 1) * 22 + x + 3) * 3 + ch];
                assert_eq!(out[ch * 256 + y * 16 + x], want, "({x},{y}) channel {ch}");
            }
        }
    }
}

#[test]
fn both_resamplers_agree() {
    let img = RgbImage::from_raw(120, 90, common::pattern(120, 90, 5)).expect("buffer");
    let crop = CropBox {
        top: 10,
        left: 7,
        height: 70,
        width: 100,
    };
    for (ow, oh) in [(32, 32), (150, 140), (100, 70)] {
        let a = resized_crop(
            &img,
            crop,
            (ow, oh),
            Interpolation::Bilinear,
            Resampler::FastImageResize,
        );
        let b = resized_crop(
            &img,
            crop,
            (ow, oh),
            Interpolation::Bilinear,
            Resampler::Image,
        );
        assert_eq!(a.len(), b.len());
        let max = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (i32::from(*x) - i32::from(*y)).abs())
            .max();
        let mean: f64 = a
            .iter()
            .zip(&b)
            .map(|(x, y)| f64::from((i32::from(*x) - i32::from(*y)).abs()))
            .sum::<f64>()
            / a.len() as f64;
        assert!(
            max.unwrap_or(0) <= 3 && mean < 1.0,
            "{ow}x{oh}: max {max:?} mean {mean}"
        );
    }
}

#[test]
fn train_transform_flips_about_half_the_time() {
    // A left-dark, right-bright image: after the crop the left half stays darker unless flipped.
    let (w, h) = (64u32, 48u32);
    let mut px = Vec::new();
    for _y in 0..h {
        for x in 0..w {
            let v = if x < w / 2 { 20 } else { 230 };
            px.extend_from_slice(&[v, v, v]);
        }
    }
    let img = RgbImage::from_raw(w, h, px).expect("buffer");
    // Full-image crops only, so the split is always visible.
    let t = Transform::Train {
        size: 16,
        scale: (1.0, 1.0),
        ratio: (4.0 / 3.0, 4.0 / 3.0),
        flip_prob: 0.5,
        interpolation: Interpolation::Bilinear,
        auto_augment: None,
        random_erase: None,
    };
    let mut rng = ChaCha8Rng::seed_from_u64(9);
    let mut flips = 0;
    let n = 400;
    for _ in 0..n {
        let mut out = vec![0u8; 3 * 16 * 16];
        t.apply_into(&img, &mut rng, Resampler::FastImageResize, &mut out);
        if out[0] > out[15] {
            flips += 1;
        }
    }
    assert!((150..=250).contains(&flips), "{flips} flips of {n}");
}

#[test]
fn val_center_crop_pads_when_the_image_is_smaller() {
    // resize 10 < size 16: 50x40 -> 12x10, centred in a zero 16x16 canvas at (2, 3).
    let img = RgbImage::from_raw(50, 40, common::pattern(50, 40, 1)).expect("buffer");
    let t = Transform::Val {
        resize: 10,
        size: 16,
        interpolation: Interpolation::Bilinear,
    };
    let mut out = vec![7u8; 3 * 16 * 16];
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    t.apply_into(&img, &mut rng, Resampler::FastImageResize, &mut out);
    let full = CropBox {
        top: 0,
        left: 0,
        height: 40,
        width: 50,
    };
    let resized = resized_crop(
        &img,
        full,
        (12, 10),
        Interpolation::Bilinear,
        Resampler::FastImageResize,
    );
    for y in 0..16usize {
        for x in 0..16usize {
            let inside = (3..13).contains(&y) && (2..14).contains(&x);
            let want = if inside {
                resized[((y - 3) * 12 + x - 2) * 3]
            } else {
                0
            };
            assert_eq!(out[y * 16 + x], want, "red at ({x},{y})");
        }
    }
}

#[test]
fn val_transform_resamplers_agree() {
    let img = RgbImage::from_raw(90, 70, common::pattern(90, 70, 2)).expect("buffer");
    let t = Transform::val(32);
    let (mut a, mut b) = (vec![0u8; 3 * 32 * 32], vec![0u8; 3 * 32 * 32]);
    let mut rng = ChaCha8Rng::seed_from_u64(0);
    t.apply_into(&img, &mut rng, Resampler::FastImageResize, &mut a);
    t.apply_into(&img, &mut rng, Resampler::Image, &mut b);
    let max = a
        .iter()
        .zip(&b)
        .map(|(x, y)| (i32::from(*x) - i32::from(*y)).abs())
        .max();
    assert!(max.unwrap_or(0) <= 3, "max difference {max:?}");
}
