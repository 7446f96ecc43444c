//! Mixup and CutMix on the device, given the draw: the images, the soft targets, and the labels
//! training accuracy counts against.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use super::sample::MixOp;
use crate::metrics::{per_sample_loss, per_sample_soft_loss};

/// torch's `t.roll(1, 0)`: sample `i` takes sample `i − 1`'s place, the last wraps to the front.
/// (Burn's `roll_dim` shifts the other way: its shift 1 is torch's −1.)
fn roll_one<B: Backend, const D: usize, K>(t: Tensor<B, D, K>) -> Tensor<B, D, K>
where
    K: burn::tensor::BasicOps<B>,
{
    t.roll_dim(-1, 0)
}

/// torchvision's `MixUp.transform` / `CutMix.transform` on the images: Mixup
/// `x.roll(1, 0)·(1 − λ) + x·λ`; CutMix pastes the box of `x.roll(1, 0)` into `x`.
///
/// # Shapes
/// `[n, c, h, w]` in and out.
pub fn mix_images<B: Backend>(images: Tensor<B, 4>, op: &MixOp) -> Tensor<B, 4> {
    match *op {
        MixOp::Mixup { lam } => roll_one(images.clone())
            .mul_scalar(1.0 - lam)
            .add(images.mul_scalar(lam)),
        MixOp::Cutmix { cut, .. } => {
            if cut.area() == 0 {
                return images;
            }
            let [n, c, _, _] = images.dims();
            let region = [0..n, 0..c, cut.y1..cut.y2, cut.x1..cut.x2];
            let pasted = roll_one(images.clone().slice(region.clone()));
            images.slice_assign(region, pasted)
        }
    }
}

/// `labels` one-hot over `classes`, built by comparison on the device (Burn's `one_hot` reads
/// the labels back to check them, a device sync per step).
///
/// # Shapes
/// `labels` `[n]` → `[n, classes]`.
pub fn one_hot<B: Backend>(labels: Tensor<B, 1, Int>, classes: usize) -> Tensor<B, 2> {
    let [n] = labels.dims();
    let class = Tensor::<B, 1, Int>::arange(0..classes as i64, &labels.device())
        .reshape([1, classes])
        .expand([n, classes]);
    labels
        .reshape([n, 1])
        .expand([n, classes])
        .equal(class)
        .float()
}

/// torchvision's `_mixup_label`: `one_hot.roll(1, 0)·(1 − λ) + one_hot·λ`.
///
/// # Shapes
/// `labels` `[n]` → `[n, classes]`.
pub fn soft_targets<B: Backend>(
    labels: Tensor<B, 1, Int>,
    classes: usize,
    lam: f64,
) -> Tensor<B, 2> {
    let one_hot = one_hot(labels, classes);
    roll_one(one_hot.clone())
        .mul_scalar(1.0 - lam)
        .add(one_hot.mul_scalar(lam))
}

/// The class each soft target peaks at, `target.max(dim=1)[1]` as torchvision's reference
/// `utils.accuracy` takes it: the sample's own label where `λ > 1 − λ`, its neighbour's
/// (`labels[i − 1]`) where less, the smaller class index on a tie (torch returns the first
/// maximum). Computed on the host from what the device compares: `λ` and `1 − λ` in f32.
pub fn target_argmax(labels: &[i64], lam: f64) -> Vec<i64> {
    let own = lam as f32;
    let other = (1.0 - lam) as f32;
    let n = labels.len();
    (0..n)
        .map(|i| {
            let (y, rolled) = (labels[i], labels[(i + n - 1) % n]);
            if y == rolled || own > other {
                y
            } else if other > own {
                rolled
            } else {
                y.min(rolled)
            }
        })
        .collect()
}

/// What a sub-batch's loss and accuracy are computed against.
#[derive(Debug, Clone)]
pub enum Targets<B: Backend> {
    /// Integer labels (no mixing).
    Labels(Tensor<B, 1, Int>),
    /// A mixed batch's soft targets, kept as the labels and λ they are built from (the class
    /// count comes with the logits).
    Mixed {
        /// The batch's own labels, `[n]`.
        labels: Tensor<B, 1, Int>,
        /// The weight of each sample's own label.
        lam: f64,
        /// [`target_argmax`], `[n]`.
        argmax: Tensor<B, 1, Int>,
    },
}

impl<B: Backend> Targets<B> {
    /// Per-sample cross-entropy with label smoothing, `[n]`: [`per_sample_loss`] for labels,
    /// [`per_sample_soft_loss`] of the soft targets for a mixed batch.
    ///
    /// # Shapes
    /// `logits` `[n, classes]` → `[n]`.
    pub fn loss(&self, logits: Tensor<B, 2>, label_smoothing: f64) -> Tensor<B, 1> {
        match self {
            Self::Labels(labels) => per_sample_loss(logits, labels.clone(), label_smoothing),
            Self::Mixed { labels, lam, .. } => {
                let classes = logits.dims()[1];
                let soft = soft_targets(labels.clone(), classes, *lam);
                per_sample_soft_loss(logits, soft, label_smoothing)
            }
        }
    }

    /// The labels training accuracy counts against, `[n]`.
    pub fn accuracy_labels(&self) -> Tensor<B, 1, Int> {
        match self {
            Self::Labels(labels) | Self::Mixed { argmax: labels, .. } => labels.clone(),
        }
    }
}

/// Applies `op` (if any) to a sub-batch: its images mixed, and its [`Targets`].
///
/// # Shapes
/// `images` `[n, c, h, w]`, `labels` `[n]` (`host_labels` the same values on the host).
pub fn apply<B: Backend>(
    op: Option<&MixOp>,
    images: Tensor<B, 4>,
    labels: Tensor<B, 1, Int>,
    host_labels: &[i64],
) -> (Tensor<B, 4>, Targets<B>) {
    let Some(op) = op else {
        return (images, Targets::Labels(labels));
    };
    let lam = op.lam();
    let argmax = target_argmax(host_labels, lam);
    let argmax = Tensor::from_data(
        TensorData::new(argmax, [host_labels.len()]),
        &labels.device(),
    );
    (
        mix_images(images, op),
        Targets::Mixed {
            labels,
            lam,
            argmax,
        },
    )
}
