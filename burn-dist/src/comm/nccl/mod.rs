//! NCCL communicator (feature `cuda`): one NCCL communicator per process, unique id exchanged
//! through the rendezvous store.
//!
//! The communicator handle must not be shared between threads, so it lives on a dedicated thread
//! ([`worker`]) that owns it from creation to destruction; callers send requests over a channel.
//! The communicator is non-blocking: nothing waits on NCCL without a deadline, a deadline or a
//! peer's failure aborts it, and a request's buffers are released only once NCCL can no longer
//! touch them. After a failure every call answers [`DistError::Broken`] with the first cause.

mod ffi;
mod worker;

pub use crate::comm::device_call::{Collective, DeviceCall};
use crate::comm::{Communicator, DType, HostBuf, ReduceOp};
use crate::error::{DistError, Result};
use crate::rendezvous::store::Store;
use crate::rendezvous::world::World;
use cudarc::nccl::{result as nccl, sys as nsys};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use worker::{Broken, Request};

const ID_KEY: &str = "burn-dist/nccl/unique-id";

/// How long a caller waits for the NCCL thread beyond the deadline the thread enforces itself:
/// time for an abort and for the stream to drain. A backstop only.
const BACKSTOP: Duration = Duration::from_secs(60);

/// Number of CUDA devices visible to this process; 0 when no driver is installed. Probes the
/// driver library before calling it (cudarc panics otherwise).
pub(crate) fn cuda_device_count() -> usize {
    // SAFETY: `is_culib_present` only tries to dlopen the driver library; no CUDA call is made.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        return 0;
    }
    if cudarc::driver::result::init().is_err() {
        return 0;
    }
    cudarc::driver::result::device::get_count()
        .map(|c| c.max(0) as usize)
        .unwrap_or(0)
}

fn library_missing(library: &'static str, lib: &str, hint: &str) -> DistError {
    DistError::LibraryMissing {
        library,
        tried: cudarc::get_lib_name_candidates(lib),
        hint: hint.to_string(),
    }
}

/// NCCL communicator for one process and one CUDA device.
pub struct Nccl {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    /// `None` once dropped: closing the channel tells the thread to finalise the communicator.
    requests: Mutex<Option<mpsc::Sender<Request>>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    broken: Broken,
}

/// How long dropping a communicator waits for its thread to finalise it at most (beyond that the
/// thread is left to finish on its own, and said so).
const FINALIZE_BOUND: Duration = Duration::from_secs(60);

/// Joins `handle` if its thread ends within `bound`; `false` (the thread left running) otherwise.
pub(crate) fn join_within(handle: std::thread::JoinHandle<()>, bound: Duration) -> bool {
    let start = std::time::Instant::now();
    while !handle.is_finished() {
        if start.elapsed() >= bound {
            return false;
        }
        std::thread::sleep(Duration::from_millis(2));
    }
    let _ = handle.join();
    true
}

impl Drop for Nccl {
    /// Closes the request channel and waits (bounded) for the thread to finalise and destroy the
    /// communicator, so that a process does not exit in the middle of `ncclCommFinalize`.
    fn drop(&mut self) {
        drop(
            self.requests
                .get_mut()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        let thread = self
            .thread
            .get_mut()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(thread) = thread {
            let bound = self.timeout.min(FINALIZE_BOUND);
            if !join_within(thread, bound) {
                eprintln!(
                    "burn-dist: rank {}: the NCCL thread did not finish finalising within {bound:?};                      leaving it",
                    self.rank
                );
            }
        }
    }
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Nccl")
            .field("rank", &self.rank)
            .field("world_size", &self.world_size)
            .finish()
    }
}

fn nccl_type(dtype: DType) -> nsys::ncclDataType_t {
    match dtype {
        DType::F32 => nsys::ncclDataType_t::ncclFloat32,
        DType::F64 => nsys::ncclDataType_t::ncclFloat64,
        DType::F16 => nsys::ncclDataType_t::ncclFloat16,
        DType::BF16 => nsys::ncclDataType_t::ncclBfloat16,
        DType::I64 => nsys::ncclDataType_t::ncclInt64,
        DType::U8 => nsys::ncclDataType_t::ncclUint8,
    }
}

fn nccl_op(op: ReduceOp) -> nsys::ncclRedOp_t {
    match op {
        ReduceOp::Sum => nsys::ncclRedOp_t::ncclSum,
        ReduceOp::Avg => nsys::ncclRedOp_t::ncclAvg,
        ReduceOp::Max => nsys::ncclRedOp_t::ncclMax,
        ReduceOp::Min => nsys::ncclRedOp_t::ncclMin,
    }
}

impl Nccl {
    /// Whether the NCCL and CUDA driver libraries can be loaded.
    pub fn is_available() -> bool {
        // SAFETY: both probes only try to dlopen the libraries.
        unsafe { cudarc::driver::sys::is_culib_present() && nsys::is_culib_present() }
    }

    /// Creates the communicator of `world.rank` on CUDA device `device` (usually the local rank).
    /// Rank 0 creates the NCCL unique id and publishes it through `store`. A world of one is a
    /// real one-rank NCCL communicator (used to check the NCCL path on one GPU).
    ///
    /// # Errors
    /// [`DistError::LibraryMissing`] naming the library files tried (cudarc looks NCCL up as
    /// `libnccl.so`; Debian and pip ship `libnccl.so.2`: call [`crate::cuda_libs::prepare`] first
    /// in `main`, which links it); [`DistError::Nccl`] when initialisation fails;
    /// [`DistError::NcclTimeout`] when not every rank joins within `timeout`; store timeouts.
    pub fn new(world: &World, store: &Store, device: usize, timeout: Duration) -> Result<Self> {
        // SAFETY: only dlopen probes, before any other cudarc call (which would panic).
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(library_missing(
                "the CUDA driver",
                "cuda",
                "install the NVIDIA driver, or use the host backend (--backend host) on machines without a GPU",
            ));
        }
        // SAFETY: as above.
        if !unsafe { nsys::is_culib_present() } {
            return Err(library_missing(
                "NCCL",
                "nccl",
                "install NCCL (`pip install nvidia-nccl-cu12` or Debian's libnccl2); programs that call \
                 burn_dist::cuda_libs::prepare() first find libnccl.so.2 there themselves, others need \
                 a `libnccl.so` symlink to it in a folder on LD_LIBRARY_PATH",
            ));
        }
        let rank = world.rank;
        let err = |op: &'static str, detail: String| DistError::Nccl { op, rank, detail };
        let id_bytes: Vec<u8> = if rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| {
                err(
                    "ncclGetUniqueId",
                    format!(
                        "{} (NCCL {})",
                        ffi::describe(e.0, std::ptr::null_mut()),
                        ffi::version()
                    ),
                )
            })?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            store.set(ID_KEY, &bytes)?;
            bytes
        } else {
            store.get(ID_KEY, timeout)?
        };
        let internal: [std::ffi::c_char; 128] = id_bytes
            .iter()
            .map(|b| *b as std::ffi::c_char)
            .collect::<Vec<_>>()
            .try_into()
            .map_err(|_| {
                err(
                    "exchanging the unique id",
                    format!("got {} bytes, expected 128", id_bytes.len()),
                )
            })?;
        let broken: Broken = Arc::default();
        let setup = worker::Setup {
            rank,
            world_size: world.world_size,
            device,
            id: nsys::ncclUniqueId { internal },
            timeout,
            broken: Arc::clone(&broken),
        };
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let thread = std::thread::Builder::new()
            .name(format!("burn-dist-nccl-{rank}"))
            .spawn(move || worker::run(setup, rx, ready_tx))
            .map_err(|e| err("starting the NCCL thread", e.to_string()))?;
        match ready_rx.recv_timeout(timeout + BACKSTOP) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => {
                // The thread has sent its error and returns.
                join_within(thread, BACKSTOP);
                return Err(e);
            }
            Err(_) => {
                return Err(DistError::NcclTimeout {
                    op: "ncclCommInitRankConfig",
                    rank,
                    deadline: timeout,
                });
            }
        }
        Ok(Self {
            rank,
            world_size: world.world_size,
            timeout,
            requests: Mutex::new(Some(tx)),
            thread: Mutex::new(Some(thread)),
            broken,
        })
    }

    /// Runs `calls` on this communicator's stream (one NCCL group when there are several) and
    /// waits for them, within the deadline. `keep_alive` owns the buffers the calls address: it
    /// is dropped only once NCCL can no longer touch them, also when the call fails or times out
    /// (then possibly after this function has returned, or never, if the device does not drain).
    ///
    /// # Safety
    /// Every call's `send` and `recv` must address enough device memory of this communicator's
    /// device for its `count` and `dtype` (see [`DeviceCall`]), kept allocated by `keep_alive`;
    /// the work that produced `send` must have completed (synchronise the device first: NCCL runs
    /// on its own stream), and nothing else may read `recv` or write either buffer until this
    /// function returns `Ok`.
    ///
    /// # Errors
    /// [`DistError::Nccl`], [`DistError::NcclTimeout`] or [`DistError::Broken`].
    pub unsafe fn run_device(
        &self,
        name: &'static str,
        calls: Vec<DeviceCall>,
        keep_alive: Box<dyn Send>,
    ) -> Result<()> {
        self.call(name, |reply| Request::Device {
            name,
            calls,
            keep_alive,
            reply,
        })
    }

    fn call<T>(
        &self,
        op: &'static str,
        make: impl FnOnce(mpsc::Sender<Result<T>>) -> Request,
    ) -> Result<T> {
        let first_failure = || {
            self.broken
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .clone()
        };
        if let Some(first) = first_failure() {
            return Err(DistError::Broken {
                rank: self.rank,
                first,
            });
        }
        let (reply_tx, reply_rx) = mpsc::channel();
        let sent = self
            .requests
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map(|tx| tx.send(make(reply_tx)));
        if !matches!(sent, Some(Ok(()))) {
            return Err(DistError::Broken {
                rank: self.rank,
                first: first_failure().unwrap_or_else(|| "the NCCL thread has stopped".into()),
            });
        }
        match reply_rx.recv_timeout(self.timeout + BACKSTOP) {
            Ok(r) => r,
            Err(_) => {
                let e = DistError::NcclTimeout {
                    op,
                    rank: self.rank,
                    deadline: self.timeout,
                };
                worker::record(
                    &self.broken,
                    format!("{e} (the NCCL thread did not answer)"),
                );
                Err(e)
            }
        }
    }

    fn host(&self, collective: Collective, mut buf: HostBuf<'_>) -> Result<()> {
        let dtype = buf.dtype();
        let data = buf.bytes_mut().to_vec();
        let out = self.call(collective.nccl_name(), |reply| Request::Host {
            collective,
            data,
            dtype,
            reply,
        })?;
        buf.bytes_mut().copy_from_slice(&out);
        Ok(())
    }
}

impl Communicator for Nccl {
    fn as_nccl(&self) -> Option<&Nccl> {
        Some(self)
    }
    fn rank(&self) -> usize {
        self.rank
    }
    fn world_size(&self) -> usize {
        self.world_size
    }
    fn timeout(&self) -> Duration {
        self.timeout
    }
    fn backend_name(&self) -> &'static str {
        "nccl"
    }
    /// A one-rank NCCL communicator still runs every collective: it is how one GPU checks the
    /// NCCL path.
    fn skips_collectives(&self) -> bool {
        false
    }

    fn all_reduce(&self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        self.host(Collective::AllReduce(op), buf)
    }

    fn broadcast(&self, buf: HostBuf<'_>, root: usize) -> Result<()> {
        crate::comm::check_root(root, self.world_size)?;
        self.host(Collective::Broadcast { root }, buf)
    }

    fn all_gather(&self, buf: HostBuf<'_>) -> Result<()> {
        crate::comm::check_gather_len(buf.len(), self.world_size)?;
        self.host(Collective::AllGather, buf)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn dropping_joins_a_thread_that_ends_and_bounds_one_that_does_not() {
        let quick = std::thread::spawn(|| std::thread::sleep(Duration::from_millis(20)));
        assert!(join_within(quick, Duration::from_secs(30)));
        let (release, wait) = mpsc::channel::<()>();
        let stuck = std::thread::spawn(move || {
            let _ = wait.recv();
        });
        assert!(!join_within(stuck, Duration::from_millis(50)), "bounded");
        drop(release);
    }

    #[test]
    fn missing_libraries_are_reported_not_panicked() {
        // Never panics, with or without a driver.
        let _ = cuda_device_count();
        if Nccl::is_available() {
            return;
        }
        let port = crate::test_support::free_port();
        let world = World {
            master_port: port,
            ..World::single()
        };
        let store = Store::connect(&world, Duration::from_secs(2)).expect("store");
        match Nccl::new(&world, &store, 0, Duration::from_secs(2)) {
            Err(DistError::LibraryMissing { tried, hint, .. }) => {
                assert!(!tried.is_empty());
                assert!(!hint.is_empty());
            }
            other => panic!("expected LibraryMissing, got {other:?}"),
        }
    }
}
