//! Surviving preemption: checkpoints in the middle of an epoch (`--checkpoint-every`), on
//! SIGTERM (and `--save-on-signal USR1`), and the position they resume from.
//!
//! Every rank must save at the same step, or the collectives of the save (the BatchNorm average)
//! would pair with another rank's training step. A step count is the same everywhere; a signal
//! or a clock is not (a signal may reach one rank only, each rank's clock runs its own way). So
//! each rank adds "I was signalled" and rank 0 adds "the interval has passed" to the metrics
//! all-reduce every step already runs, and every rank acts on the sums, at the same step.

use std::fmt;
use std::io::Write;
use std::path::PathBuf;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use clap::ValueEnum;
use serde::{Deserialize, Serialize};

use crate::checkpoint::writer::BackgroundWriter;
use crate::metrics::MetricSums;

/// The exit code of a run stopped by a signal after it saved its checkpoint (BSD's
/// `EX_TEMPFAIL`: run the same command again to continue). The launcher passes it on when every
/// rank exits with it.
pub const PREEMPTED_EXIT_CODE: u8 = 75;

/// `--checkpoint-every`: optimizer steps, or a time (`90s`, `30m`, `2h`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(into = "String", try_from = "String")]
pub enum CheckpointEvery {
    /// Every N optimizer steps (counted from the start of training).
    Steps(usize),
    /// When this much time has passed since the last checkpoint (rank 0's clock).
    Time(Duration),
}

impl FromStr for CheckpointEvery {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let s = s.trim();
        let split = s.find(|c: char| !c.is_ascii_digit()).unwrap_or(s.len());
        let (digits, unit) = s.split_at(split);
        let n: u64 = digits
            .parse()
            .map_err(|_| format!("{s:?} is not a number of steps or a time like 30m"))?;
        if n == 0 {
            return Err("must be at least 1 (omit it to checkpoint once per epoch)".into());
        }
        let seconds = match unit {
            "" => return Ok(Self::Steps(n as usize)),
            "s" => n,
            "m" => n * 60,
            "h" => n * 3600,
            other => {
                return Err(format!(
                    "unknown unit {other:?}: give steps (500) or a time in s, m or h (30m)"
                ));
            }
        };
        Ok(Self::Time(Duration::from_secs(seconds)))
    }
}

impl fmt::Display for CheckpointEvery {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Steps(n) => write!(f, "{n}"),
            Self::Time(t) if t.as_secs().is_multiple_of(3600) => {
                write!(f, "{}h", t.as_secs() / 3600)
            }
            Self::Time(t) if t.as_secs().is_multiple_of(60) => write!(f, "{}m", t.as_secs() / 60),
            Self::Time(t) => write!(f, "{}s", t.as_secs()),
        }
    }
}

impl From<CheckpointEvery> for String {
    fn from(every: CheckpointEvery) -> Self {
        every.to_string()
    }
}

impl TryFrom<String> for CheckpointEvery {
    type Error = String;

    fn try_from(s: String) -> Result<Self, Self::Error> {
        s.parse()
    }
}

/// `--save-on-signal`: a signal that saves and stops besides SIGTERM (SLURM's
/// `--signal=USR1@120`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
#[value(rename_all = "UPPERCASE")]
pub enum SaveSignal {
    /// SIGUSR1.
    #[value(alias = "usr1", alias = "SIGUSR1", alias = "sigusr1")]
    Usr1,
    /// SIGUSR2.
    #[value(alias = "usr2", alias = "SIGUSR2", alias = "sigusr2")]
    Usr2,
}

impl SaveSignal {
    fn number(self) -> libc::c_int {
        match self {
            Self::Usr1 => libc::SIGUSR1,
            Self::Usr2 => libc::SIGUSR2,
        }
    }
}

static SIGNALLED: AtomicBool = AtomicBool::new(false);
/// CLOCK_MONOTONIC at the first stop signal, in nanoseconds (0: none yet).
static FIRST_SIGNAL_NS: AtomicU64 = AtomicU64::new(0);
/// A repeat this soon after the first signal is the same request: under SLURM the scheduler
/// signals every process of the step and the launcher (or torchrun's agent) forwards it again.
const SAME_REQUEST_NS: u64 = 2_000_000_000;

fn monotonic_ns() -> u64 {
    let mut t = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: clock_gettime(2) writes into a valid timespec; it is async-signal-safe.
    unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut t) };
    (t.tv_sec as u64) * 1_000_000_000 + t.tv_nsec as u64 + 1
}

extern "C" fn on_stop_signal(sig: libc::c_int) {
    let now = monotonic_ns();
    match FIRST_SIGNAL_NS.compare_exchange(0, now, Ordering::SeqCst, Ordering::SeqCst) {
        Ok(_) => SIGNALLED.store(true, Ordering::SeqCst),
        // A second request, later than a forwarded copy of the first: stop now, as a second
        // Ctrl-C or the end of a grace period should.
        Err(first) if now.saturating_sub(first) >= SAME_REQUEST_NS => {
            // SAFETY: signal(2) and raise(2) are async-signal-safe; SIG_DFL is valid.
            unsafe {
                libc::signal(sig, libc::SIG_DFL);
                libc::raise(sig);
            }
        }
        Err(_) => {}
    }
}

/// Makes SIGTERM (and `extra`) ask for a checkpoint and a stop at the next step boundary. A
/// repeat within 2 s counts as the same request; a later one stops the process at once.
pub fn install_stop_signals(extra: Option<SaveSignal>) {
    let signals = [Some(libc::SIGTERM), extra.map(SaveSignal::number)];
    for sig in signals.into_iter().flatten() {
        // SAFETY: the handler only touches atomics and calls async-signal-safe functions; the
        // sigaction struct is zeroed then filled with a valid handler, an empty mask and flags.
        unsafe {
            let mut action: libc::sigaction = std::mem::zeroed();
            action.sa_sigaction = on_stop_signal as *const () as libc::sighandler_t;
            action.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut action.sa_mask);
            libc::sigaction(sig, &action, std::ptr::null_mut());
        }
    }
}

/// Whether a stop signal arrived (since [`install_stop_signals`]).
pub fn signalled() -> bool {
    SIGNALLED.load(Ordering::SeqCst)
}

/// Where in an epoch a mid-epoch checkpoint was written, with what the epoch's figures need.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MidEpoch {
    /// Optimizer steps of the epoch done.
    pub step: usize,
    /// Global samples of the epoch done (every rank's, padding included).
    pub samples: usize,
    /// The epoch's running metric sums (global).
    pub totals: MetricSums,
    /// Training time of the epoch so far, in seconds (for its img/s).
    pub elapsed_s: f64,
    /// Of which waiting for data.
    pub data_wait_s: f64,
}

impl MidEpoch {
    /// As an array for a broadcast from rank 0 (which read the checkpoint).
    pub fn to_array(&self) -> [f64; 9] {
        let t = self.totals.to_array();
        [
            self.step as f64,
            self.samples as f64,
            t[0],
            t[1],
            t[2],
            t[3],
            self.elapsed_s,
            self.data_wait_s,
            1.0,
        ]
    }

    /// Back from [`MidEpoch::to_array`]; `None` for an all-zero array (no mid-epoch position).
    pub fn from_array(a: &[f64; 9]) -> Option<Self> {
        (a[8] == 1.0).then(|| Self {
            step: a[0] as usize,
            samples: a[1] as usize,
            totals: MetricSums::from_array(&a[2..6]),
            elapsed_s: a[6],
            data_wait_s: a[7],
        })
    }
}

/// What the step's all-reduce says to do.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct StepVerdict {
    /// Write a mid-epoch checkpoint now.
    pub save: bool,
    /// Then stop (a signal reached some rank).
    pub stop: bool,
}

/// Decides when to write mid-epoch checkpoints (see the module doc).
pub struct StepCheckpoints {
    every: Option<CheckpointEvery>,
    is_main: bool,
    last: Instant,
    writer: BackgroundWriter,
}

/// Slots [`StepCheckpoints`] appends to the metrics all-reduce.
pub const VERDICT_SLOTS: usize = 2;

impl StepCheckpoints {
    /// For `--checkpoint-every`; `is_main` is rank 0 (whose clock decides time intervals).
    pub fn new(every: Option<CheckpointEvery>, is_main: bool) -> Self {
        Self {
            every,
            is_main,
            last: Instant::now(),
            writer: BackgroundWriter::default(),
        }
    }

    /// Where the checkpoints are written (rank 0's thread; idle on the others).
    pub fn writer(&mut self) -> &mut BackgroundWriter {
        &mut self.writer
    }

    /// This rank's votes, to be summed with every rank's: [signalled, time is up].
    pub fn votes(&self) -> [f64; VERDICT_SLOTS] {
        let time_up = match self.every {
            Some(CheckpointEvery::Time(t)) => self.is_main && self.last.elapsed() >= t,
            _ => false,
        };
        [
            f64::from(u8::from(signalled())),
            f64::from(u8::from(time_up)),
        ]
    }

    /// The verdict from the summed votes after optimizer step `global_step` (1-based, counted
    /// from the start of training); `last_of_epoch` steps save nothing here (the epoch's
    /// checkpoint follows), unless a signal asks to stop.
    pub fn verdict(
        &mut self,
        summed: &[f64],
        global_step: usize,
        last_of_epoch: bool,
    ) -> StepVerdict {
        let stop = summed.first().is_some_and(|v| *v > 0.0);
        let time_up = summed.get(1).is_some_and(|v| *v > 0.0);
        let step_due =
            matches!(self.every, Some(CheckpointEvery::Steps(n)) if global_step.is_multiple_of(n));
        let save = stop || (!last_of_epoch && (time_up || step_due));
        StepVerdict { save, stop }
    }

    /// A checkpoint was written: the time interval starts again.
    pub fn saved(&mut self) {
        self.last = Instant::now();
    }
}

/// `TRAIN_TRACE_SAMPLES=<dir>`: every rank appends `epoch step index` per trained sample to
/// `<dir>/rank<r>.txt`, so that a test (or a user auditing a resume) can check which samples
/// each rank trained on.
pub struct SampleTrace {
    file: std::fs::File,
}

impl SampleTrace {
    /// Opened when `TRAIN_TRACE_SAMPLES` is set; `None` otherwise or when the file cannot be
    /// opened (a warning says so: tracing is a diagnostic, never a reason to stop training).
    pub fn from_env(rank: usize) -> Option<Self> {
        let dir = PathBuf::from(std::env::var_os("TRAIN_TRACE_SAMPLES")?);
        let path = dir.join(format!("rank{rank}.txt"));
        let opened = std::fs::create_dir_all(&dir).and_then(|()| {
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&path)
        });
        match opened {
            Ok(file) => Some(Self { file }),
            Err(e) => {
                eprintln!(
                    "warning: TRAIN_TRACE_SAMPLES: cannot open {}: {e}",
                    path.display()
                );
                None
            }
        }
    }

    /// Records the samples of one step (padding included: it is trained on).
    pub fn record(&mut self, epoch: usize, step: usize, indices: &[usize]) {
        let mut text = String::with_capacity(indices.len() * 16);
        for index in indices {
            text.push_str(&format!("{epoch} {step} {index}\n"));
        }
        let _ = self.file.write_all(text.as_bytes());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checkpoint_every_reads_steps_and_times() {
        let parse = |s: &str| s.parse::<CheckpointEvery>();
        assert_eq!(parse("500"), Ok(CheckpointEvery::Steps(500)));
        assert_eq!(
            parse("90s"),
            Ok(CheckpointEvery::Time(Duration::from_secs(90)))
        );
        assert_eq!(
            parse("30m"),
            Ok(CheckpointEvery::Time(Duration::from_secs(1800)))
        );
        assert_eq!(
            parse("2h"),
            Ok(CheckpointEvery::Time(Duration::from_secs(7200)))
        );
        for bad in ["0", "", "m", "10d", "-3", "1.5h"] {
            assert!(parse(bad).is_err(), "{bad:?}");
        }
        for every in ["500", "90s", "30m", "2h"] {
            assert_eq!(parse(every).expect(every).to_string(), every);
        }
        let json =
            serde_json::to_string(&CheckpointEvery::Time(Duration::from_secs(1800))).expect("json");
        assert_eq!(json, "\"30m\"");
    }

    #[test]
    fn the_verdict_saves_every_n_steps_but_not_at_the_end_of_an_epoch() {
        let mut every = StepCheckpoints::new(Some(CheckpointEvery::Steps(3)), true);
        let quiet = [0.0, 0.0];
        let saves: Vec<usize> = (1..=10)
            .filter(|&s| every.verdict(&quiet, s, s == 6).save)
            .collect();
        assert_eq!(saves, [3, 9]);
        // A signal on any rank: save and stop, at the end of an epoch too.
        let v = every.verdict(&[1.0, 0.0], 6, true);
        assert!(v.save && v.stop);
        // Rank 0's clock: save, do not stop.
        let v = every.verdict(&[0.0, 1.0], 7, false);
        assert!(v.save && !v.stop);
        let mut never = StepCheckpoints::new(None, true);
        assert_eq!(never.verdict(&quiet, 3, false), StepVerdict::default());
    }

    /// The one test in this binary that signals: a stop signal and its copy within 2 s (the
    /// launcher's forward after SLURM's own) ask for one stop and leave the process running.
    #[test]
    fn a_stop_signal_and_its_copy_ask_for_one_stop() {
        assert!(!signalled());
        install_stop_signals(Some(SaveSignal::Usr2));
        // SAFETY: raise(3) with a signal this process now handles.
        unsafe {
            libc::raise(libc::SIGUSR2);
            libc::raise(libc::SIGUSR2);
        }
        assert!(signalled(), "the first signal asks for a stop");
        assert_ne!(FIRST_SIGNAL_NS.load(Ordering::SeqCst), 0);
        // Still here: the copy did not take the default action (which ends the process).
    }

    #[test]
    fn a_mid_epoch_position_crosses_the_broadcast_array() {
        let at = MidEpoch {
            step: 17,
            samples: 17 * 64,
            totals: MetricSums {
                loss: 12.5,
                top1: 40.0,
                top5: 90.0,
                count: 1088.0,
            },
            elapsed_s: 3.25,
            data_wait_s: 0.5,
        };
        assert_eq!(MidEpoch::from_array(&at.to_array()), Some(at));
        assert_eq!(MidEpoch::from_array(&[0.0; 9]), None);
    }
}
