//! Input-pipeline benchmark: img/s for decode only, decode + train transforms (also with
//! torchvision's recipe: `TrivialAugmentWide`, then `RandomErasing(0.1)`), decode + val
//! transforms, and the per-image time of each stage.
//!
//! ```text
//! cargo run --release -p benches --no-default-features --bin data -- --root DIR --workers 2
//! cargo run --release -p benches --no-default-features --bin data -- --generate 2000 --workers 2
//! ```
//!
//! `--generate N` writes N ImageNet-like JPEGs (500×375 or 375×500, quality 90, textured so they
//! compress like photos; `data::synthetic::generate_imagenet_like`) into `--root` (default
//! `target/bench-data/imagenet-like-N`) unless a complete set is already there. `benches/compare_data.py` runs torchvision on the same folder.

use std::cell::{Cell, RefCell};
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use clap::Parser;
use data::transform::Resampler;
use data::{
    AutoAugment, DecodeScaling, DistributedSampler, ImageFolder, Loader, LoaderConfig,
    OutputFormat, Transform, decode_bytes, decode_bytes_region, sample_rng,
};

#[derive(Parser, Debug)]
#[command(about = "Input pipeline benchmark (decode, train and val transforms)")]
struct Args {
    /// ImageFolder root (class sub-folders of JPEGs).
    #[arg(long)]
    root: Option<PathBuf>,
    /// Decode threads.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Write this many ImageNet-like JPEGs into --root first (skipped if already complete).
    #[arg(long)]
    generate: Option<usize>,
    /// Output side of the transforms.
    #[arg(long, default_value_t = 224)]
    size: u32,
    /// Batch size of the loader runs.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Timed passes per measurement; the best is reported.
    #[arg(long, default_value_t = 2)]
    repeat: usize,
    /// Pipelines to time (comma-separated subset of decode,decode_crop,train,train_full_decode,
    /// train_image_resize,train_f32,train_ta_wide,train_ta_wide_full_decode,train_ta_wide_erase,
    /// val,val_full_decode, and train_unscaled,train_fast,val_unscaled,val_fast). `decode_crop`
    /// decodes only a `RandomResizedCrop` box of each image; the `_full_decode` pipelines decode
    /// whole images at full size (the loader's default decodes only the pixels the transform
    /// reads, at 1/2 to 1/8 of the size where `DecodeScaling::Faithful` allows); `_unscaled`
    /// decodes the region at full size, `_fast` scales as `DecodeScaling::Fast` allows. Loader
    /// pipelines time the epochs after an untimed first one (a run's steady state, with the
    /// scan indexes earlier epochs left); `train_first_epoch`, `train_ta_wide_first_epoch` and
    /// `val_first_epoch` time a fresh loader's first epoch, and the `_no_index` pipelines the
    /// steady state without scan indexes.
    #[arg(
        long,
        default_value = "decode,decode_crop,train,train_full_decode,train_image_resize,train_f32,train_ta_wide,train_ta_wide_full_decode,train_ta_wide_erase,val,val_full_decode"
    )]
    pipelines: String,
    /// Skip the per-stage timing pass.
    #[arg(long)]
    no_stages: bool,
    /// Print one JSON object instead of the tables.
    #[arg(long)]
    json: bool,
    /// Print a hash of every image's full decode and of its training-crop region decode, then
    /// stop. The same files must hash the same before and after a change to the JPEG decoder:
    /// entropy decoding is lossless, so any change in the pixels is a bug.
    #[arg(long)]
    checksum: bool,
}

fn main() -> ExitCode {
    match run(Args::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Nanoseconds accumulated per stage, over all worker threads.
#[derive(Default)]
struct StageClock {
    read: AtomicU64,
    decode: AtomicU64,
    train_fir: AtomicU64,
    train_image: AtomicU64,
    val_fir: AtomicU64,
    val_image: AtomicU64,
}

fn add(c: &AtomicU64, d: Duration) {
    c.fetch_add(d.as_nanos() as u64, Ordering::Relaxed);
}

fn run(args: Args) -> Result<()> {
    if args.workers == 0 {
        bail!("--workers must be at least 1");
    }
    let root = match (&args.root, args.generate) {
        (Some(r), _) => r.clone(),
        (None, Some(n)) => PathBuf::from(format!("target/bench-data/imagenet-like-{n}")),
        (None, None) => bail!("pass --root DIR (an ImageFolder) or --generate N"),
    };
    if let Some(n) = args.generate {
        let t = Instant::now();
        let written = data::synthetic::generate_imagenet_like(&root, n, 0)
            .with_context(|| format!("generating {n} JPEGs in {}", root.display()))?;
        if written && !args.json {
            println!(
                "# generated {n} JPEGs in {} ({:.1} s)",
                root.display(),
                t.elapsed().as_secs_f64()
            );
        }
    }
    let t = Instant::now();
    let folder = ImageFolder::new(&root).with_context(|| format!("scanning {}", root.display()))?;
    let scan_s = t.elapsed().as_secs_f64();
    let n = folder.len();
    let paths: Vec<PathBuf> = folder.samples().iter().map(|s| s.path.clone()).collect();
    let workers = args.workers;

    // Warm the page cache (both frameworks then read from memory).
    let bytes_total = AtomicU64::new(0);
    parallel_for(workers, n, |i| {
        if let Ok(b) = std::fs::read(&paths[i]) {
            bytes_total.fetch_add(b.len() as u64, Ordering::Relaxed);
        }
    });
    let bytes_total = bytes_total.into_inner();
    if args.checksum {
        return print_checksums(&paths, args.size);
    }

    // Per-stage time per image, timed inside the workers (includes preemption on a busy machine).
    let clock = StageClock::default();
    let train = Transform::train(args.size);
    let val = Transform::val(args.size);
    let s = args.size as usize;
    let stage_images = if args.no_stages { 0 } else { n };
    parallel_for(workers, stage_images, |i| {
        let p = &paths[i];
        let t0 = Instant::now();
        let Ok(bytes) = std::fs::read(p) else { return };
        let t1 = Instant::now();
        let Ok(img) = decode_bytes(&bytes) else {
            return;
        };
        let t2 = Instant::now();
        let mut out = vec![0u8; 3 * s * s];
        train.apply_into(
            &img,
            &mut sample_rng(0, 0, i),
            Resampler::FastImageResize,
            &mut out,
        );
        let t3 = Instant::now();
        train.apply_into(&img, &mut sample_rng(0, 0, i), Resampler::Image, &mut out);
        let t4 = Instant::now();
        val.apply_into(
            &img,
            &mut sample_rng(0, 0, i),
            Resampler::FastImageResize,
            &mut out,
        );
        let t5 = Instant::now();
        val.apply_into(&img, &mut sample_rng(0, 0, i), Resampler::Image, &mut out);
        let t6 = Instant::now();
        add(&clock.read, t1 - t0);
        add(&clock.decode, t2 - t1);
        add(&clock.train_fir, t3 - t2);
        add(&clock.train_image, t4 - t3);
        add(&clock.val_fir, t5 - t4);
        add(&clock.val_image, t6 - t5);
    });
    let ms = |c: &AtomicU64| c.load(Ordering::Relaxed) as f64 / 1e6 / n as f64;

    // Wall-clock throughput (best of --repeat) and CPU cost (images per CPU-second of the whole
    // process, which a busy shared machine disturbs much less than wall time).
    let best = |f: &dyn Fn() -> Result<usize>| -> Result<(f64, f64)> {
        let (mut best, mut best_cpu) = (0.0f64, 0.0f64);
        for _ in 0..args.repeat.max(1) {
            let (t, c) = (Instant::now(), process_cpu_seconds());
            let count = f()?;
            best = best.max(count as f64 / t.elapsed().as_secs_f64());
            if let (Some(c0), Some(c1)) = (c, process_cpu_seconds()) {
                best_cpu = best_cpu.max(count as f64 / (c1 - c0).max(1e-9));
            }
        }
        Ok((best, best_cpu))
    };
    let wanted: Vec<&str> = args.pipelines.split(',').map(str::trim).collect();
    let bs = args.batch_size;
    let new_loader = |cfg: LoaderConfig| -> Result<Loader> {
        let sampler = DistributedSampler::new(n, 1, 0)?;
        Ok(Loader::new(
            folder.clone(),
            sampler,
            cfg.with_workers(args.workers),
        )?)
    };
    let run_epoch = |loader: &mut Loader, epoch: u64| -> Result<usize> {
        let mut count = 0;
        for batch in loader.epoch(epoch) {
            count += batch?.len();
        }
        Ok(count)
    };
    // A training run's steady state: one loader, an untimed first epoch, then each timed pass
    // is its next epoch (with the scan indexes the earlier epochs left, as from a run's second
    // epoch on).
    let steady = |cfg: LoaderConfig| -> Result<(f64, f64)> {
        let mut loader = new_loader(cfg)?;
        run_epoch(&mut loader, 0)?;
        let (loader, epoch) = (RefCell::new(loader), Cell::new(1));
        best(&|| {
            epoch.set(epoch.get() + 1);
            run_epoch(&mut loader.borrow_mut(), epoch.get() - 1)
        })
    };
    // A run's first epoch: a fresh loader each pass.
    let first_epoch =
        |cfg: LoaderConfig| -> Result<(f64, f64)> { best(&|| run_epoch(&mut new_loader(cfg)?, 0)) };
    let mut rows: Vec<(&str, (f64, f64))> = Vec::new();
    let recipe = |erase: f64| {
        let mut cfg = LoaderConfig::train(args.size, bs);
        cfg.transform = Transform::train(args.size)
            .with_auto_augment(Some(AutoAugment::TrivialAugmentWide))
            .with_random_erase(erase);
        cfg
    };
    for name in [
        "decode",
        "decode_crop",
        "train",
        "train_first_epoch",
        "train_no_index",
        "train_full_decode",
        "train_unscaled",
        "train_fast",
        "train_image_resize",
        "train_f32",
        "train_ta_wide",
        "train_ta_wide_first_epoch",
        "train_ta_wide_no_index",
        "train_ta_wide_full_decode",
        "train_ta_wide_erase",
        "val",
        "val_first_epoch",
        "val_no_index",
        "val_full_decode",
        "val_unscaled",
        "val_fast",
    ] {
        if !wanted.contains(&name) {
            continue;
        }
        let ips = match name {
            "decode" => best(&|| {
                let ok = AtomicUsize::new(0);
                parallel_for(workers, n, |i| {
                    if std::fs::read(&paths[i])
                        .ok()
                        .and_then(|b| decode_bytes(&b).ok())
                        .is_some()
                    {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                });
                Ok(ok.into_inner())
            })?,
            "decode_crop" => best(&|| {
                // The training transform's first draw, then only that box decoded.
                let transform = Transform::train(args.size);
                let ok = AtomicUsize::new(0);
                parallel_for(workers, n, |i| {
                    let mut rng = sample_rng(0, 0, i);
                    if std::fs::read(&paths[i])
                        .ok()
                        .and_then(|b| {
                            decode_bytes_region(&b, |w, h| transform.draw_crop(w, h, &mut rng)).ok()
                        })
                        .is_some()
                    {
                        ok.fetch_add(1, Ordering::Relaxed);
                    }
                });
                Ok(ok.into_inner())
            })?,
            "train" => steady(LoaderConfig::train(args.size, bs))?,
            "train_first_epoch" => first_epoch(LoaderConfig::train(args.size, bs))?,
            "train_no_index" => {
                steady(LoaderConfig::train(args.size, bs).with_scan_index_budget(0))?
            }
            "train_full_decode" => steady(
                LoaderConfig::train(args.size, bs)
                    .with_decode_region(false)
                    .with_decode_scaling(DecodeScaling::Off),
            )?,
            "train_unscaled" => {
                steady(LoaderConfig::train(args.size, bs).with_decode_scaling(DecodeScaling::Off))?
            }
            "train_fast" => {
                steady(LoaderConfig::train(args.size, bs).with_decode_scaling(DecodeScaling::Fast))?
            }
            "val_unscaled" => {
                steady(LoaderConfig::val(args.size, bs).with_decode_scaling(DecodeScaling::Off))?
            }
            "val_fast" => {
                steady(LoaderConfig::val(args.size, bs).with_decode_scaling(DecodeScaling::Fast))?
            }
            "train_image_resize" => {
                steady(LoaderConfig::train(args.size, bs).with_resampler(Resampler::Image))?
            }
            "train_f32" => {
                steady(LoaderConfig::train(args.size, bs).with_output(OutputFormat::F32))?
            }
            "train_ta_wide" => steady(recipe(0.0))?,
            "train_ta_wide_first_epoch" => first_epoch(recipe(0.0))?,
            "train_ta_wide_no_index" => steady(recipe(0.0).with_scan_index_budget(0))?,
            "train_ta_wide_full_decode" => steady(
                recipe(0.0)
                    .with_decode_region(false)
                    .with_decode_scaling(DecodeScaling::Off),
            )?,
            "train_ta_wide_erase" => steady(recipe(0.1))?,
            "val_first_epoch" => first_epoch(LoaderConfig::val(args.size, bs))?,
            "val_no_index" => steady(LoaderConfig::val(args.size, bs).with_scan_index_budget(0))?,
            "val_full_decode" => steady(
                LoaderConfig::val(args.size, bs)
                    .with_decode_region(false)
                    .with_decode_scaling(DecodeScaling::Off),
            )?,
            _ => steady(LoaderConfig::val(args.size, bs))?,
        };
        rows.push((name, ips));
    }

    let stages = [
        ("read", ms(&clock.read)),
        ("decode", ms(&clock.decode)),
        ("train_transform_fir", ms(&clock.train_fir)),
        ("train_transform_image", ms(&clock.train_image)),
        ("val_transform_fir", ms(&clock.val_fir)),
        ("val_transform_image", ms(&clock.val_image)),
    ];
    if args.json {
        let mut obj = serde_json::json!({
            "framework": "rust-data",
            "root": root.display().to_string(),
            "images": n,
            "mean_file_kib": bytes_total as f64 / 1024.0 / n as f64,
            "workers": args.workers,
            "size": args.size,
            "batch_size": bs,
            "scan_s": scan_s,
        });
        for &(name, (v, c)) in &rows {
            obj[format!("{name}_img_per_s")] = serde_json::json!(v);
            obj[format!("{name}_img_per_cpu_s")] = serde_json::json!(c);
        }
        for (name, v) in stages.iter().filter(|_| !args.no_stages) {
            obj[format!("{name}_ms_per_img")] = serde_json::json!(v);
        }
        println!("{obj}");
        return Ok(());
    }
    let mut out = std::io::stdout().lock();
    writeln!(
        out,
        "# {} images in {} ({:.0} KiB each on average), {} workers, size {}, batch {}, scan {:.3} s",
        n,
        root.display(),
        bytes_total as f64 / 1024.0 / n as f64,
        args.workers,
        args.size,
        bs,
        scan_s
    )?;
    writeln!(
        out,
        "# {:<22} {:>12} {:>14}",
        "pipeline", "img_per_s", "img_per_cpu_s"
    )?;
    for &(name, (v, c)) in &rows {
        writeln!(out, "  {name:<22} {v:>12.1} {c:>14.1}")?;
    }
    if !args.no_stages {
        writeln!(out, "# {:<22} {:>12}", "stage (in-worker)", "ms_per_img")?;
    }
    for (name, v) in stages.iter().filter(|_| !args.no_stages) {
        writeln!(out, "  {name:<22} {v:>12.3}")?;
    }
    Ok(())
}

/// User + system CPU seconds of this process so far (Linux `/proc/self/stat`, 100 ticks/s);
/// `None` elsewhere.
fn process_cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks: f64 = f.get(11)?.parse::<f64>().ok()? + f.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// Runs `f(i)` for `i in 0..n` on `workers` scoped threads (dynamic work sharing).
fn parallel_for(workers: usize, n: usize, f: impl Fn(usize) + Sync) {
    let next = AtomicUsize::new(0);
    std::thread::scope(|s| {
        for _ in 0..workers {
            s.spawn(|| {
                loop {
                    let i = next.fetch_add(1, Ordering::Relaxed);
                    if i >= n {
                        break;
                    }
                    f(i);
                }
            });
        }
    });
}

/// FNV-1a over the pixels of each image's full decode, and separately over the region decodes
/// of the training crop drawn with seed 0 (sizes included, so a shifted box cannot collide).
fn print_checksums(paths: &[PathBuf], size: u32) -> Result<()> {
    fn fnv(hash: &mut u64, bytes: &[u8]) {
        for &b in bytes {
            *hash = (*hash ^ u64::from(b)).wrapping_mul(0x100_0000_01b3);
        }
    }
    let transform = Transform::train(size);
    let (mut full, mut region) = (0xcbf2_9ce4_8422_2325_u64, 0xcbf2_9ce4_8422_2325_u64);
    for (i, path) in paths.iter().enumerate() {
        let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
        let image = decode_bytes(&bytes).map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        fnv(&mut full, &image.width().to_le_bytes());
        fnv(&mut full, &image.height().to_le_bytes());
        fnv(&mut full, image.as_raw());
        let mut rng = sample_rng(0, 0, i);
        let mut drawn = None;
        let image = decode_bytes_region(&bytes, |w, h| {
            drawn = transform.draw_crop(w, h, &mut rng);
            drawn
        })
        .map_err(|e| anyhow::anyhow!("{}: {e}", path.display()))?;
        // Only the box is defined by a region decode.
        if let Some(b) = drawn {
            for y in b.top..b.top + b.height {
                let row = (y * image.width() + b.left) as usize * 3;
                fnv(
                    &mut region,
                    &image.as_raw()[row..row + b.width as usize * 3],
                );
            }
        }
    }
    println!(
        "# {} images: full decode {full:016x}, training-crop region decode {region:016x}",
        paths.len()
    );
    Ok(())
}
