//! One call to join the job: rendezvous, then the chosen communicator.

use crate::comm::ring::TcpRing;
use crate::comm::{Communicator, DEFAULT_TIMEOUT};
use crate::error::{DistError, Result};
use crate::rendezvous::local_rank;
use crate::rendezvous::store::Store;
use crate::rendezvous::world::World;
use std::sync::Arc;
use std::time::Duration;

/// Environment variable overriding the deadline of rendezvous and collectives, in seconds.
pub const TIMEOUT_ENV: &str = "BURN_DIST_TIMEOUT_S";

/// Environment variable choosing the collective backend: `ring` (also accepted under its old
/// name `host`) or `nccl`. With `nccl` a world of
/// one still builds a real one-rank NCCL communicator (through the rendezvous store), so a single
/// GPU exercises the whole NCCL path.
pub const BACKEND_ENV: &str = "BURN_DIST_BACKEND";

/// Which collective backend to use.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CommBackend {
    /// TCP ring between processes (any machine).
    #[default]
    Ring,
    /// NCCL on the CUDA device `local_rank` modulo the visible devices (feature `cuda`).
    Nccl,
}

/// Options of [`init`].
#[derive(Debug, Clone, PartialEq)]
pub struct DistOptions {
    /// The backend.
    pub backend: CommBackend,
    /// Deadline of the rendezvous and of each collective (default 300 s, or `BURN_DIST_TIMEOUT_S`).
    pub timeout: Duration,
    /// Build the backend's communicator even in a world of one (default: false, or true when
    /// [`BACKEND_ENV`] names the backend). A world of one otherwise opens nothing and skips every
    /// collective.
    pub force_backend: bool,
}

impl DistOptions {
    /// Options for `backend`, overridden by [`BACKEND_ENV`] when it is set (which also forces
    /// the backend in a world of one); the deadline from [`TIMEOUT_ENV`].
    ///
    /// # Errors
    /// [`DistError::InvalidEnv`] when [`BACKEND_ENV`] is neither `ring` (`host`) nor `nccl`.
    pub fn from_env(backend: CommBackend) -> Result<Self> {
        Self::from_lookup(backend, |k| std::env::var(k).ok())
    }

    /// Same as [`DistOptions::from_env`], reading [`BACKEND_ENV`] through `get` (for tests).
    ///
    /// # Errors
    /// As [`DistOptions::from_env`].
    pub fn from_lookup(backend: CommBackend, get: impl Fn(&str) -> Option<String>) -> Result<Self> {
        let mut options = Self {
            backend,
            ..Self::default()
        };
        if let Some(value) = get(BACKEND_ENV) {
            options.backend = match value.trim() {
                // `host` is the name this backend had before.
                "ring" | "host" => CommBackend::Ring,
                "nccl" => CommBackend::Nccl,
                _ => {
                    return Err(DistError::InvalidEnv {
                        var: BACKEND_ENV.into(),
                        value,
                        reason: "expected `ring` (or its old name `host`) or `nccl`".into(),
                    });
                }
            };
            options.force_backend = true;
        }
        Ok(options)
    }
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
            backend: CommBackend::Ring,
            timeout,
            force_backend: false,
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
    /// The CUDA device this process uses: its local rank modulo the devices it sees (device 0
    /// when each process sees one, as with `srun --gpus-per-task=1`).
    pub fn cuda_device(&self) -> usize {
        local_rank::device_for(self.world.local_rank, crate::visible_cuda_devices())
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
    if world.world_size == 1 && !options.force_backend {
        return Ok(Dist {
            world: world.clone(),
            store: None,
            comm: Arc::new(TcpRing::single()),
        });
    }
    let store = if world.world_size == 1 {
        // A forced backend in a world of one: a private store on a free loopback port, so the
        // unique-id exchange runs as in a real job without taking MASTER_PORT.
        let local = World {
            master_addr: "127.0.0.1".into(),
            master_port: free_loopback_port(world.rank)?,
            ..world.clone()
        };
        Store::rendezvous(&local, options.timeout)?
    } else {
        Store::rendezvous(world, options.timeout)?
    };
    let store = Arc::new(store);
    // Without LOCAL_RANK (Kubeflow, plain RANK/WORLD_SIZE) the local rank is settled from the
    // ranks' host names, so that the device below is right on every host.
    let env = |k: &str| std::env::var(k).ok();
    let world = if world.world_size > 1 && local_rank::local_rank_missing(&env) {
        local_rank::settle_through_store(world, &store, &local_rank::host_name(), options.timeout)?
    } else {
        world.clone()
    };
    let comm: Arc<dyn Communicator> = match options.backend {
        CommBackend::Ring => Arc::new(TcpRing::new(&world, Arc::clone(&store), options.timeout)?),
        CommBackend::Nccl => Arc::new(crate::comm::nccl::Nccl::new(
            &world,
            &store,
            local_rank::device_for(world.local_rank, crate::visible_cuda_devices()),
            options.timeout,
        )?),
    };
    Ok(Dist {
        world,
        store: Some(store),
        comm,
    })
}

/// [`init`] with [`World::from_env`] and [`DistOptions::from_env`] for `backend`.
///
/// # Errors
/// As [`World::from_env`], [`DistOptions::from_env`] and [`init`].
pub fn init_from_env(backend: CommBackend) -> Result<Dist> {
    let world = World::from_env()?;
    init(&world, &DistOptions::from_env(backend)?)
}

fn free_loopback_port(rank: usize) -> Result<u16> {
    let addr = "127.0.0.1:0";
    std::net::TcpListener::bind(addr)
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .map_err(|source| DistError::Io {
            rank,
            what: "picking a free port for the one-rank store".into(),
            addr: addr.into(),
            source,
        })
}

#[allow(dead_code)]
fn _assert_error_is_send(e: DistError) -> Box<dyn std::error::Error + Send + Sync> {
    Box::new(e)
}
