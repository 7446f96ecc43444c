//! Module paths as torchvision names them.

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Tensor, backend::Backend};

pub(crate) const NUM_BATCHES_TRACKED: &str = "num_batches_tracked";

/// How a Burn parameter maps onto a torch key.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Layout {
    AsIs,
    /// A `Linear` weight: transposed between Burn and torch.
    Transposed,
}

/// Tracks the module path while Burn walks a module, and names each tensor as torch would.
#[derive(Default)]
pub(crate) struct PathTracker {
    /// (field or index name, type of the container that holds it)
    stack: Vec<(String, String)>,
}

impl PathTracker {
    pub(crate) fn enter(&mut self, name: &str, container: &str) {
        self.stack.push((name.to_string(), container.to_string()));
    }

    pub(crate) fn exit(&mut self) {
        self.stack.pop();
    }

    /// The torch key and layout of the tensor being visited.
    pub(crate) fn key(&self) -> (String, Layout) {
        let Some((field, container)) = self.stack.last() else {
            return (String::new(), Layout::AsIs);
        };
        let prefix: Vec<&str> = self.stack[..self.stack.len() - 1]
            .iter()
            .map(|(name, _)| name.as_str())
            .collect();
        let (name, layout) = match (container.as_str(), field.as_str()) {
            ("Struct:BatchNorm", "gamma") => ("weight", Layout::AsIs),
            ("Struct:BatchNorm", "beta") => ("bias", Layout::AsIs),
            ("Struct:Linear", "weight") => ("weight", Layout::Transposed),
            (_, field) => (field, Layout::AsIs),
        };
        let mut key = prefix.join(".");
        if !key.is_empty() {
            key.push('.');
        }
        key.push_str(name);
        (key, layout)
    }

    /// Whether the visited tensor is a buffer (BatchNorm running statistics), not a parameter.
    pub(crate) fn is_buffer(&self) -> bool {
        self.stack.last().is_some_and(|(field, container)| {
            container == "Struct:BatchNorm" && (field == "running_mean" || field == "running_var")
        })
    }

    /// `bn1.num_batches_tracked` when the visited tensor is a BatchNorm's `running_var`.
    pub(crate) fn batches_tracked_key(&self) -> Option<String> {
        let (field, container) = self.stack.last()?;
        (container == "Struct:BatchNorm" && field == "running_var").then(|| {
            let prefix: Vec<&str> = self.stack[..self.stack.len() - 1]
                .iter()
                .map(|(name, _)| name.as_str())
                .collect();
            format!("{}.{NUM_BATCHES_TRACKED}", prefix.join("."))
        })
    }
}

/// Number of trainable parameters, as torch's `sum(p.numel() for p in model.parameters())`:
/// BatchNorm running statistics are buffers and not counted (Burn's `num_params` counts them).
pub fn num_trainable_params<B: Backend, M: Module<B>>(module: &M) -> usize {
    struct Counter {
        path: PathTracker,
        count: usize,
    }
    impl<B: Backend> ModuleVisitor<B> for Counter {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.enter(name, container_type);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
            if !self.path.is_buffer() {
                self.count += param.lazy_shape().num_elements();
            }
        }
    }
    let mut counter = Counter {
        path: PathTracker::default(),
        count: 0,
    };
    module.visit(&mut counter);
    counter.count
}
