//! Same-machine shared memory for the host backend's large all-reduces, as NCCL's and Open MPI's
//! shared-memory transports do: no ptrace permission, no kernel network stack.
//!
//! Every rank creates one segment (`/dev/shm`, mode 0600, a name drawn by rank 0 and passed
//! through the authenticated store), maps every peer's, and unlinks its own once all are mapped,
//! so nothing is left behind even if the job is killed. A segment holds a small header (barrier
//! counter, the current collective's sequence number and length) and two staging slots used in
//! turn. One slot-sized chunk of an all-reduce on rank `r`, with the chunk cut into one part per
//! rank:
//!
//! 1. copy the parts the others will reduce into this rank's slot;
//! 2. barrier (and check that every rank runs the same collective of the same length);
//! 3. reduce part `r` in the local buffer, reading part `r` from every peer's slot, and publish
//!    the result in this rank's slot;
//! 4. barrier;
//! 5. copy every other part's result from its owner's slot.
//!
//! Alternating two slots makes step 1 of chunk `k + 2` safe without a third barrier: every peer
//! finished step 5 of chunk `k` before it reached step 4 of chunk `k + 1`.

use crate::comm::{Element, ReduceOp};
use memmap2::MmapMut;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of one staging slot (a chunk of the user's buffer moves through it).
pub(crate) const SLOT_BYTES: usize = 4 << 20;
/// Header bytes before the slots (one cache line).
const HEADER: usize = 64;
/// Header field offsets (each an `AtomicU64`).
const ARRIVED: usize = 0;
const SEQ: usize = 8;
const LEN: usize = 16;
/// A segment's size: header and two slots (8 MiB + 64 B per local rank).
pub(crate) const SEGMENT_BYTES: usize = HEADER + 2 * SLOT_BYTES;
/// How often a waiting rank checks that the peers it waits for still exist.
const LIVENESS_EVERY: Duration = Duration::from_millis(20);

/// Where segments live; `/dev/shm` is what `shm_open` uses on Linux.
fn segment_path(name: &str, rank: usize) -> PathBuf {
    PathBuf::from(format!("/dev/shm/burn-dist-{name}-{rank}"))
}

/// Why a shared-memory collective failed.
#[derive(Debug)]
pub(crate) enum ShmError {
    /// Peer `rank` did not arrive before the deadline, or its process is gone.
    Peer(usize, io::Error),
    /// Peer `rank` runs another collective (sequence number, length).
    Mismatch {
        /// The peer.
        rank: usize,
        /// Ours.
        ours: (u64, u64),
        /// Theirs.
        theirs: (u64, u64),
    },
}

/// This rank's segment and every peer's, mapped.
pub(crate) struct Segments {
    rank: usize,
    /// Indexed by rank; ours included.
    maps: Vec<MmapMut>,
    pids: Vec<i32>,
    /// Barriers passed so far (the value each rank publishes in its `ARRIVED` field).
    barriers: u64,
    /// Chunks moved so far (selects the slot).
    chunks: u64,
}

impl std::fmt::Debug for Segments {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Segments")
            .field("rank", &self.rank)
            .field("ranks", &self.maps.len())
            .finish()
    }
}

/// Creates this rank's segment `name` (fails if it exists: names are fresh per job).
pub(crate) fn create(name: &str, rank: usize) -> io::Result<MmapMut> {
    let path = segment_path(name, rank);
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(&path)?;
    let sized = reserve(&file).and_then(|()| {
        // SAFETY: the file is ours (created just now, mode 0600) and sized; the mapping is only
        // ever accessed through `Segments`, which treats its contents as plain bytes and atomics.
        unsafe { MmapMut::map_mut(&file) }
    });
    sized.inspect_err(|_| unlink(name, rank))
}

/// Allocates the segment's pages now: a `/dev/shm` too small for it (64 MiB in a default Docker
/// container) is an error here, and the job keeps to TCP, instead of a SIGBUS at the first write.
fn reserve(file: &std::fs::File) -> io::Result<()> {
    use std::os::fd::AsRawFd;
    // SAFETY: `file` owns a valid descriptor for the duration of the call.
    let r = unsafe { libc::posix_fallocate(file.as_raw_fd(), 0, SEGMENT_BYTES as libc::off_t) };
    if r == 0 {
        Ok(())
    } else {
        Err(io::Error::from_raw_os_error(r))
    }
}

/// Maps peer `rank`'s segment `name`.
pub(crate) fn open(name: &str, rank: usize) -> io::Result<MmapMut> {
    let file = OpenOptions::new()
        .read(true)
        .write(true)
        .open(segment_path(name, rank))?;
    let len = file.metadata()?.len();
    if len != SEGMENT_BYTES as u64 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("segment of rank {rank} has {len} bytes, expected {SEGMENT_BYTES}"),
        ));
    }
    // SAFETY: as in `create`; the peer wrote the file with the same layout.
    unsafe { MmapMut::map_mut(&file) }
}

/// Removes this rank's segment name (mappings stay valid until unmapped).
pub(crate) fn unlink(name: &str, rank: usize) {
    let _ = std::fs::remove_file(segment_path(name, rank));
}

fn process_alive(pid: i32) -> bool {
    // SAFETY: signal 0 only checks that the process exists and may be signalled.
    pid <= 0
        || unsafe { libc::kill(pid, 0) } == 0
        || io::Error::last_os_error().raw_os_error() == Some(libc::EPERM)
}

impl Segments {
    /// All ranks' mapped segments (`maps[rank]` is ours) and their process ids.
    pub(crate) fn new(rank: usize, maps: Vec<MmapMut>, pids: Vec<i32>) -> Self {
        Self {
            rank,
            maps,
            pids,
            barriers: 0,
            chunks: 0,
        }
    }

    fn field(&self, rank: usize, offset: usize) -> &AtomicU64 {
        let base = self.maps[rank].as_ptr();
        // SAFETY: the mapping is page-aligned and at least HEADER bytes long, so `offset` (< 64,
        // a multiple of 8) addresses an aligned u64 inside it that every rank accesses only
        // atomically; the reference lives no longer than `&self`, which keeps the map.
        unsafe { &*(base.add(offset).cast::<AtomicU64>()) }
    }

    /// Elements of `T` in rank `q`'s current slot.
    fn slot<T: Element>(&self, q: usize, slot: usize, len: usize) -> &[T] {
        let start = HEADER + slot * SLOT_BYTES;
        bytemuck::cast_slice(&self.maps[q][start..start + len * std::mem::size_of::<T>()])
    }

    fn own_slot<T: Element>(&mut self, slot: usize, len: usize) -> &mut [T] {
        let start = HEADER + slot * SLOT_BYTES;
        let rank = self.rank;
        bytemuck::cast_slice_mut(
            &mut self.maps[rank][start..start + len * std::mem::size_of::<T>()],
        )
    }

    /// Publishes our arrival and waits for every peer's, until `deadline`.
    fn barrier(&mut self, deadline: Instant) -> Result<(), ShmError> {
        self.barriers += 1;
        let target = self.barriers;
        self.field(self.rank, ARRIVED)
            .store(target, Ordering::Release);
        let mut last_check = Instant::now();
        let mut spins = 0u32;
        for q in 0..self.maps.len() {
            while self.field(q, ARRIVED).load(Ordering::Acquire) < target {
                spins += 1;
                if spins < 1000 {
                    std::hint::spin_loop();
                    continue;
                }
                std::thread::yield_now();
                let now = Instant::now();
                if now >= deadline {
                    return Err(ShmError::Peer(
                        q,
                        io::Error::new(
                            io::ErrorKind::TimedOut,
                            "did not reach the shared-memory barrier",
                        ),
                    ));
                }
                if now - last_check >= LIVENESS_EVERY {
                    last_check = now;
                    if !process_alive(self.pids[q]) {
                        return Err(ShmError::Peer(
                            q,
                            io::Error::new(io::ErrorKind::BrokenPipe, "its process is gone"),
                        ));
                    }
                }
            }
        }
        Ok(())
    }

    /// After the first barrier of a collective: every peer published the same sequence number
    /// and length (nobody can overwrite them before we pass the next barrier).
    fn check_same_collective(&self, seq: u64, len: u64) -> Result<(), ShmError> {
        for q in (0..self.maps.len()).filter(|q| *q != self.rank) {
            let theirs = (
                self.field(q, SEQ).load(Ordering::Relaxed),
                self.field(q, LEN).load(Ordering::Relaxed),
            );
            if theirs != (seq, len) {
                return Err(ShmError::Mismatch {
                    rank: q,
                    ours: (seq, len),
                    theirs,
                });
            }
        }
        Ok(())
    }

    /// In-place all-reduce of `data` across the ranks of this machine. `seq` is the collective's
    /// sequence number (identical on every rank), checked together with the length.
    pub(crate) fn all_reduce<T: Element>(
        &mut self,
        data: &mut [T],
        op: ReduceOp,
        seq: u64,
        deadline: Instant,
    ) -> Result<(), ShmError> {
        let n = self.maps.len();
        let rank = self.rank;
        self.field(rank, SEQ).store(seq, Ordering::Relaxed);
        self.field(rank, LEN)
            .store(data.len() as u64, Ordering::Relaxed);
        let per_chunk = (SLOT_BYTES / std::mem::size_of::<T>()).max(1);
        if data.is_empty() {
            // Still meet the peers, so an empty all-reduce on one rank is caught as a mismatch.
            self.barrier(deadline)?;
            return self.check_same_collective(seq, 0);
        }
        let total = data.len() as u64;
        for (index, chunk) in data.chunks_mut(per_chunk).enumerate() {
            let slot = (self.chunks % 2) as usize;
            self.chunks += 1;
            let len = chunk.len();
            let part = |q: usize| crate::comm::ring::collectives::segment(len, n, q);
            // 1. Stage the parts the peers reduce.
            {
                let staged = self.own_slot::<T>(slot, len);
                for q in (0..n).filter(|q| *q != rank) {
                    staged[part(q)].copy_from_slice(&chunk[part(q)]);
                }
            }
            self.barrier(deadline)?;
            if index == 0 {
                self.check_same_collective(seq, total)?;
            }
            // 3. Reduce our part; the others copy the result, so every rank ends bitwise equal.
            let mine = part(rank);
            for k in 1..n {
                let q = (rank + k) % n;
                let peer = &self.slot::<T>(q, slot, len)[mine.clone()];
                T::reduce(op, &mut chunk[mine.clone()], peer);
            }
            if op == ReduceOp::Avg {
                T::divide(&mut chunk[mine.clone()], n);
            }
            self.own_slot::<T>(slot, len)[mine.clone()].copy_from_slice(&chunk[mine.clone()]);
            self.barrier(deadline)?;
            // 5. Collect the other parts from their owners.
            for q in (0..n).filter(|q| *q != rank) {
                chunk[part(q)].copy_from_slice(&self.slot::<T>(q, slot, len)[part(q)]);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn name() -> String {
        format!("test-{}-{:x}", std::process::id(), rand::random::<u64>())
    }

    /// Two "ranks" as two threads of this process, each with its own mapping of both segments.
    #[test]
    fn two_ranks_reduce_and_leave_no_files() {
        let name = name();
        let pid = std::process::id() as i32;
        let own: Vec<MmapMut> = (0..2).map(|r| create(&name, r).expect("create")).collect();
        let mut handles = Vec::new();
        for (r, mine) in own.into_iter().enumerate() {
            let name = name.clone();
            handles.push(std::thread::spawn(move || {
                let peer = open(&name, 1 - r).expect("open");
                let maps = if r == 0 {
                    vec![mine, peer]
                } else {
                    vec![peer, mine]
                };
                let mut seg = Segments::new(r, maps, vec![pid, pid]);
                // Crosses a chunk boundary, odd length.
                let n = SLOT_BYTES / 4 + 1001;
                let mut data: Vec<f32> = (0..n).map(|i| (i % 97) as f32 * (r + 1) as f32).collect();
                let deadline = Instant::now() + Duration::from_secs(20);
                seg.all_reduce(&mut data, ReduceOp::Sum, 1, deadline)
                    .expect("all_reduce");
                let ok = data
                    .iter()
                    .enumerate()
                    .all(|(i, v)| *v == (i % 97) as f32 * 3.0);
                let mut avg = vec![(r * 2) as f64; 5];
                seg.all_reduce(&mut avg, ReduceOp::Avg, 2, deadline)
                    .expect("avg");
                (ok, avg)
            }));
        }
        for h in handles {
            let (ok, avg) = h.join().expect("thread");
            assert!(ok, "sum differs from the reference");
            assert_eq!(avg, vec![1.0; 5]);
        }
        for r in 0..2 {
            unlink(&name, r);
            assert!(!segment_path(&name, r).exists());
        }
    }

    #[test]
    fn a_peer_that_never_arrives_is_named_at_the_deadline() {
        let name = name();
        let mine = create(&name, 0).expect("create");
        let peer = create(&name, 1).expect("create");
        unlink(&name, 0);
        unlink(&name, 1);
        let pid = std::process::id() as i32;
        let mut seg = Segments::new(0, vec![mine, peer], vec![pid, pid]);
        let mut data = vec![1.0f32; 100];
        let deadline = Instant::now() + Duration::from_millis(300);
        match seg.all_reduce(&mut data, ReduceOp::Sum, 1, deadline) {
            Err(ShmError::Peer(1, e)) => assert_eq!(e.kind(), io::ErrorKind::TimedOut),
            other => panic!("expected rank 1 to be named, got {other:?}"),
        }
    }

    #[test]
    fn segment_names_are_exclusive_and_private() {
        use std::os::unix::fs::PermissionsExt;
        let name = name();
        let _a = create(&name, 0).expect("create");
        assert!(
            create(&name, 0).is_err(),
            "a second create of the same name must fail"
        );
        let mode = std::fs::metadata(segment_path(&name, 0))
            .expect("stat")
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o600);
        unlink(&name, 0);
    }
}
