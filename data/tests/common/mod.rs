//! Helpers shared by the integration tests: real JPEG files in temp dirs.
#![allow(dead_code)]

use std::path::{Path, PathBuf};

use image::ExtendedColorType;
use image::codecs::jpeg::JpegEncoder;

/// This crate's folder in the checkout under test. Cargo sets `CARGO_MANIFEST_DIR` when it runs
/// a test; the compile-time value names the checkout that built the binary, which differs when
/// checkouts share a target folder (`.ci/run` uses one under `~/.cache`) and cargo reuses it.
pub fn manifest_dir() -> PathBuf {
    std::env::var_os("CARGO_MANIFEST_DIR")
        .map_or_else(|| PathBuf::from(env!("CARGO_MANIFEST_DIR")), PathBuf::from)
}

/// Folder of the committed Pillow fixtures.
pub fn fixtures() -> PathBuf {
    manifest_dir().join("tests/fixtures")
}

/// Every photo fixture (baseline 4:2:0, 4:4:4 and 4:2:2, progressive, grayscale, CMYK, a phone
/// file with a trailer) and the region fixtures (restart markers per row and mid-row, 4:1:1,
/// 4:4:0, sizes off the MCU grid, a two-MCU image), sorted.
pub fn jpeg_fixtures() -> Vec<PathBuf> {
    let mut files = Vec::new();
    for folder in ["photos", "region"] {
        let dir = fixtures().join(folder);
        for entry in std::fs::read_dir(&dir).expect("fixture folder") {
            let path = entry.expect("fixture entry").path();
            if path.extension().is_some_and(|e| e == "jpg") {
                files.push(path);
            }
        }
    }
    files.sort();
    assert!(files.len() >= 13, "fixtures missing: {files:?}");
    files
}

/// A path's file name, for messages.
pub fn file_name(path: &Path) -> String {
    path.file_name()
        .map_or_else(String::new, |n| n.to_string_lossy().into_owned())
}

/// A `w × h` image whose pixels depend on position and `seed` (smooth, so JPEG keeps it).
pub fn pattern(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let mut px = Vec::with_capacity((3 * w * h) as usize);
    for y in 0..h {
        for x in 0..w {
            px.push(((x * 255) / w.max(1)) as u8);
            px.push(((y * 255) / h.max(1)) as u8);
            px.push(((seed * 37 + x + y) % 256) as u8);
        }
    }
    px
}

/// Writes a baseline JPEG (quality 90) of [`pattern`].
pub fn write_jpeg(path: &Path, w: u32, h: u32, seed: u32) {
    let mut bytes = Vec::new();
    JpegEncoder::new_with_quality(&mut bytes, 90)
        .encode(&pattern(w, h, seed), w, h, ExtendedColorType::Rgb8)
        .expect("encode test JPEG");
    std::fs::write(path, bytes).expect("write test JPEG");
}

/// Writes `root/<class>/<i>.jpg` for every class, `per_class` images each, sizes varying.
pub fn make_folder(root: &Path, classes: &[&str], per_class: usize) {
    for (k, class) in classes.iter().enumerate() {
        let dir = root.join(class);
        std::fs::create_dir_all(&dir).expect("mkdir");
        for i in 0..per_class {
            let w = 40 + ((i * 7 + k * 3) % 30) as u32;
            let h = 32 + ((i * 5 + k * 11) % 30) as u32;
            write_jpeg(
                &dir.join(format!("img_{i:03}.jpg")),
                w,
                h,
                (k * 100 + i) as u32,
            );
        }
    }
}
