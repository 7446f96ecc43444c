//! The learning-rate schedule of Horovod's ImageNet example (Goyal et al. 2017): a per-batch
//! linear warmup from the single-worker rate to the scaled rate, then steps at epochs 30, 60, 80;
//! or, after the same warmup, a per-batch cosine decay to 0 at the last epoch.

use crate::cli::LrDecay;

/// Epochs at which the rate drops by 10×, and the factor that applies from each on.
/// As in Horovod's example these are absolute epochs, not scaled with `--epochs`.
pub const LR_STEPS: [(f64, f64); 3] = [(30.0, 1e-1), (60.0, 1e-2), (80.0, 1e-3)];

/// What the schedule needs to know about the run.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LrSchedule {
    /// `--base-lr`: the learning rate of a single worker.
    pub base_lr: f64,
    /// Number of processes.
    pub world_size: usize,
    /// `--batches-per-allreduce`: sub-batches per optimizer step; it multiplies the batch.
    pub batches_per_allreduce: usize,
    /// `--warmup-epochs`.
    pub warmup_epochs: f64,
    /// Optimizer steps (loader batches) per epoch on each rank.
    pub batches_per_epoch: usize,
    /// What follows the warmup.
    pub decay: LrDecay,
    /// `--epochs`: where the cosine reaches 0.
    pub epochs: usize,
}

impl LrSchedule {
    /// Learning rate for the `batch_idx`-th step (0-based) of `epoch` (0-based):
    /// `base_lr × world × batches_per_allreduce × adj`, with, during warmup,
    /// `e = epoch + (batch_idx + 1) / batches_per_epoch` and
    /// `adj = (e × (world − 1) / warmup_epochs + 1) / world`; after it, the step factors, or
    /// `adj = (1 + cos(π·t)) / 2` with `t = (epoch + batch_idx / batches_per_epoch − warmup) /
    /// (epochs − warmup)`.
    pub fn lr(&self, epoch: usize, batch_idx: usize) -> f64 {
        let world = self.world_size as f64;
        let epoch_f = epoch as f64;
        let per_epoch = self.batches_per_epoch.max(1) as f64;
        let adj = if epoch_f < self.warmup_epochs {
            let e = epoch_f + (batch_idx + 1) as f64 / per_epoch;
            (e * (world - 1.0) / self.warmup_epochs + 1.0) / world
        } else {
            match self.decay {
                LrDecay::Step => LR_STEPS
                    .iter()
                    .rev()
                    .find(|(from, _)| epoch_f >= *from)
                    .map_or(1.0, |(_, factor)| *factor),
                LrDecay::Cosine => {
                    let span = self.epochs as f64 - self.warmup_epochs;
                    let done = epoch_f + batch_idx as f64 / per_epoch - self.warmup_epochs;
                    let t = if span > 0.0 {
                        (done / span).clamp(0.0, 1.0)
                    } else {
                        0.0
                    };
                    0.5 * (1.0 + (std::f64::consts::PI * t).cos())
                }
            }
        };
        self.base_lr * world * self.batches_per_allreduce as f64 * adj
    }

    /// One line for the config table.
    pub fn describe(&self) -> String {
        let peak = self.base_lr * (self.world_size * self.batches_per_allreduce) as f64;
        let after = match self.decay {
            LrDecay::Step => "x0.1 at epochs 30, 60, 80".to_string(),
            LrDecay::Cosine => format!("cosine to 0 at epoch {}", self.epochs),
        };
        format!(
            "base {} -> peak {peak} after {} warmup epochs; {after}",
            self.base_lr, self.warmup_epochs
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn schedule(world_size: usize) -> LrSchedule {
        LrSchedule {
            base_lr: 0.0125,
            world_size,
            batches_per_allreduce: 1,
            warmup_epochs: 5.0,
            batches_per_epoch: 100,
            decay: LrDecay::Step,
            epochs: 90,
        }
    }

    fn close(a: f64, b: f64) -> bool {
        (a - b).abs() <= 1e-12 * b.abs().max(1.0)
    }

    #[test]
    fn matches_horovods_formula_for_8_workers() {
        let s = schedule(8);
        // Written out by hand from adjust_learning_rate() in Horovod's example.
        let cases = [
            // (epoch, batch, lr)
            (0, 0, 0.0125 * 8.0 * ((0.01 * 7.0 / 5.0 + 1.0) / 8.0)),
            (0, 99, 0.0125 * 8.0 * ((1.0 * 7.0 / 5.0 + 1.0) / 8.0)),
            (2, 49, 0.0125 * 8.0 * ((2.5 * 7.0 / 5.0 + 1.0) / 8.0)),
            (4, 99, 0.1),
            (5, 0, 0.1),
            (29, 99, 0.1),
            (30, 0, 0.01),
            (59, 10, 0.01),
            (60, 0, 0.001),
            (80, 0, 0.0001),
            (89, 99, 0.0001),
        ];
        for (epoch, batch, expected) in cases {
            let got = s.lr(epoch, batch);
            assert!(
                close(got, expected),
                "epoch {epoch} batch {batch}: {got} != {expected}"
            );
        }
    }

    #[test]
    fn one_worker_has_a_flat_warmup() {
        let s = schedule(1);
        for (epoch, batch) in [(0, 0), (1, 50), (4, 99), (10, 3)] {
            assert!(close(s.lr(epoch, batch), 0.0125));
        }
        assert!(close(s.lr(30, 0), 0.00125));
    }

    #[test]
    fn warmup_ramps_from_single_worker_rate_to_scaled_rate() {
        let s = schedule(8);
        let first = s.lr(0, 0);
        let last = s.lr(4, 99);
        assert!(first > 0.0125 && first < 0.0127, "{first}");
        assert!(close(last, 0.1));
        let mut previous = 0.0;
        for epoch in 0..5 {
            for batch in 0..100 {
                let lr = s.lr(epoch, batch);
                assert!(lr > previous, "not increasing at {epoch}/{batch}");
                previous = lr;
            }
        }
    }

    #[test]
    fn batches_per_allreduce_multiplies() {
        let mut s = schedule(8);
        s.batches_per_allreduce = 4;
        assert!(close(s.lr(10, 0), 0.4));
        assert!(close(s.lr(0, 99), 4.0 * schedule(8).lr(0, 99)));
    }

    #[test]
    fn cosine_follows_the_warmup_and_reaches_zero_at_the_last_epoch() {
        let mut s = schedule(8);
        s.decay = LrDecay::Cosine;
        s.epochs = 25;
        // The warmup is Horovod's, whatever the decay.
        for (epoch, batch) in [(0, 0), (2, 49), (4, 99)] {
            assert!(close(s.lr(epoch, batch), schedule(8).lr(epoch, batch)));
        }
        let peak = 0.1;
        // t = (e - 5) / 20 with e = epoch + batch / 100.
        for (epoch, batch, t) in [(5, 0, 0.0), (10, 0, 0.25), (15, 0, 0.5), (20, 50, 0.775)] {
            let want = peak * 0.5 * (1.0 + (std::f64::consts::PI * t).cos());
            let got = s.lr(epoch, batch);
            assert!(
                close(got, want),
                "epoch {epoch} batch {batch}: {got} != {want}"
            );
        }
        assert!(s.lr(24, 99) < 1e-4 * peak && s.lr(24, 99) > 0.0);
        let mut previous = f64::MAX;
        for epoch in 5..25 {
            for batch in 0..100 {
                let lr = s.lr(epoch, batch);
                assert!(lr <= previous, "not decreasing at {epoch}/{batch}");
                previous = lr;
            }
        }
    }
}
