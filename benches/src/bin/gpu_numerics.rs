//! CUDA against the CPU: the same seeded ResNet-18 and the same batch on Burn's CUDA backend and on
//! Flex. Logits, every gradient after one backward, and every parameter after one SGD step must
//! agree within relative L2 error bounds. Exit code 0 only if all three pass. Run by
//! `scripts/gpu-check.sh` on a GPU machine.
//!
//! Each conv path is bounded by what it computes, and the path that ran is printed:
//! - cuDNN in f32 (`--conv fast`, strict FMA math): the convs are f32, but Burn's matmul (the fc
//!   layer) may pick a TF32 tensor-core kernel (cubek-matmul's `adjust_dtypes`), so logits 3e-3,
//!   gradients 1e-2, parameters 2e-3;
//! - Burn's conv (`--conv burn`, or cuDNN missing): its implicit-GEMM convs switch to TF32 (10-bit
//!   mantissa) as well, so logits 2e-2, gradients 5e-2, parameters 5e-3;
//! - `--amp bf16`: cuDNN convs in bf16 (8-bit mantissa, f32 accumulation) against the f32 CPU:
//!   logits 3e-2, gradients 1e-1, parameters 1e-2.

use std::process::ExitCode;

#[cfg(feature = "cuda")]
fn main() -> ExitCode {
    use clap::Parser;
    #[derive(Parser)]
    struct Args {
        /// Print one JSON object.
        #[arg(long)]
        json: bool,
        /// Conv precision on the GPU: none (f32) or bf16.
        #[arg(long, default_value = "none")]
        amp: String,
        /// Conv on the GPU: fast (cuDNN) or burn (Burn's own kernels).
        #[arg(long, default_value = "fast")]
        conv: String,
    }
    let libs = burn_dist::cuda_libs::prepare();
    let args = Args::parse();
    let conv: models::OpImpl = match args.conv.parse() {
        Ok(c) => c,
        Err(e) => {
            eprintln!("gpu_numerics: --conv {}: {e}", args.conv);
            return ExitCode::FAILURE;
        }
    };
    models::set_conv_impl(conv);
    // SAFETY: only probes whether libcuda can be loaded; calls no CUDA function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!(
            "gpu_numerics: no CUDA driver (libcuda.so.1) on this machine; {}",
            libs.summary()
        );
        return ExitCode::FAILURE;
    }
    train::cuda_setup::keep_autotune_results();
    let cudnn = match (conv, models::conv::cudnn_unavailable()) {
        (models::OpImpl::Burn, _) => Err("--conv burn".to_string()),
        (_, Some(why)) => Err(why),
        (_, None) => Ok(()),
    };
    let (bounds, path) = match (args.amp.as_str(), &cudnn) {
        ("none", Ok(())) => (
            compare::CUDNN_F32_BOUNDS,
            "cuDNN f32 (FMA math; fc may be TF32)".to_string(),
        ),
        ("none", Err(why)) => (
            compare::BURN_TF32_BOUNDS,
            format!("Burn's conv, TF32 allowed ({why})"),
        ),
        ("bf16", Ok(())) => {
            models::set_conv_precision(models::ConvPrecision::Bf16);
            (
                compare::BF16_BOUNDS,
                "cuDNN bf16 (f32 accumulation)".to_string(),
            )
        }
        ("bf16", Err(why)) => {
            eprintln!("gpu_numerics: --amp bf16 needs cuDNN: {why}");
            return ExitCode::FAILURE;
        }
        (other, _) => {
            eprintln!("gpu_numerics: --amp {other}: expected none or bf16");
            return ExitCode::FAILURE;
        }
    };
    println!("conv path: {path}");
    match compare::run(bounds) {
        Ok(report) => {
            if args.json {
                println!(
                    "{{\"logits_rel_err\":{:.3e},\"grads_rel_err\":{:.3e},\"step_rel_err\":{:.3e},\"pass\":{}}}",
                    report.logits,
                    report.grads,
                    report.params,
                    report.pass()
                );
            } else {
                println!("# quantity            rel L2 error   bound");
                println!(
                    "  logits              {:>12.3e}   {:.0e}",
                    report.logits, report.bounds.logits
                );
                println!(
                    "  gradients           {:>12.3e}   {:.0e}",
                    report.grads, report.bounds.grads
                );
                println!(
                    "  params after step   {:>12.3e}   {:.0e}",
                    report.params, report.bounds.params
                );
            }
            if report.pass() {
                ExitCode::SUCCESS
            } else {
                eprintln!("gpu_numerics: CUDA and CPU disagree beyond the bounds");
                ExitCode::FAILURE
            }
        }
        Err(error) => {
            eprintln!("gpu_numerics: {error:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() -> ExitCode {
    eprintln!("gpu_numerics: built without the `cuda` feature");
    ExitCode::FAILURE
}

#[cfg(feature = "cuda")]
mod compare {
    use std::path::Path;

    use burn::backend::{Autodiff, Cuda, Flex};
    use burn::module::{Module, ModuleVisitor, Param};
    use burn::nn::loss::CrossEntropyLossConfig;
    use burn::optim::{GradientsParams, Optimizer, SgdConfig, momentum::MomentumConfig};
    use burn::tensor::backend::AutodiffBackend;
    use burn::tensor::{Int, Tensor, TensorData};
    use models::{ImageClassifier, ResNet, ResNetConfig, torchvision};

    /// Relative L2 error bounds of each quantity.
    #[derive(Clone, Copy)]
    pub struct Bounds {
        pub logits: f64,
        pub grads: f64,
        pub params: f64,
    }

    pub const CUDNN_F32_BOUNDS: Bounds = Bounds {
        logits: 3e-3,
        grads: 1e-2,
        params: 2e-3,
    };
    pub const BURN_TF32_BOUNDS: Bounds = Bounds {
        logits: 2e-2,
        grads: 5e-2,
        params: 5e-3,
    };
    pub const BF16_BOUNDS: Bounds = Bounds {
        logits: 3e-2,
        grads: 1e-1,
        params: 1e-2,
    };

    pub struct Report {
        pub logits: f64,
        pub grads: f64,
        pub params: f64,
        pub bounds: Bounds,
    }

    impl Report {
        pub fn pass(&self) -> bool {
            let b = &self.bounds;
            self.logits < b.logits && self.grads < b.grads && self.params < b.params
        }
    }

    struct Outcome {
        logits: Vec<f32>,
        grads: Vec<f32>,
        params: Vec<f32>,
    }

    fn rel_err(a: &[f32], b: &[f32]) -> f64 {
        let (mut diff, mut norm) = (0.0f64, 0.0f64);
        for (x, y) in a.iter().zip(b) {
            diff += (f64::from(*x) - f64::from(*y)).powi(2);
            norm += f64::from(*y).powi(2);
        }
        if a.len() != b.len() || a.iter().chain(b).any(|v| !v.is_finite()) {
            return f64::INFINITY;
        }
        (diff / norm.max(1e-30)).sqrt()
    }

    /// One forward, backward and SGD step of `weights` on `images`.
    fn step<B: AutodiffBackend>(
        weights: &[u8],
        images: TensorData,
        labels: TensorData,
        device: &B::Device,
    ) -> anyhow::Result<Outcome> {
        let model: ResNet<B> = ResNetConfig::resnet18(10).init(device);
        let model =
            torchvision::from_safetensors_bytes(model, weights, Path::new("<cpu model>"), device)?;
        let images = Tensor::<B, 4>::from_data(images, device);
        let labels = Tensor::<B, 1, Int>::from_data(labels, device);
        let logits = model.classify(images);
        let loss = CrossEntropyLossConfig::new()
            .init(device)
            .forward(logits.clone(), labels);
        let grads = GradientsParams::from_grads(loss.backward(), &model);

        struct Grads<'a, B: AutodiffBackend> {
            grads: &'a GradientsParams,
            out: Vec<f32>,
            _b: std::marker::PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Grads<'_, B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some(g) = self.grads.get::<B::InnerBackend, D>(param.id) {
                    self.out.extend(
                        g.into_data()
                            .convert::<f32>()
                            .to_vec::<f32>()
                            .unwrap_or_default(),
                    );
                }
            }
        }
        let mut visitor = Grads::<B> {
            grads: &grads,
            out: Vec::new(),
            _b: std::marker::PhantomData,
        };
        model.visit(&mut visitor);
        let grad_values = visitor.out;

        let mut sgd = SgdConfig::new()
            .with_momentum(Some(MomentumConfig::new().with_momentum(0.9)))
            .init();
        let model = sgd.step(0.1, model, grads);
        struct Values(Vec<f32>);
        impl<B: AutodiffBackend> ModuleVisitor<B> for Values {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                self.0.extend(
                    param
                        .val()
                        .into_data()
                        .convert::<f32>()
                        .to_vec::<f32>()
                        .unwrap_or_default(),
                );
            }
        }
        let mut values = Values(Vec::new());
        model.visit(&mut values);
        let params = values.0;
        Ok(Outcome {
            logits: logits
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap_or_default(),
            grads: grad_values,
            params,
        })
    }

    pub fn run(bounds: Bounds) -> anyhow::Result<Report> {
        let cpu = Default::default();
        <Autodiff<Flex> as burn::tensor::backend::Backend>::seed(&cpu, 7);
        let model: ResNet<Autodiff<Flex>> = ResNetConfig::resnet18(10).init(&cpu);
        let weights = torchvision::to_safetensors_bytes(&model)?;
        let n = 8 * 3 * 64 * 64;
        let pixels: Vec<f32> = (0..n)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let images = TensorData::new(pixels, [8, 3, 64, 64]);
        let labels = TensorData::new(vec![0i64, 3, 1, 4, 1, 5, 9, 2], [8]);

        let on_cpu = step::<Autodiff<Flex>>(&weights, images.clone(), labels.clone(), &cpu)?;
        let gpu = burn::backend::cuda::CudaDevice::new(0);
        let on_gpu = step::<Autodiff<Cuda>>(&weights, images, labels, &gpu)?;
        Ok(Report {
            logits: rel_err(&on_gpu.logits, &on_cpu.logits),
            grads: rel_err(&on_gpu.grads, &on_cpu.grads),
            params: rel_err(&on_gpu.params, &on_cpu.params),
            bounds,
        })
    }
}
