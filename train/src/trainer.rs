//! The training loop, top to bottom: [`load_data`], [`train_one_epoch`], [`evaluate`], [`run`].
//! It follows Horovod's `pytorch_imagenet_resnet50.py`, with exact distributed metrics (sums and
//! counts reduced in one all-reduce per step, padding excluded from validation) and checkpoints
//! that survive a crash.

use std::fs::OpenOptions;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{GradientsAccumulator, GradientsParams, SgdConfig};
use burn::tensor::activation::log_softmax;
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{ElementConversion, Int, Tensor};
use burn_dist::{
    CollectiveBackend, Communicator, CommunicatorExt, Compression, Dist, DistributedConfig,
    DistributedOptimizer, SyncConfig, average_buffers, broadcast_parameters, reduce_metrics,
};
use data::{BadImagePolicy, Batch, DistributedSampler, ImageFolder, Loader, LoaderConfig};
use models::ImageClassifier;
use serde::Serialize;

use crate::TrainError;
use crate::checkpoint::{self, CheckpointHeader};
use crate::cli::{OnBadImage, TrainArgs, expand_home};
use crate::model::ClassifierConfig;
use crate::progress::Progress;
use crate::schedule::LrSchedule;
use crate::tensorboard::SummaryWriter;

/// Optimizer steps between two `train/lr`, `train/img_per_sec`, `train/data_time` points.
pub const LOG_INTERVAL_STEPS: usize = 10;

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
    fn is_main(&self) -> bool {
        self.dist.is_main()
    }

    fn comm(&self) -> &dyn Communicator {
        self.dist.comm.as_ref()
    }
}

/// One epoch's figures, global across ranks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct EpochMetrics {
    /// 1-based epoch.
    pub epoch: usize,
    /// Mean training loss over every training sample of the epoch (padding included, as torch).
    pub train_loss: f64,
    /// Training top-1 accuracy, 0..1.
    pub train_accuracy: f64,
    /// Mean validation loss over every validation image exactly once.
    pub val_loss: f64,
    /// Validation top-1 accuracy, 0..1.
    pub val_accuracy: f64,
    /// Validation images counted (the dataset's size: padding is excluded).
    pub val_images: usize,
    /// Global training throughput.
    pub train_img_per_sec: f64,
    /// Bad files skipped on this rank during the epoch.
    pub skipped_files: usize,
}

/// What a run did.
#[derive(Debug, Clone, Default)]
pub struct RunSummary {
    /// Epochs resumed from a checkpoint (0 on a fresh start).
    pub resumed_from: usize,
    /// One entry per epoch trained in this run.
    pub epochs: Vec<EpochMetrics>,
}

/// The loaders of one rank.
pub struct Datasets {
    /// Training batches (`batch_size × batches_per_allreduce` per loader batch).
    pub train: Loader,
    /// Validation batches.
    pub val: Loader,
    /// Number of classes.
    pub num_classes: usize,
}

/// Scans both folders and builds this rank's sharded loaders.
///
/// # Errors
/// [`TrainError::Data`] naming a missing or empty folder; [`TrainError::ClassMismatch`].
pub fn load_data(args: &TrainArgs, rank: usize, world_size: usize) -> Result<Datasets, TrainError> {
    let train_dir = expand_home(&args.train_dir);
    let val_dir = expand_home(&args.val_dir);
    let train = ImageFolder::new(&train_dir)?;
    let val = ImageFolder::new(&val_dir)?;
    if train.num_classes() != val.num_classes() {
        return Err(TrainError::ClassMismatch {
            train: train_dir,
            train_classes: train.num_classes(),
            val: val_dir,
            val_classes: val.num_classes(),
        });
    }
    let num_classes = train.num_classes();
    let policy = match args.on_bad_image {
        OnBadImage::Skip => BadImagePolicy::Skip,
        OnBadImage::Strict => BadImagePolicy::Strict,
    };
    let size = args.image_size as u32;
    let train_sampler =
        DistributedSampler::new(train.len(), world_size, rank)?.with_seed(args.seed);
    let val_sampler = DistributedSampler::new(val.len(), world_size, rank)?.with_shuffle(false);
    let train_loader = Loader::new(
        train,
        train_sampler,
        LoaderConfig::train(size, args.batch_size * args.batches_per_allreduce)
            .with_workers(args.workers)
            .with_seed(args.seed)
            .with_policy(policy),
    )?;
    let val_loader = Loader::new(
        val,
        val_sampler,
        LoaderConfig::val(size, args.val_batch_size)
            .with_workers(args.workers)
            .with_seed(args.seed)
            .with_policy(policy),
    )?;
    Ok(Datasets {
        train: train_loader,
        val: val_loader,
        num_classes,
    })
}

type Sgd<B, M> = burn::optim::adaptor::OptimizerAdaptor<
    burn::optim::Sgd<<B as AutodiffBackend>::InnerBackend>,
    M,
    B,
>;

/// Trains a model built by `config` on this rank's share of the data, validating and
/// checkpointing after every epoch, resuming from the newest valid checkpoint.
///
/// # Errors
/// [`TrainError`]: data, collective, checkpoint and log failures, or a diverged loss.
pub fn run<B, C>(ctx: &RunContext, config: &C, device: B::Device) -> Result<RunSummary, TrainError>
where
    B: AutodiffBackend + CollectiveBackend,
    B::InnerBackend: CollectiveBackend,
    C: ClassifierConfig,
{
    let args = &ctx.args;
    let (rank, world_size) = (ctx.dist.rank(), ctx.dist.world_size());
    let mut datasets = load_data(args, rank, world_size)?;
    let steps_per_epoch = datasets
        .train
        .batches_per_epoch()
        .min(args.max_steps_per_epoch.unwrap_or(usize::MAX));

    B::seed(&device, args.seed);
    let mut model = config.init::<B>(datasets.num_classes, &device);
    let mut sgd: Sgd<B, C::Model<B>> = SgdConfig::new()
        .with_momentum(Some(MomentumConfig {
            momentum: args.momentum,
            dampening: 0.0,
            nesterov: false,
        }))
        .with_weight_decay((args.wd > 0.0).then(|| WeightDecayConfig::new(args.wd as f32)))
        .init();

    // Resume: rank 0's view of the file system decides, as in Horovod's example, but a damaged
    // newest file is reported and the previous one used.
    let mut resume = [0i64];
    if ctx.is_main() {
        let scan = checkpoint::scan_for_resume(args);
        for damaged in &scan.damaged {
            println!("warning: {damaged}; trying an older checkpoint");
        }
        if let Some(found) = scan.newest_valid {
            (model, sgd) = found.restore(model, sgd, &device)?;
            resume[0] = found.header.epoch as i64;
            println!(
                "resuming from {} ({} epochs done)",
                found.path.display(),
                found.header.epoch
            );
        }
    }
    ctx.comm().broadcast_slice(&mut resume, 0)?;
    let resumed_from = resume[0].max(0) as usize;

    // Parameters (and BN buffers) first: that also gives every rank rank 0's parameter ids, by
    // which the optimizer state is keyed; then the optimizer state.
    let model = broadcast_parameters::<B, _>(ctx.comm(), model, 0)?;
    let sync = SyncConfig {
        compression: if args.fp16_allreduce {
            Compression::Fp16
        } else {
            Compression::None
        },
        gradient_predivide_factor: args.gradient_predivide_factor,
        ..SyncConfig::default()
    };
    let optimizer = DistributedOptimizer::new(
        sgd,
        Arc::clone(&ctx.dist.comm),
        DistributedConfig {
            sync,
            // Sub-batches are accumulated here, one optimizer step per loader batch, as Horovod.
            backward_passes_per_step: 1,
        },
    )
    .broadcast_state(0, &device)?;

    let schedule = LrSchedule {
        base_lr: args.base_lr,
        world_size,
        batches_per_allreduce: args.batches_per_allreduce,
        warmup_epochs: args.warmup_epochs,
        batches_per_epoch: steps_per_epoch,
    };
    let mut log = if ctx.is_main() {
        print_config_table(
            ctx,
            config,
            &datasets,
            steps_per_epoch,
            models::num_trainable_params(&model),
        );
        Some(RunLog::new(&expand_home(&args.log_dir))?)
    } else {
        None
    };

    let mut state = TrainState {
        model,
        optimizer,
        device,
    };
    let mut summary = RunSummary {
        resumed_from,
        epochs: Vec::new(),
    };
    if resumed_from >= args.epochs && ctx.is_main() {
        println!(
            "all {} epochs are done (checkpoint {} exists); pass more --epochs or another \
             --checkpoint-format to train again",
            args.epochs,
            args.checkpoint_path(resumed_from).display()
        );
    }
    for epoch in resumed_from..args.epochs {
        let train = train_one_epoch(
            ctx,
            &mut state,
            &mut datasets.train,
            &schedule,
            epoch,
            steps_per_epoch,
            log.as_mut(),
        )?;
        // BN running statistics differ per rank; validation and checkpoints use their average.
        state.model = average_buffers::<B, _>(ctx.comm(), state.model.clone())?;
        let val = evaluate::<B, C::Model<B>>(
            ctx,
            &state.model.valid(),
            &mut datasets.val,
            epoch,
            &state.device,
        )?;
        let metrics = EpochMetrics {
            epoch: epoch + 1,
            train_loss: train.loss,
            train_accuracy: train.accuracy,
            val_loss: val.loss,
            val_accuracy: val.accuracy,
            val_images: val.count,
            train_img_per_sec: train.img_per_sec,
            skipped_files: train.skipped + val.skipped,
        };
        if let Some(log) = log.as_mut() {
            log.epoch(&metrics)?;
            let header = CheckpointHeader {
                epoch: epoch + 1,
                args: args.clone(),
                world_size,
                data_seed: args.seed,
                model_fingerprint: checkpoint::model_fingerprint(&state.model),
                sections: Vec::new(),
            };
            let path = args.checkpoint_path(epoch + 1);
            checkpoint::save(&path, header, &state.model, state.optimizer.inner())?;
            for removed in checkpoint::prune(args, epoch + 1) {
                println!("removed old checkpoint {}", removed.display());
            }
        }
        summary.epochs.push(metrics);
    }
    Ok(summary)
}

/// The model, its optimizer and where they live.
pub struct TrainState<B, M>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
{
    /// The model.
    pub model: M,
    /// The wrapped SGD.
    pub optimizer: DistributedOptimizer<Sgd<B, M>, M, B>,
    /// The device.
    pub device: B::Device,
}

/// Global figures of one phase.
#[derive(Debug, Clone, Copy, Default)]
pub struct PhaseMetrics {
    /// Mean loss.
    pub loss: f64,
    /// Top-1 accuracy, 0..1.
    pub accuracy: f64,
    /// Samples counted, all ranks.
    pub count: usize,
    /// Global img/s.
    pub img_per_sec: f64,
    /// Bad files skipped on this rank.
    pub skipped: usize,
}

/// Global running sums `[loss × n, correct, n]`.
#[derive(Debug, Clone, Copy, Default)]
struct Totals([f64; 3]);

impl Totals {
    fn add(&mut self, global: &[f64]) {
        for (total, value) in self.0.iter_mut().zip(global) {
            *total += value;
        }
    }
    fn loss(&self) -> f64 {
        self.0[0] / self.0[2].max(1.0)
    }
    fn accuracy(&self) -> f64 {
        self.0[1] / self.0[2].max(1.0)
    }
}

/// One pass over this rank's shard: per loader batch, forward/backward over sub-batches of
/// `--batch-size` (loss divided by their count), one averaged gradient all-reduce and SGD step,
/// and one fused metrics all-reduce.
///
/// # Errors
/// [`TrainError`] from the data, the collectives, the logs, or a non-finite loss.
pub fn train_one_epoch<B, M>(
    ctx: &RunContext,
    state: &mut TrainState<B, M>,
    loader: &mut Loader,
    schedule: &LrSchedule,
    epoch: usize,
    steps: usize,
    mut log: Option<&mut RunLog>,
) -> Result<PhaseMetrics, TrainError>
where
    B: AutodiffBackend,
    B::InnerBackend: CollectiveBackend,
    M: ImageClassifier<B> + AutodiffModule<B>,
{
    let args = &ctx.args;
    let device = state.device.clone();
    let loss_fn = CrossEntropyLossConfig::new().init(&device);
    let mut progress = Progress::new(
        ctx.is_main() && ctx.show_progress,
        format!("Train Epoch     #{}", epoch + 1),
        steps,
    );
    let mut totals = Totals::default();
    let mut batches = loader.epoch(epoch as u64);
    let started = Instant::now();
    let mut data_wait = Duration::ZERO;
    let mut interval = (Instant::now(), Duration::ZERO, 0.0f64);
    let mut lr = schedule.lr(epoch, 0);

    for step in 0..steps {
        let wait = Instant::now();
        let Some(batch) = batches.next() else { break };
        let batch = batch?;
        let waited = wait.elapsed();
        data_wait += waited;
        interval.1 += waited;

        lr = schedule.lr(epoch, step);
        let local = train_step(state, &loss_fn, &batch, args.batch_size, lr)?;
        let global = reduce_metrics(ctx.comm(), &local)?;
        let step_loss = global[0] / global[2].max(1.0);
        if !step_loss.is_finite() {
            return Err(TrainError::Diverged {
                epoch: epoch + 1,
                step,
                value: step_loss,
            });
        }
        totals.add(&global);
        interval.2 += global[2];

        let elapsed = started.elapsed().as_secs_f64();
        progress.update(
            step + 1,
            &format!(
                "loss {:.4} acc {:.2}% {:.1} img/s lr {:.5} data {:.0}%",
                totals.loss(),
                100.0 * totals.accuracy(),
                totals.0[2] / elapsed.max(1e-9),
                lr,
                100.0 * data_wait.as_secs_f64() / elapsed.max(1e-9)
            ),
        );
        if (step + 1) % LOG_INTERVAL_STEPS == 0 || step + 1 == steps {
            let span = interval.0.elapsed().as_secs_f64().max(1e-9);
            let steps_in_interval = ((step % LOG_INTERVAL_STEPS) + 1) as f64;
            if let Some(log) = log.as_deref_mut() {
                let global_step = (epoch * steps + step + 1) as i64;
                log.scalar("train/lr", lr, global_step)?;
                log.scalar("train/img_per_sec", interval.2 / span, global_step)?;
                log.scalar(
                    "train/data_time",
                    interval.1.as_secs_f64() / steps_in_interval,
                    global_step,
                )?;
            }
            interval = (Instant::now(), Duration::ZERO, 0.0);
        }
    }
    let skipped = batches.skipped();
    let elapsed = started.elapsed().as_secs_f64().max(1e-9);
    let metrics = PhaseMetrics {
        loss: totals.loss(),
        accuracy: totals.accuracy(),
        count: totals.0[2] as usize,
        img_per_sec: totals.0[2] / elapsed,
        skipped,
    };
    progress.finish(&format!(
        "loss {:.4} acc {:.2}% {:.1} img/s lr {:.5} data {:.0}%{}",
        metrics.loss,
        100.0 * metrics.accuracy,
        metrics.img_per_sec,
        lr,
        100.0 * data_wait.as_secs_f64() / elapsed,
        skipped_note(skipped)
    ));
    Ok(metrics)
}

/// Forward and backward over the sub-batches of one loader batch, then one synchronised SGD
/// step. Returns this rank's `[loss × n, correct, n]`.
fn train_step<B, M>(
    state: &mut TrainState<B, M>,
    loss_fn: &burn::nn::loss::CrossEntropyLoss<B>,
    batch: &Batch,
    sub_batch: usize,
    lr: f64,
) -> Result<[f64; 3], TrainError>
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
    let mut local = [0.0; 3];
    for s in 0..sub_batches {
        let range = s * sub_batch..((s + 1) * sub_batch).min(n);
        let m = range.len();
        let (x, y) = if sub_batches == 1 {
            (images.clone(), labels.clone())
        } else {
            (
                images.clone().slice([range.clone()]),
                labels.clone().slice([range]),
            )
        };
        let logits = state.model.classify(x);
        let loss = loss_fn.forward(logits.clone(), y.clone());
        local[0] += loss.clone().into_scalar().elem::<f64>() * m as f64;
        local[1] += correct_count(logits.inner(), y.inner());
        local[2] += m as f64;
        // Averages the gradients of the sub-batches, as Horovod's example.
        let loss = loss.div_scalar(sub_batches as f64);
        let grads = GradientsParams::from_grads(loss.backward(), &state.model);
        accumulator.accumulate(&state.model, grads);
    }
    let grads = accumulator.grads();
    state.model = state.optimizer.step(lr, state.model.clone(), grads)?;
    Ok(local)
}

fn correct_count<B: Backend>(logits: Tensor<B, 2>, labels: Tensor<B, 1, Int>) -> f64 {
    let n = labels.dims()[0];
    let predicted = logits.argmax(1).reshape([n]);
    predicted
        .equal(labels)
        .int()
        .sum()
        .into_scalar()
        .elem::<f64>()
}

/// Validation over this rank's shard, every image of the dataset counted exactly once across
/// ranks (the sampler's padding is masked out).
///
/// # Errors
/// [`TrainError`] from the data or the collectives.
pub fn evaluate<B, M>(
    ctx: &RunContext,
    model: &M::InnerModule,
    loader: &mut Loader,
    epoch: usize,
    device: &B::Device,
) -> Result<PhaseMetrics, TrainError>
where
    B: AutodiffBackend,
    M: AutodiffModule<B, InnerModule: ImageClassifier<B::InnerBackend>>,
{
    let device = device.clone();
    let steps = loader.batches_per_epoch();
    let mut progress = Progress::new(
        ctx.is_main() && ctx.show_progress,
        format!("Validate Epoch  #{}", epoch + 1),
        steps,
    );
    let started = Instant::now();
    let mut totals = Totals::default();
    // The validation transform draws no randomness, and the sampler does not shuffle.
    let mut batches = loader.epoch(0);
    let mut step = 0;
    for batch in &mut batches {
        let batch = batch?;
        let n = batch.len();
        let images = batch.images_tensor::<B::InnerBackend>(&device);
        let labels = batch.labels_tensor::<B::InnerBackend>(&device);
        let mask = batch.mask_tensor::<B::InnerBackend>(&device);
        let logits = model.classify(images);
        let nll = log_softmax(logits.clone(), 1)
            .gather(1, labels.clone().reshape([n, 1]))
            .reshape([n])
            .neg();
        let loss_sum = (nll * mask.clone().float())
            .sum()
            .into_scalar()
            .elem::<f64>();
        let predicted = logits.argmax(1).reshape([n]);
        let correct = (predicted.equal(labels).int() * mask)
            .sum()
            .into_scalar()
            .elem::<f64>();
        let global = reduce_metrics(ctx.comm(), &[loss_sum, correct, batch.num_real() as f64])?;
        totals.add(&global);
        step += 1;
        progress.update(
            step,
            &format!(
                "loss {:.4} acc {:.2}%",
                totals.loss(),
                100.0 * totals.accuracy()
            ),
        );
    }
    let skipped = batches.skipped();
    let metrics = PhaseMetrics {
        loss: totals.loss(),
        accuracy: totals.accuracy(),
        count: totals.0[2] as usize,
        img_per_sec: totals.0[2] / started.elapsed().as_secs_f64().max(1e-9),
        skipped,
    };
    progress.finish(&format!(
        "loss {:.4} acc {:.2}% ({} images){}",
        metrics.loss,
        100.0 * metrics.accuracy,
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

/// Rank 0's logs: TensorBoard events and `metrics.jsonl` in `--log-dir`.
pub struct RunLog {
    writer: SummaryWriter,
    metrics_path: PathBuf,
}

impl RunLog {
    /// Opens a new event file and the metrics file in `log_dir`.
    ///
    /// # Errors
    /// [`TrainError::Log`] naming the directory.
    pub fn new(log_dir: &Path) -> Result<Self, TrainError> {
        let writer = SummaryWriter::new(log_dir).map_err(|source| TrainError::Log {
            path: log_dir.to_path_buf(),
            source,
        })?;
        Ok(Self {
            writer,
            metrics_path: log_dir.join("metrics.jsonl"),
        })
    }

    fn scalar(&mut self, tag: &str, value: f64, step: i64) -> Result<(), TrainError> {
        let path = self.writer.path().to_path_buf();
        self.writer
            .add_scalar(tag, value as f32, step)
            .map_err(|source| TrainError::Log { path, source })
    }

    /// Horovod's per-epoch scalars (step = 0-based epoch) and one JSON line with full precision.
    ///
    /// # Errors
    /// [`TrainError::Log`].
    pub fn epoch(&mut self, m: &EpochMetrics) -> Result<(), TrainError> {
        let step = (m.epoch - 1) as i64;
        self.scalar("train/loss", m.train_loss, step)?;
        self.scalar("train/accuracy", m.train_accuracy, step)?;
        self.scalar("val/loss", m.val_loss, step)?;
        self.scalar("val/accuracy", m.val_accuracy, step)?;
        let path = self.writer.path().to_path_buf();
        self.writer
            .flush()
            .map_err(|source| TrainError::Log { path, source })?;
        let line = serde_json::to_string(m).unwrap_or_default();
        let mut file = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.metrics_path)
            .and_then(|mut f| writeln!(f, "{line}").map(|_| f))
            .map_err(|source| TrainError::Log {
                path: self.metrics_path.clone(),
                source,
            })?;
        file.flush().map_err(|source| TrainError::Log {
            path: self.metrics_path.clone(),
            source,
        })?;
        println!(
            "epoch {}: train loss {:.4} acc {:.2}% | val loss {:.4} acc {:.2}% ({} images) | {:.1} img/s",
            m.epoch,
            m.train_loss,
            100.0 * m.train_accuracy,
            m.val_loss,
            100.0 * m.val_accuracy,
            m.val_images,
            m.train_img_per_sec
        );
        Ok(())
    }
}

fn print_config_table<C: ClassifierConfig>(
    ctx: &RunContext,
    config: &C,
    datasets: &Datasets,
    steps_per_epoch: usize,
    params: usize,
) {
    let a = &ctx.args;
    let world = ctx.dist.world_size();
    let global_batch = a.batch_size * a.batches_per_allreduce * world;
    let peak_lr = a.base_lr * (world * a.batches_per_allreduce) as f64;
    let rows = [
        (
            "model",
            format!(
                "{} ({:.2} M parameters)",
                config.name(),
                params as f64 / 1e6
            ),
        ),
        ("backend", ctx.backend.clone()),
        ("devices", ctx.devices.clone()),
        ("world size", world.to_string()),
        (
            "train images",
            format!(
                "{} in {} classes ({})",
                datasets.train.folder().len(),
                datasets.num_classes,
                datasets.train.folder().root().display()
            ),
        ),
        (
            "val images",
            format!(
                "{} ({})",
                datasets.val.folder().len(),
                datasets.val.folder().root().display()
            ),
        ),
        ("image size", format!("{} px", a.image_size)),
        (
            "batch",
            format!(
                "{} per process x {} per allreduce = {} global",
                a.batch_size, a.batches_per_allreduce, global_batch
            ),
        ),
        ("steps per epoch", steps_per_epoch.to_string()),
        (
            "lr",
            format!(
                "base {} -> scaled {} after {} warmup epochs; x0.1 at 30, 60, 80",
                a.base_lr, peak_lr, a.warmup_epochs
            ),
        ),
        (
            "sgd",
            format!("momentum {}, weight decay {}", a.momentum, a.wd),
        ),
        (
            "allreduce",
            format!(
                "{}{}",
                if a.fp16_allreduce { "fp16" } else { "fp32" },
                if a.gradient_predivide_factor != 1.0 {
                    format!(", predivide {}", a.gradient_predivide_factor)
                } else {
                    String::new()
                }
            ),
        ),
        ("epochs", a.epochs.to_string()),
        (
            "workers",
            format!("{} decode threads per process", a.workers),
        ),
        ("logs", expand_home(&a.log_dir).display().to_string()),
        ("checkpoints", a.checkpoint_format.clone()),
    ];
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in rows {
        println!("  {key:<width$}  {value}");
    }
}
