//! `BURN_DIST_BACKEND=nccl` forces a real NCCL communicator even in a world of one. On a machine
//! without CUDA (or a build without the `cuda` feature) that must be a clear error, never a panic.

use burn_dist::{BACKEND_ENV, CommBackend, DistError, DistOptions, World};

fn lookup(value: &'static str) -> impl Fn(&str) -> Option<String> {
    move |k| (k == BACKEND_ENV).then(|| value.to_string())
}

#[test]
fn backend_env_selects_and_forces_the_backend() {
    let nccl = DistOptions::from_lookup(CommBackend::Ring, lookup("nccl")).expect("nccl");
    assert_eq!(nccl.backend, CommBackend::Nccl);
    assert!(nccl.force_backend);
    let ring = DistOptions::from_lookup(CommBackend::Nccl, lookup("ring")).expect("ring");
    assert_eq!(ring.backend, CommBackend::Ring);
    // The ring's old name still selects it.
    let host = DistOptions::from_lookup(CommBackend::Nccl, lookup("host")).expect("host");
    assert_eq!(host.backend, CommBackend::Ring);
    let unset = DistOptions::from_lookup(CommBackend::Nccl, |_| None).expect("unset");
    assert_eq!(unset.backend, CommBackend::Nccl);
    assert!(
        !unset.force_backend,
        "without the variable a world of one stays trivial"
    );
}

#[test]
fn unknown_backend_is_an_error_naming_the_variable() {
    match DistOptions::from_lookup(CommBackend::Ring, lookup("gloo")) {
        Err(DistError::InvalidEnv { var, value, .. }) => {
            assert_eq!(var, BACKEND_ENV);
            assert_eq!(value, "gloo");
        }
        other => panic!("expected InvalidEnv, got {other:?}"),
    }
}

#[test]
fn forced_nccl_without_cuda_is_an_error_not_a_panic() {
    if burn_dist::Nccl::is_available() {
        eprintln!("NCCL and a CUDA driver are present: this test is for machines without them");
        return;
    }
    let options = DistOptions {
        backend: CommBackend::Nccl,
        force_backend: true,
        ..DistOptions::default()
    };
    let result = std::panic::catch_unwind(|| burn_dist::init(&World::single(), &options));
    match result {
        Ok(Err(DistError::LibraryMissing { tried, hint, .. })) => {
            assert!(!tried.is_empty(), "the error lists the library names tried");
            assert!(!hint.is_empty());
        }
        Ok(Err(DistError::NotCompiledWithCuda)) => {}
        Ok(Err(other)) => panic!("expected LibraryMissing or NotCompiledWithCuda, got {other}"),
        Ok(Ok(_)) => panic!("NCCL initialised on a machine without it"),
        Err(_) => panic!("forcing NCCL without CUDA panicked"),
    }
}

#[test]
fn a_world_of_one_without_forcing_opens_nothing() {
    let dist = burn_dist::init(&World::single(), &DistOptions::default()).expect("init");
    assert!(dist.store.is_none());
    assert!(dist.comm.skips_collectives());
}
