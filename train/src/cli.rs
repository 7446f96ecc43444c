//! Command-line flags: Horovod's `pytorch_imagenet_resnet50.py` flags with its defaults, plus
//! the launcher's and the input pipeline's.

use std::path::{Path, PathBuf};

use clap::{Parser, ValueEnum};
use serde::{Deserialize, Serialize};

use crate::preemption::{CheckpointEvery, SaveSignal};

pub use crate::lr_plan::{LrScheduler, WarmupMethod};
pub use crate::optim::OptimizerKind;
pub use crate::torchvision_flags::Recipe;

/// How to treat an image file that cannot be decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum OnBadImage {
    /// Warn once per file, use the next good image instead, count skips per epoch.
    Skip,
    /// Stop at the first bad file, naming it.
    Strict,
}

/// What the learning rate does after the warmup.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum LrDecay {
    /// ×0.1 at epochs 30, 60 and 80 (Horovod's example, Goyal et al.).
    #[default]
    Step,
    /// Half a cosine from the peak to 0 at the last epoch, per batch (torchvision's references).
    Cosine,
}

/// Data-parallel ImageNet training, as Horovod's `pytorch_imagenet_resnet50.py`.
#[derive(Parser, Debug, Clone, Serialize, Deserialize)]
#[command(
    name = "train",
    version,
    about = "Data-parallel ImageNet training of ResNets on Burn (Horovod's ImageNet example).",
    long_about = "Data-parallel ImageNet training of ResNets on Burn (Horovod's ImageNet example).\n\n\
        With no ImageNet at --train-dir and no --train-dir given, trains a small ResNet on a \
        generated synthetic dataset (the quickstart)."
)]
pub struct TrainArgs {
    /// Path to training data (ImageFolder layout: <dir>/<class>/<image>).
    #[arg(long, default_value = "~/imagenet/train")]
    pub train_dir: PathBuf,
    /// Path to validation data (same layout, class sub-folders required).
    #[arg(long, default_value = "~/imagenet/validation")]
    pub val_dir: PathBuf,
    /// TensorBoard log directory.
    #[arg(long, default_value = "./logs")]
    pub log_dir: PathBuf,
    /// Checkpoint file name; `{epoch}` is replaced by the number of completed epochs.
    #[arg(long, default_value = "./checkpoint-{epoch}.ckpt")]
    pub checkpoint_format: String,
    /// Keep only the newest N checkpoints (default: keep all).
    #[arg(long)]
    pub keep_checkpoints: Option<usize>,
    /// Use fp16 compression during allreduce.
    #[arg(long)]
    pub fp16_allreduce: bool,
    /// Batches processed locally before each allreduce; it multiplies the total batch size.
    #[arg(long, default_value_t = 1)]
    pub batches_per_allreduce: usize,
    /// Divide gradients by this factor before the sum and by world/factor after.
    #[arg(long, default_value_t = 1.0)]
    pub gradient_predivide_factor: f64,
    /// Input batch size for training (per process, per sub-batch; torchvision's -b).
    #[arg(short = 'b', long, default_value_t = 32)]
    pub batch_size: usize,
    /// Input batch size for validation (per process).
    #[arg(long, default_value_t = 32)]
    pub val_batch_size: usize,
    /// Number of epochs to train.
    #[arg(long, default_value_t = 90)]
    pub epochs: usize,
    /// Learning rate for a single worker (Horovod's schedule; torchvision's total rate is --lr).
    #[arg(long, default_value_t = 0.0125)]
    pub base_lr: f64,
    /// Number of warmup epochs of Horovod's schedule: a per-batch ramp from --base-lr to
    /// --base-lr × world × --batches-per-allreduce. With one process there is nothing to ramp,
    /// so no warmup (torchvision's warmup is --lr-warmup-epochs).
    #[arg(long, default_value_t = 5.0)]
    pub warmup_epochs: f64,
    /// SGD momentum.
    #[arg(long, default_value_t = 0.9)]
    pub momentum: f64,
    /// Weight decay (torchvision's --weight-decay).
    #[arg(long, visible_alias = "weight-decay", default_value_t = 0.00005)]
    pub wd: f64,
    /// Disable CUDA training (train on the CPU).
    #[arg(long)]
    pub no_cuda: bool,
    /// Random seed (weights, sample order, augmentations).
    #[arg(long, default_value_t = 42)]
    pub seed: u64,
    /// Model: resnet18, resnet34, resnet50, resnet101 or resnet152.
    #[arg(long, default_value = "resnet50")]
    pub model: String,
    /// Square input size of training crops; validation resizes to size×256/224 then center-crops.
    #[arg(long, default_value_t = 224)]
    pub image_size: usize,
    /// Decoding threads per process (torchvision's -j).
    #[arg(short = 'j', long, default_value_t = 4)]
    pub workers: usize,
    /// What to do with an image file that cannot be decoded.
    #[arg(long, value_enum, default_value_t = OnBadImage::Skip)]
    pub on_bad_image: OnBadImage,
    /// Processes per node (default: one per visible GPU, or 1 without CUDA).
    #[arg(long)]
    pub nproc_per_node: Option<usize>,
    /// Number of nodes.
    #[arg(long, default_value_t = 1)]
    pub nnodes: usize,
    /// Rank of this node, 0..nnodes.
    #[arg(long, default_value_t = 0)]
    pub node_rank: usize,
    /// Address of node 0 (the rendezvous).
    #[arg(long, default_value = "127.0.0.1")]
    pub master_addr: String,
    /// Port of the rendezvous on node 0.
    #[arg(long, default_value_t = 29500)]
    pub master_port: u16,
    /// Job identity, the same on every node (torchrun's name); needed with --nnodes > 1 unless
    /// BURN_DIST_JOB_TOKEN is set on every node.
    #[arg(long)]
    pub rdzv_id: Option<String>,
    /// Stop after this many optimizer steps per epoch (for benchmarks and smoke tests).
    #[arg(long)]
    pub max_steps_per_epoch: Option<usize>,
    /// Start from these weights: a torchvision state_dict in safetensors (DDP's `module.` prefix
    /// accepted). When its `fc` has another number of classes than the data, `fc` keeps its
    /// initial values (fine-tuning). Ignored when resuming from a checkpoint.
    #[arg(long)]
    #[serde(default)]
    pub weights: Option<PathBuf>,
    /// Evaluate the validation set once and exit: the --weights if given, else the newest valid
    /// checkpoint. Prints top-1, top-5 and the image count.
    #[arg(long)]
    #[serde(default)]
    pub test_only: bool,
    /// Label smoothing of the cross-entropy loss, in [0, 1) (torchvision's references use 0.1).
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub label_smoothing: f64,
    /// Start each residual block's last BatchNorm at weight 0 (Goyal et al. 2017, §5.1).
    #[arg(long)]
    #[serde(default)]
    pub zero_init_residual: bool,
    /// Learning rate after the warmup: step (Horovod's) or cosine.
    #[arg(long, value_enum, default_value_t = LrDecay::Step)]
    #[serde(default)]
    pub lr_schedule: LrDecay,
    /// Horovod's Adasum reduction. Accepted so that Horovod command lines parse, then refused:
    /// burn-dist averages gradients and has no Adasum.
    #[arg(long)]
    #[serde(default)]
    pub use_adasum: bool,
    /// Resume even when the checkpoint was written with other learning-rate settings (world
    /// size, global batch, --base-lr, ...); the differences are printed.
    #[arg(long)]
    #[serde(default)]
    pub resume_anyway: bool,
    /// Convolution: fast (our op: GEMM kernels on the CPU) or burn (Burn's own conv, for
    /// comparison). Same numbers within float rounding; only the speed differs.
    #[arg(long, value_enum, default_value_t = OpChoice::Fast, env = "BURN_HOROVOD_CONV")]
    #[serde(default)]
    pub conv: OpChoice,
    /// BatchNorm: fast (our op: fused kernels on the CPU) or burn (Burn's own, for comparison).
    /// Same numbers within float rounding; only the speed differs.
    #[arg(
        long,
        value_enum,
        default_value_t = OpChoice::Fast,
        env = "BURN_HOROVOD_BATCHNORM"
    )]
    #[serde(default)]
    pub batch_norm: OpChoice,
    /// Mixed precision: bf16 runs the convs in bf16 through cuDNN (f32 accumulation; weights,
    /// gradients and optimizer state stay f32, no loss scaler), as torchvision's --amp in bf16.
    /// CUDA with --conv fast only. A bare --amp (torchvision's fp16 autocast) is refused.
    #[arg(
        long,
        value_enum,
        default_value_t = Amp::None,
        num_args = 0..=1,
        default_missing_value = "fp16"
    )]
    #[serde(default)]
    pub amp: Amp,
    /// Print the driver, GPUs, CUDA libraries and what a run would use, then exit (non-zero with
    /// the fix when something the run needs is missing).
    #[arg(long)]
    #[serde(skip)]
    pub check_env: bool,
    // torchvision's recipe: per-image augmentation and sizes (references/classification/train.py).
    /// Training crop side (default: --image-size).
    #[arg(long)]
    #[serde(default)]
    pub train_crop_size: Option<usize>,
    /// Validation resize of the shorter side (default: round(--image-size × 256 / 224)).
    #[arg(long)]
    #[serde(default)]
    pub val_resize_size: Option<usize>,
    /// Validation center-crop side (default: --image-size).
    #[arg(long)]
    #[serde(default)]
    pub val_crop_size: Option<usize>,
    /// Resize filter of the training crop and the validation resize (PIL's).
    #[arg(long, value_enum, default_value_t = Interp::Bilinear)]
    #[serde(default)]
    pub interpolation: Interp,
    /// JPEG decoding at 1/2, 1/4 or 1/8 of the size (DCT-domain downscaling): faithful scales
    /// only where the resize after it still shrinks 4x (pixels as close to torchvision's as a
    /// full decode; phone photos, not ImageNet's ~500x375 files), fast wherever the scaled image
    /// keeps the output size (as DALI and Pillow's draft; a few levels off), off never.
    #[arg(long, value_enum, default_value_t = DecodeScalingArg::Faithful)]
    #[serde(default)]
    pub decode_scaling: DecodeScalingArg,
    /// MiB per loader (each rank has a training and a validation loader) for remembering where
    /// each JPEG's MCU rows start, so that from the second epoch on a crop's decode skips the
    /// rows above it and the columns beside it (1.2 KB per 500x375 file: ImageNet's training set
    /// takes ~1.6 GB; files past the budget decode as in the first epoch). 0 turns it off; the
    /// batches are the same either way.
    #[arg(long, default_value_t = 2048)]
    #[serde(default = "default_scan_index_mib")]
    pub scan_index_mib: usize,
    /// Automatic augmentation after the crop and flip: ta_wide, ra or imagenet (AutoAugment).
    #[arg(long, value_enum)]
    #[serde(default)]
    pub auto_augment: Option<AutoAugmentPolicy>,
    /// RandAugment's magnitude bin, 0..=30.
    #[arg(long, default_value_t = 9)]
    #[serde(default = "default_ra_magnitude")]
    pub ra_magnitude: usize,
    /// RandomErasing probability after normalisation (the recipe uses 0.1).
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub random_erase: f64,
    /// Repeated-augmentation sampler (torchvision's RASampler) for training.
    #[arg(long)]
    #[serde(default)]
    pub ra_sampler: bool,
    /// Repetitions of each image per epoch with --ra-sampler.
    #[arg(long, default_value_t = 3)]
    #[serde(default = "default_ra_reps")]
    pub ra_reps: usize,
    // torchvision's recipe: LR schedule family, EMA, recipe, and train.py's other flag names
    // (references/classification/train.py). The --lr* flags are Options: giving any of them
    // selects torchvision's schedule (crate::lr_plan), whose defaults apply to the rest.
    /// torchvision's total peak learning rate (not multiplied by the world size; torchvision's
    /// default 0.1). Selects torchvision's per-epoch schedule instead of Horovod's; cannot be
    /// combined with --base-lr, --warmup-epochs or --lr-schedule.
    #[arg(long, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr: Option<f64>,
    /// torchvision's scheduler, stepped once per epoch [default: steplr]. Selects torchvision's
    /// schedule.
    #[arg(long, value_enum, ignore_case = true, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_scheduler: Option<LrScheduler>,
    /// StepLR's period in epochs [default: 30]. Selects torchvision's schedule.
    #[arg(long, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_step_size: Option<usize>,
    /// StepLR's and ExponentialLR's factor [default: 0.1]. Selects torchvision's schedule.
    #[arg(long, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_gamma: Option<f64>,
    /// CosineAnnealingLR's final rate (eta_min) [default: 0.0]. Selects torchvision's schedule.
    #[arg(long, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_min: Option<f64>,
    /// torchvision's warmup, in whole epochs, from lr × --lr-warmup-decay [default: 0]. Not an
    /// alias of Horovod's --warmup-epochs (a per-batch ramp from the single-worker rate): it
    /// selects torchvision's schedule.
    #[arg(long, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_warmup_epochs: Option<usize>,
    /// torchvision's warmup: linear (LinearLR) or constant (ConstantLR) [default: constant, as
    /// torchvision's]. Selects torchvision's schedule.
    #[arg(long, value_enum, ignore_case = true, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_warmup_method: Option<WarmupMethod>,
    /// The warmup's start factor (linear) or factor (constant) [default: 0.01]. Selects
    /// torchvision's schedule.
    #[arg(long, conflicts_with_all = HOROVOD_LR_FLAGS)]
    #[serde(default)]
    pub lr_warmup_decay: Option<f64>,
    /// Keep an exponential moving average of the weights and buffers (torchvision's
    /// ExponentialMovingAverage), validated every epoch (val/accuracy_ema), checkpointed, used by
    /// --test-only, and exported beside the model as <export>_ema.safetensors.
    #[arg(long)]
    #[serde(default)]
    pub model_ema: bool,
    /// Optimizer steps between two EMA updates.
    #[arg(long, default_value_t = 32)]
    #[serde(default = "default_model_ema_steps")]
    pub model_ema_steps: usize,
    /// EMA decay per update before torchvision's adjustment by world × per-process batch ×
    /// --model-ema-steps / --epochs.
    #[arg(long, default_value_t = 0.99998)]
    #[serde(default = "default_model_ema_decay")]
    pub model_ema_decay: f64,
    /// Set every flag of a published recipe that is not given on the command line (flags given
    /// win); the config table lists what it set.
    #[arg(long, value_enum)]
    #[serde(default)]
    pub recipe: Option<Recipe>,
    /// torchvision's dataset root: --train-dir <path>/train and --val-dir <path>/val.
    #[arg(long, conflicts_with_all = ["train_dir", "val_dir"])]
    #[serde(default)]
    pub data_path: Option<PathBuf>,
    /// torchvision's output folder: --log-dir <dir>/logs and --checkpoint-format
    /// <dir>/checkpoint-{epoch}.ckpt.
    #[arg(long, conflicts_with_all = ["log_dir", "checkpoint_format"])]
    #[serde(default)]
    pub output_dir: Option<PathBuf>,
    /// Resume from this checkpoint (one written by this program) instead of the newest valid one
    /// --checkpoint-format names.
    #[arg(long)]
    #[serde(default)]
    pub resume: Option<PathBuf>,
    /// torchvision's start epoch: only 0 is accepted (the start epoch comes from the checkpoint).
    #[arg(long, default_value_t = 0)]
    #[serde(default)]
    pub start_epoch: usize,
    /// Optimizer steps between two train/lr, train/img_per_sec, train/data_time points.
    #[arg(long, default_value_t = 10)]
    #[serde(default = "default_print_freq")]
    pub print_freq: usize,
    /// torchvision's device: cuda (the default: every visible GPU) or cpu (as --no-cuda).
    #[arg(long)]
    #[serde(default)]
    pub device: Option<String>,
    /// torchvision's SyncBatchNorm: refused (BatchNorm statistics are per process and averaged
    /// once per epoch).
    #[arg(long)]
    #[serde(default)]
    pub sync_bn: bool,
    /// torchvision's dataset cache: refused (images are decoded as they are read).
    #[arg(long)]
    #[serde(default)]
    pub cache_dataset: bool,
    /// torchvision's deterministic algorithms: accepted; runs here are deterministic anyway.
    #[arg(long)]
    #[serde(default)]
    pub use_deterministic_algorithms: bool,
    /// torchvision's process count: refused unless it equals what the launcher starts (use
    /// --nproc-per-node and --nnodes).
    #[arg(long)]
    #[serde(skip)]
    pub world_size: Option<usize>,
    /// torchvision's rendezvous: env:// accepted (torchrun's environment is read); others refused.
    #[arg(long)]
    #[serde(skip)]
    pub dist_url: Option<String>,
    /// torchvision's image backend: pil accepted (the decoding and transforms here are PIL's);
    /// tensor refused.
    #[arg(long)]
    #[serde(default)]
    pub backend: Option<String>,
    /// torchvision's transforms.v2 switch: accepted (one set of transforms here).
    #[arg(long)]
    #[serde(default)]
    pub use_v2: bool,

    // torchvision's recipe: optimizer, weight-decay groups, gradient clipping (`crate::optim`).
    /// Optimizer, as torchvision's train.py: sgd and sgd_nesterov (momentum --momentum), rmsprop
    /// (momentum --momentum, eps 0.0316, alpha 0.9), adamw (betas 0.9/0.999, eps 1e-8, decoupled
    /// weight decay).
    #[arg(long, value_enum, default_value_t = OptimizerKind::Sgd)]
    #[serde(default)]
    pub opt: OptimizerKind,
    /// Weight decay of normalisation layers' weights and biases (BatchNorm's gamma and beta), as
    /// torchvision's set_weight_decay (default: --wd).
    #[arg(long)]
    #[serde(default)]
    pub norm_weight_decay: Option<f64>,
    /// Weight decay of every parameter named `bias`, norm layers' biases included (it takes
    /// precedence over --norm-weight-decay, as in torchvision) (default: --wd).
    #[arg(long)]
    #[serde(default)]
    pub bias_weight_decay: Option<f64>,
    /// Scale the gradients so that their global L2 norm is at most this, after the allreduce
    /// (torch's clip_grad_norm_); the norm is logged as train/grad_norm (default: no clipping).
    #[arg(long)]
    #[serde(default)]
    pub clip_grad_norm: Option<f64>,
    // torchvision's recipe: batch mixing (Mixup and CutMix, see `crate::mix`).
    /// Mixup's α (0 = off; the recipe uses 0.2): each batch of --batch-size is mixed with itself
    /// rolled by one, λ ~ Beta(α, α), on the device after normalisation, and the loss takes the
    /// mixed one-hot targets (label smoothing applied on top, as torchvision). With
    /// --cutmix-alpha too, each batch gets one of the two with p = 0.5. Training accuracy is then
    /// counted against the class the mixed target peaks at, as torchvision's reference does.
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub mixup_alpha: f64,
    /// CutMix's α (0 = off; the recipe uses 1.0): a box of area (1 − λ), λ ~ Beta(α, α), of
    /// the batch rolled by one is pasted into each image, and the targets are mixed by the box's
    /// real (clipped) area. See --mixup-alpha for the rest.
    #[arg(long, default_value_t = 0.0)]
    #[serde(default)]
    pub cutmix_alpha: f64,
    // Preemption (`crate::preemption`).
    /// Also checkpoint in the middle of epochs: every N optimizer steps (500), or when this much
    /// time has passed since the last checkpoint (90s, 30m, 2h). A run resumes from the newest
    /// checkpoint at the exact batch it stopped at. --keep-checkpoints counts these too; without
    /// it, a mid-epoch checkpoint is removed once two newer ones exist.
    #[arg(long)]
    #[serde(default)]
    pub checkpoint_every: Option<CheckpointEvery>,
    /// Besides SIGTERM, this signal too makes every rank save a checkpoint at the next step and
    /// exit with code 75: USR1 for SLURM's --signal=USR1@120.
    #[arg(long, value_enum)]
    #[serde(default)]
    pub save_on_signal: Option<SaveSignal>,
}

/// Horovod's learning-rate flags, refused together with torchvision's.
const HOROVOD_LR_FLAGS: [&str; 3] = ["base_lr", "warmup_epochs", "lr_schedule"];

fn default_model_ema_steps() -> usize {
    32
}

fn default_model_ema_decay() -> f64 {
    0.99998
}

fn default_print_freq() -> usize {
    10
}

/// `--amp`: the precision of the convs.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Amp {
    /// Everything in f32.
    #[default]
    None,
    /// Convs in bf16 through cuDNN, f32 accumulation and master weights.
    Bf16,
    /// torchvision's bare `--amp`: fp16 autocast with a gradient scaler, not implemented
    /// (refused by [`TrainArgs::validate`]).
    #[value(hide = true)]
    Fp16,
}

fn default_scan_index_mib() -> usize {
    2048
}

fn default_ra_magnitude() -> usize {
    9
}

fn default_ra_reps() -> usize {
    3
}

/// `--interpolation` (PIL's filters, as torchvision's PIL path).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Interp {
    /// Antialiased bilinear (torchvision's default).
    #[default]
    Bilinear,
    /// Antialiased bicubic.
    Bicubic,
    /// Nearest neighbour.
    Nearest,
}

/// `--decode-scaling`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum DecodeScalingArg {
    /// Only where the output stays as close to torchvision's as a full decode.
    #[default]
    Faithful,
    /// Down to the output size.
    Fast,
    /// Never.
    Off,
}

impl From<DecodeScalingArg> for data::DecodeScaling {
    fn from(arg: DecodeScalingArg) -> Self {
        match arg {
            DecodeScalingArg::Faithful => data::DecodeScaling::Faithful,
            DecodeScalingArg::Fast => data::DecodeScaling::Fast,
            DecodeScalingArg::Off => data::DecodeScaling::Off,
        }
    }
}

/// `--auto-augment` (torchvision's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
pub enum AutoAugmentPolicy {
    /// TrivialAugmentWide.
    #[value(name = "ta_wide")]
    #[serde(rename = "ta_wide")]
    TaWide,
    /// RandAugment (2 ops at --ra-magnitude).
    #[value(name = "ra")]
    #[serde(rename = "ra")]
    Ra,
    /// AutoAugment with the ImageNet policy.
    #[value(name = "imagenet")]
    #[serde(rename = "imagenet")]
    Imagenet,
}

/// Whose kernels an op runs (`--conv`, `--batch-norm`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OpChoice {
    /// Our op (`models::conv`, `models::norm`): GEMM and fused kernels on the CPU.
    #[default]
    Fast,
    /// Burn's own op and its default gradients.
    Burn,
}

impl From<OpChoice> for models::OpImpl {
    fn from(choice: OpChoice) -> Self {
        match choice {
            OpChoice::Fast => models::OpImpl::Fast,
            OpChoice::Burn => models::OpImpl::Burn,
        }
    }
}

/// A flag value that cannot work, found before any work starts.
#[derive(Debug, thiserror::Error)]
#[error("invalid value for --{flag}: {reason}")]
pub struct InvalidArgs {
    /// The flag, without dashes.
    pub flag: &'static str,
    /// What is wrong and what to do.
    pub reason: String,
}

impl TrainArgs {
    /// Checks every value that can be checked without touching data; one clear error.
    ///
    /// # Errors
    /// [`InvalidArgs`] naming the first bad flag.
    pub fn validate(&self) -> Result<(), InvalidArgs> {
        let bad = |flag, reason: &str| {
            Err(InvalidArgs {
                flag,
                reason: reason.to_string(),
            })
        };
        let positive = [
            ("batch-size", self.batch_size),
            ("val-batch-size", self.val_batch_size),
            ("batches-per-allreduce", self.batches_per_allreduce),
            ("epochs", self.epochs),
            ("image-size", self.image_size),
            ("workers", self.workers),
            ("nnodes", self.nnodes),
        ];
        for (flag, value) in positive {
            if value == 0 {
                return bad(flag, "must be at least 1");
            }
        }
        if self.image_size < 32 {
            return bad(
                "image-size",
                "must be at least 32 pixels (a ResNet downsamples 32×)",
            );
        }
        for (flag, size) in [
            ("train-crop-size", self.train_crop_size),
            ("val-crop-size", self.val_crop_size),
        ] {
            if size.is_some_and(|s| s < 32) {
                return bad(
                    flag,
                    "must be at least 32 pixels (a ResNet downsamples 32×)",
                );
            }
        }
        if self.val_resize_size == Some(0) {
            return bad("val-resize-size", "must be at least 1");
        }
        if !(0.0..=1.0).contains(&self.random_erase) {
            return bad("random-erase", "must be a probability in [0, 1], e.g. 0.1");
        }
        if self.ra_magnitude > 30 {
            return bad(
                "ra-magnitude",
                "must be a magnitude bin in 0..=30 (31 bins)",
            );
        }
        if self.ra_reps == 0 {
            return bad("ra-reps", "must be at least 1");
        }
        if !(self.base_lr.is_finite() && self.base_lr > 0.0) {
            return bad("base-lr", "must be a positive number");
        }
        if !(self.warmup_epochs.is_finite() && self.warmup_epochs >= 0.0) {
            return bad("warmup-epochs", "must be zero or positive");
        }
        if !(0.0..1.0).contains(&self.momentum) {
            return bad("momentum", "must be in [0, 1)");
        }
        if !(self.wd.is_finite() && self.wd >= 0.0) {
            return bad("wd", "must be zero or positive");
        }
        if !(self.gradient_predivide_factor.is_finite() && self.gradient_predivide_factor > 0.0) {
            return bad("gradient-predivide-factor", "must be a positive number");
        }
        if self.node_rank >= self.nnodes {
            return bad("node-rank", "must be smaller than --nnodes");
        }
        if self.nproc_per_node == Some(0) {
            return bad("nproc-per-node", "must be at least 1");
        }
        if self.keep_checkpoints.is_some_and(|keep| keep < 2) {
            return bad(
                "keep-checkpoints",
                "must be at least 2, so that a damaged newest checkpoint has an older one to fall \
                 back on (omit it to keep all)",
            );
        }
        if !(0.0..1.0).contains(&self.label_smoothing) {
            return bad("label-smoothing", "must be in [0, 1), e.g. 0.1");
        }
        if self.use_adasum {
            return bad(
                "use-adasum",
                "Adasum is not implemented: burn-dist averages the gradients (Horovod's default \
                 op). Drop --use-adasum; the learning rate then scales with the world size, as \
                 without Adasum in Horovod's example",
            );
        }
        if self.max_steps_per_epoch == Some(0) {
            return bad("max-steps-per-epoch", "must be at least 1");
        }
        crate::mix::validate(self)?;
        if !self.checkpoint_format.contains("{epoch}") {
            return bad(
                "checkpoint-format",
                "must contain {epoch}, e.g. ./checkpoint-{epoch}.ckpt",
            );
        }
        let in_file_name = Path::new(&self.checkpoint_format)
            .file_name()
            .is_some_and(|n| n.to_string_lossy().contains("{epoch}"));
        if self.checkpoint_every.is_some() && !in_file_name {
            return bad(
                "checkpoint-every",
                "needs {epoch} in the file name of --checkpoint-format (not in a folder), e.g. \
                 ./checkpoints/ckpt-{epoch}.ckpt, so that mid-epoch checkpoints can be found",
            );
        }
        self.validate_torchvision()?;
        crate::optim::settings::validate(self)
    }

    /// The ResNet depth `--model` names, if it names one.
    pub fn resnet_depth(&self) -> Option<usize> {
        let depth = self.model.strip_prefix("resnet")?.parse().ok()?;
        [18, 34, 50, 101, 152].contains(&depth).then_some(depth)
    }

    /// The checkpoint path after `epoch` completed epochs.
    pub fn checkpoint_path(&self, epoch: usize) -> PathBuf {
        self.checkpoint_named(&epoch.to_string())
    }

    /// `--checkpoint-format` with `{epoch}` replaced by `name` (`3`, or `2-step500` in the
    /// middle of an epoch).
    pub fn checkpoint_named(&self, name: &str) -> PathBuf {
        expand_home(Path::new(&self.checkpoint_format.replace("{epoch}", name)))
    }

    /// Images per optimizer step over all `world_size` processes.
    pub fn global_batch(&self, world_size: usize) -> usize {
        self.batch_size * self.batches_per_allreduce * world_size
    }

    /// Where the final weights go: the last epoch's checkpoint path with the extension
    /// `.safetensors` (a torchvision `state_dict`, next to the checkpoints).
    pub fn export_path(&self) -> PathBuf {
        self.checkpoint_path(self.epochs)
            .with_extension("safetensors")
    }
}

/// `~/x` → `$HOME/x`, as Python's `os.path.expanduser` (Horovod's defaults use it).
pub fn expand_home(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// The flags as `train ARGS` would parse them (for this crate's unit tests).
    pub(crate) fn parse(args: &[&str]) -> TrainArgs {
        TrainArgs::try_parse_from(std::iter::once("train").chain(args.iter().copied()))
            .expect("parses")
    }

    #[test]
    fn defaults_are_horovods() {
        let a = parse(&[]);
        assert_eq!(a.train_dir, PathBuf::from("~/imagenet/train"));
        assert_eq!(a.val_dir, PathBuf::from("~/imagenet/validation"));
        assert_eq!(a.log_dir, PathBuf::from("./logs"));
        assert_eq!(a.batches_per_allreduce, 1);
        assert_eq!((a.batch_size, a.val_batch_size, a.epochs), (32, 32, 90));
        assert_eq!(
            (a.base_lr, a.warmup_epochs, a.momentum, a.wd),
            (0.0125, 5.0, 0.9, 0.00005)
        );
        assert_eq!((a.gradient_predivide_factor, a.seed), (1.0, 42));
        assert!(!a.fp16_allreduce && !a.no_cuda);
        assert_eq!(a.model, "resnet50");
        assert_eq!(a.lr_schedule, LrDecay::Step);
        assert_eq!((a.label_smoothing, a.zero_init_residual), (0.0, false));
        a.validate().expect("defaults are valid");
    }

    #[test]
    fn bad_values_name_the_flag() {
        for (args, flag) in [
            (&["--batch-size", "0"][..], "batch-size"),
            (&["--base-lr=-0.1"][..], "base-lr"),
            (
                &["--checkpoint-format", "ckpt.bin"][..],
                "checkpoint-format",
            ),
            (&["--nnodes", "2", "--node-rank", "2"][..], "node-rank"),
            (&["--keep-checkpoints", "1"][..], "keep-checkpoints"),
            (&["--label-smoothing", "1.0"][..], "label-smoothing"),
        ] {
            let error = parse(args).validate().expect_err("invalid");
            assert_eq!(error.flag, flag, "{args:?}");
            assert!(error.to_string().contains(flag));
        }
    }

    #[test]
    fn conv_and_batch_norm_default_to_fast_and_take_burn() {
        if std::env::var_os("BURN_HOROVOD_CONV").is_none() {
            assert_eq!(parse(&[]).conv, OpChoice::Fast);
        }
        if std::env::var_os("BURN_HOROVOD_BATCHNORM").is_none() {
            assert_eq!(parse(&[]).batch_norm, OpChoice::Fast);
        }
        let a = parse(&["--conv", "burn", "--batch-norm", "burn"]);
        assert_eq!(a.conv, OpChoice::Burn);
        assert_eq!(a.batch_norm, OpChoice::Burn);
        assert_eq!(models::OpImpl::from(a.conv), models::OpImpl::Burn);
        assert_eq!(models::OpImpl::from(OpChoice::Fast), models::OpImpl::Fast);
    }

    #[test]
    fn use_adasum_parses_and_is_refused_with_the_reason() {
        let error = parse(&["--use-adasum"]).validate().expect_err("refused");
        assert_eq!(error.flag, "use-adasum");
        assert!(error.reason.contains("not implemented"), "{error}");
    }

    #[test]
    fn args_saved_before_the_new_flags_still_read() {
        let mut saved = serde_json::to_value(parse(&[])).expect("json");
        let object = saved.as_object_mut().expect("object");
        for new in [
            "weights",
            "test_only",
            "label_smoothing",
            "zero_init_residual",
            "lr_schedule",
            "use_adasum",
            "resume_anyway",
            "train_crop_size",
            "val_resize_size",
            "val_crop_size",
            "interpolation",
            "decode_scaling",
            "scan_index_mib",
            "auto_augment",
            "ra_magnitude",
            "random_erase",
            "ra_sampler",
            "ra_reps",
            "lr",
            "lr_scheduler",
            "lr_step_size",
            "lr_gamma",
            "lr_min",
            "lr_warmup_epochs",
            "lr_warmup_method",
            "lr_warmup_decay",
            "model_ema",
            "model_ema_steps",
            "model_ema_decay",
            "recipe",
            "data_path",
            "output_dir",
            "resume",
            "start_epoch",
            "print_freq",
            "device",
            "sync_bn",
            "cache_dataset",
            "use_deterministic_algorithms",
            "backend",
            "use_v2",
            "opt",
            "norm_weight_decay",
            "bias_weight_decay",
            "clip_grad_norm",
            "checkpoint_every",
            "save_on_signal",
        ] {
            object.remove(new).expect(new);
        }
        let args: TrainArgs = serde_json::from_value(saved).expect("reads");
        assert_eq!((args.ra_magnitude, args.ra_reps), (9, 3));
        assert_eq!(args.lr_schedule, LrDecay::Step);
        assert!(args.weights.is_none() && !args.test_only);
        assert!(!args.model_ema && !args.uses_torchvision_lr());
        assert_eq!((args.model_ema_steps, args.model_ema_decay), (32, 0.99998));
        assert_eq!(args.print_freq, 10);
        assert_eq!(args.opt, OptimizerKind::Sgd);
    }

    #[test]
    fn recipe_flags_take_torchvisions_names() {
        let a = parse(&[
            "--auto-augment",
            "ta_wide",
            "--random-erase",
            "0.1",
            "--train-crop-size",
            "176",
            "--val-resize-size",
            "232",
            "--interpolation",
            "bicubic",
            "--decode-scaling",
            "fast",
            "--ra-sampler",
            "--ra-reps",
            "4",
        ]);
        assert_eq!(a.auto_augment, Some(AutoAugmentPolicy::TaWide));
        assert_eq!(
            (a.train_crop_size, a.val_resize_size),
            (Some(176), Some(232))
        );
        assert_eq!(
            (a.interpolation, a.ra_sampler, a.ra_reps),
            (Interp::Bicubic, true, 4)
        );
        assert_eq!(a.decode_scaling, DecodeScalingArg::Fast);
        assert_eq!(parse(&[]).decode_scaling, DecodeScalingArg::Faithful);
        a.validate().expect("valid");
        for (args, flag) in [
            (&["--random-erase", "1.5"][..], "random-erase"),
            (&["--ra-magnitude", "31"][..], "ra-magnitude"),
            (&["--train-crop-size", "16"][..], "train-crop-size"),
        ] {
            assert_eq!(parse(args).validate().expect_err("invalid").flag, flag);
        }
    }

    #[test]
    fn checkpoint_path_fills_in_the_epoch() {
        let a = parse(&["--checkpoint-format", "/tmp/run/ckpt-{epoch}.ckpt"]);
        assert_eq!(a.checkpoint_path(7), PathBuf::from("/tmp/run/ckpt-7.ckpt"));
    }
}
