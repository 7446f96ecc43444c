//! Who failed first, and what every rank was doing: the job's failure record and progress board,
//! both kept in the rendezvous store, so every rank (and the launcher) names the same root cause.
//!
//! - The **failure record** is written once, by the first rank that knows something (set-if-absent):
//!   a rank that died, one that stopped making progress, a collective mismatch, or a rank's own
//!   error inside a collective helper. Ranks that only see the echo (a closed socket from a live
//!   neighbour, a deadline that passed because the ring stalled elsewhere) read it instead of
//!   blaming their neighbour.
//! - The **progress board** is torch's desync debug: a thread per rank publishes, twice a second,
//!   a heartbeat counter and the sequence number, kind and phase of its last collective. When a
//!   deadline passes, every rank reads the board twice: a rank whose heartbeat stood still is
//!   stopped or hung as a whole process; otherwise a rank that has not reached the collective the
//!   others wait in is busy elsewhere.

use super::{RingError, is_timeout};
use crate::error::DistError;
use crate::rendezvous::store::Store;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

/// Store key of the failure record.
const FAILURE_KEY: &str = "burn-dist/failure";
/// Store key prefix of the progress board.
const PROGRESS_KEY: &str = "burn-dist/progress";
/// How often each rank publishes its progress.
pub(crate) const PUBLISH_EVERY: Duration = Duration::from_millis(500);
/// How long a diagnosis may take before it gives up on the store (whose server may be the
/// stopped rank itself).
pub(crate) const DIAGNOSIS_BUDGET: Duration = Duration::from_secs(4);

/// What the first observer of a failure found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum Kind {
    /// The rank's connection closed or its process is gone.
    Died,
    /// The rank stopped making progress (its heartbeat stood still) or never reached the
    /// collective the others wait in.
    Unresponsive,
    /// The rank runs another collective than the observer.
    Mismatch,
    /// The rank failed by itself inside a collective helper (bad data, a record that does not
    /// load, ...).
    Local,
}

impl Kind {
    fn tag(&self) -> &'static str {
        match self {
            Kind::Died => "died",
            Kind::Unresponsive => "unresponsive",
            Kind::Mismatch => "mismatch",
            Kind::Local => "local",
        }
    }

    fn from_tag(tag: &str) -> Option<Self> {
        Some(match tag {
            "died" => Kind::Died,
            "unresponsive" => Kind::Unresponsive,
            "mismatch" => Kind::Mismatch,
            "local" => Kind::Local,
            _ => return None,
        })
    }
}

/// The job's first failure.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Record {
    /// What happened.
    pub kind: Kind,
    /// The rank it happened to (the root cause).
    pub rank: usize,
    /// The rank that found out.
    pub observer: usize,
    /// Human-readable detail.
    pub detail: String,
}

impl Record {
    fn encode(&self) -> Vec<u8> {
        format!(
            "{} {} {} {}",
            self.kind.tag(),
            self.rank,
            self.observer,
            self.detail
        )
        .into_bytes()
    }

    fn decode(b: &[u8]) -> Option<Self> {
        let s = String::from_utf8_lossy(b);
        let mut parts = s.splitn(4, ' ');
        Some(Self {
            kind: Kind::from_tag(parts.next()?)?,
            rank: parts.next()?.parse().ok()?,
            observer: parts.next()?.parse().ok()?,
            detail: parts.next().unwrap_or("").to_string(),
        })
    }
}

/// Records `record` unless a failure is already recorded; returns the record that stands (ours
/// or the first one). `None` when the store cannot be reached.
pub(crate) fn publish(store: &Store, record: &Record) -> Option<Record> {
    // One step on the server: two ranks that find a failure in the same instant agree on it.
    let stored = store.set_if_absent(FAILURE_KEY, &record.encode()).ok()?;
    Record::decode(&stored)
}

/// The recorded failure, if any.
pub(crate) fn recorded(store: &Store) -> Option<Record> {
    store
        .try_get(FAILURE_KEY)
        .ok()
        .flatten()
        .and_then(|b| Record::decode(&b))
}

/// Kinds of collective, as published.
const OPS: [&str; 4] = ["none", "all_reduce", "broadcast", "all_gather"];

/// The collective a rank is in (or last finished): sequence number, kind, phase.
#[derive(Debug, Default)]
pub(crate) struct Activity {
    /// `seq << 1 | in_progress`.
    packed: AtomicU64,
    /// Index into [`OPS`].
    op: AtomicU64,
}

impl Activity {
    /// Marks the start (`in_progress`) or the end of collective `seq` of kind `op`.
    pub(crate) fn set(&self, seq: u64, op: &str, in_progress: bool) {
        let index = OPS.iter().position(|o| *o == op).unwrap_or(0) as u64;
        self.op.store(index, Ordering::Relaxed);
        self.packed
            .store(seq << 1 | u64::from(in_progress), Ordering::Release);
    }

    fn describe(&self) -> String {
        let packed = self.packed.load(Ordering::Acquire);
        let op = OPS[(self.op.load(Ordering::Relaxed) as usize).min(OPS.len() - 1)];
        let phase = if packed & 1 == 1 { "in" } else { "done" };
        format!("{} {op} {phase}", packed >> 1)
    }
}

/// One rank's entry on the board.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Entry {
    beat: u64,
    seq: u64,
    op: String,
    in_progress: bool,
}

impl Entry {
    fn decode(b: &[u8]) -> Option<Self> {
        let s = String::from_utf8_lossy(b);
        let mut p = s.split(' ');
        Some(Self {
            beat: p.next()?.parse().ok()?,
            seq: p.next()?.parse().ok()?,
            op: p.next()?.to_string(),
            in_progress: p.next()? == "in",
        })
    }

    fn describe(&self) -> String {
        if self.seq == 0 {
            return "its set-up, before any collective".into();
        }
        let phase = if self.in_progress {
            "in progress"
        } else {
            "finished"
        };
        format!("collective #{} ({}, {phase})", self.seq, self.op)
    }
}

/// Publishes this rank's [`Activity`] with a heartbeat until dropped.
#[derive(Debug)]
pub(crate) struct Publisher {
    stop: Arc<AtomicBool>,
}

impl Drop for Publisher {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::SeqCst);
    }
}

impl Publisher {
    /// Starts the publishing thread of `rank`.
    pub(crate) fn start(store: Arc<Store>, rank: usize, activity: Arc<Activity>) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        let spawned = std::thread::Builder::new()
            .name(format!("burn-dist-progress-{rank}"))
            .spawn(move || {
                let key = format!("{PROGRESS_KEY}/{rank}");
                let mut beat = 0u64;
                while !stopped.load(Ordering::SeqCst) {
                    beat += 1;
                    let value = format!("{beat} {}", activity.describe());
                    // A store that does not answer is a failure the collectives report.
                    let _ = store.set(&key, value.as_bytes());
                    std::thread::sleep(PUBLISH_EVERY);
                }
            });
        if let Err(e) = spawned {
            eprintln!(
                "[burn-dist rank {rank}] no progress publisher ({e}): failure reports will be vaguer"
            );
        }
        Self { stop }
    }
}

/// Why a collective that passed its deadline is stuck, from the progress board: the rank to
/// blame and what it was doing. `None` when the board shows nothing unusual.
///
/// Reads the board twice, 2.5 publishing periods apart, all within [`DIAGNOSIS_BUDGET`]: the
/// store may be served by the stopped rank itself, and then rank 0 is the answer.
pub(crate) fn diagnose(store: &Arc<Store>, rank: usize, world_size: usize) -> Option<Record> {
    let store = Arc::clone(store);
    let (tx, rx) = std::sync::mpsc::channel();
    let spawned = std::thread::Builder::new()
        .name("burn-dist-diagnosis".into())
        .spawn(move || {
            let read = || -> Vec<Option<Entry>> {
                (0..world_size)
                    .map(|q| {
                        store
                            .try_get(&format!("{PROGRESS_KEY}/{q}"))
                            .ok()
                            .flatten()
                            .and_then(|b| Entry::decode(&b))
                    })
                    .collect()
            };
            let first = read();
            std::thread::sleep(PUBLISH_EVERY * 5 / 2);
            let second = read();
            let _ = tx.send(blame(&first, &second));
        });
    if spawned.is_err() {
        return None;
    }
    match rx.recv_timeout(DIAGNOSIS_BUDGET) {
        Ok(found) => found.map(|(q, detail)| Record {
            kind: Kind::Unresponsive,
            rank: q,
            observer: rank,
            detail,
        }),
        // The store itself does not answer: its server, rank 0's process, is not running.
        Err(_) => Some(Record {
            kind: Kind::Unresponsive,
            rank: 0,
            observer: rank,
            detail: "does not answer: the rendezvous store it serves is silent (stopped or hung)"
                .into(),
        }),
    }
}

/// The rank the two readings of the board blame, and why.
fn blame(first: &[Option<Entry>], second: &[Option<Entry>]) -> Option<(usize, String)> {
    // A process whose heartbeat stood still is stopped or hung as a whole.
    for (q, (a, b)) in first.iter().zip(second).enumerate() {
        match (a, b) {
            (Some(a), Some(b)) if a.beat == b.beat => {
                return Some((
                    q,
                    format!(
                        "stopped making progress: its heartbeat stands still (last seen in {}); \
                         the process is stopped, hung or swapping",
                        b.describe()
                    ),
                ));
            }
            (_, None) => {
                return Some((q, "never published its progress (stopped or hung)".into()));
            }
            _ => {}
        }
    }
    // All alive: a rank that has not reached the collective the others are in is busy elsewhere.
    let newest = second.iter().flatten().map(|e| e.seq).max()?;
    let (q, lagging) = second
        .iter()
        .enumerate()
        .filter_map(|(q, e)| e.as_ref().map(|e| (q, e)))
        .find(|(_, e)| e.seq < newest)?;
    Some((
        q,
        format!(
            "has not reached collective #{newest} that the others wait in (it is at {}): it is \
             busy outside collectives, or hung in its own code",
            lagging.describe()
        ),
    ))
}

impl super::TcpRing {
    /// Turns what this rank saw into the job's failure: the first record in the store wins, so
    /// every rank names the same root cause (see [`crate::comm::ring::failure`]).
    pub(super) fn explain(&self, op: &'static str, e: RingError) -> DistError {
        let n = self.world_size;
        let (peer, detail, timed_out) = match e {
            RingError::Peer(q, e) => (q, e.to_string(), is_timeout(&e)),
            RingError::Recv(e) => ((self.rank + n - 1) % n, e.to_string(), is_timeout(&e)),
            RingError::Send(e) => ((self.rank + 1) % n, e.to_string(), is_timeout(&e)),
            RingError::Mismatch { ours, theirs } => {
                let peer = (self.rank + n - 1) % n;
                if let Some(store) = &self.store {
                    publish(
                        store,
                        &Record {
                            kind: Kind::Mismatch,
                            rank: peer,
                            observer: self.rank,
                            detail: format!(
                                "rank {} runs {ours}, rank {peer} runs {theirs}",
                                self.rank
                            ),
                        },
                    );
                }
                return DistError::CollectiveMismatch {
                    rank: self.rank,
                    peer,
                    ours,
                    theirs,
                };
            }
        };
        let Some(store) = &self.store else {
            return DistError::PeerFailed {
                op,
                rank: self.rank,
                peer,
                detail,
            };
        };
        // An echo of a failure another rank already recorded: name its root cause.
        if let Some(first) = recorded(store)
            && first.observer != self.rank
        {
            return self.error_for(op, first, &detail);
        }
        let ours = if timed_out {
            // Which rank holds the job up? The progress board knows; the neighbour we waited on
            // may itself be waiting.
            diagnose(store, self.rank, n).unwrap_or(Record {
                kind: Kind::Unresponsive,
                rank: peer,
                observer: self.rank,
                detail: format!(
                    "did not answer within {}s (it may be waiting on another rank)",
                    self.timeout.as_secs_f64()
                ),
            })
        } else if store.try_get("burn-dist/rendezvous-probe").is_err()
            && peer != 0
            && self.rank != 0
        {
            // The store is gone: its server, rank 0, is down.
            Record {
                kind: Kind::Died,
                rank: 0,
                observer: self.rank,
                detail: format!(
                    "is unreachable (its rendezvous store is gone); this rank saw: {detail}"
                ),
            }
        } else {
            Record {
                kind: Kind::Died,
                rank: peer,
                observer: self.rank,
                detail: format!("closed the connection or died ({detail})"),
            }
        };
        let standing = publish(store, &ours).unwrap_or(ours);
        self.error_for(op, standing, &detail)
    }

    /// The error this rank reports for the job's failure `record`.
    fn error_for(&self, op: &'static str, record: Record, seen: &str) -> DistError {
        let echo = if record.observer == self.rank {
            String::new()
        } else {
            format!(
                " (found by rank {}; this rank saw: {seen})",
                record.observer
            )
        };
        match record.kind {
            Kind::Mismatch => DistError::MismatchReported {
                rank: self.rank,
                observer: record.observer,
                detail: record.detail,
            },
            Kind::Unresponsive => DistError::Unresponsive {
                op,
                rank: self.rank,
                peer: record.rank,
                detail: format!("{}{echo}", record.detail),
                deadline: self.timeout,
            },
            Kind::Died => DistError::PeerFailed {
                op,
                rank: self.rank,
                peer: record.rank,
                detail: format!("{}{echo}", record.detail),
            },
            Kind::Local => DistError::PeerFailed {
                op,
                rank: self.rank,
                peer: record.rank,
                detail: format!("failed by itself: {}{echo}", record.detail),
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn e(beat: u64, seq: u64, in_progress: bool) -> Option<Entry> {
        Some(Entry {
            beat,
            seq,
            op: "all_reduce".into(),
            in_progress,
        })
    }

    #[test]
    fn records_round_trip() {
        let r = Record {
            kind: Kind::Mismatch,
            rank: 3,
            observer: 1,
            detail: "runs broadcast #4 while rank 1 runs all_reduce #4".into(),
        };
        assert_eq!(Record::decode(&r.encode()), Some(r));
        assert_eq!(Record::decode(b"garbage"), None);
    }

    #[test]
    fn a_still_heartbeat_is_blamed_first() {
        let first = [e(10, 42, true), e(7, 41, false), e(9, 42, true)];
        let second = [e(15, 42, true), e(7, 41, false), e(14, 42, true)];
        let (q, why) = blame(&first, &second).expect("blame");
        assert_eq!(q, 1);
        assert!(why.contains("heartbeat"), "{why}");
    }

    #[test]
    fn a_live_rank_behind_the_others_is_blamed() {
        let first = [e(10, 42, true), e(7, 41, false), e(9, 42, true)];
        let second = [e(15, 42, true), e(12, 41, false), e(14, 42, true)];
        let (q, why) = blame(&first, &second).expect("blame");
        assert_eq!(q, 1);
        assert!(why.contains("#42"), "{why}");
    }

    #[test]
    fn everyone_alive_and_level_blames_nobody() {
        let first = [e(10, 42, true), e(7, 42, true)];
        let second = [e(15, 42, true), e(12, 42, true)];
        assert_eq!(blame(&first, &second), None);
    }

    #[test]
    fn activity_is_described_for_the_board() {
        let a = Activity::default();
        a.set(7, "broadcast", true);
        assert_eq!(a.describe(), "7 broadcast in");
        a.set(7, "broadcast", false);
        let entry = Entry::decode(format!("3 {}", a.describe()).as_bytes()).expect("entry");
        assert_eq!(entry.seq, 7);
        assert!(!entry.in_progress);
    }
}
