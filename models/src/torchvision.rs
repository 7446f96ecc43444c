//! Weights in and out as a torchvision `state_dict` in safetensors.
//!
//! Burn and PyTorch name and lay out two things differently, and only those are translated:
//! a BatchNorm's `gamma`/`beta` are torch's `weight`/`bias` (torch also keeps an int64
//! `num_batches_tracked`, which Burn's momentum-based BatchNorm has no use for: it is written as 0
//! and ignored on load), and a `Linear` weight is stored `[in, out]` in Burn and `[out, in]` in torch.
//! Everything else is the module path, which for our models is torchvision's already. Values are
//! copied as they are: our BatchNorm's `running_var` is torch's (the unbiased variance folded with
//! `momentum`), so it is neither rescaled on load nor on export.
//!
//! Files saved from a model wrapped in PyTorch's `DistributedDataParallel` carry a `module.`
//! prefix on every key; [`load`] accepts them as they are. Fine-tuning onto another class count
//! loads everything but the classifier head with [`load_with`] and
//! [`LoadOptions::skip_mismatched`].

use std::collections::{BTreeMap, HashMap};
use std::path::Path;

use burn::module::{Module, ModuleMapper, ModuleVisitor, Param};
use burn::tensor::{Tensor, TensorData, backend::Backend};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};

use crate::ModelError;
use crate::path::{Layout, NUM_BATCHES_TRACKED, PathTracker};

struct Entry {
    shape: Vec<usize>,
    dtype: Dtype,
    bytes: Vec<u8>,
}

struct Exporter {
    path: PathTracker,
    tensors: BTreeMap<String, Entry>,
}

impl<B: Backend> ModuleVisitor<B> for Exporter {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let (key, layout) = self.path.key();
        let mut tensor = param.val();
        if layout == Layout::Transposed {
            tensor = tensor.transpose();
        }
        let shape = tensor.dims().to_vec();
        let data = tensor.into_data().convert::<f32>();
        let values: Vec<f32> = data.to_vec().unwrap_or_default();
        self.tensors.insert(
            key,
            Entry {
                shape,
                dtype: Dtype::F32,
                bytes: bytemuck::cast_slice(&values).to_vec(),
            },
        );
        if let Some(key) = self.path.batches_tracked_key() {
            self.tensors.insert(
                key,
                Entry {
                    shape: Vec::new(),
                    dtype: Dtype::I64,
                    bytes: 0i64.to_le_bytes().to_vec(),
                },
            );
        }
    }
}

/// The torchvision `state_dict` keys of a module, in Burn's visit order, `num_batches_tracked`
/// included.
pub fn state_dict_keys<B: Backend, M: Module<B>>(module: &M) -> Vec<String> {
    struct Keys {
        path: PathTracker,
        keys: Vec<String>,
    }
    impl<B: Backend> ModuleVisitor<B> for Keys {
        fn enter_module(&mut self, name: &str, container_type: &str) {
            self.path.enter(name, container_type);
        }
        fn exit_module(&mut self, _name: &str, _container_type: &str) {
            self.path.exit();
        }
        fn visit_float<const D: usize>(&mut self, _param: &Param<Tensor<B, D>>) {
            self.keys.push(self.path.key().0);
            self.keys.extend(self.path.batches_tracked_key());
        }
    }
    let mut keys = Keys {
        path: PathTracker::default(),
        keys: Vec::new(),
    };
    module.visit(&mut keys);
    keys.keys
}

/// Serialises a module's weights as a torchvision `state_dict` in safetensors format.
///
/// # Errors
/// [`ModelError::Format`] if the tensors cannot be serialised.
pub fn to_safetensors_bytes<B: Backend, M: Module<B>>(module: &M) -> Result<Vec<u8>, ModelError> {
    // Burn keeps a running state's latest update per thread until something syncs it, and a
    // visitor reads the synced value: without this, BatchNorm's running statistics would be
    // exported one training step old. Clones share the states, so the clone's `into_record`
    // syncs `module`'s.
    let _ = module.clone().into_record();
    let mut exporter = Exporter {
        path: PathTracker::default(),
        tensors: BTreeMap::new(),
    };
    module.visit(&mut exporter);
    let mut views = Vec::with_capacity(exporter.tensors.len());
    for (key, entry) in &exporter.tensors {
        let view =
            TensorView::new(entry.dtype, entry.shape.clone(), &entry.bytes).map_err(|e| {
                ModelError::Format {
                    path: key.into(),
                    reason: e.to_string(),
                }
            })?;
        views.push((key.clone(), view));
    }
    safetensors::serialize(views, None).map_err(|e| ModelError::Format {
        path: "<memory>".into(),
        reason: e.to_string(),
    })
}

/// Writes a module's weights to `path` as a torchvision `state_dict` in safetensors format
/// (readable by `torchvision.models.resnet50().load_state_dict(safetensors.torch.load_file(p))`).
///
/// # Errors
/// [`ModelError::Io`] if the file cannot be written.
pub fn save<B: Backend, M: Module<B>>(module: &M, path: &Path) -> Result<(), ModelError> {
    let bytes = to_safetensors_bytes(module)?;
    std::fs::write(path, bytes).map_err(|source| ModelError::Io {
        op: "write",
        path: path.to_path_buf(),
        source,
    })
}

/// DDP's prefix: `torch.nn.parallel.DistributedDataParallel(model).state_dict()` names every
/// tensor `module.<key>`.
pub const DDP_PREFIX: &str = "module.";

/// How [`load_with`] treats a file that does not fit the model exactly.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadOptions {
    /// Module paths (e.g. `fc`) whose tensors keep the model's own values when the file's shape
    /// differs, instead of failing: fine-tuning a classifier onto another number of classes. Every
    /// other shape difference is still an error.
    pub skip_mismatched: Vec<String>,
}

/// A tensor of the file that [`load_with`] left out because its shape does not fit.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SkippedTensor {
    /// The torchvision key (without DDP's `module.` prefix).
    pub key: String,
    /// Its shape in the file.
    pub file_shape: Vec<usize>,
    /// The model's shape (torch layout), which kept its initial values.
    pub model_shape: Vec<usize>,
}

/// What [`load_with`] did besides loading.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LoadReport {
    /// Whether the keys carried DDP's `module.` prefix.
    pub stripped_ddp_prefix: bool,
    /// Tensors left out under [`LoadOptions::skip_mismatched`].
    pub skipped: Vec<SkippedTensor>,
}

/// Loads weights saved by [`save`] or by torchvision (`safetensors.torch.save_file(model.state_dict())`),
/// with or without DDP's `module.` prefix.
///
/// Every parameter of the module must be in the file and every key of the file in the module
/// (`num_batches_tracked` aside), with the same shapes; F32, F64, F16 and BF16 tensors are accepted.
///
/// # Errors
/// [`ModelError::Io`], [`ModelError::Format`], [`ModelError::ShapeMismatch`] naming the first
/// offending key, or [`ModelError::KeyMismatch`] listing every missing and unknown key.
pub fn load<B: Backend, M: Module<B>>(
    module: M,
    path: &Path,
    device: &B::Device,
) -> Result<M, ModelError> {
    load_with(module, path, device, &LoadOptions::default()).map(|(module, _)| module)
}

/// [`load`] with options: tensors under [`LoadOptions::skip_mismatched`] whose shape differs are
/// left as initialised and listed in the report.
///
/// # Errors
/// As [`load`].
pub fn load_with<B: Backend, M: Module<B>>(
    module: M,
    path: &Path,
    device: &B::Device,
    options: &LoadOptions,
) -> Result<(M, LoadReport), ModelError> {
    let bytes = std::fs::read(path).map_err(|source| ModelError::Io {
        op: "read",
        path: path.to_path_buf(),
        source,
    })?;
    from_safetensors_bytes_with(module, &bytes, path, device, options)
}

/// [`load`] from bytes in memory; `path` only names the source in errors.
///
/// # Errors
/// As [`load`].
pub fn from_safetensors_bytes<B: Backend, M: Module<B>>(
    module: M,
    bytes: &[u8],
    path: &Path,
    device: &B::Device,
) -> Result<M, ModelError> {
    from_safetensors_bytes_with(module, bytes, path, device, &LoadOptions::default())
        .map(|(module, _)| module)
}

/// [`load_with`] from bytes in memory; `path` only names the source in errors.
///
/// # Errors
/// As [`load`].
pub fn from_safetensors_bytes_with<B: Backend, M: Module<B>>(
    module: M,
    bytes: &[u8],
    path: &Path,
    device: &B::Device,
    options: &LoadOptions,
) -> Result<(M, LoadReport), ModelError> {
    let file = SafeTensors::deserialize(bytes).map_err(|e| ModelError::Format {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    let all = file.tensors();
    // DDP's prefix is all or nothing: a file where only some keys carry it is not DDP's.
    let stripped_ddp_prefix = !all.is_empty() && all.iter().all(|(k, _)| k.starts_with(DDP_PREFIX));
    let mut tensors = HashMap::new();
    for (key, view) in all {
        let key = if stripped_ddp_prefix {
            key[DDP_PREFIX.len()..].to_string()
        } else {
            key
        };
        if key.ends_with(NUM_BATCHES_TRACKED) {
            continue;
        }
        tensors.insert(key, view);
    }

    let mut importer = Importer {
        path: PathTracker::default(),
        file: path,
        tensors,
        missing: Vec::new(),
        skipped: Vec::new(),
        skip_mismatched: &options.skip_mismatched,
        error: None,
        device: device.clone(),
    };
    let module = module.map(&mut importer);
    if let Some(error) = importer.error {
        return Err(error);
    }
    if !importer.missing.is_empty() || !importer.tensors.is_empty() {
        let mut unexpected: Vec<String> = importer.tensors.into_keys().collect();
        unexpected.sort();
        return Err(ModelError::KeyMismatch {
            path: path.to_path_buf(),
            missing: importer.missing,
            unexpected,
        });
    }
    Ok((
        module,
        LoadReport {
            stripped_ddp_prefix,
            skipped: importer.skipped,
        },
    ))
}

struct Importer<'a, B: Backend> {
    path: PathTracker,
    file: &'a Path,
    /// Tensors not yet claimed by a parameter.
    tensors: HashMap<String, TensorView<'a>>,
    missing: Vec<String>,
    skipped: Vec<SkippedTensor>,
    skip_mismatched: &'a [String],
    error: Option<ModelError>,
    device: B::Device,
}

impl<B: Backend> Importer<'_, B> {
    fn take<const D: usize>(&mut self, expected: [usize; D]) -> Option<Tensor<B, D>> {
        let (key, layout) = self.path.key();
        let Some(view) = self.tensors.remove(&key) else {
            self.missing.push(key);
            return None;
        };
        let mut torch_shape = expected;
        if layout == Layout::Transposed {
            torch_shape.reverse();
        }
        let values = decode_f32(&view);
        let under_skip = |prefix: &String| {
            key == *prefix
                || key
                    .strip_prefix(prefix.as_str())
                    .is_some_and(|r| r.starts_with('.'))
        };
        if view.shape() != torch_shape && self.skip_mismatched.iter().any(under_skip) {
            self.skipped.push(SkippedTensor {
                key,
                file_shape: view.shape().to_vec(),
                model_shape: torch_shape.to_vec(),
            });
            return None;
        }
        if view.shape() != torch_shape || values.is_none() {
            self.error.get_or_insert(ModelError::ShapeMismatch {
                path: self.file.to_path_buf(),
                key,
                expected: torch_shape.to_vec(),
                got: view.shape().to_vec(),
                dtype: format!("{:?}", view.dtype()),
            });
            return None;
        }
        let data = TensorData::new(values.unwrap_or_default(), torch_shape);
        let tensor = Tensor::<B, D>::from_data(data, &self.device);
        Some(match layout {
            Layout::AsIs => tensor,
            Layout::Transposed => tensor.transpose(),
        })
    }
}

impl<B: Backend> ModuleMapper<B> for Importer<'_, B> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.path.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.path.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let (id, old, mapper) = param.consume();
        let require_grad = old.is_require_grad();
        let value = match self.take::<D>(old.dims()) {
            Some(new) => new.to_device(&old.device()).set_require_grad(require_grad),
            None => old,
        };
        Param::from_mapped_value(id, value, mapper)
    }
}

/// The values of a floating-point tensor as f32, or `None` for other dtypes.
fn decode_f32(view: &TensorView<'_>) -> Option<Vec<f32>> {
    let bytes = view.data();
    let values = match view.dtype() {
        Dtype::F32 => bytes
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::F64 => bytes
            .chunks_exact(8)
            .map(|b| f64::from_le_bytes([b[0], b[1], b[2], b[3], b[4], b[5], b[6], b[7]]) as f32)
            .collect(),
        Dtype::F16 => bytes
            .chunks_exact(2)
            .map(|b| burn::tensor::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::BF16 => bytes
            .chunks_exact(2)
            .map(|b| burn::tensor::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    };
    Some(values)
}
