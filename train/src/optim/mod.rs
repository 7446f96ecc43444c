//! The optimizers of torchvision's `references/classification/train.py` (`--opt sgd`,
//! `sgd_nesterov`, `rmsprop`, `adamw`), with its weight-decay groups and gradient clipping, as one
//! Burn [`Optimizer`](burn::optim::Optimizer): [`TorchOptimizer`].
//!
//! - [`settings`]: the flags, their checks and their description for the config table.
//! - [`groups`]: which weight decay each parameter gets, from its module path, as torchvision's
//!   `set_weight_decay` splits a model.
//! - [`update`]: the per-tensor update rules, as `torch.optim` writes them.
//! - [`fused`]: the same rules on Flex in one in-place pass (bit for bit the same result).
//! - [`clip`]: the global gradient norm and `clip_grad_norm_`'s factor, kept on the device.
//! - [`optimizer`]: the optimizer itself, its per-parameter state and its record.
//!
//! The update formulas are torch's, not Burn's configurations of them: SGD without dampening and
//! with Nesterov as `torch.optim.SGD`, RMSprop with its `eps` added after the square root and its
//! momentum buffer starting at zero, AdamW with the decoupled decay applied before the Adam step
//! and both bias corrections.

pub mod clip;
mod fused;
pub mod groups;
pub mod optimizer;
pub mod settings;
pub mod update;

pub use groups::{DecayGroups, ParamRole, param_roles};
pub use optimizer::{TorchOptimizer, TorchOptimizerRecord};
pub use settings::{OptimizerKind, OptimizerSettings};
