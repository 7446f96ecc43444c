//! Process-wide settings of Burn's CUDA backend, made once before the first CUDA operation.

use std::path::PathBuf;

/// `~/.cache/burn-horovod` (or `$XDG_CACHE_HOME/burn-horovod`): the quickstart's dataset and the
/// CUDA autotune results live here.
pub fn cache_root() -> PathBuf {
    std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))
        .unwrap_or_else(std::env::temp_dir)
        .join("burn-horovod")
}

/// Set to `0` to run Burn's CUDA backend without fusion (one kernel per op): for comparison, or to
/// step around a fusion bug.
pub const FUSION_ENV: &str = "BURN_HOROVOD_FUSION";

/// Whether CUDA runs with Burn's fusion (the default), per [`FUSION_ENV`].
pub fn fusion_enabled() -> bool {
    std::env::var(FUSION_ENV).map_or(true, |v| v.trim() != "0")
}

/// Where CubeCL keeps autotune results when no `cubecl.toml` says otherwise.
pub fn autotune_cache_dir() -> PathBuf {
    cache_root().join("cubecl")
}

/// Keeps Burn's CUDA autotune results and compiled kernels (PTX) between runs in
/// [`autotune_cache_dir`], so the kernel search (seconds per convolution shape) and the NVRTC
/// compilation of every kernel happen once per machine, not once per process. CubeCL keeps no
/// compiled kernels unless told to (`compilation.cache` is unset by default).
///
/// CubeCL's own default is the `target/` folder of the Cargo project around the working
/// directory, which a launched binary often does not have. A `cubecl.toml` (or `burn.toml` with a
/// `[cubecl]` section) in the working directory or above still wins, as do CubeCL's `CUBECL_*`
/// environment variables. Call before the first CUDA operation; later calls do nothing.
#[cfg(feature = "cuda")]
pub fn keep_autotune_results() {
    use cubecl::config::cache::CacheConfig;
    use cubecl::config::{CubeClRuntimeConfig, RuntimeConfig};
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let mut config = CubeClRuntimeConfig::from_current_dir();
        // `Target` is the default: nobody chose it, so put the cache where it survives.
        if matches!(config.autotune.cache, CacheConfig::Target) {
            config.autotune.cache = CacheConfig::File(autotune_cache_dir());
        }
        if config.compilation.cache.is_none() {
            config.compilation.cache = Some(CacheConfig::File(autotune_cache_dir()));
        }
        let config = config.override_from_env();
        // `set` panics if CubeCL already read its configuration (a CUDA op ran first); then the
        // configuration in force stays, which is only a missed cache, not an error.
        let _ = std::panic::catch_unwind(move || CubeClRuntimeConfig::set(config));
    });
}

/// Without CUDA there is nothing to keep.
#[cfg(not(feature = "cuda"))]
pub fn keep_autotune_results() {}
