//! The image operations of torchvision's auto-augment policies, on 8-bit RGB as torchvision
//! runs them on PIL images: each one follows Pillow's C code (blend truncation, the `L`
//! conversion's fixed-point weights, the 3×3 `SMOOTH` kernel in `f32`, the 16.16 fixed-point
//! nearest-neighbour affine sampler) so that results match Pillow's pixel for pixel.

use image::RgbImage;

/// One operation of the auto-augment search spaces (torchvision's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Op {
    /// No change.
    Identity,
    /// Horizontal shear about the top-left corner, by `atan(magnitude)`.
    ShearX,
    /// Vertical shear about the top-left corner.
    ShearY,
    /// Horizontal shift by `int(magnitude)` pixels.
    TranslateX,
    /// Vertical shift by `int(magnitude)` pixels.
    TranslateY,
    /// Counter-clockwise rotation by `magnitude` degrees about the centre.
    Rotate,
    /// Blend with black by `1 + magnitude`.
    Brightness,
    /// Blend with the grayscale image by `1 + magnitude` (saturation).
    Color,
    /// Blend with the mean gray level by `1 + magnitude`.
    Contrast,
    /// Blend with the `SMOOTH`-filtered image by `1 + magnitude`.
    Sharpness,
    /// Keep the `int(magnitude)` high bits.
    Posterize,
    /// Invert the values at or above `255 · magnitude`.
    Solarize,
    /// Stretch each channel to 0..=255.
    AutoContrast,
    /// Equalize each channel's histogram.
    Equalize,
    /// `255 - x`.
    Invert,
}

impl Op {
    /// torchvision's name of the op.
    pub fn name(self) -> &'static str {
        match self {
            Op::Identity => "Identity",
            Op::ShearX => "ShearX",
            Op::ShearY => "ShearY",
            Op::TranslateX => "TranslateX",
            Op::TranslateY => "TranslateY",
            Op::Rotate => "Rotate",
            Op::Brightness => "Brightness",
            Op::Color => "Color",
            Op::Contrast => "Contrast",
            Op::Sharpness => "Sharpness",
            Op::Posterize => "Posterize",
            Op::Solarize => "Solarize",
            Op::AutoContrast => "AutoContrast",
            Op::Equalize => "Equalize",
            Op::Invert => "Invert",
        }
    }

    /// The op named `name` (torchvision's spelling).
    pub fn from_name(name: &str) -> Option<Self> {
        ALL_OPS.iter().copied().find(|op| op.name() == name)
    }
}

const ALL_OPS: [Op; 15] = [
    Op::Identity,
    Op::ShearX,
    Op::ShearY,
    Op::TranslateX,
    Op::TranslateY,
    Op::Rotate,
    Op::Brightness,
    Op::Color,
    Op::Contrast,
    Op::Sharpness,
    Op::Posterize,
    Op::Solarize,
    Op::AutoContrast,
    Op::Equalize,
    Op::Invert,
];

/// Applies `op` with its signed `magnitude` (torchvision's `_apply_image_or_video_transform`
/// with nearest interpolation and fill 0).
pub fn apply_op(img: &RgbImage, op: Op, magnitude: f64) -> RgbImage {
    let (w, h) = img.dimensions();
    match op {
        Op::Identity => img.clone(),
        Op::ShearX => {
            let shear = [magnitude.atan().to_degrees(), 0.0];
            affine_nearest(img, inverse_affine([0.0, 0.0], 0.0, [0.0, 0.0], shear))
        }
        Op::ShearY => {
            let shear = [0.0, magnitude.atan().to_degrees()];
            affine_nearest(img, inverse_affine([0.0, 0.0], 0.0, [0.0, 0.0], shear))
        }
        Op::TranslateX | Op::TranslateY => {
            // Python's int(): toward zero.
            let t = magnitude.trunc();
            let translate = if op == Op::TranslateX {
                [t, 0.0]
            } else {
                [0.0, t]
            };
            let center = [f64::from(w) * 0.5, f64::from(h) * 0.5];
            affine_nearest(img, inverse_affine(center, 0.0, translate, [0.0, 0.0]))
        }
        Op::Rotate => rotate_nearest(img, magnitude),
        Op::Brightness => {
            let black = RgbImage::new(w, h);
            blend(&black, img, 1.0 + magnitude)
        }
        Op::Color => blend(&gray(img), img, 1.0 + magnitude),
        Op::Contrast => {
            let (sum, n) = img
                .pixels()
                .fold((0u64, 0u64), |(s, n), p| (s + u64::from(luma(p.0)), n + 1));
            let mean = (sum as f64 / n as f64 + 0.5) as u8;
            let degenerate = RgbImage::from_pixel(w, h, image::Rgb([mean; 3]));
            blend(&degenerate, img, 1.0 + magnitude)
        }
        Op::Sharpness => blend(&smooth(img), img, 1.0 + magnitude),
        Op::Posterize => {
            let bits = magnitude.trunc() as i32;
            let mask = !((1u32 << (8 - bits.clamp(0, 8))) - 1) as u8;
            map_lut(img, &std::array::from_fn::<u8, 256, _>(|i| i as u8 & mask))
        }
        Op::Solarize => {
            let threshold = 255.0 * magnitude;
            let lut = std::array::from_fn::<u8, 256, _>(|i| {
                if (i as f64) < threshold {
                    i as u8
                } else {
                    255 - i as u8
                }
            });
            map_lut(img, &lut)
        }
        Op::AutoContrast => per_channel_lut(img, autocontrast_lut),
        Op::Equalize => per_channel_lut(img, equalize_lut),
        Op::Invert => map_lut(img, &std::array::from_fn::<u8, 256, _>(|i| 255 - i as u8)),
    }
}

/// Pillow's RGB → L: `(19595 r + 38470 g + 7471 b + 0x8000) >> 16`.
fn luma([r, g, b]: [u8; 3]) -> u8 {
    ((u32::from(r) * 19595 + u32::from(g) * 38470 + u32::from(b) * 7471 + 0x8000) >> 16) as u8
}

fn gray(img: &RgbImage) -> RgbImage {
    let mut out = img.clone();
    for p in out.pixels_mut() {
        p.0 = [luma(p.0); 3];
    }
    out
}

/// Pillow's `Image.blend(a, b, alpha)`: `a + alpha·(b - a)` in `f32`, truncated; clipped when
/// `alpha` is outside `[0, 1]`.
fn blend(a: &RgbImage, b: &RgbImage, alpha: f64) -> RgbImage {
    let alpha = alpha as f32;
    let mut out = b.clone();
    let inside = (0.0..=1.0).contains(&alpha);
    for ((o, &x), &y) in out.iter_mut().zip(a.iter()).zip(b.iter()) {
        let v = f32::from(x) + alpha * (f32::from(y) - f32::from(x));
        *o = if inside {
            v as u8
        } else if v <= 0.0 {
            0
        } else if v >= 255.0 {
            255
        } else {
            v as u8
        };
    }
    out
}

/// Pillow's `ImageFilter.SMOOTH` (3×3 `[1 1 1; 1 5 1; 1 1 1] / 13`, `f32`, rounded by `+0.5`
/// then truncated); border pixels are copied.
fn smooth(img: &RgbImage) -> RgbImage {
    let (w, h) = (img.width() as usize, img.height() as usize);
    let mut out = img.clone();
    if w < 3 || h < 3 {
        return out;
    }
    let edge = (1.0f64 / 13.0) as f32;
    let centre = (5.0f64 / 13.0) as f32;
    let src = img.as_raw();
    let dst: &mut [u8] = &mut out;
    let at = |x: usize, y: usize, c: usize| f32::from(src[(y * w + x) * 3 + c]);
    for y in 1..h - 1 {
        for x in 1..w - 1 {
            for c in 0..3 {
                // Pillow's row order: the row below first, then this row, then the row above.
                let row = |yy: usize, k: [f32; 3]| {
                    at(x - 1, yy, c) * k[0] + at(x, yy, c) * k[1] + at(x + 1, yy, c) * k[2]
                };
                let mut ss = 0.5f32;
                ss += row(y + 1, [edge; 3]);
                ss += row(y, [edge, centre, edge]);
                ss += row(y - 1, [edge; 3]);
                dst[(y * w + x) * 3 + c] = if ss <= 0.0 {
                    0
                } else if ss >= 255.0 {
                    255
                } else {
                    ss as u8
                };
            }
        }
    }
    out
}

fn map_lut(img: &RgbImage, lut: &[u8; 256]) -> RgbImage {
    let mut out = img.clone();
    for v in out.iter_mut() {
        *v = lut[usize::from(*v)];
    }
    out
}

fn per_channel_lut(img: &RgbImage, make: fn(&[u64; 256]) -> [u8; 256]) -> RgbImage {
    let mut hist = [[0u64; 256]; 3];
    for p in img.pixels() {
        for c in 0..3 {
            hist[c][usize::from(p.0[c])] += 1;
        }
    }
    let luts = [make(&hist[0]), make(&hist[1]), make(&hist[2])];
    let mut out = img.clone();
    for p in out.pixels_mut() {
        for c in 0..3 {
            p.0[c] = luts[c][usize::from(p.0[c])];
        }
    }
    out
}

fn identity_lut() -> [u8; 256] {
    std::array::from_fn(|i| i as u8)
}

/// `ImageOps.autocontrast` (no cutoff): the lowest and highest used values go to 0 and 255.
fn autocontrast_lut(h: &[u64; 256]) -> [u8; 256] {
    let lo = h.iter().position(|&n| n > 0);
    let hi = h.iter().rposition(|&n| n > 0);
    match (lo, hi) {
        (Some(lo), Some(hi)) if hi > lo => {
            let scale = 255.0 / (hi - lo) as f64;
            let offset = -(lo as f64) * scale;
            std::array::from_fn(|i| (i as f64 * scale + offset).trunc().clamp(0.0, 255.0) as u8)
        }
        _ => identity_lut(),
    }
}

/// `ImageOps.equalize`, integer arithmetic as Pillow's.
fn equalize_lut(h: &[u64; 256]) -> [u8; 256] {
    let used: Vec<u64> = h.iter().copied().filter(|&n| n > 0).collect();
    if used.len() <= 1 {
        return identity_lut();
    }
    let step = (used.iter().sum::<u64>() - used[used.len() - 1]) / 255;
    if step == 0 {
        return identity_lut();
    }
    let mut n = step / 2;
    std::array::from_fn(|i| {
        let v = (n / step).min(255) as u8;
        n += h[i];
        v
    })
}

/// torchvision's `_get_inverse_affine_matrix` (scale 1): the output → input map of an affine
/// transform about `center`, as Pillow's `AFFINE` data.
fn inverse_affine(center: [f64; 2], angle: f64, translate: [f64; 2], shear: [f64; 2]) -> [f64; 6] {
    let rot = angle.to_radians();
    let (sx, sy) = (shear[0].to_radians(), shear[1].to_radians());
    let [cx, cy] = center;
    let [tx, ty] = translate;
    let a = (rot - sy).cos() / sy.cos();
    let b = -(rot - sy).cos() * sx.tan() / sy.cos() - rot.sin();
    let c = (rot - sy).sin() / sy.cos();
    let d = -(rot - sy).sin() * sx.tan() / sy.cos() + rot.cos();
    let mut m = [d, -b, 0.0, -c, a, 0.0];
    m[2] += m[0] * (-cx - tx) + m[1] * (-cy - ty);
    m[5] += m[3] * (-cx - tx) + m[4] * (-cy - ty);
    m[2] += cx;
    m[5] += cy;
    m
}

/// Python's `round(x, 15)`: the double nearest the decimal rounding.
fn round15(x: f64) -> f64 {
    format!("{x:.15}").parse().unwrap_or(x)
}

/// Pillow's `Image.rotate(angle, NEAREST)` without expand: exact transposes for 180° (and 90°
/// and 270° on square images), else the affine sampler about `(w/2, h/2)`.
fn rotate_nearest(img: &RgbImage, angle: f64) -> RgbImage {
    let angle = angle.rem_euclid(360.0);
    let (w, h) = img.dimensions();
    if angle == 0.0 {
        return img.clone();
    }
    if angle == 180.0 {
        return image::imageops::rotate180(img);
    }
    if w == h && angle == 90.0 {
        return image::imageops::rotate270(img);
    }
    if w == h && angle == 270.0 {
        return image::imageops::rotate90(img);
    }
    let (cx, cy) = (f64::from(w) / 2.0, f64::from(h) / 2.0);
    let a = -angle.to_radians();
    let mut m = [
        round15(a.cos()),
        round15(a.sin()),
        0.0,
        round15(-a.sin()),
        round15(a.cos()),
        0.0,
    ];
    // Pillow: `a·x + b·y + c` with c = 0, so adding to the zero is the same sum.
    m[2] += m[0] * -cx + m[1] * -cy;
    m[5] += m[3] * -cx + m[4] * -cy;
    m[2] += cx;
    m[5] += cy;
    affine_nearest(img, m)
}

/// Pillow's `ImagingTransformAffine` with nearest sampling and fill 0, same output size as the
/// input: see [`affine_nearest_to`].
fn affine_nearest(img: &RgbImage, a: [f64; 6]) -> RgbImage {
    affine_nearest_to(img, a, img.width(), img.height())
}

/// Pillow's `ImagingTransformAffine` with nearest sampling and fill 0, into a `w × h` output:
/// output pixel `(x, y)` reads input `floor(a·(x+½) + b·(y+½) + c, d·(x+½) + e·(y+½) + f)`, in
/// Pillow's three arithmetics (a pure scale, 16.16 fixed point, or `f64` steps) so that
/// boundaries fall alike. Pillow's `resize(.., NEAREST)` is the pure-scale case.
pub(crate) fn affine_nearest_to(img: &RgbImage, a: [f64; 6], w: u32, h: u32) -> RgbImage {
    let (wi, hi) = (i64::from(img.width()), i64::from(img.height()));
    let mut out = RgbImage::new(w, h);
    let coord = |v: f64| if v < 0.0 { -1 } else { v as i64 };
    if a[1] == 0.0 && a[3] == 0.0 {
        let mut xo = a[2] + a[0] * 0.5;
        let mut yo = a[5] + a[4] * 0.5;
        let mut xin = Vec::with_capacity(w as usize);
        for _ in 0..w {
            xin.push(coord(xo));
            xo += a[0];
        }
        for y in 0..h {
            let yi = coord(yo);
            if (0..hi).contains(&yi) {
                for (x, &xi) in xin.iter().enumerate() {
                    if (0..wi).contains(&xi) {
                        out.put_pixel(x as u32, y, *img.get_pixel(xi as u32, yi as u32));
                    }
                }
            }
            yo += a[4];
        }
        return out;
    }
    let fits = |x: f64, y: f64| {
        (x * a[0] + y * a[1] + a[2]).abs() < 32768.0 && (x * a[3] + y * a[4] + a[5]).abs() < 32768.0
    };
    let (wf, hf) = (f64::from(w), f64::from(h));
    if fits(0.0, 0.0) && fits(wf, hf) && fits(0.0, hf) && fits(wf, 0.0) {
        let fix = |v: f64| (v * 65536.0 + 0.5).floor() as i32;
        let (a0, a1, a3, a4) = (fix(a[0]), fix(a[1]), fix(a[3]), fix(a[4]));
        let mut a2 = fix(a[2] + a[0] * 0.5 + a[1] * 0.5);
        let mut a5 = fix(a[5] + a[3] * 0.5 + a[4] * 0.5);
        for y in 0..h {
            let (mut xx, mut yy) = (a2, a5);
            for x in 0..w {
                let (xi, yi) = (i64::from(xx >> 16), i64::from(yy >> 16));
                if (0..wi).contains(&xi) && (0..hi).contains(&yi) {
                    out.put_pixel(x, y, *img.get_pixel(xi as u32, yi as u32));
                }
                xx = xx.wrapping_add(a0);
                yy = yy.wrapping_add(a3);
            }
            a2 = a2.wrapping_add(a1);
            a5 = a5.wrapping_add(a4);
        }
        return out;
    }
    let mut xo = a[2] + a[1] * 0.5 + a[0] * 0.5;
    let mut yo = a[5] + a[4] * 0.5 + a[3] * 0.5;
    for y in 0..h {
        let (mut xx, mut yy) = (xo, yo);
        for x in 0..w {
            let (xi, yi) = (coord(xx), coord(yy));
            if (0..wi).contains(&xi) && (0..hi).contains(&yi) {
                out.put_pixel(x, y, *img.get_pixel(xi as u32, yi as u32));
            }
            xx += a[0];
            yy += a[3];
        }
        xo += a[1];
        yo += a[4];
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn equalize_lut_matches_pillow_by_hand() {
        // Two values, 3 and 1 pixels: step = (4 - 1) // 255 = 0 -> identity (Pillow's rule).
        let mut h = [0u64; 256];
        h[10] = 3;
        h[20] = 1;
        assert_eq!(equalize_lut(&h)[10], 10);
        // 600 pixels at 0, 400 at 255: step = 600 // 255 = 2; lut[255] = (1 + 600) // 2 = 300,
        // which Pillow's `point` clips to 255.
        let mut h = [0u64; 256];
        h[0] = 600;
        h[255] = 400;
        let lut = equalize_lut(&h);
        assert_eq!((lut[0], lut[255]), (0, 255));
    }

    #[test]
    fn translate_moves_by_whole_pixels_and_fills_zero() {
        let img = RgbImage::from_fn(4, 3, |x, y| image::Rgb([(10 * x + y) as u8 + 1, 0, 0]));
        let out = apply_op(&img, Op::TranslateX, 1.9);
        assert_eq!(out.get_pixel(0, 0).0[0], 0);
        assert_eq!(out.get_pixel(1, 2).0[0], img.get_pixel(0, 2).0[0]);
        assert_eq!(out.get_pixel(3, 1).0[0], img.get_pixel(2, 1).0[0]);
    }
}
