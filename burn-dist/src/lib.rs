//! Multi-process data-parallel training for Burn: launcher, rendezvous store, collectives
//! (a TCP ring on the host, NCCL on CUDA) and gradient synchronisation — Horovod /
//! `torch.distributed` for Burn.
//!
//! # Tour
//! - [`launch_or_run`]: call first in `main`. Started by hand with `--nproc-per-node N`, it
//!   re-executes the binary N times with torchrun's env (`RANK`, `WORLD_SIZE`, ...) and supervises
//!   the workers; in a worker (or a single-process run) it returns the [`World`].
//!   [`World::from_env`] reads torchrun's, SLURM's and OpenMPI's variables too.
//! - [`init`]: rendezvous through the job's [`Store`] (torchrun's own store under torchrun, else
//!   one served by rank 0) and connect a [`Communicator`] ([`TcpRing`]:
//!   TCP ring, shared memory between processes of one machine; [`Nccl`] with feature `cuda`).
//!   A world of one opens no port and every collective is a no-op, through the same code path.
//! - [`DistributedOptimizer`]: wraps a Burn optimizer; averages gradients across ranks in
//!   25 MiB buckets ([`GradientSync`]), in module visit order (never by `ParamId`).
//! - [`cuda_libs::prepare`]: call first in `main` of a CUDA program: finds libcuda, NVRTC, NCCL
//!   and cuDNN where users install them (pip wheels, toolkits, distributions) and makes cudarc
//!   load them.
//! - [`broadcast_parameters`], [`broadcast_optimizer_state`], [`average_buffers`],
//!   [`reduce_metrics`]: the rest of a data-parallel loop.
//!
//! ```no_run
//! # use burn::tensor::backend::AutodiffBackend;
//! # fn example() -> Result<(), burn_dist::DistError> {
//! use burn_dist::{CommBackend, DistOptions, DistributedConfig, LaunchConfig};
//! let world = burn_dist::launch_or_run(&LaunchConfig { nproc_per_node: Some(2), ..Default::default() })?;
//! let dist = burn_dist::init(&world, &DistOptions { backend: CommBackend::Ring, ..Default::default() })?;
//! // model = burn_dist::broadcast_parameters(dist.comm.as_ref(), model, 0)?;
//! // let mut opt = burn_dist::DistributedOptimizer::new(SgdConfig::new().init(), dist.comm.clone(),
//! //     DistributedConfig::default());
//! // per batch: model = opt.step(lr, model, GradientsParams::from_grads(loss.backward(), &model))?;
//! // metrics: let sums = burn_dist::reduce_metrics(dist.comm.as_ref(), &[loss_sum, n, correct, n])?;
//! # Ok(()) }
//! ```
//!
//! # Feature flags
//! - `cuda`: the [`Nccl`] communicator and [`CollectiveBackend`] for `burn::backend::Cuda`.
//!   Without it, [`Nccl::new`] returns [`DistError::NotCompiledWithCuda`].
#![deny(missing_docs)]

mod comm;
pub mod cuda_libs;
mod error;
mod error_file;
mod rendezvous;
mod sync;
#[cfg(test)]
mod test_support;

pub use comm::nccl::{Collective, DeviceCall, Nccl};
pub use comm::ring::{ADDR_ENV, SHM_ENV, TcpRing};
pub use comm::{Communicator, CommunicatorExt, DEFAULT_TIMEOUT, DType, Element, HostBuf, ReduceOp};
pub use error::{DistError, Result};
pub use error_file::{ERROR_FILE_ENV, write_error_file};
pub use rendezvous::launcher::{
    LaunchConfig, is_worker_env, launch, launch_or_run, should_draw_progress, visible_cuda_devices,
};
pub use rendezvous::local_rank::device_for;
pub use rendezvous::setup::{
    BACKEND_ENV, CommBackend, Dist, DistOptions, TIMEOUT_ENV, init, init_from_env,
};
pub use rendezvous::store::{MAX_STORE_MESSAGE, Store};
pub use rendezvous::world::{DEFAULT_MASTER_PORT, JOB_TOKEN_ENV, QUIET_ENV, Rendezvous, World};
pub use sync::gradient::{
    DEFAULT_BUCKET_BYTES, Fingerprint, GradientSync, SyncConfig, verify_same_model,
};
pub use sync::optimizer::{
    DistributedConfig, DistributedOptimizer, average_buffers, broadcast_optimizer_state,
    broadcast_parameters, reduce_metrics,
};
pub use sync::tensor::{CollectiveBackend, Compression, host_all_reduce, host_broadcast};
#[cfg(feature = "cuda")]
pub use sync::tensor::{CubeAccess, CudaFused, CudaRaw};
