//! The automatic augmentations against torchvision `transforms.v2` on PIL images, from the
//! fixtures `tests/fixtures/make_augment_fixtures.py` writes: every op at fixed magnitudes and
//! signs, the magnitude tables, the policies' op/bin/sign frequencies, and determinism across
//! worker counts.

mod common;

use std::collections::HashMap;

use data::augment::{
    AutoAugment, IMAGENET_POLICY, NUM_BINS, Op, Space, WIDE_OPS, apply_op, magnitudes,
};
use data::{DistributedSampler, ImageFolder, Loader, LoaderConfig, Transform, sample_rng};
use image::RgbImage;

fn fixture(name: &str) -> std::path::PathBuf {
    common::fixtures().join("augment").join(name)
}

fn png(name: &str) -> RgbImage {
    image::open(fixture(name)).expect(name).into_rgb8()
}

#[test]
fn every_op_matches_torchvision_on_photo_crops() {
    let index = std::fs::read_to_string(fixture("ops.txt")).expect("ops.txt");
    let mut inputs: HashMap<String, (RgbImage, RgbImage)> = HashMap::new();
    // op -> (max, sum, values, cases)
    let mut stats: Vec<(Op, u8, u64, u64, usize)> = Vec::new();
    let mut failures = Vec::new();
    for line in index.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let (input, row, op_name, magnitude) = (f[0], f[1], f[2], f[3]);
        let (img, strip) = inputs.entry(input.to_string()).or_insert_with(|| {
            (
                png(&format!("in_{input}.png")),
                png(&format!("op_{input}.png")),
            )
        });
        let op = Op::from_name(op_name).expect(op_name);
        let magnitude: f64 = magnitude.parse().expect("magnitude");
        let row: u32 = row.parse().expect("row");
        let (w, h) = img.dimensions();
        let theirs = image::imageops::crop_imm(strip, 0, row * h, w, h).to_image();
        let ours = apply_op(img, op, magnitude);
        let (mut max, mut sum) = (0u8, 0u64);
        for (a, b) in ours.iter().zip(theirs.iter()) {
            let d = a.abs_diff(*b);
            max = max.max(d);
            sum += u64::from(d);
        }
        // Bit-exact: the ops follow Pillow's integer and f32 arithmetic step by step.
        if max > 0 {
            failures.push(format!("{input} {op_name} {magnitude}: max error {max}"));
        }
        match stats.iter_mut().find(|s| s.0 == op) {
            Some(s) => {
                s.1 = s.1.max(max);
                s.2 += sum;
                s.3 += u64::from(w * h * 3);
                s.4 += 1;
            }
            None => stats.push((op, max, sum, u64::from(w * h * 3), 1)),
        }
    }
    eprintln!("# op            cases   max error   mean error   (1/255 steps)");
    for (op, max, sum, n, cases) in &stats {
        eprintln!(
            "  {:<14} {cases:>5} {max:>11} {:>12.5}",
            op.name(),
            *sum as f64 / *n as f64
        );
    }
    assert_eq!(stats.len(), 15, "every op has cases");
    assert!(failures.is_empty(), "off torchvision: {failures:#?}");
}

#[test]
fn magnitude_tables_are_torchvisions_to_the_bit() {
    let tables = std::fs::read_to_string(fixture("tables.txt")).expect("tables.txt");
    let mut checked = 0;
    for line in tables.lines() {
        let f: Vec<&str> = line.split_whitespace().collect();
        let space = match f[0] {
            "wide" => Space::Wide,
            "ra" => Space::RandAugment,
            _ => Space::AutoAugment,
        };
        let op = Op::from_name(f[1]).expect(f[1]);
        let want: Vec<f64> = f[3..].iter().map(|v| v.parse().expect("value")).collect();
        let (ours, signed) = magnitudes(space, op, 48, 40);
        let ours: Vec<f64> = ours.expect("a table").into_iter().map(f64::from).collect();
        assert_eq!(ours, want, "{line}");
        assert_eq!(signed, f[2] == "1", "{line}");
        checked += 1;
    }
    assert_eq!(checked, 11 + 11 + 11, "tables in the fixture");
    // Ops without a magnitude in torchvision have none here either.
    for op in [Op::Identity, Op::AutoContrast, Op::Equalize, Op::Invert] {
        assert!(magnitudes(Space::Wide, op, 48, 40).0.is_none());
    }
}

/// Pearson's chi-square of `counts` against equal expected frequencies.
fn chi_square_uniform(counts: &[u64]) -> f64 {
    let n: u64 = counts.iter().sum();
    let e = n as f64 / counts.len() as f64;
    counts.iter().map(|&c| (c as f64 - e).powi(2) / e).sum()
}

#[test]
fn trivial_augment_draws_ops_bins_and_signs_uniformly() {
    let draws = 140_000;
    let mut ops = [0u64; 14];
    let mut bins = [0u64; NUM_BINS];
    let (mut signed, mut negative) = (0u64, 0u64);
    for i in 0..draws {
        let mut rng = sample_rng(7, 0, i);
        let drawn = AutoAugment::TrivialAugmentWide.draw(&mut rng, 224, 224);
        assert_eq!(drawn.len(), 1);
        let d = drawn[0];
        ops[WIDE_OPS.iter().position(|&o| o == d.op).expect("wide op")] += 1;
        if let Some(b) = d.bin {
            bins[b] += 1;
        }
        if magnitudes(Space::Wide, d.op, 224, 224).1 && d.bin != Some(0) {
            signed += 1;
            negative += u64::from(d.magnitude < 0.0);
        }
    }
    // chi-square critical values at p = 0.001: 34.53 (13 dof), 59.70 (30 dof).
    let (c_ops, c_bins) = (chi_square_uniform(&ops), chi_square_uniform(&bins));
    eprintln!("TA wide: chi2 ops {c_ops:.2} (13 dof), bins {c_bins:.2} (30 dof)");
    assert!(c_ops < 34.53, "op frequencies {ops:?}");
    assert!(c_bins < 59.70, "bin frequencies {bins:?}");
    let frac = negative as f64 / signed as f64;
    let sigma = (0.25 / signed as f64).sqrt();
    assert!(
        (frac - 0.5).abs() < 5.0 * sigma,
        "negative sign fraction {frac}"
    );
}

#[test]
fn rand_augment_draws_two_ops_uniformly_at_the_fixed_bin() {
    let policy = AutoAugment::RandAugment {
        num_ops: 2,
        magnitude: 9,
    };
    let mut ops = [0u64; 14];
    for i in 0..70_000 {
        let mut rng = sample_rng(3, 1, i);
        let drawn = policy.draw(&mut rng, 176, 176);
        assert_eq!(drawn.len(), 2);
        for d in drawn {
            ops[WIDE_OPS.iter().position(|&o| o == d.op).expect("op")] += 1;
            let (table, _) = magnitudes(Space::RandAugment, d.op, 176, 176);
            match table {
                Some(t) => {
                    assert_eq!(d.bin, Some(9));
                    assert_eq!(d.magnitude.abs(), f64::from(t[9]));
                }
                None => assert_eq!(d.magnitude, 0.0),
            }
        }
    }
    let c = chi_square_uniform(&ops);
    eprintln!("RandAugment: chi2 ops {c:.2} (13 dof)");
    assert!(c < 34.53, "op frequencies {ops:?}");
}

#[test]
fn auto_augment_applies_each_op_at_the_policy_rate() {
    let draws = 100_000;
    let mut seen: HashMap<Op, u64> = HashMap::new();
    for i in 0..draws {
        let mut rng = sample_rng(5, 2, i);
        for d in AutoAugment::ImageNet.draw(&mut rng, 224, 224) {
            *seen.entry(d.op).or_default() += 1;
        }
    }
    // Expected applications per draw: mean over the 25 sub-policies of the op's probabilities.
    let mut expected: HashMap<Op, f64> = HashMap::new();
    for sub in IMAGENET_POLICY {
        for (op, p, _) in sub {
            *expected.entry(op).or_default() += p / 25.0;
        }
    }
    for (op, rate) in expected {
        let got = *seen.get(&op).unwrap_or(&0) as f64;
        let want = rate * draws as f64;
        // Each draw applies an op 0, 1 or 2 times: the variance is at most 4 · want.
        let bound = 5.0 * (4.0 * want).sqrt();
        assert!(
            (got - want).abs() < bound,
            "{}: {got} applications, expected {want:.0} ± {bound:.0}",
            op.name()
        );
    }
}

#[test]
fn same_images_at_one_and_three_workers_with_ta_wide_and_erasing() {
    let dir = tempfile::tempdir().expect("tempdir");
    common::make_folder(dir.path(), &["a", "b"], 6);
    let folder = ImageFolder::new(dir.path()).expect("folder");
    let transform = Transform::train(24)
        .with_auto_augment(Some(AutoAugment::TrivialAugmentWide))
        .with_random_erase(0.5);
    let run = |workers| {
        let sampler = DistributedSampler::new(folder.len(), 1, 0).expect("sampler");
        let mut cfg = LoaderConfig::train(24, 4)
            .with_workers(workers)
            .with_seed(9);
        cfg.transform = transform;
        let mut loader = Loader::new(folder.clone(), sampler, cfg).expect("loader");
        loader
            .epoch(1)
            .map(|b| b.expect("batch"))
            .collect::<Vec<_>>()
    };
    let (one, three) = (run(1), run(3));
    assert_eq!(one, three);
    assert!(
        one.iter().flat_map(|b| &b.erase).any(Option::is_some),
        "erasing at p = 0.5 erased nothing"
    );
    // The augmentation does something: the same sample without it differs.
    let sampler = DistributedSampler::new(folder.len(), 1, 0).expect("sampler");
    let cfg = LoaderConfig::train(24, 4).with_seed(9);
    let plain: Vec<_> = Loader::new(folder.clone(), sampler, cfg)
        .expect("loader")
        .epoch(1)
        .map(|b| b.expect("batch").images)
        .collect();
    assert_ne!(plain, one.into_iter().map(|b| b.images).collect::<Vec<_>>());
}
