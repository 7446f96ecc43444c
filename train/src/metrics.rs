//! Loss and top-1/top-5 accuracy of a batch, one computation for training and validation.
//!
//! The sums stay on the device ([`batch_stats`] returns a tensor) and are added up there over the
//! sub-batches of a step; the host reads them once per optimizer step, then one fused all-reduce
//! of `[loss × n, top-1, top-5, n]` makes them global. On a GPU each read is a device sync, so
//! reading per sub-batch (as Horovod's example does) would stall the pipeline.

use burn::tensor::activation::log_softmax;
use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};
use serde::{Deserialize, Serialize};

/// The `k` of top-k accuracy (torchvision's references report top-1 and top-5).
pub const TOP_K: usize = 5;

/// Per-sample cross-entropy with label smoothing, as torch's
/// `F.cross_entropy(logits, labels, reduction="none", label_smoothing=α)`:
/// `(1 − α)·(−log p_y) + α·mean_c(−log p_c)`.
///
/// # Shapes
/// - `logits`: `[n, classes]`
/// - `labels`: `[n]`
/// - returns: `[n]`
pub fn per_sample_loss<B: Backend>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    label_smoothing: f64,
) -> Tensor<B, 1> {
    let [n, _] = logits.dims();
    let log_p = log_softmax(logits, 1);
    let nll = log_p
        .clone()
        .gather(1, labels.reshape([n, 1]))
        .reshape([n])
        .neg();
    if label_smoothing == 0.0 {
        return nll;
    }
    let uniform = log_p.mean_dim(1).reshape([n]).neg();
    nll.mul_scalar(1.0 - label_smoothing) + uniform.mul_scalar(label_smoothing)
}

/// Per-sample cross-entropy against probability targets (Mixup's and CutMix's soft labels), as
/// torch's `F.cross_entropy(logits, targets, reduction="none", label_smoothing=α)`: the targets
/// smoothed to `(1 − α)·t + α/K`, then `−Σ_c t_c·log p_c`. For one-hot targets it equals
/// [`per_sample_loss`] of their labels.
///
/// # Shapes
/// - `logits`, `targets`: `[n, classes]`
/// - returns: `[n]`
pub fn per_sample_soft_loss<B: Backend>(
    logits: Tensor<B, 2>,
    targets: Tensor<B, 2>,
    label_smoothing: f64,
) -> Tensor<B, 1> {
    let [n, classes] = logits.dims();
    let targets = if label_smoothing == 0.0 {
        targets
    } else {
        targets
            .mul_scalar(1.0 - label_smoothing)
            .add_scalar(label_smoothing / classes as f64)
    };
    log_softmax(logits, 1)
        .mul(targets)
        .sum_dim(1)
        .reshape([n])
        .neg()
}

/// The device-side sums of one batch: `[loss sum, top-1 correct, top-5 correct]` over the
/// samples whose `mask` is 1 (every sample when `mask` is `None`).
///
/// A sample is top-k correct when fewer than k classes rank above its label; ties rank by class
/// index, as `argmax` picks the first maximum, so top-1 is exactly `argmax == label`. With fewer
/// than five classes top-5 counts every sample.
///
/// # Shapes
/// - `logits`: `[n, classes]`
/// - `labels`, `loss` (from [`per_sample_loss`]), `mask`: `[n]`
/// - returns: `[3]`
pub fn batch_stats<B: Backend>(
    logits: Tensor<B, 2>,
    labels: Tensor<B, 1, Int>,
    loss: Tensor<B, 1>,
    mask: Option<Tensor<B, 1>>,
) -> Tensor<B, 1> {
    let [n, classes] = logits.dims();
    let device = logits.device();
    let labels = labels.reshape([n, 1]);
    let target = logits
        .clone()
        .gather(1, labels.clone())
        .expand([n, classes]);
    let above = logits.clone().greater(target.clone()).int();
    let class = Tensor::<B, 1, Int>::arange(0..classes as i64, &device)
        .reshape([1, classes])
        .expand([n, classes]);
    let tied_before = logits.equal(target).int() * class.lower(labels.expand([n, classes])).int();
    let rank = (above + tied_before).sum_dim(1).reshape([n]);
    let top1 = rank.clone().lower_elem(1).float();
    let top5 = rank.lower_elem(TOP_K as i64).float();
    let (loss, top1, top5) = match mask {
        Some(mask) => (loss * mask.clone(), top1 * mask.clone(), top5 * mask),
        None => (loss, top1, top5),
    };
    Tensor::cat(vec![loss.sum(), top1.sum(), top5.sum()], 0)
}

/// Running sums of a phase on the host, global across ranks after each step's all-reduce.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize, Deserialize)]
pub struct MetricSums {
    /// Sum of per-sample losses.
    pub loss: f64,
    /// Samples whose label is the top prediction.
    pub top1: f64,
    /// Samples whose label is among the top five predictions.
    pub top5: f64,
    /// Samples counted.
    pub count: f64,
}

impl MetricSums {
    /// This rank's sums from a [`batch_stats`] readback and the number of samples it counted.
    pub fn from_stats(stats: &[f64], count: usize) -> Self {
        let get = |i: usize| stats.get(i).copied().unwrap_or(f64::NAN);
        Self {
            loss: get(0),
            top1: get(1),
            top5: get(2),
            count: count as f64,
        }
    }

    /// The layout of the fused all-reduce.
    pub fn to_array(self) -> [f64; 4] {
        [self.loss, self.top1, self.top5, self.count]
    }

    /// Back from the all-reduced array.
    pub fn from_array(values: &[f64]) -> Self {
        let get = |i: usize| values.get(i).copied().unwrap_or(f64::NAN);
        Self {
            loss: get(0),
            top1: get(1),
            top5: get(2),
            count: get(3),
        }
    }

    /// Adds another step's sums.
    pub fn add(&mut self, other: Self) {
        self.loss += other.loss;
        self.top1 += other.top1;
        self.top5 += other.top5;
        self.count += other.count;
    }

    /// Mean loss per sample.
    pub fn mean_loss(&self) -> f64 {
        self.loss / self.count.max(1.0)
    }

    /// Top-1 accuracy, 0..1.
    pub fn top1_accuracy(&self) -> f64 {
        self.top1 / self.count.max(1.0)
    }

    /// Top-5 accuracy, 0..1.
    pub fn top5_accuracy(&self) -> f64 {
        self.top5 / self.count.max(1.0)
    }
}

/// Global figures of one phase (an epoch's training or a validation pass).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct PhaseMetrics {
    /// Mean loss.
    pub loss: f64,
    /// Top-1 accuracy, 0..1.
    pub accuracy: f64,
    /// Top-5 accuracy, 0..1.
    pub accuracy_top5: f64,
    /// Samples counted, all ranks.
    pub count: usize,
    /// Global img/s.
    pub img_per_sec: f64,
    /// Bad files skipped on this rank.
    pub skipped: usize,
}

impl PhaseMetrics {
    /// The figures of a phase's global sums.
    pub fn new(sums: &MetricSums, seconds: f64, skipped: usize) -> Self {
        Self {
            loss: sums.mean_loss(),
            accuracy: sums.top1_accuracy(),
            accuracy_top5: sums.top5_accuracy(),
            count: sums.count as usize,
            img_per_sec: sums.count / seconds.max(1e-9),
            skipped,
        }
    }
}

/// One epoch's figures, global across ranks: a line of `metrics.jsonl`, and the history a
/// checkpoint carries so that the logs can be repaired on resume.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpochMetrics {
    /// 1-based epoch.
    pub epoch: usize,
    /// Mean training loss over every training sample of the epoch (padding included, as torch).
    pub train_loss: f64,
    /// Training top-1 accuracy, 0..1.
    pub train_accuracy: f64,
    /// Training top-5 accuracy, 0..1.
    #[serde(default)]
    pub train_accuracy_top5: f64,
    /// Mean validation loss over every validation image exactly once.
    pub val_loss: f64,
    /// Validation top-1 accuracy, 0..1.
    pub val_accuracy: f64,
    /// Validation top-5 accuracy, 0..1.
    #[serde(default)]
    pub val_accuracy_top5: f64,
    /// Validation images counted (the dataset's size: padding is excluded).
    pub val_images: usize,
    /// Global training throughput.
    pub train_img_per_sec: f64,
    /// Bad files skipped on rank 0 during the epoch.
    pub skipped_files: usize,
    /// `--model-ema`: the EMA's validation loss.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_loss_ema: Option<f64>,
    /// `--model-ema`: the EMA's validation top-1 accuracy, 0..1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_accuracy_ema: Option<f64>,
    /// `--model-ema`: the EMA's validation top-5 accuracy, 0..1.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub val_accuracy_top5_ema: Option<f64>,
}

impl EpochMetrics {
    /// The record of 1-based `epoch` from its training and validation figures.
    pub fn new(epoch: usize, train: &PhaseMetrics, val: &PhaseMetrics) -> Self {
        Self {
            epoch,
            train_loss: train.loss,
            train_accuracy: train.accuracy,
            train_accuracy_top5: train.accuracy_top5,
            val_loss: val.loss,
            val_accuracy: val.accuracy,
            val_accuracy_top5: val.accuracy_top5,
            val_images: val.count,
            train_img_per_sec: train.img_per_sec,
            skipped_files: train.skipped + val.skipped,
            val_loss_ema: None,
            val_accuracy_ema: None,
            val_accuracy_top5_ema: None,
        }
    }

    /// With the EMA's validation figures (`--model-ema`).
    pub fn with_ema(mut self, ema: Option<&PhaseMetrics>) -> Self {
        if let Some(ema) = ema {
            self.val_loss_ema = Some(ema.loss);
            self.val_accuracy_ema = Some(ema.accuracy);
            self.val_accuracy_top5_ema = Some(ema.accuracy_top5);
        }
        self
    }
}

/// Reads a [`batch_stats`] tensor back to the host: the one device sync of a step.
pub fn read_stats<B: Backend>(stats: Tensor<B, 1>) -> Vec<f64> {
    stats.into_data().iter::<f64>().collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    type TestBackend = Flex;

    fn tensors(
        logits: Vec<f32>,
        classes: usize,
        labels: Vec<i64>,
    ) -> (Tensor<TestBackend, 2>, Tensor<TestBackend, 1, Int>) {
        let device = Default::default();
        let n = labels.len();
        (
            Tensor::from_data(TensorData::new(logits, [n, classes]), &device),
            Tensor::from_data(TensorData::new(labels, [n]), &device),
        )
    }

    /// Torch's `F.cross_entropy(logits, labels, reduction="none", label_smoothing=α)`, written
    /// out in f64 from its definition.
    fn reference_loss(logits: &[f32], classes: usize, labels: &[i64], alpha: f64) -> Vec<f64> {
        logits
            .chunks(classes)
            .zip(labels)
            .map(|(row, &y)| {
                let max = row.iter().fold(f64::MIN, |m, &v| m.max(f64::from(v)));
                let lse = max
                    + row
                        .iter()
                        .map(|&v| (f64::from(v) - max).exp())
                        .sum::<f64>()
                        .ln();
                let log_p: Vec<f64> = row.iter().map(|&v| f64::from(v) - lse).collect();
                let nll = -log_p[y as usize];
                let uniform = -log_p.iter().sum::<f64>() / classes as f64;
                (1.0 - alpha) * nll + alpha * uniform
            })
            .collect()
    }

    #[test]
    fn loss_matches_torchs_definition_with_and_without_smoothing() {
        let classes = 7;
        let logits: Vec<f32> = (0..4 * classes)
            .map(|i| ((i * 37 % 11) as f32 - 5.0) * 0.7)
            .collect();
        let labels = vec![0, 6, 3, 3];
        for alpha in [0.0, 0.1, 0.5] {
            let (x, y) = tensors(logits.clone(), classes, labels.clone());
            let got: Vec<f64> = per_sample_loss(x, y, alpha)
                .into_data()
                .iter::<f64>()
                .collect();
            let want = reference_loss(&logits, classes, &labels, alpha);
            for (g, w) in got.iter().zip(&want) {
                assert!(
                    (g - w).abs() < 1e-5 * w.abs().max(1.0),
                    "α {alpha}: {got:?} vs {want:?}"
                );
            }
        }
    }

    #[test]
    fn top1_and_top5_count_ranks_with_first_index_ties_and_the_mask() {
        // 7 classes, 4 samples.
        let logits = vec![
            // label 2 is the maximum: top-1 and top-5.
            0.0, 1.0, 9.0, 3.0, 2.0, 0.5, 0.1, //
            // label 0 ranks 6th (five classes above): neither.
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, -1.0, //
            // label 4 ranks 5th: top-5 only.
            9.0, 8.0, 7.0, 6.0, 5.0, 1.0, 0.0, //
            // label 3 ties class 1 for the maximum: class 1 comes first, so top-5 but not top-1.
            0.0, 4.0, 1.0, 4.0, 2.0, 0.0, 0.0,
        ];
        let labels = vec![2, 0, 4, 3];
        let (x, y) = tensors(logits.clone(), 7, labels.clone());
        let loss = per_sample_loss(x.clone(), y.clone(), 0.0);
        let sums = read_stats(batch_stats(x.clone(), y.clone(), loss.clone(), None));
        let want_loss: f64 = reference_loss(&logits, 7, &labels, 0.0).iter().sum();
        assert!((sums[0] - want_loss).abs() < 1e-4, "{sums:?}");
        assert_eq!(&sums[1..], &[1.0, 3.0]);

        // Masking out the first sample removes its loss and its hits.
        let mask = Tensor::from_data(
            TensorData::new(vec![0.0f32, 1.0, 1.0, 1.0], [4]),
            &x.device(),
        );
        let masked = read_stats(batch_stats(x, y, loss, Some(mask)));
        let first = reference_loss(&logits[..7], 7, &labels[..1], 0.0)[0];
        assert!((masked[0] - (want_loss - first)).abs() < 1e-4, "{masked:?}");
        assert_eq!(&masked[1..], &[0.0, 2.0]);
    }

    #[test]
    fn with_fewer_than_five_classes_top5_counts_everything() {
        let (x, y) = tensors(vec![1.0, 0.0, 0.0, 1.0, 3.0, 2.0], 2, vec![1, 1, 0]);
        let loss = per_sample_loss(x.clone(), y.clone(), 0.0);
        let sums = read_stats(batch_stats(x, y, loss, None));
        assert_eq!(&sums[1..], &[2.0, 3.0]);
    }

    #[test]
    fn sums_round_trip_through_the_all_reduce_layout() {
        let mut total = MetricSums::default();
        total.add(MetricSums::from_stats(&[6.0, 2.0, 3.0], 4));
        total.add(MetricSums::from_array(&[2.0, 1.0, 1.0, 4.0]));
        assert_eq!(total.to_array(), [8.0, 3.0, 4.0, 8.0]);
        assert_eq!(total.mean_loss(), 1.0);
        assert_eq!(total.top1_accuracy(), 0.375);
        assert_eq!(total.top5_accuracy(), 0.5);
    }
}
