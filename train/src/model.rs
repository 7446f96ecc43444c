//! What `train` needs to know about a model: how to build it for a backend and a class count.

use burn::module::{AutodiffModule, Module, ModuleVisitor, Param};
use burn::tensor::backend::{AutodiffBackend, Backend};
use burn::tensor::{Bool, Int, Tensor};
use models::{ImageClassifier, ResNet, ResNetConfig};

/// A model family the trainer can build on any backend: implement it (one method and a name) for
/// your model's config to train your model with `train`'s loop, CLI and launcher. `Sync`: on the
/// CPU the loop reads it from a worker of rayon's pool ([`crate::cpu_pool`]).
pub trait ClassifierConfig: Sync {
    /// The model on backend `B`; validation runs its inner (no-autodiff) module.
    type Model<B: AutodiffBackend>: ImageClassifier<B>
        + AutodiffModule<B, InnerModule: ImageClassifier<B::InnerBackend>>;

    /// Builds the model with `num_classes` outputs on `device`.
    fn init<B: AutodiffBackend>(&self, num_classes: usize, device: &B::Device) -> Self::Model<B>;

    /// A short name for logs and the config table, e.g. `resnet50`.
    fn name(&self) -> String;

    /// The module path of the classifier head, which `--weights` may skip when its class count
    /// differs from the data's (fine-tuning). torchvision's ResNets call it `fc`.
    fn head(&self) -> String {
        "fc".into()
    }
}

/// The ResNets of the `models` crate, by depth.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ResNetFamily {
    /// 18, 34, 50, 101 or 152.
    pub depth: usize,
    /// Start each block's last BatchNorm at weight 0 (`--zero-init-residual`).
    pub zero_init_residual: bool,
}

impl ClassifierConfig for ResNetFamily {
    type Model<B: AutodiffBackend> = ResNet<B>;

    fn init<B: AutodiffBackend>(&self, num_classes: usize, device: &B::Device) -> ResNet<B> {
        let layout = match self.depth {
            18 => ResNetConfig::resnet18(num_classes),
            34 => ResNetConfig::resnet34(num_classes),
            101 => ResNetConfig::resnet101(num_classes),
            152 => ResNetConfig::resnet152(num_classes),
            _ => ResNetConfig::resnet50(num_classes),
        };
        layout
            .with_zero_init_residual(self.zero_init_residual)
            .init(device)
    }

    fn name(&self) -> String {
        format!("resnet{}", self.depth)
    }
}

/// Draws every parameter's initial value now, in the module's visit order. Burn initialises a
/// parameter lazily, at its first use, from the backend's global generator: the weights a seed
/// gives would otherwise depend on which code touches the parameters first, and one process (no
/// broadcast) started from other weights than several processes with the same `--seed`.
pub fn draw_parameters<B: Backend, M: Module<B>>(model: &M) {
    struct Draw;
    impl<B: Backend> ModuleVisitor<B> for Draw {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            let _ = param.val();
        }
        fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
            let _ = param.val();
        }
        fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
            let _ = param.val();
        }
    }
    model.visit(&mut Draw);
}

#[cfg(test)]
mod tests {
    use super::*;
    use burn::backend::{Autodiff, Flex};

    #[test]
    fn zero_init_residual_zeroes_each_blocks_last_norm_only() {
        let device = Default::default();
        for (zero, want) in [(true, 0.0f32), (false, 1.0)] {
            let family = ResNetFamily {
                depth: 18,
                zero_init_residual: zero,
            };
            let model = family.init::<Autodiff<Flex>>(4, &device);
            for block in model.layer1.iter().chain(&model.layer4) {
                let gamma: Vec<f32> = block.bn2.gamma.val().into_data().to_vec().expect("f32");
                assert!(gamma.iter().all(|&g| g == want), "zero-init {zero}");
                let first: Vec<f32> = block.bn1.gamma.val().into_data().to_vec().expect("f32");
                assert!(first.iter().all(|&g| g == 1.0));
            }
        }
    }
}
