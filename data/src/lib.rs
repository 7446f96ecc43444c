//! The ImageNet input pipeline: torchvision's `ImageFolder`, JPEG/PNG decoding, torchvision's
//! train and validation transforms, torch's `DistributedSampler`, and a parallel prefetching
//! [`Loader`] for one rank.
//!
//! ```no_run
//! use data::{DistributedSampler, ImageFolder, Loader, LoaderConfig};
//! # fn main() -> Result<(), data::DataError> {
//! let folder = ImageFolder::new("imagenet/train")?;
//! let (world_size, rank) = (2, 0);
//! let sampler = DistributedSampler::new(folder.len(), world_size, rank)?;
//! let mut loader = Loader::new(folder, sampler, LoaderConfig::train(224, 32).with_workers(4))?;
//! for epoch in 0..2 {
//!     let mut batches = loader.epoch(epoch);
//!     for batch in &mut batches {
//!         let batch = batch?;
//!         // let x = batch.images_tensor::<B>(&device); let y = batch.labels_tensor::<B>(&device);
//!         assert_eq!(batch.shape()[1..], [3, 224, 224]);
//!     }
//!     eprintln!("epoch {epoch}: {} bad files skipped", batches.skipped());
//! }
//! # Ok(())
//! # }
//! ```
//!
//! - Determinism: augmentation draws come from [`sample_rng`]`(seed, epoch, index)`, so a batch
//!   is bit-identical whatever the number of workers.
//! - Bad files (empty, truncated, not an image, unreadable) never panic a worker; see
//!   [`BadImagePolicy`].
//! - [`synthetic::generate`] writes a small learnable JPEG dataset for quickstarts and tests.
//!
//! No cargo features.
#![deny(missing_docs)]

pub mod augment;
mod batch;
mod decode;
pub mod erase;
mod error;
mod folder;
mod folder_index;
mod loader;
mod pil_resample;
mod sampler;
mod scale;
mod scan_index;
mod slice_reader;
pub mod synthetic;
pub mod transform;

pub use augment::AutoAugment;
pub use batch::{Batch, BatchImages, f32_images_to_tensor, u8_images_to_tensor};
pub use decode::{
    DecodePlan, ScaledImage, decode_bytes, decode_bytes_plan, decode_bytes_region, decode_file,
    decode_file_plan, decode_file_plan_indexed, decode_file_region, jpeg_end_of_image,
};
pub use erase::RandomErasing;
pub use error::DataError;
pub use folder::{IMAGE_EXTENSIONS, ImageFolder, Sample, has_image_extension};
pub use folder_index::IndexSource;
pub use loader::{
    BadImagePolicy, EpochIter, Loader, LoaderConfig, OutputFormat, repeat_rng, sample_rng,
};
pub use sampler::{DistributedSampler, SampledIndex, repeated_augmentation_indices};
pub use scale::{DecodeScaling, FAITHFUL_FACTOR};
pub use scan_index::ScanIndexCache;
pub use transform::{CropBox, IMAGENET_MEAN, IMAGENET_STD, Interpolation, Resampler, Transform};
