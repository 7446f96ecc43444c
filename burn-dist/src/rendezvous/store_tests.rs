//! The store on real sockets: its operations, its failures and strangers on its port.
use super::*;
use std::io::Write;
use std::net::{Ipv4Addr, TcpListener};
use std::sync::Arc;

use crate::test_support::{free_port, local_world as world};

#[test]
fn set_get_add_wait_barrier() {
    let port = free_port();
    let t = Duration::from_secs(5);
    let s0 = Store::connect(&world(0, 2, port), t).expect("rank 0");
    let h = std::thread::spawn(move || {
        let s1 = Store::connect(&world(1, 2, port), t).expect("rank 1");
        s1.set("k", b"v").expect("set");
        s1.barrier("b", t).expect("barrier");
        s1.add("c", 2).expect("add")
    });
    assert_eq!(s0.get("k", t).expect("get"), b"v");
    s0.barrier("b", t).expect("barrier");
    let a = s0.add("c", 3).expect("add");
    let b = h.join().expect("join");
    assert_eq!(a.max(b), 5);
    assert_eq!(s0.try_get("nope").expect("try_get"), None);
}

#[test]
fn set_if_absent_has_one_winner() {
    let port = free_port();
    let t = Duration::from_secs(5);
    let n = 8;
    let s0 = Store::connect(&world(0, n, port), t).expect("rank 0");
    let stores: Vec<Store> = (1..n)
        .map(|r| Store::connect(&world(r, n, port), t).expect("rank"))
        .collect();
    let barrier = std::sync::Barrier::new(n - 1);
    let answers: Vec<(usize, Vec<u8>)> = std::thread::scope(|sc| {
        let hs: Vec<_> = stores
            .iter()
            .map(|s| {
                let barrier = &barrier;
                sc.spawn(move || {
                    barrier.wait();
                    let mine = format!("rank {}", s.rank()).into_bytes();
                    (
                        s.rank(),
                        s.set_if_absent("first", &mine).expect("set_if_absent"),
                    )
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().expect("join")).collect()
    });
    let winner = s0.try_get("first").expect("get").expect("set");
    for (rank, stands) in &answers {
        assert_eq!(stands, &winner, "rank {rank} saw another winner");
    }
    let winners = answers
        .iter()
        .filter(|(r, _)| format!("rank {r}").into_bytes() == winner)
        .count();
    assert_eq!(winners, 1, "{answers:?}");
    // A later call keeps the first value.
    assert_eq!(s0.set_if_absent("first", b"late").expect("again"), winner);
}

/// Plays the store's side of the handshake on an accepted connection of the job at `port`.
fn accept_client(s: &mut TcpStream, port: u16) {
    wire::server_handshake(s, ConnKind::Store, &world(0, 2, port).job_token).expect("handshake");
}

fn accept_within(listener: &TcpListener, limit: Duration) -> Option<TcpStream> {
    listener.set_nonblocking(true).expect("nonblocking");
    let start = Instant::now();
    while start.elapsed() < limit {
        if let Ok((s, _)) = listener.accept() {
            s.set_nonblocking(false).expect("blocking");
            return Some(s);
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    None
}

/// A fake store whose first connection answers its first request late and in two pieces; the
/// second connection answers at once. A client that kept its first stream would read the
/// late reply as the answer to its next request.
#[test]
fn a_request_that_timed_out_drops_its_connection() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let late_sent = Arc::new(std::sync::Barrier::new(2));
    let server = {
        let late_sent = Arc::clone(&late_sent);
        std::thread::spawn(move || {
            let (mut first, _) = listener.accept().expect("first connection");
            accept_client(&mut first, port);
            wire::read_frame(&mut first, MAX_STORE_MESSAGE).expect("request");
            // A partial frame, then nothing until the client has given up.
            let mut stale = vec![REPLY_OK];
            stale.extend_from_slice(b"stale");
            let mut framed = (stale.len() as u32).to_le_bytes().to_vec();
            framed.extend_from_slice(&stale);
            first.write_all(&framed[..5]).expect("partial");
            // A client that kept its stream never comes back (the test then fails, not hangs).
            let second = accept_within(&listener, Duration::from_secs(10));
            first.write_all(&framed[5..]).expect("rest");
            late_sent.wait();
            let Some(mut second) = second else { return };
            accept_client(&mut second, port);
            wire::read_frame(&mut second, MAX_STORE_MESSAGE).expect("request");
            let mut fresh = vec![REPLY_OK];
            fresh.extend_from_slice(b"fresh");
            wire::write_frame(&mut second, &fresh).expect("reply");
            // Keep the first connection open until the client is done.
            let _ = wire::read_frame(&mut second, MAX_STORE_MESSAGE);
            drop(first);
        })
    };
    let s1 = Store::connect(&world(1, 2, port), Duration::from_millis(300)).expect("connect");
    let e = s1.try_get("k").expect_err("no reply in time");
    assert!(e.to_string().contains("reading a reply"), "{e}");
    // The interface that reaches the store is still known while no connection is open.
    assert!(s1.local_ip().is_some_and(|ip| ip.is_loopback()));
    // The reconnect's handshake waits until the late bytes are on the old stream.
    let got = std::thread::scope(|sc| {
        let h = sc.spawn(|| s1.try_get("k"));
        late_sent.wait();
        h.join().expect("join")
    });
    assert_eq!(got.expect("second request"), Some(b"fresh".to_vec()));
    drop(s1);
    server.join().expect("fake store");
}

/// A server on the store port that speaks the handshake but does not hold the token.
#[test]
fn a_store_that_cannot_prove_the_token_is_refused() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        wire::pretend_server(&mut s, |_| vec![0; 32])
    });
    let e = Store::connect(&world(1, 2, port), Duration::from_secs(5)).expect_err("refused");
    assert!(matches!(e, DistError::Unproven { .. }), "{e}");
    assert!(e.to_string().contains("could not prove"), "{e}");
    server
        .join()
        .expect("fake store")
        .expect("fake store's side");
}

#[test]
fn an_empty_token_off_loopback_is_refused_with_how_to_set_one() {
    let mut w = world(0, 2, free_port());
    w.master_addr = "192.0.2.1".into();
    w.job_token = String::new();
    let e = Store::connect(&w, Duration::from_secs(1)).expect_err("no token");
    assert!(matches!(e, DistError::NoJobToken { .. }), "{e}");
    let text = e.to_string();
    assert!(
        text.contains("BURN_DIST_JOB_TOKEN") && text.contains("--rdzv-id"),
        "{text}"
    );
}

#[test]
fn missing_rank_is_named_and_bad_clients_are_dropped() {
    let port = free_port();
    let s0 = Store::connect(&world(0, 3, port), Duration::from_secs(5)).expect("rank 0");
    // Garbage and a wrong token.
    let mut g = TcpStream::connect(("127.0.0.1", port)).expect("connect");
    io::Write::write_all(&mut g, b"\xff\xff\xff\x7fgarbage").expect("write");
    let mut w = world(1, 3, port);
    w.job_token = "wrong".into();
    let e = Store::connect(&w, Duration::from_secs(2)).expect_err("wrong token");
    assert!(e.to_string().contains("token"), "{e}");
    let e = s0
        .barrier("rendezvous", Duration::from_millis(300))
        .expect_err("missing");
    match e {
        DistError::RendezvousTimeout { missing, .. } => assert_eq!(missing, vec![1, 2]),
        e => panic!("unexpected {e}"),
    }
    // The store still works.
    s0.set("x", b"1").expect("set after garbage");
}

#[test]
fn port_in_use_is_named() {
    let l = TcpListener::bind("0.0.0.0:0").expect("bind");
    let port = l.local_addr().expect("addr").port();
    let e = Store::connect(&world(0, 2, port), Duration::from_secs(1)).expect_err("in use");
    assert!(e.to_string().contains(&port.to_string()), "{e}");
}

#[test]
fn every_address_of_the_master_is_tried() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let open = listener.local_addr().expect("addr");
    // A port on another loopback address that nobody listens on refuses at once.
    let refused = SocketAddr::from((Ipv4Addr::new(127, 0, 0, 2), free_port()));
    let s = connect_first(&[refused, open], Duration::from_secs(2)).expect("second address");
    assert_eq!(s.peer_addr().expect("peer"), open);
    let e = connect_first(&[refused], Duration::from_secs(2)).expect_err("refused");
    assert!(e.to_string().contains(&refused.to_string()), "{e}");
}

#[test]
fn an_ipv6_master_address_is_served_and_reached() {
    let port = free_port();
    let t = Duration::from_secs(5);
    let mut w0 = world(0, 2, port);
    w0.master_addr = "::1".into();
    let mut w1 = w0.clone();
    w1.rank = 1;
    let s0 = Store::connect(&w0, t).expect("rank 0 serves on ::1");
    let s1 = Store::connect(&w1, t).expect("rank 1 reaches ::1");
    assert_eq!(s1.addr(), format!("[::1]:{port}"));
    s1.set("k", b"v6").expect("set");
    assert_eq!(s0.get("k", t).expect("get"), b"v6");
    assert!(s1.local_ip().expect("ip").is_ipv6());
}

#[test]
fn an_unresolvable_master_address_is_named() {
    let mut w = world(0, 2, free_port());
    w.master_addr = "no-such-host.invalid".into();
    let e = Store::connect(&w, Duration::from_secs(1)).expect_err("unresolvable");
    assert!(e.to_string().contains("no-such-host.invalid"), "{e}");
}
