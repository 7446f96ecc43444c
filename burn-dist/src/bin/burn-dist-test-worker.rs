//! Worker process for `burn-dist`'s multi-process integration tests (tests/multiprocess.rs).
//! Not a user tool: it reads its role from the first argument and its world from the env.
#![allow(clippy::unwrap_used)]

use burn::module::{Module, ModuleVisitor, Param};
use burn::nn::{Linear, LinearConfig};
use burn::optim::{GradientsParams, SgdConfig};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};
use burn_dist::{
    CommBackend, Communicator, CommunicatorExt, Compression, DistOptions, DistributedConfig,
    DistributedOptimizer, Element, HostBuf, LaunchConfig, ReduceOp, Rendezvous, SyncConfig, World,
};
use half::{bf16, f16};
use std::process::ExitCode;
use std::time::Duration;

type TB = burn::backend::Autodiff<burn::backend::Flex>;

fn options() -> DistOptions {
    DistOptions {
        backend: CommBackend::Ring,
        ..DistOptions::default()
    }
}

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().collect();
    let mode = args.get(1).cloned().unwrap_or_default();
    let result = match mode.as_str() {
        "collectives" => collectives(),
        "train" => train(&args[2..]),
        "loop" => all_reduce_loop(&args[2..]),
        "init" => {
            burn_dist::init(&World::from_env().unwrap(), &options()).map(|_| println!("INIT OK"))
        }
        "launch" => launch(&args[2..]),
        "job" => World::from_env().and_then(|w| job(&w)),
        "launch-job" => launch_job(&args[2..]),
        "state" => state(),
        "unused" => unused(),
        "launch-loop" => launch_loop(&args[2..]),
        "bad-state" => bad_state(),
        "order" => out_of_order(),
        _ => {
            eprintln!("unknown mode {mode:?}");
            return ExitCode::from(2);
        }
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("DIST ERROR: {e}");
            let rank = World::from_env().map(|w| w.rank).unwrap_or(0);
            let _ = burn_dist::write_error_file(&e.to_string(), rank, e.root_cause_rank(rank));
            ExitCode::from(3)
        }
    }
}

fn value(rank: usize, i: usize) -> i64 {
    ((i * 7 + rank * 3) % 11) as i64 - 5
}

trait FromI64: Element + Copy {
    fn from_i64(v: i64) -> Self;
}
impl FromI64 for f32 {
    fn from_i64(v: i64) -> Self {
        v as f32
    }
}
impl FromI64 for f64 {
    fn from_i64(v: i64) -> Self {
        v as f64
    }
}
impl FromI64 for i64 {
    fn from_i64(v: i64) -> Self {
        v
    }
}
impl FromI64 for f16 {
    fn from_i64(v: i64) -> Self {
        f16::from_f32(v as f32)
    }
}
impl FromI64 for bf16 {
    fn from_i64(v: i64) -> Self {
        bf16::from_f32(v as f32)
    }
}

fn check_type<T: FromI64>(comm: &dyn Communicator, checksum: &mut u64) -> burn_dist::Result<()> {
    let n = comm.world_size();
    let r = comm.rank();
    for len in [
        0usize,
        1,
        2,
        3,
        5,
        7,
        13,
        1000,
        (1 << 20) / std::mem::size_of::<T>() * 2 + 3,
    ] {
        for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
            let mut data: Vec<T> = (0..len).map(|i| T::from_i64(value(r, i))).collect();
            comm.all_reduce(T::host_buf(&mut data), op)?;
            let mut reference: Vec<T> = (0..len)
                .map(|i| {
                    let vals = (0..n).map(|q| value(q, i));
                    T::from_i64(match op {
                        ReduceOp::Sum | ReduceOp::Avg => vals.sum(),
                        ReduceOp::Max => vals.max().unwrap_or(0),
                        ReduceOp::Min => vals.min().unwrap_or(0),
                    })
                })
                .collect();
            if op == ReduceOp::Avg {
                T::divide(&mut reference, n);
            }
            if data != reference {
                let bad = data
                    .iter()
                    .zip(&reference)
                    .position(|(a, b)| a != b)
                    .unwrap_or(0);
                panic!(
                    "{:?} {op:?} len {len}: element {bad}: {:?} != {:?}",
                    T::DTYPE,
                    data[bad],
                    reference[bad]
                );
            }
            for b in bytemuck::cast_slice::<T, u8>(&data) {
                *checksum = checksum.wrapping_mul(1_000_003).wrapping_add(*b as u64);
            }
        }
        for root in 0..n {
            let mut data: Vec<T> = (0..len).map(|i| T::from_i64(value(r, i))).collect();
            comm.broadcast(T::host_buf(&mut data), root)?;
            let reference: Vec<T> = (0..len).map(|i| T::from_i64(value(root, i))).collect();
            assert!(
                data == reference,
                "{:?} broadcast from {root} len {len}",
                T::DTYPE
            );
        }
        let mine: Vec<T> = (0..len).map(|i| T::from_i64(value(r, i))).collect();
        let all = comm.all_gather_vec(&mine)?;
        let reference: Vec<T> = (0..n)
            .flat_map(|q| (0..len).map(move |i| T::from_i64(value(q, i))))
            .collect();
        assert!(all == reference, "{:?} all_gather len {len}", T::DTYPE);
    }
    Ok(())
}

fn collectives() -> burn_dist::Result<()> {
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let comm = dist.comm.as_ref();
    let mut checksum = 0u64;
    check_type::<f32>(comm, &mut checksum)?;
    check_type::<f64>(comm, &mut checksum)?;
    check_type::<f16>(comm, &mut checksum)?;
    check_type::<bf16>(comm, &mut checksum)?;
    check_type::<i64>(comm, &mut checksum)?;
    let mut bytes = if comm.rank() == 0 {
        b"hello from rank 0".to_vec()
    } else {
        Vec::new()
    };
    comm.broadcast_bytes(&mut bytes, 0)?;
    assert_eq!(bytes, b"hello from rank 0");
    comm.barrier()?;
    let m = burn_dist::reduce_metrics(comm, &[1.0, comm.rank() as f64])?;
    assert_eq!(
        m,
        vec![
            comm.world_size() as f64,
            (0..comm.world_size()).sum::<usize>() as f64
        ]
    );
    // Tensors keep their dtype through the host path.
    let device = Default::default();
    let half = burn::tensor::Tensor::<burn::backend::Flex, 1>::from_data(
        burn::tensor::TensorData::new(vec![1.5f32; 7], [7]),
        (&device, burn::tensor::DType::F16),
    );
    assert_eq!(half.dtype(), burn::tensor::DType::F16);
    let summed = <burn::backend::Flex as burn_dist::CollectiveBackend>::all_reduce_float(
        comm,
        half,
        ReduceOp::Sum,
        burn_dist::Compression::None,
    )?;
    assert_eq!(summed.dtype(), burn::tensor::DType::F16);
    let values = summed.into_data().convert::<f32>().to_vec::<f32>().unwrap();
    assert_eq!(values, vec![1.5 * comm.world_size() as f32; 7]);
    println!("TRANSPORT {}", comm.transport());
    println!("CHECKSUM {checksum:016x}");
    shm_mappings();
    Ok(())
}

/// `SHM_MAPS mapped=N unlinked=M`: this process's own shared-memory segments (from
/// /proc/self/maps, so other jobs on the machine do not count) and how many of them are gone
/// from /dev/shm already; all should be, once every rank has mapped them.
fn shm_mappings() {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap_or_default();
    let mut segments: Vec<&str> = maps
        .lines()
        .filter_map(|l| l.find("/dev/shm/burn-dist-").map(|at| &l[at..]))
        .collect();
    segments.sort();
    segments.dedup();
    let unlinked = segments
        .iter()
        .filter(|s| {
            let path = s.trim_end_matches(" (deleted)");
            s.ends_with(" (deleted)") && !std::path::Path::new(path).exists()
        })
        .count();
    println!("SHM_MAPS mapped={} unlinked={unlinked}", segments.len());
}

#[derive(Module, Debug)]
struct Mlp<B: Backend> {
    fc1: Linear<B>,
    fc2: Linear<B>,
}

impl<BB: Backend> Mlp<BB> {
    fn new(hidden: usize, device: &BB::Device) -> Self {
        Self {
            fc1: LinearConfig::new(8, hidden).init(device),
            fc2: LinearConfig::new(hidden, 4).init(device),
        }
    }
    fn forward(&self, x: Tensor<BB, 2>) -> Tensor<BB, 2> {
        self.fc2
            .forward(burn::tensor::activation::tanh(self.fc1.forward(x)))
    }
}

fn batch(
    step: usize,
    rows: std::ops::Range<usize>,
    device: &burn::tensor::Device<TB>,
) -> (Tensor<TB, 2>, Tensor<TB, 2>) {
    let n = rows.len();
    let x: Vec<f32> = rows
        .clone()
        .flat_map(|r| {
            (0..8).map(move |c| (((r * 31 + c * 17 + step * 13) % 23) as f32 - 11.0) / 7.0)
        })
        .collect();
    let y: Vec<f32> = rows
        .flat_map(|r| (0..4).map(move |c| (((r * 5 + c * 3 + step) % 7) as f32 - 3.0) / 3.0))
        .collect();
    (
        Tensor::from_data(TensorData::new(x, [n, 8]), device),
        Tensor::from_data(TensorData::new(y, [n, 4]), device),
    )
}

struct Dump(Vec<f32>);
impl<BB: Backend> ModuleVisitor<BB> for Dump {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<BB, D>>) {
        self.0.extend(
            p.val()
                .into_data()
                .convert::<f32>()
                .to_vec::<f32>()
                .unwrap(),
        );
    }
}

/// `train <per-rank batch> <backward passes per step> <none|fp16|bf16> [hidden]`
fn train(args: &[String]) -> burn_dist::Result<()> {
    let b: usize = args[0].parse().unwrap();
    let k: usize = args[1].parse().unwrap();
    let compression = match args[2].as_str() {
        "fp16" => Compression::Fp16,
        "bf16" => Compression::Bf16,
        _ => Compression::None,
    };
    let hidden: usize = args.get(3).map(|h| h.parse().unwrap()).unwrap_or(16);
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let device = Default::default();
    TB::seed(&device, 42);
    let model = Mlp::<TB>::new(hidden, &device);
    let mut model = burn_dist::broadcast_parameters(dist.comm.as_ref(), model, 0)?;
    let config = DistributedConfig {
        sync: SyncConfig {
            compression,
            bucket_bytes: 256,
            ..SyncConfig::default()
        },
        backward_passes_per_step: k,
    };
    let mut opt = DistributedOptimizer::new(SgdConfig::new().init(), dist.comm.clone(), config);
    let rank = dist.rank();
    for step in 0..5 {
        let sub = b / k;
        for pass in 0..k {
            let start = rank * b + pass * sub;
            let (x, y) = batch(step, start..start + sub, &device);
            let loss = (model.forward(x) - y)
                .powf_scalar(2.0)
                .mean()
                .div_scalar(k as f64);
            let grads = GradientsParams::from_grads(loss.backward(), &model);
            model = opt.step(0.1, model, grads)?;
        }
    }
    let mut dump = Dump(Vec::new());
    model.visit(&mut dump);
    let text: Vec<String> = dump.0.iter().map(|v| format!("{v:e}")).collect();
    println!("PARAMS {}", text.join(","));
    Ok(())
}

#[derive(Module, Debug)]
struct BnNet<B: Backend> {
    fc: Linear<B>,
    bn: burn::nn::BatchNorm<B>,
}

impl<B: Backend> BnNet<B> {
    fn forward(&self, x: Tensor<B, 2>) -> Tensor<B, 2> {
        let [n, _] = x.dims();
        self.bn
            .forward(self.fc.forward(x).reshape([n, 4, 1]))
            .reshape([n, 4])
    }
}

struct Buffers(Vec<f32>);
impl<BB: Backend> ModuleVisitor<BB> for Buffers {
    fn visit_float<const D: usize>(&mut self, p: &Param<Tensor<BB, D>>) {
        let t = p.val();
        if !t.is_require_grad() {
            self.0
                .extend(t.into_data().convert::<f32>().to_vec::<f32>().unwrap());
        }
    }
}

fn floats(label: &str, v: &[f32]) {
    let text: Vec<String> = v.iter().map(|x| format!("{x:e}")).collect();
    println!("{label} {}", text.join(","));
}

/// Broadcast of parameters and buffers, optimizer state broadcast, buffer averaging.
fn state() -> burn_dist::Result<()> {
    use burn::optim::Optimizer;
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let comm = dist.comm.as_ref();
    let rank = dist.rank();
    let device = Default::default();
    TB::seed(&device, 100 + rank as u64);
    let model = BnNet::<TB> {
        fc: LinearConfig::new(8, 4).init(&device),
        bn: burn::nn::BatchNormConfig::new(4).init(&device),
    };
    // Make rank-specific running statistics, then broadcast rank 0's parameters and buffers.
    let (x, _) = batch(rank, rank * 8..rank * 8 + 8, &device);
    let _ = model.forward(x);
    let model = burn_dist::broadcast_parameters(comm, model, 0)?;
    let mut all = Dump(Vec::new());
    model.visit(&mut all);
    floats("AFTER_BCAST", &all.0);
    // Rank-local optimizer steps (momentum state differs per rank), then broadcast rank 0's state.
    let mut opt = SgdConfig::new()
        .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
        .init::<TB, BnNet<TB>>();
    let mut model = model;
    for step in 0..2 {
        let (x, y) = batch(step + 10 * rank, rank * 8..rank * 8 + 8, &device);
        let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        model = opt.step(0.1, model, grads);
    }
    // Parameters and momentum diverged; re-broadcast both from rank 0, then one identical step:
    // ranks agree afterwards only if the momentum state really was replaced by rank 0's.
    let model = burn_dist::broadcast_parameters(comm, model, 0)?;
    // SKIP_STATE_BROADCAST=1: negative control for the test.
    let mut opt = if std::env::var_os("SKIP_STATE_BROADCAST").is_some() {
        opt
    } else {
        burn_dist::broadcast_optimizer_state::<_, BnNet<TB>, TB>(comm, opt, 0, &device)?
    };
    let (x, y) = batch(99, 0..8, &device);
    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let model = opt.step(0.1, model, grads);
    let mut trained = Dump(Vec::new());
    model.visit(&mut trained);
    floats("AFTER_STATE_STEP", &trained.0);
    // Rank-local forward passes make the buffers diverge; average them.
    let (x, _) = batch(7 + rank, rank * 8..rank * 8 + 8, &device);
    let _ = model.forward(x);
    let mut before = Buffers(Vec::new());
    let _ = model.clone().into_record(); // syncs running states shared with `model`
    model.visit(&mut before);
    floats("BUFFERS_BEFORE", &before.0);
    let model = burn_dist::average_buffers(comm, model)?;
    let mut after = Buffers(Vec::new());
    let _ = model.clone().into_record();
    model.visit(&mut after);
    floats("BUFFERS_AFTER", &after.0);
    Ok(())
}

#[derive(Module, Debug)]
struct TwoHeads<B: Backend> {
    body: Linear<B>,
    head: Linear<B>,
    /// Used by no rank.
    spare: Linear<B>,
}

/// Rank 0 uses `head`, the others do not (no gradient): they must contribute zeros, not hang.
/// No rank uses `spare`: with weight decay it would still move if it got a (zero) gradient; it
/// must get none.
fn unused() -> burn_dist::Result<()> {
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let device = Default::default();
    TB::seed(&device, 7);
    let model = TwoHeads::<TB> {
        body: LinearConfig::new(8, 4).init(&device),
        head: LinearConfig::new(4, 4).init(&device),
        spare: LinearConfig::new(4, 4).init(&device),
    };
    let model = burn_dist::broadcast_parameters(dist.comm.as_ref(), model, 0)?;
    let mut before = Dump(Vec::new());
    model.head.visit(&mut before);
    let mut spare_before = Dump(Vec::new());
    model.spare.visit(&mut spare_before);
    let mut opt = DistributedOptimizer::new(
        SgdConfig::new()
            .with_weight_decay(Some(burn::optim::decay::WeightDecayConfig::new(0.1)))
            .init(),
        dist.comm.clone(),
        DistributedConfig::default(),
    );
    let (x, y) = batch(dist.rank(), 0..8, &device);
    let mut out = model.body.forward(x);
    if dist.rank() == 0 {
        out = model.head.forward(out);
    }
    let loss = (out - y).powf_scalar(2.0).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let model = opt.step(0.1, model, grads)?;
    let mut all = Dump(Vec::new());
    model.visit(&mut all);
    floats("PARAMS", &all.0);
    let mut after = Dump(Vec::new());
    model.head.visit(&mut after);
    println!("HEAD_CHANGED {}", before.0 != after.0);
    let mut spare_after = Dump(Vec::new());
    model.spare.visit(&mut spare_after);
    println!("SPARE_CHANGED {}", spare_before.0 != spare_after.0);
    Ok(())
}

/// `loop <iterations> <elements> [die_rank die_after]`: repeated all-reduces; `die_rank` aborts
/// after `die_after` iterations.
fn all_reduce_loop(args: &[String]) -> burn_dist::Result<()> {
    let iters: usize = args[0].parse().unwrap();
    let len: usize = args[1].parse().unwrap();
    let die: Option<(usize, usize)> = args
        .get(2)
        .map(|r| (r.parse().unwrap(), args[3].parse().unwrap()));
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let comm = dist.comm.as_ref();
    println!("READY rank={} pid={}", comm.rank(), std::process::id());
    let mut v = vec![1.0f32; len];
    for i in 0..iters {
        if let Some((r, after)) = die
            && r == comm.rank()
            && i == after
        {
            eprintln!("rank {r} dies now");
            std::process::abort();
        }
        v.iter_mut().for_each(|x| *x = 1.0);
        comm.all_reduce(HostBuf::F32(&mut v), ReduceOp::Sum)?;
        assert!(v.iter().all(|x| *x == comm.world_size() as f32));
        if i == 0 {
            // Every rank took part in a collective by now.
            println!("LOOPING rank={}", comm.rank());
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    println!("LOOP OK");
    Ok(())
}

/// `launch <nproc> <failing rank or -1>`: acts as the launcher; workers succeed except one.
fn launch(args: &[String]) -> burn_dist::Result<()> {
    let nproc: usize = args[0].parse().unwrap();
    let fail: i64 = args[1].parse().unwrap();
    let config = LaunchConfig {
        nproc_per_node: Some(nproc),
        master_port: 0,
        ..LaunchConfig::default()
    };
    let world = burn_dist::launch_or_run(&config)?;
    println!(
        "worker {} of {} quiet={}",
        world.rank,
        world.world_size,
        !burn_dist::should_draw_progress()
    );
    if world.rank as i64 == fail {
        std::process::exit(7);
    }
    // Healthy ranks would run for a long time; the launcher must stop them.
    std::thread::sleep(Duration::from_secs(if fail >= 0 { 3600 } else { 0 }));
    Ok(())
}

/// Joins the job and sums `rank + 1` over all ranks; prints where it found the store.
fn job(world: &World) -> burn_dist::Result<()> {
    let dist = burn_dist::init(world, &options())?;
    let mut v = vec![(world.rank + 1) as f32; 3];
    dist.comm.all_reduce(f32::host_buf(&mut v), ReduceOp::Sum)?;
    let store = match &world.rendezvous {
        Rendezvous::OwnStore => "own".to_string(),
        Rendezvous::TorchAgentStore { key_prefix } => format!("torch-agent:{key_prefix}"),
    };
    println!(
        "JOB rank={} world={} local={}/{} master={} store={store} sum={}",
        world.rank,
        world.world_size,
        world.local_rank,
        world.local_world_size,
        world.master_endpoint(),
        v[0]
    );
    Ok(())
}

/// `launch-job --nproc N --nnodes N --node-rank R --master-port P [--master-addr A] [--rdzv-id ID]`:
/// our launcher with these flags, each worker running [`job`].
fn launch_job(args: &[String]) -> burn_dist::Result<()> {
    let mut config = LaunchConfig::default();
    for pair in args.chunks(2) {
        let value = pair[1].clone();
        match pair[0].as_str() {
            "--nproc" => config.nproc_per_node = Some(value.parse().unwrap()),
            "--nnodes" => config.nnodes = value.parse().unwrap(),
            "--node-rank" => config.node_rank = value.parse().unwrap(),
            "--master-addr" => config.master_addr = value,
            "--master-port" => config.master_port = value.parse().unwrap(),
            "--rdzv-id" => config.rdzv_id = Some(value),
            other => panic!("unknown flag {other}"),
        }
    }
    let world = burn_dist::launch_or_run(&config)?;
    job(&world)
}

/// `launch-loop <nproc> <iterations> <elements>`: our launcher running `loop` on every rank.
fn launch_loop(args: &[String]) -> burn_dist::Result<()> {
    let nproc: usize = args[0].parse().unwrap();
    let config = LaunchConfig {
        nproc_per_node: Some(nproc),
        master_port: 0,
        ..LaunchConfig::default()
    };
    burn_dist::launch_or_run(&config)?;
    all_reduce_loop(&args[1..])
}

/// Rank 0 broadcasts its SGD-with-momentum state; rank 1 expects an Adam state, so loading it
/// fails on rank 1 alone, inside `broadcast_optimizer_state`. The others go on to a barrier and
/// must stop at once naming rank 1, not wait out the deadline.
fn bad_state() -> burn_dist::Result<()> {
    use burn::optim::Optimizer;
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let comm = dist.comm.as_ref();
    let device = Default::default();
    TB::seed(&device, 5);
    let model = BnNet::<TB> {
        fc: LinearConfig::new(8, 4).init(&device),
        bn: burn::nn::BatchNormConfig::new(4).init(&device),
    };
    let model = burn_dist::broadcast_parameters(comm, model, 0)?;
    let mut sgd = SgdConfig::new()
        .with_momentum(Some(burn::optim::momentum::MomentumConfig::new()))
        .init::<TB, BnNet<TB>>();
    let (x, y) = batch(1, 0..8, &device);
    let loss = (model.forward(x) - y).powf_scalar(2.0).mean();
    let grads = GradientsParams::from_grads(loss.backward(), &model);
    let _ = sgd.step(0.1, model, grads);
    println!("READY rank={} pid={}", comm.rank(), std::process::id());
    if comm.rank() == 1 {
        let adam = burn::optim::AdamConfig::new().init::<TB, BnNet<TB>>();
        burn_dist::broadcast_optimizer_state::<_, BnNet<TB>, TB>(comm, adam, 0, &device)?;
    } else {
        burn_dist::broadcast_optimizer_state::<_, BnNet<TB>, TB>(comm, sgd, 0, &device)?;
    }
    comm.barrier()?;
    println!("NOT REACHED");
    Ok(())
}

/// Rank 1 broadcasts where the others all-reduce (then the other way round).
fn out_of_order() -> burn_dist::Result<()> {
    let dist = burn_dist::init(&World::from_env()?, &options())?;
    let comm = dist.comm.as_ref();
    println!("READY rank={} pid={}", comm.rank(), std::process::id());
    let mut v = vec![1.0f32; 64];
    if comm.rank() == 1 {
        comm.broadcast(HostBuf::F32(&mut v), 0)?;
        comm.all_reduce(HostBuf::F32(&mut v), ReduceOp::Sum)?;
    } else {
        comm.all_reduce(HostBuf::F32(&mut v), ReduceOp::Sum)?;
        comm.broadcast(HostBuf::F32(&mut v), 0)?;
    }
    println!("NOT REACHED");
    Ok(())
}
