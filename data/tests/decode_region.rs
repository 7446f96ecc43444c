//! Decoding only a crop's region (the patched zune-jpeg's `set_region`): inside the box, the
//! pixels must be exactly those of the full decode, for every layout a JPEG can have.

mod common;

use data::{
    CropBox, DecodePlan, ScanIndexCache, decode_file, decode_file_plan_indexed, decode_file_region,
};
use image::RgbImage;
use rand::{RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Boxes at the corners and edges, one pixel and one row or column wide, on and off the MCU
/// grid, the whole image, and random `RandomResizedCrop`-like boxes.
fn boxes(width: u32, height: u32, rng: &mut ChaCha8Rng) -> Vec<CropBox> {
    let mut out = vec![
        CropBox {
            top: 0,
            left: 0,
            height,
            width,
        },
        CropBox {
            top: 0,
            left: 0,
            height: 1,
            width: 1,
        },
        CropBox {
            top: height - 1,
            left: width - 1,
            height: 1,
            width: 1,
        },
        CropBox {
            top: 0,
            left: 0,
            height: 1,
            width,
        },
        CropBox {
            top: height - 1,
            left: 0,
            height: 1,
            width,
        },
        CropBox {
            top: 0,
            left: width - 1,
            height,
            width: 1,
        },
        CropBox {
            top: height / 2,
            left: width / 2,
            height: height - height / 2,
            width: width - width / 2,
        },
    ];
    for edge in [8, 15, 16, 17, 31, 32, 33] {
        if edge < width && edge < height {
            out.push(CropBox {
                top: edge,
                left: edge,
                height: height - edge,
                width: width - edge,
            });
            out.push(CropBox {
                top: 0,
                left: 0,
                height: edge,
                width: edge,
            });
        }
    }
    for _ in 0..40 {
        let w = rng.random_range(1..=width);
        let h = rng.random_range(1..=height);
        let left = rng.random_range(0..=width - w);
        let top = rng.random_range(0..=height - h);
        out.push(CropBox {
            top,
            left,
            height: h,
            width: w,
        });
    }
    out
}

fn assert_same_inside(full: &RgbImage, region: &RgbImage, b: CropBox, what: &str) {
    assert_eq!(full.dimensions(), region.dimensions(), "{what}: size");
    for y in b.top..b.top + b.height {
        for x in b.left..b.left + b.width {
            assert_eq!(
                full.get_pixel(x, y),
                region.get_pixel(x, y),
                "{what}: pixel ({x}, {y}) inside the box differs from the full decode"
            );
        }
    }
}

#[test]
fn a_region_decodes_to_exactly_the_full_decodes_pixels() {
    let mut rng = ChaCha8Rng::seed_from_u64(7);
    let mut checked = 0;
    for path in common::jpeg_fixtures() {
        let full = decode_file(&path).expect("full decode");
        let (w, h) = full.dimensions();
        for b in boxes(w, h, &mut rng) {
            let mut asked = None;
            let region = decode_file_region(&path, |width, height| {
                asked = Some((width, height));
                Some(b)
            })
            .expect("region decode");
            assert_eq!(
                asked,
                Some((w, h)),
                "{}: the region is asked once, with the size",
                path.display()
            );
            assert_same_inside(&full, &region, b, &format!("{} box {b:?}", path.display()));
            checked += 1;
        }
    }
    assert!(checked > 600, "only {checked} boxes checked");
}

/// Region decode of `path` at full size through `cache` (as file 0).
fn indexed_region(path: &std::path::Path, cache: &ScanIndexCache, b: CropBox) -> RgbImage {
    decode_file_plan_indexed(
        path,
        |_, _, _| DecodePlan {
            scale: 1,
            region: Some(b),
        },
        cache,
        0,
    )
    .expect("indexed region decode")
    .image
}

#[test]
fn regions_decoded_from_earlier_decodes_marks_are_exact() {
    // One cache per fixture and order: the boxes in order (the whole image first marks every
    // row) and reversed (random boxes first leave rows unmarked, which later decodes fill in).
    let mut rng = ChaCha8Rng::seed_from_u64(11);
    let (mut checked, mut indexed) = (0, 0);
    for path in common::jpeg_fixtures() {
        let full = decode_file(&path).expect("full decode");
        let (w, h) = full.dimensions();
        let boxes = boxes(w, h, &mut rng);
        for order in [boxes.clone(), boxes.into_iter().rev().collect()] {
            let cache = ScanIndexCache::new(1, usize::MAX);
            for b in order {
                let region = indexed_region(&path, &cache, b);
                let what = format!("{} box {b:?} with marks", path.display());
                assert_same_inside(&full, &region, b, &what);
                checked += 1;
            }
            indexed += usize::from(cache.bytes() > 0);
        }
    }
    assert!(checked > 1200, "only {checked} boxes checked");
    // Baseline files without restart markers are indexed; progressive, restart-marker,
    // grayscale and CMYK files are not.
    assert!(indexed >= 12, "only {indexed} of the runs kept marks");
}

#[test]
fn an_indexed_region_reads_nothing_above_it() {
    // Marks from a clean decode, then the first fifth of the scan's bytes scrambled (same
    // length, so the marks still apply): a region in the bottom half decodes exactly as before
    // from the marks, where a decode without them reads the scrambled bytes and differs.
    for name in ["baseline_420.jpg", "baseline_444.jpg", "small_422.jpg"] {
        let path = common::fixtures().join("photos").join(name);
        let full = decode_file(&path).expect("full decode");
        let (w, h) = full.dimensions();
        let cache = ScanIndexCache::new(1, usize::MAX);
        let whole = CropBox {
            top: 0,
            left: 0,
            height: h,
            width: w,
        };
        indexed_region(&path, &cache, whole);

        let mut bytes = std::fs::read(&path).expect("read");
        let sos = bytes
            .windows(2)
            .position(|m| m == [0xFF, 0xDA])
            .expect("SOS marker");
        let start = sos + 2 + usize::from(u16::from_be_bytes([bytes[sos + 2], bytes[sos + 3]]));
        let end = start + (bytes.len() - start) / 5;
        for (i, byte) in bytes[start..end].iter_mut().enumerate() {
            // Never 0xFF: no marker appears.
            *byte = (i as u8).wrapping_mul(97).wrapping_add(13) % 0xFF;
        }
        let dir = tempfile::tempdir().expect("tempdir");
        let scrambled = dir.path().join(name);
        std::fs::write(&scrambled, &bytes).expect("write");

        let b = CropBox {
            top: h / 2,
            left: w / 3,
            height: h - h / 2,
            width: w / 2,
        };
        let region = indexed_region(&scrambled, &cache, b);
        assert_same_inside(
            &full,
            &region,
            b,
            &format!("{name}, scrambled above, with marks"),
        );
        let unindexed = decode_file_region(&scrambled, |_, _| Some(b));
        let differs = unindexed.is_err()
            || unindexed.as_ref().is_ok_and(|img| {
                (b.top..b.top + b.height).any(|y| {
                    (b.left..b.left + b.width).any(|x| img.get_pixel(x, y) != full.get_pixel(x, y))
                })
            });
        assert!(
            differs,
            "{name}: the scrambled bytes do not matter without marks either"
        );
    }
}

#[test]
fn no_region_is_the_whole_image_bit_for_bit() {
    // The direct zune-jpeg call must give what `image` gives (the same options), everywhere.
    for path in common::jpeg_fixtures() {
        let full = decode_file(&path).expect("full decode");
        let whole = decode_file_region(&path, |_, _| None).expect("decode without a region");
        assert!(
            full == whole,
            "{}: the decode without a region differs",
            path.display()
        );
    }
}

#[test]
fn a_region_near_the_top_stops_decoding_early() {
    // The decoder stops after the region's last row and leaves the rest of the (zeroed) output
    // alone: what makes region decoding cheaper, seen in its output. A photo's bottom rows are
    // never all black.
    let path = common::fixtures().join("photos/baseline_420.jpg");
    let full = decode_file(&path).expect("full decode");
    let (w, h) = full.dimensions();
    let b = CropBox {
        top: 10,
        left: 40,
        height: 50,
        width: 100,
    };
    let region = decode_file_region(&path, |_, _| Some(b)).expect("region decode");
    let last_row = |img: &RgbImage| {
        (0..w)
            .map(|x| img.get_pixel(x, h - 1).0)
            .collect::<Vec<_>>()
    };
    assert!(last_row(&full).iter().any(|p| *p != [0, 0, 0]));
    assert!(
        last_row(&region).iter().all(|p| *p == [0, 0, 0]),
        "the region decode went on past the region's last row"
    );
    assert_same_inside(&full, &region, b, "baseline_420.jpg");
}

#[test]
fn a_png_and_a_bad_file_go_the_general_way() {
    let png = common::fixtures().join("png_named.JPEG");
    let mut asked = 0;
    let img = decode_file_region(&png, |_, _| {
        asked += 1;
        None
    })
    .expect("PNG");
    assert_eq!((asked, img.dimensions()), (1, (40, 24)));

    let dir = tempfile::tempdir().expect("tempdir");
    let cut = dir.path().join("cut.jpg");
    let bytes = std::fs::read(common::fixtures().join("photos/baseline_420.jpg")).expect("read");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).expect("write");
    let error = decode_file_region(&cut, |_, _| None)
        .expect_err("truncated")
        .to_string();
    assert!(
        error.contains("cut.jpg") && error.contains("truncated"),
        "{error}"
    );
}

#[test]
fn the_transforms_read_only_the_pixels_they_report() {
    // Each transform applied to the region decode of `pixels_read` gives the same bytes as on the
    // full decode: validation's window (its center crop's preimage and the filter's support, at
    // down- and upscaling) and training's crop, both resizers, every interpolation.
    use data::transform::{Interpolation, Resampler};
    use data::{AutoAugment, Transform};
    let transforms = [
        Transform::val(224),
        Transform::val_sizes(232, 224),
        Transform::val(64),
        Transform::val(224).with_interpolation(Interpolation::Bicubic),
        Transform::val(48).with_interpolation(Interpolation::Bicubic),
        Transform::val(224).with_interpolation(Interpolation::Nearest),
        Transform::val_sizes(400, 384),
        Transform::train(224),
        Transform::train(176).with_interpolation(Interpolation::Bicubic),
        Transform::train(64).with_auto_augment(Some(AutoAugment::TrivialAugmentWide)),
    ];
    let mut regions = 0;
    for path in common::jpeg_fixtures() {
        let full = decode_file(&path).expect("full decode");
        for (t, transform) in transforms.iter().enumerate() {
            for resampler in [Resampler::FastImageResize, Resampler::Image] {
                for seed in 0..3 {
                    let size = transform.size() as usize;
                    let mut want = vec![0; 3 * size * size];
                    let mut rng = ChaCha8Rng::seed_from_u64(seed);
                    let want_erase = transform.apply_into(&full, &mut rng, resampler, &mut want);

                    let mut rng = ChaCha8Rng::seed_from_u64(seed);
                    let mut crop = None;
                    let img = decode_file_region(&path, |w, h| {
                        crop = transform.draw_crop(w, h, &mut rng);
                        let read = transform.pixels_read(w, h, crop, resampler);
                        regions += usize::from(read.is_some_and(|r| (r.width, r.height) != (w, h)));
                        read
                    })
                    .expect("region decode");
                    let mut got = vec![0; 3 * size * size];
                    let got_erase =
                        transform.apply_drawn(&img, crop, &mut rng, resampler, &mut got);
                    assert!(
                        want == got && want_erase == got_erase,
                        "{}: transform {t} ({transform:?}), {resampler:?}, seed {seed}: the \
                         output differs when only the reported pixels are decoded",
                        path.display()
                    );
                }
            }
        }
    }
    assert!(
        regions > 500,
        "only {regions} transforms read less than the whole image"
    );
}
