//! DCT-domain downscaling in the pipelines: which scale a sample may be decoded at, and the
//! resizes that read a scaled decode. The decoder side is the vendored zune-jpeg's `set_scale`.
//!
//! A decode at `1/s` is the full decode averaged over `s × s` pixels (within a level or so, as
//! libjpeg-turbo's scaled decode). Resizing that instead of the full image changes the output
//! only a little when the resize still shrinks by a good factor afterwards, since its own
//! antialiasing filter then averages far more pixels than `s × s`.

use fast_image_resize as fr;
use image::RgbImage;

use crate::transform::{CropBox, Interpolation};

/// When the loader decodes at 1/2, 1/4 or 1/8 of the image's size (baseline colour JPEGs only,
/// bilinear resizing on the default resampler only).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DecodeScaling {
    /// Always decode at full size.
    Off,
    /// Only where the resize after the scaled decode still shrinks by at least
    /// [`FAITHFUL_FACTOR`]: the output stays within the same few levels of torchvision's as a
    /// full-size decode (`data/tests/fidelity.rs`). Photos of several megapixels, as phones
    /// take, decode at 1/2 to 1/8; ImageNet's ~500 × 375 files at full size.
    #[default]
    Faithful,
    /// Wherever the scaled image still has at least the resize's output size, as DALI and
    /// Pillow's `draft` do: faster on every image of more than twice the output size, and a
    /// few levels further from torchvision (see the data README).
    Fast,
}

/// The shrink factor [`DecodeScaling::Faithful`] keeps for the resize after a scaled decode.
pub const FAITHFUL_FACTOR: f64 = 4.0;

impl DecodeScaling {
    /// The largest of `scales` at which a source of `source` pixels (width, height) may be
    /// decoded for a resize to `output`.
    pub(crate) fn choose(self, source: (f64, f64), output: (u32, u32), scales: &[u32]) -> u32 {
        let factor = match self {
            DecodeScaling::Off => return 1,
            DecodeScaling::Faithful => FAITHFUL_FACTOR,
            DecodeScaling::Fast => 1.0,
        };
        let room =
            (source.0 / f64::from(output.0.max(1))).min(source.1 / f64::from(output.1.max(1)));
        scales
            .iter()
            .copied()
            .filter(|&s| f64::from(s) * factor <= room)
            .max()
            .unwrap_or(1)
    }
}

/// `crop` (in the full image's pixels) as the smallest box of whole pixels of an image decoded
/// at `1/scale` (`size` is that image's size) that holds it.
pub(crate) fn scaled_box(crop: CropBox, scale: u32, size: (u32, u32)) -> CropBox {
    let left = crop.left / scale;
    let top = crop.top / scale;
    let right = (crop.left + crop.width).div_ceil(scale).min(size.0);
    let bottom = (crop.top + crop.height).div_ceil(scale).min(size.1);
    CropBox {
        top,
        left,
        height: bottom.saturating_sub(top).max(1),
        width: right.saturating_sub(left).max(1),
    }
}

/// `RandomResizedCrop`'s resize of `crop` (in the full image's pixels) from `src`, a decode at
/// `1/scale`, to `out`: the resize of the crop's exact (fractional) box, reading no pixel
/// outside the whole pixels that hold it. Returns packed HWC RGB.
pub(crate) fn resized_crop(
    src: &RgbImage,
    scale: u32,
    crop: CropBox,
    out: (u32, u32),
    interpolation: Interpolation,
) -> Vec<u8> {
    let s = f64::from(scale);
    let held = scaled_box(crop, scale, src.dimensions());
    let fir_src =
        fr::images::ImageRef::new(src.width(), src.height(), src.as_raw(), fr::PixelType::U8x3)
            .expect("an RgbImage buffer always matches its size");
    let view =
        fr::images::CroppedImage::new(&fir_src, held.left, held.top, held.width, held.height)
            .expect("scaled_box lies inside the image");
    let mut dst = fr::images::Image::new(out.0, out.1, fr::PixelType::U8x3);
    let options = fr::ResizeOptions::new()
        .resize_alg(fr::ResizeAlg::Convolution(interpolation.fir_filter()))
        .crop(
            f64::from(crop.left) / s - f64::from(held.left),
            f64::from(crop.top) / s - f64::from(held.top),
            (f64::from(crop.width) / s).min(f64::from(held.width)),
            (f64::from(crop.height) / s).min(f64::from(held.height)),
        );
    crate::transform::with_resizer(|r| {
        r.resize(&view, &mut dst, &options)
            .expect("pixel types match and sizes are non-zero")
    });
    dst.into_vec()
}
