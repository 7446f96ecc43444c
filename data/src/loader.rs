//! `Loader`: parallel decode + transform of one rank's batches, with a bounded prefetch queue.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use crossbeam_channel::{Receiver, bounded};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rayon::prelude::*;

use crate::decode::{decode_file_for_loader, recycle_pixels};
use crate::erase::zero_box_chw;
use crate::sampler::{DistributedSampler, SampledIndex};
use crate::scale::DecodeScaling;
use crate::scan_index::ScanIndexCache;
use crate::transform::{CropBox, Resampler, Transform, normalize_chw};
use crate::{Batch, BatchImages, DataError, ImageFolder};

/// What to do with a file that cannot be read or decoded.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BadImagePolicy {
    /// Warn once per file on stderr (path and reason), replace the sample by the next good one
    /// in this rank's order (so the batch keeps its size), count it in
    /// [`EpochIter::skipped`].
    #[default]
    Skip,
    /// Stop at the first bad file with [`DataError::BadImage`] naming it.
    Strict,
}

/// Element type of [`Batch::images`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum OutputFormat {
    /// Raw `u8` CHW pixels, normalised on the device by [`Batch::images_tensor`] (4× less memory
    /// in the queue and less host work).
    #[default]
    U8,
    /// `f32` CHW, already normalised with ImageNet mean/std on the host.
    F32,
}

/// Settings of a [`Loader`].
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LoaderConfig {
    /// Samples per batch (the last batch of an epoch may be smaller).
    pub batch_size: usize,
    /// Decode threads (a rayon pool private to the loader).
    pub workers: usize,
    /// Batches kept ready ahead of the consumer (at least 1).
    pub prefetch: usize,
    /// Seed of the augmentation randomness; each sample's RNG is [`sample_rng`]`(seed, epoch,
    /// index)`, so batches do not depend on `workers`.
    pub seed: u64,
    /// The per-sample transform.
    pub transform: Transform,
    /// u8 or normalised f32 images.
    pub output: OutputFormat,
    /// Bad-file policy.
    pub policy: BadImagePolicy,
    /// Which resizer to use.
    pub resampler: Resampler,
    /// Decode only the pixels the transform reads: the training crop, validation's center crop
    /// and its resize's support (the default; the batches are the same either way). `false`
    /// decodes whole images, for benchmarks.
    pub decode_region: bool,
    /// When to decode a JPEG at 1/2, 1/4 or 1/8 of its size (DCT-domain downscaling): by
    /// default only where the output stays as close to torchvision's as a full decode.
    pub decode_scaling: DecodeScaling,
    /// Bytes the loader may spend remembering where each JPEG's MCU rows start, so that from
    /// the second epoch on a crop's decode skips the rows above it and the columns beside it
    /// ([`ScanIndexCache`]; 1.2 KB per 500 × 375 file; 2 GiB by default, which holds all of
    /// ImageNet's 1.28 M training files, ~1.6 GB). Files past the budget decode as in the
    /// first epoch; 0 turns it off. The batches are the same either way.
    pub scan_index_budget: usize,
}

impl LoaderConfig {
    /// Training defaults: `Transform::train(size)`, 4 workers, 2 batches of prefetch, seed 0,
    /// u8 output, skip bad files.
    pub fn train(size: u32, batch_size: usize) -> Self {
        Self {
            batch_size,
            workers: 4,
            prefetch: 2,
            seed: 0,
            transform: Transform::train(size),
            output: OutputFormat::U8,
            policy: BadImagePolicy::Skip,
            resampler: Resampler::default(),
            decode_region: true,
            decode_scaling: DecodeScaling::default(),
            scan_index_budget: 2 << 30,
        }
    }

    /// Validation defaults: as [`train`](Self::train) with `Transform::val(size)`.
    pub fn val(size: u32, batch_size: usize) -> Self {
        Self {
            transform: Transform::val(size),
            ..Self::train(size, batch_size)
        }
    }

    /// Sets `workers`.
    pub fn with_workers(mut self, workers: usize) -> Self {
        self.workers = workers;
        self
    }

    /// Sets `prefetch`.
    pub fn with_prefetch(mut self, prefetch: usize) -> Self {
        self.prefetch = prefetch;
        self
    }

    /// Sets `seed`.
    pub fn with_seed(mut self, seed: u64) -> Self {
        self.seed = seed;
        self
    }

    /// Sets `output`.
    pub fn with_output(mut self, output: OutputFormat) -> Self {
        self.output = output;
        self
    }

    /// Sets `policy`.
    pub fn with_policy(mut self, policy: BadImagePolicy) -> Self {
        self.policy = policy;
        self
    }

    /// Sets `resampler`.
    pub fn with_resampler(mut self, resampler: Resampler) -> Self {
        self.resampler = resampler;
        self
    }

    /// Sets `decode_scaling`.
    pub fn with_decode_scaling(mut self, decode_scaling: DecodeScaling) -> Self {
        self.decode_scaling = decode_scaling;
        self
    }

    /// Sets `scan_index_budget` (bytes; 0 turns scan indexes off).
    pub fn with_scan_index_budget(mut self, bytes: usize) -> Self {
        self.scan_index_budget = bytes;
        self
    }

    /// Sets `decode_region`.
    pub fn with_decode_region(mut self, decode_region: bool) -> Self {
        self.decode_region = decode_region;
        self
    }
}

fn splitmix64(mut x: u64) -> u64 {
    x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
    x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    x ^ (x >> 31)
}

/// The augmentation RNG of dataset sample `index` in `epoch`: ChaCha8 seeded by a SplitMix64 hash
/// of `(seed, epoch, index)`.
pub fn sample_rng(seed: u64, epoch: u64, index: usize) -> ChaCha8Rng {
    let h = splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ index as u64);
    ChaCha8Rng::seed_from_u64(h)
}

/// The augmentation RNG of the `repeat`-th copy of sample `index` in `epoch` (the repeated
/// augmentation sampler hands out each index several times, and each copy must be augmented
/// differently); copy 0 is [`sample_rng`], so runs without repeats are unchanged.
pub fn repeat_rng(seed: u64, epoch: u64, index: usize, repeat: u32) -> ChaCha8Rng {
    if repeat == 0 {
        return sample_rng(seed, epoch, index);
    }
    let h = splitmix64(
        splitmix64(splitmix64(splitmix64(seed) ^ epoch) ^ index as u64) ^ u64::from(repeat),
    );
    ChaCha8Rng::seed_from_u64(h)
}

/// Files found bad so far: dataset index → reason.
type BadFiles = Arc<Mutex<HashMap<usize, String>>>;

/// Loads one rank's batches: the sampler's order, decoded and transformed by a private rayon
/// pool, `prefetch` batches ahead on a background thread.
pub struct Loader {
    folder: Arc<ImageFolder>,
    sampler: DistributedSampler,
    config: LoaderConfig,
    pool: Arc<rayon::ThreadPool>,
    bad: BadFiles,
    scan_index: Option<Arc<ScanIndexCache>>,
}

impl std::fmt::Debug for Loader {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Loader")
            .field("root", &self.folder.root())
            .field("sampler", &self.sampler)
            .field("config", &self.config)
            .finish()
    }
}

impl Loader {
    /// Creates a loader of `folder` for the rank described by `sampler`.
    ///
    /// # Errors
    /// [`DataError::InvalidConfig`] for `batch_size == 0`, `workers == 0`, a zero output size or a
    /// sampler built for another dataset length; [`DataError::ThreadPool`] if the threads cannot
    /// start.
    pub fn new(
        folder: impl Into<Arc<ImageFolder>>,
        sampler: DistributedSampler,
        config: LoaderConfig,
    ) -> Result<Self, DataError> {
        let folder = folder.into();
        let invalid = |field, got: usize, expected| DataError::InvalidConfig {
            field,
            got: got.to_string(),
            expected,
        };
        if config.batch_size == 0 {
            return Err(invalid("batch_size", 0, "at least 1"));
        }
        if config.workers == 0 {
            return Err(invalid("workers", 0, "at least 1"));
        }
        if config.transform.size() == 0 {
            return Err(invalid("transform size", 0, "at least 1 pixel"));
        }
        if sampler.dataset_len() != folder.len() {
            return Err(invalid(
                "sampler dataset length",
                sampler.dataset_len(),
                "the ImageFolder's length (build the sampler with folder.len())",
            ));
        }
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(config.workers)
            .thread_name(|i| format!("data-worker-{i}"))
            .build()
            .map_err(|e| DataError::ThreadPool {
                workers: config.workers,
                reason: e.to_string(),
            })?;
        let scan_index = (config.scan_index_budget > 0 && config.decode_region)
            .then(|| Arc::new(ScanIndexCache::new(folder.len(), config.scan_index_budget)));
        Ok(Self {
            folder,
            sampler,
            config,
            pool: Arc::new(pool),
            bad: Arc::default(),
            scan_index,
        })
    }

    /// Bytes of scan indexes held (see [`LoaderConfig::scan_index_budget`]).
    pub fn scan_index_bytes(&self) -> usize {
        self.scan_index.as_ref().map_or(0, |c| c.bytes())
    }

    /// The dataset.
    pub fn folder(&self) -> &ImageFolder {
        &self.folder
    }

    /// The sampler (its epoch is the last one iterated).
    pub fn sampler(&self) -> &DistributedSampler {
        &self.sampler
    }

    /// The configuration.
    pub fn config(&self) -> &LoaderConfig {
        &self.config
    }

    /// Batches per epoch for this rank (`ceil(num_samples / batch_size)`).
    pub fn batches_per_epoch(&self) -> usize {
        self.sampler.num_samples().div_ceil(self.config.batch_size)
    }

    /// Every file found bad so far (all epochs), sorted by path, with the reason.
    pub fn bad_files(&self) -> Vec<(PathBuf, String)> {
        let bad = self.bad.lock().unwrap_or_else(PoisonError::into_inner);
        let mut out: Vec<_> = bad
            .iter()
            .map(|(&i, r)| (self.folder.samples()[i].path.clone(), r.clone()))
            .collect();
        out.sort();
        out
    }

    /// Starts `epoch` (calls the sampler's `set_epoch`) and returns its batches in order.
    ///
    /// Dropping the iterator early stops the background thread after the batch in progress.
    pub fn epoch(&mut self, epoch: u64) -> EpochIter {
        self.epoch_from(epoch, 0)
    }

    /// [`Loader::epoch`] from batch `first_batch` on, as if the earlier ones had been taken: a
    /// run resumed in the middle of an epoch gets the batches, samples and augmentations an
    /// uninterrupted one would have got next (each is a function of the seed, the epoch and the
    /// sample), without decoding the skipped ones.
    pub fn epoch_from(&mut self, epoch: u64, first_batch: usize) -> EpochIter {
        self.sampler.set_epoch(epoch);
        let positions = Arc::new(self.sampler.indices());
        let (tx, rx) = bounded(self.config.prefetch.max(1));
        let skipped = Arc::new(AtomicUsize::new(0));
        let job = BatchJob {
            folder: Arc::clone(&self.folder),
            config: self.config,
            epoch,
            positions,
            bad: Arc::clone(&self.bad),
            skipped: Arc::clone(&skipped),
            scan_index: self.scan_index.clone(),
        };
        let pool = Arc::clone(&self.pool);
        let handle = std::thread::Builder::new()
            .name("data-prefetch".into())
            .spawn(move || {
                let n = job.positions.len();
                let mut start = first_batch.saturating_mul(job.config.batch_size).min(n);
                while start < n {
                    let end = (start + job.config.batch_size).min(n);
                    let batch = pool.install(|| job.build(start, end));
                    let failed = batch.is_err();
                    if tx.send(batch).is_err() || failed {
                        break;
                    }
                    start = end;
                }
            });
        match handle {
            Ok(handle) => EpochIter {
                rx: Some(rx),
                handle: Some(handle),
                skipped,
                spawn_error: None,
            },
            Err(e) => EpochIter {
                rx: None,
                handle: None,
                skipped,
                spawn_error: Some(DataError::ThreadPool {
                    workers: 1,
                    reason: format!("cannot spawn the prefetch thread: {e}"),
                }),
            },
        }
    }
}

/// Everything the prefetch thread needs to build batches of one epoch.
struct BatchJob {
    folder: Arc<ImageFolder>,
    config: LoaderConfig,
    epoch: u64,
    positions: Arc<Vec<SampledIndex>>,
    bad: BadFiles,
    skipped: Arc<AtomicUsize>,
    scan_index: Option<Arc<ScanIndexCache>>,
}

impl BatchJob {
    fn sample_len(&self) -> usize {
        let s = self.config.transform.size() as usize;
        3 * s * s
    }

    /// Decodes and transforms dataset sample `index` (its `repeat`-th copy in the epoch) into
    /// `out`, returning the erase box; on failure returns the reason (and remembers the file as
    /// bad, warning once).
    fn load_into(
        &self,
        index: usize,
        repeat: u32,
        out: &mut [u8],
    ) -> Result<Option<CropBox>, String> {
        if let Some(reason) = self
            .bad
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&index)
        {
            return Err(reason.clone());
        }
        let path = &self.folder.samples()[index].path;
        let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            let transform = &self.config.transform;
            let mut rng = repeat_rng(self.config.seed, self.epoch, index, repeat);
            // The crop is drawn from the header's size so that only the pixels the transform
            // reads are decoded.
            let mut drawn = None;
            let plan = |w, h, scales: &[u32]| {
                let crop = transform.draw_crop(w, h, &mut rng);
                drawn = Some(crop);
                let mut plan = transform.plan(
                    w,
                    h,
                    crop,
                    self.config.resampler,
                    self.config.decode_scaling,
                    scales,
                );
                if !self.config.decode_region {
                    plan.region = None;
                }
                plan
            };
            let marks = self.scan_index.as_deref().map(|cache| (cache, index));
            let img = decode_file_for_loader(path, plan, marks).map_err(|e| match e {
                DataError::BadImage { reason, .. } => reason,
                other => other.to_string(),
            })?;
            let crop = drawn.expect("decode_file_plan asks every image it decodes for its plan");
            let erased = transform.apply_scaled(&img, crop, &mut rng, self.config.resampler, out);
            recycle_pixels(img.image.into_raw());
            Ok(erased)
        }))
        .unwrap_or_else(|_| Err("the transform panicked on this image".to_string()));
        if let Err(reason) = &result {
            let mut bad = self.bad.lock().unwrap_or_else(PoisonError::into_inner);
            if bad.insert(index, reason.clone()).is_none()
                && self.config.policy == BadImagePolicy::Skip
            {
                eprintln!("warning: skipping bad image {}: {reason}", path.display());
            }
        }
        result
    }

    fn build(&self, start: usize, end: usize) -> Result<Batch, DataError> {
        let len = self.sample_len();
        let n = end - start;
        let positions = &self.positions[start..end];
        let mut pixels = vec![0u8; n * len];
        let outcomes: Vec<Result<Option<CropBox>, String>> = pixels
            .par_chunks_mut(len)
            .zip(positions.par_iter())
            .map(|(out, p)| self.load_into(p.index, p.repeat, out))
            .collect();
        let mut erase = vec![None; n];
        let mut indices: Vec<usize> = positions.iter().map(|p| p.index).collect();
        let mut is_padding: Vec<bool> = positions.iter().map(|p| p.is_padding).collect();
        for (k, outcome) in outcomes.into_iter().enumerate() {
            let reason = match outcome {
                Ok(e) => {
                    erase[k] = e;
                    continue;
                }
                Err(reason) => reason,
            };
            let path = self.folder.samples()[indices[k]].path.clone();
            if self.config.policy == BadImagePolicy::Strict {
                return Err(DataError::BadImage { path, reason });
            }
            self.skipped.fetch_add(1, Ordering::Relaxed);
            // Next good sample in this rank's order, wrapping around the epoch.
            let total = self.positions.len();
            let out = &mut pixels[k * len..(k + 1) * len];
            let replacement = (1..total)
                .map(|j| self.positions[(start + k + j) % total])
                .find_map(|p| Some((p.index, self.load_into(p.index, p.repeat, out).ok()?)));
            let Some((i, e)) = replacement else {
                return Err(DataError::NoReplacement { path });
            };
            indices[k] = i;
            erase[k] = e;
            // A stand-in is a duplicate: metrics must not count it.
            is_padding[k] = true;
        }
        let labels = indices
            .iter()
            .map(|&i| self.folder.samples()[i].label as i64)
            .collect();
        let images = match self.config.output {
            OutputFormat::U8 => BatchImages::U8(pixels),
            OutputFormat::F32 => {
                let mut f = vec![0f32; pixels.len()];
                let size = self.config.transform.size() as usize;
                f.par_chunks_mut(len)
                    .zip(pixels.par_chunks(len))
                    .zip(erase.par_iter())
                    .for_each(|((o, x), e)| {
                        normalize_chw(x, o);
                        if let Some(e) = e {
                            zero_box_chw(o, size, *e);
                        }
                    });
                BatchImages::F32(f)
            }
        };
        Ok(Batch {
            images,
            labels,
            indices,
            is_padding,
            size: self.config.transform.size() as usize,
            erase,
        })
    }
}

/// The batches of one epoch, in the sampler's order.
///
/// Yields `Err` once (then ends) when a bad file stops the epoch under
/// [`BadImagePolicy::Strict`].
#[derive(Debug)]
pub struct EpochIter {
    rx: Option<Receiver<Result<Batch, DataError>>>,
    handle: Option<JoinHandle<()>>,
    skipped: Arc<AtomicUsize>,
    spawn_error: Option<DataError>,
}

impl EpochIter {
    /// Bad files skipped (and replaced) so far in this epoch; read it after the last batch for
    /// the epoch's total.
    pub fn skipped(&self) -> usize {
        self.skipped.load(Ordering::Relaxed)
    }
}

impl Iterator for EpochIter {
    type Item = Result<Batch, DataError>;

    fn next(&mut self) -> Option<Self::Item> {
        if let Some(e) = self.spawn_error.take() {
            return Some(Err(e));
        }
        let item = self.rx.as_ref()?.recv().ok();
        if item.is_none() {
            self.rx = None;
        }
        item
    }
}

impl Drop for EpochIter {
    fn drop(&mut self) {
        // Disconnect first so the producer's next send fails and it exits.
        self.rx = None;
        if let Some(h) = self.handle.take() {
            let _ = h.join();
        }
    }
}
