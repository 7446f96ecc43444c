//! [`TorchOptimizer`]: one Burn [`Optimizer`] for every `--opt`, walking the module once per step
//! (its path gives each parameter's weight-decay group), keyed by parameter id like Burn's own
//! optimizers, so that `burn_dist::DistributedOptimizer` wraps it and broadcasts its record.

use std::collections::HashMap;
use std::marker::PhantomData;

use burn::module::{AutodiffModule, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::{GradientsParams, MultiGradientsParams, Optimizer};
use burn::record::Record;
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};

use crate::optim::clip::{clip_factor, global_grad_norm};
use crate::optim::groups::ModulePath;
use crate::optim::settings::OptimizerSettings;
use crate::optim::update::{self, ParamState, Rule};

/// torch.optim's SGD, Nesterov SGD, RMSprop or AdamW over a Burn module, with torchvision's
/// weight-decay groups and optional global-norm gradient clipping.
pub struct TorchOptimizer<M, B: AutodiffBackend> {
    settings: OptimizerSettings,
    states: HashMap<ParamId, ParamState<B::InnerBackend>>,
    grad_norm: Option<Tensor<B::InnerBackend, 1>>,
    _module: PhantomData<fn() -> M>,
}

impl<M, B: AutodiffBackend> Clone for TorchOptimizer<M, B> {
    fn clone(&self) -> Self {
        Self {
            settings: self.settings,
            states: self.states.clone(),
            grad_norm: self.grad_norm.clone(),
            _module: PhantomData,
        }
    }
}

impl<M, B: AutodiffBackend> std::fmt::Debug for TorchOptimizer<M, B> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TorchOptimizer")
            .field("settings", &self.settings)
            .field("states", &self.states.len())
            .finish()
    }
}

impl<M, B: AutodiffBackend> TorchOptimizer<M, B> {
    /// An optimizer with no state yet (torch's, before its first step).
    pub fn new(settings: OptimizerSettings) -> Self {
        Self {
            settings,
            states: HashMap::new(),
            grad_norm: None,
            _module: PhantomData,
        }
    }

    /// Its settings.
    pub fn settings(&self) -> &OptimizerSettings {
        &self.settings
    }

    /// The total gradient norm before clipping at the last step, on the device (`[1]`); only
    /// computed with `--clip-grad-norm`.
    pub fn grad_norm(&self) -> Option<Tensor<B::InnerBackend, 1>> {
        self.grad_norm.clone()
    }

    /// The state of the parameter `id`, if it has taken a step.
    pub fn state(&self, id: ParamId) -> Option<&ParamState<B::InnerBackend>> {
        self.states.get(&id)
    }
}

/// One parameter's saved state.
#[derive(Record, Clone)]
pub struct ParamStateRecord<B: Backend> {
    /// The parameter id (`ParamId::val`).
    pub id: u64,
    /// Steps taken.
    pub step: u64,
    /// The state tensors, flattened, in [`ParamState::buffers`]'s order.
    pub buffers: Vec<Tensor<B, 1>>,
}

/// [`TorchOptimizer`]'s record: the `--opt` it was written by and every parameter's state, sorted
/// by id.
#[derive(Record, Clone)]
pub struct TorchOptimizerRecord<B: Backend> {
    /// The `--opt` name: a state is only loaded into the same optimizer.
    pub optimizer: String,
    /// Per-parameter states.
    pub states: Vec<ParamStateRecord<B>>,
}

impl<M, B> Optimizer<M, B> for TorchOptimizer<M, B>
where
    M: AutodiffModule<B>,
    B: AutodiffBackend,
{
    type Record = TorchOptimizerRecord<B>;

    fn step(&mut self, lr: f64, module: M, mut grads: GradientsParams) -> M {
        let factor = match self.settings.clip_grad_norm {
            Some(max_norm) => global_grad_norm::<B, M>(&module, &grads).map(|norm| {
                self.grad_norm = Some(norm.clone());
                clip_factor(norm, max_norm)
            }),
            None => None,
        };
        let mut mapper = StepMapper::<B> {
            rule: self.settings.rule(),
            settings: &self.settings,
            states: &mut self.states,
            grads: &mut grads,
            factor,
            lr,
            path: ModulePath::default(),
        };
        module.map(&mut mapper)
    }

    fn step_multi(&mut self, lr: f64, module: M, grads: MultiGradientsParams) -> M {
        // Gathered into one set first: the global norm needs every gradient before any update.
        struct Gather<B: AutodiffBackend> {
            from: MultiGradientsParams,
            into: GradientsParams,
            _b: PhantomData<B>,
        }
        impl<B: AutodiffBackend> ModuleVisitor<B> for Gather<B> {
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                if let Some((grad, _)) = self.from.remove::<B::InnerBackend, D>(param.id) {
                    self.into.register(param.id, grad);
                }
            }
        }
        let mut gather = Gather::<B> {
            from: grads,
            into: GradientsParams::new(),
            _b: PhantomData,
        };
        module.visit(&mut gather);
        self.step(lr, module, gather.into)
    }

    fn to_record(&self) -> Self::Record {
        let mut states: Vec<ParamStateRecord<B>> = self
            .states
            .iter()
            .map(|(id, state)| ParamStateRecord {
                id: id.val(),
                step: state.step,
                buffers: state
                    .buffers
                    .iter()
                    .map(|b| Tensor::from_inner(b.clone()))
                    .collect(),
            })
            .collect();
        states.sort_by_key(|s| s.id);
        TorchOptimizerRecord {
            optimizer: self.settings.kind.name().to_string(),
            states,
        }
    }

    fn load_record(mut self, record: Self::Record) -> Self {
        // Another optimizer's state has other buffers: start this one afresh (resume says so).
        self.states = if record.optimizer == self.settings.kind.name() {
            record
                .states
                .into_iter()
                .map(|s| {
                    let state = ParamState {
                        step: s.step,
                        buffers: s.buffers.into_iter().map(|b| b.inner()).collect(),
                    };
                    (ParamId::from(s.id), state)
                })
                .collect()
        } else {
            HashMap::new()
        };
        self
    }
}

struct StepMapper<'a, B: AutodiffBackend> {
    rule: Rule,
    settings: &'a OptimizerSettings,
    states: &'a mut HashMap<ParamId, ParamState<B::InnerBackend>>,
    grads: &'a mut GradientsParams,
    factor: Option<Tensor<B::InnerBackend, 1>>,
    lr: f64,
    path: ModulePath,
}

impl<B: AutodiffBackend> ModuleMapper<B> for StepMapper<'_, B> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, tensor, mapper) = param.consume();
        let Some(grad) = self.grads.remove::<B::InnerBackend, D>(id) else {
            return Param::from_mapped_value(id, tensor, mapper);
        };
        let require_grad = tensor.is_require_grad();
        let value = tensor.inner();
        let dims = value.dims();
        let numel = value.shape().num_elements();
        let mut grad = grad.reshape([numel]);
        if let Some(factor) = &self.factor {
            grad = grad * factor.clone();
        }
        let decay = self.settings.decay.decay(self.path.role());
        let (value, state) = update::step(
            self.rule,
            self.lr,
            decay,
            value.reshape([numel]),
            grad,
            self.states.remove(&id),
        );
        self.states.insert(id, state);
        let mut tensor = Tensor::from_inner(value.reshape(dims));
        if require_grad {
            tensor = tensor.require_grad();
        }
        Param::from_mapped_value(id, tensor, mapper)
    }
}
