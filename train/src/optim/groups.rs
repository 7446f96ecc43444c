//! Weight-decay groups as torchvision's `set_weight_decay` (references/classification/utils.py)
//! forms them, from the module path Burn reports while it walks a model, so that a user's own
//! model (through `ClassifierConfig`) is split the same way as the ResNets.
//!
//! torchvision's rule, in its order: a parameter named `bias` goes to the bias group when
//! `--bias-weight-decay` is given (a norm layer's bias too: the custom key is checked first);
//! otherwise a parameter of a normalisation layer goes to the norm group when
//! `--norm-weight-decay` is given; everything else gets `--wd`.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;
use burn::tensor::backend::Backend;

/// Burn's normalisation layers and ours (`models::nn::BatchNorm`), by type name: torchvision's
/// `norm_classes` (`_BatchNorm`, `LayerNorm`, `GroupNorm`, `_InstanceNorm`; Burn has no
/// `LocalResponseNorm`).
pub const NORM_LAYERS: &[&str] = &["BatchNorm", "LayerNorm", "GroupNorm", "InstanceNorm"];

/// What a parameter is, for the weight-decay split.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ParamRole {
    /// A normalisation layer's scale (`gamma`, torch's `weight`).
    NormWeight,
    /// A normalisation layer's shift (`beta`, torch's `bias`).
    NormBias,
    /// Any other parameter named `bias`.
    Bias,
    /// Everything else (conv and linear weights, ...).
    Other,
}

/// `--wd` and the optional decays of the norm and bias groups.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DecayGroups {
    /// `--wd`: every parameter not in another group.
    pub weight_decay: f64,
    /// `--norm-weight-decay`: normalisation layers' weights and biases (unset: `--wd`).
    pub norm: Option<f64>,
    /// `--bias-weight-decay`: every parameter named `bias` (unset: `--wd`).
    pub bias: Option<f64>,
}

impl DecayGroups {
    /// The weight decay of a parameter, by torchvision's precedence (bias key first).
    pub fn decay(&self, role: ParamRole) -> f64 {
        match (role, self.bias, self.norm) {
            (ParamRole::Bias | ParamRole::NormBias, Some(bias), _) => bias,
            (ParamRole::NormWeight | ParamRole::NormBias, _, Some(norm)) => norm,
            _ => self.weight_decay,
        }
    }
}

/// The module path of the tensor being visited or mapped, as Burn reports it through
/// `enter_module`/`exit_module`: (field or index, type of the container holding it).
#[derive(Debug, Default, Clone)]
pub(crate) struct ModulePath {
    stack: Vec<(String, String)>,
}

impl ModulePath {
    pub(crate) fn enter(&mut self, name: &str, container: &str) {
        self.stack.push((name.to_string(), container.to_string()));
    }

    pub(crate) fn exit(&mut self) {
        self.stack.pop();
    }

    fn in_norm_layer(&self) -> bool {
        self.stack.last().is_some_and(|(_, container)| {
            container
                .strip_prefix("Struct:")
                .is_some_and(|ty| NORM_LAYERS.contains(&ty))
        })
    }

    /// The parameter's name as torch would call it: a norm layer's `gamma`/`beta` are its
    /// `weight`/`bias`.
    fn torch_field(&self) -> &str {
        let field = self.stack.last().map_or("", |(field, _)| field.as_str());
        match (self.in_norm_layer(), field) {
            (true, "gamma") => "weight",
            (true, "beta") => "bias",
            (_, field) => field,
        }
    }

    /// The role of the tensor at this path.
    pub(crate) fn role(&self) -> ParamRole {
        match (self.in_norm_layer(), self.torch_field()) {
            (true, "bias") => ParamRole::NormBias,
            (true, _) => ParamRole::NormWeight,
            (false, "bias") => ParamRole::Bias,
            (false, _) => ParamRole::Other,
        }
    }

    /// The dotted path, torch-style (`layer1.0.bn1.weight`).
    pub(crate) fn name(&self) -> String {
        let mut parts: Vec<&str> = self.stack.iter().map(|(name, _)| name.as_str()).collect();
        if let Some(last) = parts.last_mut() {
            *last = self.torch_field();
        }
        parts.join(".")
    }
}

/// Every trainable parameter of `module` (buffers such as BatchNorm's running statistics are
/// left out: they are not trained) with its torch-style path and its role, in visit order.
pub fn param_roles<B: Backend, M: Module<B>>(module: &M) -> Vec<(String, ParamRole)> {
    struct Roles {
        path: ModulePath,
        roles: Vec<(String, ParamRole)>,
    }
    impl<B: Backend> ModuleVisitor<B> for Roles {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.enter(name, container_type);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if param.val().is_require_grad() {
                self.roles.push((self.path.name(), self.path.role()));
            }
        }
    }
    let mut roles = Roles {
        path: ModulePath::default(),
        roles: Vec::new(),
    };
    module.visit(&mut roles);
    roles.roles
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(entries: &[(&str, &str)]) -> ModulePath {
        let mut path = ModulePath::default();
        for (name, container) in entries {
            path.enter(name, container);
        }
        path
    }

    #[test]
    fn norm_layers_fields_take_torchs_names_and_roles() {
        let gamma = path(&[
            ("layer1", "Vec"),
            ("0", "Struct:Block"),
            ("bn1", "Struct:Block"),
        ]);
        // The field itself is entered with the norm layer as its container.
        let mut gamma = gamma;
        gamma.enter("gamma", "Struct:BatchNorm");
        assert_eq!(gamma.name(), "layer1.0.bn1.weight");
        assert_eq!(gamma.role(), ParamRole::NormWeight);
        let beta = path(&[("norm", "Struct:Net"), ("beta", "Struct:LayerNorm")]);
        assert_eq!(
            (beta.name(), beta.role()),
            ("norm.bias".into(), ParamRole::NormBias)
        );
        let bias = path(&[("fc", "Struct:ResNet"), ("bias", "Struct:Linear")]);
        assert_eq!(bias.role(), ParamRole::Bias);
        let weight = path(&[("fc", "Struct:ResNet"), ("weight", "Struct:Linear")]);
        assert_eq!(weight.role(), ParamRole::Other);
    }

    #[test]
    fn decays_follow_torchvisions_precedence() {
        let only_wd = DecayGroups {
            weight_decay: 0.1,
            norm: None,
            bias: None,
        };
        for role in [
            ParamRole::NormWeight,
            ParamRole::NormBias,
            ParamRole::Bias,
            ParamRole::Other,
        ] {
            assert_eq!(only_wd.decay(role), 0.1);
        }
        let norm = DecayGroups {
            norm: Some(0.0),
            ..only_wd
        };
        assert_eq!(norm.decay(ParamRole::NormBias), 0.0);
        assert_eq!(norm.decay(ParamRole::Bias), 0.1);
        let both = DecayGroups {
            bias: Some(0.5),
            ..norm
        };
        // The bias key wins over the norm class, as in set_weight_decay.
        assert_eq!(both.decay(ParamRole::NormBias), 0.5);
        assert_eq!(both.decay(ParamRole::NormWeight), 0.0);
        assert_eq!(both.decay(ParamRole::Other), 0.1);
    }
}
