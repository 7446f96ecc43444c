//! `train --check-env`: what a run on this machine would find and use, in the spirit of
//! `python -m torch.utils.collect_env` and `nvidia-smi topo -m`. Exits non-zero, with the fix,
//! when something the run needs is missing; a machine without a GPU is reported as such (a run
//! trains on the CPU) and its libraries are still listed.

use std::fmt::Write as _;
use std::process::ExitCode;

use burn_dist::cuda_libs::{CudaLibraries, CudaLibrary};

use crate::cli::{Amp, OpChoice, TrainArgs};

/// One GPU as the driver reports it.
#[derive(Debug, Clone, PartialEq)]
pub struct Gpu {
    /// `cuDeviceGetName`.
    pub name: String,
    /// `cuDeviceTotalMem`, in bytes.
    pub memory_bytes: usize,
    /// Compute capability (major, minor).
    pub capability: (i32, i32),
}

/// The driver and its GPUs.
#[derive(Debug, Clone, PartialEq)]
pub struct Driver {
    /// `cuDriverGetVersion` (e.g. 13000 for CUDA 13.0).
    pub version: i32,
    /// The visible GPUs, in device order.
    pub gpus: Vec<Gpu>,
    /// `p2p[i][j]`: device i can access device j's memory (`cuDeviceCanAccessPeer`).
    pub p2p: Vec<Vec<bool>>,
}

/// Everything `--check-env` reports.
#[derive(Debug, Clone)]
pub struct Report {
    /// Where the libraries are.
    pub libs: CudaLibraries,
    /// The driver, or why there is none.
    pub driver: Result<Driver, String>,
    /// Versions the loaded libraries report.
    pub versions: Vec<(CudaLibrary, String)>,
    /// `CUDA_VISIBLE_DEVICES`.
    pub visible_devices: Option<String>,
    /// `LD_LIBRARY_PATH` as this process (after [`burn_dist::cuda_libs::prepare`]) sees it.
    pub ld_library_path: Option<String>,
    /// Whether this binary was built with the `cuda` feature.
    pub cuda_build: bool,
}

fn version_dotted(v: i32) -> String {
    format!("{}.{}", v / 1000, (v % 1000) / 10)
}

impl Report {
    /// The lines to print and the problems that make the command fail (each with its fix).
    pub fn render(&self, args: &TrainArgs) -> (String, Vec<String>) {
        let mut out = String::new();
        let mut problems = Vec::new();
        let gpus = self.driver.as_ref().map_or(0, |d| d.gpus.len());
        match &self.driver {
            Ok(d) => {
                let _ = writeln!(
                    out,
                    "driver: CUDA {} (driver API), {} GPU(s)",
                    version_dotted(d.version),
                    d.gpus.len()
                );
                for (i, g) in d.gpus.iter().enumerate() {
                    let _ = writeln!(
                        out,
                        "  cuda:{i}  {}  {:.1} GiB  compute capability {}.{}",
                        g.name,
                        g.memory_bytes as f64 / f64::from(1u32 << 30),
                        g.capability.0,
                        g.capability.1
                    );
                }
                if d.gpus.len() > 1 {
                    let _ = writeln!(out, "P2P access (row can read column):");
                    let header: Vec<String> =
                        (0..d.gpus.len()).map(|j| format!("{j:>4}")).collect();
                    let _ = writeln!(out, "        {}", header.join(""));
                    for (i, row) in d.p2p.iter().enumerate() {
                        let cells: Vec<String> = row
                            .iter()
                            .enumerate()
                            .map(|(j, ok)| {
                                format!(
                                    "{:>4}",
                                    if i == j {
                                        "X"
                                    } else if *ok {
                                        "OK"
                                    } else {
                                        "-"
                                    }
                                )
                            })
                            .collect();
                        let _ = writeln!(out, "  cuda:{i}{}", cells.join(""));
                    }
                }
            }
            Err(why) => {
                let _ = writeln!(out, "no NVIDIA GPU: {why}; a run trains on the CPU");
            }
        }
        let _ = writeln!(out, "libraries:");
        for lib in CudaLibrary::ALL {
            let version = self
                .versions
                .iter()
                .find(|(l, _)| *l == lib)
                .map(|(_, v)| format!("  version {v}"))
                .unwrap_or_default();
            match self.libs.get(lib) {
                Some(found) => {
                    let _ = writeln!(
                        out,
                        "  {:<16} {}{version}",
                        lib.name(),
                        found.path.display()
                    );
                }
                None => {
                    let _ = writeln!(out, "  {:<16} not found", lib.name());
                }
            }
        }
        if let Some(problem) = &self.libs.cudnn_problem {
            let _ = writeln!(out, "  cuDNN seen but not usable: {problem}");
        }
        if let Some(dir) = &self.libs.link_dir {
            let _ = writeln!(
                out,
                "  (names cudarc loads are linked in {})",
                dir.display()
            );
        }
        let _ = writeln!(
            out,
            "CUDA_VISIBLE_DEVICES: {}",
            self.visible_devices
                .as_deref()
                .unwrap_or("(unset: every GPU)")
        );
        let _ = writeln!(
            out,
            "LD_LIBRARY_PATH: {}",
            self.ld_library_path.as_deref().unwrap_or("")
        );
        let _ = writeln!(
            out,
            "CUDA_PATH (NVRTC headers): {}",
            self.libs
                .cuda_path
                .as_ref()
                .map_or("not found".to_string(), |p| p.display().to_string())
        );

        let use_cuda = self.cuda_build && !args.no_cuda && gpus > 0;
        let processes = args
            .nproc_per_node
            .unwrap_or(if use_cuda { gpus } else { 1 })
            * args.nnodes.max(1);
        let require = |lib: CudaLibrary, problems: &mut Vec<String>| {
            if let Err(e) = self.libs.require(lib) {
                problems.push(e.to_string());
            }
        };
        let backend = if use_cuda {
            require(CudaLibrary::Nvrtc, &mut problems);
            if self.libs.cuda_path.is_none() {
                problems.push(
                    "no CUDA headers (Burn compiles its kernels with NVRTC and \
                     --include-path=$CUDA_PATH/include): install the CUDA toolkit or \
                     `pip install nvidia-cuda-runtime-cu12`, or set CUDA_PATH"
                        .into(),
                );
            }
            "cuda (burn-cuda)"
        } else if args.no_cuda {
            "flex (CPU): --no-cuda"
        } else if !self.cuda_build {
            "flex (CPU): built without CUDA"
        } else {
            "flex (CPU): no GPU"
        };
        let cudnn = self.libs.get(CudaLibrary::Cudnn).is_some();
        let conv = match (use_cuda, args.conv, cudnn) {
            (false, OpChoice::Fast, _) => "ours (GEMM kernels on the CPU)",
            (_, OpChoice::Burn, _) => "Burn's",
            (true, OpChoice::Fast, true) => "cuDNN",
            (true, OpChoice::Fast, false) => "Burn's (cuDNN not found)",
        };
        if args.amp == Amp::Bf16 {
            if let Err(reason) = amp_refusal(use_cuda, args.conv) {
                problems.push(reason);
            } else if !cudnn {
                require(CudaLibrary::Cudnn, &mut problems);
            }
        }
        let comm = if processes <= 1 {
            "none (one process)"
        } else if use_cuda {
            require(CudaLibrary::Nccl, &mut problems);
            "NCCL"
        } else {
            "ring (TCP, shared memory on one host)"
        };
        let _ = writeln!(
            out,
            "a run would use: backend {backend}; conv {conv}{}; communicator {comm}, {processes} \
             process(es)",
            if args.amp == Amp::Bf16 {
                " in bf16"
            } else {
                ""
            }
        );
        (out, problems)
    }
}

/// Why `--amp bf16` cannot run, or `Ok`: bf16 convs are our cuDNN op's, on CUDA only.
///
/// # Errors
/// The reason, naming the flag to change.
pub fn amp_refusal(use_cuda: bool, conv: OpChoice) -> Result<(), String> {
    if !use_cuda {
        return Err(
            "--amp bf16 runs the convs in bf16 through cuDNN on CUDA; this run trains on the CPU \
             (Flex has no bf16 conv path): drop --amp or run on a GPU"
                .into(),
        );
    }
    if conv == OpChoice::Burn {
        return Err(
            "--amp bf16 is our cuDNN conv's (bf16 operands, f32 accumulation); use \
                    --conv fast, or drop --amp with --conv burn"
                .into(),
        );
    }
    Ok(())
}

/// Probes the driver, its GPUs and the libraries' versions.
pub fn gather(libs: CudaLibraries) -> Report {
    #[cfg(feature = "cuda")]
    let (driver, versions) = probe::driver_and_versions(&libs);
    #[cfg(not(feature = "cuda"))]
    let (driver, versions) = (
        Err("this train was built without the `cuda` feature".to_string()),
        Vec::new(),
    );
    Report {
        libs,
        driver,
        versions,
        visible_devices: std::env::var("CUDA_VISIBLE_DEVICES").ok(),
        ld_library_path: std::env::var("LD_LIBRARY_PATH").ok(),
        cuda_build: cfg!(feature = "cuda"),
    }
}

/// `train --check-env`: prints the report; exit code 1 with each fix when something is missing.
pub fn run(args: &TrainArgs, libs: CudaLibraries) -> ExitCode {
    let report = gather(libs);
    let (text, problems) = report.render(args);
    print!("{text}");
    if problems.is_empty() {
        println!("ok: nothing this run needs is missing");
        ExitCode::SUCCESS
    } else {
        for p in &problems {
            println!("missing: {p}");
        }
        ExitCode::FAILURE
    }
}

#[cfg(feature = "cuda")]
mod probe {
    use super::{Driver, Gpu};
    use burn_dist::cuda_libs::{CudaLibraries, CudaLibrary};
    use cudarc::driver::{result as cu, sys as cusys};

    pub(super) fn driver_and_versions(
        libs: &CudaLibraries,
    ) -> (Result<Driver, String>, Vec<(CudaLibrary, String)>) {
        let mut versions = Vec::new();
        // SAFETY (all `is_culib_present` calls): they only try to dlopen the library; every
        // other call below is made only when it loaded (cudarc panics otherwise).
        if unsafe { cudarc::nvrtc::sys::is_culib_present() } {
            let (mut major, mut minor) = (0, 0);
            // SAFETY: two valid out-pointers.
            unsafe { cudarc::nvrtc::sys::nvrtcVersion(&mut major, &mut minor) };
            versions.push((CudaLibrary::Nvrtc, format!("{major}.{minor}")));
        }
        if unsafe { cudarc::nccl::sys::is_culib_present() }
            && let Ok(v) = cudarc::nccl::result::get_nccl_version()
        {
            versions.push((
                CudaLibrary::Nccl,
                format!("{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100),
            ));
        }
        // Only a cuDNN whose sub-libraries open: the shim alone may abort the process.
        if libs.get(CudaLibrary::Cudnn).is_some()
            && unsafe { cudarc::cudnn::sys::is_culib_present() }
        {
            let v = cudarc::cudnn::result::get_version();
            versions.push((
                CudaLibrary::Cudnn,
                format!("{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100),
            ));
        }
        if !unsafe { cusys::is_culib_present() } {
            return (
                Err("no CUDA driver library (libcuda.so.1) could be loaded".into()),
                versions,
            );
        }
        let mut version = 0;
        // SAFETY: a valid out-pointer; the library is loaded.
        unsafe { cusys::cuDriverGetVersion(&mut version) };
        versions.push((CudaLibrary::Driver, super::version_dotted(version)));
        if let Err(e) = cu::init() {
            return (Err(format!("cuInit failed ({e:?})")), versions);
        }
        let count = cu::device::get_count().unwrap_or(0).max(0);
        let mut gpus = Vec::new();
        let mut handles = Vec::new();
        for i in 0..count {
            let Ok(dev) = cu::device::get(i) else {
                continue;
            };
            let attr = |a| {
                // SAFETY: `dev` is a valid device handle after cuInit.
                unsafe { cu::device::get_attribute(dev, a) }.unwrap_or(0)
            };
            gpus.push(Gpu {
                name: cu::device::get_name(dev).unwrap_or_else(|_| "?".into()),
                // SAFETY: as above.
                memory_bytes: unsafe { cu::device::total_mem(dev) }.unwrap_or(0),
                capability: (
                    attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                    attr(cusys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                ),
            });
            handles.push(dev);
        }
        let p2p = handles
            .iter()
            .map(|&a| {
                handles
                    .iter()
                    .map(|&b| {
                        let mut ok = 0;
                        // SAFETY: valid device handles and out-pointer.
                        a != b
                            && unsafe { cusys::cuDeviceCanAccessPeer(&mut ok, a, b) }
                                == cusys::CUresult::CUDA_SUCCESS
                            && ok == 1
                    })
                    .collect()
            })
            .collect();
        if gpus.is_empty() {
            return (
                Err(format!(
                    "the driver (CUDA {}) sees no GPU (CUDA_VISIBLE_DEVICES={})",
                    super::version_dotted(version),
                    std::env::var("CUDA_VISIBLE_DEVICES").unwrap_or_else(|_| "unset".into())
                )),
                versions,
            );
        }
        (Ok(Driver { version, gpus, p2p }), versions)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    fn args(extra: &[&str]) -> TrainArgs {
        let mut argv = vec!["train"];
        argv.extend_from_slice(extra);
        TrainArgs::parse_from(argv)
    }

    fn libs_in(folder: &std::path::Path) -> CudaLibraries {
        burn_dist::cuda_libs::find_in(&[folder.to_path_buf()])
    }

    fn touch(path: &std::path::Path) {
        std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
        std::fs::write(path, b"").expect("write");
    }

    fn report(libs: CudaLibraries, driver: Result<Driver, String>) -> Report {
        Report {
            libs,
            driver,
            versions: vec![(CudaLibrary::Nccl, "2.27.3".into())],
            visible_devices: None,
            ld_library_path: None,
            cuda_build: true,
        }
    }

    fn h200s(n: usize) -> Driver {
        Driver {
            version: 13000,
            gpus: vec![
                Gpu {
                    name: "NVIDIA H200".into(),
                    memory_bytes: 150_000_000_000,
                    capability: (9, 0),
                };
                n
            ],
            p2p: (0..n).map(|i| (0..n).map(|j| i != j).collect()).collect(),
        }
    }

    #[test]
    fn without_a_gpu_it_says_so_lists_the_libraries_and_passes() {
        let dir = tempfile::tempdir().expect("tempdir");
        touch(&dir.path().join("libnccl.so.2"));
        let r = report(libs_in(dir.path()), Err("no CUDA driver library".into()));
        let (text, problems) = r.render(&args(&[]));
        assert!(problems.is_empty(), "{problems:?}");
        assert!(text.contains("no NVIDIA GPU: no CUDA driver library; a run trains on the CPU"));
        assert!(text.contains("libnccl.so.2  version 2.27.3"), "{text}");
        assert!(
            text.lines()
                .any(|l| l.trim_start().starts_with("cuDNN") && l.ends_with("not found")),
            "{text}"
        );
        assert!(text.contains("backend flex (CPU): no GPU"), "{text}");
        assert!(text.contains("CUDA_VISIBLE_DEVICES: (unset"), "{text}");
    }

    #[test]
    fn gpus_without_nvrtc_or_nccl_fail_with_the_fix() {
        let dir = tempfile::tempdir().expect("tempdir");
        let r = report(libs_in(dir.path()), Ok(h200s(2)));
        let (text, problems) = r.render(&args(&[]));
        assert!(text.contains("cuda:1  NVIDIA H200"), "{text}");
        assert!(text.contains("P2P access"), "{text}");
        assert!(text.contains("communicator NCCL, 2 process(es)"), "{text}");
        let all = problems.join("\n");
        for needle in ["NVRTC", "NCCL", "nvidia-nccl-cu12", "CUDA_PATH"] {
            assert!(all.contains(needle), "{needle:?} missing from: {all}");
        }
        // One GPU, one process: no NCCL needed.
        let r = report(libs_in(dir.path()), Ok(h200s(1)));
        let (_, problems) = r.render(&args(&[]));
        assert!(!problems.join("\n").contains("NCCL"), "{problems:?}");
    }

    #[test]
    fn amp_bf16_is_refused_on_the_cpu_and_with_burns_conv() {
        let cpu = amp_refusal(false, OpChoice::Fast).expect_err("CPU");
        assert!(cpu.contains("CPU") && cpu.contains("--amp"), "{cpu}");
        let burn = amp_refusal(true, OpChoice::Burn).expect_err("burn conv");
        assert!(burn.contains("--conv fast"), "{burn}");
        amp_refusal(true, OpChoice::Fast).expect("CUDA + our conv");
        let dir = tempfile::tempdir().expect("tempdir");
        let r = report(libs_in(dir.path()), Err("none".into()));
        let (_, problems) = r.render(&args(&["--amp", "bf16"]));
        assert!(
            problems.iter().any(|p| p.contains("--amp bf16")),
            "{problems:?}"
        );
    }

    /// `--amp` is one of the run's settings, so a checkpoint records it (the header keeps the
    /// flags); checkpoints written before the flag read back as `none`.
    #[test]
    fn amp_is_saved_with_the_settings() {
        let saved = serde_json::to_value(args(&["--amp", "bf16"])).expect("serialise");
        assert_eq!(saved["amp"], "bf16");
        let mut old = saved.clone();
        old.as_object_mut().expect("object").remove("amp");
        let read: TrainArgs = serde_json::from_value(old).expect("old settings read");
        assert_eq!(read.amp, Amp::None);
        assert!(
            saved.get("check_env").is_none(),
            "--check-env is not a setting"
        );
    }
}
