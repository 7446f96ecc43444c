//! The data of a run: both folders scanned and checked against each other, and this rank's
//! sharded loaders.

use data::{BadImagePolicy, DistributedSampler, ImageFolder, Loader, LoaderConfig};

use crate::TrainError;
use crate::cli::{OnBadImage, TrainArgs, expand_home};

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

/// This rank's validation loader over `folder`: not shuffled, padded duplicates marked.
pub(crate) fn val_loader(
    args: &TrainArgs,
    folder: ImageFolder,
    rank: usize,
    world_size: usize,
) -> Result<Loader, TrainError> {
    let sampler = DistributedSampler::new(folder.len(), world_size, rank)?.with_shuffle(false);
    Ok(Loader::new(
        folder,
        sampler,
        LoaderConfig::val(args.image_size as u32, args.val_batch_size)
            .with_workers(args.workers)
            .with_seed(args.seed)
            .with_policy(bad_image_policy(args)),
    )?)
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

/// Scans both folders, checks they hold the same classes, and builds this rank's sharded loaders.
///
/// # Errors
/// [`TrainError::Data`] naming a missing or empty folder; [`TrainError::ClassMismatch`].
pub fn load_data(args: &TrainArgs, rank: usize, world_size: usize) -> Result<Datasets, TrainError> {
    let train = ImageFolder::new(expand_home(&args.train_dir))?;
    let val = ImageFolder::new(expand_home(&args.val_dir))?;
    check_same_classes(&train, &val)?;
    let num_classes = train.num_classes();
    let train_sampler =
        DistributedSampler::new(train.len(), world_size, rank)?.with_seed(args.seed);
    let train_loader = Loader::new(
        train,
        train_sampler,
        LoaderConfig::train(
            args.image_size as u32,
            args.batch_size * args.batches_per_allreduce,
        )
        .with_workers(args.workers)
        .with_seed(args.seed)
        .with_policy(bad_image_policy(args)),
    )?;
    Ok(Datasets {
        train: train_loader,
        val: val_loader(args, val, rank, world_size)?,
        num_classes,
    })
}
