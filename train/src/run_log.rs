//! What rank 0 tells the user: the config table at start, and the run's logs (TensorBoard events
//! and `metrics.jsonl` in `--log-dir`), repaired on resume so that every epoch appears once.

use std::collections::BTreeMap;
use std::fs::{File, OpenOptions};
use std::io::Write;
use std::path::{Path, PathBuf};

use crate::TrainError;
use crate::cli::expand_home;
use crate::lr_plan::LrPlan;
use crate::metrics::EpochMetrics;
use crate::tensorboard::SummaryWriter;
use crate::trainer::RunContext;

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

    fn event_error(&self) -> impl Fn(std::io::Error) -> TrainError + use<> {
        let path = self.writer.path().to_path_buf();
        move |source| TrainError::Log {
            path: path.clone(),
            source,
        }
    }

    /// One TensorBoard scalar.
    ///
    /// # Errors
    /// [`TrainError::Log`].
    pub fn scalar(&mut self, tag: &str, value: f64, step: i64) -> Result<(), TrainError> {
        let error = self.event_error();
        self.writer
            .add_scalar(tag, value as f32, step)
            .map_err(error)
    }

    /// Pushes buffered events to disk when they have waited long enough; called every step.
    ///
    /// # Errors
    /// [`TrainError::Log`].
    pub fn tick(&mut self) -> Result<(), TrainError> {
        let error = self.event_error();
        self.writer.flush_if_due().map_err(error)
    }

    fn epoch_scalars(&mut self, m: &EpochMetrics) -> Result<(), TrainError> {
        // Horovod's tags at step = 0-based epoch, and top-5 beside them.
        let step = (m.epoch - 1) as i64;
        self.scalar("train/loss", m.train_loss, step)?;
        self.scalar("train/accuracy", m.train_accuracy, step)?;
        self.scalar("train/accuracy_top5", m.train_accuracy_top5, step)?;
        self.scalar("val/loss", m.val_loss, step)?;
        self.scalar("val/accuracy", m.val_accuracy, step)?;
        self.scalar("val/accuracy_top5", m.val_accuracy_top5, step)?;
        for (tag, value) in [
            ("val/loss_ema", m.val_loss_ema),
            ("val/accuracy_ema", m.val_accuracy_ema),
            ("val/accuracy_top5_ema", m.val_accuracy_top5_ema),
        ] {
            if let Some(value) = value {
                self.scalar(tag, value, step)?;
            }
        }
        let error = self.event_error();
        self.writer.flush().map_err(error)
    }

    /// Logs a checkpointed epoch: TensorBoard first, then one JSON line with full precision (the
    /// resume repair trusts `metrics.jsonl`), then the summary line.
    ///
    /// # Errors
    /// [`TrainError::Log`].
    pub fn epoch(&mut self, m: &EpochMetrics) -> Result<(), TrainError> {
        self.epoch_scalars(m)?;
        let line = serde_json::to_string(m).unwrap_or_default();
        OpenOptions::new()
            .create(true)
            .append(true)
            .open(&self.metrics_path)
            .and_then(|mut f| {
                writeln!(f, "{line}")?;
                f.flush()
            })
            .map_err(|source| TrainError::Log {
                path: self.metrics_path.clone(),
                source,
            })?;
        let ema = match (m.val_accuracy_ema, m.val_accuracy_top5_ema) {
            (Some(top1), Some(top5)) => {
                format!(" | EMA acc {:.2}% top-5 {:.2}%", 100.0 * top1, 100.0 * top5)
            }
            _ => String::new(),
        };
        println!(
            "epoch {}: train loss {:.4} acc {:.2}% | val loss {:.4} acc {:.2}% top-5 {:.2}% \
             ({} images){ema} | {:.1} img/s",
            m.epoch,
            m.train_loss,
            100.0 * m.train_accuracy,
            m.val_loss,
            100.0 * m.val_accuracy,
            100.0 * m.val_accuracy_top5,
            m.val_images,
            m.train_img_per_sec
        );
        Ok(())
    }

    /// Starts the logs of a run that begins after `resumed_from` completed epochs and
    /// `steps_done` optimizer steps in all (those of a partly trained epoch included).
    ///
    /// The new event file first gets TensorBoard's restart marker at the run's first step (0 on
    /// a fresh start, the first step not done otherwise), so TensorBoard hides the events
    /// of earlier files in this directory at that step or later: those of an interrupted epoch,
    /// or of an older run the fresh start replaces. Then, on resume, `metrics.jsonl` loses the
    /// lines of later epochs (logged before the crash, trained again now) and regains, from the
    /// checkpoint's `history`, an epoch that was checkpointed but not logged when the run died;
    /// such an epoch's scalars are written to TensorBoard too.
    ///
    /// # Errors
    /// [`TrainError::Log`].
    pub fn start(
        &mut self,
        history: &[EpochMetrics],
        resumed_from: usize,
        steps_done: usize,
    ) -> Result<(), TrainError> {
        let first_step = match steps_done {
            0 => 0,
            n => (n + 1) as i64,
        };
        let error = self.event_error();
        self.writer.add_session_start(first_step).map_err(error)?;
        if resumed_from == 0 {
            return Ok(());
        }
        let metrics_path = self.metrics_path.clone();
        let log_error = |source| TrainError::Log {
            path: metrics_path.clone(),
            source,
        };
        let text = match std::fs::read_to_string(&self.metrics_path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => String::new(),
            Err(e) => return Err(log_error(e)),
        };
        let mut unparsed = Vec::new();
        let mut by_epoch = BTreeMap::new();
        let mut dropped = 0;
        for line in text.lines().filter(|l| !l.trim().is_empty()) {
            let epoch = serde_json::from_str::<serde_json::Value>(line)
                .ok()
                .and_then(|v| v["epoch"].as_u64());
            match epoch {
                Some(e) if e as usize <= resumed_from => {
                    // A line logged twice (by an older version) is kept once, the last one.
                    if by_epoch.insert(e as usize, line.to_string()).is_some() {
                        dropped += 1;
                    }
                }
                Some(_) => dropped += 1,
                // Not ours to judge: kept as it is.
                None => unparsed.push(line.to_string()),
            }
        }
        let mut restored = Vec::new();
        for m in history.iter().filter(|m| m.epoch <= resumed_from) {
            if let std::collections::btree_map::Entry::Vacant(line) = by_epoch.entry(m.epoch) {
                line.insert(serde_json::to_string(m).unwrap_or_default());
                self.epoch_scalars(m)?;
                restored.push(m.epoch);
            }
        }
        if dropped > 0 || !restored.is_empty() {
            let tmp = metrics_path.with_extension("jsonl.tmp");
            let body: String = unparsed
                .iter()
                .chain(by_epoch.values())
                .map(|l| format!("{l}\n"))
                .collect();
            (|| {
                let mut file = File::create(&tmp)?;
                file.write_all(body.as_bytes())?;
                file.sync_all()?;
                std::fs::rename(&tmp, &metrics_path)
            })()
            .map_err(log_error)?;
            println!(
                "logs: {} removed {dropped} line(s) of epochs after {resumed_from}{}",
                metrics_path.display(),
                if restored.is_empty() {
                    String::new()
                } else {
                    format!(", restored epoch(s) {restored:?} from the checkpoint")
                }
            );
        }
        Ok(())
    }
}

/// The table rank 0 prints at start: the run's settings and the values derived from them.
pub fn print_config_table(
    ctx: &RunContext,
    model: &str,
    data: (&data::Loader, &data::Loader),
    steps_per_epoch: usize,
    schedule: &LrPlan,
) {
    let a = &ctx.args;
    let (train, val) = data;
    let world = ctx.dist.world_size();
    let global_batch = a.global_batch(world);
    let mut rows = vec![
        ("model", model.to_string()),
        ("backend", ctx.backend.clone()),
        ("devices", ctx.devices.clone()),
        ("world size", world.to_string()),
        (
            "train images",
            format!(
                "{} in {} classes ({})",
                train.folder().len(),
                train.folder().num_classes(),
                train.folder().root().display()
            ),
        ),
        (
            "val images",
            format!("{} ({})", val.folder().len(), val.folder().root().display()),
        ),
        ("image size", crate::datasets::describe_sizes(a)),
        (
            "batch",
            format!(
                "{} per process x {} per allreduce = {} global",
                a.batch_size, a.batches_per_allreduce, global_batch
            ),
        ),
        ("steps per epoch", steps_per_epoch.to_string()),
        ("lr", schedule.describe()),
        (
            "loss",
            if a.label_smoothing > 0.0 {
                format!("cross-entropy, label smoothing {}", a.label_smoothing)
            } else {
                "cross-entropy".to_string()
            },
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
    let lr_row = rows
        .iter()
        .position(|(k, _)| *k == "lr")
        .map_or(rows.len(), |i| i + 1);
    for (offset, row) in crate::optim::OptimizerSettings::from_args(a)
        .describe()
        .into_iter()
        .enumerate()
    {
        rows.insert(lr_row + offset, row);
    }
    rows.extend(crate::torchvision_flags::config_rows(a, world));
    let init = match (&a.weights, a.zero_init_residual) {
        (Some(w), _) => Some(format!("weights {}", w.display())),
        (None, true) => Some("zero-init residual BatchNorms".to_string()),
        (None, false) => None,
    };
    if let Some(init) = init {
        rows.insert(1, ("init", init));
    }
    if let Some(mixing) = crate::mix::describe(a) {
        let after_loss = rows
            .iter()
            .position(|(k, _)| *k == "loss")
            .map_or(rows.len(), |i| i + 1);
        rows.insert(after_loss, ("batch mixing", mixing));
    }
    let width = rows.iter().map(|(k, _)| k.len()).max().unwrap_or(0);
    for (key, value) in rows {
        println!("  {key:<width$}  {value}");
    }
}
