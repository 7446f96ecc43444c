//! Mixup and CutMix (`--mixup-alpha`, `--cutmix-alpha`), torchvision's `transforms.v2.MixUp` and
//! `CutMix` as `references/classification/train.py` uses them: `RandomChoice([MixUp, CutMix])`
//! (p = 0.5 each when both are on) on every batch after the collate.
//!
//! - Where: on the device, on the normalised (and randomly erased) batch, which is where
//!   torchvision's collate sees it (its `Normalize` and `RandomErasing` run per image before).
//! - Which batch: each sub-batch of `--batch-size`, i.e. each forward pass. torchvision mixes
//!   each loader batch, and its loader batch is the per-process `--batch-size`; ours is
//!   `--batch-size × --batches-per-allreduce`, split into sub-batches, so a sub-batch is what
//!   torchvision would have mixed. Each draws its own λ (and box) and rolls within itself.
//! - The draws: our seeded RNG per `(seed, rank, epoch, step, sub-batch)` ([`sample::batch_rng`]):
//!   reruns and resumed runs make the same draws; ranks draw independently, each mixing its own
//!   batch, as every process of a torch job does.
//! - The loss: cross-entropy against the soft targets, with label smoothing applied to them as
//!   torch's `F.cross_entropy(logits, soft, label_smoothing=ε)`: `(1 − ε)·soft + ε/K`.
//! - Training accuracy (top-1 and top-5): against the class the soft target peaks at, as the
//!   reference's `utils.accuracy` (`target.max(dim=1)[1]` for 2-D targets).

pub mod apply;
pub mod sample;

pub use apply::{Targets, apply, mix_images, one_hot, soft_targets, target_argmax};
pub use sample::{CutBox, MixAlphas, MixOp, batch_rng, cutmix_box, sample_beta};

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor};

use crate::cli::{InvalidArgs, TrainArgs};

/// The mixing of one run: the alphas and what keys the draws.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BatchMixer {
    /// `--mixup-alpha`, `--cutmix-alpha`.
    pub alphas: MixAlphas,
    /// `--seed`.
    pub seed: u64,
    /// This process's rank.
    pub rank: usize,
}

impl BatchMixer {
    /// The mixer the flags ask for; `None` when both alphas are 0.
    pub fn from_args(args: &TrainArgs, rank: usize) -> Option<Self> {
        let alphas = MixAlphas {
            mixup: args.mixup_alpha,
            cutmix: args.cutmix_alpha,
        };
        alphas.any().then_some(Self {
            alphas,
            seed: args.seed,
            rank,
        })
    }

    /// The draw of sub-batch `sub_batch` of optimizer step `step` in `epoch` (both 0-based), for
    /// images of `h × w`.
    pub fn draw(
        &self,
        epoch: usize,
        step: usize,
        sub_batch: usize,
        h: usize,
        w: usize,
    ) -> Option<MixOp> {
        let mut rng = batch_rng(self.seed, self.rank, epoch, step, sub_batch);
        self.alphas.draw(&mut rng, h, w)
    }

    /// The mixer of one optimizer step.
    pub fn at(&self, epoch: usize, step: usize) -> StepMixer {
        StepMixer {
            mixer: *self,
            epoch,
            step,
        }
    }
}

/// [`BatchMixer`] at one optimizer step.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct StepMixer {
    mixer: BatchMixer,
    epoch: usize,
    step: usize,
}

impl StepMixer {
    /// Mixes sub-batch `sub_batch` of the step (see [`apply`]).
    ///
    /// # Shapes
    /// `images` `[n, c, h, w]`, `labels` `[n]` (`host_labels` the same values on the host).
    pub fn apply<B: Backend>(
        &self,
        sub_batch: usize,
        images: Tensor<B, 4>,
        labels: Tensor<B, 1, Int>,
        host_labels: &[i64],
    ) -> (Tensor<B, 4>, Targets<B>) {
        let [_, _, h, w] = images.dims();
        let op = self.mixer.draw(self.epoch, self.step, sub_batch, h, w);
        apply(op.as_ref(), images, labels, host_labels)
    }
}

/// Checks `--mixup-alpha` and `--cutmix-alpha`.
///
/// # Errors
/// [`InvalidArgs`] naming the flag.
pub fn validate(args: &TrainArgs) -> Result<(), InvalidArgs> {
    for (flag, alpha) in [
        ("mixup-alpha", args.mixup_alpha),
        ("cutmix-alpha", args.cutmix_alpha),
    ] {
        if !(alpha.is_finite() && alpha >= 0.0) {
            return Err(InvalidArgs {
                flag,
                reason: "must be 0 (off) or a positive Beta(α, α) parameter, e.g. 0.2 for Mixup \
                         and 1.0 for CutMix"
                    .to_string(),
            });
        }
    }
    Ok(())
}

/// The config table's line, when mixing is on.
pub fn describe(args: &TrainArgs) -> Option<String> {
    let on = |name: &str, alpha: f64| (alpha > 0.0).then(|| format!("{name} α {alpha}"));
    let parts: Vec<String> = [
        on("mixup", args.mixup_alpha),
        on("cutmix", args.cutmix_alpha),
    ]
    .into_iter()
    .flatten()
    .collect();
    match parts.len() {
        0 => None,
        1 => Some(format!("{} per batch of --batch-size", parts[0])),
        _ => Some(format!(
            "{} or {} (p = 0.5 each) per batch of --batch-size",
            parts[0], parts[1]
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::tests::parse;

    #[test]
    fn flags_default_off_parse_and_refuse_negative_alphas() {
        let a = parse(&[]);
        assert_eq!((a.mixup_alpha, a.cutmix_alpha), (0.0, 0.0));
        assert!(BatchMixer::from_args(&a, 0).is_none());
        assert!(describe(&a).is_none());
        let a = parse(&["--mixup-alpha", "0.2", "--cutmix-alpha", "1.0"]);
        a.validate().expect("valid");
        let mixer = BatchMixer::from_args(&a, 3).expect("on");
        assert_eq!(
            (mixer.alphas.mixup, mixer.alphas.cutmix, mixer.rank),
            (0.2, 1.0, 3)
        );
        assert!(describe(&a).expect("on").contains("p = 0.5"));
        for (args, flag) in [
            (&["--mixup-alpha=-0.2"][..], "mixup-alpha"),
            (&["--cutmix-alpha", "inf"][..], "cutmix-alpha"),
            (&["--cutmix-alpha", "NaN"][..], "cutmix-alpha"),
        ] {
            let error = parse(args).validate().expect_err("invalid");
            assert_eq!(error.flag, flag, "{args:?}");
        }
    }

    #[test]
    fn args_saved_before_the_mixing_flags_still_read() {
        let mut saved = serde_json::to_value(parse(&[])).expect("json");
        let object = saved.as_object_mut().expect("object");
        for new in ["mixup_alpha", "cutmix_alpha"] {
            object.remove(new).expect(new);
        }
        let args: TrainArgs = serde_json::from_value(saved).expect("reads");
        assert_eq!((args.mixup_alpha, args.cutmix_alpha), (0.0, 0.0));
    }
}
