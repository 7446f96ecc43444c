//! `--model-ema`: torchvision's `ExponentialMovingAverage` (an `AveragedModel` with
//! `use_buffers=True`) as `references/classification/train.py` drives it.
//!
//! - The decay is adjusted as `train.py` does: `adjust = world × batch × steps / epochs`,
//!   `alpha = min(1, (1 − decay) × adjust)`, decay `1 − alpha`, where `batch` is the
//!   per-process batch of one optimizer step (`--batch-size × --batches-per-allreduce`).
//! - Every `--model-ema-steps` optimizer steps (`step % steps == 0`, `step` counted from 0 in each
//!   epoch) the EMA is updated from the model's parameters **and** buffers (BatchNorm's running
//!   mean and variance): the first update after a reset copies, later ones compute
//!   `ema + (1 − decay)·(current − ema)` (`torch._foreach_lerp_`, as `get_ema_multi_avg_fn`).
//! - During the LR warmup the update count is reset after each update, so the EMA copies the
//!   weights until the warmup ends.
//!
//! **Identical on every rank.** The parameters it averages are identical on every rank after the
//! gradient all-reduce, so their EMA is too, with no traffic. BatchNorm's running statistics are
//! not: each rank folds its own batches, and the model's are averaged once per epoch
//! (`average_buffers`). The EMA's buffers follow the same rule: each rank averages its own
//! running statistics between epochs, and at the epoch boundary, beside the model's, the EMA's
//! buffers are averaged across ranks (a few hundred KB for ResNet-50, once per epoch; nothing per
//! step). Since the EMA is linear in what it averages, the mean of the ranks' EMAs is exactly the
//! EMA of the ranks' mean statistics, so the result is what one EMA over rank-averaged buffers
//! would hold. Validation, checkpoints and the export use it after that average.
//!
//! Integer buffers (none in these ResNets: Burn's BatchNorm keeps no `num_batches_tracked`) are
//! not averaged.

use burn::module::{AutodiffModule, Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn_dist::{CollectiveBackend, CommunicatorExt, average_buffers, broadcast_parameters};
use data::Loader;
use models::ImageClassifier;

use crate::TrainError;
use crate::metrics::PhaseMetrics;
use crate::trainer::RunContext;

/// torchvision's adjusted EMA decay: `1 − min(1, (1 − decay) × world × batch × steps / epochs)`,
/// with `batch` the per-process batch of one optimizer step.
pub fn adjusted_decay(
    model_ema_decay: f64,
    world_size: usize,
    per_process_batch: usize,
    model_ema_steps: usize,
    epochs: usize,
) -> f64 {
    let adjust = (world_size * per_process_batch * model_ema_steps) as f64 / epochs.max(1) as f64;
    let alpha = (1.0 - model_ema_decay) * adjust;
    1.0 - alpha.min(1.0)
}

/// The averaged copy of a model, on the inference backend.
#[derive(Debug, Clone)]
pub struct ModelEma<M> {
    /// The averaged weights and buffers.
    pub model: M,
    /// Updates since the last reset (`AveragedModel.n_averaged`): 0 means the next one copies.
    pub n_averaged: u64,
    /// The (adjusted) decay of one update.
    pub decay: f64,
}

impl<M> ModelEma<M> {
    /// An EMA starting from `model` (torchvision deep-copies the model); the first update copies.
    pub fn new(model: M, decay: f64) -> Self {
        Self {
            model,
            n_averaged: 0,
            decay,
        }
    }

    /// `AveragedModel.update_parameters(current)`: copies on the first update after a reset,
    /// else moves every float parameter and buffer towards `current`'s by `1 − decay`.
    ///
    /// `current` must be the same architecture (it is the model the EMA was made from).
    pub fn update<B: Backend>(&mut self, current: &M)
    where
        M: Module<B>,
    {
        let mut collect = Collect::<B> {
            tensors: Vec::new(),
        };
        current.visit(&mut collect);
        let mut blend = Blend::<B> {
            current: collect.tensors.into_iter(),
            weight: (self.n_averaged > 0).then_some(1.0 - self.decay),
        };
        self.model = self.model.clone().map(&mut blend);
        self.n_averaged += 1;
    }

    /// `n_averaged.fill_(0)`: the next update copies (torchvision does it during the warmup).
    pub fn reset(&mut self) {
        self.n_averaged = 0;
    }
}

/// The EMA a run starts with (`None` without `--model-ema`). On a fresh start it is the broadcast
/// model, identical on every rank with no traffic. On resume only rank 0 read the checkpoint, so
/// its EMA and update count are broadcast once (a checkpoint without an EMA starts it from the
/// resumed weights).
///
/// # Errors
/// The communicator's errors.
pub(crate) fn start<B, M>(
    ctx: &RunContext,
    model: &M,
    resumed: Option<(M, u64)>,
    resumed_from: usize,
) -> Result<Option<ModelEma<M::InnerModule>>, TrainError>
where
    B: AutodiffBackend,
    B::InnerBackend: CollectiveBackend,
    M: AutodiffModule<B>,
{
    let args = &ctx.args;
    if !args.model_ema {
        return Ok(None);
    }
    let decay = adjusted_decay(
        args.model_ema_decay,
        ctx.dist.world_size(),
        args.batch_size * args.batches_per_allreduce,
        args.model_ema_steps,
        args.epochs,
    );
    if resumed_from == 0 {
        return Ok(Some(ModelEma::new(model.valid(), decay)));
    }
    let mut found = [
        i64::from(resumed.is_some()),
        resumed.as_ref().map_or(0, |(_, n)| *n as i64),
    ];
    ctx.comm().broadcast_slice(&mut found, 0)?;
    let mut ema = match resumed {
        Some((ema, _)) => ModelEma::new(ema.valid(), decay),
        None => ModelEma::new(model.valid(), decay),
    };
    if found[0] == 1 {
        ema.model = broadcast_parameters::<B::InnerBackend, _>(ctx.comm(), ema.model, 0)?;
        ema.n_averaged = found[1].max(0) as u64;
    }
    Ok(Some(ema))
}

/// After optimizer step `step` (0-based in its epoch): every `every` steps, the EMA update from
/// the model, then, during the warmup, the reset that makes the next update copy again.
pub(crate) fn after_step<B, M>(
    ema: &mut ModelEma<M::InnerModule>,
    model: &M,
    step: usize,
    every: usize,
    in_warmup: impl FnOnce() -> bool,
) where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    if !step.is_multiple_of(every.max(1)) {
        return;
    }
    ema.update::<B::InnerBackend>(&model.valid());
    if in_warmup() {
        ema.reset();
    }
}

/// At the end of an epoch: the EMA's buffers averaged across ranks (see the module doc), then
/// the EMA validated like the model.
///
/// # Errors
/// The collectives' and the data's errors.
pub(crate) fn end_of_epoch<B, M>(
    ctx: &RunContext,
    ema: Option<&mut ModelEma<M::InnerModule>>,
    loader: &mut Loader,
    epoch: usize,
    device: &B::Device,
) -> Result<Option<PhaseMetrics>, TrainError>
where
    B: AutodiffBackend,
    B::InnerBackend: CollectiveBackend,
    M: AutodiffModule<B, InnerModule: ImageClassifier<B::InnerBackend>>,
{
    let Some(ema) = ema else {
        return Ok(None);
    };
    ema.model = average_buffers::<B::InnerBackend, _>(ctx.comm(), ema.model.clone())?;
    let label = format!("Validate EMA    #{}", epoch + 1);
    let metrics =
        crate::trainer::evaluate_labelled::<B, M>(ctx, &ema.model, loader, label, device)?;
    Ok(Some(metrics))
}

/// The float tensors (parameters, then running states, in visit order), flattened.
struct Collect<B: Backend> {
    tensors: Vec<Tensor<B, 1>>,
}

impl<B: Backend> ModuleVisitor<B> for Collect<B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let tensor = param.val();
        let numel = tensor.shape().num_elements();
        self.tensors.push(tensor.reshape([numel]));
    }
}

/// Replaces each float tensor by its blend with the next collected one.
struct Blend<B: Backend> {
    current: std::vec::IntoIter<Tensor<B, 1>>,
    /// `None`: copy.
    weight: Option<f64>,
}

impl<B: Backend> ModuleMapper<B> for Blend<B> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, ema, mapper) = param.consume();
        let Some(current) = self.current.next() else {
            return Param::from_mapped_value(id, ema, mapper);
        };
        let current = current.reshape(ema.dims());
        let value = match self.weight {
            None => current,
            // torch's lerp for weights below 0.5: self + weight × (end − self).
            Some(weight) => ema.clone() + (current - ema).mul_scalar(weight),
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::Flex;
    use burn::tensor::TensorData;

    #[derive(Module, Debug)]
    struct Tiny<B: Backend> {
        weight: Param<Tensor<B, 2>>,
        bn: models::nn::BatchNorm<B>,
    }

    fn tiny(values: [f32; 4], mean: [f32; 2]) -> Tiny<Flex> {
        let device = Default::default();
        let mut bn = models::nn::BatchNormConfig::new(2).init::<Flex>(&device);
        bn.running_mean =
            burn::module::RunningState::new(Tensor::from_data(TensorData::from(mean), &device));
        Tiny {
            weight: Param::from_tensor(Tensor::from_data(
                TensorData::new(values.to_vec(), [2, 2]),
                &device,
            )),
            bn,
        }
    }

    fn values(m: &Tiny<Flex>) -> (Vec<f32>, Vec<f32>) {
        (
            m.weight.val().into_data().to_vec().expect("f32"),
            m.bn.running_mean.value().into_data().to_vec().expect("f32"),
        )
    }

    #[test]
    fn first_update_copies_then_blends_parameters_and_buffers() {
        let mut ema = ModelEma::new(tiny([0.0; 4], [0.0; 2]), 0.75);
        ema.update(&tiny([1.0, 2.0, 3.0, 4.0], [8.0, -8.0]));
        assert_eq!(
            values(&ema.model),
            (vec![1.0, 2.0, 3.0, 4.0], vec![8.0, -8.0])
        );
        ema.update(&tiny([5.0, 2.0, 3.0, 0.0], [0.0, 0.0]));
        assert_eq!(
            values(&ema.model),
            (vec![2.0, 2.0, 3.0, 3.0], vec![6.0, -6.0])
        );
        ema.reset();
        ema.update(&tiny([9.0; 4], [1.0; 2]));
        assert_eq!(values(&ema.model), (vec![9.0; 4], vec![1.0; 2]));
    }

    #[test]
    fn the_adjustment_is_torchvisions() {
        // The recipe: 8 × 128 images, every 32 steps, 600 epochs.
        let adjust: f64 = 8.0 * 128.0 * 32.0 / 600.0;
        let want = 1.0 - (1.0 - 0.99998) * adjust;
        assert_eq!(adjusted_decay(0.99998, 8, 128, 32, 600), want);
        // alpha is capped at 1: the EMA is then the model.
        assert_eq!(adjusted_decay(0.9, 64, 256, 32, 1), 0.0);
    }
}
