use super::*;
use std::collections::HashMap;

/// An environment made of `pairs` only.
fn env_of(pairs: &[(&str, &Path)]) -> impl Fn(&str) -> Option<OsString> + use<> {
    let map: HashMap<String, OsString> = pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.as_os_str().to_owned()))
        .collect();
    move |k| map.get(k).cloned()
}

/// An empty file at `root/rel` (folders made).
fn touch(root: &Path, rel: &str) -> PathBuf {
    let path = root.join(rel);
    std::fs::create_dir_all(path.parent().expect("parent")).expect("mkdir");
    std::fs::write(&path, b"").expect("write");
    path
}

fn arch_dir() -> String {
    format!("usr/lib/{}-linux-gnu", std::env::consts::ARCH)
}

#[test]
fn library_names_are_the_ones_distributions_and_wheels_ship() {
    assert_eq!(CudaLibrary::Driver.file_names(), ["libcuda.so.1"]);
    assert_eq!(
        CudaLibrary::Nvrtc.file_names(),
        ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so.11.2"]
    );
    assert_eq!(
        CudaLibrary::Nccl.file_names(),
        ["libnccl.so.2", "libnccl.so"]
    );
    assert_eq!(CudaLibrary::Cudnn.file_names(), ["libcudnn.so.9"]);
    assert_eq!(
        CUDNN_SUB_LIBRARIES,
        [
            "libcudnn_graph.so.9",
            "libcudnn_ops.so.9",
            "libcudnn_cnn.so.9",
            "libcudnn_heuristic.so.9",
            "libcudnn_engines_precompiled.so.9",
            "libcudnn_engines_runtime_compiled.so.9",
        ]
    );
    let stems: Vec<&str> = CudaLibrary::ALL.iter().map(|l| l.cudarc_stem()).collect();
    assert_eq!(stems, ["cuda", "nvrtc", "nccl", "cudnn"]);
    assert!(CudaLibrary::Nccl.package().contains("nvidia-nccl-cu12"));
    assert!(CudaLibrary::Cudnn.package().contains("nvidia-cudnn-cu12"));
    assert_eq!(
        cudarc_names("nccl"),
        [
            "libnccl.so",
            "libnccl.so.12",
            "libnccl.so.11",
            "libnccl.so.10",
            "libnccl.so.9",
            "libnccl.so.1"
        ]
    );
}

/// Our copy of cudarc's names is cudarc's own list (Linux names), and that list lacks the names
/// the libraries really have: the reason for the links.
#[cfg(feature = "cuda")]
#[test]
fn cudarc_names_match_cudarc_and_miss_the_real_sonames() {
    for stem in ["cuda", "nvrtc", "nccl", "cudnn"] {
        let theirs = cudarc::get_lib_name_candidates(stem);
        let linux: Vec<&String> = theirs.iter().filter(|n| !n.contains("64")).collect();
        let mut ours = cudarc_names(stem);
        ours.dedup();
        let mut linux_unique: Vec<String> = Vec::new();
        for n in linux {
            if !linux_unique.contains(n) {
                linux_unique.push(n.clone());
            }
        }
        assert_eq!(ours, linux_unique, "{stem}");
    }
    let nccl = cudarc::get_lib_name_candidates("nccl");
    assert!(!nccl.iter().any(|n| n == "libnccl.so.2"));
    let nvrtc = cudarc::get_lib_name_candidates("nvrtc");
    assert!(!nvrtc.iter().any(|n| n == "libnvrtc.so.13"));
    let cuda = cudarc::get_lib_name_candidates("cuda");
    let stub_first = cuda.iter().position(|n| n == "libcuda.so");
    let driver = cuda.iter().position(|n| n == "libcuda.so.1");
    assert!(stub_first < driver, "cudarc tries libcuda.so first");
}

/// A machine as users have it: a toolkit with its stub, NVRTC in the toolkit, NCCL from a pip
/// wheel in the active venv, the driver in Debian's multiarch folder.
#[test]
fn finds_each_library_where_it_is_installed_and_never_the_stub() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    touch(root, "usr/local/cuda-12.4/lib64/stubs/libcuda.so");
    touch(root, "usr/local/cuda-12.4/lib64/stubs/libcuda.so.1");
    let nvrtc = touch(root, "usr/local/cuda-12.4/lib64/libnvrtc.so.12");
    let venv = root.join("venv");
    let nccl = touch(
        root,
        "venv/lib/python3.11/site-packages/nvidia/nccl/lib/libnccl.so.2",
    );
    let driver = touch(root, &format!("{}/libcuda.so.1", arch_dir()));
    let stubs = root.join("usr/local/cuda-12.4/lib64/stubs");
    let env = env_of(&[("VIRTUAL_ENV", &venv), ("LD_LIBRARY_PATH", &stubs)]);
    let places = search_places(&env, &[], root);
    assert!(
        !places.iter().any(|p| p.ends_with("stubs")),
        "stubs never searched: {places:?}"
    );
    let toolkit = places
        .iter()
        .position(|p| p.ends_with("cuda-12.4/lib64"))
        .expect("toolkit searched");
    let wheel = places
        .iter()
        .position(|p| p.ends_with("nvidia/nccl/lib"))
        .expect("wheel searched");
    let multiarch = places
        .iter()
        .position(|p| p.ends_with(arch_dir()))
        .expect("multiarch searched");
    assert!(toolkit < wheel && wheel < multiarch, "{places:?}");

    let libs = find_in(&places);
    assert_eq!(
        libs.get(CudaLibrary::Driver).map(|f| &f.path),
        Some(&driver)
    );
    assert_eq!(libs.get(CudaLibrary::Nvrtc).map(|f| &f.path), Some(&nvrtc));
    assert_eq!(libs.get(CudaLibrary::Nccl).map(|f| &f.path), Some(&nccl));
    assert!(libs.get(CudaLibrary::Cudnn).is_none());
    let line = libs.summary();
    assert!(!line.contains('\n'));
    assert!(
        line.contains("NCCL ") && line.contains("libnccl.so.2"),
        "{line}"
    );
    assert!(line.contains("cuDNN not found"), "{line}");

    // The links cudarc needs: the driver always (a stub libcuda.so must never win), NCCL (cudarc
    // never tries .so.2); NVRTC .so.12 is one of cudarc's names, so its folder is enough.
    let link_dir = root.join("links");
    let plan = plan(&libs, &link_dir, Some(stubs.as_os_str()), None);
    assert_eq!(
        plan.links,
        vec![
            (link_dir.join("libcuda.so"), driver.clone()),
            (link_dir.join("libnccl.so"), nccl.clone()),
        ]
    );
    let path: Vec<PathBuf> = std::env::split_paths(&plan.ld_library_path).collect();
    assert_eq!(path[0], link_dir, "the links come first");
    assert!(path.contains(&nccl.parent().expect("folder").to_path_buf()));
    assert_eq!(path.last(), Some(&stubs), "what was there stays, last");
    make_links(&plan).expect("links");
    make_links(&plan).expect("again: nothing to do");
    assert_eq!(
        std::fs::read_link(link_dir.join("libnccl.so")).expect("link"),
        nccl
    );
}

#[test]
fn ld_library_path_and_the_ld_cache_come_first() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    let mine = touch(root, "mine/libnccl.so.2");
    let cached = touch(root, "cached/libnccl.so.2");
    touch(root, &format!("{}/libnccl.so.2", arch_dir()));
    let ldconfig = format!(
        "2 libs found in cache `/etc/ld.so.cache'\n\tlibnccl.so.2 (libc6,x86-64) => {}\n\
         \tlibz.so.1 (libc6,x86-64) => {}\n",
        cached.display(),
        cached.display()
    );
    let cache = ld_cache_folders(&ldconfig);
    assert_eq!(cache, vec![root.join("cached")]);
    let env = env_of(&[("LD_LIBRARY_PATH", &root.join("mine"))]);
    let libs = find_in(&search_places(&env, &cache, root));
    assert_eq!(libs.get(CudaLibrary::Nccl).map(|f| &f.path), Some(&mine));
    let none = env_of(&[]);
    let libs = find_in(&search_places(&none, &cache, root));
    assert_eq!(libs.get(CudaLibrary::Nccl).map(|f| &f.path), Some(&cached));
}

#[test]
fn conda_and_the_user_site_are_searched() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    let conda_lib = touch(root, "conda/lib/libnccl.so.2");
    let user = touch(
        root,
        "home/.local/lib/python3.12/site-packages/nvidia/cuda_nvrtc/lib/libnvrtc.so.13",
    );
    let env = env_of(&[
        ("CONDA_PREFIX", &root.join("conda")),
        ("HOME", &root.join("home")),
    ]);
    let libs = find_in(&search_places(&env, &[], root));
    assert_eq!(
        libs.get(CudaLibrary::Nccl).map(|f| &f.path),
        Some(&conda_lib)
    );
    assert_eq!(libs.get(CudaLibrary::Nvrtc).map(|f| &f.path), Some(&user));
    let plan = plan(&libs, &root.join("links"), None, None);
    assert!(
        plan.links
            .contains(&(root.join("links/libnvrtc.so"), user.clone())),
        "cudarc never tries .so.13: {:?}",
        plan.links
    );
}

/// cuDNN 9's shim without its sub-libraries aborts the process in `cudnnCreate`: such a folder
/// is not "found", and the error says why.
#[test]
fn the_python_on_path_is_searched_without_virtual_env() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    touch(root, "opt/torch/.venv/bin/python3");
    let nccl = touch(
        root,
        "opt/torch/.venv/lib/python3.12/site-packages/nvidia/nccl/lib/libnccl.so.2",
    );
    // CUDA 13's wheels put NVRTC under nvidia/cu13/lib.
    let nvrtc = touch(
        root,
        "opt/torch/.venv/lib/python3.12/site-packages/nvidia/cu13/lib/libnvrtc.so.13",
    );
    // A bin folder without python3 is not a Python environment.
    touch(root, "tools/bin/tool");
    touch(
        root,
        "tools/lib/python3.12/site-packages/nvidia/cudnn/lib/libcudnn.so.9",
    );
    let path = std::env::join_paths([root.join("tools/bin"), root.join("opt/torch/.venv/bin")])
        .expect("PATH");
    let env = env_of(&[("PATH", Path::new(&path))]);
    let libs = find_in(&search_places(&env, &[], root));
    assert_eq!(libs.get(CudaLibrary::Nccl).map(|f| &f.path), Some(&nccl));
    assert_eq!(libs.get(CudaLibrary::Nvrtc).map(|f| &f.path), Some(&nvrtc));
    assert!(libs.get(CudaLibrary::Cudnn).is_none());
}

#[test]
fn a_cudnn_folder_without_its_sub_libraries_is_not_ready() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    touch(root, "shim-only/libcudnn.so.9");
    touch(root, "shim-only/libcudnn_graph.so.9");
    let reason = cudnn_folder_ready(&root.join("shim-only")).expect_err("sub-libraries missing");
    assert!(reason.contains("libcudnn_cnn.so.9"), "{reason}");
    assert!(reason.contains("libcudnn_ops.so.9"), "{reason}");
    assert!(
        !reason.contains("libcudnn_graph.so.9,"),
        "graph is there: {reason}"
    );

    let env = env_of(&[("LD_LIBRARY_PATH", &root.join("shim-only"))]);
    let libs = find_in(&search_places(&env, &[], root));
    assert!(libs.get(CudaLibrary::Cudnn).is_none());
    let error = libs
        .require(CudaLibrary::Cudnn)
        .expect_err("not usable")
        .to_string();
    for needle in [
        "cuDNN",
        "libcudnn.so.9",
        "shim-only",
        "libcudnn_cnn.so.9",
        "nvidia-cudnn-cu12",
        "LD_LIBRARY_PATH",
    ] {
        assert!(error.contains(needle), "{needle:?} missing from: {error}");
    }

    // Every file there, but not libraries: they must open, not only exist.
    for name in CUDNN_SUB_LIBRARIES {
        touch(root, &format!("fake/{name}"));
    }
    let reason = cudnn_folder_ready(&root.join("fake")).expect_err("empty files do not open");
    assert!(reason.contains("cannot be opened"), "{reason}");
}

#[test]
fn a_missing_library_names_where_it_was_looked_for_and_the_package() {
    let root = tempfile::tempdir().expect("tempdir");
    let env = env_of(&[]);
    let libs = find_in(&search_places(&env, &[], root.path()));
    let error = libs
        .require(CudaLibrary::Nccl)
        .expect_err("nothing here")
        .to_string();
    for needle in ["NCCL", "libnccl.so.2", "nvidia-nccl-cu12", "libnccl2"] {
        assert!(error.contains(needle), "{needle:?} missing from: {error}");
    }
}

#[test]
fn cuda_path_comes_from_the_environment_then_nvcc_then_usr_local() {
    let root = tempfile::tempdir().expect("tempdir");
    let root = root.path();
    let home = root.join("cuda-home");
    assert_eq!(
        cuda_path(&env_of(&[("CUDA_HOME", &home)]), root, &[]),
        Some(home.clone())
    );
    let nvcc = touch(root, "opt/cuda-13.0/bin/nvcc");
    let bin = nvcc.parent().expect("bin").to_path_buf();
    assert_eq!(
        cuda_path(&env_of(&[("PATH", &bin)]), root, &[]),
        Some(root.join("opt/cuda-13.0"))
    );
    assert_eq!(cuda_path(&env_of(&[]), root, &[]), None);
    // CUDA 13 wheels: nvidia/cu13/{lib,include}.
    touch(root, "venv/nvidia/cu13/include/cuda_fp16.h");
    let wheel_lib = root.join("venv/nvidia/cu13/lib");
    std::fs::create_dir_all(&wheel_lib).expect("mkdir");
    assert_eq!(
        cuda_path(
            &env_of(&[]),
            root,
            &[root.join("venv/nvidia/nccl/lib"), wheel_lib]
        ),
        Some(root.join("venv/nvidia/cu13"))
    );
    std::fs::create_dir_all(root.join("usr/local/cuda/include")).expect("mkdir");
    assert_eq!(
        cuda_path(&env_of(&[]), root, &[]),
        Some(root.join("usr/local/cuda"))
    );
}

/// The real NVIDIA wheels, when a Python environment with them is active (`VIRTUAL_ENV`, e.g.
/// after `pip install nvidia-nccl-cu12 nvidia-cudnn-cu12`): NCCL and cuDNN are found, cuDNN's
/// sub-libraries really open, and a folder holding only a link to the real shim is refused.
#[test]
#[ignore = "needs VIRTUAL_ENV naming a venv with NVIDIA's wheels (pip install nvidia-nccl-cu12 nvidia-cudnn-cu12)"]
fn real_pip_wheels_are_found_and_ready() {
    let venv = std::env::var_os("VIRTUAL_ENV")
        .map(PathBuf::from)
        .expect("VIRTUAL_ENV names a venv with NVIDIA's wheels");
    let env = env_of(&[("VIRTUAL_ENV", &venv)]);
    let empty = tempfile::tempdir().expect("tempdir");
    let libs = find_in(&search_places(&env, &[], empty.path()));
    let nccl = libs
        .get(CudaLibrary::Nccl)
        .unwrap_or_else(|| panic!("no nvidia-nccl wheel in {}", venv.display()));
    assert!(
        nccl.path.ends_with("nvidia/nccl/lib/libnccl.so.2"),
        "{nccl:?}"
    );
    if let Some(cudnn) = libs.get(CudaLibrary::Cudnn) {
        cudnn_folder_ready(cudnn.folder()).expect("the wheel's sub-libraries open");
        let lonely = empty.path().join("lonely");
        std::fs::create_dir_all(&lonely).expect("mkdir");
        std::os::unix::fs::symlink(&cudnn.path, lonely.join("libcudnn.so.9")).expect("link");
        assert!(cudnn_folder_ready(&lonely).is_err());
    }
}
