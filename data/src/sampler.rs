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
    /// Which copy of `index` this is in the epoch (0 unless the repeated-augmentation sampler
    /// hands the index out several times); it keys the augmentation RNG.
    pub repeat: u32,
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
    repetitions: Option<usize>,
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
            repetitions: None,
        })
    }

    /// Turns this into torchvision's `RASampler` (repeated augmentation, DeiT's): each index of
    /// the permutation is repeated `repetitions` times, the list padded from its start to a
    /// multiple of the world size and rank-strided, and each rank's epoch cut to
    /// `floor(len // 256 · 256 / world_size)` samples. `drop_last` does not apply.
    ///
    /// # Errors
    /// [`DataError::InvalidConfig`] if `repetitions == 0` or the cut leaves no sample (fewer
    /// than 256 images).
    pub fn with_repeated_augmentation(mut self, repetitions: usize) -> Result<Self, DataError> {
        if repetitions == 0 {
            return Err(DataError::InvalidConfig {
                field: "ra_reps",
                got: "0".into(),
                expected: "at least 1",
            });
        }
        self.repetitions = Some(repetitions);
        if self.num_samples() == 0 {
            return Err(DataError::InvalidConfig {
                field: "ra_sampler dataset length",
                got: format!("{} images over {} ranks", self.len, self.world_size),
                expected: "at least 256 images per rank group: RASampler keeps floor(len // 256 * 256 / world) samples per rank",
            });
        }
        Ok(self)
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

    /// The repetitions of the repeated-augmentation sampler, if on.
    pub fn repetitions(&self) -> Option<usize> {
        self.repetitions
    }

    /// Samples per rank per epoch (torch's `num_samples`; `RASampler`'s
    /// `num_selected_samples`).
    pub fn num_samples(&self) -> usize {
        let (n, w) = (self.len, self.world_size);
        if self.repetitions.is_some() {
            return n / 256 * 256 / w;
        }
        if self.drop_last && !n.is_multiple_of(w) {
            // torch: math.ceil((len - num_replicas) / num_replicas); 0 when len < num_replicas.
            n.saturating_sub(w).div_ceil(w)
        } else {
            n.div_ceil(w)
        }
    }

    /// `num_samples · world_size` (for `RASampler`, its padded length
    /// `ceil(len · repetitions / world) · world`).
    pub fn total_size(&self) -> usize {
        match self.repetitions {
            Some(r) => (self.len * r).div_ceil(self.world_size) * self.world_size,
            None => self.num_samples() * self.world_size,
        }
    }

    /// The permutation of the current epoch (identity without shuffle).
    pub fn permutation(&self) -> Vec<usize> {
        let mut order: Vec<usize> = (0..self.len).collect();
        if self.shuffle {
            let mut rng = ChaCha8Rng::seed_from_u64(self.seed.wrapping_add(self.epoch));
            order.shuffle(&mut rng);
        }
        order
    }

    /// The global (all ranks) padded or truncated index list of the current epoch.
    pub fn global_indices(&self) -> Vec<SampledIndex> {
        let order = self.permutation();
        if let Some(r) = self.repetitions {
            return repeated_global(&order, r, self.world_size);
        }
        let total = self.total_size();
        let mut out: Vec<SampledIndex> = order
            .iter()
            .take(total)
            .map(|&index| SampledIndex {
                index,
                is_padding: false,
                repeat: 0,
            })
            .collect();
        if !order.is_empty() {
            let mut k = 0;
            while out.len() < total {
                out.push(SampledIndex {
                    index: order[k % order.len()],
                    is_padding: true,
                    // Same augmentation as the original: padding is for counting, and runs
                    // before repeat keys existed stay bit-identical.
                    repeat: 0,
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
            .take(self.num_samples())
            .collect()
    }
}

/// `RASampler`'s global list from a permutation: each element `repetitions` times in a row,
/// then the list's head appended up to `ceil(len · repetitions / world) · world`. Each entry's
/// `repeat` counts the earlier copies of its index, so every copy gets its own augmentation.
fn repeated_global(order: &[usize], repetitions: usize, world_size: usize) -> Vec<SampledIndex> {
    let total = (order.len() * repetitions).div_ceil(world_size) * world_size;
    let mut out: Vec<SampledIndex> = order
        .iter()
        .flat_map(|&index| {
            (0..repetitions).map(move |r| SampledIndex {
                index,
                is_padding: false,
                repeat: r as u32,
            })
        })
        .collect();
    let base = out.len();
    for k in 0..total.saturating_sub(base) {
        let head = out[k % base.max(1)];
        out.push(SampledIndex {
            repeat: head.repeat + (repetitions * (1 + k / base.max(1))) as u32,
            ..head
        });
    }
    out
}

/// `RASampler`'s indices for `rank` from a given permutation (torchvision's
/// `references/classification/sampler.py`, with the permutation supplied instead of drawn):
/// for checking the mapping against torchvision's code.
pub fn repeated_augmentation_indices(
    permutation: &[usize],
    repetitions: usize,
    world_size: usize,
    rank: usize,
) -> Vec<usize> {
    let selected = permutation.len() / 256 * 256 / world_size;
    repeated_global(permutation, repetitions, world_size)
        .into_iter()
        .skip(rank)
        .step_by(world_size)
        .take(selected)
        .map(|s| s.index)
        .collect()
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
