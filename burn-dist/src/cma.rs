//! Cross-memory attach (`process_vm_readv`): ranks on the same machine read each other's buffers
//! directly, one copy, no kernel network stack. Used by the host backend for large all-reduces
//! when every rank runs on one machine and a probe at start-up succeeds (else it stays on TCP).

use std::io;

/// Lets any process of this user read our memory with `process_vm_readv` (Yama's
/// `ptrace_scope = 1` otherwise restricts it to ancestors). Best effort.
pub(crate) fn allow_peer_reads() {
    // SAFETY: prctl with PR_SET_PTRACER only changes this process's Yama attribute; all arguments
    // are plain integers.
    unsafe {
        libc::prctl(libc::PR_SET_PTRACER, libc::PR_SET_PTRACER_ANY, 0, 0, 0);
    }
}

/// This machine's boot id (same on every process of one machine, across containers too).
pub(crate) fn machine_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

/// Copies `dst.len()` bytes at address `remote` of process `pid` into `dst`.
pub(crate) fn read_remote(pid: i32, remote: usize, dst: &mut [u8]) -> io::Result<()> {
    let mut done = 0;
    while done < dst.len() {
        let local = libc::iovec {
            iov_base: dst[done..].as_mut_ptr().cast(),
            iov_len: dst.len() - done,
        };
        let remote_iov = libc::iovec {
            iov_base: (remote + done) as *mut libc::c_void,
            iov_len: dst.len() - done,
        };
        // SAFETY: `local` describes the live, exclusively borrowed tail of `dst`; the remote iovec
        // is only interpreted by the kernel in the other process's address space (a bad address
        // yields EFAULT, not undefined behaviour here).
        let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote_iov, 1, 0) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            return Err(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                "process_vm_readv copied nothing",
            ));
        }
        done += n as usize;
    }
    Ok(())
}
