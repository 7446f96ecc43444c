//! One call to join the job: rendezvous, then the chosen communicator.

use crate::comm::{Communicator, DEFAULT_TIMEOUT};
use crate::error::{DistError, Result};
use crate::host::Host;
use crate::store::Store;
use crate::world::World;
use std::sync::Arc;
use std::time::Duration;

/// Environment variable overriding the deadline of rendezvous and collectives, in seconds.
pub const TIMEOUT_ENV: &str = "BURN_DIST_TIMEOUT_S";

/// Which collective backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommBackend {
    /// TCP ring between processes (any machine).
    #[default]
    Host,
    /// NCCL on the CUDA device `local_rank` (feature `cuda`).
    Nccl,
}

/// Options of [`init`].
#[derive(Debug, Clone, PartialEq)]
pub struct DistOptions {
    /// The backend.
    pub backend: CommBackend,
    /// Deadline of the rendezvous and of each collective (default 300 s, or `BURN_DIST_TIMEOUT_S`).
    pub timeout: Duration,
}

impl Default for DistOptions {
    fn default() -> Self {
        let timeout = std::env::var(TIMEOUT_ENV)
            .ok()
            .and_then(|s| s.trim().parse::<f64>().ok())
            .filter(|s| *s > 0.0)
            .map(Duration::from_secs_f64)
            .unwrap_or(DEFAULT_TIMEOUT);
        Self {
            backend: CommBackend::Host,
            timeout,
        }
    }
}

/// A joined job: who we are, the store, and the communicator.
#[derive(Debug, Clone)]
pub struct Dist {
    /// This process's place in the job.
    pub world: World,
    /// The rendezvous store (`None` in a world of one).
    pub store: Option<Arc<Store>>,
    /// The collectives.
    pub comm: Arc<dyn Communicator>,
}

impl Dist {
    /// This process's rank.
    pub fn rank(&self) -> usize {
        self.world.rank
    }
    /// Number of processes.
    pub fn world_size(&self) -> usize {
        self.world.world_size
    }
    /// Whether this is rank 0 (owns logs, progress bar and checkpoints).
    pub fn is_main(&self) -> bool {
        self.world.rank == 0
    }
}

/// Joins the job described by `world`: rank 0 serves the store, all ranks rendezvous, then the
/// communicator connects. A world of one starts nothing (no port is opened) and every collective
/// is a no-op, through the same API.
///
/// # Errors
/// Rendezvous errors naming the missing ranks or the unreachable address; backend errors
/// ([`DistError::NotCompiledWithCuda`], [`DistError::LibraryMissing`]).
pub fn init(world: &World, options: &DistOptions) -> Result<Dist> {
    if world.world_size == 1 {
        return Ok(Dist {
            world: world.clone(),
            store: None,
            comm: Arc::new(Host::single()),
        });
    }
    let store = Arc::new(Store::rendezvous(world, options.timeout)?);
    let comm: Arc<dyn Communicator> = match options.backend {
        CommBackend::Host => Arc::new(Host::new(world, Arc::clone(&store), options.timeout)?),
        CommBackend::Nccl => Arc::new(crate::nccl::Nccl::new(
            world,
            &store,
            world.local_rank,
            options.timeout,
        )?),
    };
    Ok(Dist {
        world: world.clone(),
        store: Some(store),
        comm,
    })
}

/// [`init`] with [`World::from_env`] and default options for `backend`.
///
/// # Errors
/// As [`World::from_env`] and [`init`].
pub fn init_from_env(backend: CommBackend) -> Result<Dist> {
    let world = World::from_env()?;
    init(
        &world,
        &DistOptions {
            backend,
            ..DistOptions::default()
        },
    )
}

#[allow(dead_code)]
fn _assert_error_is_send(e: DistError) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(e)
}
