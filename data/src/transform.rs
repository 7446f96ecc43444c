//! torchvision-compatible transforms: `RandomResizedCrop`, `RandomHorizontalFlip`, the
//! automatic augmentations, `RandomErasing`'s box, `Resize` + `CenterCrop`, normalisation,
//! HWC → CHW; bilinear, bicubic or nearest as PIL resamples.

use std::cell::RefCell;

use fast_image_resize as fr;
use image::RgbImage;
use rand::{Rng, RngExt};

use crate::augment::{AutoAugment, affine_nearest_to};
use crate::decode::{DecodePlan, ScaledImage};
use crate::erase::RandomErasing;
use crate::pil_resample::{self, Filter};
use crate::scale::DecodeScaling;

/// ImageNet per-channel mean (RGB), as in torchvision's references.
pub const IMAGENET_MEAN: [f32; 3] = [0.485, 0.456, 0.406];
/// ImageNet per-channel standard deviation (RGB).
pub const IMAGENET_STD: [f32; 3] = [0.229, 0.224, 0.225];

/// A crop rectangle in pixels (torchvision's `(i, j, h, w)`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropBox {
    /// First row (`i`).
    pub top: u32,
    /// First column (`j`).
    pub left: u32,
    /// Rows (`h`).
    pub height: u32,
    /// Columns (`w`).
    pub width: u32,
}

/// The pixels a transform reads: an image decoded at `1/scale` of `full_size`.
#[derive(Clone, Copy)]
struct Source<'a> {
    image: &'a RgbImage,
    scale: u32,
    full_size: (u32, u32),
}

impl Source<'_> {
    /// The whole image's width and height in `image`'s pixels (`full_size / scale`, fractional
    /// where a scaled side was rounded up).
    fn extent(&self) -> (f64, f64) {
        let s = f64::from(self.scale);
        (
            f64::from(self.full_size.0) / s,
            f64::from(self.full_size.1) / s,
        )
    }
}

impl<'a> From<&'a ScaledImage> for Source<'a> {
    fn from(img: &'a ScaledImage) -> Self {
        Source {
            image: &img.image,
            scale: img.scale,
            full_size: img.full_size,
        }
    }
}

/// Python's `round()`: half to even.
fn py_round(x: f64) -> f64 {
    x.round_ties_even()
}

/// torchvision's `RandomResizedCrop.get_params`, ported line by line: up to 10 tries of an area
/// fraction uniform in `scale` and an aspect ratio log-uniform in `ratio`
/// (`w = round(sqrt(area·r))`, `h = round(sqrt(area/r))`, Python rounding), accepted when it fits;
/// then the center-crop fallback that clamps the aspect ratio to `ratio`.
///
/// # Panics
/// If `width` or `height` is zero.
pub fn random_resized_crop_params<R: Rng + ?Sized>(
    rng: &mut R,
    width: u32,
    height: u32,
    scale: (f64, f64),
    ratio: (f64, f64),
) -> CropBox {
    assert!(width > 0 && height > 0, "image has zero size");
    let area = f64::from(height) * f64::from(width);
    let (log_lo, log_hi) = (ratio.0.ln(), ratio.1.ln());
    for _ in 0..10 {
        let target_area = area * uniform(rng, scale.0, scale.1);
        let aspect_ratio = uniform(rng, log_lo, log_hi).exp();
        let w = py_round((target_area * aspect_ratio).sqrt());
        let h = py_round((target_area / aspect_ratio).sqrt());
        if w > 0.0 && w <= f64::from(width) && h > 0.0 && h <= f64::from(height) {
            let (w, h) = (w as u32, h as u32);
            let top = rng.random_range(0..=height - h);
            let left = rng.random_range(0..=width - w);
            return CropBox {
                top,
                left,
                height: h,
                width: w,
            };
        }
    }
    let in_ratio = f64::from(width) / f64::from(height);
    let (min_r, max_r) = (ratio.0.min(ratio.1), ratio.0.max(ratio.1));
    let (w, h) = if in_ratio < min_r {
        (
            width,
            (py_round(f64::from(width) / min_r) as u32).clamp(1, height),
        )
    } else if in_ratio > max_r {
        (
            (py_round(f64::from(height) * max_r) as u32).clamp(1, width),
            height,
        )
    } else {
        (width, height)
    };
    CropBox {
        top: (height - h) / 2,
        left: (width - w) / 2,
        height: h,
        width: w,
    }
}

/// `torch.empty(1).uniform_(lo, hi)`.
fn uniform<R: Rng + ?Sized>(rng: &mut R, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

/// torchvision's `Resize(size)` with an int: the shorter side becomes `size`, the longer one
/// `int(size * long / short)` (truncated). Returns `(width, height)`.
pub fn resize_shorter_side(width: u32, height: u32, size: u32) -> (u32, u32) {
    let (short, long) = if width <= height {
        (width, height)
    } else {
        (height, width)
    };
    let new_long = (u64::from(size) * u64::from(long) / u64::from(short.max(1))) as u32;
    if width <= height {
        (size, new_long)
    } else {
        (new_long, size)
    }
}

/// torchvision's `CenterCrop` box: `top = round((H - h) / 2)`, `left = round((W - w) / 2)` with
/// Python rounding. Requires the crop to fit (`Resize` guarantees it in the validation pipeline).
/// Returns `None` when it does not fit.
pub fn center_crop_box(width: u32, height: u32, crop_w: u32, crop_h: u32) -> Option<CropBox> {
    if crop_w > width || crop_h > height {
        return None;
    }
    Some(CropBox {
        top: py_round(f64::from(height - crop_h) / 2.0) as u32,
        left: py_round(f64::from(width - crop_w) / 2.0) as u32,
        height: crop_h,
        width: crop_w,
    })
}

/// Which bilinear (antialiased, PIL-style) resizer to use. Both give PIL's `BILINEAR` result up
/// to rounding; `FastImageResize` is SIMD and measured faster (see `benches/src/bin/data.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Resampler {
    /// `fast_image_resize` convolution with the bilinear filter (AVX2/SSE4.1/NEON).
    #[default]
    FastImageResize,
    /// `image::imageops::resize` with `FilterType::Triangle`.
    Image,
}

/// How resizes sample (torchvision's `interpolation`, on PIL images): `Bilinear` and `Bicubic`
/// are PIL's antialiased filters (bicubic with `a = -0.5`), `Nearest` is PIL's nearest.
/// Bilinear runs on [`Resampler`]'s choice; bicubic and nearest on ports of Pillow's own code
/// (both resamplers drift from Pillow's bicubic by up to 10 levels at sharp edges, where
/// Pillow's 8-bit intermediate rounding between its two passes clips the overshoot).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Interpolation {
    /// PIL `BILINEAR` (torchvision's default).
    #[default]
    Bilinear,
    /// PIL `BICUBIC`.
    Bicubic,
    /// PIL `NEAREST`.
    Nearest,
}

impl Interpolation {
    pub(crate) fn fir_filter(self) -> fr::FilterType {
        match self {
            Interpolation::Bicubic => fr::FilterType::CatmullRom,
            _ => fr::FilterType::Bilinear,
        }
    }

    fn image_filter(self) -> image::imageops::FilterType {
        match self {
            Interpolation::Bicubic => image::imageops::FilterType::CatmullRom,
            _ => image::imageops::FilterType::Triangle,
        }
    }
}

/// PIL's `resize(.., NEAREST)` of the `crop` of `src` to `out_w × out_h` (the source pixel of
/// output `x` is `floor((x + ½) · crop_w / out_w)`, accumulated in `f64` as Pillow does).
fn nearest_resized_crop(src: &RgbImage, crop: CropBox, out_w: u32, out_h: u32) -> Vec<u8> {
    let a = [
        f64::from(crop.width) / f64::from(out_w),
        0.0,
        0.0,
        0.0,
        f64::from(crop.height) / f64::from(out_h),
        0.0,
    ];
    let sub =
        image::imageops::crop_imm(src, crop.left, crop.top, crop.width, crop.height).to_image();
    affine_nearest_to(&sub, a, out_w, out_h).into_raw()
}

thread_local! {
    static RESIZER: RefCell<fr::Resizer> = RefCell::new(fr::Resizer::new());
}

/// Runs `f` with this thread's resizer (its buffers are reused from call to call).
pub(crate) fn with_resizer<T>(f: impl FnOnce(&mut fr::Resizer) -> T) -> T {
    RESIZER.with(|r| f(&mut r.borrow_mut()))
}

/// Crops `crop` out of `src` and resizes it to `out_w × out_h` with `interpolation`, as PIL's
/// `crop` + `resize` used by torchvision on PIL images. Returns packed HWC RGB.
///
/// # Panics
/// If `crop` does not lie inside `src` or an output side is zero.
pub fn resized_crop(
    src: &RgbImage,
    crop: CropBox,
    (out_w, out_h): (u32, u32),
    interpolation: Interpolation,
    resampler: Resampler,
) -> Vec<u8> {
    assert!(
        crop.left + crop.width <= src.width() && crop.top + crop.height <= src.height(),
        "crop box {crop:?} outside a {}x{} image",
        src.width(),
        src.height()
    );
    match interpolation {
        Interpolation::Nearest => return nearest_resized_crop(src, crop, out_w, out_h),
        Interpolation::Bicubic => {
            let window = CropBox {
                top: 0,
                left: 0,
                height: out_h,
                width: out_w,
            };
            return pil_resample::resize_window(src, crop, (out_w, out_h), window, Filter::Bicubic);
        }
        Interpolation::Bilinear => {}
    }
    match resampler {
        Resampler::FastImageResize => {
            let fir_src = fr::images::ImageRef::new(
                src.width(),
                src.height(),
                src.as_raw(),
                fr::PixelType::U8x3,
            )
            .expect("an RgbImage buffer always matches its size");
            let view = fr::images::CroppedImage::new(
                &fir_src,
                crop.left,
                crop.top,
                crop.width,
                crop.height,
            )
            .expect("crop checked above");
            let mut dst = fr::images::Image::new(out_w, out_h, fr::PixelType::U8x3);
            let options = fr::ResizeOptions::new()
                .resize_alg(fr::ResizeAlg::Convolution(interpolation.fir_filter()));
            with_resizer(|r| {
                r.resize(&view, &mut dst, &options)
                    .expect("pixel types match and sizes are non-zero")
            });
            dst.into_vec()
        }
        Resampler::Image => {
            let sub = image::imageops::crop_imm(src, crop.left, crop.top, crop.width, crop.height)
                .to_image();
            if sub.width() == out_w && sub.height() == out_h {
                return sub.into_raw();
            }
            image::imageops::resize(&sub, out_w, out_h, interpolation.image_filter()).into_raw()
        }
    }
}

/// Writes packed HWC RGB (`width × height`) as planar CHW into `out`, mirroring columns if `flip`.
///
/// # Panics
/// If the buffers' lengths are not `3 × width × height`.
pub fn hwc_to_chw(hwc: &[u8], width: usize, height: usize, flip: bool, out: &mut [u8]) {
    let plane = width * height;
    assert_eq!(hwc.len(), 3 * plane, "HWC buffer size");
    assert_eq!(out.len(), 3 * plane, "CHW buffer size");
    if plane == 0 {
        return;
    }
    let (r, rest) = out.split_at_mut(plane);
    let (g, b) = rest.split_at_mut(plane);
    #[cfg(target_arch = "x86_64")]
    if std::is_x86_feature_detected!("avx2") {
        // SAFETY: the CPU has AVX2.
        unsafe { planes_from_pixels_avx2(hwc, width, flip, [r, g, b]) };
        return;
    }
    planes_from_pixels(hwc, width, flip, [r, g, b]);
}

/// [`planes_from_pixels`] compiled for AVX2, where the compiler turns the loop's stride-3 loads
/// into byte shuffles, 32 pixels at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
fn planes_from_pixels_avx2(hwc: &[u8], width: usize, flip: bool, planes: [&mut [u8]; 3]) {
    planes_from_pixels(hwc, width, flip, planes);
}

#[inline(always)]
fn planes_from_pixels(hwc: &[u8], width: usize, flip: bool, [r, g, b]: [&mut [u8]; 3]) {
    // Row by row over zipped slices, the flip outside the loop: no index arithmetic or bounds
    // checks per pixel (this runs over every output pixel of every sample).
    let rows = hwc
        .chunks_exact(3 * width)
        .zip(r.chunks_exact_mut(width))
        .zip(g.chunks_exact_mut(width))
        .zip(b.chunks_exact_mut(width));
    for (((row, r), g), b) in rows {
        let pixels = row.chunks_exact(3);
        let out = r.iter_mut().zip(g.iter_mut()).zip(b.iter_mut());
        if flip {
            for (px, ((r, g), b)) in pixels.rev().zip(out) {
                (*r, *g, *b) = (px[0], px[1], px[2]);
            }
        } else {
            for (px, ((r, g), b)) in pixels.zip(out) {
                (*r, *g, *b) = (px[0], px[1], px[2]);
            }
        }
    }
}

/// Normalises a CHW u8 buffer: `(x / 255 - mean[c]) / std[c]`, as `ToTensor` + `Normalize`.
///
/// # Panics
/// If `chw.len()` is not a multiple of 3 or `out` has a different length.
pub fn normalize_chw(chw: &[u8], out: &mut [f32]) {
    assert_eq!(chw.len(), out.len(), "buffer sizes");
    assert_eq!(chw.len() % 3, 0, "CHW buffer size");
    let plane = chw.len() / 3;
    for c in 0..3 {
        let (m, s) = (IMAGENET_MEAN[c], IMAGENET_STD[c]);
        for (o, &x) in out[c * plane..(c + 1) * plane]
            .iter_mut()
            .zip(&chw[c * plane..(c + 1) * plane])
        {
            *o = (f32::from(x) / 255.0 - m) / s;
        }
    }
}

/// A per-sample transform pipeline producing a square `size × size` CHW image.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Transform {
    /// `RandomResizedCrop(size, scale, ratio, interpolation)`, `RandomHorizontalFlip(flip_prob)`,
    /// then the automatic augmentation if any; `RandomErasing` (drawn last) is returned as a box
    /// to zero after normalisation.
    Train {
        /// Output side in pixels (`--train-crop-size`).
        size: u32,
        /// Area fraction range (torchvision default `(0.08, 1.0)`).
        scale: (f64, f64),
        /// Aspect ratio range (torchvision default `(3/4, 4/3)`).
        ratio: (f64, f64),
        /// Probability of a horizontal flip (0.5).
        flip_prob: f64,
        /// Resize filter of the crop.
        interpolation: Interpolation,
        /// `TrivialAugmentWide`, `RandAugment` or `AutoAugment`, after the flip.
        auto_augment: Option<AutoAugment>,
        /// `RandomErasing(p)`; `None` draws nothing (torchvision leaves it out at `p = 0`).
        random_erase: Option<RandomErasing>,
    },
    /// `Resize(resize)` of the shorter side then `CenterCrop(size)`.
    Val {
        /// Shorter side after resizing (`--val-resize-size`, 256 for 224).
        resize: u32,
        /// Output side in pixels (`--val-crop-size`).
        size: u32,
        /// Resize filter.
        interpolation: Interpolation,
    },
}

impl Transform {
    /// The ImageNet training transform at `size` (224 in the references): bilinear, no
    /// automatic augmentation, no erasing.
    pub fn train(size: u32) -> Self {
        Self::Train {
            size,
            scale: (0.08, 1.0),
            ratio: (3.0 / 4.0, 4.0 / 3.0),
            flip_prob: 0.5,
            interpolation: Interpolation::Bilinear,
            auto_augment: None,
            random_erase: None,
        }
    }

    /// The ImageNet validation transform at `size`: resize the shorter side to
    /// `round(size · 256 / 224)` (256 for 224) then center-crop `size`, bilinear.
    pub fn val(size: u32) -> Self {
        Self::val_sizes((f64::from(size) * 256.0 / 224.0).round() as u32, size)
    }

    /// The validation transform with torchvision's separate sizes: `Resize(resize)` then
    /// `CenterCrop(crop)` (e.g. 232 and 224 for the V2 weights), bilinear.
    pub fn val_sizes(resize: u32, crop: u32) -> Self {
        Self::Val {
            resize,
            size: crop,
            interpolation: Interpolation::Bilinear,
        }
    }

    /// Sets the resize filter.
    pub fn with_interpolation(mut self, filter: Interpolation) -> Self {
        match &mut self {
            Self::Train { interpolation, .. } | Self::Val { interpolation, .. } => {
                *interpolation = filter
            }
        }
        self
    }

    /// Sets the automatic augmentation (training only; the validation transform ignores it).
    pub fn with_auto_augment(mut self, policy: Option<AutoAugment>) -> Self {
        if let Self::Train { auto_augment, .. } = &mut self {
            *auto_augment = policy;
        }
        self
    }

    /// Sets `RandomErasing` with probability `p` (`p = 0` removes it); training only.
    pub fn with_random_erase(mut self, p: f64) -> Self {
        if let Self::Train { random_erase, .. } = &mut self {
            *random_erase = (p > 0.0).then(|| RandomErasing::new(p));
        }
        self
    }

    /// Output side in pixels.
    pub fn size(&self) -> u32 {
        match *self {
            Self::Train { size, .. } | Self::Val { size, .. } => size,
        }
    }

    /// Applies the transform, writing `3 × size × size` CHW bytes into `out`. The random draws
    /// (crop, flip, automatic augmentation, erasing) come from `rng` in that order; the
    /// validation transform draws nothing. Returns the box `RandomErasing` drew, which the
    /// caller zeroes after normalisation (see [`Batch::erase`](crate::Batch::erase)).
    ///
    /// # Panics
    /// If `out` has the wrong length or the image has a zero side.
    pub fn apply_into<R: Rng + ?Sized>(
        &self,
        img: &RgbImage,
        rng: &mut R,
        resampler: Resampler,
        out: &mut [u8],
    ) -> Option<CropBox> {
        let crop = self.draw_crop(img.width(), img.height(), rng);
        self.apply_drawn(img, crop, rng, resampler, out)
    }

    /// The transform's first draw: the box `RandomResizedCrop` keeps of a `width × height`
    /// image (`None` for validation, which draws nothing). Drawn from the header's size, it
    /// tells [`Self::pixels_read`] which pixels the decoder must decode
    /// ([`decode_file_region`](crate::decode_file_region)).
    pub fn draw_crop<R: Rng + ?Sized>(
        &self,
        width: u32,
        height: u32,
        rng: &mut R,
    ) -> Option<CropBox> {
        match *self {
            Self::Train { scale, ratio, .. } => {
                Some(random_resized_crop_params(rng, width, height, scale, ratio))
            }
            Self::Val { .. } => None,
        }
    }

    /// The part of a `width × height` image that [`Self::apply_drawn`] reads, given the `crop`
    /// [`Self::draw_crop`] drew, so that the decoder can skip the rest
    /// ([`decode_file_region`](crate::decode_file_region)); `None` when it reads everything.
    ///
    /// Training reads its crop. Validation with a center crop reads the crop's preimage plus the
    /// resize filter's support, and a few pixels more, since a resize reads past the window it
    /// computes. Nearest, `Resampler::Image` and a crop larger than the image resize the whole
    /// image.
    pub fn pixels_read(
        &self,
        width: u32,
        height: u32,
        crop: Option<CropBox>,
        resampler: Resampler,
    ) -> Option<CropBox> {
        self.pixels_read_at(width, height, crop, resampler, 1)
    }

    /// [`Self::pixels_read`] of the image decoded at `1/scale`, in that decode's pixels.
    fn pixels_read_at(
        &self,
        width: u32,
        height: u32,
        crop: Option<CropBox>,
        resampler: Resampler,
        scale: u32,
    ) -> Option<CropBox> {
        let scaled = (width.div_ceil(scale), height.div_ceil(scale));
        match *self {
            Self::Train { .. } => crop.map(|c| crate::scale::scaled_box(c, scale, scaled)),
            Self::Val {
                resize,
                size,
                interpolation,
            } => {
                let support = match (resampler, interpolation) {
                    (_, Interpolation::Bicubic) => 2.0,
                    (Resampler::FastImageResize, Interpolation::Bilinear) => 1.0,
                    _ => return None,
                };
                let (w, h) = resize_shorter_side(width, height, resize);
                let window = center_crop_box(w, h, size, size)?;
                // Source span of output pixels `start..start + len` of `out` resized from `inp`:
                // the window's preimage widened by the filter's support at this scale, plus two
                // pixels for the rounding of the taps' bounds.
                // `inp` is the source's extent in the decoded image's pixels, `limit` its size.
                let span = |start: u32, len: u32, out: u32, inp: f64, limit: u32| {
                    let scale = inp / f64::from(out);
                    let margin = (support * scale.max(1.0)).ceil() + 2.0;
                    let lo = (f64::from(start) * scale - margin).floor().max(0.0) as u32;
                    let hi = (f64::from(start + len) * scale + margin)
                        .ceil()
                        .min(f64::from(limit)) as u32;
                    (lo, hi - lo)
                };
                let s = f64::from(scale);
                let (left, cols) =
                    span(window.left, window.width, w, f64::from(width) / s, scaled.0);
                let (top, rows) = span(
                    window.top,
                    window.height,
                    h,
                    f64::from(height) / s,
                    scaled.1,
                );
                Some(CropBox {
                    top,
                    left,
                    height: rows,
                    width: cols,
                })
            }
        }
    }

    /// What to decode of a `width × height` image given the `crop` [`Self::draw_crop`] drew:
    /// the largest of the file's `scales` `scaling` allows (see [`DecodeScaling`]) and the
    /// pixels [`Self::apply_scaled`] reads at that scale. Only bilinear resizing on
    /// [`Resampler::FastImageResize`] reads scaled decodes; everything else decodes at full size.
    pub fn plan(
        &self,
        width: u32,
        height: u32,
        crop: Option<CropBox>,
        resampler: Resampler,
        scaling: DecodeScaling,
        scales: &[u32],
    ) -> DecodePlan {
        let scale = match (*self, resampler) {
            (
                Self::Train {
                    size,
                    interpolation: Interpolation::Bilinear,
                    ..
                },
                Resampler::FastImageResize,
            ) => crop.map_or(1, |c| {
                scaling.choose(
                    (f64::from(c.width), f64::from(c.height)),
                    (size, size),
                    scales,
                )
            }),
            (
                Self::Val {
                    resize,
                    size,
                    interpolation: Interpolation::Bilinear,
                },
                Resampler::FastImageResize,
            ) => {
                let (w, h) = resize_shorter_side(width, height, resize);
                // A crop larger than the resized image pads it, from the whole image.
                match center_crop_box(w, h, size, size) {
                    Some(_) => {
                        scaling.choose((f64::from(width), f64::from(height)), (w, h), scales)
                    }
                    None => 1,
                }
            }
            _ => 1,
        };
        DecodePlan {
            scale,
            region: self.pixels_read_at(width, height, crop, resampler, scale),
        }
    }

    /// [`Self::apply_drawn`] on an image decoded as [`Self::plan`] said, at any scale.
    ///
    /// # Panics
    /// As [`Self::apply_drawn`], and for a scaled image with a resize other than bilinear on
    /// [`Resampler::FastImageResize`].
    pub fn apply_scaled<R: Rng + ?Sized>(
        &self,
        img: &ScaledImage,
        crop: Option<CropBox>,
        rng: &mut R,
        resampler: Resampler,
        out: &mut [u8],
    ) -> Option<CropBox> {
        self.apply_source(Source::from(img), crop, rng, resampler, out)
    }

    /// [`Self::apply_into`] after [`Self::draw_crop`] drew `crop` from the same `rng`: the
    /// remaining draws and the pixels. `img` needs to be exact only inside `crop`.
    ///
    /// # Panics
    /// As [`Self::apply_into`], and if the training transform gets no crop.
    pub fn apply_drawn<R: Rng + ?Sized>(
        &self,
        img: &RgbImage,
        crop: Option<CropBox>,
        rng: &mut R,
        resampler: Resampler,
        out: &mut [u8],
    ) -> Option<CropBox> {
        let source = Source {
            image: img,
            scale: 1,
            full_size: img.dimensions(),
        };
        self.apply_source(source, crop, rng, resampler, out)
    }

    fn apply_source<R: Rng + ?Sized>(
        &self,
        source: Source<'_>,
        crop: Option<CropBox>,
        rng: &mut R,
        resampler: Resampler,
        out: &mut [u8],
    ) -> Option<CropBox> {
        let img = source.image;
        let scaled = source.scale > 1;
        assert!(
            !scaled || resampler == Resampler::FastImageResize,
            "a scaled decode is read by fast_image_resize only"
        );
        match *self {
            Self::Train {
                size,
                flip_prob,
                interpolation,
                auto_augment,
                random_erase,
                ..
            } => {
                let crop = crop.expect("the training transform's crop is drawn first");
                let flip = rng.random::<f64>() < flip_prob;
                let hwc = if scaled {
                    crate::scale::resized_crop(img, source.scale, crop, (size, size), interpolation)
                } else {
                    resized_crop(img, crop, (size, size), interpolation, resampler)
                };
                let s = size as usize;
                match auto_augment {
                    Some(policy) => {
                        let mut crop_img = RgbImage::from_raw(size, size, hwc)
                            .expect("resized_crop returns size x size RGB");
                        if flip {
                            image::imageops::flip_horizontal_in_place(&mut crop_img);
                        }
                        let augmented = policy.apply(crop_img, rng);
                        hwc_to_chw(augmented.as_raw(), s, s, false, out);
                    }
                    None => hwc_to_chw(&hwc, s, s, flip, out),
                }
                random_erase.and_then(|e| e.draw(rng, size, size))
            }
            Self::Val {
                resize,
                size,
                interpolation,
            } => {
                let (w, h) = resize_shorter_side(source.full_size.0, source.full_size.1, resize);
                let s = size as usize;
                let crop = center_crop_box(w, h, size, size);
                assert!(
                    !scaled || (crop.is_some() && interpolation == Interpolation::Bilinear),
                    "a scaled decode is planned only for a bilinear resize that is then cropped"
                );
                match (crop, resampler, interpolation) {
                    (Some(c), _, Interpolation::Bicubic) => {
                        let full = CropBox {
                            top: 0,
                            left: 0,
                            height: img.height(),
                            width: img.width(),
                        };
                        let hwc =
                            pil_resample::resize_window(img, full, (w, h), c, Filter::Bicubic);
                        hwc_to_chw(&hwc, s, s, false, out);
                    }
                    (Some(c), Resampler::FastImageResize, Interpolation::Bilinear) => {
                        // Resize only the output window: the same kernels as resizing the whole
                        // image to w x h then cropping (fast_image_resize's crop box keeps
                        // the pixels outside the box in the filter support).
                        let hwc = fir_resize_window(img, source.extent(), (w, h), c, interpolation);
                        hwc_to_chw(&hwc, s, s, false, out);
                    }
                    (crop, _, _) => {
                        let full = CropBox {
                            top: 0,
                            left: 0,
                            height: img.height(),
                            width: img.width(),
                        };
                        let resized = resized_crop(img, full, (w, h), interpolation, resampler);
                        let hwc = center_crop_or_pad(&resized, (w as usize, h as usize), s, crop);
                        hwc_to_chw(&hwc, s, s, false, out);
                    }
                }
                None
            }
        }
    }
}

/// The `window` of `src` resized (as a whole) to `resized = (w, h)`, computed without resizing
/// the rest. `extent` is the source's size in `src`'s pixels: its size, or less for a scaled
/// decode rounded up to whole pixels. Returns packed HWC RGB of `window.width × window.height`.
fn fir_resize_window(
    src: &RgbImage,
    extent: (f64, f64),
    resized: (u32, u32),
    window: CropBox,
    interpolation: Interpolation,
) -> Vec<u8> {
    let fir_src =
        fr::images::ImageRef::new(src.width(), src.height(), src.as_raw(), fr::PixelType::U8x3)
            .expect("an RgbImage buffer always matches its size");
    let sx = extent.0 / f64::from(resized.0);
    let sy = extent.1 / f64::from(resized.1);
    let mut dst = fr::images::Image::new(window.width, window.height, fr::PixelType::U8x3);
    let options = fr::ResizeOptions::new()
        .resize_alg(fr::ResizeAlg::Convolution(interpolation.fir_filter()))
        .crop(
            f64::from(window.left) * sx,
            f64::from(window.top) * sy,
            f64::from(window.width) * sx,
            f64::from(window.height) * sy,
        );
    with_resizer(|r| {
        r.resize(&fir_src, &mut dst, &options)
            .expect("pixel types match and sizes are non-zero")
    });
    dst.into_vec()
}

/// torchvision's `CenterCrop(s)` of a packed HWC image of `(w, h)`: the `crop` box when it fits,
/// else zero padding around the image.
fn center_crop_or_pad(
    hwc: &[u8],
    (w, h): (usize, usize),
    s: usize,
    crop: Option<CropBox>,
) -> Vec<u8> {
    let mut out = vec![0u8; 3 * s * s];
    if let Some(c) = crop {
        for y in 0..s {
            let src = ((c.top as usize + y) * w + c.left as usize) * 3;
            out[y * s * 3..(y + 1) * s * 3].copy_from_slice(&hwc[src..src + s * 3]);
        }
        return out;
    }
    let (oy, ox) = (s.saturating_sub(h) / 2, s.saturating_sub(w) / 2);
    let (sy, sx) = (h.saturating_sub(s) / 2, w.saturating_sub(s) / 2);
    let n = w.min(s) * 3;
    for y in 0..h.min(s) {
        let src = ((sy + y) * w + sx) * 3;
        let dst = ((oy + y) * s + ox) * 3;
        out[dst..dst + n].copy_from_slice(&hwc[src..src + n]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand_chacha::ChaCha8Rng;

    #[test]
    fn resize_shorter_side_matches_torchvision() {
        // torchvision: Resize(256) of 500x375 (w x h) -> h=256, w=int(256*500/375)=341.
        assert_eq!(resize_shorter_side(500, 375, 256), (341, 256));
        assert_eq!(resize_shorter_side(375, 500, 256), (256, 341));
        assert_eq!(resize_shorter_side(300, 300, 256), (256, 256));
    }

    #[test]
    fn center_crop_matches_hand_computed_box() {
        // (341-224)/2 = 58.5 -> round half to even = 58; (256-224)/2 = 16.
        assert_eq!(
            center_crop_box(341, 256, 224, 224),
            Some(CropBox {
                top: 16,
                left: 58,
                height: 224,
                width: 224
            })
        );
        // (343-224)/2 = 59.5 -> 60.
        assert_eq!(
            center_crop_box(343, 256, 224, 224).map(|c| c.left),
            Some(60)
        );
        assert_eq!(center_crop_box(100, 100, 224, 224), None);
    }

    #[test]
    fn random_resized_crop_fallback_clamps_ratio() {
        // A very wide image: every try fails when the scale forces the whole area, then the
        // fallback keeps the full height and width = round(h * 4/3).
        let mut rng = ChaCha8Rng::seed_from_u64(1);
        let c = random_resized_crop_params(&mut rng, 1000, 10, (1.0, 1.0), (0.75, 4.0 / 3.0));
        assert_eq!((c.height, c.width), (10, 13));
        assert_eq!((c.top, c.left), (0, (1000 - 13) / 2));
    }

    #[test]
    fn normalize_matches_formula() {
        let chw = [0u8, 255, 128];
        let mut out = [0f32; 3];
        normalize_chw(&chw, &mut out);
        for c in 0..3 {
            let want = (f32::from(chw[c]) / 255.0 - IMAGENET_MEAN[c]) / IMAGENET_STD[c];
            assert!((out[c] - want).abs() < 1e-6);
        }
    }

    #[test]
    fn flip_mirrors_columns() {
        // 2x1 image: red, blue.
        let hwc = [255u8, 0, 0, 0, 0, 255];
        let mut out = [0u8; 6];
        hwc_to_chw(&hwc, 2, 1, true, &mut out);
        assert_eq!(out, [0, 255, 0, 0, 255, 0]);
    }

    #[test]
    fn planes_match_a_per_pixel_copy_at_widths_the_vector_loop_splits() {
        // The AVX2 build of the loop takes 32 pixels at a time: widths below, at and around it
        // run its body and its scalar tail, rows one after another.
        for (width, height) in [(1, 3), (31, 2), (32, 2), (33, 3), (67, 5), (224, 4)] {
            let hwc: Vec<u8> = (0..3 * width * height)
                .map(|i| (i * 7 + i / 5) as u8)
                .collect();
            for flip in [false, true] {
                let mut out = vec![0u8; hwc.len()];
                hwc_to_chw(&hwc, width, height, flip, &mut out);
                let plane = width * height;
                for y in 0..height {
                    for x in 0..width {
                        let src = if flip { width - 1 - x } else { x };
                        for c in 0..3 {
                            assert_eq!(
                                out[c * plane + y * width + x],
                                hwc[(y * width + src) * 3 + c],
                                "{width}x{height} flip {flip}: channel {c} at ({x}, {y})"
                            );
                        }
                    }
                }
            }
        }
    }
}
