//! What the in-crate tests on real sockets share: a free port and a world on 127.0.0.1.

use std::net::TcpListener;
use std::sync::Mutex;

use crate::rendezvous::world::{Rendezvous, World};

/// A port nobody listens on right now, never handed out twice in this test process (its tests
/// run in parallel threads). A port another process takes meanwhile fails that job loudly: the
/// job token of [`local_world`] is unique to the port.
pub(crate) fn free_port() -> u16 {
    static GIVEN: Mutex<Vec<u16>> = Mutex::new(Vec::new());
    let mut given = GIVEN.lock().unwrap_or_else(|e| e.into_inner());
    loop {
        let port = TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("free port");
        if !given.contains(&port) {
            given.push(port);
            return port;
        }
    }
}

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
