//! Stand-in for the NCCL communicator when `burn-dist` is built without the `cuda` feature: the
//! same API, every call returns [`DistError::NotCompiledWithCuda`].

pub use crate::comm::device_call::{Collective, DeviceCall};
use crate::comm::{Communicator, HostBuf, ReduceOp};
use crate::error::{DistError, Result};
use crate::rendezvous::store::Store;
use crate::rendezvous::world::World;
use std::time::Duration;

/// NCCL communicator (unavailable: built without the `cuda` feature).
#[derive(Debug)]
pub struct Nccl {
    _private: (),
}

impl Nccl {
    /// Always [`DistError::NotCompiledWithCuda`] in this build.
    ///
    /// # Errors
    /// Always.
    pub fn new(_world: &World, _store: &Store, _device: usize, _timeout: Duration) -> Result<Self> {
        Err(DistError::NotCompiledWithCuda)
    }

    /// Always [`DistError::NotCompiledWithCuda`] in this build.
    ///
    /// # Safety
    /// None needed: nothing is run.
    ///
    /// # Errors
    /// Always.
    pub unsafe fn run_device(
        &self,
        _name: &'static str,
        _calls: Vec<DeviceCall>,
        _keep_alive: Box<dyn Send>,
    ) -> Result<()> {
        Err(DistError::NotCompiledWithCuda)
    }

    /// Whether NCCL can be used: never in this build.
    pub fn is_available() -> bool {
        false
    }
}

impl Communicator for Nccl {
    fn rank(&self) -> usize {
        0
    }
    fn world_size(&self) -> usize {
        1
    }
    fn timeout(&self) -> Duration {
        Duration::ZERO
    }
    fn backend_name(&self) -> &'static str {
        "nccl"
    }
    fn all_reduce(&self, _buf: HostBuf<'_>, _op: ReduceOp) -> Result<()> {
        Err(DistError::NotCompiledWithCuda)
    }
    fn broadcast(&self, _buf: HostBuf<'_>, _root: usize) -> Result<()> {
        Err(DistError::NotCompiledWithCuda)
    }
    fn all_gather(&self, _buf: HostBuf<'_>) -> Result<()> {
        Err(DistError::NotCompiledWithCuda)
    }
    fn barrier(&self) -> Result<()> {
        Err(DistError::NotCompiledWithCuda)
    }
}
