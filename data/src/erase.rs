//! torchvision's `RandomErasing(p, scale=(0.02, 0.33), ratio=(0.3, 3.3), value=0)`.
//!
//! torchvision erases after `Normalize`, so the erased values are exactly 0 in the normalised
//! tensor. Our batches stay u8 until the device normalises them, and no u8 value normalises to
//! 0, so the transform only draws the box; [`Batch`](crate::Batch) carries it and zeroes it after
//! normalisation (on the device for u8 batches, on the host for f32 ones).

use rand::{Rng, RngExt};

use crate::transform::CropBox;

/// `RandomErasing`'s parameters.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RandomErasing {
    /// Probability of erasing a box.
    pub p: f64,
    /// Range of the box's area as a fraction of the image.
    pub scale: (f64, f64),
    /// Range of the box's aspect ratio (height / width), drawn log-uniform.
    pub ratio: (f64, f64),
}

impl RandomErasing {
    /// torchvision's defaults with probability `p`.
    pub fn new(p: f64) -> Self {
        Self {
            p,
            scale: (0.02, 0.33),
            ratio: (0.3, 3.3),
        }
    }

    /// Draws the box to erase in a `width × height` image, as torchvision's `make_params`:
    /// with probability `p`, up to 10 tries of an area and an aspect ratio, accepted when the
    /// box is smaller than the image on both sides; `None` when not erasing or no try fits
    /// (torchvision then leaves the image as it is).
    pub fn draw<R: Rng + ?Sized>(&self, rng: &mut R, width: u32, height: u32) -> Option<CropBox> {
        if rng.random::<f64>() >= self.p {
            return None;
        }
        let area = f64::from(height) * f64::from(width);
        let (log_lo, log_hi) = (self.ratio.0.ln(), self.ratio.1.ln());
        for _ in 0..10 {
            let erase_area = area * uniform(rng, self.scale.0, self.scale.1);
            let aspect_ratio = uniform(rng, log_lo, log_hi).exp();
            let h = (erase_area * aspect_ratio).sqrt().round_ties_even();
            let w = (erase_area / aspect_ratio).sqrt().round_ties_even();
            if !(h < f64::from(height) && w < f64::from(width)) {
                continue;
            }
            let (h, w) = (h as u32, w as u32);
            let top = rng.random_range(0..=height - h);
            let left = rng.random_range(0..=width - w);
            return Some(CropBox {
                top,
                left,
                height: h,
                width: w,
            });
        }
        None
    }
}

fn uniform<R: Rng + ?Sized>(rng: &mut R, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.random::<f64>()
}

/// Sets the `erase` box of every channel of a normalised CHW image of `size × size` to 0.
///
/// # Panics
/// If the buffer is not `3 × size × size` or the box does not fit.
pub fn zero_box_chw(chw: &mut [f32], size: usize, erase: CropBox) {
    assert_eq!(chw.len(), 3 * size * size, "CHW buffer size");
    let (top, left) = (erase.top as usize, erase.left as usize);
    let (h, w) = (erase.height as usize, erase.width as usize);
    assert!(
        top + h <= size && left + w <= size,
        "erase box {erase:?} outside {size}x{size}"
    );
    for plane in chw.chunks_exact_mut(size * size) {
        for row in plane.chunks_exact_mut(size).skip(top).take(h) {
            row[left..left + w].fill(0.0);
        }
    }
}
