//! Multi-process data-parallel training for Burn: launcher, rendezvous store, collectives
//! (a TCP ring on the host, NCCL on CUDA) and gradient synchronisation.
#![deny(missing_docs)]

mod cma;
mod comm;
mod error;
mod host;
mod launcher;
#[cfg(feature = "cuda")]
mod nccl;
#[cfg(not(feature = "cuda"))]
#[path = "nccl_stub.rs"]
mod nccl;
mod optimizer;
mod setup;
mod store;
mod sync;
mod tensor;
mod wire;
mod world;

pub use comm::{Communicator, CommunicatorExt, DEFAULT_TIMEOUT, DType, Element, HostBuf, ReduceOp};
pub use error::{DistError, Result};
pub use host::{CMA_ENV, Host};
pub use launcher::{
    LaunchConfig, is_worker_env, launch, launch_or_run, should_draw_progress, visible_cuda_devices,
};
pub use nccl::Nccl;
pub use optimizer::{
    DistributedConfig, DistributedOptimizer, average_buffers, broadcast_optimizer_state,
    broadcast_parameters, reduce_metrics,
};
pub use setup::{CommBackend, Dist, DistOptions, TIMEOUT_ENV, init, init_from_env};
pub use store::{MAX_STORE_MESSAGE, Store};
pub use sync::{DEFAULT_BUCKET_BYTES, Fingerprint, GradientSync, SyncConfig, verify_same_model};
pub use tensor::{CollectiveBackend, Compression, host_all_reduce, host_broadcast};
pub use world::{DEFAULT_MASTER_PORT, JOB_TOKEN_ENV, QUIET_ENV, World};
