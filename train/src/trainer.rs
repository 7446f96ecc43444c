//! The training loop, top to bottom: [`run`], [`train_one_epoch`], [`evaluate`] (the data comes
//! from [`crate::datasets::load_data`]).
//! It follows Horovod's `pytorch_imagenet_resnet50.py`, with exact distributed metrics (sums and
//! counts kept on the device, read and reduced in one all-reduce per step, padding excluded from
//! validation) and checkpoints that survive a crash.

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use burn::optim::{GradientsAccumulator, GradientsParams};
use burn::tensor::Tensor;
use burn::tensor::backend::AutodiffBackend;
use burn_dist::{
    CollectiveBackend, Communicator, Compression, Dist, DistributedConfig, DistributedOptimizer,
    SyncConfig, average_buffers, broadcast_parameters, reduce_metrics,
};
use data::{Batch, ImageFolder, Loader};
use models::ImageClassifier;

use crate::TrainError;
use crate::checkpoint::{self, Position};
use crate::cli::{TrainArgs, expand_home};
use crate::datasets::{load_data, val_loader};
use crate::ema::ModelEma;
use crate::lr_plan::LrPlan;
use crate::metrics::{
    EpochMetrics, MetricSums, PhaseMetrics, batch_stats, per_sample_loss, read_stats,
};
use crate::mix::{BatchMixer, StepMixer, Targets};
use crate::model::ClassifierConfig;
use crate::optim::{OptimizerSettings, TorchOptimizer};
use crate::preemption::{self, MidEpoch, SampleTrace, StepCheckpoints, VERDICT_SLOTS};
use crate::progress::Progress;
use crate::resume;
use crate::run_log::{RunLog, print_config_table};
use crate::weights;

/// Optimizer steps between two `train/lr`, `train/img_per_sec`, `train/data_time` points, unless
/// `--print-freq` says otherwise.
pub const LOG_INTERVAL_STEPS: usize = 10;

/// Where `--clip-grad-norm`'s pre-clip gradient norm sits in a training step's stats, after
/// `[loss sum, top-1, top-5]`.
const GRAD_NORM_STAT: usize = 3;

/// Validation batches between two reads of the device-side sums (each read is a device sync and
/// an all-reduce; the count is the same on every rank, as the collective needs).
pub const VAL_SYNC_BATCHES: usize = 10;

/// Where a run runs and what it reports.
#[derive(Debug, Clone)]
pub struct RunContext {
    /// The flags.
    pub args: TrainArgs,
    /// The joined job (rank, world size, communicator).
    pub dist: Dist,
    /// For the config table, e.g. `flex (CPU)` or `cuda`.
    pub backend: String,
    /// For the config table, e.g. `cpu` or `cuda:0..7`.
    pub devices: String,
    /// Draw progress (false on ranks the launcher marked quiet).
    pub show_progress: bool,
}

impl RunContext {
    pub(crate) fn is_main(&self) -> bool {
        self.dist.is_main()
    }

    pub(crate) fn comm(&self) -> &dyn Communicator {
        self.dist.comm.as_ref()
    }
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    /// Epochs resumed from a checkpoint (0 on a fresh start).
    pub resumed_from: usize,
    /// One entry per epoch trained in this run.
    pub epochs: Vec<EpochMetrics>,
    /// `--test-only`: the validation figures.
    pub evaluation: Option<PhaseMetrics>,
    /// The final weights, exported as a torchvision `state_dict` (rank 0).
    pub exported: Option<PathBuf>,
    /// `--model-ema`: the EMA's final weights, exported beside them (rank 0).
    pub exported_ema: Option<PathBuf>,
    /// `--test-only --model-ema`: the evaluation is the EMA's.
    pub evaluated_ema: bool,
}

fn sync_config(args: &TrainArgs) -> SyncConfig {
    SyncConfig {
        compression: if args.fp16_allreduce {
            Compression::Fp16
        } else {
            Compression::None
        },
        gradient_predivide_factor: args.gradient_predivide_factor,
        ..SyncConfig::default()
    }
}

/// Trains a model built by `config` on this rank's share of the data, validating and
/// checkpointing after every epoch, resuming from the newest valid checkpoint (or starting from
/// `--weights`), and exporting the final weights; with `--test-only`, evaluates once instead.
///
/// # Errors
/// [`TrainError`]: data, collective, checkpoint, weights and log failures, a refused resume, or
/// a diverged loss.
pub fn run<B, C>(ctx: &RunContext, config: &C, device: B::Device) -> Result<RunSummary, TrainError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
    C: ClassifierConfig,
{
    if ctx.args.test_only {
        return test_only::<B, C>(ctx, config, device);
    }
    let args = &ctx.args;
    let mut datasets = load_data(args, ctx.dist.rank(), ctx.dist.world_size())?;
    let steps_per_epoch = datasets
        .train
        .batches_per_epoch()
        .min(args.max_steps_per_epoch.unwrap_or(usize::MAX));
    let schedule = LrPlan::from_args(args, ctx.dist.world_size(), steps_per_epoch);
    let Started {
        mut state,
        resumed_from,
        mut history,
        mid_epoch,
    } = start_training::<B, C>(ctx, config, datasets.num_classes, device)?;
    preemption::install_stop_signals(args.save_on_signal);
    let mut log = if ctx.is_main() {
        let params = models::num_trainable_params(&state.model) as f64 / 1e6;
        print_config_table(
            ctx,
            &format!("{} ({params:.2} M parameters)", config.name()),
            (&datasets.train, &datasets.val),
            steps_per_epoch,
            &schedule,
        );
        let mut log = RunLog::new(&expand_home(&args.log_dir))?;
        let global_batch = args.global_batch(ctx.dist.world_size());
        let steps_done =
            resumed_from * steps_per_epoch + mid_epoch.map_or(0, |m| m.samples / global_batch);
        log.start(&history, resumed_from, steps_done)?;
        if resumed_from >= args.epochs {
            println!(
                "all {} epochs are done (checkpoint {} exists); pass more --epochs or another \
                 --checkpoint-format to train again",
                args.epochs,
                args.checkpoint_path(resumed_from).display()
            );
        }
        Some(log)
    } else {
        None
    };

    let mut summary = RunSummary {
        resumed_from,
        ..RunSummary::default()
    };
    let mut step_checkpoints = StepCheckpoints::new(args.checkpoint_every, ctx.is_main());
    let mut from = mid_epoch;
    for epoch in resumed_from..args.epochs {
        let train = match train_one_epoch(
            ctx,
            &mut state,
            &mut datasets.train,
            &schedule,
            EpochPlan {
                epoch,
                steps: steps_per_epoch,
                from: from.take(),
            },
            log.as_mut(),
            &mut step_checkpoints,
            &history,
        )? {
            EpochEnd::Done(metrics) => metrics,
            EpochEnd::Stopped(at) => {
                // Nobody exits before rank 0's file is written: a launcher, torchrun or SLURM
                // may stop the whole job as soon as one process is gone.
                step_checkpoints.writer().finish()?;
                reduce_metrics(ctx.comm(), &[0.0])?;
                return Err(TrainError::Preempted {
                    rank: ctx.dist.rank(),
                    checkpoint: checkpoint::path_at(
                        args,
                        Position {
                            epochs: epoch,
                            steps: at.step,
                        },
                    ),
                });
            }
        };
        // BN running statistics differ per rank; validation and checkpoints use their average.
        state.model = average_buffers::<B, _>(ctx.comm(), state.model.clone())?;
        let val = evaluate::<B, C::Model<B>>(
            ctx,
            &state.model.valid(),
            &mut datasets.val,
            Some(epoch),
            &state.device,
        )?;
        let val_ema = crate::ema::end_of_epoch::<B, C::Model<B>>(
            ctx,
            state.ema.as_mut(),
            &mut datasets.val,
            epoch,
            &state.device,
        )?;
        let metrics = EpochMetrics::new(epoch + 1, &train, &val).with_ema(val_ema.as_ref());
        if let Some(log) = log.as_mut() {
            // Checkpoint first, then log: a crash in between loses no epoch (resume restores its
            // line from the checkpoint) and duplicates none.
            history.push(metrics.clone());
            let writer = step_checkpoints.writer();
            checkpoint::training::save(
                args,
                ctx.dist.world_size(),
                &state,
                &history,
                None,
                writer,
            )?;
            let waited = writer.take_waited();
            if !waited.is_zero() {
                println!(
                    "steps waited {:.2} s in epoch {} for checkpoint writes still in flight",
                    waited.as_secs_f64(),
                    epoch + 1
                );
            }
            log.epoch(&metrics)?;
        }
        step_checkpoints.saved();
        summary.epochs.push(metrics);
    }
    step_checkpoints.writer().finish()?;
    if ctx.is_main() {
        let path = args.export_path();
        if !summary.epochs.is_empty() || !path.exists() {
            weights::export(&state.model, &path)?;
            summary.exported = Some(path);
            if let Some(ema) = &state.ema {
                let path = args.ema_export_path();
                weights::export(&ema.model, &path)?;
                summary.exported_ema = Some(path);
            }
        }
    }
    Ok(summary)
}

/// What [`start_training`] hands to the epoch loop.
struct Started<B: AutodiffBackend, M: AutodiffModule<B>> {
    state: TrainState<B, M>,
    /// Completed epochs.
    resumed_from: usize,
    /// Their figures (rank 0).
    history: Vec<EpochMetrics>,
    /// Resumed from a mid-epoch checkpoint: where in epoch `resumed_from` (every rank).
    mid_epoch: Option<MidEpoch>,
}

/// The model and optimizer every rank starts the epochs with: built by `config`, resumed or
/// pretrained on rank 0 ([`resume::start`]), then broadcast.
fn start_training<B, C>(
    ctx: &RunContext,
    config: &C,
    num_classes: usize,
    device: B::Device,
) -> Result<Started<B, C::Model<B>>, TrainError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
    C: ClassifierConfig,
{
    let args = &ctx.args;
    B::seed(&device, args.seed);
    let model = config.init::<B>(num_classes, &device);
    crate::model::draw_parameters(&model);
    let start = resume::start::<B, _, _>(
        ctx,
        model,
        TorchOptimizer::new(OptimizerSettings::from_args(args)),
        &config.head(),
        &device,
    )?;
    // Parameters (and BN buffers) first: that also gives every rank rank 0's parameter ids, by
    // which the optimizer state is keyed; then the optimizer state.
    let model = broadcast_parameters::<B, _>(ctx.comm(), start.model, 0)?;
    let ema = crate::ema::start::<B, C::Model<B>>(ctx, &model, start.ema, start.resumed_from)?;
    let optimizer = DistributedOptimizer::new(
        start.optimizer,
        Arc::clone(&ctx.dist.comm),
        DistributedConfig {
            sync: sync_config(args),
            // Sub-batches are accumulated here, one optimizer step per loader batch, as Horovod.
            backward_passes_per_step: 1,
        },
    )
    .broadcast_state(0, &device)?;
    Ok(Started {
        state: TrainState {
            model,
            optimizer,
            device,
            ema,
        },
        resumed_from: start.resumed_from,
        history: start.history,
        mid_epoch: start.mid_epoch,
    })
}

/// `--test-only`: the validation set once, with `--weights` or the newest valid checkpoint.
fn test_only<B, C>(
    ctx: &RunContext,
    config: &C,
    device: B::Device,
) -> Result<RunSummary, TrainError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
    C: ClassifierConfig,
{
    let args = &ctx.args;
    let folder = ImageFolder::new(expand_home(&args.val_dir))?;
    let num_classes = folder.num_classes();
    let mut val = val_loader(args, folder, ctx.dist.rank(), ctx.dist.world_size())?;
    B::seed(&device, args.seed);
    let model = config.init::<B>(num_classes, &device);
    crate::model::draw_parameters(&model);
    let model = resume::evaluation_model::<B, _>(ctx, model, &device)?;
    let model = broadcast_parameters::<B, _>(ctx.comm(), model, 0)?;
    let metrics = evaluate::<B, C::Model<B>>(ctx, &model.valid(), &mut val, None, &device)?;
    Ok(RunSummary {
        evaluation: Some(metrics),
        evaluated_ema: args.model_ema,
        ..RunSummary::default()
    })
}

/// The model, its optimizer and where they live.
pub struct TrainState<B, M>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    /// The model.
    pub model: M,
    /// The wrapped `--opt` optimizer.
    pub optimizer: DistributedOptimizer<TorchOptimizer<M, B>, M, B>,
    /// The device.
    pub device: B::Device,
    /// `--model-ema`: the averaged model (see [`crate::ema`]).
    pub ema: Option<ModelEma<M::InnerModule>>,
}

/// Which epoch [`train_one_epoch`] trains, how many steps it has, and where a resumed one starts.
#[derive(Debug, Clone, Copy)]
pub struct EpochPlan {
    /// 0-based epoch.
    pub epoch: usize,
    /// Optimizer steps in the epoch.
    pub steps: usize,
    /// Resumed from a mid-epoch checkpoint: its position and the epoch's figures so far.
    pub from: Option<MidEpoch>,
}

/// How [`train_one_epoch`] ended.
#[derive(Debug, Clone)]
pub enum EpochEnd {
    /// Every step ran: the epoch's training figures.
    Done(PhaseMetrics),
    /// A stop signal: a checkpoint of this position was written, the run stops.
    Stopped(MidEpoch),
}

/// One pass over this rank's shard: per loader batch, forward/backward over sub-batches of
/// `--batch-size` (loss divided by their count), one averaged gradient all-reduce and optimizer step,
/// one read of the step's device-side metric sums and one fused metrics all-reduce. That
/// all-reduce also carries the votes for a mid-epoch checkpoint (`step_checkpoints`), written at
/// the same step on every rank with the epochs `history` done.
///
/// # Errors
/// [`TrainError`] from the data, the collectives, the logs, a checkpoint, or a non-finite loss.
#[allow(clippy::too_many_arguments)]
pub fn train_one_epoch<B, M>(
    ctx: &RunContext,
    state: &mut TrainState<B, M>,
    loader: &mut Loader,
    schedule: &LrPlan,
    plan: EpochPlan,
    mut log: Option<&mut RunLog>,
    step_checkpoints: &mut StepCheckpoints,
    history: &[EpochMetrics],
) -> Result<EpochEnd, TrainError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
    M: ImageClassifier<B> + AutodiffModule<B>,
{
    let args = &ctx.args;
    let EpochPlan { epoch, steps, from } = plan;
    let mut progress = Progress::new(
        ctx.is_main() && ctx.show_progress,
        format!("Train Epoch     #{}", epoch + 1),
        steps,
    );
    let global_batch = args.global_batch(ctx.dist.world_size());
    // Counted in samples: a run regrouped onto another world (the same global batch, see
    // `resume::changed_settings`) starts at the same sample of the epoch.
    let first_step = from.map_or(0, |m| (m.samples / global_batch.max(1)).min(steps));
    let mut totals = from.map_or_else(MetricSums::default, |m| m.totals);
    let mut batches = loader.epoch_from(epoch as u64, first_step);
    let mut trace = SampleTrace::from_env(ctx.dist.rank());
    // A resumed epoch's img/s and data share count the time before the stop too.
    let before = from.map_or(Duration::ZERO, |m| Duration::from_secs_f64(m.elapsed_s));
    let started = Instant::now() - before;
    let mut data_wait = from.map_or(Duration::ZERO, |m| Duration::from_secs_f64(m.data_wait_s));
    // Since the last per-step log point: when it started, data wait, images.
    let mut interval = (Instant::now(), Duration::ZERO, 0.0f64);
    let mut lr = schedule.lr(epoch, 0);
    let log_interval = args.print_freq.max(1);
    // `--clip-grad-norm`'s pre-clip norms since the last log point (sum, steps).
    let mut grad_norms = (0.0f64, 0usize);
    let mixer = BatchMixer::from_args(args, ctx.dist.rank());

    for step in first_step..steps {
        let wait = Instant::now();
        let Some(batch) = batches.next() else { break };
        let batch = batch?;
        if let Some(trace) = trace.as_mut() {
            trace.record(epoch, step, &batch.indices);
        }
        let waited = wait.elapsed();
        data_wait += waited;
        interval.1 += waited;

        lr = schedule.lr(epoch, step);
        let mix = mixer.map(|m| m.at(epoch, step));
        let stats = train_step(
            state,
            &batch,
            args.batch_size,
            args.label_smoothing,
            lr,
            mix,
        )?;
        if let Some(ema) = state.ema.as_mut() {
            crate::ema::after_step(ema, &state.model, step, args.model_ema_steps, || {
                schedule.in_warmup(epoch)
            });
        }
        let stats = read_stats(stats);
        if let Some(norm) = stats.get(GRAD_NORM_STAT) {
            grad_norms = (grad_norms.0 + norm, grad_norms.1 + 1);
        }
        let local = MetricSums::from_stats(&stats, batch.len());
        let mut sums = local.to_array().to_vec();
        sums.extend(step_checkpoints.votes());
        let sums = reduce_metrics(ctx.comm(), &sums)?;
        // A checkpoint write that failed in the background stops the run here, naming the file.
        step_checkpoints.writer().check()?;
        let global = MetricSums::from_array(&sums[..sums.len() - VERDICT_SLOTS]);
        let verdict = step_checkpoints.verdict(
            &sums[sums.len() - VERDICT_SLOTS..],
            epoch * steps + step + 1,
            step + 1 == steps,
        );
        if !global.mean_loss().is_finite() {
            return Err(TrainError::Diverged {
                epoch: epoch + 1,
                step,
                value: global.mean_loss(),
            });
        }
        totals.add(global);
        interval.2 += global.count;

        let elapsed = started.elapsed().as_secs_f64().max(1e-9);
        progress.update(
            step + 1,
            &format!(
                "loss {:.4} acc {:.2}% top-5 {:.2}% {:.1} img/s lr {:.5} data {:.0}%",
                totals.mean_loss(),
                100.0 * totals.top1_accuracy(),
                100.0 * totals.top5_accuracy(),
                totals.count / elapsed,
                lr,
                100.0 * data_wait.as_secs_f64() / elapsed
            ),
        );
        if let Some(log) = log.as_deref_mut() {
            if (step + 1) % log_interval == 0 || step + 1 == steps {
                let span = interval.0.elapsed().as_secs_f64().max(1e-9);
                let steps_in_interval = ((step % log_interval) + 1) as f64;
                let global_step = (epoch * steps + step + 1) as i64;
                log.scalar("train/lr", lr, global_step)?;
                log.scalar("train/img_per_sec", interval.2 / span, global_step)?;
                log.scalar(
                    "train/data_time",
                    interval.1.as_secs_f64() / steps_in_interval,
                    global_step,
                )?;
                if grad_norms.1 > 0 {
                    let mean = grad_norms.0 / grad_norms.1 as f64;
                    log.scalar("train/grad_norm", mean, global_step)?;
                }
            }
            log.tick()?;
        }
        if (step + 1) % log_interval == 0 {
            interval = (Instant::now(), Duration::ZERO, 0.0);
            grad_norms = (0.0, 0);
        }
        if verdict.save {
            let at = MidEpoch {
                step: step + 1,
                samples: (step + 1) * global_batch,
                totals,
                elapsed_s: started.elapsed().as_secs_f64(),
                data_wait_s: data_wait.as_secs_f64(),
            };
            checkpoint::training::save_mid_epoch(
                ctx,
                state,
                history,
                at,
                step_checkpoints.writer(),
            )?;
            step_checkpoints.saved();
            if verdict.stop {
                progress.finish("stopped by a signal; checkpoint written");
                return Ok(EpochEnd::Stopped(at));
            }
        }
    }
    let skipped = batches.skipped();
    let elapsed = started.elapsed().as_secs_f64();
    let metrics = PhaseMetrics::new(&totals, elapsed, skipped);
    progress.finish(&format!(
        "loss {:.4} acc {:.2}% top-5 {:.2}% {:.1} img/s lr {:.5} data {:.0}%{}",
        metrics.loss,
        100.0 * metrics.accuracy,
        100.0 * metrics.accuracy_top5,
        metrics.img_per_sec,
        lr,
        100.0 * data_wait.as_secs_f64() / elapsed.max(1e-9),
        skipped_note(skipped)
    ));
    Ok(EpochEnd::Done(metrics))
}

/// Forward and backward over the sub-batches of one loader batch (each mixed by `mix`, when on),
/// then one synchronised optimizer step. Returns this rank's `[loss sum, top-1, top-5]` of the
/// batch, then with `--clip-grad-norm` the step's pre-clip gradient norm, still on the device.
pub fn train_step<B, M>(
    state: &mut TrainState<B, M>,
    batch: &Batch,
    sub_batch: usize,
    label_smoothing: f64,
    lr: f64,
    mix: Option<StepMixer>,
) -> Result<Tensor<B::InnerBackend, 1>, TrainError>
where
    B: AutodiffBackend,
    B::InnerBackend: CollectiveBackend,
    M: ImageClassifier<B> + AutodiffModule<B>,
{
    let n = batch.len();
    let images = batch.images_tensor::<B>(&state.device);
    let labels = batch.labels_tensor::<B>(&state.device);
    let sub_batches = n.div_ceil(sub_batch).max(1);
    let mut accumulator = GradientsAccumulator::<M>::new();
    let mut stats: Option<Tensor<B::InnerBackend, 1>> = None;
    for s in 0..sub_batches {
        let range = s * sub_batch..((s + 1) * sub_batch).min(n);
        let (x, y) = if sub_batches == 1 {
            (images.clone(), labels.clone())
        } else {
            (
                images.clone().slice([range.clone()]),
                labels.clone().slice([range.clone()]),
            )
        };
        let (x, targets) = match mix {
            Some(mix) => mix.apply(s, x, y, &batch.labels[range]),
            None => (x, Targets::Labels(y)),
        };
        let logits = state.model.classify(x);
        let loss = targets.loss(logits.clone(), label_smoothing);
        let y = targets.accuracy_labels();
        // Metrics from the untracked values: no autodiff graph, no device sync.
        let sums = batch_stats(logits.inner(), y.inner(), loss.clone().inner(), None);
        stats = Some(match stats {
            Some(total) => total + sums,
            None => sums,
        });
        // Averages the gradients of the sub-batches, as Horovod's example.
        let loss = loss.mean().div_scalar(sub_batches as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &state.model);
        accumulator.accumulate(&state.model, grads);
    }
    let grads = accumulator.grads();
    state.model = state.optimizer.step(lr, state.model.clone(), grads)?;
    let stats = stats.unwrap_or_else(|| Tensor::zeros([3], &state.device));
    // The norm rides in the step's one device read (identical on every rank: not reduced).
    Ok(match state.optimizer.inner().grad_norm() {
        Some(norm) => Tensor::cat(vec![stats, norm], 0),
        None => stats,
    })
}

/// Validation over this rank's shard, every image of the dataset counted exactly once across
/// ranks (the sampler's padding is masked out). `epoch` (0-based) labels the progress; `None` is
/// a `--test-only` pass.
///
/// # Errors
/// [`TrainError`] from the data or the collectives.
pub fn evaluate<B, M>(
    ctx: &RunContext,
    model: &M::InnerModule,
    loader: &mut Loader,
    epoch: Option<usize>,
    device: &B::Device,
) -> Result<PhaseMetrics, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B, InnerModule: ImageClassifier<B::InnerBackend>>,
{
    let label = match epoch {
        Some(epoch) => format!("Validate Epoch  #{}", epoch + 1),
        None => "Test".to_string(),
    };
    evaluate_labelled::<B, M>(ctx, model, loader, label, device)
}

/// [`evaluate`] with the progress label given.
pub(crate) fn evaluate_labelled<B, M>(
    ctx: &RunContext,
    model: &M::InnerModule,
    loader: &mut Loader,
    label: String,
    device: &B::Device,
) -> Result<PhaseMetrics, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B, InnerModule: ImageClassifier<B::InnerBackend>>,
{
    let steps = loader.batches_per_epoch();
    let mut progress = Progress::new(ctx.is_main() && ctx.show_progress, label, steps);
    let started = Instant::now();
    let mut totals = MetricSums::default();
    // Sums of the batches since the last read, on the device, and the samples they count.
    let mut pending: Option<(Tensor<B::InnerBackend, 1>, usize)> = None;
    let flush = |pending: &mut Option<(Tensor<B::InnerBackend, 1>, usize)>,
                 totals: &mut MetricSums|
     -> Result<(), TrainError> {
        if let Some((stats, count)) = pending.take() {
            let local = MetricSums::from_stats(&read_stats(stats), count);
            totals.add(MetricSums::from_array(&reduce_metrics(
                ctx.comm(),
                &local.to_array(),
            )?));
        }
        Ok(())
    };
    // The validation transform draws no randomness, and the sampler does not shuffle.
    let mut batches = loader.epoch(0);
    let mut step = 0;
    for batch in &mut batches {
        let batch = batch?;
        let images = batch.images_tensor::<B::InnerBackend>(device);
        let labels = batch.labels_tensor::<B::InnerBackend>(device);
        let mask = batch.mask_tensor::<B::InnerBackend>(device).float();
        let logits = model.classify(images);
        let loss = per_sample_loss(logits.clone(), labels.clone(), ctx.args.label_smoothing);
        let stats = batch_stats(logits, labels, loss, Some(mask));
        pending = Some(match pending.take() {
            Some((total, count)) => (total + stats, count + batch.num_real()),
            None => (stats, batch.num_real()),
        });
        step += 1;
        if step % VAL_SYNC_BATCHES == 0 {
            flush(&mut pending, &mut totals)?;
            progress.update(
                step,
                &format!(
                    "loss {:.4} acc {:.2}% top-5 {:.2}%",
                    totals.mean_loss(),
                    100.0 * totals.top1_accuracy(),
                    100.0 * totals.top5_accuracy()
                ),
            );
        }
    }
    flush(&mut pending, &mut totals)?;
    let skipped = batches.skipped();
    let metrics = PhaseMetrics::new(&totals, started.elapsed().as_secs_f64(), skipped);
    progress.finish(&format!(
        "loss {:.4} acc {:.2}% top-5 {:.2}% ({} images){}",
        metrics.loss,
        100.0 * metrics.accuracy,
        100.0 * metrics.accuracy_top5,
        metrics.count,
        skipped_note(skipped)
    ));
    Ok(metrics)
}

fn skipped_note(skipped: usize) -> String {
    if skipped == 0 {
        String::new()
    } else {
        format!(", {skipped} bad files skipped on rank 0")
    }
}
