//! The thread that owns one NCCL communicator from creation to destruction.
//!
//! The communicator is non-blocking (`blocking = 0`): `ncclCommInitRankConfig`, collectives and
//! `ncclGroupEnd` return at once, possibly with `ncclInProgress`, and this thread polls
//! `ncclCommGetAsyncError` and the stream against one deadline per request. At the deadline, or on
//! an asynchronous error, it calls `ncclCommAbort`, waits until the stream is idle, and only then
//! drops the request's buffers, so NCCL never writes memory that was handed back to the caller.
//! From then on every request is answered with the recorded cause.

use super::ffi;
use super::{Collective, DeviceCall, nccl_op, nccl_type};
use crate::comm::DType;
use crate::error::{DistError, Result};
use cudarc::driver::sys as dsys;
use cudarc::driver::{CudaContext, CudaStream, DevicePtr};
use cudarc::nccl::sys as nsys;
use nsys::ncclResult_t::{ncclInProgress, ncclSuccess};
use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

/// How long an aborted communicator's stream may take to drain before its buffers are leaked on
/// purpose (a leak is safe; freeing memory a kernel may still write is not).
const QUIESCE: Duration = Duration::from_secs(30);

/// Work for the NCCL thread.
pub(super) enum Request {
    /// A collective on host bytes, staged through device memory.
    Host {
        collective: Collective,
        data: Vec<u8>,
        dtype: DType,
        reply: mpsc::Sender<Result<Vec<u8>>>,
    },
    /// Collectives on the caller's device buffers, in one NCCL group. `keep_alive` owns those
    /// buffers (e.g. Burn tensors) and is dropped only once NCCL cannot touch them any more.
    Device {
        name: &'static str,
        calls: Vec<DeviceCall>,
        keep_alive: Box<dyn Send>,
        reply: mpsc::Sender<Result<()>>,
    },
}

/// The first failure of a communicator, shared with its [`super::Nccl`] handle.
pub(super) type Broken = Arc<Mutex<Option<String>>>;

pub(super) fn record(broken: &Broken, cause: String) {
    let mut b = broken.lock().unwrap_or_else(|e| e.into_inner());
    if b.is_none() {
        *b = Some(cause);
    }
}

pub(super) struct Setup {
    pub rank: usize,
    pub world_size: usize,
    pub device: usize,
    pub id: nsys::ncclUniqueId,
    pub timeout: Duration,
    pub broken: Broken,
}

struct Worker {
    rank: usize,
    world_size: usize,
    timeout: Duration,
    stream: Arc<CudaStream>,
    comm: nsys::ncclComm_t,
    aborted: bool,
    gate: AbortGate,
    broken: Broken,
    /// Buffers of requests whose stream never went idle after an abort: never freed.
    quarantine: Vec<Box<dyn Send>>,
}

/// Holds an abort back while an NCCL group is open. `ncclCommAbort` called between
/// `ncclGroupStart` and `ncclGroupEnd` defers its reclaim into the caller's open group (NCCL
/// 2.27+), so the communicator would be torn down inside a group that then launches on it. An
/// abort wanted inside a group runs right after the group is ended.
#[derive(Debug, Default)]
pub(super) struct AbortGate {
    group_open: bool,
    pending: bool,
}

impl AbortGate {
    pub(super) fn open_group(&mut self) {
        self.group_open = true;
    }

    /// An abort is wanted: `true` when it may run now, `false` when it waits for the group's end.
    pub(super) fn request(&mut self) -> bool {
        if self.group_open {
            self.pending = true;
            false
        } else {
            true
        }
    }

    /// `ncclGroupEnd` returned: `true` when a deferred abort must run now.
    pub(super) fn close_group(&mut self) -> bool {
        self.group_open = false;
        std::mem::take(&mut self.pending)
    }
}

/// Runs the communicator until the request channel closes. `ready` gets the result of the
/// communicator's initialisation.
pub(super) fn run(
    setup: Setup,
    requests: mpsc::Receiver<Request>,
    ready: mpsc::Sender<Result<()>>,
) {
    let mut worker = match Worker::start(&setup) {
        Ok(w) => {
            let _ = ready.send(Ok(()));
            w
        }
        Err(e) => {
            record(&setup.broken, e.to_string());
            let _ = ready.send(Err(e));
            return;
        }
    };
    for request in requests {
        worker.serve(request);
    }
    worker.shut_down();
}

impl Worker {
    fn start(s: &Setup) -> Result<Self> {
        let err = |op: &'static str, detail: String| DistError::Nccl {
            op,
            rank: s.rank,
            detail,
        };
        let ctx = CudaContext::new(s.device).map_err(|e| {
            err(
                "creating the CUDA context",
                format!("device {}: {e:?}", s.device),
            )
        })?;
        ctx.bind_to_thread()
            .map_err(|e| err("binding the CUDA context", format!("{e:?}")))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| err("creating a CUDA stream", format!("{e:?}")))?;
        let mut config = ffi::nonblocking_config();
        let mut comm: nsys::ncclComm_t = std::ptr::null_mut();
        // SAFETY: `comm` and `config` are valid for the call; `id` is the unique id every rank
        // got through the store. In non-blocking mode NCCL writes the handle before returning
        // (also with ncclInProgress) and finishes the initialisation in the background.
        let started = unsafe {
            nsys::ncclCommInitRankConfig(
                &mut comm,
                s.world_size as i32,
                s.id,
                s.rank as i32,
                &mut config,
            )
        };
        if started != ncclSuccess && started != ncclInProgress {
            return Err(err(
                "ncclCommInitRankConfig",
                format!(
                    "{} (NCCL {}, device {})",
                    ffi::describe(started, comm),
                    ffi::version(),
                    s.device
                ),
            ));
        }
        let mut worker = Self {
            rank: s.rank,
            world_size: s.world_size,
            timeout: s.timeout,
            stream,
            comm,
            aborted: false,
            gate: AbortGate::default(),
            broken: Arc::clone(&s.broken),
            quarantine: Vec::new(),
        };
        worker.settle("ncclCommInitRankConfig", Instant::now())?;
        Ok(worker)
    }

    fn err(&self, op: &'static str, detail: String) -> DistError {
        DistError::Nccl {
            op,
            rank: self.rank,
            detail,
        }
    }

    fn usable(&self) -> Result<()> {
        let b = self.broken.lock().unwrap_or_else(|e| e.into_inner());
        match b.as_ref() {
            Some(cause) => Err(DistError::Broken {
                rank: self.rank,
                first: cause.clone(),
            }),
            None => Ok(()),
        }
    }

    fn serve(&mut self, request: Request) {
        match request {
            Request::Host {
                collective,
                data,
                dtype,
                reply,
            } => {
                let _ = reply.send(self.host(collective, data, dtype));
            }
            Request::Device {
                name,
                calls,
                keep_alive,
                reply,
            } => {
                let result = self.usable().and_then(|()| self.device(name, &calls));
                self.release(keep_alive, result.is_ok());
                let _ = reply.send(result);
            }
        }
    }

    /// Enqueues `calls` (one NCCL group when there are several) and waits for them.
    fn device(&mut self, name: &'static str, calls: &[DeviceCall]) -> Result<()> {
        let start = Instant::now();
        let calls: Vec<&DeviceCall> = calls.iter().filter(|c| c.count > 0).collect();
        if calls.is_empty() {
            return Ok(());
        }
        let grouped = calls.len() > 1;
        if grouped {
            // SAFETY: plain NCCL call; groups only batch the calls below.
            self.check(name, unsafe { nsys::ncclGroupStart() }, start)?;
            self.gate.open_group();
        }
        for call in &calls {
            // SAFETY: the pointers and counts come from `Nccl::run_device`'s caller, who
            // guarantees they address live device memory of this device that `keep_alive` keeps
            // allocated; the request is answered only after the stream is idle.
            let result = unsafe { self.enqueue(call) };
            // An abort wanted here is held back by the gate until the group is ended below.
            if let Err(e) = self.check(name, result, start) {
                if grouped {
                    // SAFETY: closes the group opened above; nothing is launched on error.
                    let _ = unsafe { nsys::ncclGroupEnd() };
                    self.end_group();
                }
                return Err(e);
            }
        }
        if grouped {
            // SAFETY: closes the group opened above, which launches its calls.
            let ended = unsafe { nsys::ncclGroupEnd() };
            self.end_group();
            self.check(name, ended, start)?;
        }
        self.wait_stream(name, start)
    }

    /// After `ncclGroupEnd`: runs the abort the gate held back, if any.
    fn end_group(&mut self) {
        if self.gate.close_group() {
            self.abort_now();
        }
    }

    /// # Safety
    /// `call`'s pointers address device memory as [`super::Nccl::run_device`] requires.
    unsafe fn enqueue(&self, call: &DeviceCall) -> nsys::ncclResult_t {
        let stream = self.stream.cu_stream() as nsys::cudaStream_t;
        let (send, recv) = (call.send as *const _, call.recv as *mut _);
        // SAFETY: forwarded from the caller.
        unsafe {
            match call.collective {
                Collective::AllReduce(op) => nsys::ncclAllReduce(
                    send,
                    recv,
                    call.count,
                    nccl_type(call.dtype),
                    nccl_op(op),
                    self.comm,
                    stream,
                ),
                Collective::Broadcast { root } => nsys::ncclBroadcast(
                    send,
                    recv,
                    call.count,
                    nccl_type(call.dtype),
                    root as i32,
                    self.comm,
                    stream,
                ),
                Collective::AllGather => nsys::ncclAllGather(
                    send,
                    recv,
                    call.count,
                    nccl_type(call.dtype),
                    self.comm,
                    stream,
                ),
            }
        }
    }

    /// A call's immediate result: success, in progress (then settle), or an error.
    fn check(
        &mut self,
        op: &'static str,
        result: nsys::ncclResult_t,
        start: Instant,
    ) -> Result<()> {
        match result {
            ncclSuccess => Ok(()),
            ncclInProgress => self.settle(op, start),
            other => {
                let e = self.err(op, ffi::describe(other, self.comm));
                self.abort(&e);
                Err(e)
            }
        }
    }

    /// Polls the communicator's state until it leaves `ncclInProgress`, within the deadline.
    fn settle(&mut self, op: &'static str, start: Instant) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            let state = self.async_state();
            if state == ncclSuccess {
                return Ok(());
            }
            if state != ncclInProgress {
                let e = self.err(
                    op,
                    format!(
                        "{} (NCCL {}; a peer may have died)",
                        ffi::describe(state, self.comm),
                        ffi::version()
                    ),
                );
                self.abort(&e);
                return Err(e);
            }
            self.deadline(op, start)?;
            backoff.pause();
        }
    }

    /// Waits until the stream has run everything enqueued, watching NCCL's asynchronous errors
    /// and the deadline.
    fn wait_stream(&mut self, op: &'static str, start: Instant) -> Result<()> {
        let mut backoff = Backoff::default();
        loop {
            match self.stream_state() {
                dsys::CUresult::CUDA_SUCCESS => return Ok(()),
                dsys::CUresult::CUDA_ERROR_NOT_READY => {}
                other => {
                    let e = self.err(op, format!("CUDA error {other:?} on the NCCL stream"));
                    self.abort(&e);
                    return Err(e);
                }
            }
            let state = self.async_state();
            if state != ncclSuccess && state != ncclInProgress {
                let e = self.err(
                    op,
                    format!(
                        "asynchronous {} (a peer may have died)",
                        ffi::describe(state, self.comm)
                    ),
                );
                self.abort(&e);
                return Err(e);
            }
            self.deadline(op, start)?;
            backoff.pause();
        }
    }

    fn deadline(&mut self, op: &'static str, start: Instant) -> Result<()> {
        if start.elapsed() <= self.timeout {
            return Ok(());
        }
        let e = DistError::NcclTimeout {
            op,
            rank: self.rank,
            deadline: self.timeout,
        };
        self.abort(&e);
        Err(e)
    }

    fn async_state(&self) -> nsys::ncclResult_t {
        let mut state = ncclSuccess;
        // SAFETY: `self.comm` is live (never polled after abort) and `state` a valid out-pointer.
        let r = unsafe { nsys::ncclCommGetAsyncError(self.comm, &mut state) };
        if r != ncclSuccess { r } else { state }
    }

    fn stream_state(&self) -> dsys::CUresult {
        // SAFETY: the stream handle is valid while `self.stream` lives.
        unsafe { dsys::cuStreamQuery(self.stream.cu_stream()) }
    }

    /// Records `cause` as the communicator's first failure and aborts the communicator (once),
    /// after the open group's end if a group is open (see [`AbortGate`]).
    fn abort(&mut self, cause: &DistError) {
        record(&self.broken, cause.to_string());
        if self.gate.request() {
            self.abort_now();
        }
    }

    fn abort_now(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: `self.comm` is live and owned by this thread, no group is open (the gate),
            // and after abort it is never used.
            let _ = unsafe { nsys::ncclCommAbort(self.comm) };
        }
    }

    /// Drops a request's buffers, after making sure no NCCL kernel can still touch them.
    fn release(&mut self, keep_alive: Box<dyn Send>, completed: bool) {
        if completed || self.quiesce() {
            drop(keep_alive);
        } else {
            self.quarantine.push(keep_alive);
        }
    }

    /// Waits (bounded) until the stream is idle; false if it never got there.
    fn quiesce(&self) -> bool {
        let start = Instant::now();
        let mut backoff = Backoff::default();
        while start.elapsed() < QUIESCE {
            if self.stream_state() != dsys::CUresult::CUDA_ERROR_NOT_READY {
                return true;
            }
            backoff.pause();
        }
        false
    }

    fn host(&mut self, collective: Collective, data: Vec<u8>, dtype: DType) -> Result<Vec<u8>> {
        self.usable()?;
        let op = collective.nccl_name();
        if data.is_empty() {
            return Ok(data);
        }
        let stream = Arc::clone(&self.stream);
        let buffer = stream
            .clone_htod(&data)
            .map_err(|e| self.err(op, format!("copy to device: {e:?}")))?;
        let count = data.len() / dtype.size();
        let call = {
            let (ptr, _record) = buffer.device_ptr(&stream);
            match collective {
                // In-place, which NCCL allows for all three.
                Collective::AllGather => {
                    let chunk = count / self.world_size.max(1);
                    DeviceCall {
                        collective,
                        send: ptr + (self.rank * chunk * dtype.size()) as u64,
                        recv: ptr,
                        count: chunk,
                        dtype,
                    }
                }
                _ => DeviceCall {
                    collective,
                    send: ptr,
                    recv: ptr,
                    count,
                    dtype,
                },
            }
        };
        let result = self.device(op, &[call]);
        if let Err(e) = result {
            self.release(Box::new(buffer), false);
            return Err(e);
        }
        stream
            .clone_dtoh(&buffer)
            .map_err(|e| self.err(op, format!("copy to host: {e:?}")))
    }

    fn shut_down(mut self) {
        if self.aborted {
            return;
        }
        // Non-blocking communicators are finalised (which may complete in the background), then
        // destroyed; a finalisation that fails or outlives the deadline becomes an abort.
        // SAFETY: the communicator is live and owned by this thread.
        let finalised = unsafe { nsys::ncclCommFinalize(self.comm) };
        let settled = match finalised {
            ncclSuccess => Ok(()),
            ncclInProgress => self.settle("ncclCommFinalize", Instant::now()),
            other => Err(self.err("ncclCommFinalize", ffi::describe(other, self.comm))),
        };
        match settled {
            // SAFETY: finalised, owned by this thread, not used afterwards.
            Ok(()) => drop(unsafe { nsys::ncclCommDestroy(self.comm) }),
            Err(e) => self.abort(&e),
        }
    }
}

/// Polling pace: spin (yielding) for the first 50 µs, where small collectives finish, then sleep
/// in steps growing to 100 µs, so a long wait costs little CPU and a short one little latency.
#[derive(Default)]
struct Backoff {
    polls: u32,
}

impl Backoff {
    fn pause(&mut self) {
        self.polls += 1;
        if self.polls <= 50 {
            std::thread::yield_now();
        } else {
            let micros = u64::from((self.polls - 50).min(100));
            std::thread::sleep(Duration::from_micros(micros));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::AbortGate;

    #[test]
    fn an_abort_inside_a_group_waits_for_the_groups_end() {
        let mut gate = AbortGate::default();
        assert!(gate.request(), "outside a group an abort runs at once");
        assert!(!gate.close_group(), "nothing was held back");

        gate.open_group();
        assert!(!gate.request(), "inside a group the abort is held back");
        assert!(!gate.request(), "asked twice, still held");
        assert!(
            gate.close_group(),
            "the held abort runs once the group is ended"
        );
        assert!(!gate.close_group(), "and only once");
        assert!(gate.request(), "after the group, at once again");

        gate.open_group();
        assert!(!gate.close_group(), "a clean group runs no abort");
    }
}
