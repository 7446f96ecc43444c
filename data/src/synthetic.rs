//! A small, learnable ImageFolder of real JPEG files, for quickstarts and tests.
//!
//! Class `k` of `n` has its own hue (`360°·k/n`) and its own stripe pattern (orientation
//! `180°·k/n`, period a class-specific fraction of the image side). Each image varies size
//! (160–500 px by default), saturation, brightness, stripe phase (position jitter) and carries
//! per-pixel noise, so it is not trivial, but colour and stripes survive `RandomResizedCrop` at
//! 64 px: a small ResNet separates the classes in a couple of epochs.
//!
//! Layout: `root/train/<class>/<i>.jpg`, `root/val/<class>/<i>.jpg`, and a marker file written
//! last. [`generate`] returns at once when the marker matches the configuration; otherwise it
//! writes the whole set into a temporary sibling folder and renames it into place, so readers
//! never see half a dataset and several writers (processes of one job, nodes sharing a file
//! system) never mix their files: the first rename wins and the others discard their copy. An
//! older or incomplete set in the way is renamed aside, then deleted.

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use image::ExtendedColorType;
use image::codecs::jpeg::JpegEncoder;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::DataError;

/// Name of the marker written after every image.
pub const MARKER_FILE: &str = ".synthetic-complete";

/// What to generate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticConfig {
    /// Number of classes (default 10).
    pub classes: usize,
    /// Training images per class (default 200).
    pub train_per_class: usize,
    /// Validation images per class (default 50).
    pub val_per_class: usize,
    /// Smallest image side in pixels (default 160).
    pub min_side: u32,
    /// Largest image side in pixels (default 500).
    pub max_side: u32,
    /// JPEG quality 1..=100 (default 90).
    pub quality: u8,
    /// Seed; the same seed gives the same files.
    pub seed: u64,
}

impl Default for SyntheticConfig {
    fn default() -> Self {
        Self {
            classes: 10,
            train_per_class: 200,
            val_per_class: 50,
            min_side: 160,
            max_side: 500,
            quality: 90,
            seed: 0,
        }
    }
}

/// What [`generate`] produced (or found).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SyntheticSummary {
    /// `root/train`, an ImageFolder root.
    pub train_dir: PathBuf,
    /// `root/val`, an ImageFolder root.
    pub val_dir: PathBuf,
    /// Class folder names, sorted.
    pub classes: Vec<String>,
    /// Training images written.
    pub train_images: usize,
    /// Validation images written.
    pub val_images: usize,
    /// `true` when a complete dataset with the same configuration was already there.
    pub reused: bool,
}

/// Class folder name of class `k`.
fn class_name(k: usize) -> String {
    format!("class_{k:03}")
}

fn marker_text(cfg: &SyntheticConfig) -> String {
    format!("{cfg:?}\n")
}

/// Writes (or reuses) the dataset under `root`.
///
/// # Errors
/// [`DataError::InvalidConfig`] for zero classes, `min_side` of 0 or above `max_side`, a quality
/// outside 1..=100; [`DataError::Write`] / [`DataError::Encode`] when a file cannot be written.
pub fn generate(
    root: impl AsRef<Path>,
    cfg: &SyntheticConfig,
) -> Result<SyntheticSummary, DataError> {
    let root = root.as_ref();
    if cfg.classes == 0 {
        return Err(DataError::InvalidConfig {
            field: "classes",
            got: "0".into(),
            expected: "at least 1",
        });
    }
    if cfg.min_side < 8 || cfg.min_side > cfg.max_side {
        return Err(DataError::InvalidConfig {
            field: "min_side",
            got: format!("{} (max_side {})", cfg.min_side, cfg.max_side),
            expected: "8 <= min_side <= max_side",
        });
    }
    if !(1..=100).contains(&cfg.quality) {
        return Err(DataError::InvalidConfig {
            field: "quality",
            got: cfg.quality.to_string(),
            expected: "1..=100",
        });
    }
    let classes: Vec<String> = (0..cfg.classes).map(class_name).collect();
    let summary = SyntheticSummary {
        train_dir: root.join("train"),
        val_dir: root.join("val"),
        classes: classes.clone(),
        train_images: cfg.classes * cfg.train_per_class,
        val_images: cfg.classes * cfg.val_per_class,
        reused: false,
    };
    if is_complete(root, cfg) {
        return Ok(SyntheticSummary {
            reused: true,
            ..summary
        });
    }
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Write { path, source }
    };
    let parent = match root.parent() {
        Some(p) if !p.as_os_str().is_empty() => p.to_path_buf(),
        _ => PathBuf::from("."),
    };
    std::fs::create_dir_all(&parent).map_err(write_err(&parent))?;
    let name = root
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "synthetic".into());
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.subsec_nanos())
        .unwrap_or(0);
    static WRITERS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
    let writer = WRITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = parent.join(format!(
        ".{name}.tmp-{}-{writer}-{nanos}",
        std::process::id()
    ));
    let written = write_splits(&tmp, cfg, &classes);
    if let Err(error) = written {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(error);
    }
    let reused = SyntheticSummary {
        reused: true,
        ..summary.clone()
    };
    // Into place by renames only, so that concurrent writers and readers never see a set half
    // removed: the first complete set to land wins, and an older or incomplete set in the way
    // is renamed aside before it is deleted. Each writer moves one aside at most a few times.
    let mut moves_left = 3;
    let placed = loop {
        let source = match std::fs::rename(&tmp, root) {
            Ok(()) => break Ok(summary),
            Err(source) => source,
        };
        if is_complete(root, cfg) {
            break Ok(reused);
        }
        if moves_left == 0 {
            break Err(DataError::Write {
                path: root.to_path_buf(),
                source,
            });
        }
        moves_left -= 1;
        let aside = parent.join(format!(
            ".{name}.old-{}-{writer}-{nanos}",
            std::process::id()
        ));
        match std::fs::rename(root, &aside) {
            Ok(()) => {
                let _ = std::fs::remove_dir_all(&aside);
            }
            // Another writer moved it first.
            Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
            Err(source) => {
                break Err(DataError::Write {
                    path: root.to_path_buf(),
                    source,
                });
            }
        }
    };
    if !matches!(placed, Ok(SyntheticSummary { reused: false, .. })) {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    placed
}

/// Whether `root` holds a complete set generated with `cfg` (its marker, written last, matches).
pub fn is_complete(root: impl AsRef<Path>, cfg: &SyntheticConfig) -> bool {
    std::fs::read_to_string(root.as_ref().join(MARKER_FILE)).is_ok_and(|m| m == marker_text(cfg))
}

/// Writes both splits and, last, the marker under `root` (a fresh folder).
fn write_splits(root: &Path, cfg: &SyntheticConfig, classes: &[String]) -> Result<(), DataError> {
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Write { path, source }
    };
    let mut jobs = Vec::new();
    for (split, dir, per_class) in [
        (0u64, root.join("train"), cfg.train_per_class),
        (1u64, root.join("val"), cfg.val_per_class),
    ] {
        for (k, class) in classes.iter().enumerate() {
            let class_dir = dir.join(class);
            std::fs::create_dir_all(&class_dir).map_err(write_err(&class_dir))?;
            jobs.extend(
                (0..per_class).map(|i| (split, k, i, class_dir.join(format!("{i:05}.jpg")))),
            );
        }
    }
    jobs.par_iter().try_for_each(|(split, k, i, path)| {
        let mut rng = ChaCha8Rng::seed_from_u64(
            cfg.seed ^ (split << 62) ^ ((*k as u64) << 40) ^ (*i as u64).wrapping_mul(0x9E37_79B9),
        );
        let (w, h, rgb) = render(&mut rng, *k, cfg);
        write_jpeg(path, &rgb, w, h, cfg.quality)
    })?;
    let marker = root.join(MARKER_FILE);
    let mut f = File::create(&marker).map_err(write_err(&marker))?;
    f.write_all(marker_text(cfg).as_bytes())
        .and_then(|()| f.sync_all())
        .map_err(write_err(&marker))
}

/// Marker written after [`generate_imagenet_like`]'s last image.
pub const IMAGENET_LIKE_MARKER: &str = ".imagenet-like-complete";

/// Writes `n` ImageNet-like JPEGs for benchmarks: `min(n, 10)` class folders (`n0000000k`), files
/// `img_XXXXXX.JPEG`, four in five 500×375 and one in five 375×500, quality 90, with smooth
/// regions, edges, mid-frequency texture and noise so they compress roughly like photos.
/// Deterministic from `seed`. Returns `false` (and writes nothing) when a complete set of the
/// same `n` and `seed` is already there.
///
/// # Errors
/// [`DataError::Write`] / [`DataError::Encode`] when a file cannot be written.
pub fn generate_imagenet_like(
    root: impl AsRef<Path>,
    n: usize,
    seed: u64,
) -> Result<bool, DataError> {
    let root = root.as_ref();
    let marker = root.join(IMAGENET_LIKE_MARKER);
    let stamp = format!("{n} {seed}\n");
    if std::fs::read_to_string(&marker).is_ok_and(|m| m == stamp) {
        return Ok(false);
    }
    let write_err = |path: &Path| {
        let path = path.to_path_buf();
        move |source| DataError::Write { path, source }
    };
    if root.exists() {
        std::fs::remove_dir_all(root).map_err(write_err(root))?;
    }
    let classes = n.clamp(1, 10);
    for k in 0..classes {
        let dir = root.join(format!("n{k:08}"));
        std::fs::create_dir_all(&dir).map_err(write_err(&dir))?;
    }
    (0..n).into_par_iter().try_for_each(|i| {
        let (w, h) = if i % 5 == 4 { (375, 500) } else { (500, 375) };
        let mut rng =
            ChaCha8Rng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let px = photo_like(&mut rng, w, h);
        let path = root.join(format!("n{:08}/img_{i:06}.JPEG", i % classes));
        write_jpeg(&path, &px, w, h, 90)
    })?;
    std::fs::write(&marker, stamp).map_err(write_err(&marker))?;
    Ok(true)
}

/// Photo-like content: a bilinearly upsampled random colour grid, a few solid discs (edges), a
/// sinusoidal texture and noise.
fn photo_like(rng: &mut ChaCha8Rng, w: u32, h: u32) -> Vec<u8> {
    let (gw, gh) = (12usize, 9usize);
    let colour = |rng: &mut ChaCha8Rng| -> [f32; 3] {
        [
            rng.random_range(0.0f32..255.0),
            rng.random_range(0.0f32..255.0),
            rng.random_range(0.0f32..255.0),
        ]
    };
    let grid: Vec<[f32; 3]> = (0..gw * gh).map(|_| colour(rng)).collect();
    let discs: Vec<(f32, f32, f32, [f32; 3])> = (0..6)
        .map(|_| {
            (
                rng.random_range(0.0..w as f32),
                rng.random_range(0.0..h as f32),
                rng.random_range(20.0f32..120.0),
                colour(rng),
            )
        })
        .collect();
    let (fx, fy) = (
        rng.random_range(0.05f32..0.4),
        rng.random_range(0.05f32..0.4),
    );
    let mut state = rng.random::<u64>() | 1;
    let mut px = Vec::with_capacity(3 * w as usize * h as usize);
    for y in 0..h {
        for x in 0..w {
            let gx = x as f32 / w as f32 * (gw - 1) as f32;
            let gy = y as f32 / h as f32 * (gh - 1) as f32;
            let (x0, y0) = (gx as usize, gy as usize);
            let (x1, y1) = ((x0 + 1).min(gw - 1), (y0 + 1).min(gh - 1));
            let (tx, ty) = (gx - x0 as f32, gy - y0 as f32);
            let texture = 18.0 * (x as f32 * fx).sin() * (y as f32 * fy).cos();
            let mut c = [0f32; 3];
            for (ch, v) in c.iter_mut().enumerate() {
                let a = grid[y0 * gw + x0][ch] * (1.0 - tx) + grid[y0 * gw + x1][ch] * tx;
                let b = grid[y1 * gw + x0][ch] * (1.0 - tx) + grid[y1 * gw + x1][ch] * tx;
                *v = a * (1.0 - ty) + b * ty + texture;
            }
            for &(cx, cy, r, col) in &discs {
                if (x as f32 - cx).powi(2) + (y as f32 - cy).powi(2) < r * r {
                    c = col;
                }
            }
            for v in c {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let noise = ((state >> 56) as f32 - 128.0) / 128.0 * 12.0;
                px.push((v + noise).clamp(0.0, 255.0) as u8);
            }
        }
    }
    px
}

/// Encodes packed RGB as a JPEG file.
fn write_jpeg(path: &Path, rgb: &[u8], w: u32, h: u32, quality: u8) -> Result<(), DataError> {
    let file = File::create(path).map_err(|source| DataError::Write {
        path: path.to_path_buf(),
        source,
    })?;
    let mut out = BufWriter::new(file);
    JpegEncoder::new_with_quality(&mut out, quality)
        .encode(rgb, w, h, ExtendedColorType::Rgb8)
        .map_err(|e| DataError::Encode {
            path: path.to_path_buf(),
            reason: e.to_string(),
        })?;
    out.flush().map_err(|source| DataError::Write {
        path: path.to_path_buf(),
        source,
    })
}

/// HSV (h in degrees, s and v in 0..=1) to RGB in 0..=255.
fn hsv_to_rgb(h: f32, s: f32, v: f32) -> [f32; 3] {
    let h = h.rem_euclid(360.0) / 60.0;
    let c = v * s;
    let x = c * (1.0 - ((h % 2.0) - 1.0).abs());
    let (r, g, b) = match h as u32 {
        0 => (c, x, 0.0),
        1 => (x, c, 0.0),
        2 => (0.0, c, x),
        3 => (0.0, x, c),
        4 => (x, 0.0, c),
        _ => (c, 0.0, x),
    };
    let m = v - c;
    [(r + m) * 255.0, (g + m) * 255.0, (b + m) * 255.0]
}

/// Draws one image of class `k`: returns `(width, height, packed RGB)`.
fn render(rng: &mut ChaCha8Rng, k: usize, cfg: &SyntheticConfig) -> (u32, u32, Vec<u8>) {
    let n = cfg.classes as f32;
    let w = rng.random_range(cfg.min_side..=cfg.max_side);
    let h = rng.random_range(cfg.min_side..=cfg.max_side);
    let hue = 360.0 * k as f32 / n + rng.random_range(-6.0f32..6.0);
    let bg = hsv_to_rgb(
        hue,
        rng.random_range(0.55f32..0.9),
        rng.random_range(0.6f32..0.95),
    );
    // Stripes: darker and less saturated, same hue family.
    let fg = hsv_to_rgb(
        hue + 20.0,
        rng.random_range(0.3f32..0.6),
        rng.random_range(0.15f32..0.35),
    );
    let angle = std::f32::consts::PI * k as f32 / n + rng.random_range(-0.08f32..0.08);
    let (dx, dy) = (angle.cos(), angle.sin());
    // 3 to 6 stripe pairs across the shorter side depending on the class.
    let period = w.min(h) as f32 / (3.0 + (k % 4) as f32);
    let phase = rng.random_range(0.0f32..1.0);
    let noise_amp = rng.random_range(8.0f32..28.0);
    // Cheap per-pixel noise: xorshift seeded from the image RNG.
    let mut state = rng.random::<u64>() | 1;
    let mut px = Vec::with_capacity(3 * w as usize * h as usize);
    for y in 0..h {
        for x in 0..w {
            let t = (x as f32 * dx + y as f32 * dy) / period + phase;
            let c = if t - t.floor() < 0.5 { bg } else { fg };
            for ch in c {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let u = (state >> 40) as f32 / (1u64 << 24) as f32; // [0, 1)
                let v = ch + noise_amp * (2.0 * u - 1.0);
                px.push(v.clamp(0.0, 255.0) as u8);
            }
        }
    }
    (w, h, px)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hsv_primaries() {
        let close = |a: [f32; 3], b: [f32; 3]| a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-3);
        assert!(close(hsv_to_rgb(0.0, 1.0, 1.0), [255.0, 0.0, 0.0]));
        assert!(close(hsv_to_rgb(120.0, 1.0, 1.0), [0.0, 255.0, 0.0]));
        assert!(close(hsv_to_rgb(240.0, 1.0, 1.0), [0.0, 0.0, 255.0]));
    }
}
