//! Ports and job tokens for tests that start jobs on 127.0.0.1: one copy for every test crate of
//! the workspace (burn-dist's in-crate and integration tests, train's integration tests include
//! this file).

use std::net::TcpListener;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A port nobody listens on right now, never handed out twice by this test process (its tests
/// run in parallel threads). A port another process takes meanwhile fails that job loudly:
/// every job has its own token ([`job_token`]).
pub fn free_port() -> u16 {
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

/// A job token no other job of any test shares: two jobs that met on one port refuse each
/// other instead of mixing.
pub fn job_token(what: &str) -> String {
    static NEXT: AtomicUsize = AtomicUsize::new(0);
    format!(
        "{what}-{}-{}",
        std::process::id(),
        NEXT.fetch_add(1, Ordering::Relaxed)
    )
}
