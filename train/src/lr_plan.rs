//! The two learning-rate families and which one a run uses ([`LrPlan`]):
//!
//! - **Horovod's** ([`LrSchedule`], the default): `--base-lr` per worker, scaled by the world size
//!   and `--batches-per-allreduce`, a per-batch warmup from the single-worker rate (none with one
//!   process), then steps or a cosine (`--lr-schedule`).
//! - **torchvision's** ([`TorchvisionSchedule`]), chosen by any of `--lr`, `--lr-scheduler`,
//!   `--lr-step-size`, `--lr-gamma`, `--lr-min`, `--lr-warmup-epochs`, `--lr-warmup-method`,
//!   `--lr-warmup-decay`: `references/classification/train.py`'s schedulers, stepped once per
//!   epoch, with `--lr` the total peak rate (not multiplied by the world size).

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::cli::TrainArgs;
use crate::schedule::LrSchedule;

/// `--lr-scheduler` (torchvision's names, case-insensitive as its `.lower()`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrScheduler {
    /// StepLR: × --lr-gamma every --lr-step-size epochs.
    #[default]
    Steplr,
    /// CosineAnnealingLR to --lr-min over epochs − warmup epochs.
    Cosineannealinglr,
    /// ExponentialLR: × --lr-gamma every epoch.
    Exponentiallr,
}

/// `--lr-warmup-method`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum WarmupMethod {
    /// LinearLR from --lr-warmup-decay × lr to lr.
    Linear,
    /// ConstantLR at --lr-warmup-decay × lr (torchvision's default).
    #[default]
    Constant,
}

/// torchvision's defaults for its schedule flags (`train.py`'s `get_args_parser`).
pub mod torchvision_defaults {
    /// `--lr`.
    pub const LR: f64 = 0.1;
    /// `--lr-step-size`.
    pub const STEP_SIZE: usize = 30;
    /// `--lr-gamma`.
    pub const GAMMA: f64 = 0.1;
    /// `--lr-min`.
    pub const LR_MIN: f64 = 0.0;
    /// `--lr-warmup-epochs`.
    pub const WARMUP_EPOCHS: usize = 0;
    /// `--lr-warmup-decay`.
    pub const WARMUP_DECAY: f64 = 0.01;
}

/// The learning rate of every optimizer step of a run.
#[derive(Debug, Clone, PartialEq)]
pub enum LrPlan {
    /// Horovod's per-batch schedule (the default).
    Horovod(LrSchedule),
    /// torchvision's per-epoch schedulers.
    Torchvision(TorchvisionSchedule),
}

impl LrPlan {
    /// The plan the flags ask for; `batches_per_epoch` are this rank's optimizer steps per epoch.
    pub fn from_args(args: &TrainArgs, world_size: usize, batches_per_epoch: usize) -> Self {
        if args.uses_torchvision_lr() {
            return Self::Torchvision(TorchvisionSchedule::from_args(args));
        }
        Self::Horovod(LrSchedule {
            base_lr: args.base_lr,
            world_size,
            batches_per_allreduce: args.batches_per_allreduce,
            warmup_epochs: args.warmup_epochs,
            batches_per_epoch,
            decay: args.lr_schedule,
            epochs: args.epochs,
        })
    }

    /// Learning rate for the `batch_idx`-th step (0-based) of `epoch` (0-based).
    pub fn lr(&self, epoch: usize, batch_idx: usize) -> f64 {
        match self {
            Self::Horovod(schedule) => schedule.lr(epoch, batch_idx),
            Self::Torchvision(schedule) => schedule.lr(epoch),
        }
    }

    /// Whether `epoch` (0-based) is a warmup epoch: torchvision's EMA copies the weights then.
    pub fn in_warmup(&self, epoch: usize) -> bool {
        match self {
            Self::Horovod(schedule) => (epoch as f64) < schedule.warmup_epochs,
            Self::Torchvision(schedule) => epoch < schedule.warmup_epochs,
        }
    }

    /// One line for the config table, naming the family.
    pub fn describe(&self) -> String {
        match self {
            Self::Horovod(schedule) => format!("Horovod's: {}", schedule.describe()),
            Self::Torchvision(schedule) => format!("torchvision's: {}", schedule.describe()),
        }
    }
}

/// torchvision's `train.py` schedule: the main scheduler (`StepLR`, `CosineAnnealingLR` with
/// `T_max = epochs − warmup`, or `ExponentialLR`), after `--lr-warmup-epochs` of `LinearLR` or
/// `ConstantLR` chained by `SequentialLR(milestones=[warmup])`, stepped after every epoch.
///
/// The per-epoch values are computed once, as torch computes them: each step applies the
/// scheduler's recursive (chainable) form to the previous rate, and the switch at the milestone
/// uses the main scheduler's closed form at 0, so the values equal torch's to the last bits.
#[derive(Debug, Clone, PartialEq)]
pub struct TorchvisionSchedule {
    /// `--lr`: the total peak rate.
    pub lr: f64,
    /// `--lr-scheduler`.
    pub scheduler: LrScheduler,
    /// `--lr-step-size` (StepLR).
    pub step_size: usize,
    /// `--lr-gamma` (StepLR, ExponentialLR).
    pub gamma: f64,
    /// `--lr-min` (CosineAnnealingLR's `eta_min`).
    pub lr_min: f64,
    /// `--lr-warmup-epochs`.
    pub warmup_epochs: usize,
    /// `--lr-warmup-method`.
    pub warmup_method: WarmupMethod,
    /// `--lr-warmup-decay`: the warmup's start (linear) or constant (constant) factor.
    pub warmup_decay: f64,
    /// `--epochs`.
    pub epochs: usize,
    per_epoch: Vec<f64>,
}

impl TorchvisionSchedule {
    /// The schedule of `--lr*` flags, torchvision's defaults for those not given.
    pub fn from_args(args: &TrainArgs) -> Self {
        use torchvision_defaults as d;
        Self::new(
            args.lr.unwrap_or(d::LR),
            args.lr_scheduler.unwrap_or_default(),
            args.lr_step_size.unwrap_or(d::STEP_SIZE),
            args.lr_gamma.unwrap_or(d::GAMMA),
            args.lr_min.unwrap_or(d::LR_MIN),
            (
                args.lr_warmup_epochs.unwrap_or(d::WARMUP_EPOCHS),
                args.lr_warmup_method.unwrap_or_default(),
                args.lr_warmup_decay.unwrap_or(d::WARMUP_DECAY),
            ),
            args.epochs,
        )
    }

    /// The schedule with these settings; `warmup` is (epochs, method, decay).
    pub fn new(
        lr: f64,
        scheduler: LrScheduler,
        step_size: usize,
        gamma: f64,
        lr_min: f64,
        warmup: (usize, WarmupMethod, f64),
        epochs: usize,
    ) -> Self {
        let (warmup_epochs, warmup_method, warmup_decay) = warmup;
        let mut schedule = Self {
            lr,
            scheduler,
            step_size,
            gamma,
            lr_min,
            warmup_epochs,
            warmup_method,
            warmup_decay,
            epochs,
            per_epoch: Vec::new(),
        };
        schedule.per_epoch = schedule.simulate();
        schedule
    }

    /// The rate of 0-based `epoch` (the last epoch's after the end).
    pub fn lr(&self, epoch: usize) -> f64 {
        let last = self.per_epoch.len().saturating_sub(1);
        self.per_epoch
            .get(epoch.min(last))
            .copied()
            .unwrap_or(self.lr)
    }

    /// The rates of epochs `0..epochs`.
    pub fn per_epoch(&self) -> &[f64] {
        &self.per_epoch
    }

    /// `T_max` of the cosine: the epochs after the warmup.
    fn t_max(&self) -> usize {
        self.epochs.saturating_sub(self.warmup_epochs)
    }

    /// torch's `get_lr` of the main scheduler at `last_epoch` from the current rate `lr`.
    fn main_step(&self, lr: f64, last_epoch: usize) -> f64 {
        match self.scheduler {
            LrScheduler::Steplr => {
                if last_epoch == 0 || !last_epoch.is_multiple_of(self.step_size.max(1)) {
                    lr
                } else {
                    lr * self.gamma
                }
            }
            LrScheduler::Exponentiallr => {
                if last_epoch == 0 {
                    lr
                } else {
                    lr * self.gamma
                }
            }
            LrScheduler::Cosineannealinglr => {
                let (e, t) = (last_epoch as i64, self.t_max().max(1) as i64);
                let pi = std::f64::consts::PI;
                if last_epoch == 0 {
                    lr
                } else if (e - 1 - t).rem_euclid(2 * t) == 0 {
                    lr + (self.lr - self.lr_min) * (1.0 - (pi / t as f64).cos()) / 2.0
                } else {
                    (1.0 + (pi * e as f64 / t as f64).cos())
                        / (1.0 + (pi * (e - 1) as f64 / t as f64).cos())
                        * (lr - self.lr_min)
                        + self.lr_min
                }
            }
        }
    }

    /// The main scheduler's `_get_closed_form_lr` at `last_epoch = 0` (SequentialLR's switch).
    fn main_closed_form_at_zero(&self) -> f64 {
        match self.scheduler {
            LrScheduler::Steplr | LrScheduler::Exponentiallr => self.lr * 1.0,
            LrScheduler::Cosineannealinglr => {
                self.lr_min + (self.lr - self.lr_min) * (1.0 + 0.0f64.cos()) / 2.0
            }
        }
    }

    /// torch's `get_lr` of the warmup scheduler at `last_epoch` from the current rate `lr`.
    fn warmup_step(&self, lr: f64, last_epoch: usize) -> f64 {
        let (start, end, total) = (self.warmup_decay, 1.0, self.warmup_epochs);
        match self.warmup_method {
            WarmupMethod::Linear => {
                if last_epoch == 0 {
                    lr * start
                } else if last_epoch > total {
                    lr
                } else {
                    lr * (1.0
                        + (end - start)
                            / (total as f64 * start + (last_epoch as f64 - 1.0) * (end - start)))
                }
            }
            WarmupMethod::Constant => {
                if last_epoch == 0 {
                    lr * start
                } else if last_epoch != total {
                    lr
                } else {
                    lr * (1.0 / start)
                }
            }
        }
    }

    /// The rate during each epoch, as `train.py` builds its scheduler and calls `step()` after
    /// each epoch.
    fn simulate(&self) -> Vec<f64> {
        let mut values = Vec::with_capacity(self.epochs);
        if self.warmup_epochs == 0 {
            let mut lr = self.lr;
            for epoch in 0..self.epochs {
                if epoch > 0 {
                    lr = self.main_step(lr, epoch);
                }
                values.push(lr);
            }
            return values;
        }
        // SequentialLR resets the rate, then runs the warmup's initial step.
        let mut lr = self.warmup_step(self.lr, 0);
        let mut main_epoch = 0;
        for epoch in 0..self.epochs {
            if epoch > 0 {
                if epoch < self.warmup_epochs {
                    lr = self.warmup_step(lr, epoch);
                } else if epoch == self.warmup_epochs {
                    lr = self.main_closed_form_at_zero();
                } else {
                    main_epoch += 1;
                    lr = self.main_step(lr, main_epoch);
                }
            }
            values.push(lr);
        }
        values
    }

    /// One line for the config table.
    pub fn describe(&self) -> String {
        let main = match self.scheduler {
            LrScheduler::Steplr => {
                format!("StepLR x{} every {} epochs", self.gamma, self.step_size)
            }
            LrScheduler::Cosineannealinglr => format!(
                "CosineAnnealingLR to {} over {} epochs",
                self.lr_min,
                self.t_max()
            ),
            LrScheduler::Exponentiallr => format!("ExponentialLR x{} per epoch", self.gamma),
        };
        let warmup = if self.warmup_epochs == 0 {
            "no warmup".to_string()
        } else {
            let method = match self.warmup_method {
                WarmupMethod::Linear => "linear from",
                WarmupMethod::Constant => "constant at",
            };
            format!(
                "{} warmup epochs {method} {} x lr",
                self.warmup_epochs, self.warmup_decay
            )
        };
        format!("lr {} (total, per epoch); {warmup}; then {main}", self.lr)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::tests::parse;

    #[test]
    fn no_torchvision_flag_keeps_horovods_schedule() {
        let plan = LrPlan::from_args(&parse(&[]), 4, 100);
        let LrPlan::Horovod(schedule) = &plan else {
            panic!("{plan:?}")
        };
        assert_eq!((schedule.base_lr, schedule.warmup_epochs), (0.0125, 5.0));
        assert!(plan.describe().starts_with("Horovod's"));
    }

    #[test]
    fn any_torchvision_flag_picks_torchvisions_schedule_with_its_defaults() {
        for flags in [
            &["--lr", "0.1"][..],
            &["--lr-scheduler", "steplr"],
            &["--lr-warmup-epochs", "0"],
            &["--lr-gamma", "0.1"],
        ] {
            let plan = LrPlan::from_args(&parse(flags), 8, 100);
            let LrPlan::Torchvision(s) = &plan else {
                panic!("{flags:?}: {plan:?}")
            };
            assert_eq!(
                (s.lr, s.scheduler, s.step_size),
                (0.1, LrScheduler::Steplr, 30)
            );
            assert_eq!(
                (s.warmup_epochs, s.warmup_method),
                (0, WarmupMethod::Constant)
            );
            // The total rate: not scaled by the world size.
            assert_eq!(plan.lr(0, 0), 0.1);
            assert_eq!(plan.lr(30, 7), 0.1 * 0.1);
        }
    }

    #[test]
    fn warmup_epochs_are_those_of_the_plan_in_use() {
        let torchvision =
            LrPlan::from_args(&parse(&["--lr", "0.5", "--lr-warmup-epochs", "2"]), 1, 9);
        assert!(torchvision.in_warmup(1) && !torchvision.in_warmup(2));
        let horovod = LrPlan::from_args(&parse(&["--warmup-epochs", "1.5"]), 1, 9);
        assert!(horovod.in_warmup(1) && !horovod.in_warmup(2));
    }
}
