//! What the in-crate tests on real sockets share: a free port and a world on 127.0.0.1.

use crate::rendezvous::world::{Rendezvous, World};

// The same free ports as the integration tests (one file serves every test crate); the in-crate
// tests make their tokens from the port instead of `job_token`.
#[allow(dead_code)]
#[path = "../tests/common/ports.rs"]
mod ports;
pub(crate) use ports::free_port;

/// Rank `rank` of `n` on this machine, our own store at `port`, a job token of this process
/// and port only.
pub(crate) fn local_world(rank: usize, n: usize, port: u16) -> World {
    World {
        rank,
        world_size: n,
        local_rank: rank,
        local_world_size: n,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_token: format!("tok-{}-{port}", std::process::id()),
        rendezvous: Rendezvous::OwnStore,
    }
}
