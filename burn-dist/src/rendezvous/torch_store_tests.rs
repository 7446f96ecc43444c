//! The client against the bytes of a real torch TCPStore (fixtures recorded by
//! `scripts/make_tcpstore_fixtures.py`), replayed by a server on a real socket.

use super::*;
use std::net::TcpListener;
use std::thread::JoinHandle;

/// The key prefix the fixtures were recorded with (a run id of `none`, no restart yet).
const PREFIX: &str = "/burn-dist/none/attempt_0/";
const LONG: Duration = Duration::from_secs(5);

#[derive(Clone)]
enum Item {
    /// Bytes torch's client sent.
    Client(Vec<u8>),
    /// Bytes torch's server answered.
    Server(Vec<u8>),
    /// The server answered after this pause.
    Pause(Duration),
}

#[derive(Clone)]
struct Section {
    op: String,
    items: Vec<Item>,
}

fn hex(s: &str) -> Vec<u8> {
    assert!(s.len().is_multiple_of(2), "odd hex {s:?}");
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).expect("hex digit"))
        .collect()
}

fn hex_of(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

fn parse(text: &str) -> Vec<Section> {
    let mut sections: Vec<Section> = Vec::new();
    for line in text
        .lines()
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
    {
        let (tag, rest) = line.split_once(' ').expect("tagged line");
        if tag == "==" {
            sections.push(Section {
                op: rest.to_string(),
                items: Vec::new(),
            });
            continue;
        }
        let item = match tag {
            ">" => Item::Client(hex(rest)),
            "<" => Item::Server(hex(rest)),
            "~" => Item::Pause(Duration::from_millis(rest.parse().expect("ms"))),
            other => panic!("unknown fixture line tag {other:?}"),
        };
        sections.last_mut().expect("a section").items.push(item);
    }
    sections
}

/// Serves one connection, playing torch's server: checks every byte the client sends against
/// the fixture and answers what torch's server answered.
fn replay(sections: Vec<Section>) -> (u16, JoinHandle<std::result::Result<(), String>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().map_err(|e| e.to_string())?;
        s.set_read_timeout(Some(LONG)).map_err(|e| e.to_string())?;
        for section in &sections {
            for item in &section.items {
                match item {
                    Item::Client(expected) => {
                        let mut got = vec![0u8; expected.len()];
                        s.read_exact(&mut got).map_err(|e| {
                            format!(
                                "{}: reading {} client bytes: {e}",
                                section.op,
                                expected.len()
                            )
                        })?;
                        if &got != expected {
                            return Err(format!(
                                "{}: the client sent {}, torch's client sent {}",
                                section.op,
                                hex_of(&got),
                                hex_of(expected)
                            ));
                        }
                    }
                    Item::Server(answer) => s.write_all(answer).map_err(|e| e.to_string())?,
                    Item::Pause(d) => std::thread::sleep(*d),
                }
            }
        }
        let mut extra = Vec::new();
        let _ = s.read_to_end(&mut extra);
        if extra.is_empty() {
            Ok(())
        } else {
            Err(format!("the client sent more: {}", hex_of(&extra)))
        }
    });
    (port, server)
}

fn value(field: &str) -> Vec<u8> {
    if field == "-" { Vec::new() } else { hex(field) }
}

fn keys(field: &str) -> Vec<String> {
    field.split(',').map(|k| format!("{PREFIX}{k}")).collect()
}

/// Performs the fixture's operation `op` and checks the result torch's client got.
fn perform(store: &mut TorchStore, op: &str) -> std::result::Result<(), String> {
    let f: Vec<&str> = op.split(' ').collect();
    let key = |i: usize| format!("{PREFIX}{}", f[i]);
    let fail = |e: DistError| format!("{op}: {e}");
    match f[0] {
        "set" => store.set(&key(1), &value(f[2])).map_err(fail),
        "get" => {
            let got = store.get(&key(1), LONG).map_err(fail)?;
            (got == value(f[2]))
                .then_some(())
                .ok_or_else(|| format!("{op}: got {}", hex_of(&got)))
        }
        "add" => {
            let got = store
                .add(&key(1), f[2].parse().expect("delta"))
                .map_err(fail)?;
            (got.to_string() == f[3])
                .then_some(())
                .ok_or_else(|| format!("{op}: got {got}"))
        }
        "set-if-absent" => {
            let got = store.set_if_absent(&key(1), &value(f[2])).map_err(fail)?;
            (got == value(f[3]))
                .then_some(())
                .ok_or_else(|| format!("{op}: got {}", hex_of(&got)))
        }
        "check" => {
            let ks = keys(f[1]);
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            let ready = store.check(&refs).map_err(fail)?;
            (ready == (f[2] == "ready"))
                .then_some(())
                .ok_or_else(|| format!("{op}: got ready={ready}"))
        }
        "wait" => {
            let ks = keys(f[1]);
            let refs: Vec<&str> = ks.iter().map(String::as_str).collect();
            let ms: u64 = f[2].parse().expect("ms");
            let done = store.wait(&refs, Duration::from_millis(ms)).map_err(fail)?;
            (done == (f[3] == "done"))
                .then_some(())
                .ok_or_else(|| format!("{op}: got done={done}"))
        }
        other => panic!("the fixture has an operation this test does not know: {other:?}"),
    }
}

fn replays_fixture(text: &str) {
    let sections = parse(text);
    let ops: Vec<&str> = sections.iter().map(|s| s.op.as_str()).collect();
    assert_eq!(ops.first(), Some(&"connect"), "{ops:?}");
    for needed in ["set", "get", "add", "set-if-absent", "check", "wait"] {
        assert!(
            ops.iter().any(|o| o.starts_with(needed)),
            "the fixture lacks {needed}: {ops:?}"
        );
    }
    // torch's client pings with its pid; ours must send the same nonce to match byte for byte.
    let Some(Item::Client(hello)) = sections[0].items.first() else {
        panic!("the fixture's connect starts with the client's bytes");
    };
    let nonce = u32::from_le_bytes(hello[hello.len() - 4..].try_into().expect("4 bytes"));
    let (port, server) = replay(sections.clone());
    let result = (|| {
        let mut store = TorchStore::connect_with_nonce("127.0.0.1", port, 0, LONG, nonce)
            .map_err(|e| format!("connect: {e}"))?;
        for section in &sections[1..] {
            perform(&mut store, &section.op)?;
        }
        Ok::<(), String>(())
    })();
    let served = server.join().expect("replay thread");
    if let Err(e) = served {
        panic!("{e} (client side: {result:?})");
    }
    if let Err(e) = result {
        panic!("{e}");
    }
}

#[test]
fn speaks_torchs_protocol_to_the_libuv_server() {
    replays_fixture(include_str!("../../tests/fixtures/tcpstore/libuv.txt"));
}

#[test]
fn speaks_torchs_protocol_to_the_classic_server() {
    replays_fixture(include_str!("../../tests/fixtures/tcpstore/classic.txt"));
}

/// Accepts `n` connections and runs `serve` on each, in order.
fn fake_server(
    n: usize,
    serve: impl Fn(usize, &mut TcpStream) -> io::Result<()> + Send + 'static,
) -> (u16, JoinHandle<io::Result<()>>) {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        for i in 0..n {
            let (mut s, _) = listener.accept()?;
            s.set_read_timeout(Some(LONG))?;
            let mut hello = [0u8; 10];
            s.read_exact(&mut hello)?;
            s.write_all(&hello[6..])?;
            serve(i, &mut s)?;
        }
        Ok(())
    });
    (port, server)
}

#[test]
fn a_wait_ended_while_cancelling_counts_as_done() {
    let (port, server) = fake_server(1, |_, s| {
        let mut wait = vec![0u8; keys_request(WAIT, &["k"]).len()];
        s.read_exact(&mut wait)?;
        let mut cancel = [0u8; 1];
        s.read_exact(&mut cancel)?;
        assert_eq!(cancel[0], CANCEL_WAIT);
        s.write_all(&[STOP_WAITING, WAIT_CANCELED])?;
        let mut check = vec![0u8; keys_request(CHECK, &["k"]).len()];
        s.read_exact(&mut check)?;
        s.write_all(&[READY])
    });
    let mut store = TorchStore::connect("127.0.0.1", port, 0, LONG).expect("connect");
    assert!(store.wait(&["k"], Duration::from_millis(50)).expect("wait"));
    // Both answers were read: the next exchange is in step.
    assert!(store.check(&["k"]).expect("check"));
    server.join().expect("thread").expect("server");
}

#[test]
fn a_connection_that_failed_midway_is_replaced() {
    let (port, server) = fake_server(2, |i, s| {
        let mut check = vec![0u8; keys_request(CHECK, &["k"]).len()];
        s.read_exact(&mut check)?;
        if i == 0 {
            // No answer: the connection dies.
            return Ok(());
        }
        s.write_all(&[NOT_READY])
    });
    let mut store = TorchStore::connect("127.0.0.1", port, 0, LONG).expect("connect");
    let e = store
        .check(&["k"])
        .expect_err("the first connection closes");
    assert!(e.to_string().contains("check failed"), "{e}");
    assert!(!store.check(&["k"]).expect("a new connection answers"));
    server.join().expect("thread").expect("server");
}

#[test]
fn a_server_that_is_not_a_torch_store_is_named() {
    let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
    let port = listener.local_addr().expect("addr").port();
    let server = std::thread::spawn(move || {
        let (mut s, _) = listener.accept().expect("accept");
        let mut hello = [0u8; 10];
        s.read_exact(&mut hello).expect("hello");
        s.write_all(b"HTTP").expect("answer");
    });
    let e = TorchStore::connect("127.0.0.1", port, 3, LONG)
        .err()
        .expect("not a store");
    let text = e.to_string();
    assert!(
        text.contains("rank 3") && text.contains("torchrun"),
        "{text}"
    );
    server.join().expect("server");
}
