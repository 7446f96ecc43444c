//! The ring collectives over TCP (reduce-scatter then all-gather, as in Baidu's ring all-reduce
//! and NCCL's ring algorithm), chunked and pipelined: a sender thread writes to the next rank while
//! the calling thread reads from the previous one and reduces. Every message starts with a header
//! (sequence number, kind, dtype, count) so that ranks calling different collectives find out.

use super::*;

fn header(seq: u64, op: u8, dtype: DType, count: usize, extra: u64) -> [u8; 32] {
    let mut h = [0u8; 32];
    h[0..8].copy_from_slice(&seq.to_le_bytes());
    h[8] = op;
    h[9] = dtype as u8;
    h[10..18].copy_from_slice(&(count as u64).to_le_bytes());
    h[18..26].copy_from_slice(&extra.to_le_bytes());
    h
}

fn describe(h: &[u8; 32]) -> String {
    let op = match h[8] {
        OP_ALL_REDUCE => "all_reduce",
        OP_BROADCAST => "broadcast",
        OP_ALL_GATHER => "all_gather",
        _ => "an unknown collective",
    };
    let u = |r: std::ops::Range<usize>| h[r].try_into().map(u64::from_le_bytes).unwrap_or(0);
    format!(
        "{op} #{} of {} elements (dtype {}, arg {})",
        u(0..8),
        u(10..18),
        h[9],
        u(18..26)
    )
}

/// Segment `i` of `n` of a buffer of `len` elements: the first `len % n` get one extra element.
pub(crate) fn segment(len: usize, n: usize, i: usize) -> std::ops::Range<usize> {
    let base = len / n;
    let extra = len % n;
    let start = i * base + i.min(extra);
    start..start + base + usize::from(i < extra)
}

fn chunks(r: std::ops::Range<usize>, chunk: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    let chunk = chunk.max(1);
    r.clone()
        .step_by(chunk)
        .map(move |s| s..(s + chunk).min(r.end))
}

/// One ring pass: a sender thread writes messages to `next` in FIFO order while `body` reads from
/// `prev`. Errors from either side stop both promptly (sockets are shut down).
fn ring_pass<T: Element>(
    links: &mut Links,
    hdr: [u8; 32],
    inline: bool,
    body: impl FnOnce(&mut Link, &mut Out<'_, T>, &mpsc::Receiver<Vec<T>>) -> Result<(), RingError>,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let next = &mut links.next;
    let prev = &mut links.prev;
    if inline {
        // Small messages: every step's sends fit in the socket buffers, so write them from this
        // thread before reading (no sender thread to start: lower latency).
        let (_keep, pool) = mpsc::channel::<Vec<T>>();
        let mut out = Out::Inline(next);
        let run = || -> Result<(), RingError> {
            out.send(Msg::Header(hdr))?;
            let mut theirs = [0u8; 32];
            prev.read_exact(&mut theirs).map_err(RingError::Recv)?;
            if theirs != hdr {
                return Err(RingError::Mismatch {
                    ours: describe(&hdr),
                    theirs: describe(&theirs),
                });
            }
            body(prev, &mut out, &pool)
        };
        return run().map_err(fail);
    }
    let prev_shut = prev
        .stream
        .try_clone()
        .map_err(|e| fail(RingError::Recv(e)))?;
    let next_shut = next
        .stream
        .try_clone()
        .map_err(|e| fail(RingError::Send(e)))?;
    let sender_failed = AtomicBool::new(false);
    let sender_failed = &sender_failed;
    let (tx, rx) = mpsc::channel::<Msg<T>>();
    let (ret_tx, ret_rx) = mpsc::channel::<Vec<T>>();
    std::thread::scope(|scope| {
        let sender = scope.spawn(move || -> Result<(), DistError> {
            for msg in rx {
                let r = match &msg {
                    Msg::Header(h) => next.write_all(h),
                    Msg::Data(v) => next.write_all(bytemuck::cast_slice(v)),
                };
                if let Err(e) = r {
                    sender_failed.store(true, Ordering::SeqCst);
                    // Record the cause first, then wake the reader so the whole pass stops now.
                    let err = fail(RingError::Send(e));
                    let _ = prev_shut.shutdown(Shutdown::Both);
                    return Err(err);
                }
                if let Msg::Data(v) = msg {
                    let _ = ret_tx.send(v);
                }
            }
            Ok(())
        });
        let run = || -> Result<(), RingError> {
            let mut out = Out::Thread(tx.clone());
            out.send(Msg::Header(hdr))?;
            let mut theirs = [0u8; 32];
            prev.read_exact(&mut theirs).map_err(RingError::Recv)?;
            if theirs != hdr {
                return Err(RingError::Mismatch {
                    ours: describe(&hdr),
                    theirs: describe(&theirs),
                });
            }
            body(prev, &mut out, &ret_rx)
        };
        let result = match run() {
            Ok(()) => Ok(()),
            // The sender failed first and woke us: its error is the one to report.
            Err(_) if sender_failed.load(Ordering::SeqCst) => Ok(()),
            Err(e) => {
                let err = fail(e);
                let _ = next_shut.shutdown(Shutdown::Both);
                Err(err)
            }
        };
        drop(tx);
        let sent = sender.join().unwrap_or_else(|_| {
            Err(fail(RingError::Send(io::Error::other(
                "sender thread panicked",
            ))))
        });
        sent.and(result)
    })
}

/// Where a ring pass's outgoing messages go: the sender thread, or straight to the socket.
enum Out<'a, T> {
    Thread(mpsc::Sender<Msg<T>>),
    Inline(&'a mut Link),
}

impl<T: Element> Out<'_, T> {
    fn send(&mut self, msg: Msg<T>) -> Result<(), RingError> {
        match self {
            Out::Thread(tx) => {
                // A closed channel means the sender failed; its error is reported instead.
                let _ = tx.send(msg);
                Ok(())
            }
            Out::Inline(next) => match msg {
                Msg::Header(h) => next.write_all(&h),
                Msg::Data(v) => next.write_all(bytemuck::cast_slice(&v)),
            }
            .map_err(RingError::Send),
        }
    }
}

fn take_buf<T: Element>(pool: &mpsc::Receiver<Vec<T>>, len: usize) -> Vec<T> {
    let mut v = pool.try_recv().unwrap_or_default();
    v.resize(len, T::zeroed());
    v
}

fn recv_into<T: Element>(prev: &mut Link, buf: &mut [T]) -> Result<(), RingError> {
    prev.read_exact(bytemuck::cast_slice_mut(buf))
        .map_err(RingError::Recv)
}

pub(super) fn ring_all_reduce<T: Element>(
    links: &mut Links,
    rank: usize,
    n: usize,
    data: &mut [T],
    op: ReduceOp,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let hdr = header(links.seq, OP_ALL_REDUCE, T::DTYPE, data.len(), op as u64);
    let chunk = (CHUNK_BYTES / std::mem::size_of::<T>()).max(1);
    let len = data.len();
    let inline = len.div_ceil(n) * std::mem::size_of::<T>() <= INLINE_MAX_BYTES;
    ring_pass::<T>(
        links,
        hdr,
        inline,
        |prev, tx, pool| {
            let seg = |i: usize| segment(len, n, (i + n) % n);
            // Reduce-scatter, step 0 sends our own segment.
            for c in chunks(seg(rank), chunk) {
                let mut v = take_buf(pool, c.len());
                v.copy_from_slice(&data[c]);
                tx.send(Msg::Data(v))?;
            }
            for s in 0..n - 1 {
                let r = seg(rank + 2 * n - s - 1);
                for c in chunks(r, chunk) {
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    T::reduce(op, &mut v, &data[c.clone()]);
                    if s == n - 2 {
                        if op == ReduceOp::Avg {
                            T::divide(&mut v, n);
                        }
                        data[c].copy_from_slice(&v);
                    }
                    tx.send(Msg::Data(v))?;
                }
            }
            // All-gather.
            for s in 0..n - 1 {
                let r = seg(rank + n - s);
                for c in chunks(r, chunk) {
                    if s == n - 2 {
                        // Last step: nothing to forward, read straight into place.
                        recv_into(prev, &mut data[c])?;
                        continue;
                    }
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    data[c].copy_from_slice(&v);
                    tx.send(Msg::Data(v))?;
                }
            }
            Ok(())
        },
        fail,
    )
}

pub(super) fn ring_broadcast(
    links: &mut Links,
    rank: usize,
    n: usize,
    data: &mut [u8],
    root: usize,
    dtype: DType,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let hdr = header(links.seq, OP_BROADCAST, dtype, data.len(), root as u64);
    let forward = (rank + 1) % n != root;
    let inline = data.len() <= INLINE_MAX_BYTES;
    ring_pass::<u8>(
        links,
        hdr,
        inline,
        |prev, tx, pool| {
            for c in chunks(0..data.len(), CHUNK_BYTES) {
                if rank == root {
                    let mut v = take_buf(pool, c.len());
                    v.copy_from_slice(&data[c]);
                    tx.send(Msg::Data(v))?;
                } else {
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    data[c].copy_from_slice(&v);
                    if forward {
                        tx.send(Msg::Data(v))?;
                    }
                }
            }
            Ok(())
        },
        fail,
    )
}

pub(super) fn ring_all_gather(
    links: &mut Links,
    rank: usize,
    n: usize,
    data: &mut [u8],
    dtype: DType,
    fail: &Fail<'_>,
) -> Result<(), DistError> {
    let hdr = header(links.seq, OP_ALL_GATHER, dtype, data.len(), 0);
    let block = data.len() / n;
    let inline = block <= INLINE_MAX_BYTES;
    ring_pass::<u8>(
        links,
        hdr,
        inline,
        |prev, tx, pool| {
            let blk = |i: usize| {
                let i = i % n;
                i * block..(i + 1) * block
            };
            for c in chunks(blk(rank), CHUNK_BYTES) {
                let mut v = take_buf(pool, c.len());
                v.copy_from_slice(&data[c]);
                tx.send(Msg::Data(v))?;
            }
            for s in 0..n - 1 {
                for c in chunks(blk(rank + 2 * n - s - 1), CHUNK_BYTES) {
                    let mut v = take_buf(pool, c.len());
                    recv_into(prev, &mut v)?;
                    data[c].copy_from_slice(&v);
                    if s < n - 2 {
                        tx.send(Msg::Data(v))?;
                    }
                }
            }
            Ok(())
        },
        fail,
    )
}

/// A shared-memory failure in the ring's terms (the peer, or the collective that differs).
pub(super) fn shm_failure(e: crate::comm::ring::shm::ShmError) -> RingError {
    match e {
        crate::comm::ring::shm::ShmError::Peer(q, e) => RingError::Peer(q, e),
        crate::comm::ring::shm::ShmError::Mismatch { rank, ours, theirs } => RingError::Mismatch {
            ours: format!("collective #{} (all_reduce of {} elements)", ours.0, ours.1),
            theirs: format!(
                "collective #{} (all_reduce of {} elements) on rank {rank}",
                theirs.0, theirs.1
            ),
        },
        crate::comm::ring::shm::ShmError::OtherKind {
            rank,
            seq,
            len,
            theirs,
        } => RingError::Mismatch {
            ours: format!("collective #{seq} (all_reduce of {len} elements)"),
            theirs: format!("collective #{seq} ({theirs}) on rank {rank}"),
        },
    }
}
