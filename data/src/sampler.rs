//! `DistributedSampler`: torch's sharding of a dataset across ranks.

use rand::SeedableRng;
use rand::seq::SliceRandom;
use rand_chacha::ChaCha8Rng;

use crate::DataError;

/// One position of a rank's epoch order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SampledIndex {
    /// Index into the dataset.
    pub index: usize,
    /// `true` for the wrap-around duplicates added so every rank gets the same count; validation
    /// must not count these.
    pub is_padding: bool,
}

/// torch's `torch.utils.data.DistributedSampler`, same semantics:
///
/// - `num_samples = ceil(len / world_size)`, or with `drop_last` and `len % world_size != 0`,
///   `ceil((len - world_size) / world_size)`; `total_size = num_samples · world_size`.
/// - With `shuffle`, one permutation of `0..len` from `(seed + epoch)`, identical on every rank.
///   (The permutation comes from ChaCha8, so it differs from torch's `randperm`; every other
///   rule is torch's.)
/// - Without `drop_last`, the list is padded to `total_size` by repeating it from the start (as
///   many times as needed); with `drop_last` it is truncated to `total_size`.
/// - Rank `r` takes positions `r, r + world_size, r + 2·world_size, …`.
/// - [`set_epoch`](Self::set_epoch) changes the permutation; call it before every epoch.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    len: usize,
    world_size: usize,
    rank: usize,
    shuffle: bool,
    seed: u64,
    drop_last: bool,
    epoch: u64,
}

impl DistributedSampler {
    /// A shuffling sampler with `seed = 0` and `drop_last = false` (torch's defaults).
    ///
    /// # Errors
    /// [`DataError::InvalidConfig`] if `world_size == 0` or `rank >= world_size`.
    pub fn new(len: usize, world_size: usize, rank: usize) -> Result<Self, DataError> {
        if world_size == 0 {
            return Err(DataError::InvalidConfig {
                field: "world_size",
                got: "0".into(),
                expected: "at least 1",
            });
        }
        if rank >= world_size {
            return Err(DataError::InvalidConfig {
                field: "rank",
                got: format!("{rank} (world_size {world_size})"),
                expected: "0 <= rank < world_size",
            });
        }
        Ok(Self {
            len,
            world_size,
            rank,
            shuffle: true,
            seed: 0,
            drop_last: false,
            epoch: 0,
        })
    }

    /// Sets whether to shuffle (default `true`).
    pub fn with_shuffle(mut self, shuffle: bool) -> Self {
        self.shuffle = shuffle;
        self
    }

    /// Sets the seed shared by all ranks (default 0, as torch and Horovod's example).
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets `drop_last` (default `false`: pad instead).
    pub fn with_drop_last(mut self, drop_last: bool) -> Self {
        self.drop_last = drop_last;
        self
    }

    /// Sets the epoch used for the permutation.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The current epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// The seed.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn world_size(&self) -> usize {
        self.world_size
    }

    /// Dataset length.
    pub fn dataset_len(&self) -> usize {
        self.len
    }

    /// Samples per rank per epoch (torch's `num_samples`).
    pub fn num_samples(&self) -> usize {
        let (n, w) = (self.len, self.world_size);
        if self.drop_last && !n.is_multiple_of(w) {
            // torch: math.ceil((len - num_replicas) / num_replicas); 0 when len < num_replicas.
            n.saturating_sub(w).div_ceil(w)
        } else {
            n.div_ceil(w)
        }
    }

    /// `num_samples · world_size`.
    pub fn total_size(&self) -> usize {
        self.num_samples() * self.world_size
    }

    /// The global (all ranks) padded or truncated index list of the current epoch.
    pub fn global_indices(&self) -> Vec<SampledIndex> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(self.epoch));
            order.shuffle(&mut rng);
        }
        let total = self.total_size();
        let mut out: Vec<SampledIndex> = order
            .iter()
            .take(total)
            .map(|&index| SampledIndex {
                index,
                is_padding: false,
            })
            .collect();
        if !order.is_empty() {
            let mut k = 0;
            while out.len() < total {
                out.push(SampledIndex {
                    index: order[k % order.len()],
                    is_padding: true,
                });
                k += 1;
            }
        }
        out
    }

    /// This rank's positions for the current epoch, in order, with their padding flags.
    pub fn indices(&self) -> Vec<SampledIndex> {
        self.global_indices()
            .into_iter()
            .skip(self.rank)
            .step_by(self.world_size)
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_match_torch() {
        // torch: len 10, 4 replicas -> num_samples 3, total 12; drop_last -> ceil(6/4) = 2.
        let s = DistributedSampler::new(10, 4, 0).expect("valid");
        assert_eq!((s.num_samples(), s.total_size()), (3, 12));
        let s = s.with_drop_last(true);
        assert_eq!((s.num_samples(), s.total_size()), (2, 8));
        let s = DistributedSampler::new(3, 4, 0)
            .expect("valid")
            .with_drop_last(true);
        assert_eq!(s.num_samples(), 0);
        assert!(DistributedSampler::new(3, 0, 0).is_err());
        assert!(DistributedSampler::new(3, 2, 2).is_err());
    }
}
