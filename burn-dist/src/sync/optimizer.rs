//! [`DistributedOptimizer`] (Horovod's `DistributedOptimizer`) and the broadcast/averaging helpers
//! a data-parallel training loop needs around it.

use crate::comm::{Communicator, CommunicatorExt, HostBuf, ReduceOp};
use crate::error::{DistError, Result};
use crate::sync::gradient::{GradientSync, SyncConfig};
use crate::sync::tensor::CollectiveBackend;
use burn::module::{AutodiffModule, Module, ModuleMapper, Param, ParamId};
use burn::optim::{GradientsAccumulator, GradientsParams, Optimizer};
use burn::record::{FullPrecisionSettings, NamedMpkBytesRecorder, Recorder};
use burn::tensor::Tensor;
use burn::tensor::backend::{AutodiffBackend, Backend};
use std::marker::PhantomData;
use std::sync::Arc;

/// Options of [`DistributedOptimizer`].
#[derive(Debug, Clone, PartialEq)]
pub struct DistributedConfig {
    /// Gradient sync options (bucket size, compression, predivide factor).
    pub sync: SyncConfig,
    /// Horovod's `backward_passes_per_step` (batches per all-reduce): gradients of this many
    /// backward passes are summed locally, then synchronised once and applied.
    pub backward_passes_per_step: usize,
}

impl Default for DistributedConfig {
    fn default() -> Self {
        Self {
            sync: SyncConfig::default(),
            backward_passes_per_step: 1,
        }
    }
}

/// Wraps any Burn [`Optimizer`]: gradients are accumulated over `backward_passes_per_step` passes,
/// averaged across ranks, then applied by the inner optimizer.
pub struct DistributedOptimizer<O, M, B>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    inner: O,
    sync: GradientSync,
    passes_per_step: usize,
    passes: usize,
    accumulator: GradientsAccumulator<M>,
    _b: PhantomData<B>,
}

impl<O, M, B> std::fmt::Debug for DistributedOptimizer<O, M, B>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DistributedOptimizer")
            .field("sync", &self.sync)
            .field("passes_per_step", &self.passes_per_step)
            .field("passes", &self.passes)
            .finish()
    }
}

impl<O, M, B> DistributedOptimizer<O, M, B>
where
    B: AutodiffBackend,
    B::InnerBackend: CollectiveBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    /// Wraps `optimizer`; collectives go through `comm`.
    pub fn new(optimizer: O, comm: Arc<dyn Communicator>, config: DistributedConfig) -> Self {
        Self {
            inner: optimizer,
            sync: GradientSync::new(comm, config.sync),
            passes_per_step: config.backward_passes_per_step.max(1),
            passes: 0,
            accumulator: GradientsAccumulator::new(),
            _b: PhantomData,
        }
    }

    /// Records the gradients of one backward pass. Every `backward_passes_per_step`-th call
    /// averages the accumulated (summed) gradients across ranks and applies the inner optimizer;
    /// the other calls only accumulate and return `module` unchanged. Use
    /// [`DistributedOptimizer::will_step`] to know which call applies.
    ///
    /// With `backward_passes_per_step = k`, gradients of the k passes are summed (as Horovod):
    /// scale each pass's loss by `1/k` to average them.
    ///
    /// # Errors
    /// [`DistError::ModelMismatch`] on the first sync when ranks differ; communicator errors.
    pub fn step(&mut self, lr: f64, module: M, grads: GradientsParams) -> Result<M> {
        self.passes += 1;
        if self.passes < self.passes_per_step {
            self.accumulator.accumulate(&module, grads);
            return Ok(module);
        }
        self.passes = 0;
        let grads = if self.passes_per_step > 1 {
            self.accumulator.accumulate(&module, grads);
            self.accumulator.grads()
        } else {
            grads
        };
        let grads = self.sync.sync::<B, M>(&module, grads)?;
        Ok(self.inner.step(lr, module, grads))
    }

    /// Whether the next [`DistributedOptimizer::step`] call synchronises and applies.
    pub fn will_step(&self) -> bool {
        self.passes + 1 >= self.passes_per_step
    }

    /// The inner optimizer.
    pub fn inner(&self) -> &O {
        &self.inner
    }

    /// Replaces the inner optimizer (e.g. after [`broadcast_optimizer_state`]).
    pub fn set_inner(&mut self, optimizer: O) {
        self.inner = optimizer;
    }

    /// The inner optimizer's record (for checkpoints).
    pub fn to_record(&self) -> O::Record {
        self.inner.to_record()
    }

    /// Loads the inner optimizer's record.
    pub fn load_record(mut self, record: O::Record) -> Self {
        self.inner = self.inner.load_record(record);
        self
    }

    /// Broadcasts the inner optimizer's state from `root` to every rank. Call after
    /// [`broadcast_parameters`] (which unifies parameter ids, by which Burn optimizers key state).
    ///
    /// # Errors
    /// As [`broadcast_optimizer_state`].
    pub fn broadcast_state(self, root: usize, device: &B::Device) -> Result<Self> {
        let Self {
            inner,
            sync,
            passes_per_step,
            passes,
            accumulator,
            _b,
        } = self;
        let inner = broadcast_optimizer_state::<O, M, B>(
            sync.communicator().as_ref(),
            inner,
            root,
            device,
        )?;
        Ok(Self {
            inner,
            sync,
            passes_per_step,
            passes,
            accumulator,
            _b,
        })
    }

    /// The communicator.
    pub fn communicator(&self) -> &Arc<dyn Communicator> {
        self.sync.communicator()
    }
}

/// Sums many values across ranks in one all-reduce, e.g. `[loss_sum, count, correct, count, ..]`.
///
/// # Errors
/// The communicator's errors.
pub fn reduce_metrics(comm: &dyn Communicator, values: &[f64]) -> Result<Vec<f64>> {
    let mut v = values.to_vec();
    comm.all_reduce(HostBuf::F64(&mut v), ReduceOp::Sum)?;
    Ok(v)
}

/// Makes Burn's running states (BN statistics, kept per thread until synced) current, so that a
/// visitor or mapper sees their latest value. Clones share the states, so the clone's
/// `into_record` syncs the original's.
fn sync_running_states<B: Backend, M: Module<B>>(module: &M) {
    let _ = module.clone().into_record();
}

struct BroadcastMapper<'a> {
    comm: &'a dyn Communicator,
    root: usize,
    /// Only buffers (no-grad float params) and averaged instead of broadcast.
    average_buffers: bool,
    error: Option<DistError>,
}

impl<B: Backend + CollectiveBackend> ModuleMapper<B> for BroadcastMapper<'_> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        if self.error.is_some() {
            return param;
        }
        let (id, tensor, mapper) = param.consume();
        let require_grad = tensor.is_require_grad();
        if self.average_buffers && require_grad {
            return Param::from_mapped_value(id, tensor, mapper);
        }
        let dims = tensor.dims();
        let numel = tensor.shape().num_elements();
        let flat = tensor.clone().reshape([numel]);
        let result = if self.average_buffers {
            B::all_reduce_float(
                self.comm,
                flat,
                ReduceOp::Avg,
                crate::sync::tensor::Compression::None,
            )
        } else {
            B::broadcast_float(self.comm, flat, self.root)
        };
        // Make parameter ids agree with the root's: Burn optimizers key their state by id, and
        // ids are random per process.
        let id = if self.average_buffers {
            Ok(id)
        } else {
            let mut v = [id.val() as i64];
            self.comm
                .broadcast_slice(&mut v, self.root)
                .map(|_| ParamId::from(v[0] as u64))
        };
        match (result, id) {
            (Ok(flat), Ok(new_id)) => {
                let mut t = flat.reshape(dims);
                if require_grad {
                    t = t.set_require_grad(true);
                }
                Param::from_mapped_value(new_id, t, mapper)
            }
            (Err(e), _) | (_, Err(e)) => {
                if e.is_local() {
                    self.comm.abort(&e.to_string());
                }
                self.error = Some(e);
                Param::from_mapped_value(ParamId::new(), tensor, mapper)
            }
        }
    }
}

/// Copies `root`'s parameters **and buffers** (e.g. BN running statistics) to every rank, in
/// visit order, and gives every rank `root`'s parameter ids (so optimizer state, keyed by id,
/// matches across ranks). Call once after building (or loading) the model.
///
/// # Errors
/// The communicator's errors.
pub fn broadcast_parameters<B, M>(comm: &dyn Communicator, module: M, root: usize) -> Result<M>
where
    B: Backend + CollectiveBackend,
    M: Module<B>,
{
    if comm.skips_collectives() {
        return Ok(module);
    }
    crate::sync::gradient::verify_same_model::<B, M>(comm, &module)?;
    sync_running_states::<B, M>(&module);
    let mut mapper = BroadcastMapper {
        comm,
        root,
        average_buffers: false,
        error: None,
    };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

/// Averages every buffer (float parameter that does not require a gradient, e.g. BN running
/// mean/variance) across ranks. Call before validation and before writing a checkpoint.
///
/// # Errors
/// The communicator's errors.
pub fn average_buffers<B, M>(comm: &dyn Communicator, module: M) -> Result<M>
where
    B: Backend + CollectiveBackend,
    M: Module<B>,
{
    if comm.skips_collectives() {
        return Ok(module);
    }
    sync_running_states::<B, M>(&module);
    let mut mapper = BroadcastMapper {
        comm,
        root: 0,
        average_buffers: true,
        error: None,
    };
    let module = module.map(&mut mapper);
    match mapper.error {
        Some(e) => Err(e),
        None => Ok(module),
    }
}

/// Sends `root`'s optimizer state to every rank (serialised with Burn's binary recorder). Call
/// after [`broadcast_parameters`], so parameter ids agree across ranks.
///
/// # Errors
/// [`DistError::Record`] when the record cannot be (de)serialised; the communicator's errors.
pub fn broadcast_optimizer_state<O, M, B>(
    comm: &dyn Communicator,
    optimizer: O,
    root: usize,
    device: &B::Device,
) -> Result<O>
where
    B: AutodiffBackend,
    M: AutodiffModule<B>,
    O: Optimizer<M, B>,
{
    if comm.skips_collectives() {
        return Ok(optimizer);
    }
    // Named MessagePack, not Burn's bincode recorder: a state that does not fit this optimizer
    // (another optimizer type, another burn version) is an error here; bincode's loader panics.
    let recorder = NamedMpkBytesRecorder::<FullPrecisionSettings>::default();
    let mut bytes = if comm.rank() == root {
        Recorder::<B>::record(&recorder, optimizer.to_record(), ()).map_err(|e| {
            DistError::Record {
                detail: format!("serialising the optimizer state: {e:?}"),
            }
        })?
    } else {
        Vec::new()
    };
    comm.broadcast_bytes(&mut bytes, root)?;
    if comm.rank() == root {
        return Ok(optimizer);
    }
    let record: O::Record = Recorder::<B>::load(&recorder, bytes, device).map_err(|e| {
        let e = DistError::Record {
            detail: format!("loading rank {root}'s optimizer state: {e:?}"),
        };
        comm.abort(&e.to_string());
        e
    })?;
    Ok(optimizer.load_record(record))
}
