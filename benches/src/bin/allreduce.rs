//! nccl-tests-style all-reduce sweep over `burn-dist` communicators.
//!
//! `cargo run --release -p benches --bin allreduce -- --nproc 2 --backend ring`
//!
//! Launches `--nproc` processes on this machine (through `burn_dist::launch_or_run`), sweeps
//! message sizes from `--min-bytes` to `--max-bytes` (×2), warms up, times in-place f32 sum
//! all-reduces, then checks one more all-reduce of a known pattern (`#wrong`). busbw follows
//! nccl-tests: `algbw · 2(n−1)/n`. The NCCL backend all-reduces device buffers (as nccl-tests),
//! one GPU per process, and runs even with `--nproc 1` (a one-rank NCCL communicator: busbw is
//! then 0 by the formula, time and algbw are NCCL's fixed cost and local copy).

use anyhow::{Context, Result, bail};
use burn_dist::{CommBackend, DistOptions, HostBuf, LaunchConfig, ReduceOp};
use clap::Parser;
use std::process::ExitCode;
use std::time::Instant;

#[derive(Parser, Debug)]
#[command(about = "All-reduce bandwidth sweep (nccl-tests conventions)")]
struct Args {
    /// Processes to launch on this machine.
    #[arg(long, default_value_t = 2)]
    nproc: usize,
    /// Communicator: ring (TCP ring with shared memory on one machine; `host` is its old name) or
    /// nccl (feature cuda).
    #[arg(long, default_value = "ring")]
    backend: String,
    /// Smallest message in bytes.
    #[arg(long, default_value_t = 8)]
    min_bytes: usize,
    /// Largest message in bytes.
    #[arg(long, default_value_t = 256 << 20)]
    max_bytes: usize,
    /// Warm-up iterations per size.
    #[arg(long, default_value_t = 3)]
    warmup: usize,
    /// Upper bound of timed iterations per size (fewer for big messages).
    #[arg(long, default_value_t = 200)]
    iters: usize,
    /// Rendezvous port (0: pick a free one).
    #[arg(long, default_value_t = 0)]
    master_port: u16,
    /// Print one JSON object per size instead of the table.
    #[arg(long)]
    json: bool,
}

fn main() -> ExitCode {
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::FAILURE
        }
    }
}

fn pattern(rank: usize, i: usize) -> f32 {
    ((i % 13) as f32 + 1.0) * (rank as f32 + 1.0)
}

fn run() -> Result<()> {
    let args = Args::parse();
    let backend = match args.backend.as_str() {
        // "host" is the ring's old name, kept so older scripts and binaries compare like for like.
        "ring" | "host" => CommBackend::Ring,
        "nccl" => CommBackend::Nccl,
        other => bail!("unknown --backend {other:?}: expected ring (or host) or nccl"),
    };
    let launch = LaunchConfig {
        nproc_per_node: Some(args.nproc),
        master_port: args.master_port,
        ..LaunchConfig::default()
    };
    let world = burn_dist::launch_or_run(&launch).context("launching the benchmark workers")?;
    let dist = burn_dist::init(
        &world,
        &DistOptions {
            backend,
            // `--backend nccl` means NCCL, also for one process.
            force_backend: backend == CommBackend::Nccl,
            ..DistOptions::default()
        },
    )
    .context("joining the job")?;
    let comm = dist.comm.as_ref();
    let n = comm.world_size();
    let rank = comm.rank();
    if rank == 0 && !args.json {
        println!(
            "# burn-dist all_reduce: backend {}, {n} processes, in-place f32 sum, {} buffers",
            comm.backend_name(),
            if comm.as_nccl().is_some() {
                "device"
            } else {
                "host"
            }
        );
        println!(
            "# {:>12} {:>12} {:>6} {:>12} {:>12} {:>12} {:>8}",
            "size(B)", "count", "type", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "#wrong"
        );
    }
    let mut payload = payload::for_backend(comm, world.local_rank)?;
    let mut bytes = args.min_bytes.max(4);
    while bytes <= args.max_bytes {
        let count = bytes / 4;
        payload.load(
            &(0..count)
                .map(|i| pattern(rank, i) * 1e-3)
                .collect::<Vec<_>>(),
        )?;
        let iters =
            (((2usize << 30) / bytes.max(1)).clamp(5, args.iters.max(5))).min(args.iters.max(1));
        for _ in 0..args.warmup {
            payload.all_reduce()?;
        }
        comm.barrier()?;
        let start = Instant::now();
        for _ in 0..iters {
            payload.all_reduce()?;
        }
        let mut secs = [start.elapsed().as_secs_f64() / iters as f64];
        comm.all_reduce(HostBuf::F64(&mut secs), ReduceOp::Max)?;
        // Correctness after timing: one all-reduce of a known pattern.
        payload.load(&(0..count).map(|i| pattern(rank, i)).collect::<Vec<_>>())?;
        payload.all_reduce()?;
        let check = payload.read()?;
        let ranks_sum = (n * (n + 1) / 2) as f32;
        let wrong = check
            .iter()
            .enumerate()
            .filter(|(i, v)| **v != ((i % 13) as f32 + 1.0) * ranks_sum)
            .count();
        let mut wrong_all = [wrong as i64];
        comm.all_reduce(HostBuf::I64(&mut wrong_all), ReduceOp::Sum)?;
        let t = secs[0];
        let algbw = bytes as f64 / t / 1e9;
        let busbw = algbw * 2.0 * (n as f64 - 1.0) / n as f64;
        if rank == 0 {
            if args.json {
                println!(
                    "{}",
                    serde_json::json!({"size": bytes, "count": count, "type": "float", "time_us": t * 1e6,
                        "algbw_gbs": algbw, "busbw_gbs": busbw, "wrong": wrong_all[0],
                        "nproc": n, "backend": comm.backend_name()})
                );
            } else {
                println!(
                    "  {:>12} {:>12} {:>6} {:>12.1} {:>12.3} {:>12.3} {:>8}",
                    bytes,
                    count,
                    "float",
                    t * 1e6,
                    algbw,
                    busbw,
                    wrong_all[0]
                );
            }
        }
        bytes *= 2;
    }
    Ok(())
}

/// The buffer under test: host memory for the host ring, device memory for NCCL.
mod payload {
    use anyhow::Result;
    use burn_dist::{Communicator, HostBuf, ReduceOp};

    pub trait Payload {
        /// Replaces the buffer's contents.
        fn load(&mut self, data: &[f32]) -> Result<()>;
        /// One in-place sum all-reduce, complete when it returns.
        fn all_reduce(&mut self) -> Result<()>;
        /// The buffer's contents.
        fn read(&mut self) -> Result<Vec<f32>>;
    }

    struct Host<'a> {
        comm: &'a dyn Communicator,
        buf: Vec<f32>,
    }

    impl Payload for Host<'_> {
        fn load(&mut self, data: &[f32]) -> Result<()> {
            self.buf = data.to_vec();
            Ok(())
        }
        fn all_reduce(&mut self) -> Result<()> {
            Ok(self
                .comm
                .all_reduce(HostBuf::F32(&mut self.buf), ReduceOp::Sum)?)
        }
        fn read(&mut self) -> Result<Vec<f32>> {
            Ok(self.buf.clone())
        }
    }

    pub fn for_backend<'a>(
        comm: &'a dyn Communicator,
        local_rank: usize,
    ) -> Result<Box<dyn Payload + 'a>> {
        #[cfg(feature = "cuda")]
        if let Some(nccl) = comm.as_nccl() {
            return Ok(Box::new(device::Device::new(nccl, local_rank)?));
        }
        let _ = local_rank;
        Ok(Box::new(Host {
            comm,
            buf: Vec::new(),
        }))
    }

    #[cfg(feature = "cuda")]
    mod device {
        use super::Payload;
        use anyhow::{Result, anyhow};
        use burn_dist::{Collective, DType, DeviceCall, Nccl, ReduceOp};
        use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
        use std::sync::Arc;

        pub struct Device<'a> {
            nccl: &'a Nccl,
            stream: Arc<CudaStream>,
            buf: Option<Arc<CudaSlice<f32>>>,
        }

        impl<'a> Device<'a> {
            pub fn new(nccl: &'a Nccl, local_rank: usize) -> Result<Self> {
                let ctx = cudarc::driver::CudaContext::new(local_rank)?;
                Ok(Self {
                    nccl,
                    stream: ctx.default_stream(),
                    buf: None,
                })
            }
        }

        impl Payload for Device<'_> {
            fn load(&mut self, data: &[f32]) -> Result<()> {
                self.buf = Some(Arc::new(self.stream.clone_htod(data)?));
                self.stream.synchronize()?;
                Ok(())
            }
            fn all_reduce(&mut self) -> Result<()> {
                let buf = self
                    .buf
                    .as_ref()
                    .ok_or_else(|| anyhow!("no buffer loaded"))?;
                let (ptr, _record) = buf.device_ptr(&self.stream);
                let call = DeviceCall {
                    collective: Collective::AllReduce(ReduceOp::Sum),
                    send: ptr,
                    recv: ptr,
                    count: buf.len(),
                    dtype: DType::F32,
                };
                // SAFETY: `buf` is a live f32 allocation of `count` elements on this rank's
                // device, filled by a synchronised copy; the keep-alive holds a reference.
                unsafe {
                    self.nccl.run_device(
                        "allreduce bench",
                        vec![call],
                        Box::new(Arc::clone(buf)),
                    )?
                };
                Ok(())
            }
            fn read(&mut self) -> Result<Vec<f32>> {
                let buf = self
                    .buf
                    .as_ref()
                    .ok_or_else(|| anyhow!("no buffer loaded"))?;
                Ok(self.stream.clone_dtoh(buf.as_ref())?)
            }
        }
    }
}
