//! The few raw NCCL calls that cudarc's safe layer does not cover, with readable errors.

use cudarc::nccl::sys as nsys;
use std::ffi::CStr;

/// `NCCL_CONFIG_UNDEF_INT`: "let NCCL decide".
const UNDEF_INT: i32 = i32::MIN;
/// `NCCL_API_MAGIC`, which `NCCL_CONFIG_INITIALIZER` writes.
const MAGIC: u32 = 0xcafe_beef;
/// The NCCL version whose `ncclConfig_t` layout cudarc's bindings describe (2.28 layout, with the
/// 2.30 field). NCCL copies `min(size, its own sizeof)` bytes and ignores fields it does not know,
/// so an older library reads this struct correctly.
const CONFIG_VERSION: u32 = 2 * 10_000 + 30 * 100;

/// `NCCL_CONFIG_INITIALIZER` with `blocking = 0`: every call returns at once (maybe with
/// `ncclInProgress`) and we poll `ncclCommGetAsyncError`, so a peer that never arrives cannot
/// block this thread past our deadline.
pub(super) fn nonblocking_config() -> nsys::ncclConfig_t {
    nsys::ncclConfig_t {
        size: std::mem::size_of::<nsys::ncclConfig_t>(),
        magic: MAGIC,
        version: CONFIG_VERSION,
        blocking: 0,
        cgaClusterSize: UNDEF_INT,
        minCTAs: UNDEF_INT,
        maxCTAs: UNDEF_INT,
        netName: std::ptr::null(),
        splitShare: UNDEF_INT,
        trafficClass: UNDEF_INT,
        commName: std::ptr::null(),
        collnetEnable: UNDEF_INT,
        CTAPolicy: UNDEF_INT,
        shrinkShare: UNDEF_INT,
        nvlsCTAs: UNDEF_INT,
        nChannelsPerNetPeer: UNDEF_INT,
        nvlinkCentricSched: UNDEF_INT,
        graphUsageMode: UNDEF_INT,
        numRmaCtx: UNDEF_INT,
        maxP2pPeers: UNDEF_INT,
    }
}

/// The loaded library's version, e.g. `2.21.5`, for error messages.
pub(super) fn version() -> String {
    match cudarc::nccl::result::get_nccl_version() {
        // NCCL_VERSION(X,Y,Z) = X*10000 + Y*100 + Z since 2.9.
        Ok(v) => format!("{}.{}.{}", v / 10_000, (v / 100) % 100, v % 100),
        Err(e) => format!("unknown ({:?})", e.0),
    }
}

/// `ncclFoo: ncclRemoteError (remote process exited or there was a network error): <last error>`.
/// `comm` may be null (before a communicator exists).
pub(super) fn describe(result: nsys::ncclResult_t, comm: nsys::ncclComm_t) -> String {
    // SAFETY: both functions return pointers to static (or per-communicator, still live)
    // NUL-terminated strings, or null; `comm` is null or a live communicator of this thread.
    let (text, last) = unsafe {
        let text = nsys::ncclGetErrorString(result);
        let last = nsys::ncclGetLastError(comm);
        (c_string(text), c_string(last))
    };
    match (text, last) {
        (Some(t), Some(l)) if !l.is_empty() => format!("{result:?} ({t}): {l}"),
        (Some(t), _) => format!("{result:?} ({t})"),
        _ => format!("{result:?}"),
    }
}

/// # Safety
/// `ptr` is null or a valid NUL-terminated string.
unsafe fn c_string(ptr: *const std::ffi::c_char) -> Option<String> {
    if ptr.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated by the caller's contract.
    Some(
        unsafe { CStr::from_ptr(ptr) }
            .to_string_lossy()
            .into_owned(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn config_is_nccls_initializer_with_blocking_off() {
        let c = nonblocking_config();
        assert_eq!(c.size, std::mem::size_of::<nsys::ncclConfig_t>());
        assert_eq!(c.magic, 0xcafebeef);
        assert_eq!(c.blocking, 0);
        assert_eq!(c.minCTAs, i32::MIN);
        assert!(c.netName.is_null());
    }
}
