//! The data of a run: both folders scanned and checked against each other, and this rank's
//! sharded loaders.

use std::path::{Path, PathBuf};

use data::{
    AutoAugment, BadImagePolicy, DistributedSampler, ImageFolder, IndexSource, Interpolation,
    Loader, LoaderConfig, Transform,
};

use crate::TrainError;
use crate::cli::{AutoAugmentPolicy, Interp, OnBadImage, TrainArgs, expand_home};

/// The loaders of one rank.
pub struct Datasets {
    /// Training batches (`batch_size × batches_per_allreduce` per loader batch).
    pub train: Loader,
    /// Validation batches.
    pub val: Loader,
    /// Number of classes.
    pub num_classes: usize,
}

fn bad_image_policy(args: &TrainArgs) -> BadImagePolicy {
    match args.on_bad_image {
        OnBadImage::Skip => BadImagePolicy::Skip,
        OnBadImage::Strict => BadImagePolicy::Strict,
    }
}

fn interpolation(args: &TrainArgs) -> Interpolation {
    match args.interpolation {
        Interp::Bilinear => Interpolation::Bilinear,
        Interp::Bicubic => Interpolation::Bicubic,
        Interp::Nearest => Interpolation::Nearest,
    }
}

/// The training transform: `--train-crop-size` (default `--image-size`), the automatic
/// augmentation and `RandomErasing` if asked.
pub(crate) fn train_transform(args: &TrainArgs) -> Transform {
    let size = args.train_crop_size.unwrap_or(args.image_size) as u32;
    let policy = args.auto_augment.map(|p| match p {
        AutoAugmentPolicy::TaWide => AutoAugment::TrivialAugmentWide,
        AutoAugmentPolicy::Ra => AutoAugment::RandAugment {
            num_ops: 2,
            magnitude: args.ra_magnitude,
        },
        AutoAugmentPolicy::Imagenet => AutoAugment::ImageNet,
    });
    Transform::train(size)
        .with_interpolation(interpolation(args))
        .with_auto_augment(policy)
        .with_random_erase(args.random_erase)
}

/// The validation transform: `--val-resize-size` / `--val-crop-size`, each defaulting to what
/// `--image-size` gave before they existed (`round(size × 256 / 224)` and `size`).
pub(crate) fn val_transform(args: &TrainArgs) -> Transform {
    let Transform::Val { resize, size, .. } = Transform::val(args.image_size as u32) else {
        unreachable!("Transform::val is a Val")
    };
    let resize = args.val_resize_size.map_or(resize, |r| r as u32);
    let crop = args.val_crop_size.map_or(size, |c| c as u32);
    Transform::val_sizes(resize, crop).with_interpolation(interpolation(args))
}

/// The config table's line on sizes and augmentation: `--image-size`'s alone when no recipe
/// flag changes anything, else the train crop, its augmentations and the validation sizes.
pub(crate) fn describe_sizes(args: &TrainArgs) -> String {
    let size = args.image_size as u32;
    let (train, val) = (train_transform(args), val_transform(args));
    if train == Transform::train(size) && val == Transform::val(size) && !args.ra_sampler {
        return format!("{size} px");
    }
    let mut extra = Vec::new();
    if let Transform::Train {
        auto_augment: Some(policy),
        ..
    } = train
    {
        extra.push(format!("{policy:?}"));
    }
    if args.random_erase > 0.0 {
        extra.push(format!("erase {}", args.random_erase));
    }
    if args.ra_sampler {
        extra.push(format!("RASampler x{}", args.ra_reps));
    }
    let Transform::Val {
        resize, size: crop, ..
    } = val
    else {
        unreachable!("val_transform is a Val")
    };
    format!(
        "train crop {} px{}, val resize {resize} -> crop {crop} px, {:?}",
        train.size(),
        if extra.is_empty() {
            String::new()
        } else {
            format!(" ({})", extra.join(", "))
        },
        args.interpolation
    )
}

/// This rank's validation loader over `folder`: not shuffled, padded duplicates marked.
pub(crate) fn val_loader(
    args: &TrainArgs,
    folder: ImageFolder,
    rank: usize,
    world_size: usize,
) -> Result<Loader, TrainError> {
    let sampler = DistributedSampler::new(folder.len(), world_size, rank)?.with_shuffle(false);
    let mut config = LoaderConfig::val(args.image_size as u32, args.val_batch_size)
        .with_workers(args.workers)
        .with_seed(args.seed)
        .with_policy(bad_image_policy(args))
        .with_decode_scaling(args.decode_scaling.into())
        .with_scan_index_budget(args.scan_index_mib.saturating_mul(1 << 20));
    config.transform = val_transform(args);
    Ok(Loader::new(folder, sampler, config)?)
}

/// Labels are indices into the sorted class names: both folders must have the same names.
fn check_same_classes(train: &ImageFolder, val: &ImageFolder) -> Result<(), TrainError> {
    if train.classes() == val.classes() {
        return Ok(());
    }
    let only = |a: &ImageFolder, b: &ImageFolder| -> Vec<String> {
        a.classes()
            .iter()
            .filter(|c| b.classes().binary_search(c).is_err())
            .cloned()
            .collect()
    };
    Err(TrainError::ClassMismatch {
        train: train.root().to_path_buf(),
        train_classes: train.num_classes(),
        val: val.root().to_path_buf(),
        val_classes: val.num_classes(),
        only_in_train: only(train, val),
        only_in_val: only(val, train),
    })
}

/// Where the file lists of the dataset folders are cached between processes and runs.
pub fn folder_index_dir() -> PathBuf {
    crate::cuda_setup::cache_root().join("image-folder-index")
}

/// The folder at `root`, listed once per machine: the first process to get there scans and
/// caches the list, the others (and later runs) read it while the folders are unchanged.
fn open_folder(root: &Path, rank: usize) -> Result<ImageFolder, TrainError> {
    let (folder, source) = ImageFolder::with_index(root, &folder_index_dir())?;
    if rank == 0 {
        match source {
            IndexSource::Read(index) => println!(
                "{}: {} files, list read from {}",
                root.display(),
                folder.len(),
                index.display()
            ),
            IndexSource::Scanned(index) => println!(
                "{}: {} files, scanned; list cached in {}",
                root.display(),
                folder.len(),
                index.display()
            ),
            IndexSource::ScannedNotCached(why) => println!(
                "{}: {} files, scanned; list not cached ({why})",
                root.display(),
                folder.len()
            ),
        }
    }
    Ok(folder)
}

/// Scans both folders, checks they hold the same classes, and builds this rank's sharded loaders.
///
/// # Errors
/// [`TrainError::Data`] naming a missing or empty folder; [`TrainError::ClassMismatch`].
pub fn load_data(args: &TrainArgs, rank: usize, world_size: usize) -> Result<Datasets, TrainError> {
    let train = open_folder(&expand_home(&args.train_dir), rank)?;
    let val = open_folder(&expand_home(&args.val_dir), rank)?;
    check_same_classes(&train, &val)?;
    let num_classes = train.num_classes();
    let mut train_sampler =
        DistributedSampler::new(train.len(), world_size, rank)?.with_seed(args.seed);
    if args.ra_sampler {
        train_sampler = train_sampler.with_repeated_augmentation(args.ra_reps)?;
    }
    let mut train_config = LoaderConfig::train(
        args.image_size as u32,
        args.batch_size * args.batches_per_allreduce,
    )
    .with_workers(args.workers)
    .with_seed(args.seed)
    .with_policy(bad_image_policy(args))
    .with_decode_scaling(args.decode_scaling.into())
    .with_scan_index_budget(args.scan_index_mib.saturating_mul(1 << 20));
    train_config.transform = train_transform(args);
    let train_loader = Loader::new(train, train_sampler, train_config)?;
    Ok(Datasets {
        train: train_loader,
        val: val_loader(args, val, rank, world_size)?,
        num_classes,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cli::tests::parse;

    #[test]
    fn without_recipe_flags_the_transforms_are_the_image_size_ones() {
        for size in ["32", "224", "160"] {
            let a = parse(&["--image-size", size]);
            let s: u32 = size.parse().expect("int");
            assert_eq!(train_transform(&a), Transform::train(s));
            assert_eq!(val_transform(&a), Transform::val(s));
            assert_eq!(describe_sizes(&a), format!("{s} px"));
        }
    }

    #[test]
    fn recipe_flags_reach_the_transforms() {
        let a = parse(&[
            "--auto-augment",
            "ta_wide",
            "--random-erase",
            "0.1",
            "--train-crop-size",
            "176",
            "--val-resize-size",
            "232",
            "--interpolation",
            "bicubic",
        ]);
        let want = Transform::train(176)
            .with_interpolation(Interpolation::Bicubic)
            .with_auto_augment(Some(AutoAugment::TrivialAugmentWide))
            .with_random_erase(0.1);
        assert_eq!(train_transform(&a), want);
        assert_eq!(
            val_transform(&a),
            Transform::val_sizes(232, 224).with_interpolation(Interpolation::Bicubic)
        );
        assert_eq!(
            describe_sizes(&a),
            "train crop 176 px (TrivialAugmentWide, erase 0.1), val resize 232 -> crop 224 px, \
             Bicubic"
        );
    }
}
