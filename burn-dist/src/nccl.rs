//! NCCL communicator (feature `cuda`): one NCCL communicator per process, unique id exchanged
//! through the rendezvous store.
//!
//! The communicator handle is a raw pointer that must not be shared between threads, so it lives
//! on a dedicated thread that owns it from creation to destruction; callers send requests over a
//! channel. That thread polls the stream and `ncclCommGetAsyncError` instead of blocking, and
//! calls `ncclCommAbort` when the deadline passes, so a dead peer becomes an error, not a hang.

use crate::comm::{Communicator, DType, HostBuf, ReduceOp};
use crate::error::{DistError, Result};
use crate::store::Store;
use crate::world::World;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::{result as nccl, sys as nsys};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

const ID_KEY: &str = "burn-dist/nccl/unique-id";

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

/// Work the NCCL thread runs on host data, staged through device memory.
enum Request {
    AllReduce {
        data: Vec<u8>,
        dtype: DType,
        op: ReduceOp,
        reply: mpsc::Sender<Result<Vec<u8>>>,
    },
    Broadcast {
        data: Vec<u8>,
        dtype: DType,
        root: usize,
        reply: mpsc::Sender<Result<Vec<u8>>>,
    },
    AllGather {
        data: Vec<u8>,
        dtype: DType,
        reply: mpsc::Sender<Result<Vec<u8>>>,
    },
    /// All-reduce between two device buffers of the caller (replies with an empty vector).
    AllReduceDevice {
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
        reply: mpsc::Sender<Result<Vec<u8>>>,
    },
}

/// NCCL communicator for one process and one CUDA device.
pub struct Nccl {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    requests: Mutex<Option<mpsc::Sender<Request>>>,
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
    /// Rank 0 creates the NCCL unique id and publishes it through `store`.
    ///
    /// # Errors
    /// [`DistError::LibraryMissing`] naming the library files tried (NCCL is looked up as
    /// `libnccl.so`; Debian and pip ship `libnccl.so.2`: add a `libnccl.so` symlink in a directory
    /// on `LD_LIBRARY_PATH`); [`DistError::Nccl`] when initialisation fails; store timeouts.
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
                "install NCCL (e.g. `pip install nvidia-nccl-cu12` or Debian's libnccl2) and create a \
                 `libnccl.so` symlink to `libnccl.so.2` in a directory listed in LD_LIBRARY_PATH",
            ));
        }
        let rank = world.rank;
        let err = |op: &'static str, detail: String| DistError::Nccl { op, rank, detail };
        let id_bytes: Vec<u8> = if rank == 0 {
            let id = nccl::get_uniqueid().map_err(|e| err("ncclGetUniqueId", format!("{e:?}")))?;
            let bytes: Vec<u8> = id.internal.iter().map(|c| *c as u8).collect();
            store.set(ID_KEY, &bytes)?;
            bytes
        } else {
            store.get(ID_KEY, timeout)?
        };
        if id_bytes.len() != 128 {
            return Err(err(
                "exchanging the unique id",
                format!("got {} bytes, expected 128", id_bytes.len()),
            ));
        }
        let mut internal = [0 as std::ffi::c_char; 128];
        internal
            .iter_mut()
            .zip(&id_bytes)
            .for_each(|(d, s)| *d = *s as std::ffi::c_char);
        let id = nsys::ncclUniqueId { internal };
        let (tx, rx) = mpsc::channel::<Request>();
        let (ready_tx, ready_rx) = mpsc::channel::<Result<()>>();
        let n = world.world_size;
        std::thread::Builder::new()
            .name(format!("burn-dist-nccl-{rank}"))
            .spawn(move || nccl_thread(rank, n, device, id, timeout, rx, ready_tx))
            .map_err(|e| err("starting the NCCL thread", e.to_string()))?;
        match ready_rx.recv_timeout(timeout + Duration::from_secs(5)) {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(DistError::NcclTimeout {
                    op: "ncclCommInitRank",
                    rank,
                    deadline: timeout,
                });
            }
        }
        Ok(Self {
            rank,
            world_size: n,
            timeout,
            requests: Mutex::new(Some(tx)),
        })
    }

    /// All-reduces `count` elements from device buffer `send` into device buffer `recv` (they may
    /// be equal), on this communicator's stream, and waits for it (deadline, async errors).
    ///
    /// # Safety
    /// `send` and `recv` must address at least `count` elements of `dtype` of device memory of
    /// this communicator's device, in its primary context, that stay allocated and are neither
    /// read nor written by other work until this call returns; the work that produced `send` must
    /// have completed (synchronise the device first: NCCL runs on its own stream).
    ///
    /// # Errors
    /// [`DistError::Nccl`], [`DistError::NcclTimeout`] or [`DistError::Broken`].
    pub unsafe fn all_reduce_device(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        self.call("ncclAllReduce", |reply| Request::AllReduceDevice {
            send,
            recv,
            count,
            dtype,
            op,
            reply,
        })
        .map(|_| ())
    }

    fn call(
        &self,
        op: &'static str,
        make: impl FnOnce(mpsc::Sender<Result<Vec<u8>>>) -> Request,
    ) -> Result<Vec<u8>> {
        let (reply_tx, reply_rx) = mpsc::channel();
        let guard = self.requests.lock().unwrap_or_else(|e| e.into_inner());
        let Some(tx) = guard.as_ref() else {
            return Err(DistError::Broken {
                rank: self.rank,
                first: "the NCCL communicator was aborted".into(),
            });
        };
        tx.send(make(reply_tx)).map_err(|_| DistError::Broken {
            rank: self.rank,
            first: "the NCCL thread has stopped".into(),
        })?;
        // The NCCL thread enforces the deadline itself (and aborts); this is a backstop.
        match reply_rx.recv_timeout(self.timeout + Duration::from_secs(30)) {
            Ok(r) => r,
            Err(_) => Err(DistError::NcclTimeout {
                op,
                rank: self.rank,
                deadline: self.timeout,
            }),
        }
    }
}

struct Worker {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    stream: Arc<CudaStream>,
    comm: nsys::ncclComm_t,
    aborted: bool,
}

impl Worker {
    fn err(&self, op: &'static str, detail: String) -> DistError {
        DistError::Nccl {
            op,
            rank: self.rank,
            detail,
        }
    }

    /// Waits for the stream while watching NCCL's asynchronous errors and the deadline.
    fn wait(&mut self, op: &'static str) -> Result<()> {
        let start = Instant::now();
        loop {
            // SAFETY: the stream handle is valid while `self.stream` lives.
            let status = unsafe { cudarc::driver::sys::cuStreamQuery(self.stream.cu_stream()) };
            match status {
                cudarc::driver::sys::CUresult::CUDA_SUCCESS => return Ok(()),
                cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => return Err(self.err(op, format!("CUDA error {other:?}"))),
            }
            let mut async_err = nsys::ncclResult_t::ncclSuccess;
            // SAFETY: `self.comm` is a live communicator owned by this thread; `async_err` is a
            // valid out-pointer.
            unsafe { nsys::ncclCommGetAsyncError(self.comm, &mut async_err) };
            if async_err != nsys::ncclResult_t::ncclSuccess {
                self.abort();
                return Err(self.err(
                    op,
                    format!("asynchronous NCCL error {async_err:?} (a peer may have died)"),
                ));
            }
            if start.elapsed() > self.timeout {
                self.abort();
                return Err(DistError::NcclTimeout {
                    op,
                    rank: self.rank,
                    deadline: self.timeout,
                });
            }
            std::thread::sleep(Duration::from_micros(200));
        }
    }

    fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: `self.comm` is live and owned by this thread; after abort it is never used again.
            let _ = unsafe { nccl::comm_abort(self.comm) };
        }
    }

    fn run(&mut self, req: Request) {
        let (reply, result) = match req {
            Request::AllReduce {
                data,
                dtype,
                op,
                reply,
            } => (
                reply,
                self.host_op("ncclAllReduce", data, dtype, |ptr, count, comm, s| {
                    // SAFETY: `ptr` addresses `count` elements of device memory that stay alive until the
                    // stream is synchronised in `host_op`; in-place all-reduce is allowed by NCCL.
                    unsafe {
                        nccl::all_reduce(
                            ptr as *const _,
                            ptr as *mut _,
                            count,
                            nccl_type(dtype),
                            nccl_op(op),
                            comm,
                            s,
                        )
                    }
                }),
            ),
            Request::Broadcast {
                data,
                dtype,
                root,
                reply,
            } => (
                reply,
                self.host_op("ncclBroadcast", data, dtype, |ptr, count, comm, s| {
                    // SAFETY: as above; in-place broadcast is allowed by NCCL.
                    unsafe {
                        nccl::broadcast(
                            ptr as *const _,
                            ptr as *mut _,
                            count,
                            nccl_type(dtype),
                            root as i32,
                            comm,
                            s,
                        )
                    }
                }),
            ),
            Request::AllGather { data, dtype, reply } => {
                let (rank, world) = (self.rank, self.world_size);
                (
                    reply,
                    self.host_op("ncclAllGather", data, dtype, move |ptr, count, comm, s| {
                        let send_count = count / world.max(1);
                        let send = ptr + (rank * send_count * dtype.size()) as u64;
                        // SAFETY: `send` points at this rank's block inside the same live buffer: the
                        // in-place form NCCL documents (sendbuff == recvbuff + rank * sendcount).
                        unsafe {
                            nccl::all_gather(
                                send as *const _,
                                ptr as *mut _,
                                send_count,
                                nccl_type(dtype),
                                comm,
                                s,
                            )
                        }
                    }),
                )
            }
            Request::AllReduceDevice {
                send,
                recv,
                count,
                dtype,
                op,
                reply,
            } => (
                reply,
                self.device_all_reduce(send, recv, count, dtype, op)
                    .map(|()| Vec::new()),
            ),
        };
        let _ = reply.send(result);
    }

    fn device_all_reduce(
        &mut self,
        send: u64,
        recv: u64,
        count: usize,
        dtype: DType,
        op: ReduceOp,
    ) -> Result<()> {
        if self.aborted {
            return Err(DistError::Broken {
                rank: self.rank,
                first: "the NCCL communicator was aborted after an earlier error".into(),
            });
        }
        if count == 0 {
            return Ok(());
        }
        // SAFETY: the caller of `Nccl::all_reduce_device` guarantees both buffers hold `count`
        // elements of live device memory of this device and context until we reply, and we reply
        // only after `wait` has seen the stream finish.
        unsafe {
            nccl::all_reduce(
                send as *const _,
                recv as *mut _,
                count,
                nccl_type(dtype),
                nccl_op(op),
                self.comm,
                self.stream.cu_stream() as nsys::cudaStream_t,
            )
        }
        .map_err(|e| self.err("ncclAllReduce", format!("{e:?}")))?;
        self.wait("ncclAllReduce")
    }

    fn host_op(
        &mut self,
        op: &'static str,
        data: Vec<u8>,
        dtype: DType,
        f: impl FnOnce(
            u64,
            usize,
            nsys::ncclComm_t,
            nsys::cudaStream_t,
        ) -> std::result::Result<nccl::NcclStatus, nccl::NcclError>,
    ) -> Result<Vec<u8>> {
        if self.aborted {
            return Err(DistError::Broken {
                rank: self.rank,
                first: "the NCCL communicator was aborted after an earlier error".into(),
            });
        }
        if data.is_empty() {
            return Ok(data);
        }
        let count = data.len() / dtype.size();
        let stream = Arc::clone(&self.stream);
        let dev = stream
            .clone_htod(&data)
            .map_err(|e| self.err(op, format!("copy to device: {e:?}")))?;
        {
            let (ptr, _sync) = dev.device_ptr(&stream);
            f(
                ptr,
                count,
                self.comm,
                stream.cu_stream() as nsys::cudaStream_t,
            )
            .map_err(|e| self.err(op, format!("{e:?}")))?;
        }
        self.wait(op)?;
        stream
            .clone_dtoh(&dev)
            .map_err(|e| self.err(op, format!("copy to host: {e:?}")))
    }
}

fn nccl_thread(
    rank: usize,
    world_size: usize,
    device: usize,
    id: nsys::ncclUniqueId,
    timeout: Duration,
    requests: mpsc::Receiver<Request>,
    ready: mpsc::Sender<Result<()>>,
) {
    let setup = || -> Result<Worker> {
        let e = |op: &'static str, d: String| DistError::Nccl {
            op,
            rank,
            detail: d,
        };
        let ctx = CudaContext::new(device).map_err(|x| {
            e(
                "creating the CUDA context",
                format!("device {device}: {x:?}"),
            )
        })?;
        ctx.bind_to_thread()
            .map_err(|x| e("binding the CUDA context", format!("{x:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|x| e("creating a CUDA stream", format!("{x:?}")))?;
        let mut comm = std::mem::MaybeUninit::<nsys::ncclComm_t>::uninit();
        // SAFETY: `comm` is a valid out-pointer; `id` is the unique id shared by all ranks; NCCL
        // writes the communicator handle before returning success.
        let comm = unsafe {
            nccl::comm_init_rank(comm.as_mut_ptr(), world_size as i32, id, rank as i32)
                .map_err(|x| e("ncclCommInitRank", format!("{x:?}")))?;
            comm.assume_init()
        };
        Ok(Worker {
            rank,
            world_size,
            timeout,
            stream,
            comm,
            aborted: false,
        })
    };
    let mut worker = match setup() {
        Ok(w) => {
            let _ = ready.send(Ok(()));
            w
        }
        Err(e) => {
            let _ = ready.send(Err(e));
            return;
        }
    };
    for req in requests {
        worker.run(req);
    }
    if !worker.aborted {
        // SAFETY: the communicator is live, owned by this thread, and not used afterwards.
        let _ = unsafe { nccl::comm_destroy(worker.comm) };
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

    fn all_reduce(&self, mut buf: HostBuf<'_>, op: ReduceOp) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let dtype = buf.dtype();
        let data = buf.bytes_mut().to_vec();
        let out = self.call("all_reduce", |reply| Request::AllReduce {
            data,
            dtype,
            op,
            reply,
        })?;
        buf.bytes_mut().copy_from_slice(&out);
        Ok(())
    }

    fn broadcast(&self, mut buf: HostBuf<'_>, root: usize) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let dtype = buf.dtype();
        let data = buf.bytes_mut().to_vec();
        let out = self.call("broadcast", |reply| Request::Broadcast {
            data,
            dtype,
            root,
            reply,
        })?;
        buf.bytes_mut().copy_from_slice(&out);
        Ok(())
    }

    fn all_gather(&self, mut buf: HostBuf<'_>) -> Result<()> {
        if self.world_size == 1 {
            return Ok(());
        }
        let dtype = buf.dtype();
        let data = buf.bytes_mut().to_vec();
        let out = self.call("all_gather", |reply| Request::AllGather {
            data,
            dtype,
            reply,
        })?;
        buf.bytes_mut().copy_from_slice(&out);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_libraries_are_reported_not_panicked() {
        // Never panics, with or without a driver.
        let _ = cuda_device_count();
        if Nccl::is_available() {
            return;
        }
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|l| l.local_addr())
            .map(|a| a.port())
            .expect("port");
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
