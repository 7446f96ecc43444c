//! glibc's allocator, set up for a training step.
//!
//! A step allocates and frees the same few hundred activation, gradient and scratch buffers,
//! from kilobytes to tens of megabytes. glibc's defaults serve every block over its mmap
//! threshold with fresh pages from the kernel, and hand freed memory at the top of the heap back
//! to the kernel. That threshold starts at 128 KiB and only rises as blocks are freed. So each
//! step faults its buffers in again, and the kernel zeroes every page: ResNet-50 at 224 px,
//! batch 8, took 830 k minor faults and 2.3 s of system time for 7 steps. Raising the mmap
//! threshold to its maximum (32 MiB), keeping up to 1 GiB of freed memory, and growing the heap
//! in 256 MiB steps lets later steps reuse the pages. `benches/RESULTS.md` has the measurement.
//!
//! A user who sets glibc's malloc tunables (`GLIBC_TUNABLES=glibc.malloc...` or the older
//! `MALLOC_*` variables) keeps them. Other C libraries and systems: nothing changes.

use std::ffi::OsString;

/// Largest mmap threshold glibc accepts on 64-bit systems (`DEFAULT_MMAP_THRESHOLD_MAX`).
const MMAP_THRESHOLD: i32 = 32 << 20;
/// Freed memory kept at the top of the heap before glibc returns it.
const TRIM_THRESHOLD: i32 = 1 << 30;
/// Extra heap requested each time the heap grows.
const TOP_PAD: i32 = 256 << 20;

/// Whether `vars` (the environment) configure glibc's allocator.
fn sets_malloc_tunables(vars: impl IntoIterator<Item = (OsString, OsString)>) -> bool {
    vars.into_iter().any(|(name, value)| {
        let name = name.to_string_lossy();
        name.starts_with("MALLOC_")
            || (name == "GLIBC_TUNABLES" && value.to_string_lossy().contains("glibc.malloc."))
    })
}

/// Sets glibc's allocator up for training (see the module docs), unless the user set its
/// tunables. Returns whether it changed anything. Call once, early in `main`.
pub fn keep_freed_memory() -> bool {
    !sets_malloc_tunables(std::env::vars_os()) && apply()
}

/// The three settings; whether glibc took them all (false elsewhere).
fn apply() -> bool {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        // SAFETY: mallopt only sets allocator parameters, to values in glibc's 64-bit range.
        unsafe {
            libc::mallopt(libc::M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
                && libc::mallopt(libc::M_TRIM_THRESHOLD, TRIM_THRESHOLD) == 1
                && libc::mallopt(libc::M_TOP_PAD, TOP_PAD) == 1
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    {
        false
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    #[test]
    fn glibc_takes_every_setting() {
        // mallopt returns 0 for a value out of range (an mmap threshold over 32 MiB).
        assert!(apply(), "glibc refused a setting");
    }

    #[test]
    fn the_users_malloc_settings_win() {
        let env = |pairs: &[(&str, &str)]| -> Vec<(OsString, OsString)> {
            pairs.iter().map(|(k, v)| (k.into(), v.into())).collect()
        };
        assert!(sets_malloc_tunables(env(&[("MALLOC_ARENA_MAX", "2")])));
        assert!(sets_malloc_tunables(env(&[(
            "MALLOC_TRIM_THRESHOLD_",
            "0"
        )])));
        assert!(sets_malloc_tunables(env(&[(
            "GLIBC_TUNABLES",
            "glibc.malloc.trim_threshold=0"
        )])));
        assert!(!sets_malloc_tunables(env(&[(
            "GLIBC_TUNABLES",
            "glibc.cpu.hwcaps=-AVX512F"
        )])));
        assert!(!sets_malloc_tunables(env(&[
            ("MALLOC", "x"),
            ("PATH", "/bin")
        ])));
    }
}
