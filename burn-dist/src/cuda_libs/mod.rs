//! Finding the CUDA libraries where users really have them, and making cudarc load them.
//!
//! cudarc 0.19 dlopens `lib{x}.so` and `lib{x}.so.{12,11,10,9,1}` by bare name, so the dynamic
//! loader searches only `LD_LIBRARY_PATH` (read once, at process start) and the ld cache. It never
//! tries `libnccl.so.2` (what Debian's `libnccl2` and the `nvidia-nccl-cu12` wheel ship) or
//! `libnvrtc.so.13` (CUDA 13), never looks in pip's `site-packages/nvidia/*/lib`, and tries
//! `libcuda.so` (in a toolkit that is often the `lib64/stubs` stub, whose `cuInit` fails) before
//! the driver's `libcuda.so.1`.
//!
//! [`prepare`] searches where libraries are installed ([`search_places`]), puts symlinks with the
//! names cudarc asks for in a private folder, and re-executes the program once with that folder
//! and the real library folders first on `LD_LIBRARY_PATH` (cuDNN 9's `libcudnn.so.9` opens its
//! sub-libraries by bare name, so their real folder must be on the path too). Call it first in
//! `main`, before any CUDA call; the launcher's workers inherit the environment.

use std::ffi::{OsStr, OsString};
use std::path::{Path, PathBuf};

#[cfg(test)]
mod tests;

/// Set in the environment of the re-executed process: the libraries are arranged, never exec again.
pub const READY_ENV: &str = "BURN_DIST_CUDA_LIBS";

/// A CUDA library the CUDA path loads at run time.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CudaLibrary {
    /// The driver API (`libcuda.so.1`, installed with the NVIDIA driver).
    Driver,
    /// The runtime compiler Burn's kernels are compiled with.
    Nvrtc,
    /// Collectives between GPUs.
    Nccl,
    /// Convolutions (`--conv fast` on CUDA).
    Cudnn,
}

/// cuDNN 9's sub-libraries that `libcudnn.so.9` opens for a convolution; without them it aborts
/// the process (SIGABRT in `cudnnCreate`) instead of returning an error.
pub const CUDNN_SUB_LIBRARIES: [&str; 6] = [
    "libcudnn_graph.so.9",
    "libcudnn_ops.so.9",
    "libcudnn_cnn.so.9",
    "libcudnn_heuristic.so.9",
    "libcudnn_engines_precompiled.so.9",
    "libcudnn_engines_runtime_compiled.so.9",
];

impl CudaLibrary {
    /// All four, in the order they are reported.
    pub const ALL: [Self; 4] = [Self::Driver, Self::Nvrtc, Self::Nccl, Self::Cudnn];

    /// The library's name for people.
    pub fn name(self) -> &'static str {
        match self {
            Self::Driver => "the CUDA driver",
            Self::Nvrtc => "NVRTC",
            Self::Nccl => "NCCL",
            Self::Cudnn => "cuDNN",
        }
    }

    /// The name cudarc asks for (`lib{stem}.so...`).
    pub fn cudarc_stem(self) -> &'static str {
        match self {
            Self::Driver => "cuda",
            Self::Nvrtc => "nvrtc",
            Self::Nccl => "nccl",
            Self::Cudnn => "cudnn",
        }
    }

    /// File names of the real library, best first. Never `libcuda.so`: that name is the
    /// toolkit's link-time stub as often as the driver.
    pub fn file_names(self) -> &'static [&'static str] {
        match self {
            Self::Driver => &["libcuda.so.1"],
            Self::Nvrtc => &["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"],
            Self::Nccl => &["libnccl.so.2", "libnccl.so"],
            Self::Cudnn => &["libcudnn.so.9"],
        }
    }

    /// What provides it.
    pub fn package(self) -> &'static str {
        match self {
            Self::Driver => "the NVIDIA driver (`nvidia-driver-*`, or Debian/Ubuntu's `libcuda1`)",
            Self::Nvrtc => {
                "`pip install nvidia-cuda-nvrtc-cu12` (or -cu13), or the CUDA toolkit's `cuda-nvrtc`"
            }
            Self::Nccl => "`pip install nvidia-nccl-cu12`, or Debian/Ubuntu's `libnccl2`",
            Self::Cudnn => {
                "`pip install nvidia-cudnn-cu12`, or Debian/Ubuntu's `libcudnn9-cuda-12`"
            }
        }
    }
}

/// The names cudarc 0.19.10 tries for `stem` that a Linux install can have
/// (`get_lib_name_candidates` in its `lib.rs`, with `cuda-12080`: major version 12); the
/// Windows-style `{stem}64_*` names are left out.
pub fn cudarc_names(stem: &str) -> Vec<String> {
    ["", ".12", ".11", ".10", ".9", ".1"]
        .iter()
        .map(|v| format!("lib{stem}.so{v}"))
        .collect()
}

/// Where a library was found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found {
    /// Which library.
    pub library: CudaLibrary,
    /// The file.
    pub path: PathBuf,
}

impl Found {
    /// The folder that holds it.
    pub fn folder(&self) -> &Path {
        self.path.parent().unwrap_or(Path::new("/"))
    }
}

/// What a search found, and where it looked.
#[derive(Debug, Clone, Default)]
pub struct CudaLibraries {
    /// One entry per library that was found.
    pub found: Vec<Found>,
    /// The folders searched, in order.
    pub searched: Vec<PathBuf>,
    /// Why a copy of cuDNN that was seen cannot be used (sub-libraries missing or unopenable).
    pub cudnn_problem: Option<String>,
    /// The private folder of symlinks on `LD_LIBRARY_PATH`, once arranged.
    pub link_dir: Option<PathBuf>,
    /// `CUDA_PATH` as the run sees it (set from `CUDA_HOME`, `nvcc` or `/usr/local/cuda`).
    pub cuda_path: Option<PathBuf>,
}

/// A library that the run needs and that was not found.
#[derive(Debug, thiserror::Error)]
#[error(
    "{library} ({files}) was not found; looked in {searched}{problem}. Install {package}, or put \
     the folder that holds it on LD_LIBRARY_PATH"
)]
pub struct NotFound {
    /// The library's name.
    pub library: &'static str,
    /// The file names looked for.
    pub files: String,
    /// The folders searched.
    pub searched: String,
    /// A copy that was seen but cannot be used.
    pub problem: String,
    /// What provides it.
    pub package: &'static str,
}

impl CudaLibraries {
    /// Where `library` was found.
    pub fn get(&self, library: CudaLibrary) -> Option<&Found> {
        self.found.iter().find(|f| f.library == library)
    }

    /// Where `library` was found, or an error naming the library, the places searched and the
    /// package that provides it.
    ///
    /// # Errors
    /// [`NotFound`] when the search did not find it.
    pub fn require(&self, library: CudaLibrary) -> Result<&Found, NotFound> {
        self.get(library).ok_or_else(|| NotFound {
            library: library.name(),
            files: library.file_names().join(", "),
            searched: if self.searched.is_empty() {
                "no folder (none exists)".into()
            } else {
                self.searched
                    .iter()
                    .map(|p| p.display().to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
            problem: match (library, &self.cudnn_problem) {
                (CudaLibrary::Cudnn, Some(p)) => format!(" ({p})"),
                _ => String::new(),
            },
            package: library.package(),
        })
    }

    /// One line: what was found and where (for rank 0 at start).
    pub fn summary(&self) -> String {
        let parts: Vec<String> = CudaLibrary::ALL
            .iter()
            .map(|&l| match self.get(l) {
                Some(f) => format!("{} {}", l.name(), f.path.display()),
                None => format!("{} not found", l.name()),
            })
            .collect();
        let mut line = format!("CUDA libraries: {}", parts.join("; "));
        if let Some(dir) = &self.link_dir {
            line.push_str(&format!(
                " (names cudarc loads linked in {})",
                dir.display()
            ));
        }
        line
    }
}

fn is_stub_folder(path: &Path) -> bool {
    path.components().any(|c| c.as_os_str() == "stubs")
}

/// Sub-folders `prefix/lib/python3*/site-packages/nvidia/*/lib` (pip's NVIDIA wheels), sorted.
fn wheel_folders(prefix: &Path) -> Vec<PathBuf> {
    let mut out = Vec::new();
    for python in sorted_children(&prefix.join("lib"), |n| n.starts_with("python3")) {
        let nvidia = python.join("site-packages").join("nvidia");
        for package in sorted_children(&nvidia, |_| true) {
            let lib = package.join("lib");
            if lib.is_dir() {
                out.push(lib);
            }
        }
    }
    out
}

fn sorted_children(dir: &Path, keep: impl Fn(&str) -> bool) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(dir)
        .into_iter()
        .flatten()
        .flatten()
        .filter(|e| e.file_name().to_str().is_some_and(&keep))
        .map(|e| e.path())
        .collect();
    out.sort();
    out
}

/// Folders of the ld cache, from `ldconfig -p`'s output (`\tlibx.so.1 (libc6,x86-64) => /path`).
pub fn ld_cache_folders(ldconfig_output: &str) -> Vec<PathBuf> {
    let mut out: Vec<PathBuf> = Vec::new();
    for line in ldconfig_output.lines() {
        let Some((_, path)) = line.rsplit_once("=> ") else {
            continue;
        };
        if let Some(folder) = Path::new(path.trim()).parent()
            && !out.iter().any(|p| p == folder)
        {
            out.push(folder.to_path_buf());
        }
    }
    out
}

/// The ld cache's folders on this machine (empty when `ldconfig` is not there).
fn system_ld_cache() -> Vec<PathBuf> {
    ["/sbin/ldconfig", "/usr/sbin/ldconfig", "ldconfig"]
        .iter()
        .find_map(|cmd| std::process::Command::new(cmd).arg("-p").output().ok())
        .map(|o| ld_cache_folders(&String::from_utf8_lossy(&o.stdout)))
        .unwrap_or_default()
}

/// Debian's multiarch triple for this machine (`x86_64-linux-gnu`).
fn multiarch() -> String {
    format!("{}-linux-gnu", std::env::consts::ARCH)
}

/// The folders to search, in order: `LD_LIBRARY_PATH`, the ld cache, `CUDA_HOME`/`CUDA_PATH`,
/// `/usr/local/cuda*`, the Python environment's NVIDIA wheels (`VIRTUAL_ENV`, `CONDA_PREFIX`, the
/// `python3` on `PATH`, the user site), Debian's multiarch folder and `/usr/lib64`. `root` is `/` except in tests; `stubs`
/// folders are never searched; only folders that exist are kept.
pub fn search_places(
    env: &dyn Fn(&str) -> Option<OsString>,
    ld_cache: &[PathBuf],
    root: &Path,
) -> Vec<PathBuf> {
    let under_root = |p: &str| root.join(p.trim_start_matches('/'));
    let mut places: Vec<PathBuf> = Vec::new();
    if let Some(paths) = env("LD_LIBRARY_PATH") {
        places.extend(std::env::split_paths(&paths).filter(|p| !p.as_os_str().is_empty()));
    }
    places.extend(ld_cache.iter().cloned());
    let toolkit_libs = |prefix: &Path| {
        [
            prefix.join("lib64"),
            prefix.join("lib"),
            prefix
                .join("targets")
                .join(format!("{}-linux", std::env::consts::ARCH))
                .join("lib"),
        ]
    };
    for var in ["CUDA_HOME", "CUDA_PATH"] {
        if let Some(prefix) = env(var) {
            places.extend(toolkit_libs(Path::new(&prefix)));
        }
    }
    let local = under_root("/usr/local");
    let mut toolkits = sorted_children(&local, |n| n.starts_with("cuda"));
    // `cuda` (the symlink to the chosen toolkit) first, then the newest version.
    toolkits.sort_by_key(|p| {
        let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
        (name.as_deref() != Some("cuda"), std::cmp::Reverse(name))
    });
    for toolkit in toolkits {
        places.extend(toolkit_libs(&toolkit));
    }
    for var in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(prefix) = env(var) {
            let prefix = PathBuf::from(prefix);
            places.extend(wheel_folders(&prefix));
            if var == "CONDA_PREFIX" {
                places.push(prefix.join("lib"));
            }
        }
    }
    // A Python environment used without `activate` (or a container image that only puts its
    // venv's `bin` on PATH) sets no VIRTUAL_ENV: the `python3` on PATH names it instead.
    if let Some(paths) = env("PATH") {
        for bin in std::env::split_paths(&paths) {
            if bin.file_name() == Some(OsStr::new("bin"))
                && bin.join("python3").exists()
                && let Some(prefix) = bin.parent()
            {
                places.extend(wheel_folders(prefix));
            }
        }
    }
    let user_base = env("PYTHONUSERBASE")
        .map(PathBuf::from)
        .or_else(|| env("HOME").map(|h| PathBuf::from(h).join(".local")));
    if let Some(base) = user_base {
        places.extend(wheel_folders(&base));
    }
    let arch = multiarch();
    for folder in [
        format!("/usr/lib/{arch}"),
        format!("/lib/{arch}"),
        "/usr/lib64".into(),
        "/usr/lib".into(),
    ] {
        places.push(under_root(&folder));
    }
    let mut unique: Vec<PathBuf> = Vec::new();
    for place in places {
        if !is_stub_folder(&place) && place.is_dir() && !unique.contains(&place) {
            unique.push(place);
        }
    }
    unique
}

/// Whether a cuDNN folder is usable: every sub-library of [`CUDNN_SUB_LIBRARIES`] is there and
/// opens (by full path). `Err` names what is missing or fails to open.
///
/// # Errors
/// The reason, naming the folder and the sub-libraries.
pub fn cudnn_folder_ready(folder: &Path) -> Result<(), String> {
    let missing: Vec<&str> = CUDNN_SUB_LIBRARIES
        .iter()
        .copied()
        .filter(|name| !folder.join(name).exists())
        .collect();
    if !missing.is_empty() {
        return Err(format!(
            "{} has libcudnn.so.9 but not {}, which cuDNN 9 opens from that folder (it aborts \
             the process when they are missing)",
            folder.display(),
            missing.join(", ")
        ));
    }
    for name in CUDNN_SUB_LIBRARIES {
        open_library(&folder.join(name))
            .map_err(|e| format!("{} cannot be opened: {e}", folder.join(name).display()))?;
    }
    Ok(())
}

/// dlopens `path` and closes it again; `Err` is `dlerror()`'s text.
fn open_library(path: &Path) -> Result<(), String> {
    use std::os::unix::ffi::OsStrExt;
    let c_path = std::ffi::CString::new(path.as_os_str().as_bytes())
        .map_err(|_| "the path holds a NUL byte".to_string())?;
    // SAFETY: `c_path` is NUL-terminated; RTLD_LAZY | RTLD_LOCAL runs the library's constructors
    // but binds nothing into the global namespace; the handle is closed right away.
    unsafe {
        let handle = libc::dlopen(c_path.as_ptr(), libc::RTLD_LAZY | libc::RTLD_LOCAL);
        if handle.is_null() {
            let err = libc::dlerror();
            return Err(if err.is_null() {
                "dlopen failed".into()
            } else {
                std::ffi::CStr::from_ptr(err).to_string_lossy().into_owned()
            });
        }
        libc::dlclose(handle);
    }
    Ok(())
}

/// Searches `places` for every library: for each folder in order, each file name best first. A
/// cuDNN folder counts only when [`cudnn_folder_ready`] says so.
pub fn find_in(places: &[PathBuf]) -> CudaLibraries {
    let mut libs = CudaLibraries {
        searched: places.to_vec(),
        ..Default::default()
    };
    for library in CudaLibrary::ALL {
        'search: for folder in places {
            for name in library.file_names() {
                let path = folder.join(name);
                if !path.exists() {
                    continue;
                }
                if library == CudaLibrary::Cudnn
                    && let Err(problem) = cudnn_folder_ready(folder)
                {
                    libs.cudnn_problem.get_or_insert(problem);
                    continue;
                }
                libs.found.push(Found { library, path });
                break 'search;
            }
        }
    }
    if libs.get(CudaLibrary::Cudnn).is_some() {
        libs.cudnn_problem = None;
    }
    libs
}

/// `CUDA_PATH` for cubecl's NVRTC headers (it compiles with `--include-path=$CUDA_PATH/include`
/// and panics without one): `CUDA_PATH`, else `CUDA_HOME`, else the toolkit of the `nvcc` on
/// `PATH`, else `/usr/local/cuda` (under `root`) when it has headers, else a pip wheel among
/// `places` whose folder holds `include/cuda_fp16.h` (`nvidia/cu13`, `nvidia/cuda_runtime`).
pub fn cuda_path(
    env: &dyn Fn(&str) -> Option<OsString>,
    root: &Path,
    places: &[PathBuf],
) -> Option<PathBuf> {
    if let Some(p) = env("CUDA_PATH").or_else(|| env("CUDA_HOME")) {
        return Some(PathBuf::from(p));
    }
    if let Some(paths) = env("PATH") {
        for dir in std::env::split_paths(&paths) {
            let nvcc = dir.join("nvcc");
            if nvcc.is_file() {
                let real = std::fs::canonicalize(&nvcc).unwrap_or(nvcc);
                // <toolkit>/bin/nvcc
                if let Some(toolkit) = real.parent().and_then(Path::parent) {
                    return Some(toolkit.to_path_buf());
                }
            }
        }
    }
    let default = root.join("usr/local/cuda");
    if default.join("include").is_dir() {
        return Some(default);
    }
    places
        .iter()
        .filter_map(|lib| lib.parent())
        .find(|prefix| prefix.join("include").join("cuda_fp16.h").is_file())
        .map(Path::to_path_buf)
}

/// What [`prepare`] changes: symlinks to make and the environment of the re-executed process.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Plan {
    /// `(link in the private folder, real library)`.
    pub links: Vec<(PathBuf, PathBuf)>,
    /// The new `LD_LIBRARY_PATH`: the private folder, the real folders, then what was there.
    pub ld_library_path: OsString,
    /// `CUDA_PATH` to set, when it was unset.
    pub cuda_path: Option<PathBuf>,
}

/// The symlinks and `LD_LIBRARY_PATH` that make cudarc load `libs`: a library whose file name is
/// not one cudarc tries gets a link named `lib{stem}.so`; the driver always does, so that a stub
/// `libcuda.so` further down the path never wins.
pub fn plan(
    libs: &CudaLibraries,
    link_dir: &Path,
    current_ld_path: Option<&OsStr>,
    cuda_path_unset: Option<PathBuf>,
) -> Plan {
    let mut links = Vec::new();
    let mut folders: Vec<PathBuf> = vec![link_dir.to_path_buf()];
    for found in &libs.found {
        let stem = found.library.cudarc_stem();
        let file = found.path.file_name().and_then(OsStr::to_str).unwrap_or("");
        let tried = cudarc_names(stem);
        if found.library == CudaLibrary::Driver || !tried.iter().any(|t| t == file) {
            links.push((link_dir.join(format!("lib{stem}.so")), found.path.clone()));
        }
        let folder = found.folder().to_path_buf();
        if !folders.contains(&folder) {
            folders.push(folder);
        }
    }
    let existing: Vec<PathBuf> = current_ld_path
        .map(|p| std::env::split_paths(p).collect())
        .unwrap_or_default();
    for p in existing {
        if !p.as_os_str().is_empty() && !folders.contains(&p) {
            folders.push(p);
        }
    }
    Plan {
        links,
        ld_library_path: std::env::join_paths(folders).unwrap_or_default(),
        cuda_path: cuda_path_unset,
    }
}

/// The private folder for this user and these libraries (its name hashes the link targets, so
/// processes with other libraries never share it).
fn link_dir_for(libs: &CudaLibraries) -> PathBuf {
    use std::hash::{Hash, Hasher};
    let mut h = std::collections::hash_map::DefaultHasher::new();
    for f in &libs.found {
        f.path.hash(&mut h);
    }
    // SAFETY: getuid has no failure mode and no preconditions.
    let uid = unsafe { libc::getuid() };
    std::env::temp_dir().join(format!("burn-dist-cuda-libs-{uid}-{:016x}", h.finish()))
}

/// Makes the plan's symlinks (each through a temporary name and a rename, so concurrent
/// processes never see half a folder).
///
/// # Errors
/// The I/O error, with the path.
pub fn make_links(plan: &Plan) -> Result<(), String> {
    for (link, target) in &plan.links {
        let dir = link.parent().unwrap_or(Path::new("/"));
        std::fs::create_dir_all(dir).map_err(|e| format!("creating {}: {e}", dir.display()))?;
        if std::fs::read_link(link).is_ok_and(|t| &t == target) {
            continue;
        }
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.subsec_nanos());
        let tmp = dir.join(format!(".{}.{nanos}", std::process::id()));
        std::os::unix::fs::symlink(target, &tmp)
            .map_err(|e| format!("linking {}: {e}", tmp.display()))?;
        std::fs::rename(&tmp, link).map_err(|e| format!("renaming to {}: {e}", link.display()))?;
    }
    Ok(())
}

/// Finds the CUDA libraries in this process's environment.
pub fn find() -> CudaLibraries {
    let env = |k: &str| std::env::var_os(k);
    let root = Path::new("/");
    let link_dir = std::env::var_os(READY_ENV).map(PathBuf::from);
    let mut places = search_places(&env, &system_ld_cache(), root);
    // Our own links (first on LD_LIBRARY_PATH after the re-exec) are not where a library is.
    places.retain(|p| Some(p) != link_dir.as_ref());
    let mut libs = find_in(&places);
    libs.cuda_path = cuda_path(&env, root, &places);
    libs.link_dir = link_dir;
    libs
}

/// Finds the CUDA libraries and, unless done already, re-executes this program once with them
/// arranged for cudarc (see the module docs). Call first in `main`, before any CUDA call and
/// before starting threads. Returns what was found; nothing found is not an error here (a CPU run
/// needs none): ask [`CudaLibraries::require`] for what the run needs.
///
/// Does nothing when `BURN_DIST_NO_CUDA_LIBS=1`, or after the re-exec ([`READY_ENV`] is set).
pub fn prepare() -> CudaLibraries {
    let mut libs = find();
    if std::env::var_os(READY_ENV).is_some()
        || std::env::var("BURN_DIST_NO_CUDA_LIBS").is_ok_and(|v| v == "1")
        || libs.found.is_empty()
    {
        return libs;
    }
    let link_dir = link_dir_for(&libs);
    let unset_cuda_path = if std::env::var_os("CUDA_PATH").is_none() {
        libs.cuda_path.clone()
    } else {
        None
    };
    let plan = plan(
        &libs,
        &link_dir,
        std::env::var_os("LD_LIBRARY_PATH").as_deref(),
        unset_cuda_path,
    );
    if let Err(e) = make_links(&plan) {
        eprintln!("burn-dist: could not arrange the CUDA libraries ({e}); loading them by name");
        return libs;
    }
    let exe = match std::env::current_exe() {
        Ok(exe) => exe,
        Err(e) => {
            eprintln!("burn-dist: cannot re-execute to load the CUDA libraries ({e})");
            return libs;
        }
    };
    use std::os::unix::process::CommandExt;
    let mut args = std::env::args_os();
    let mut cmd = std::process::Command::new(&exe);
    if let Some(argv0) = args.next() {
        cmd.arg0(argv0);
    }
    cmd.args(args)
        .env("LD_LIBRARY_PATH", &plan.ld_library_path)
        .env(READY_ENV, &link_dir);
    if let Some(p) = &plan.cuda_path {
        cmd.env("CUDA_PATH", p);
    }
    let error = cmd.exec();
    eprintln!(
        "burn-dist: re-executing {} to load the CUDA libraries failed ({error}); loading them by name",
        exe.display()
    );
    libs.link_dir = Some(link_dir);
    libs
}
