//! The NCCL path on one GPU: a real one-rank NCCL communicator (`BURN_DIST_BACKEND=nccl`
//! semantics), built through the rendezvous store, and every way burn-dist hands it device memory.
//! Contents are checked, not just return codes. Run by `scripts/gpu-check.sh` on a GPU machine;
//! exit code 0 only if every check passes.
//!
//! 1. Raw device buffers (cudarc): all-reduce, broadcast and all-gather, out of place into a
//!    poisoned buffer, f32 / f16 / bf16, odd lengths, at offsets inside a larger allocation; every
//!    element inside the window must be the input and every one outside must still be poison.
//! 2. Burn tensors, with and without fusion: `all_reduce_float` (fp32, fp16 and bf16 on the wire,
//!    cast on the device), on a view that starts inside a larger tensor, `all_reduce_floats`
//!    (several buckets, one NCCL group) and `broadcast_float`.
//! 3. Failure handling: a two-rank communicator whose second rank never comes fails at its
//!    deadline (non-blocking init, abort), and a communicator that failed once answers the next
//!    call with the recorded cause.
//! 4. Costs (for `benches/RESULTS.md`): a device synchronisation, a 4-byte NCCL round trip, and
//!    one step's worth of ResNet-50 gradient buckets through the device path and through the host.

use std::process::ExitCode;

#[cfg(feature = "cuda")]
fn main() -> ExitCode {
    let libs = burn_dist::cuda_libs::prepare();
    // SAFETY: only probes whether libcuda can be loaded; calls no CUDA function.
    if !unsafe { cudarc::driver::sys::is_culib_present() } {
        eprintln!(
            "nccl_check: no CUDA driver (libcuda.so.1) on this machine; {}",
            libs.summary()
        );
        return ExitCode::FAILURE;
    }
    println!("{}", libs.summary());
    train::cuda_setup::keep_autotune_results();
    // `--quick`: skip the timings (for runs under compute-sanitizer, which slows every call).
    let quick = std::env::args().any(|a| a == "--quick");
    match check::run(quick) {
        Ok(0) => {
            println!("nccl_check: all checks passed");
            ExitCode::SUCCESS
        }
        Ok(failures) => {
            eprintln!("nccl_check: {failures} check(s) failed");
            ExitCode::FAILURE
        }
        Err(e) => {
            eprintln!("nccl_check: {e:#}");
            ExitCode::FAILURE
        }
    }
}

#[cfg(not(feature = "cuda"))]
fn main() -> ExitCode {
    eprintln!("nccl_check: built without the `cuda` feature");
    ExitCode::FAILURE
}

#[cfg(feature = "cuda")]
mod check {
    use anyhow::{Context, Result, anyhow};
    use burn::backend::cuda::CudaDevice;
    use burn::tensor::backend::Backend;
    use burn::tensor::{FloatDType, Tensor, TensorData};
    use burn_dist::{
        Collective, CollectiveBackend, CommBackend, Communicator, Compression, CudaFused, CudaRaw,
        DType, DeviceCall, DistError, DistOptions, Nccl, ReduceOp, Store, World,
    };
    use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr};
    use std::sync::Arc;
    use std::time::{Duration, Instant};

    const POISON: u8 = 0xAB;

    struct Tally {
        failures: usize,
    }

    impl Tally {
        fn check(&mut self, name: &str, result: Result<String>) {
            match result {
                Ok(detail) => println!("  pass  {name}: {detail}"),
                Err(e) => {
                    self.failures += 1;
                    println!("  FAIL  {name}: {e:#}");
                }
            }
        }
    }

    pub fn run(quick: bool) -> Result<usize> {
        let mut tally = Tally { failures: 0 };
        println!("# NCCL at world size 1 (forced), device 0");
        let start = Instant::now();
        let options = DistOptions {
            backend: CommBackend::Nccl,
            force_backend: true,
            timeout: Duration::from_secs(60),
        };
        let dist = burn_dist::init(&World::single(), &options).context("init with NCCL forced")?;
        let comm = dist.comm.clone();
        let nccl = comm
            .as_nccl()
            .ok_or_else(|| anyhow!("BURN_DIST_BACKEND=nccl did not build an NCCL communicator"))?;
        println!(
            "  pass  store + unique id + non-blocking init: {:.2} s",
            start.elapsed().as_secs_f64()
        );

        let ctx = CudaContext::new(0).context("CUDA context")?;
        let stream = ctx.default_stream();
        for dtype in [DType::F32, DType::F16, DType::BF16] {
            for (count, offset) in [(1usize, 0usize), (7, 3), (1001, 5), (65_537, 1)] {
                for collective in [
                    Collective::AllReduce(ReduceOp::Sum),
                    Collective::Broadcast { root: 0 },
                    Collective::AllGather,
                ] {
                    let name =
                        format!("raw {collective:?} {dtype:?} count {count} offset {offset}");
                    tally.check(
                        &name,
                        raw_buffers(nccl, &stream, collective, dtype, count, offset),
                    );
                }
            }
        }

        tally.check("burn fused tensors", burn_tensors::<CudaFused>(&*comm));
        tally.check("burn raw tensors", burn_tensors::<CudaRaw>(&*comm));
        tally.check("deadline: a rank that never joins", missing_rank());
        tally.check("broken communicator keeps its cause", broken_after_error());
        if !quick {
            tally.check("costs", costs::<CudaFused>(&*comm, nccl, &stream));
        }
        Ok(tally.failures)
    }

    /// A window of `count` elements at `offset` inside a larger allocation: the input is a
    /// pattern, the output is poisoned; after the call the output window must equal the input
    /// and everything around it must still be poison.
    fn raw_buffers(
        nccl: &Nccl,
        stream: &Arc<CudaStream>,
        collective: Collective,
        dtype: DType,
        count: usize,
        offset: usize,
    ) -> Result<String> {
        let size = dtype.size();
        let total = (offset + count + 9) * size;
        let input: Vec<u8> = (0..total)
            .map(|i| ((i * 31 + 7) % 251) as u8 ^ 0x40)
            .collect();
        let send: Arc<CudaSlice<u8>> = Arc::new(stream.clone_htod(&input)?);
        let recv: Arc<CudaSlice<u8>> = Arc::new(stream.clone_htod(&vec![POISON; total])?);
        stream.synchronize()?;
        let (send_ptr, recv_ptr) = {
            let (s, _a) = send.device_ptr(stream);
            let (r, _b) = recv.device_ptr(stream);
            (s, r)
        };
        let at = (offset * size) as u64;
        let call = DeviceCall {
            collective,
            send: send_ptr + at,
            recv: recv_ptr + at,
            count,
            dtype,
        };
        // SAFETY: both windows lie inside live allocations of `total` bytes on device 0 that the
        // keep-alive owns; the copies that filled them were synchronised above.
        unsafe { nccl.run_device("raw check", vec![call], Box::new((send, Arc::clone(&recv))))? };
        let out = stream.clone_dtoh(recv.as_ref())?;
        let window = offset * size..(offset + count) * size;
        // A one-rank sum of a finite value is the value itself (the pattern holds no NaN bits
        // for these dtypes' purposes: compare bytes, which NCCL must copy exactly).
        if out[window.clone()] != input[window.clone()] {
            let first = window
                .clone()
                .find(|i| out[*i] != input[*i])
                .unwrap_or(window.start);
            return Err(anyhow!(
                "byte {first}: got {:#04x}, expected {:#04x}",
                out[first],
                input[first]
            ));
        }
        if let Some(i) = (0..total).find(|i| !window.contains(i) && out[*i] != POISON) {
            return Err(anyhow!("wrote outside the window at byte {i}"));
        }
        Ok(format!(
            "{} bytes exact, surroundings untouched",
            window.len()
        ))
    }

    fn values(n: usize, seed: usize) -> Vec<f32> {
        (0..n)
            .map(|i| (((i * 7919 + seed * 104_729) % 2000) as f32 - 1000.0) / 250.0)
            .collect()
    }

    fn max_rel(a: &[f32], b: &[f32]) -> f32 {
        a.iter()
            .zip(b)
            .map(|(x, y)| (x - y).abs() / y.abs().max(1e-3))
            .fold(0.0, f32::max)
    }

    fn read(t: Tensor<impl Backend, 1>) -> Result<Vec<f32>> {
        t.into_data()
            .convert::<f32>()
            .into_vec::<f32>()
            .map_err(|e| anyhow!("{e:?}"))
    }

    fn burn_tensors<B: CollectiveBackend<Device = CudaDevice>>(
        comm: &dyn Communicator,
    ) -> Result<String> {
        let device = CudaDevice::new(0);
        let n = 100_003;
        let big = values(n + 11, 1);
        let expected = big[5..5 + n].to_vec();
        let whole = Tensor::<B, 1>::from_data(TensorData::new(big, [n + 11]), &device);
        let mut report = Vec::new();
        for (compression, tol) in [
            (Compression::None, 0.0),
            (Compression::Fp16, 1e-3),
            (Compression::Bf16, 8e-3),
        ] {
            let view = whole.clone().narrow(0, 5, n);
            let out = B::all_reduce_float(comm, view, ReduceOp::Sum, compression)?;
            if out.dtype() != burn::tensor::DType::F32 {
                return Err(anyhow!("{compression:?}: came back as {:?}", out.dtype()));
            }
            let err = max_rel(&read(out)?, &expected);
            if err > tol {
                return Err(anyhow!(
                    "{compression:?}: max relative error {err:.2e} > {tol:.0e}"
                ));
            }
            report.push(format!("{compression:?} {err:.1e}"));
        }
        let parts: Vec<Vec<f32>> = [3usize, 1, 250_001]
            .iter()
            .map(|n| values(*n, *n))
            .collect();
        let tensors = parts
            .iter()
            .map(|p| Tensor::<B, 1>::from_data(TensorData::new(p.clone(), [p.len()]), &device))
            .collect();
        let outs = B::all_reduce_floats(comm, tensors, ReduceOp::Sum, Compression::None)?;
        for (out, part) in outs.into_iter().zip(&parts) {
            if read(out)? != *part {
                return Err(anyhow!(
                    "all_reduce_floats: a bucket of {} changed",
                    part.len()
                ));
            }
        }
        let half = Tensor::<B, 1>::from_data(TensorData::new(values(777, 3), [777]), &device)
            .cast(FloatDType::F16);
        let back = B::broadcast_float(comm, half.clone(), 0)?;
        if read(back)? != read(half)? {
            return Err(anyhow!("broadcast_float (f16) changed the tensor"));
        }
        report.push("3 buckets in one group exact, f16 broadcast exact".into());
        Ok(report.join(", "))
    }

    /// Rank 0 of a two-rank job whose rank 1 never starts: the non-blocking init must give up at
    /// the deadline with an error, not hang.
    fn missing_rank() -> Result<String> {
        let port = std::net::TcpListener::bind("127.0.0.1:0")?
            .local_addr()?
            .port();
        let world = World {
            world_size: 2,
            local_world_size: 2,
            master_port: port,
            ..World::single()
        };
        let store = Store::connect(&world, Duration::from_secs(5))?;
        let deadline = Duration::from_secs(5);
        let start = Instant::now();
        let result = Nccl::new(&world, &store, 0, deadline);
        let waited = start.elapsed();
        match result {
            Err(DistError::NcclTimeout { .. }) if waited < deadline + Duration::from_secs(10) => {
                Ok(format!(
                    "NcclTimeout after {:.1} s (deadline 5 s)",
                    waited.as_secs_f64()
                ))
            }
            Err(e) => Err(anyhow!(
                "after {:.1} s: unexpected error {e}",
                waited.as_secs_f64()
            )),
            Ok(_) => Err(anyhow!("a two-rank communicator initialised with one rank")),
        }
    }

    /// A call NCCL rejects (root 5 of a one-rank communicator, passed straight to NCCL by device
    /// pointer) breaks the communicator; the next, valid, call must answer `Broken` naming that
    /// first cause.
    fn broken_after_error() -> Result<String> {
        let options = DistOptions {
            backend: CommBackend::Nccl,
            force_backend: true,
            timeout: Duration::from_secs(30),
        };
        let dist = burn_dist::init(&World::single(), &options)?;
        let nccl = dist
            .comm
            .as_nccl()
            .ok_or_else(|| anyhow!("no NCCL communicator"))?;
        let stream = CudaContext::new(0)?.default_stream();
        let buffer: Arc<CudaSlice<f32>> = Arc::new(stream.alloc_zeros(16)?);
        let (ptr, _record) = buffer.device_ptr(&stream);
        let call = DeviceCall {
            collective: Collective::Broadcast { root: 5 },
            send: ptr,
            recv: ptr,
            count: 16,
            dtype: DType::F32,
        };
        // SAFETY: 16 live f32 on device 0, kept alive by the keep-alive's reference.
        let first =
            unsafe { nccl.run_device("bad root", vec![call], Box::new(Arc::clone(&buffer))) }
                .err()
                .ok_or_else(|| anyhow!("broadcast from root 5 of 1 succeeded"))?;
        let mut data = vec![1.0f32; 16];
        match dist
            .comm
            .all_reduce(burn_dist::HostBuf::F32(&mut data), ReduceOp::Sum)
        {
            Err(DistError::Broken { first: cause, .. }) if cause.contains("bad root") => Ok(
                format!("first error: {first}; later call: Broken ({cause})"),
            ),
            other => Err(anyhow!("after {first}: expected Broken, got {other:?}")),
        }
    }

    fn median(mut xs: Vec<f64>) -> f64 {
        xs.sort_by(f64::total_cmp);
        xs[xs.len() / 2]
    }

    /// Microseconds of a device sync, an NCCL round trip, and one ResNet-50 step's buckets
    /// (25.6 M floats in 25 MiB buckets) through the device path and the host path.
    fn costs<B: CollectiveBackend<Device = CudaDevice>>(
        comm: &dyn Communicator,
        nccl: &Nccl,
        stream: &Arc<CudaStream>,
    ) -> Result<String> {
        let device = CudaDevice::new(0);
        let time = |f: &mut dyn FnMut() -> Result<()>| -> Result<f64> {
            for _ in 0..3 {
                f()?;
            }
            let mut t = Vec::new();
            for _ in 0..20 {
                let s = Instant::now();
                f()?;
                t.push(s.elapsed().as_secs_f64() * 1e6);
            }
            Ok(median(t))
        };
        let sync_us = time(&mut || {
            B::sync(&device).map_err(|e| anyhow!("{e:?}"))?;
            Ok(())
        })?;
        let tiny: Arc<CudaSlice<u8>> = Arc::new(stream.alloc_zeros(4)?);
        let tiny_us = time(&mut || {
            let (p, _r) = tiny.device_ptr(stream);
            let call = DeviceCall {
                collective: Collective::AllReduce(ReduceOp::Sum),
                send: p,
                recv: p,
                count: 1,
                dtype: DType::F32,
            };
            // SAFETY: 4 live bytes on device 0, kept alive by the keep-alive's reference.
            unsafe { nccl.run_device("tiny", vec![call], Box::new(Arc::clone(&tiny)))? };
            Ok(())
        })?;
        let sizes = [6_553_600usize, 6_553_600, 6_553_600, 5_896_232];
        let buckets = |_: ()| -> Vec<Tensor<B, 1>> {
            sizes
                .iter()
                .map(|n| Tensor::<B, 1>::ones([*n], &device))
                .collect()
        };
        let device_us = time(&mut || {
            let out = B::all_reduce_floats(comm, buckets(()), ReduceOp::Sum, Compression::None)?;
            B::sync(&device).map_err(|e| anyhow!("{e:?}"))?;
            drop(out);
            Ok(())
        })?;
        let host_us = time(&mut || {
            for t in buckets(()) {
                drop(burn_dist::host_all_reduce(
                    comm,
                    t,
                    ReduceOp::Sum,
                    Compression::None,
                )?);
            }
            Ok(())
        })?;
        Ok(format!(
            "device sync {sync_us:.0} us; 4-byte NCCL round trip {tiny_us:.0} us; ResNet-50 step buckets (102 MB): device path {device_us:.0} us, host-staged {host_us:.0} us"
        ))
    }
}
