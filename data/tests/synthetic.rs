//! The synthetic dataset: real JPEGs, deterministic, reusable, learnable.

use data::synthetic::{MARKER_FILE, SyntheticConfig, generate};
use data::{ImageFolder, decode_file};

fn small() -> SyntheticConfig {
    SyntheticConfig {
        classes: 10,
        train_per_class: 6,
        val_per_class: 3,
        min_side: 40,
        max_side: 80,
        quality: 90,
        seed: 17,
    }
}

#[test]
fn writes_an_image_folder_and_reuses_it() {
    let dir = tempfile::tempdir().expect("tempdir");
    let cfg = small();
    let s = generate(dir.path(), &cfg).expect("generate");
    assert!(!s.reused);
    assert_eq!((s.train_images, s.val_images), (60, 30));
    let train = ImageFolder::new(&s.train_dir).expect("train folder");
    let val = ImageFolder::new(&s.val_dir).expect("val folder");
    assert_eq!((train.len(), val.len(), train.num_classes()), (60, 30, 10));
    assert_eq!(train.classes(), s.classes.as_slice());
    for sample in val.samples() {
        let img = decode_file(&sample.path).expect("real JPEG");
        assert!((40..=80).contains(&img.width()) && (40..=80).contains(&img.height()));
    }
    let again = generate(dir.path(), &cfg).expect("generate");
    assert!(again.reused);
    // A half-written folder (no marker) is regenerated.
    std::fs::remove_file(dir.path().join(MARKER_FILE)).expect("rm marker");
    std::fs::remove_file(&val.samples()[0].path).expect("rm image");
    let redone = generate(dir.path(), &cfg).expect("generate");
    assert!(!redone.reused);
    assert!(val.samples()[0].path.exists());
}

#[test]
fn same_seed_same_files() {
    let (a, b) = (
        tempfile::tempdir().expect("tmp"),
        tempfile::tempdir().expect("tmp"),
    );
    let mut cfg = small();
    cfg.classes = 2;
    generate(a.path(), &cfg).expect("generate");
    generate(b.path(), &cfg).expect("generate");
    let rel = "train/class_001/00003.jpg";
    let fa = std::fs::read(a.path().join(rel)).expect("read");
    assert_eq!(fa, std::fs::read(b.path().join(rel)).expect("read"));
}

#[test]
fn classes_are_separable_by_mean_colour() {
    // Sanity check of learnability: a nearest-centroid classifier on the mean RGB colour of the
    // image already separates the classes; the stripes add a second cue for the CNN.
    let dir = tempfile::tempdir().expect("tempdir");
    let s = generate(dir.path(), &small()).expect("generate");
    let mean_rgb = |p: &std::path::Path| {
        let img = decode_file(p).expect("decode");
        let mut m = [0f64; 3];
        for px in img.pixels() {
            for (acc, &v) in m.iter_mut().zip(&px.0) {
                *acc += f64::from(v);
            }
        }
        let n = f64::from(img.width() * img.height());
        m.map(|v| v / n)
    };
    let train = ImageFolder::new(&s.train_dir).expect("scan");
    let mut centroids = vec![[0f64; 3]; 10];
    let mut counts = [0f64; 10];
    for sm in train.samples() {
        let m = mean_rgb(&sm.path);
        for c in 0..3 {
            centroids[sm.label][c] += m[c];
        }
        counts[sm.label] += 1.0;
    }
    for (c, n) in centroids.iter_mut().zip(counts) {
        c.iter_mut().for_each(|v| *v /= n);
    }
    let val = ImageFolder::new(&s.val_dir).expect("scan");
    let correct = val
        .samples()
        .iter()
        .filter(|sm| {
            let m = mean_rgb(&sm.path);
            let d = |c: &[f64; 3]| (0..3).map(|i| (c[i] - m[i]).powi(2)).sum::<f64>();
            let best = (0..10)
                .min_by(|&a, &b| d(&centroids[a]).total_cmp(&d(&centroids[b])))
                .expect("10 classes");
            best == sm.label
        })
        .count();
    assert!(
        correct * 10 >= val.len() * 8,
        "{correct} of {} correct",
        val.len()
    );
}

#[test]
fn imagenet_like_benchmark_set() {
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path().join("bench");
    assert!(data::synthetic::generate_imagenet_like(&root, 5, 1).expect("generate"));
    let f = ImageFolder::new(&root).expect("scan");
    assert_eq!(f.len(), 5);
    let img = decode_file(&f.samples()[0].path).expect("decode");
    assert_eq!(img.dimensions(), (500, 375));
    // Second call: already complete, nothing written.
    assert!(!data::synthetic::generate_imagenet_like(&root, 5, 1).expect("generate"));
}

#[test]
fn concurrent_writers_leave_one_complete_set_and_no_temporary_folders() {
    let parent = tempfile::tempdir().expect("tempdir");
    let root = parent.path().join("synthetic");
    let cfg = small();
    let results: Vec<_> = std::thread::scope(|scope| {
        let writers: Vec<_> = (0..3)
            .map(|_| scope.spawn(|| generate(&root, &cfg)))
            .collect();
        writers
            .into_iter()
            .map(|w| w.join().expect("writer thread"))
            .collect()
    });
    for result in &results {
        let summary = result.as_ref().expect("every writer succeeds");
        assert_eq!(summary.train_dir, root.join("train"));
    }
    assert!(data::synthetic::is_complete(&root, &cfg));
    let train = data::ImageFolder::new(root.join("train")).expect("train folder");
    assert_eq!(train.len(), cfg.classes * cfg.train_per_class);
    for sample in train.samples() {
        data::decode_file(&sample.path).expect("a whole JPEG");
    }
    let leftovers: Vec<_> = std::fs::read_dir(parent.path())
        .expect("ls")
        .filter_map(|e| e.ok().map(|e| e.file_name()))
        .collect();
    assert_eq!(leftovers, vec![std::ffi::OsString::from("synthetic")]);
}
