//! Pillow's convolution resampler (`Resample.c`), ported for the filters where
//! `fast_image_resize` drifts from it: bicubic overshoots, so the intermediate 8-bit rounding and
//! clipping of Pillow's two passes (horizontal first) decide values near edges, and only the same
//! pass order and fixed-point coefficients give Pillow's pixels.

use image::RgbImage;

use crate::transform::CropBox;

/// Fixed-point fraction bits of Pillow's 8-bit coefficients.
const PRECISION_BITS: u32 = 32 - 8 - 2;

/// A Pillow resampling filter: its support and kernel.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Filter {
    /// `BICUBIC`, Keys' cubic with `a = -0.5`, support 2.
    Bicubic,
}

impl Filter {
    fn support(self) -> f64 {
        match self {
            Filter::Bicubic => 2.0,
        }
    }

    fn eval(self, x: f64) -> f64 {
        match self {
            Filter::Bicubic => {
                let a = -0.5;
                let x = x.abs();
                if x < 1.0 {
                    ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
                } else if x < 2.0 {
                    (((x - 5.0) * x + 8.0) * x - 4.0) * a
                } else {
                    0.0
                }
            }
        }
    }
}

/// Pillow's `precompute_coeffs` + `normalize_coeffs_8bpc` for resizing `in_size` to `out_size`:
/// per output pixel, the first input pixel, the tap count, and `ksize` fixed-point weights.
fn coefficients(
    in_size: u32,
    out_size: u32,
    filter: Filter,
) -> (Vec<(usize, usize)>, Vec<i32>, usize) {
    let scale = f64::from(in_size) / f64::from(out_size);
    let filterscale = scale.max(1.0);
    let support = filter.support() * filterscale;
    let ksize = support.ceil() as usize * 2 + 1;
    let mut bounds = Vec::with_capacity(out_size as usize);
    let mut weights = vec![0i32; out_size as usize * ksize];
    let mut k = vec![0f64; ksize];
    for xx in 0..out_size as usize {
        let center = (xx as f64 + 0.5) * scale;
        let ss = 1.0 / filterscale;
        let xmin = ((center - support + 0.5) as i64).max(0) as usize;
        let xmax = ((center + support + 0.5) as i64).min(i64::from(in_size)) as usize - xmin;
        let mut ww = 0.0;
        for (x, kx) in k.iter_mut().enumerate().take(xmax) {
            let w = filter.eval((x as f64 + xmin as f64 - center + 0.5) * ss);
            *kx = w;
            ww += w;
        }
        for (x, kx) in k.iter().enumerate().take(xmax) {
            let v = if ww != 0.0 { kx / ww } else { *kx };
            let fixed = v * f64::from(1u32 << PRECISION_BITS);
            weights[xx * ksize + x] = if v < 0.0 {
                (-0.5 + fixed) as i32
            } else {
                (0.5 + fixed) as i32
            };
        }
        bounds.push((xmin, xmax));
    }
    (bounds, weights, ksize)
}

fn clip8(ss: i32) -> u8 {
    (ss >> PRECISION_BITS).clamp(0, 255) as u8
}

/// Pillow's `resize((w, h), filter)` of the `crop` of `src` (as torchvision's `crop` then
/// `resize`), evaluated only on the output `window`: the same values as resizing all of it then
/// cropping. Returns packed HWC RGB of `window.width × window.height`.
pub(crate) fn resize_window(
    src: &RgbImage,
    crop: CropBox,
    (out_w, out_h): (u32, u32),
    window: CropBox,
    filter: Filter,
) -> Vec<u8> {
    let (hb, hk, hsize) = coefficients(crop.width, out_w, filter);
    let (vb, vk, vsize) = coefficients(crop.height, out_h, filter);
    let cols = window.left as usize..(window.left + window.width) as usize;
    let rows = window.top as usize..(window.top + window.height) as usize;
    // Input rows (of the crop) the window's vertical taps read.
    let first = rows.clone().map(|y| vb[y].0).min().unwrap_or(0);
    let last = rows.clone().map(|y| vb[y].0 + vb[y].1).max().unwrap_or(0);
    let src_raw = src.as_raw();
    let stride = src.width() as usize * 3;
    let need_h = out_w != crop.width;
    let need_v = out_h != crop.height;
    let half = 1i32 << (PRECISION_BITS - 1);
    // Horizontal pass (Pillow's first), rounded and clipped to u8, on the rows needed.
    let ww = cols.len();
    let mut temp = vec![0u8; (last - first) * ww * 3];
    for y in first..last {
        let row = &src_raw[(crop.top as usize + y) * stride..];
        let out = &mut temp[(y - first) * ww * 3..(y - first + 1) * ww * 3];
        for (o, xx) in cols.clone().enumerate() {
            if !need_h {
                let at = (crop.left as usize + xx) * 3;
                out[o * 3..o * 3 + 3].copy_from_slice(&row[at..at + 3]);
                continue;
            }
            let (xmin, n) = hb[xx];
            let k = &hk[xx * hsize..xx * hsize + n];
            let mut ss = [half; 3];
            for (x, &kx) in k.iter().enumerate() {
                let at = (crop.left as usize + xmin + x) * 3;
                for c in 0..3 {
                    ss[c] += i32::from(row[at + c]) * kx;
                }
            }
            for c in 0..3 {
                out[o * 3 + c] = clip8(ss[c]);
            }
        }
    }
    // Vertical pass.
    let mut out = vec![0u8; window.height as usize * ww * 3];
    for (oy, yy) in rows.enumerate() {
        let dst = &mut out[oy * ww * 3..(oy + 1) * ww * 3];
        if !need_v {
            let src_row = &temp[(yy - first) * ww * 3..(yy - first + 1) * ww * 3];
            dst.copy_from_slice(src_row);
            continue;
        }
        let (ymin, n) = vb[yy];
        let k = &vk[yy * vsize..yy * vsize + n];
        for (i, d) in dst.iter_mut().enumerate() {
            let mut ss = half;
            for (y, &ky) in k.iter().enumerate() {
                ss += i32::from(temp[(ymin + y - first) * ww * 3 + i]) * ky;
            }
            *d = clip8(ss);
        }
    }
    out
}
