//! Training-step throughput of a ResNet: forward, backward and SGD step, img/s, with a fixed
//! in-memory batch (data excluded) and fed by the `data` pipeline (decode + train transforms,
//! data included).
//!
//! `cargo run --release -p benches --bin train_step -- --model resnet50 --batch 8 --image-size 224`
//!
//! `benches/compare_train_step.py` times PyTorch on the CPU with the same model and batch.
//! `--conv burn` and `--batch-norm burn` run Burn's own ops instead of ours, for comparison.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Context, bail};
use burn::module::AutodiffModule;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::optim::{GradientsParams, Optimizer};
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Distribution, Int, Tensor};
use clap::Parser;
use data::{DistributedSampler, ImageFolder, Loader, LoaderConfig};
use models::{ImageClassifier, OpImpl, ResNet, ResNetConfig};
use train::optim::{DecayGroups, OptimizerKind, OptimizerSettings, TorchOptimizer};

#[derive(Parser, Debug)]
#[command(about = "ResNet training-step throughput (forward + backward + SGD step)")]
struct Args {
    /// resnet18, resnet34, resnet50, resnet101 or resnet152.
    #[arg(long, default_value = "resnet50")]
    model: String,
    /// Images per step.
    #[arg(long, default_value_t = 8)]
    batch: usize,
    /// Square input size in pixels.
    #[arg(long, default_value_t = 224)]
    image_size: usize,
    /// Timed steps.
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Untimed steps first.
    #[arg(long, default_value_t = 2)]
    warmup: usize,
    /// flex (CPU), cuda (Burn's CUDA with fusion) or cuda-raw (CUDA without fusion).
    #[arg(long, default_value = "flex")]
    backend: String,
    /// Convolution: fast (our op: GEMM kernels on the CPU) or burn (Burn's own conv).
    #[arg(long, default_value = "fast")]
    conv: String,
    /// BatchNorm: fast (our op: fused kernels on the CPU) or burn (Burn's own).
    #[arg(long, default_value = "fast")]
    batch_norm: String,
    /// Mixed precision of the convs: none, or bf16 (cuDNN on CUDA: operands cast to bf16 inside
    /// the op, f32 accumulation, f32 parameters and optimizer state).
    #[arg(long, default_value = "none")]
    amp: String,
    /// Also checkpoint every N steps as `train --checkpoint-every N` does: the model and the
    /// optimizer copied to host memory at the step, the file written on a background thread
    /// (under the system's temp folder), so the step times include what a checkpoint costs the
    /// training thread.
    #[arg(long)]
    checkpoint_every: Option<usize>,
    /// The optimizer step, SGD with momentum 0.9 as `train` runs it (`train::optim`): `fused`
    /// (one in-place pass per parameter on Flex, the default) or `tensor` (Burn's tensor ops).
    #[arg(long, default_value = "fused")]
    update: String,
    /// glibc's allocator: `train` (kept freed memory, as `train` sets it up:
    /// `train::malloc`) or `default` (glibc's defaults).
    #[arg(long, default_value = "train")]
    malloc: String,
    /// The thread the Flex step runs on: `pool` (a worker of rayon's global pool, as `train`
    /// runs it: `train::cpu_pool`) or `main` (this process's main thread, each parallel op
    /// handed to the pool and waited for).
    #[arg(long, default_value = "pool")]
    step_thread: String,
    /// Print one JSON object instead of the table.
    #[arg(long)]
    json: bool,
    /// ImageFolder to feed the data-included figure; default: ImageNet-like JPEGs generated under
    /// target/bench-data.
    #[arg(long)]
    root: Option<PathBuf>,
    /// Decode threads of the data pipeline.
    #[arg(long, default_value_t = 2)]
    workers: usize,
    /// Skip the data-included figure.
    #[arg(long)]
    no_data: bool,
}

fn main() -> anyhow::Result<()> {
    #[cfg(feature = "cuda")]
    burn_dist::cuda_libs::prepare();
    let args = Args::parse();
    match args.malloc.as_str() {
        "train" => {
            train::malloc::keep_freed_memory();
        }
        "default" => {}
        other => bail!("--malloc {other}: expected train or default"),
    }
    let depth: usize = args
        .model
        .strip_prefix("resnet")
        .and_then(|d| d.parse().ok())
        .with_context(|| format!("--model {}: expected resnet18|34|50|101|152", args.model))?;
    let config = ResNetConfig::from_depth(depth, 1000)?;
    match args.update.as_str() {
        "fused" => train::optim::update::set_fused_update(true),
        "tensor" => train::optim::update::set_fused_update(false),
        other => bail!("--update {other}: expected fused or tensor"),
    }
    if args.batch == 0 || args.steps == 0 {
        bail!("--batch and --steps must be at least 1");
    }
    let conv: OpImpl = args
        .conv
        .parse()
        .with_context(|| format!("--conv {}", args.conv))?;
    models::set_conv_impl(conv);
    let batch_norm: OpImpl = args
        .batch_norm
        .parse()
        .with_context(|| format!("--batch-norm {}", args.batch_norm))?;
    models::set_batch_norm_impl(batch_norm);
    match args.amp.as_str() {
        "none" => {}
        "bf16" if args.backend == "flex" => bail!(
            "--amp bf16: bf16 convs run only on CUDA with cuDNN; use --amp none with --backend flex"
        ),
        "bf16" if conv == OpImpl::Burn => bail!(
            "--amp bf16: bf16 convs are our cuDNN op's; use --conv fast (or --amp none with \
             --conv burn)"
        ),
        "bf16" => models::set_conv_precision(models::ConvPrecision::Bf16),
        other => bail!("--amp {other}: expected none or bf16"),
    }
    match args.backend.as_str() {
        "flex" => {
            let step = || {
                run::<burn::backend::Autodiff<burn::backend::Flex>>(
                    &args,
                    &config,
                    Default::default(),
                )
            };
            match args.step_thread.as_str() {
                "pool" => train::cpu_pool::on_pool_worker(step),
                "main" => step(),
                other => bail!("--step-thread {other}: expected pool or main"),
            }
        }
        "cuda" | "cuda-raw" => run_cuda(&args, &config),
        other => bail!("--backend {other}: expected flex, cuda or cuda-raw"),
    }
}

#[cfg(feature = "cuda")]
fn run_cuda(args: &Args, config: &ResNetConfig) -> anyhow::Result<()> {
    // SAFETY: only probes whether libcuda can be loaded; calls no CUDA function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        bail!(
            "--backend {}: no CUDA driver (libcuda.so) found on this machine; use --backend flex",
            args.backend
        );
    }
    train::cuda_setup::keep_autotune_results();
    if args.backend == "cuda-raw" {
        run::<burn::backend::Autodiff<burn_dist::CudaRaw>>(args, config, Default::default())
    } else {
        run::<burn::backend::Autodiff<burn_dist::CudaFused>>(args, config, Default::default())
    }
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(args: &Args, _config: &ResNetConfig) -> anyhow::Result<()> {
    bail!(
        "--backend {}: this binary was built without the `cuda` feature; rebuild with it or use \
         --backend flex",
        args.backend
    )
}

fn run<B: AutodiffBackend>(
    args: &Args,
    config: &ResNetConfig,
    device: B::Device,
) -> anyhow::Result<()> {
    let images = Tensor::<B, 4>::random(
        [args.batch, 3, args.image_size, args.image_size],
        Distribution::Normal(0.0, 1.0),
        &device,
    );
    let labels =
        Tensor::<B, 1, Int>::random([args.batch], Distribution::Uniform(0.0, 1000.0), &device);
    let fixed = time_steps::<B>(args, config, &device, |_| {
        Ok((images.clone(), labels.clone()))
    })?;

    let fed = if args.no_data {
        None
    } else {
        let root = match &args.root {
            Some(root) => root.clone(),
            None => {
                let root = PathBuf::from("target/bench-data/imagenet-like-2000");
                data::synthetic::generate_imagenet_like(&root, 2000, 0)?;
                root
            }
        };
        let folder = ImageFolder::new(&root)?;
        let sampler = DistributedSampler::new(folder.len(), 1, 0)?;
        let mut loader = Loader::new(
            folder,
            sampler,
            LoaderConfig::train(args.image_size as u32, args.batch).with_workers(args.workers),
        )?;
        let mut epoch = 0u64;
        let mut batches = loader.epoch(epoch);
        Some(time_steps::<B>(args, config, &device, |_| {
            loop {
                match batches.next() {
                    Some(batch) => {
                        let batch = batch?;
                        if batch.len() == args.batch {
                            return Ok((
                                batch.images_tensor::<B>(&device),
                                batch.labels_tensor::<B>(&device),
                            ));
                        }
                    }
                    None => {
                        epoch += 1;
                        batches = loader.epoch(epoch);
                    }
                }
            }
        })?)
    };

    let ips = |t: f64| args.batch as f64 / t;
    let every_step_ms = fixed
        .every_step
        .iter()
        .map(|s| format!("{:.1}", s * 1e3))
        .collect::<Vec<_>>()
        .join(",");
    let fed_ips = fed.map(|t| ips(t.step));
    if args.json {
        println!(
            "{{\"model\":\"{}\",\"backend\":\"{}\",\"conv\":\"{}\",\"batch_norm\":\"{}\",\"amp\":\"{}\",\"batch\":{},\"image_size\":{},\"fwd_bwd_img_per_sec\":{:.3},\"step_img_per_sec\":{:.3},\"step_with_data_img_per_sec\":{},\"checkpoint_every\":{},\"every_step_ms\":[{}]}}",
            args.model,
            args.backend,
            args.conv,
            args.batch_norm,
            args.amp,
            args.batch,
            args.image_size,
            ips(fixed.fwd_bwd),
            ips(fixed.step),
            fed_ips.map_or("null".to_string(), |v| format!("{v:.3}")),
            args.checkpoint_every
                .map_or("null".to_string(), |n| n.to_string()),
            every_step_ms
        );
    } else {
        println!(
            "# model      backend  conv  bn    batch  size  fwd+bwd(img/s)  step(img/s)  step(ms)  step+data(img/s)"
        );
        println!(
            "  {:<10} {:<8} {:<4} {:<4} {:>5} {:>5} {:>15.2} {:>12.2} {:>9.1} {:>17}",
            args.model,
            args.backend,
            args.conv,
            args.batch_norm,
            args.batch,
            args.image_size,
            ips(fixed.fwd_bwd),
            ips(fixed.step),
            fixed.step * 1e3,
            fed_ips.map_or("-".to_string(), |v| format!("{v:.2}"))
        );
        println!("  every step (ms, warm-up first): {every_step_ms}");
    }
    Ok(())
}

/// Median seconds of the timed steps, and every step's seconds (warm-up included): on CUDA a
/// step that still compiles kernels stands out from the steady ones.
struct StepTimes {
    fwd_bwd: f64,
    step: f64,
    every_step: Vec<f64>,
}

/// Warm-up then timed steps of a fresh model; `next_batch` supplies each step's batch (its time
/// counts: that is the data-included figure).
fn time_steps<B: AutodiffBackend>(
    args: &Args,
    config: &ResNetConfig,
    device: &B::Device,
    mut next_batch: impl FnMut(usize) -> anyhow::Result<(Tensor<B, 4>, Tensor<B, 1, Int>)>,
) -> anyhow::Result<StepTimes> {
    B::seed(device, 0);
    let mut model: ResNet<B> = config.init(device);
    let loss_fn = CrossEntropyLossConfig::new().init(device);
    let mut optimizer = TorchOptimizer::<ResNet<B>, B>::new(OptimizerSettings {
        kind: OptimizerKind::Sgd,
        momentum: 0.9,
        decay: DecayGroups {
            weight_decay: 0.0,
            norm: None,
            bias: None,
        },
        clip_grad_norm: None,
    });
    let mut fwd_bwd = Vec::new();
    let mut step = Vec::new();
    let mut every_step = Vec::new();
    let mut checkpoints = args
        .checkpoint_every
        .filter(|n| *n > 0)
        .map(|every| -> anyhow::Result<_> {
            let dir = std::env::temp_dir().join(format!("train-step-ckpt-{}", std::process::id()));
            std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
            Ok((
                every,
                dir,
                train::checkpoint::writer::BackgroundWriter::default(),
            ))
        })
        .transpose()?;
    for i in 0..args.warmup + args.steps {
        let start = Instant::now();
        let (images, labels) = next_batch(i)?;
        let loss = loss_fn.forward(model.classify(images), labels);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        B::sync(device)?;
        let backward_done = start.elapsed();
        model = optimizer.step(0.01, model, grads);
        // Reading one value forces the step to finish on asynchronous backends.
        let _ = model.fc.bias.as_ref().map(|b| b.val().sum().into_scalar());
        if let Some((every, dir, writer)) = checkpoints.as_mut()
            && (i + 1) % *every == 0
        {
            let header = train::checkpoint::CheckpointHeader {
                epoch: 0,
                args: train::TrainArgs::parse_from(["train"]),
                world_size: 1,
                data_seed: 0,
                model_fingerprint: train::checkpoint::model_fingerprint(&model),
                sections: Vec::new(),
                history: Vec::new(),
                ema_n_averaged: None,
                mid_epoch: None,
            };
            let path = dir.join(format!("step-{}.ckpt", (i + 1) % 2));
            let encoded = train::checkpoint::encode(&path, header, &model, &optimizer, None)?;
            writer.submit(Box::new(move || encoded.write()))?;
            writer.check()?;
        }
        B::sync(device)?;
        every_step.push(start.elapsed().as_secs_f64());
        if i >= args.warmup {
            fwd_bwd.push(backward_done.as_secs_f64());
            step.push(start.elapsed().as_secs_f64());
        }
    }
    if let Some((_, dir, writer)) = checkpoints.as_mut() {
        writer.finish()?;
        let _ = std::fs::remove_dir_all(dir);
    }
    let _ = model.valid();
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    Ok(StepTimes {
        fwd_bwd: median(fwd_bwd),
        step: median(step),
        every_step,
    })
}
