//! torchvision's automatic augmentation policies (`transforms.v2`): `TrivialAugmentWide`,
//! `RandAugment` and `AutoAugment` (ImageNet policy), with torchvision's op lists, magnitude
//! tables (built in `f32` as `torch.linspace` builds them), signs, fill 0 and nearest
//! interpolation. The draws come from our per-sample RNG, not torch's.

mod ops;

pub(crate) use ops::affine_nearest_to;
pub use ops::{Op, apply_op};

use image::RgbImage;
use rand::{Rng, RngExt};

/// Which automatic augmentation runs after the crop and flip (`--auto-augment`).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum AutoAugment {
    /// `TrivialAugmentWide()`: one op of 14, a magnitude bin of 31, a random sign.
    TrivialAugmentWide,
    /// `RandAugment(num_ops, magnitude)`: `num_ops` ops of 14 at bin `magnitude` of 31.
    RandAugment {
        /// Ops applied in sequence (torchvision default 2).
        num_ops: usize,
        /// Magnitude bin, `0..31` (torchvision default 9).
        magnitude: usize,
    },
    /// `AutoAugment(AutoAugmentPolicy.IMAGENET)`: one of 25 sub-policies of two ops.
    ImageNet,
}

/// Ops of `TrivialAugmentWide` and `RandAugment`, in torchvision's dictionary order.
pub const WIDE_OPS: [Op; 14] = [
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
];

/// Magnitude bins of `TrivialAugmentWide` and `RandAugment`.
pub const NUM_BINS: usize = 31;

/// torchvision's AutoAugment ImageNet policy: `(op, probability, magnitude bin)` pairs.
pub const IMAGENET_POLICY: [[(Op, f64, usize); 2]; 25] = {
    use Op::*;
    [
        [(Posterize, 0.4, 8), (Rotate, 0.6, 9)],
        [(Solarize, 0.6, 5), (AutoContrast, 0.6, 0)],
        [(Equalize, 0.8, 0), (Equalize, 0.6, 0)],
        [(Posterize, 0.6, 7), (Posterize, 0.6, 6)],
        [(Equalize, 0.4, 0), (Solarize, 0.2, 4)],
        [(Equalize, 0.4, 0), (Rotate, 0.8, 8)],
        [(Solarize, 0.6, 3), (Equalize, 0.6, 0)],
        [(Posterize, 0.8, 5), (Equalize, 1.0, 0)],
        [(Rotate, 0.2, 3), (Solarize, 0.6, 8)],
        [(Equalize, 0.6, 0), (Posterize, 0.4, 6)],
        [(Rotate, 0.8, 8), (Color, 0.4, 0)],
        [(Rotate, 0.4, 9), (Equalize, 0.6, 0)],
        [(Equalize, 0.0, 0), (Equalize, 0.8, 0)],
        [(Invert, 0.6, 0), (Equalize, 1.0, 0)],
        [(Color, 0.6, 4), (Contrast, 1.0, 8)],
        [(Rotate, 0.8, 8), (Color, 1.0, 2)],
        [(Color, 0.8, 8), (Solarize, 0.8, 7)],
        [(Sharpness, 0.4, 7), (Invert, 0.6, 0)],
        [(ShearX, 0.6, 5), (Equalize, 1.0, 0)],
        [(Color, 0.4, 0), (Equalize, 0.6, 0)],
        [(Equalize, 0.4, 0), (Solarize, 0.2, 4)],
        [(Solarize, 0.6, 5), (AutoContrast, 0.6, 0)],
        [(Invert, 0.6, 0), (Equalize, 1.0, 0)],
        [(Color, 0.6, 4), (Contrast, 1.0, 8)],
        [(Equalize, 0.8, 0), (Equalize, 0.6, 0)],
    ]
};

/// The search space a magnitude table belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Space {
    /// `TrivialAugmentWide`'s wide ranges (31 bins).
    Wide,
    /// `RandAugment`'s ranges (31 bins).
    RandAugment,
    /// `AutoAugment`'s ranges (10 bins).
    AutoAugment,
}

/// `torch.linspace(start, end, steps)` in `f32`, as torch's CPU kernel computes it: an `f32`
/// step, the first half counted from `start` and the second from `end`, each value one fused
/// multiply-add (one rounding; exact in `f64` for these small counts, then rounded once).
pub fn linspace_f32(start: f64, end: f64, steps: usize) -> Vec<f32> {
    let (s, e) = (start as f32, end as f32);
    if steps == 1 {
        return vec![s];
    }
    let step = (e - s) / (steps - 1) as f32;
    let half = steps / 2;
    let (s, e, step) = (f64::from(s), f64::from(e), f64::from(step));
    (0..steps)
        .map(|i| {
            if i < half {
                (s + step * i as f64) as f32
            } else {
                (e - step * (steps - i - 1) as f64) as f32
            }
        })
        .collect()
}

/// `(8 - arange(bins) / ((bins - 1) / levels)).round().int()` in `f32`, half to even.
fn posterize_bits(bins: usize, levels: f64) -> Vec<f32> {
    let div = ((bins - 1) as f64 / levels) as f32;
    (0..bins)
        .map(|i| (8.0 - i as f32 / div).round_ties_even())
        .collect()
}

/// The magnitude table of `op` in `space` for an image of `width × height`, or `None` for the
/// ops without magnitude; and whether the magnitude takes a random sign.
pub fn magnitudes(space: Space, op: Op, width: u32, height: u32) -> (Option<Vec<f32>>, bool) {
    let bins = match space {
        Space::Wide | Space::RandAugment => NUM_BINS,
        Space::AutoAugment => 10,
    };
    let wide = space == Space::Wide;
    let table = |end: f64| Some(linspace_f32(0.0, end, bins));
    match op {
        Op::Identity | Op::AutoContrast | Op::Equalize | Op::Invert => (None, false),
        Op::ShearX | Op::ShearY => (table(if wide { 0.99 } else { 0.3 }), true),
        Op::TranslateX | Op::TranslateY => {
            let side = if op == Op::TranslateX { width } else { height };
            let end = if wide {
                32.0
            } else {
                150.0 / 331.0 * f64::from(side)
            };
            (table(end), true)
        }
        Op::Rotate => (table(if wide { 135.0 } else { 30.0 }), true),
        Op::Brightness | Op::Color | Op::Contrast | Op::Sharpness => {
            (table(if wide { 0.99 } else { 0.9 }), true)
        }
        Op::Posterize => (
            Some(posterize_bits(bins, if wide { 6.0 } else { 4.0 })),
            false,
        ),
        Op::Solarize => (Some(linspace_f32(1.0, 0.0, bins)), false),
    }
}

/// One drawn op: the op and its signed magnitude.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DrawnOp {
    /// The op.
    pub op: Op,
    /// Magnitude with its sign (0 for the ops without one).
    pub magnitude: f64,
    /// The magnitude bin drawn or fixed (`None` for the ops without one).
    pub bin: Option<usize>,
}

/// The signed magnitude at `bin`: negative with probability 1/2 for signed ops (torchvision
/// `rand() <= 0.5`).
fn signed_magnitude<R: Rng + ?Sized>(
    rng: &mut R,
    space: Space,
    op: Op,
    bin: Option<usize>,
    (w, h): (u32, u32),
) -> DrawnOp {
    let (table, signed) = magnitudes(space, op, w, h);
    match (table, bin) {
        (Some(t), Some(bin)) => {
            let mut magnitude = f64::from(t[bin]);
            if signed && rng.random::<f64>() <= 0.5 {
                magnitude = -magnitude;
            }
            DrawnOp {
                op,
                magnitude,
                bin: Some(bin),
            }
        }
        _ => DrawnOp {
            op,
            magnitude: 0.0,
            bin: None,
        },
    }
}

impl AutoAugment {
    /// Draws the ops (with signed magnitudes) to apply to an image of `width × height`, in
    /// order. The draw sequence is the same as torchvision's forward, on our RNG.
    pub fn draw<R: Rng + ?Sized>(&self, rng: &mut R, width: u32, height: u32) -> Vec<DrawnOp> {
        let size = (width, height);
        match *self {
            AutoAugment::TrivialAugmentWide => {
                let op = WIDE_OPS[rng.random_range(0..WIDE_OPS.len())];
                let has_table = magnitudes(Space::Wide, op, width, height).0.is_some();
                let bin = has_table.then(|| rng.random_range(0..NUM_BINS));
                vec![signed_magnitude(rng, Space::Wide, op, bin, size)]
            }
            AutoAugment::RandAugment { num_ops, magnitude } => (0..num_ops)
                .map(|_| {
                    let op = WIDE_OPS[rng.random_range(0..WIDE_OPS.len())];
                    signed_magnitude(rng, Space::RandAugment, op, Some(magnitude), size)
                })
                .collect(),
            AutoAugment::ImageNet => {
                let policy = IMAGENET_POLICY[rng.random_range(0..IMAGENET_POLICY.len())];
                let mut drawn = Vec::with_capacity(2);
                for (op, p, bin) in policy {
                    if rng.random::<f64>() <= p {
                        let d = signed_magnitude(rng, Space::AutoAugment, op, Some(bin), size);
                        drawn.push(d);
                    }
                }
                drawn
            }
        }
    }

    /// Draws and applies the policy to `img`.
    pub fn apply<R: Rng + ?Sized>(&self, img: RgbImage, rng: &mut R) -> RgbImage {
        let drawn = self.draw(rng, img.width(), img.height());
        drawn
            .iter()
            .fold(img, |acc, d| apply_op(&acc, d.op, d.magnitude))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn posterize_tables_match_torchvisions_by_hand() {
        // TA wide: 8 - round(i / 5): 8 at 0..=2, 7 at 3..=7 (2.5 rounds to 2 -> i=12.5 n/a).
        let t = posterize_bits(31, 6.0);
        assert_eq!((t[0], t[2], t[3], t[30]), (8.0, 8.0, 7.0, 2.0));
        // AutoAugment: 8 - round(i / 2.25) for i = 0..10: last is 8 - 4 = 4.
        assert_eq!(posterize_bits(10, 4.0)[9], 4.0);
    }

    #[test]
    fn linspace_ends_are_exact() {
        let t = linspace_f32(0.0, 135.0, 31);
        assert_eq!((t[0], t[20], t[30]), (0.0, 90.0, 135.0));
    }
}
