//! Rank 0's progress: an indicatif bar per epoch on a terminal, one plain line every few seconds
//! otherwise (logs, CI, the launcher's pipes). Other ranks show nothing.

use std::io::IsTerminal;
use std::time::{Duration, Instant};

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

/// How often a plain line is printed when stdout is not a terminal.
pub const PLAIN_INTERVAL: Duration = Duration::from_secs(5);

/// Progress of one epoch phase (`Train Epoch #N`, `Validate Epoch #N`).
pub struct Progress {
    label: String,
    total: usize,
    started: Instant,
    mode: Mode,
}

enum Mode {
    Hidden,
    Bar(ProgressBar),
    Plain { last: Instant },
}

impl Progress {
    /// Starts a phase of `total` steps; `visible` is false on every rank but 0.
    pub fn new(visible: bool, label: String, total: usize) -> Self {
        let mode = if !visible {
            Mode::Hidden
        } else if std::io::stdout().is_terminal() {
            let bar =
                ProgressBar::with_draw_target(Some(total as u64), ProgressDrawTarget::stdout());
            let style = ProgressStyle::with_template(
                "{prefix} {bar:25.cyan/blue} {pos:>5}/{len:5} [{elapsed_precise}<{eta_precise}] {msg}",
            )
            .unwrap_or_else(|_| ProgressStyle::default_bar());
            bar.set_style(style.progress_chars("=> "));
            bar.set_prefix(label.clone());
            Mode::Bar(bar)
        } else {
            Mode::Plain {
                last: Instant::now(),
            }
        };
        Self {
            label,
            total,
            started: Instant::now(),
            mode,
        }
    }

    /// Reports that `done` steps are finished, with the current figures.
    pub fn update(&mut self, done: usize, message: &str) {
        match &mut self.mode {
            Mode::Hidden => {}
            Mode::Bar(bar) => {
                bar.set_position(done as u64);
                bar.set_message(message.to_string());
            }
            Mode::Plain { last } => {
                if last.elapsed() >= PLAIN_INTERVAL {
                    *last = Instant::now();
                    println!(
                        "{}",
                        plain_line(
                            &self.label,
                            done,
                            self.total,
                            self.started.elapsed(),
                            message
                        )
                    );
                }
            }
        }
    }

    /// Ends the phase with its final figures.
    pub fn finish(self, message: &str) {
        match self.mode {
            Mode::Hidden => {}
            Mode::Bar(bar) => {
                bar.set_position(self.total as u64);
                bar.finish_with_message(message.to_string());
            }
            Mode::Plain { .. } => {
                println!(
                    "{}",
                    plain_line(
                        &self.label,
                        self.total,
                        self.total,
                        self.started.elapsed(),
                        message
                    )
                );
            }
        }
    }
}

fn plain_line(label: &str, done: usize, total: usize, elapsed: Duration, message: &str) -> String {
    let eta = if done == 0 {
        "?".to_string()
    } else {
        let left = elapsed.as_secs_f64() * (total.saturating_sub(done)) as f64 / done as f64;
        format!("{left:.0}s")
    };
    format!(
        "{label} {done:>5}/{total} [{:.0}s, ETA {eta}] {message}",
        elapsed.as_secs_f64()
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_line_shows_position_and_eta() {
        let line = plain_line(
            "Train Epoch     #2",
            25,
            100,
            Duration::from_secs(10),
            "loss 1.5",
        );
        assert_eq!(line, "Train Epoch     #2    25/100 [10s, ETA 30s] loss 1.5");
    }
}
