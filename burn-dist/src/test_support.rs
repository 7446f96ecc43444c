//! What the in-crate tests on real sockets share: a free port and a world on 127.0.0.1.

use std::net::TcpListener;

use crate::rendezvous::world::{Rendezvous, World};

/// A port nobody listens on right now.
pub(crate) fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

/// Rank `rank` of `n` on this machine, our own store at `port`, job token `tok`.
pub(crate) fn local_world(rank: usize, n: usize, port: u16) -> World {
    World {
        rank,
        world_size: n,
        local_rank: rank,
        local_world_size: n,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_token: "tok".into(),
        rendezvous: Rendezvous::OwnStore,
    }
}
