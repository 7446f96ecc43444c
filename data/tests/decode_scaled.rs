//! DCT-domain downscaling (the patched zune-jpeg's `set_scale`): a decode at `1/s` must be close
//! to the full decode averaged over `s × s` blocks, a region of it must be exactly the same
//! pixels as the whole scaled decode, and an image the scale does not apply to must decode
//! whole, unchanged.

mod common;

use std::path::Path;

use data::transform::{Resampler, Transform};
use data::{DecodeScaling, decode_file, decode_file_plan};
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;
use zune_core::bytestream::ZCursor;
use zune_core::colorspace::ColorSpace;
use zune_core::options::DecoderOptions;
use zune_jpeg::JpegDecoder;

/// Decodes `path` at `1/scale`, optionally only `region` (left, top, width, height in the
/// scaled image). Returns the scale used, the size and the RGB pixels.
fn decode_scaled(
    path: &Path,
    scale: usize,
    region: Option<(usize, usize, usize, usize)>,
) -> (usize, (usize, usize), Vec<u8>) {
    let bytes = std::fs::read(path).expect("fixture");
    let options = DecoderOptions::default()
        .set_strict_mode(false)
        .jpeg_set_out_colorspace(ColorSpace::RGB);
    let mut decoder = JpegDecoder::new_with_options(ZCursor::new(&bytes[..]), options);
    decoder.set_scale(scale);
    if let Some((left, top, width, height)) = region {
        decoder.set_region(left, top, width, height);
    }
    decoder.decode_headers().expect("headers");
    let used = decoder.scale();
    let size = decoder.output_dimensions().expect("size after the headers");
    let pixels = decoder.decode().expect("decode");
    assert_eq!(
        pixels.len(),
        3 * size.0 * size.1,
        "{}: buffer",
        path.display()
    );
    (used, size, pixels)
}

/// The full decode averaged over `s × s` blocks (partial blocks at the right and bottom edges
/// average what they hold).
fn area_downscale(path: &Path, s: usize) -> ((usize, usize), Vec<f64>) {
    let full = decode_file(path).expect("full decode");
    let (w, h) = (full.width() as usize, full.height() as usize);
    let (sw, sh) = (w.div_ceil(s), h.div_ceil(s));
    let mut out = vec![0.0; 3 * sw * sh];
    for y in 0..sh {
        for x in 0..sw {
            let mut sum = [0.0; 3];
            let mut n = 0.0;
            for yy in y * s..((y + 1) * s).min(h) {
                for xx in x * s..((x + 1) * s).min(w) {
                    let p = full.get_pixel(xx as u32, yy as u32).0;
                    for c in 0..3 {
                        sum[c] += f64::from(p[c]);
                    }
                    n += 1.0;
                }
            }
            for c in 0..3 {
                out[3 * (y * sw + x) + c] = sum[c] / n;
            }
        }
    }
    ((sw, sh), out)
}

/// Against libjpeg-turbo's own scaled decode (`make_scaled_fixtures.py`): both average each
/// block's transform over `s × s` pixels in the DCT domain, and differ by rounding.
const LIBJPEG_MAX_ERROR: f64 = 3.0;
const LIBJPEG_MEAN_ERROR: f64 = 0.1;

/// Against the full decode averaged over `s × s`: chroma is upsampled (smoothly) in the full
/// decode and not in the scaled one, so strong colour edges differ by tens of levels; on
/// average the two agree within about one level (libjpeg-turbo: 0.5–0.7 on the same files).
const AREA_MEAN_ERROR: f64 = 1.25;

fn max_and_mean(ours: &[u8], reference: impl Iterator<Item = f64>) -> (f64, f64) {
    let (mut max, mut sum, mut n) = (0.0f64, 0.0, 0usize);
    for (a, b) in ours.iter().zip(reference) {
        let d = (f64::from(*a) - b).abs();
        max = max.max(d);
        sum += d;
        n += 1;
    }
    assert_eq!(n, ours.len(), "reference size");
    (max, sum / n as f64)
}

#[test]
fn a_scaled_decode_matches_libjpeg_turbos() {
    let dir = common::fixtures().join("scaled/libjpeg");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("scaled/libjpeg fixtures") {
        let reference = entry.expect("entry").path();
        let stem = reference
            .file_stem()
            .expect("name")
            .to_string_lossy()
            .to_string();
        let (name, s) = stem.rsplit_once('_').expect("<name>_<scale>.png");
        let s: usize = s.parse().expect("scale");
        let folder = if name.starts_with("baseline") {
            "photos"
        } else {
            "region"
        };
        let path = common::fixtures().join(folder).join(format!("{name}.jpg"));
        let (used, size, pixels) = decode_scaled(&path, s, None);
        assert_eq!(
            used, s,
            "{name}: 1/{s} applies to a 4:2:0 or 4:4:4 baseline file"
        );
        let theirs = image::open(&reference).expect("reference PNG").into_rgb8();
        assert_eq!(
            (theirs.width() as usize, theirs.height() as usize),
            size,
            "{stem}: size"
        );
        let (max, mean) = max_and_mean(&pixels, theirs.as_raw().iter().map(|&v| f64::from(v)));
        eprintln!("{stem:<18} against libjpeg-turbo: max {max:.0}, mean {mean:.3}");
        assert!(
            max <= LIBJPEG_MAX_ERROR && mean <= LIBJPEG_MEAN_ERROR,
            "{stem}: max {max}, mean {mean:.3} from libjpeg-turbo's scaled decode"
        );
        checked += 1;
    }
    assert!(checked >= 11, "{checked} references");
}

#[test]
fn a_scaled_decode_is_close_to_the_full_decode_averaged() {
    let mut applied = 0;
    for path in common::jpeg_fixtures() {
        let name = common::file_name(&path);
        for s in [2, 4, 8] {
            let (used, size, pixels) = decode_scaled(&path, s, None);
            if used == 1 {
                // Not applicable: the whole image, exactly as the full decode.
                let full = decode_file(&path).expect("full decode");
                assert_eq!(
                    size,
                    (full.width() as usize, full.height() as usize),
                    "{name}"
                );
                if !name.contains("cmyk") && !name.contains("grayscale") {
                    assert_eq!(
                        pixels,
                        full.into_raw(),
                        "{name}: an unscaled decode is the full one"
                    );
                }
                continue;
            }
            assert_eq!(used, s, "{name}: a scale is applied as asked or not at all");
            applied += 1;
            let (expected_size, reference) = area_downscale(&path, s);
            assert_eq!(size, expected_size, "{name} at 1/{s}: size");
            let (max, mean) = max_and_mean(&pixels, reference.into_iter());
            eprintln!("{name:<22} 1/{s}  against the area average: max {max:6.2}, mean {mean:.3}");
            // A 17 × 9 image is mostly edge blocks, whose padding the encoder invented.
            if !name.starts_with("tiny") {
                assert!(
                    mean <= AREA_MEAN_ERROR,
                    "{name} at 1/{s}: mean error {mean:.3}"
                );
            }
        }
    }
    // 4:2:0, 4:4:4, 4:2:2, 4:4:0 at every scale, 4:1:1 at 1/4 and 1/8.
    assert!(applied >= 20, "{applied} scaled decodes");
}

#[test]
fn progressive_grayscale_and_cmyk_files_decode_whole() {
    for name in ["progressive_420", "progressive_444", "grayscale", "cmyk"] {
        let path = common::fixtures()
            .join("photos")
            .join(format!("{name}.jpg"));
        let bytes = std::fs::read(&path).expect("fixture");
        let mut decoder = JpegDecoder::new(ZCursor::new(&bytes[..]));
        decoder.set_scale(2);
        decoder.decode_headers().expect("headers");
        assert_eq!(decoder.scale(), 1, "{name}");
        assert_eq!(decoder.output_dimensions(), decoder.dimensions(), "{name}");
    }
}

#[test]
fn a_region_of_a_scaled_decode_is_exactly_the_whole_scaled_decodes() {
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let mut checked = 0;
    for path in common::jpeg_fixtures() {
        let name = common::file_name(&path);
        for s in [2, 4, 8] {
            let (used, (w, h), whole) = decode_scaled(&path, s, None);
            if used == 1 {
                continue;
            }
            let mut boxes = vec![(0, 0, w, h), (0, 0, 1, 1), (w - 1, h - 1, 1, 1)];
            for _ in 0..12 {
                let bw = rng.random_range(1..=w);
                let bh = rng.random_range(1..=h);
                boxes.push((
                    rng.random_range(0..=w - bw),
                    rng.random_range(0..=h - bh),
                    bw,
                    bh,
                ));
            }
            for (left, top, bw, bh) in boxes {
                let (_, size, part) = decode_scaled(&path, s, Some((left, top, bw, bh)));
                assert_eq!(size, (w, h), "{name}: the region keeps the scaled layout");
                for y in top..top + bh {
                    let row = (y * w + left) * 3..(y * w + left + bw) * 3;
                    assert_eq!(
                        part[row.clone()],
                        whole[row],
                        "{name} at 1/{s}: row {y} of the box ({left}, {top}) {bw}x{bh}"
                    );
                }
                checked += 1;
            }
        }
    }
    assert!(checked >= 200, "{checked} boxes");
}

/// `RandomResizedCrop` on a scaled decode of only the crop's region, against the same draws on
/// the full decode: under `Faithful` within a few levels (the mean within the validation
/// bound of `fidelity.rs`).
#[test]
fn the_training_crop_from_a_scaled_region_decode_matches_the_full_decodes() {
    let transform = Transform::train(32);
    let mut scaled = 0;
    for name in ["baseline_420", "baseline_444", "phone_trailer", "small_422"] {
        let path = common::fixtures()
            .join("photos")
            .join(format!("{name}.jpg"));
        for index in 0..24 {
            let run = |scaling: DecodeScaling| {
                let mut rng = data::sample_rng(3, 0, index);
                let mut drawn = None;
                let img = decode_file_plan(&path, |w, h, scales| {
                    let crop = transform.draw_crop(w, h, &mut rng);
                    drawn = Some(crop);
                    transform.plan(w, h, crop, Resampler::default(), scaling, scales)
                })
                .expect("decode");
                let mut out = vec![0u8; 3 * 32 * 32];
                let crop = drawn.expect("planned");
                transform.apply_scaled(&img, crop, &mut rng, Resampler::default(), &mut out);
                (img.scale, out)
            };
            let (full_scale, full) = run(DecodeScaling::Off);
            assert_eq!(full_scale, 1);
            let (scale, ours) = run(DecodeScaling::Faithful);
            scaled += usize::from(scale > 1);
            // The crop's edge falls inside a pixel of the scaled decode, and the resize reads
            // that pixel whole: the outermost output rows and columns differ most.
            let (mut edge_max, mut inner_max, mut sum) = (0u8, 0u8, 0u64);
            for (i, (a, b)) in ours.iter().zip(&full).enumerate() {
                let (y, x) = ((i / 32) % 32, i % 32);
                let d = a.abs_diff(*b);
                if y == 0 || y == 31 || x == 0 || x == 31 {
                    edge_max = edge_max.max(d);
                } else {
                    inner_max = inner_max.max(d);
                }
                sum += u64::from(d);
            }
            let mean = sum as f64 / full.len() as f64;
            assert!(
                inner_max <= 4 && edge_max <= 12 && mean <= 0.35,
                "{name}, sample {index} at 1/{scale}: max {inner_max} inside, {edge_max} on \
                 the edge, mean {mean:.3} from the full decode"
            );
        }
    }
    assert!(scaled >= 10, "{scaled} crops decoded scaled");
}

/// A file cut short decodes at a scale as at full size: no panic, the part the data covered,
/// the rest filled (the decoder is lenient, as `image` runs it).
#[test]
fn a_truncated_file_decodes_at_a_scale_without_panicking() {
    let path = common::fixtures().join("photos/baseline_420.jpg");
    let bytes = std::fs::read(&path).expect("fixture");
    for cut in [
        700,
        5_000,
        bytes.len() / 3,
        bytes.len() / 2,
        bytes.len() - 10,
    ] {
        for s in [2, 4, 8] {
            let outcome = std::panic::catch_unwind(|| {
                let options = DecoderOptions::default()
                    .set_strict_mode(false)
                    .jpeg_set_out_colorspace(ColorSpace::RGB);
                let mut decoder =
                    JpegDecoder::new_with_options(ZCursor::new(&bytes[..cut]), options);
                decoder.set_scale(s);
                decoder.set_region(10, 10, 60, 60);
                decoder.decode().map(|p| p.len())
            });
            let decoded = outcome.unwrap_or_else(|_| panic!("cut at {cut}, 1/{s}: panicked"));
            if let Ok(len) = decoded {
                assert_eq!(
                    len,
                    3 * 500usize.div_ceil(s) * 375usize.div_ceil(s),
                    "cut at {cut}"
                );
            }
        }
    }
}

/// A validation crop larger than the resized image is padded (torchvision's `CenterCrop`): the
/// plan decodes such an image at full size, so every scaling gives the unscaled output.
#[test]
fn a_padded_validation_crop_is_never_planned_scaled() {
    let transform = Transform::val_sizes(32, 48);
    let path = common::fixtures().join("photos/baseline_420.jpg");
    let run = |scaling: DecodeScaling| {
        let img = decode_file_plan(&path, |w, h, scales| {
            transform.plan(w, h, None, Resampler::default(), scaling, scales)
        })
        .expect("decode");
        let mut out = vec![0u8; 3 * 48 * 48];
        let mut rng = data::sample_rng(0, 0, 0);
        transform.apply_scaled(&img, None, &mut rng, Resampler::default(), &mut out);
        (img.scale, out)
    };
    let (_, unscaled) = run(DecodeScaling::Off);
    for scaling in [DecodeScaling::Faithful, DecodeScaling::Fast] {
        let (scale, out) = run(scaling);
        assert_eq!(scale, 1, "{scaling:?}");
        assert_eq!(out, unscaled, "{scaling:?}");
    }
}
