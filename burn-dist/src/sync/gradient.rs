//! Gradient synchronisation: walk the model's parameters in visit order (never by `ParamId`, which
//! is random per process), fuse their gradients into size-bounded buckets, all-reduce each bucket
//! as an average, and register the results back (Horovod's tensor fusion, DDP's buckets).

use crate::comm::{Communicator, CommunicatorExt, ReduceOp};
use crate::error::{DistError, Result};
use crate::sync::tensor::{CollectiveBackend, Compression};
use burn::module::{AutodiffModule, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::backend::AutodiffBackend;
use burn::tensor::{Tensor, TensorData};
use std::collections::HashMap;
use std::sync::Arc;

/// Default bucket size, as DDP's `bucket_cap_mb` (25 MiB).
pub const DEFAULT_BUCKET_BYTES: usize = 25 << 20;

/// Options of [`GradientSync`].
#[derive(Debug, Clone, PartialEq)]
pub struct SyncConfig {
    /// Largest fused bucket in bytes (f32 gradients); a larger single tensor gets its own bucket.
    pub bucket_bytes: usize,
    /// Element type on the wire.
    pub compression: Compression,
    /// Horovod's `gradient_predivide_factor`: divide by `f` before the sum and by `world / f` after.
    pub gradient_predivide_factor: f64,
}

impl Default for SyncConfig {
    fn default() -> Self {
        Self {
            bucket_bytes: DEFAULT_BUCKET_BYTES,
            compression: Compression::None,
            gradient_predivide_factor: 1.0,
        }
    }
}

/// One line per float parameter, in visit order: `path shape dtype kind`.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct Fingerprint {
    /// The entries.
    pub entries: Vec<String>,
}

impl Fingerprint {
    /// Computes the fingerprint of `module`'s float parameters (trainable ones and buffers).
    pub fn of<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(module: &M) -> Self {
        struct V {
            path: Vec<String>,
            entries: Vec<String>,
        }
        impl<B: burn::tensor::backend::Backend> ModuleVisitor<B> for V {
            fn enter_module(&mut self, name: &str, _: &str) {
                self.path.push(name.to_string());
            }
            fn exit_module(&mut self, _: &str, _: &str) {
                self.path.pop();
            }
            fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
                let t = param.val();
                let kind = if t.is_require_grad() {
                    "param"
                } else {
                    "buffer"
                };
                self.entries.push(format!(
                    "{} {:?} {:?} {kind}",
                    self.path.join("."),
                    t.dims(),
                    t.dtype()
                ));
            }
        }
        let mut v = V {
            path: Vec::new(),
            entries: Vec::new(),
        };
        module.visit(&mut v);
        Self { entries: v.entries }
    }

    fn to_bytes(&self) -> Vec<u8> {
        self.entries.join("\n").into_bytes()
    }

    fn from_bytes(b: &[u8]) -> Self {
        let s = String::from_utf8_lossy(b);
        Self {
            entries: if s.is_empty() {
                Vec::new()
            } else {
                s.split('\n').map(str::to_string).collect()
            },
        }
    }

    /// The first difference with `other`, described for a human.
    pub fn first_difference(&self, other: &Self) -> Option<String> {
        for (i, (a, b)) in self.entries.iter().zip(&other.entries).enumerate() {
            if a != b {
                return Some(format!("parameter #{i}: {a:?} vs {b:?}"));
            }
        }
        match self.entries.len().cmp(&other.entries.len()) {
            std::cmp::Ordering::Equal => None,
            _ => Some(format!(
                "{} float parameters vs {} (first extra: {:?})",
                self.entries.len(),
                other.entries.len(),
                self.entries
                    .get(other.entries.len())
                    .or(other.entries.get(self.entries.len()))
            )),
        }
    }
}

/// Checks that every rank has the same model (paths, shapes, dtypes in visit order); on a
/// mismatch, every rank returns the same error naming the first difference.
///
/// # Errors
/// [`DistError::ModelMismatch`], or the communicator's error.
pub fn verify_same_model<B: burn::tensor::backend::Backend, M: burn::module::Module<B>>(
    comm: &dyn Communicator,
    module: &M,
) -> Result<()> {
    if comm.world_size() == 1 {
        return Ok(());
    }
    let fp = Fingerprint::of::<B, M>(module);
    let bytes = fp.to_bytes();
    let lens = comm.all_gather_vec(&[bytes.len() as i64])?;
    let max = lens.iter().copied().max().unwrap_or(0).max(0) as usize;
    let mut padded = bytes.clone();
    padded.resize(max, 0);
    let all = comm.all_gather_vec(&padded)?;
    let fps: Vec<Fingerprint> = lens
        .iter()
        .enumerate()
        .map(|(r, l)| Fingerprint::from_bytes(&all[r * max..r * max + (*l).max(0) as usize]))
        .collect();
    for (r, other) in fps.iter().enumerate().skip(1) {
        if let Some(diff) = fps[0].first_difference(other) {
            let (rank, other_rank) = if comm.rank() == r {
                (r, 0)
            } else {
                (comm.rank(), r)
            };
            let difference = format!("rank 0 vs rank {r}: {diff}");
            return Err(DistError::ModelMismatch {
                rank,
                other_rank,
                difference,
            });
        }
    }
    Ok(())
}

struct Entry<B: burn::tensor::backend::Backend> {
    id: ParamId,
    numel: usize,
    grad: Option<Tensor<B, 1>>,
    device: B::Device,
}

struct Collect<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    out: Vec<Entry<B::InnerBackend>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Collect<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        let t = param.val();
        if !t.is_require_grad() {
            return;
        }
        let numel = t.shape().num_elements();
        let grad = self
            .grads
            .remove::<B::InnerBackend, D>(param.id)
            .map(|g| g.reshape([numel]));
        self.out.push(Entry {
            id: param.id,
            numel,
            grad,
            device: t.device(),
        });
    }
}

struct Register<'a, B: AutodiffBackend> {
    grads: &'a mut GradientsParams,
    reduced: HashMap<ParamId, Tensor<B::InnerBackend, 1>>,
}

impl<B: AutodiffBackend> ModuleVisitor<B> for Register<'_, B> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if let Some(flat) = self.reduced.remove(&param.id) {
            let dims: [usize; D] = param.val().dims();
            self.grads
                .register::<B::InnerBackend, D>(param.id, flat.reshape(dims));
        }
    }
}

/// Averages gradients across ranks. Create one per model; call [`GradientSync::sync`] after every
/// backward pass that should be synchronised.
#[derive(Debug)]
pub struct GradientSync {
    comm: Arc<dyn Communicator>,
    config: SyncConfig,
    verified: bool,
}

impl GradientSync {
    /// A gradient synchroniser over `comm`.
    pub fn new(comm: Arc<dyn Communicator>, config: SyncConfig) -> Self {
        Self {
            comm,
            config,
            verified: false,
        }
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        &self.comm
    }

    /// The options.
    pub fn config(&self) -> &SyncConfig {
        &self.config
    }

    /// Horovod's `gradient_predivide_factor`, or the world size when gradients travel in 16 bits
    /// and no factor was chosen (1.0): a sum of many fp16 gradients can overflow, the sum of
    /// their world-size shares cannot.
    fn predivide_factor(&self, world: usize) -> f64 {
        let f = self.config.gradient_predivide_factor;
        if f > 0.0 && f != 1.0 {
            f
        } else if self.config.compression != Compression::None {
            world as f64
        } else {
            1.0
        }
    }

    /// Averages `grads` (of `module`'s parameters) across all ranks and returns them, keyed by this
    /// process's parameter ids. A parameter without a gradient on this rank contributes zeros; a
    /// parameter with no gradient on any rank gets none (so the optimizer leaves it alone, as in
    /// a world of one). Each bucket carries one has-gradient flag per parameter for that. The
    /// first call verifies that every rank has the same model.
    ///
    /// # Errors
    /// [`DistError::ModelMismatch`] at the first call when models differ; the communicator's
    /// errors (a dead or hung rank) otherwise.
    pub fn sync<B, M>(&mut self, module: &M, mut grads: GradientsParams) -> Result<GradientsParams>
    where
        B: AutodiffBackend,
        B::InnerBackend: CollectiveBackend,
        M: AutodiffModule<B>,
    {
        if !self.verified {
            verify_same_model::<B, M>(&*self.comm, module)?;
            self.verified = true;
        }
        let mut collect = Collect::<B> {
            grads: &mut grads,
            out: Vec::new(),
        };
        module.visit(&mut collect);
        let entries = collect.out;
        let reduced = if self.comm.skips_collectives() {
            entries
                .into_iter()
                .filter_map(|e| Some((e.id, e.grad?)))
                .collect()
        } else {
            self.reduce_buckets::<B::InnerBackend>(entries)
                .inspect_err(|e| {
                    if e.is_local() {
                        self.comm.abort(&e.to_string());
                    }
                })?
        };
        let mut register = Register::<B> {
            grads: &mut grads,
            reduced,
        };
        module.visit(&mut register);
        Ok(grads)
    }

    /// Packs the gradients into buckets (each followed by its parameters' has-gradient flags),
    /// all-reduces them in one call, and unpacks the averages of the parameters that had a
    /// gradient on some rank.
    fn reduce_buckets<B: CollectiveBackend>(
        &self,
        entries: Vec<Entry<B>>,
    ) -> Result<HashMap<ParamId, Tensor<B, 1>>> {
        let world = self.comm.world_size();
        let f = self.predivide_factor(world);
        let max_elems = (self.config.bucket_bytes / 4).max(1);
        let mut buckets: Vec<&[Entry<B>]> = Vec::new();
        let mut start = 0;
        while start < entries.len() {
            let mut end = start;
            let mut elems = 0;
            while end < entries.len() && (end == start || elems + entries[end].numel <= max_elems) {
                elems += entries[end].numel;
                end += 1;
            }
            buckets.push(&entries[start..end]);
            start = end;
        }
        let flats: Vec<Tensor<B, 1>> = buckets
            .iter()
            .map(|bucket| {
                let parts: Vec<Tensor<B, 1>> = bucket
                    .iter()
                    .map(|e| {
                        e.grad
                            .clone()
                            .unwrap_or_else(|| Tensor::zeros([e.numel], &e.device))
                    })
                    .collect();
                let mut flat = Tensor::cat(parts, 0);
                if f != 1.0 {
                    flat = flat.div_scalar(f);
                }
                let flags: Vec<f32> = bucket
                    .iter()
                    .map(|e| if e.grad.is_some() { 1.0 } else { 0.0 })
                    .collect();
                let flags = Tensor::from_data(
                    TensorData::new(flags, [bucket.len()]),
                    (&bucket[0].device, flat.dtype()),
                );
                Tensor::cat(vec![flat, flags], 0)
            })
            .collect();
        // All buckets in one call: a device backend launches them together and waits once.
        let flats =
            B::all_reduce_floats(&*self.comm, flats, ReduceOp::Sum, self.config.compression)?;
        // Reading the flags back costs a device round trip: only needed when some parameter has
        // no gradient here (otherwise every count is at least this rank's 1).
        let everywhere = entries.iter().all(|e| e.grad.is_some());
        let mut reduced = HashMap::with_capacity(entries.len());
        for (bucket, flat) in buckets.iter().zip(flats) {
            let elems: usize = bucket.iter().map(|e| e.numel).sum();
            let flat = flat.mul_scalar(f / world as f64);
            let counts: Vec<f32> = if everywhere {
                vec![1.0; bucket.len()]
            } else {
                flat.clone()
                    .narrow(0, elems, bucket.len())
                    .into_data()
                    .convert::<f32>()
                    .into_vec::<f32>()
                    .map_err(|e| DistError::TensorData {
                        op: "reading the has-gradient flags",
                        detail: format!("{e:?}"),
                    })?
            };
            let mut off = 0;
            for (e, count) in bucket.iter().zip(counts) {
                if count > 0.0 {
                    reduced.insert(e.id, flat.clone().narrow(0, off, e.numel));
                }
                off += e.numel;
            }
        }
        Ok(reduced)
    }
}
