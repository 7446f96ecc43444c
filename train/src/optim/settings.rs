//! `--opt`, `--norm-weight-decay`, `--bias-weight-decay`, `--clip-grad-norm`: what they select,
//! how they are checked, and how the config table shows them.

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::cli::{InvalidArgs, TrainArgs};
use crate::optim::groups::DecayGroups;
use crate::optim::update::Rule;

/// RMSprop's `eps` in torchvision's `train.py` (TensorFlow's RMSprop epsilon, moved outside the
/// square root as torch places it).
pub const RMSPROP_EPS: f64 = 0.0316;
/// RMSprop's smoothing constant in torchvision's `train.py`.
pub const RMSPROP_ALPHA: f64 = 0.9;
/// `torch.optim.AdamW`'s defaults, which torchvision's `train.py` keeps.
pub const ADAMW_BETAS: (f64, f64) = (0.9, 0.999);
/// `torch.optim.AdamW`'s default `eps`.
pub const ADAMW_EPS: f64 = 1e-8;

/// `--opt`: torchvision's optimizer names.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum OptimizerKind {
    /// `torch.optim.SGD` with `--momentum` (Horovod's and torchvision's default).
    #[default]
    #[value(name = "sgd")]
    #[serde(rename = "sgd")]
    Sgd,
    /// `torch.optim.SGD(nesterov=True)` with `--momentum`.
    #[value(name = "sgd_nesterov")]
    #[serde(rename = "sgd_nesterov")]
    SgdNesterov,
    /// `torch.optim.RMSprop` with `--momentum`, eps 0.0316, alpha 0.9.
    #[value(name = "rmsprop")]
    #[serde(rename = "rmsprop")]
    RmsProp,
    /// `torch.optim.AdamW`: betas (0.9, 0.999), eps 1e-8, decoupled weight decay.
    #[value(name = "adamw")]
    #[serde(rename = "adamw")]
    AdamW,
}

impl OptimizerKind {
    /// The `--opt` value.
    pub fn name(self) -> &'static str {
        match self {
            Self::Sgd => "sgd",
            Self::SgdNesterov => "sgd_nesterov",
            Self::RmsProp => "rmsprop",
            Self::AdamW => "adamw",
        }
    }
}

/// Everything the optimizer takes from the flags.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptimizerSettings {
    /// `--opt`.
    pub kind: OptimizerKind,
    /// `--momentum` (SGD, Nesterov SGD and RMSprop; AdamW has its betas).
    pub momentum: f64,
    /// `--wd`, `--norm-weight-decay`, `--bias-weight-decay`.
    pub decay: DecayGroups,
    /// `--clip-grad-norm`.
    pub clip_grad_norm: Option<f64>,
}

impl OptimizerSettings {
    /// The settings the flags select.
    pub fn from_args(args: &TrainArgs) -> Self {
        Self {
            kind: args.opt,
            momentum: args.momentum,
            decay: DecayGroups {
                weight_decay: args.wd,
                norm: args.norm_weight_decay,
                bias: args.bias_weight_decay,
            },
            clip_grad_norm: args.clip_grad_norm,
        }
    }

    pub(crate) fn rule(&self) -> Rule {
        match self.kind {
            OptimizerKind::Sgd | OptimizerKind::SgdNesterov => Rule::Sgd {
                momentum: self.momentum,
                nesterov: self.kind == OptimizerKind::SgdNesterov,
            },
            OptimizerKind::RmsProp => Rule::RmsProp {
                alpha: RMSPROP_ALPHA,
                eps: RMSPROP_EPS,
                momentum: self.momentum,
            },
            OptimizerKind::AdamW => Rule::AdamW {
                beta1: ADAMW_BETAS.0,
                beta2: ADAMW_BETAS.1,
                eps: ADAMW_EPS,
            },
        }
    }

    /// The config table's rows: the optimizer with its constants, the decay of each group, and the
    /// clipping.
    pub fn describe(&self) -> Vec<(&'static str, String)> {
        let optimizer = match self.kind {
            OptimizerKind::Sgd => format!("sgd, momentum {}", self.momentum),
            OptimizerKind::SgdNesterov => format!("sgd nesterov, momentum {}", self.momentum),
            OptimizerKind::RmsProp => format!(
                "rmsprop, momentum {}, alpha {RMSPROP_ALPHA}, eps {RMSPROP_EPS}",
                self.momentum
            ),
            OptimizerKind::AdamW => format!(
                "adamw, betas ({}, {}), eps {ADAMW_EPS:e}, decoupled decay",
                ADAMW_BETAS.0, ADAMW_BETAS.1
            ),
        };
        let d = &self.decay;
        let decay = if d.norm.is_none() && d.bias.is_none() {
            format!("{} on every parameter", d.weight_decay)
        } else {
            format!(
                "{} (norm layers {}, biases {})",
                d.weight_decay,
                d.norm.unwrap_or(d.weight_decay),
                d.bias.unwrap_or(d.weight_decay)
            )
        };
        vec![
            ("optimizer", optimizer),
            ("weight decay", decay),
            (
                "clip grad norm",
                self.clip_grad_norm.map_or("off".to_string(), |c| {
                    format!("{c} (global L2, after allreduce)")
                }),
            ),
        ]
    }
}

/// Checks the optimizer's flags; called by [`TrainArgs::validate`].
///
/// # Errors
/// [`InvalidArgs`] naming the flag.
pub fn validate(args: &TrainArgs) -> Result<(), InvalidArgs> {
    let bad = |flag, reason: &str| {
        Err(InvalidArgs {
            flag,
            reason: reason.to_string(),
        })
    };
    for (flag, decay) in [
        ("norm-weight-decay", args.norm_weight_decay),
        ("bias-weight-decay", args.bias_weight_decay),
    ] {
        if decay.is_some_and(|d| !(d.is_finite() && d >= 0.0)) {
            return bad(flag, "must be zero or positive, e.g. 0.0");
        }
    }
    if args
        .clip_grad_norm
        .is_some_and(|c| !(c.is_finite() && c > 0.0))
    {
        return bad(
            "clip-grad-norm",
            "must be a positive norm, e.g. 1.0 (omit it to not clip)",
        );
    }
    if args.opt == OptimizerKind::SgdNesterov && args.momentum == 0.0 {
        return bad(
            "opt",
            "sgd_nesterov needs a momentum (torch refuses Nesterov without one): give --momentum \
             above 0, e.g. 0.9, or use --opt sgd",
        );
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::tests::parse;
    use crate::resume::changed_settings;
    use clap::Parser;

    #[test]
    fn flags_parse_with_torchvisions_names_and_default_to_todays_sgd() {
        let a = parse(&[]);
        assert_eq!(a.opt, OptimizerKind::Sgd);
        assert_eq!(
            (a.norm_weight_decay, a.bias_weight_decay, a.clip_grad_norm),
            (None, None, None)
        );
        let a = parse(&[
            "--opt",
            "sgd_nesterov",
            "--norm-weight-decay",
            "0.0",
            "--bias-weight-decay",
            "0",
            "--clip-grad-norm",
            "1.5",
        ]);
        a.validate().expect("valid");
        let s = OptimizerSettings::from_args(&a);
        assert_eq!(s.kind, OptimizerKind::SgdNesterov);
        assert_eq!((s.decay.norm, s.decay.bias), (Some(0.0), Some(0.0)));
        assert_eq!(s.clip_grad_norm, Some(1.5));
        for (name, kind) in [
            ("sgd", OptimizerKind::Sgd),
            ("rmsprop", OptimizerKind::RmsProp),
            ("adamw", OptimizerKind::AdamW),
        ] {
            assert_eq!(parse(&["--opt", name]).opt, kind);
            assert_eq!(kind.name(), name);
        }
        let table = OptimizerSettings::from_args(&parse(&["--opt", "rmsprop"])).describe();
        assert!(table[0].1.contains("eps 0.0316"), "{table:?}");
    }

    #[test]
    fn bad_values_name_the_flag() {
        let unknown = TrainArgs::try_parse_from(["train", "--opt", "adam"]);
        let message = unknown.expect_err("unknown optimizer").to_string();
        assert!(
            message.contains("--opt") && message.contains("adamw"),
            "{message}"
        );
        for (args, flag) in [
            (&["--norm-weight-decay=-1"][..], "norm-weight-decay"),
            (&["--bias-weight-decay", "nan"][..], "bias-weight-decay"),
            (&["--clip-grad-norm", "0"][..], "clip-grad-norm"),
            (&["--opt", "sgd_nesterov", "--momentum", "0"][..], "opt"),
        ] {
            let error = parse(args).validate().expect_err("invalid");
            assert_eq!(error.flag, flag, "{args:?}");
            assert!(error.to_string().contains(flag), "{error}");
        }
    }

    #[test]
    fn another_optimizer_or_decay_refuses_resume() {
        let saved = parse(&["--opt", "adamw"]);
        for now in [
            parse(&["--opt", "rmsprop"]),
            parse(&["--opt", "adamw", "--norm-weight-decay", "0"]),
            parse(&["--opt", "adamw", "--bias-weight-decay", "0"]),
            parse(&["--opt", "adamw", "--clip-grad-norm", "1"]),
            parse(&["--opt", "adamw", "--wd", "0.1"]),
        ] {
            let changes = changed_settings(&saved, 1, &now, 1);
            assert_eq!(changes.len(), 1, "{changes:?}");
            assert!(changes[0].affects_lr, "{changes:?}");
        }
        assert!(changed_settings(&saved, 1, &saved, 1).is_empty());
    }
}
