//! Same-machine shared memory for the host backend's all-reduces, as NCCL's and Open MPI's
//! shared-memory transports do: no ptrace permission, no kernel network stack, no system call
//! per message (ranks meet at a barrier of counters they spin on).
//!
//! Every rank creates one segment (`/dev/shm`, mode 0600, a name drawn by rank 0 and passed
//! through the authenticated store), maps every peer's, and unlinks its own once all are mapped,
//! so nothing is left behind even if the job is killed. A segment holds a small header (barrier
//! counter, and per slot the sequence number and length of the collective that uses it) and two
//! staging slots used in turn. An all-reduce moves through them one slot-sized chunk at a time;
//! the slot is small enough (256 KiB) that a chunk, its staging and its peers' stay in a core's
//! L2 cache (measured on 2 cores: 256–512 KiB chunks beat 4 MiB ones by 1.5–2× from 8 MiB up).
//!
//! A chunk of at most [`WHOLE_MAX_BYTES`] takes one barrier, where a barrier costs more than the
//! copies: every rank stages the whole chunk, then reduces all ranks' copies in rank order.
//!
//! A larger chunk on rank `r`, cut into one part per rank, takes two, so that the work and bytes
//! per rank do not grow with the number of ranks (a reduce-scatter, then an all-gather):
//!
//! 1. copy the parts the others will reduce into this rank's slot;
//! 2. barrier (and check that every rank runs the same collective of the same length);
//! 3. reduce part `r` in the local buffer, reading part `r` from every peer's slot, and publish
//!    the result in this rank's slot;
//! 4. barrier;
//! 5. copy every other part's result from its owner's slot.
//!
//! Either way each element's result is computed by one expression, the same on every rank (in
//! rank order on each, or once by the part's owner and copied), so every rank ends bitwise equal. Alternating two slots makes the staging of chunk `k + 2` safe without another
//! barrier: a rank stages it only after the barrier of chunk `k + 1`, which every peer reaches
//! only after it finished reading chunk `k`.

use crate::comm::{Element, ReduceOp};
use memmap2::MmapMut;
use std::fs::OpenOptions;
use std::io;
use std::os::unix::fs::OpenOptionsExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Bytes of one staging slot (a chunk of the user's buffer moves through it).
pub(crate) const SLOT_BYTES: usize = 256 << 10;
/// Largest chunk reduced whole in one barrier (measured crossover with 2 ranks: 2–4 KiB).
const WHOLE_MAX_BYTES: usize = 2 << 10;
/// Header bytes before the slots (one cache line).
const HEADER: usize = 64;
/// Header field offsets (each an `AtomicU64`). The collective's sequence number and length are
/// kept per slot: with one barrier per chunk, a fast rank may publish the next collective's
/// before a slow one has checked this one's, but never into the slot that one still reads.
const ARRIVED: usize = 0;
const SEQ: [usize; 2] = [8, 24];
const LEN: [usize; 2] = [16, 32];
/// The collective this rank is in, of any kind (`seq << 8 | kind`): a rank waiting at a barrier
/// reads it to tell a peer that runs a TCP collective under the same sequence number (a
/// mismatch, named at once) from one that is merely slow.
const NOW: usize = 40;
/// Collective kinds as [`Segments::announce`] codes them (index + 1; 0 is "none").
const KINDS: [&str; 3] = ["all_reduce", "broadcast", "all_gather"];
/// A segment's size: header and two slots (512 KiB + 64 B per local rank).
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
    /// Peer `rank` runs another kind of collective (`theirs`) under our sequence number `seq`,
    /// where we all-reduce `len` elements.
    OtherKind {
        /// The peer.
        rank: usize,
        /// The sequence number both ranks are at.
        seq: u64,
        /// Our all-reduce's length.
        len: u64,
        /// The peer's collective.
        theirs: &'static str,
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
    /// The all-reduce in progress (sequence number, length), for the barrier's kind check.
    current: (u64, u64),
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
            current: (0, 0),
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
                self.check_peer_kind(q)?;
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

    /// Publishes that this rank entered collective `seq` of kind `op` (one of [`KINDS`]); every
    /// collective calls it, TCP ones included.
    pub(crate) fn announce(&self, seq: u64, op: &str) {
        let kind = KINDS
            .iter()
            .position(|k| *k == op)
            .map_or(0, |i| i as u64 + 1);
        self.field(self.rank, NOW)
            .store(seq << 8 | kind, Ordering::Release);
    }

    /// While we wait for peer `q` in an all-reduce: a peer announcing another kind under our
    /// sequence number will never arrive (it waits on a TCP collective).
    fn check_peer_kind(&self, q: usize) -> Result<(), ShmError> {
        let (seq, len) = self.current;
        let now = self.field(q, NOW).load(Ordering::Acquire);
        let kind = (now & 0xff) as usize;
        if now >> 8 == seq && kind > 1 && kind <= KINDS.len() {
            return Err(ShmError::OtherKind {
                rank: q,
                seq,
                len,
                theirs: KINDS[kind - 1],
            });
        }
        Ok(())
    }

    /// After the first barrier of a collective: every peer published the same sequence number
    /// and length (nobody can overwrite them before we pass the next barrier).
    fn check_same_collective(&self, slot: usize, seq: u64, len: u64) -> Result<(), ShmError> {
        for q in (0..self.maps.len()).filter(|q| *q != self.rank) {
            let theirs = (
                self.field(q, SEQ[slot]).load(Ordering::Relaxed),
                self.field(q, LEN[slot]).load(Ordering::Relaxed),
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

    /// Takes the next slot and publishes, beside it, which collective this rank runs (sequence
    /// number and total length), for the peers to check after the barrier.
    fn publish(&mut self, seq: u64, total: u64) -> usize {
        let slot = (self.chunks % 2) as usize;
        self.chunks += 1;
        let rank = self.rank;
        self.field(rank, SEQ[slot]).store(seq, Ordering::Relaxed);
        self.field(rank, LEN[slot]).store(total, Ordering::Relaxed);
        slot
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
        let total = data.len() as u64;
        self.current = (seq, total);
        if data.is_empty() {
            // Still meet the peers, so an empty all-reduce on one rank is caught as a mismatch.
            let slot = self.publish(seq, total);
            self.barrier(deadline)?;
            return self.check_same_collective(slot, seq, total);
        }
        let per_chunk = (SLOT_BYTES / std::mem::size_of::<T>()).max(1);
        let whole_max = WHOLE_MAX_BYTES / std::mem::size_of::<T>();
        for (index, chunk) in data.chunks_mut(per_chunk).enumerate() {
            let slot = self.publish(seq, total);
            if chunk.len() <= whole_max {
                self.reduce_whole(chunk, op, slot, index == 0, (seq, total), deadline)?;
            } else {
                self.reduce_parts(chunk, op, slot, index == 0, (seq, total), deadline)?;
            }
        }
        Ok(())
    }

    /// One chunk in one barrier, for small chunks where a barrier costs more than the copies:
    /// every rank stages the whole chunk, then reduces every rank's copy in rank order, so every
    /// rank computes the same expression and ends bitwise equal.
    fn reduce_whole<T: Element>(
        &mut self,
        chunk: &mut [T],
        op: ReduceOp,
        slot: usize,
        first: bool,
        (seq, total): (u64, u64),
        deadline: Instant,
    ) -> Result<(), ShmError> {
        let (n, rank, len) = (self.maps.len(), self.rank, chunk.len());
        self.own_slot::<T>(slot, len).copy_from_slice(chunk);
        self.barrier(deadline)?;
        if first {
            self.check_same_collective(slot, seq, total)?;
        }
        if rank != 0 {
            chunk.copy_from_slice(self.slot::<T>(0, slot, len));
        }
        for q in 1..n {
            T::reduce(op, chunk, self.slot::<T>(q, slot, len));
        }
        if op == ReduceOp::Avg {
            T::divide(chunk, n);
        }
        Ok(())
    }

    /// One chunk as a reduce-scatter and an all-gather through the slots (two barriers): each
    /// rank reduces only its part, so the work and the bytes read per rank do not grow with the
    /// number of ranks.
    fn reduce_parts<T: Element>(
        &mut self,
        chunk: &mut [T],
        op: ReduceOp,
        slot: usize,
        first: bool,
        (seq, total): (u64, u64),
        deadline: Instant,
    ) -> Result<(), ShmError> {
        let (n, rank, len) = (self.maps.len(), self.rank, chunk.len());
        let part = |q: usize| crate::comm::ring::collectives::segment(len, n, q);
        // 1. Stage the parts the peers reduce.
        {
            let staged = self.own_slot::<T>(slot, len);
            for q in (0..n).filter(|q| *q != rank) {
                staged[part(q)].copy_from_slice(&chunk[part(q)]);
            }
        }
        self.barrier(deadline)?;
        if first {
            self.check_same_collective(slot, seq, total)?;
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

    /// `n` "ranks" as threads of this process, each mapping every segment; runs `body` on each
    /// and returns what each returned, in rank order.
    fn with_ranks<R: Send + 'static>(
        n: usize,
        body: impl Fn(usize, &mut Segments) -> R + Send + Sync + 'static,
    ) -> Vec<R> {
        let name = name();
        let pid = std::process::id() as i32;
        let own: Vec<MmapMut> = (0..n).map(|r| create(&name, r).expect("create")).collect();
        let body = std::sync::Arc::new(body);
        let handles: Vec<_> = own
            .into_iter()
            .enumerate()
            .map(|(r, mine)| {
                let (name, body) = (name.clone(), body.clone());
                std::thread::spawn(move || {
                    let mut mine = Some(mine);
                    let maps = (0..n)
                        .map(|q| match q == r {
                            true => mine.take().expect("own segment"),
                            false => open(&name, q).expect("open"),
                        })
                        .collect();
                    body(r, &mut Segments::new(r, maps, vec![pid; n]))
                })
            })
            .collect();
        let out = handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect();
        (0..n).for_each(|r| unlink(&name, r));
        out
    }

    /// Both paths (whole chunks up to `WHOLE_MAX_BYTES`, parts above), chunk boundaries, odd
    /// lengths and every op, with 3 ranks: integer-valued data gives the exact reference whatever
    /// the order of the sum; fractional data gives every rank the same bits.
    #[test]
    fn three_ranks_agree_bitwise_on_both_paths_and_across_chunks() {
        let whole = WHOLE_MAX_BYTES / 4;
        let slot = SLOT_BYTES / 4;
        let lens = [
            1,
            7,
            whole - 1,
            whole,
            whole + 1,
            3 * whole + 5,
            slot,
            slot + 1,
            2 * slot + 513,
        ];
        let exact = |r: usize, i: usize| ((i * 7 + r * 13) % 101) as f32 - 50.0;
        let fraction = |r: usize, i: usize| ((i as f32) * 0.37 + r as f32 * 1.3).sin() * 1e3;
        let results = with_ranks(3, move |r, seg| {
            let deadline = Instant::now() + Duration::from_secs(30);
            let mut seq = 0;
            let mut out = Vec::new();
            for len in lens {
                for op in [ReduceOp::Sum, ReduceOp::Avg, ReduceOp::Max, ReduceOp::Min] {
                    for f in [exact, fraction] {
                        seq += 1;
                        let mut data: Vec<f32> = (0..len).map(|i| f(r, i)).collect();
                        seg.all_reduce(&mut data, op, seq, deadline)
                            .unwrap_or_else(|e| panic!("rank {r}, {len} elements, {op:?}: {e:?}"));
                        out.push((len, op, data));
                    }
                }
            }
            out
        });
        for (k, (len, op, data)) in results[0].iter().enumerate() {
            for (r, other) in results.iter().enumerate().skip(1) {
                let same = data
                    .iter()
                    .zip(&other[k].2)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "rank {r} differs from rank 0: {len} elements, {op:?}");
            }
            let exact_case = k % 2 == 0;
            let input = |r: usize, i: usize| {
                if exact_case {
                    exact(r, i)
                } else {
                    fraction(r, i)
                }
            };
            for (i, got) in data.iter().enumerate() {
                let v = [input(0, i), input(1, i), input(2, i)].map(f64::from);
                let want = match op {
                    ReduceOp::Sum => v.iter().sum::<f64>(),
                    ReduceOp::Avg => v.iter().sum::<f64>() / 3.0,
                    ReduceOp::Max => v.iter().copied().fold(f64::MIN, f64::max),
                    ReduceOp::Min => v.iter().copied().fold(f64::MAX, f64::min),
                };
                // f32 sums of three terms round at most twice, each within EPSILON of the
                // running magnitude, so the bound scales with the summands, not the result
                // (which cancels).
                let magnitude = v.iter().map(|x| x.abs()).sum::<f64>();
                let tol = match (exact_case, op) {
                    (true, ReduceOp::Sum | ReduceOp::Max | ReduceOp::Min) => 0.0,
                    (false, ReduceOp::Max | ReduceOp::Min) => 0.0,
                    (_, ReduceOp::Avg) => 4.0 * f64::from(f32::EPSILON) * magnitude / 3.0,
                    _ => 4.0 * f64::from(f32::EPSILON) * magnitude,
                };
                assert!(
                    (f64::from(*got) - want).abs() <= tol,
                    "{len} elements, {op:?}, element {i}: {got} against {want}"
                );
            }
        }
    }

    /// A peer in a TCP collective under the same sequence number never reaches the barrier; the
    /// waiting rank names it and its collective instead of waiting for the deadline.
    #[test]
    fn a_peer_in_another_kind_of_collective_is_a_mismatch_not_a_wait() {
        let results = with_ranks(2, |r, seg| {
            // Far beyond the check's latency (20 ms), so a wait for it would fail the match.
            let deadline = Instant::now() + Duration::from_secs(60);
            if r == 1 {
                seg.announce(7, "broadcast");
                return None;
            }
            seg.announce(7, "all_reduce");
            let mut data = vec![1.0f32; 64];
            Some(seg.all_reduce(&mut data, ReduceOp::Sum, 7, deadline))
        });
        match &results[0] {
            Some(Err(ShmError::OtherKind {
                rank: 1,
                seq: 7,
                len: 64,
                theirs: "broadcast",
            })) => {}
            other => panic!("expected rank 1's broadcast to be named, got {other:?}"),
        }
    }

    /// One barrier per small all-reduce lets a rank run a collective ahead of a slow peer; the
    /// identity it publishes for the next one must not be taken for this one's (a false
    /// mismatch) nor its staged data read in place of this one's.
    #[test]
    fn back_to_back_small_all_reduces_never_mix_up_collectives() {
        let results = with_ranks(2, |r, seg| {
            let deadline = Instant::now() + Duration::from_secs(30);
            (1..=3000u64)
                .map(|seq| {
                    let len = 1 + (seq as usize % 5);
                    let mut data = vec![(seq * 10 + r as u64) as f64; len];
                    seg.all_reduce(&mut data, ReduceOp::Sum, seq, deadline)
                        .unwrap_or_else(|e| panic!("rank {r}, collective {seq}: {e:?}"));
                    (seq, data)
                })
                .collect::<Vec<_>>()
        });
        for ranks in results {
            for (seq, data) in ranks {
                let want = (seq * 20 + 1) as f64;
                assert!(
                    data.iter().all(|v| *v == want),
                    "collective {seq}: {data:?}, want {want}"
                );
            }
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
