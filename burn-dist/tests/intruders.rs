//! Strangers on the job's ports, on real sockets: garbage, an HTTP request and a flood of idle
//! connections sent to the store port and to a rank's ring port while the job sets up must leave
//! the set-up and the collectives unharmed.

mod common;

use burn_dist::{CommunicatorExt, ReduceOp, Rendezvous, Store, TcpRing, World};
use std::io::Write;
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::{Duration, Instant};

use common::free_port;

/// More idle connections than either listener keeps in its handshake at once.
const IDLE: usize = 100;
const DEADLINE: Duration = Duration::from_secs(20);

fn world(rank: usize, port: u16) -> World {
    World {
        rank,
        world_size: 2,
        local_rank: rank,
        local_world_size: 2,
        master_addr: "127.0.0.1".into(),
        master_port: port,
        job_token: "intruders-test".into(),
        rendezvous: Rendezvous::OwnStore,
    }
}

/// Opens `IDLE` connections that never send a byte, plus one of garbage and one HTTP request;
/// returns them so that they stay open.
fn harass(at: SocketAddr) -> Vec<TcpStream> {
    let mut held = Vec::new();
    for payload in [
        &b"\x00\x00\x00\x01\xff\xfe garbage \x00"[..],
        &b"GET / HTTP/1.1\r\nHost: burn-dist\r\n\r\n"[..],
    ] {
        let mut s = TcpStream::connect_timeout(&at, Duration::from_secs(5)).expect("connect");
        s.write_all(payload).expect("write");
        held.push(s);
    }
    for _ in 0..IDLE {
        held.push(TcpStream::connect_timeout(&at, Duration::from_secs(5)).expect("connect"));
    }
    held
}

#[test]
fn garbage_http_and_idle_connections_leave_the_set_up_and_the_sums_unharmed() {
    let port = free_port();
    let rank0 = std::thread::spawn(move || {
        let w = world(0, port);
        let store = Arc::new(Store::rendezvous(&w, DEADLINE)?);
        let host = TcpRing::new(&w, store, DEADLINE)?;
        let mut v = vec![1.0f32, 2.0, 3.0];
        host.all_reduce_slice(&mut v, ReduceOp::Sum)?;
        Ok::<_, burn_dist::DistError>(v)
    });
    // The store port, once rank 0 serves it, before rank 1 joins.
    let store_at = SocketAddr::from(([127, 0, 0, 1], port));
    let start = Instant::now();
    while TcpStream::connect_timeout(&store_at, Duration::from_secs(1)).is_err() {
        assert!(start.elapsed() < DEADLINE, "rank 0 never served the store");
        std::thread::sleep(Duration::from_millis(20));
    }
    let _at_store = harass(store_at);
    let w1 = world(1, port);
    let store = Arc::new(Store::rendezvous(&w1, DEADLINE).expect("rank 1 joins the store"));
    // Rank 0's ring port, while rank 0 waits in its accept loop for rank 1.
    let ring0 = store
        .get("burn-dist/host/addr/0", DEADLINE)
        .expect("rank 0's ring address");
    let ring0: SocketAddr = String::from_utf8_lossy(&ring0).parse().expect("an address");
    let _at_ring = harass(ring0);
    let host = TcpRing::new(&w1, store, DEADLINE).expect("rank 1 connects the ring");
    let mut v = vec![10.0f32, 20.0, 30.0];
    host.all_reduce_slice(&mut v, ReduceOp::Sum)
        .expect("rank 1's sum");
    let v0 = rank0.join().expect("rank 0").expect("rank 0's sum");
    for got in [&v, &v0] {
        assert_eq!(got, &vec![11.0, 22.0, 33.0]);
    }
}
