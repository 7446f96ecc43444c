//! Checkpoint files written off the training thread.
//!
//! At the step boundary the state is copied to host memory ([`super::encode`]); writing, fsync,
//! rename, reading back and pruning run on a thread while the next steps train. One write is in
//! flight at most: the next checkpoint waits for it, and that wait is counted. A failed write is
//! reported at the next step boundary ([`BackgroundWriter::check`]) and stops the run.

use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::CheckpointError;

/// A background write: what it does once the file is down (read back, prune, say so).
pub type WriteJob = Box<dyn FnOnce() -> Result<(), CheckpointError> + Send + 'static>;

/// One checkpoint write at a time, on its own thread.
#[derive(Default)]
pub struct BackgroundWriter {
    in_flight: Option<JoinHandle<Result<(), CheckpointError>>>,
    waited: Duration,
}

impl BackgroundWriter {
    /// Waits for the write in flight (the wait counts, see [`BackgroundWriter::take_waited`]),
    /// then starts `job`.
    ///
    /// # Errors
    /// The previous write's error: `job` is then not started.
    pub fn submit(&mut self, job: WriteJob) -> Result<(), CheckpointError> {
        let started = Instant::now();
        let previous = self.finish();
        self.waited += started.elapsed();
        previous?;
        match std::thread::Builder::new()
            .name("checkpoint-writer".into())
            .spawn(job)
        {
            Ok(handle) => self.in_flight = Some(handle),
            Err(_) => return Err(CheckpointError::WriterGone),
        }
        Ok(())
    }

    /// At a step boundary: the error of a write that has finished, without waiting for one
    /// still going.
    ///
    /// # Errors
    /// The finished write's error.
    pub fn check(&mut self) -> Result<(), CheckpointError> {
        if self.in_flight.as_ref().is_some_and(JoinHandle::is_finished) {
            return self.finish();
        }
        Ok(())
    }

    /// Waits for the write in flight, if any.
    ///
    /// # Errors
    /// Its error, or [`CheckpointError::WriterGone`] when the thread panicked.
    pub fn finish(&mut self) -> Result<(), CheckpointError> {
        match self.in_flight.take() {
            None => Ok(()),
            Some(handle) => handle.join().unwrap_or(Err(CheckpointError::WriterGone)),
        }
    }

    /// The time steps waited for earlier writes since the last call.
    pub fn take_waited(&mut self) -> Duration {
        std::mem::take(&mut self.waited)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicUsize, Ordering};

    #[test]
    fn one_write_at_a_time_and_errors_surface_at_the_next_boundary() {
        let mut writer = BackgroundWriter::default();
        let done = Arc::new(AtomicUsize::new(0));
        let slow = {
            let done = done.clone();
            Box::new(move || {
                std::thread::sleep(Duration::from_millis(200));
                done.fetch_add(1, Ordering::SeqCst);
                Ok(())
            })
        };
        writer.submit(slow).expect("first write starts");
        // The second waits for the first: it starts only once the first has finished.
        let second = {
            let done = done.clone();
            Box::new(move || {
                assert_eq!(done.load(Ordering::SeqCst), 1, "two writes in flight");
                Ok(())
            })
        };
        writer.submit(second).expect("second write starts");
        assert!(writer.take_waited() > Duration::ZERO);
        writer.finish().expect("second write");

        let failing: WriteJob = Box::new(|| {
            Err(CheckpointError::Io {
                op: "write",
                path: "/full/ckpt-3.ckpt".into(),
                source: std::io::Error::from_raw_os_error(28),
            })
        });
        writer.submit(failing).expect("starts");
        let started = Instant::now();
        let error = loop {
            if let Err(e) = writer.check() {
                break e;
            }
            assert!(
                started.elapsed() < Duration::from_secs(30),
                "never reported"
            );
            std::thread::sleep(Duration::from_millis(5));
        };
        assert!(error.to_string().contains("/full/ckpt-3.ckpt"), "{error}");
        // Reported once; nothing in flight after it.
        writer.check().expect("no second report");
        writer.finish().expect("nothing in flight");

        let panicking: WriteJob = Box::new(|| panic!("disk on fire"));
        writer.submit(panicking).expect("starts");
        assert!(matches!(writer.finish(), Err(CheckpointError::WriterGone)));
    }
}
