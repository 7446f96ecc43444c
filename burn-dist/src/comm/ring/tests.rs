//! The ring on real sockets, in threads.

use super::collectives::segment;
use super::*;
use crate::test_support::{free_port, local_world as world};
use std::sync::atomic::{AtomicUsize, Ordering};

#[test]
fn segments_cover_everything() {
    for len in [0usize, 1, 2, 5, 17, 1000] {
        for n in 1..6 {
            let mut next = 0;
            for i in 0..n {
                let s = segment(len, n, i);
                assert_eq!(s.start, next);
                next = s.end;
            }
            assert_eq!(next, len);
        }
    }
}

#[test]
fn threads_all_reduce() {
    let port = free_port();
    let n = 3;
    let t = Duration::from_secs(10);
    let handles: Vec<_> = (0..n)
        .map(|r| {
            std::thread::spawn(move || {
                let w = world(r, n, port);
                let store = Arc::new(Store::rendezvous(&w, t).expect("store"));
                let h = TcpRing::new(&w, store, t).expect("host");
                let mut v: Vec<f32> = (0..1_000_003).map(|i| (i % 7 + r) as f32).collect();
                h.all_reduce(HostBuf::F32(&mut v), ReduceOp::Sum)
                    .expect("allreduce");
                let mut b = vec![r as u8; 10];
                h.broadcast(HostBuf::U8(&mut b), 2).expect("bcast");
                assert_eq!(b, vec![2u8; 10]);
                h.barrier().expect("barrier");
                v
            })
        })
        .collect();
    let res: Vec<Vec<f32>> = handles
        .into_iter()
        .map(|h| h.join().expect("join"))
        .collect();
    for (i, x) in res[0].iter().enumerate() {
        assert_eq!(*x, (3 * (i % 7) + 3) as f32);
    }
    assert!(res.iter().all(|r| r == &res[0]));
}

/// A socket peer that sends one byte every 200 ms, forever.
fn trickler() -> (TcpStream, std::thread::JoinHandle<()>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let addr = listener.local_addr().expect("addr");
    let handle = std::thread::spawn(move || {
        if let Ok((mut s, _)) = listener.accept() {
            while s.write_all(&[7]).is_ok() {
                std::thread::sleep(Duration::from_millis(200));
            }
        }
    });
    (TcpStream::connect(addr).expect("connect"), handle)
}

/// The trickle would complete the read after 12.8 s: a read that a per-byte socket timeout let
/// stretch would succeed. So the read must fail with a timeout, and not before its deadline
/// (orderings, no speed measured).
#[test]
fn a_trickling_peer_cannot_stretch_a_read_past_the_deadline() {
    let (stream, _peer) = trickler();
    let mut link = Link::new(stream);
    let deadline = Instant::now() + Duration::from_millis(1500);
    link.deadline = deadline;
    let mut buf = [0u8; 64];
    let err = link
        .read_exact(&mut buf)
        .expect_err("64 bytes at 5 B/s cannot arrive in 1.5 s");
    assert!(is_timeout(&err), "{err}");
    assert!(Instant::now() >= deadline, "gave up before the deadline");
}

/// Rank 0 is a real `TcpRing`; the test plays rank 1 over the real protocol, then trickles the
/// first collective's header one byte per second (32 bytes: 32 s). Rank 0 must fail at its
/// deadline and name rank 1 before the header is complete, where a per-read socket timeout would
/// have waited for the whole header (an ordering: no speed is measured).
#[test]
fn a_trickling_rank_fails_the_collective_at_its_deadline() {
    let port = free_port();
    let deadline = Duration::from_secs(3);
    let rank0 = std::thread::spawn(move || {
        let w = world(0, 2, port);
        let store = Arc::new(Store::rendezvous(&w, deadline).expect("store"));
        let start = Instant::now();
        let result = TcpRing::new(&w, store, deadline);
        (result, start.elapsed())
    });
    let w1 = world(1, 2, port);
    let store = Store::rendezvous(&w1, deadline).expect("store");
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let me = listener.local_addr().expect("addr");
    store
        .set("burn-dist/host/addr/1", me.to_string().as_bytes())
        .expect("publish");
    let theirs = store
        .get("burn-dist/host/addr/0", deadline)
        .expect("rank 0's address");
    let theirs: SocketAddr = String::from_utf8_lossy(&theirs).parse().expect("address");
    let mut to_rank0 = TcpStream::connect(theirs).expect("connect");
    wire::client_handshake(&mut to_rank0, ConnKind::Ring, 1, &w1.job_token).expect("handshake");
    let (mut from_rank0, _) = listener.accept().expect("rank 0 connects");
    wire::server_handshake(&mut from_rank0, ConnKind::Ring, &w1.job_token)
        .expect("rank 0's handshake");
    let sent = Arc::new(AtomicUsize::new(0));
    let trickle = {
        let sent = Arc::clone(&sent);
        std::thread::spawn(move || {
            while to_rank0.write_all(&[0]).is_ok() {
                sent.fetch_add(1, Ordering::SeqCst);
                std::thread::sleep(Duration::from_secs(1));
            }
        })
    };
    let (result, waited) = rank0.join().expect("rank 0");
    let trickled = sent.load(Ordering::SeqCst);
    match result {
        // Whether the deadline reads as a plain timeout or as "never published its progress"
        // depends on whether the board was consulted in time; either way rank 1 is named.
        Err(DistError::Timeout { peer: 1, .. } | DistError::Unresponsive { peer: 1, .. }) => {}
        other => panic!("expected a timeout naming rank 1, got {other:?}"),
    }
    assert!(
        trickled < 32,
        "rank 0 gave up only after the whole header arrived ({waited:?}, deadline {deadline:?})"
    );
    drop(store);
    drop(trickle);
}

/// Rank 0 is a real `TcpRing`; the test plays rank 1 without the token. A client with the wrong
/// token is refused by rank 0's ring port, and rank 0 refuses a next rank that cannot prove the
/// token, at once rather than at the deadline.
#[test]
fn the_ring_refuses_the_wrong_token_both_ways() {
    let port = free_port();
    let deadline = Duration::from_secs(30);
    let rank0 = std::thread::spawn(move || {
        let w = world(0, 2, port);
        let store = Arc::new(Store::rendezvous(&w, deadline).expect("store"));
        TcpRing::new(&w, store, deadline)
    });
    let w1 = world(1, 2, port);
    let store = Store::rendezvous(&w1, deadline).expect("store");
    // Rank 0 accepts once it knows where rank 1 listens: here, a server without the token, which
    // answers rank 0 only after the wrong-token client below was refused.
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let me = listener.local_addr().expect("addr");
    let (go_tx, go_rx) = mpsc::channel::<()>();
    let fake = std::thread::spawn(move || {
        let (mut from_rank0, _) = listener.accept().expect("rank 0 connects");
        let _ = go_rx.recv();
        wire::pretend_server(&mut from_rank0, |_| vec![0; 32]).expect("pretend");
    });
    store
        .set("burn-dist/host/addr/1", me.to_string().as_bytes())
        .expect("publish");
    let theirs = store
        .get("burn-dist/host/addr/0", deadline)
        .expect("rank 0's address");
    let theirs: SocketAddr = String::from_utf8_lossy(&theirs).parse().expect("address");
    let mut to_rank0 = TcpStream::connect(theirs).expect("connect");
    let refused = wire::client_handshake(&mut to_rank0, ConnKind::Ring, 1, "a guess");
    drop(go_tx);
    match refused {
        Err(HandshakeError::Rejected(reason)) => {
            assert!(reason.contains("unknown job token"), "{reason}");
        }
        other => panic!("rank 0 must refuse a wrong token, got {other:?}"),
    }
    fake.join().expect("fake rank 1");
    match rank0.join().expect("rank 0") {
        Err(e @ DistError::Unproven { .. }) => {
            assert!(e.to_string().contains("could not prove"), "{e}");
        }
        other => panic!("rank 0 must refuse a next rank without the token, got {other:?}"),
    }
    drop(store);
}
