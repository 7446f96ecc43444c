//! The CPU training loop runs on a worker of rayon's global pool, not on the main thread.
//!
//! Flex's ops and ours split their work over rayon's global pool. Called from a thread outside
//! the pool, every parallel op is queued for the pool's workers while the caller sleeps until
//! they are done: for each of the hundreds of ops in a step, the caller goes to sleep and is
//! woken again, and one more thread than there are cores takes turns on them. Called from one of
//! the pool's workers, an op runs its first part on that thread and the other workers take the
//! rest, as PyTorch's calling thread is one of its OpenMP team. On 2 cores a ResNet-18 step at
//! 32 px ran 12% faster this way, a ResNet-50 step at 224 px 6% (the medians of 5 interleaved
//! rounds' ratios, `benches/RESULTS.md`).
//!
//! The loop blocks a worker when it waits (collectives, a checkpoint write in flight); nothing it
//! waits for needs the global pool: the data loader decodes on its own pool, collectives and the
//! checkpoint writer on their own threads.

/// Runs `job` on a worker of rayon's global pool (on this thread if it is one) and returns its
/// result; a panic in `job` goes on in the caller.
pub fn on_pool_worker<R: Send>(job: impl FnOnce() -> R + Send) -> R {
    // `scope` runs its closure on a worker of the current pool, the global one from outside,
    // and blocks the calling thread until it returns.
    rayon::scope(|_| job())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_job_runs_on_a_worker_of_the_global_pool() {
        assert_eq!(
            rayon::current_thread_index(),
            None,
            "tests run outside the pool"
        );
        let (index, sum) = on_pool_worker(|| {
            use rayon::prelude::*;
            (
                rayon::current_thread_index(),
                (0..1000u64).into_par_iter().sum::<u64>(),
            )
        });
        assert!(index.is_some(), "the job ran outside the pool");
        assert_eq!(sum, 499_500);
    }

    #[test]
    fn a_panic_reaches_the_caller() {
        let caught = std::panic::catch_unwind(|| on_pool_worker(|| panic!("in the job")));
        assert!(caught.is_err());
    }
}
