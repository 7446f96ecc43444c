//! The draws of Mixup and CutMix: λ ~ Beta(α, α), the CutMix box, and which of the two a batch
//! gets. Our own seeded RNG (ChaCha8) instead of torch's, so the values differ from a torch run;
//! the distributions and the arithmetic after the draws are torchvision's.

use rand::{Rng, RngExt, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// A CutMix box in pixels, torchvision's `(x1, y1, x2, y2)`: columns `x1..x2`, rows `y1..y2`
/// (empty when `x1 == x2` or `y1 == y2`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CutBox {
    /// First column.
    pub x1: usize,
    /// First row.
    pub y1: usize,
    /// One past the last column.
    pub x2: usize,
    /// One past the last row.
    pub y2: usize,
}

impl CutBox {
    /// Pixels inside.
    pub fn area(&self) -> usize {
        (self.x2 - self.x1) * (self.y2 - self.y1)
    }
}

/// What one batch gets.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum MixOp {
    /// `λ·x + (1 − λ)·x.roll(1, 0)`, targets mixed by `lam`.
    Mixup {
        /// λ, the weight of the batch's own image and label.
        lam: f64,
    },
    /// The box of `x.roll(1, 0)` pasted into `x`, targets mixed by `lam`.
    Cutmix {
        /// The pasted region.
        cut: CutBox,
        /// `1 − area / (W·H)`: λ corrected by the box's real (clipped) area.
        lam: f64,
    },
}

impl MixOp {
    /// The weight of each sample's own label in its target.
    pub fn lam(&self) -> f64 {
        match *self {
            Self::Mixup { lam } | Self::Cutmix { lam, .. } => lam,
        }
    }
}

/// torchvision's `CutMix.make_params` after its draws: with `λ` and the box centre `(r_x, r_y)`
/// (uniform integers in `0..w`, `0..h`), the half sides are `int(0.5·√(1 − λ)·W)` and
/// `int(0.5·√(1 − λ)·H)`, the box is clipped to the image, and λ becomes `1 − area/(W·H)`.
pub fn cutmix_box(lam: f64, r_x: usize, r_y: usize, h: usize, w: usize) -> MixOp {
    let r = 0.5 * (1.0 - lam).max(0.0).sqrt();
    // Python's int() of a non-negative float: truncation.
    let half_w = (r * w as f64) as usize;
    let half_h = (r * h as f64) as usize;
    let cut = CutBox {
        x1: r_x.saturating_sub(half_w),
        y1: r_y.saturating_sub(half_h),
        x2: (r_x + half_w).min(w),
        y2: (r_y + half_h).min(h),
    };
    let lam = 1.0 - cut.area() as f64 / (w * h).max(1) as f64;
    MixOp::Cutmix { cut, lam }
}

/// `--mixup-alpha` and `--cutmix-alpha` (0: that one is off).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MixAlphas {
    /// Mixup's α.
    pub mixup: f64,
    /// CutMix's α.
    pub cutmix: f64,
}

impl MixAlphas {
    /// Whether either is on.
    pub fn any(&self) -> bool {
        self.mixup > 0.0 || self.cutmix > 0.0
    }

    /// One batch's draw, as torchvision's `RandomChoice([MixUp, CutMix])` (p = 0.5 each when
    /// both are on) followed by the chosen transform's `make_params`; `None` when both are off.
    /// `h`, `w`: the image size.
    pub fn draw(&self, rng: &mut impl Rng, h: usize, w: usize) -> Option<MixOp> {
        let cutmix = match (self.mixup > 0.0, self.cutmix > 0.0) {
            (false, false) => return None,
            (true, false) => false,
            (false, true) => true,
            (true, true) => rng.random::<bool>(),
        };
        if cutmix {
            let lam = sample_beta(rng, self.cutmix);
            let r_x = rng.random_range(0..w.max(1));
            let r_y = rng.random_range(0..h.max(1));
            Some(cutmix_box(lam, r_x, r_y, h, w))
        } else {
            Some(MixOp::Mixup {
                lam: sample_beta(rng, self.mixup),
            })
        }
    }
}

/// The RNG of one batch's draw: ChaCha8 seeded by a SplitMix64 hash of `(seed, rank, epoch,
/// step, sub_batch)`. The same seed gives the same draws on a rerun and on resume; ranks draw
/// independently (each mixes its own batch, as each torch process has its own generator).
pub fn batch_rng(
    seed: u64,
    rank: usize,
    epoch: usize,
    step: usize,
    sub_batch: usize,
) -> ChaCha8Rng {
    // Keeps this stream apart from the per-sample augmentation streams, which hash the same seed.
    const STREAM: u64 = 0x6D69_7875_7063_7574;
    let h = [rank, epoch, step, sub_batch]
        .into_iter()
        .fold(splitmix64(seed ^ STREAM), |h, v| splitmix64(h ^ v as u64));
    ChaCha8Rng::seed_from_u64(h)
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// λ ~ Beta(α, α) as `X / (X + Y)` with `X, Y ~ Gamma(α, 1)` (how torch samples it too), computed
/// from the Gammas' logarithms so that the tiny values of a small α (Gamma(0.2) is below 1e-30
/// now and then) neither underflow nor give 0/0.
///
/// # Panics
/// In debug builds, if `alpha` is not positive.
pub fn sample_beta(rng: &mut impl Rng, alpha: f64) -> f64 {
    debug_assert!(alpha > 0.0, "Beta needs α > 0");
    let ln_x = ln_gamma_sample(rng, alpha);
    let ln_y = ln_gamma_sample(rng, alpha);
    1.0 / (1.0 + (ln_y - ln_x).exp())
}

/// `ln X` for `X ~ Gamma(shape, 1)`: Marsaglia and Tsang (2000), with their boost
/// `Gamma(a) = Gamma(a + 1)·U^(1/a)` for `a < 1`.
fn ln_gamma_sample(rng: &mut impl Rng, shape: f64) -> f64 {
    if shape < 1.0 {
        let u = open_unit(rng);
        return ln_gamma_sample(rng, shape + 1.0) + u.ln() / shape;
    }
    let d = shape - 1.0 / 3.0;
    let c = 1.0 / (9.0 * d).sqrt();
    loop {
        let x = standard_normal(rng);
        let v = 1.0 + c * x;
        if v <= 0.0 {
            continue;
        }
        let v = v * v * v;
        let u = open_unit(rng);
        let x2 = x * x;
        if u < 1.0 - 0.0331 * x2 * x2 || u.ln() < 0.5 * x2 + d * (1.0 - v + v.ln()) {
            return d.ln() + v.ln();
        }
    }
}

/// Uniform in `(0, 1]` (never 0, so that its logarithm is finite).
fn open_unit(rng: &mut impl Rng) -> f64 {
    1.0 - rng.random::<f64>()
}

/// Box–Muller.
fn standard_normal(rng: &mut impl Rng) -> f64 {
    let radius = (-2.0 * open_unit(rng).ln()).sqrt();
    radius * (std::f64::consts::TAU * rng.random::<f64>()).cos()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn draws(alpha: f64, count: usize) -> Vec<f64> {
        let mut rng = batch_rng(7, 0, 0, 0, 0);
        (0..count).map(|_| sample_beta(&mut rng, alpha)).collect()
    }

    /// Sample mean and variance against Beta(α, α)'s `1/2` and `1/(4(2α + 1))`, each within five
    /// standard errors (the variance's from the fourth central moment
    /// `σ⁴·(3 − 6/(2α + 3))` of a symmetric Beta).
    #[test]
    fn beta_draws_have_the_mean_and_variance_of_beta_alpha_alpha() {
        let n = 200_000;
        for alpha in [0.2, 0.5, 1.0, 2.5] {
            let x = draws(alpha, n);
            assert!(
                x.iter().all(|v| (0.0..=1.0).contains(v)),
                "α {alpha}: outside [0, 1]"
            );
            let mean = x.iter().sum::<f64>() / n as f64;
            let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / (n - 1) as f64;
            let want_var = 1.0 / (4.0 * (2.0 * alpha + 1.0));
            let mu4 = want_var * want_var * (3.0 - 6.0 / (2.0 * alpha + 3.0));
            let se_mean = (want_var / n as f64).sqrt();
            let se_var = ((mu4 - want_var * want_var) / n as f64).sqrt();
            assert!(
                (mean - 0.5).abs() < 5.0 * se_mean,
                "α {alpha}: mean {mean} (±{se_mean})"
            );
            assert!(
                (var - want_var).abs() < 5.0 * se_var,
                "α {alpha}: variance {var} vs {want_var} (±{se_var})"
            );
        }
    }

    /// The whole distribution where its CDF has a closed form: Beta(1, 1) is uniform and
    /// Beta(½, ½) the arcsine law `(2/π)·asin(√x)`. Kolmogorov–Smirnov at the 0.1% level
    /// (`D < 1.95/√n`).
    #[test]
    fn beta_draws_pass_kolmogorov_smirnov_where_the_cdf_is_known() {
        let n = 50_000;
        type Cdf = fn(f64) -> f64;
        let cdfs: [(f64, Cdf); 2] = [
            (1.0, |x| x),
            (0.5, |x| std::f64::consts::FRAC_2_PI * x.sqrt().asin()),
        ];
        for (alpha, cdf) in cdfs {
            let mut x = draws(alpha, n);
            x.sort_by(f64::total_cmp);
            let d = x
                .iter()
                .enumerate()
                .map(|(i, &v)| {
                    let f = cdf(v);
                    (f - i as f64 / n as f64).max((i + 1) as f64 / n as f64 - f)
                })
                .fold(0.0, f64::max);
            assert!(d < 1.95 / (n as f64).sqrt(), "α {alpha}: KS distance {d}");
        }
    }

    #[test]
    fn the_same_key_gives_the_same_draws_and_other_keys_others() {
        let alphas = MixAlphas {
            mixup: 0.2,
            cutmix: 1.0,
        };
        let draw = |key: [usize; 4]| {
            let mut rng = batch_rng(42, key[0], key[1], key[2], key[3]);
            alphas.draw(&mut rng, 224, 224)
        };
        assert_eq!(draw([0, 1, 2, 3]), draw([0, 1, 2, 3]));
        for other in [[1, 1, 2, 3], [0, 2, 2, 3], [0, 1, 3, 3], [0, 1, 2, 4]] {
            assert_ne!(draw([0, 1, 2, 3]), draw(other), "{other:?}");
        }
    }

    /// Both on: Mixup and CutMix each about half of the batches (binomial, five standard errors);
    /// every CutMix box inside the image, its λ the box's real area, and the box as large as
    /// `√(1 − λ)` asks for where it is not clipped.
    #[test]
    fn both_on_choose_half_and_half_and_boxes_stay_inside_the_image() {
        let alphas = MixAlphas {
            mixup: 0.2,
            cutmix: 1.0,
        };
        let n = 20_000;
        let mut cutmixes = 0;
        let mut rng = batch_rng(3, 0, 0, 0, 0);
        for i in 0..n {
            let (h, w) = [(224, 224), (7, 13), (1, 1), (32, 5)][i % 4];
            match alphas.draw(&mut rng, h, w).expect("on") {
                MixOp::Mixup { lam } => assert!((0.0..=1.0).contains(&lam)),
                MixOp::Cutmix { cut, lam } => {
                    cutmixes += 1;
                    assert!(cut.x1 <= cut.x2 && cut.x2 <= w, "{cut:?} in {h}x{w}");
                    assert!(cut.y1 <= cut.y2 && cut.y2 <= h, "{cut:?} in {h}x{w}");
                    let want = 1.0 - cut.area() as f64 / (h * w) as f64;
                    assert_eq!(lam, want, "{cut:?}");
                }
            }
        }
        let se = (n as f64 * 0.25).sqrt();
        assert!(
            (cutmixes as f64 - n as f64 / 2.0).abs() < 5.0 * se,
            "{cutmixes} CutMix of {n}"
        );
        let only = |mixup, cutmix| {
            let mut rng = batch_rng(3, 0, 0, 0, 0);
            let alphas = MixAlphas { mixup, cutmix };
            (0..100)
                .map(|_| alphas.draw(&mut rng, 8, 8))
                .collect::<Vec<_>>()
        };
        assert!(
            only(0.2, 0.0)
                .iter()
                .all(|d| matches!(d, Some(MixOp::Mixup { .. })))
        );
        assert!(
            only(0.0, 1.0)
                .iter()
                .all(|d| matches!(d, Some(MixOp::Cutmix { .. })))
        );
        assert!(only(0.0, 0.0).iter().all(Option::is_none));
    }

    #[test]
    fn an_unclipped_box_has_the_half_sides_torchvision_computes() {
        // λ = 0.75: r = 0.25, half sides int(0.25·40) = 10 and int(0.25·20) = 5.
        let op = cutmix_box(0.75, 20, 10, 20, 40);
        let MixOp::Cutmix { cut, lam } = op else {
            panic!("{op:?}")
        };
        assert_eq!(
            cut,
            CutBox {
                x1: 10,
                y1: 5,
                x2: 30,
                y2: 15
            }
        );
        assert_eq!(lam, 1.0 - 200.0 / 800.0);
    }
}
