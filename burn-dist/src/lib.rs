//! Multi-process data-parallel training for Burn: launcher, rendezvous store, collectives
//! (a TCP ring on the host, NCCL on CUDA) and gradient synchronisation.
#![deny(missing_docs)]

mod comm;
mod error;
mod host;
mod store;
mod wire;
mod world;

pub use comm::{Communicator, CommunicatorExt, DType, DEFAULT_TIMEOUT, Element, HostBuf, ReduceOp};
pub use error::{DistError, Result};
pub use host::Host;
pub use store::{MAX_STORE_MESSAGE, Store};
pub use world::{DEFAULT_MASTER_PORT, JOB_TOKEN_ENV, QUIET_ENV, World};
