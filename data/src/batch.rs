//! `Batch`: what the [`Loader`](crate::Loader) yields, and its conversion to Burn tensors.

use burn::tensor::backend::Backend;
use burn::tensor::{Int, Tensor, TensorData};

use burn::tensor::Bool;

use crate::transform::{CropBox, IMAGENET_MEAN, IMAGENET_STD};

/// Image data of a batch, CHW per sample, samples contiguous (`[n, 3, size, size]`).
#[derive(Debug, Clone, PartialEq)]
pub enum BatchImages {
    /// Raw pixels 0..=255.
    U8(Vec<u8>),
    /// ImageNet-normalised `(x / 255 - mean) / std`.
    F32(Vec<f32>),
}

/// One batch of one rank.
#[derive(Debug, Clone, PartialEq)]
pub struct Batch {
    /// Pixels, `[n, 3, size, size]` row-major.
    pub images: BatchImages,
    /// Class index of each sample.
    pub labels: Vec<i64>,
    /// Dataset index of each sample (after bad-file replacement).
    pub indices: Vec<usize>,
    /// `true` where the sample is a duplicate that metrics must not count: the sampler's
    /// wrap-around padding, or a stand-in for a skipped bad file.
    pub is_padding: Vec<bool>,
    /// Side of each square image.
    pub size: usize,
    /// `RandomErasing`'s box per sample (`None`: not erased). [`images_tensor`](Self::images_tensor)
    /// zeroes it after normalisation for u8 batches; f32 batches hold it zeroed already.
    pub erase: Vec<Option<CropBox>>,
}

impl Batch {
    /// Samples in the batch (the last batch of an epoch may be short).
    pub fn len(&self) -> usize {
        self.labels.len()
    }

    /// Whether the batch is empty.
    pub fn is_empty(&self) -> bool {
        self.labels.is_empty()
    }

    /// `[n, 3, size, size]`.
    pub fn shape(&self) -> [usize; 4] {
        [self.len(), 3, self.size, self.size]
    }

    /// Samples that count for metrics (not padding).
    pub fn num_real(&self) -> usize {
        self.is_padding.iter().filter(|&&p| !p).count()
    }

    /// The images as a normalised float tensor on `device`. u8 batches are normalised by tensor
    /// ops (see [`u8_images_to_tensor`]).
    ///
    /// # Shapes
    /// `[n, 3, size, size]`.
    pub fn images_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 4> {
        match &self.images {
            BatchImages::U8(px) => {
                let x = u8_images_to_tensor(px, self.shape(), device);
                match self.erase_mask::<B>(device) {
                    Some(mask) => x.mask_fill(mask, 0.0),
                    None => x,
                }
            }
            BatchImages::F32(px) => f32_images_to_tensor(px, self.shape(), device),
        }
    }

    /// `true` inside each sample's erase box, broadcast over channels; `None` when nothing is
    /// erased (the common case costs nothing).
    fn erase_mask<B: Backend>(&self, device: &B::Device) -> Option<Tensor<B, 4, Bool>> {
        if self.erase.iter().all(Option::is_none) {
            return None;
        }
        let s = self.size;
        let mut mask = vec![false; self.len() * s * s];
        for (k, erase) in self.erase.iter().enumerate() {
            let Some(e) = erase else { continue };
            let plane = &mut mask[k * s * s..(k + 1) * s * s];
            for row in plane
                .chunks_exact_mut(s)
                .skip(e.top as usize)
                .take(e.height as usize)
            {
                row[e.left as usize..(e.left + e.width) as usize].fill(true);
            }
        }
        let mask: Tensor<B, 4, Bool> =
            Tensor::from_data(TensorData::new(mask, [self.len(), 1, s, s]), device);
        Some(mask.expand(self.shape()))
    }

    /// The labels as an int tensor.
    ///
    /// # Shapes
    /// `[n]`.
    pub fn labels_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 1, Int> {
        Tensor::from_data(TensorData::new(self.labels.clone(), [self.len()]), device)
    }

    /// The non-padding mask as an int tensor (1 = counts, 0 = padding), for exact validation
    /// metrics: `correct = (pred == labels) * mask`.
    ///
    /// # Shapes
    /// `[n]`.
    pub fn mask_tensor<B: Backend>(&self, device: &B::Device) -> Tensor<B, 1, Int> {
        let m: Vec<i64> = self.is_padding.iter().map(|&p| i64::from(!p)).collect();
        Tensor::from_data(TensorData::new(m, [self.len()]), device)
    }
}

/// Turns raw u8 CHW pixels into an ImageNet-normalised float tensor on `device`:
/// `(x / 255 - mean[c]) / std[c]`, computed with tensor ops (on the device for GPU backends).
///
/// # Shapes
/// `shape = [n, 3, h, w]`, output `[n, 3, h, w]`.
///
/// # Panics
/// If `pixels.len()` is not the product of `shape` or `shape[1] != 3`.
pub fn u8_images_to_tensor<B: Backend>(
    pixels: &[u8],
    shape: [usize; 4],
    device: &B::Device,
) -> Tensor<B, 4> {
    assert_eq!(shape[1], 3, "expected 3 channels");
    assert_eq!(pixels.len(), shape.iter().product::<usize>(), "pixel count");
    let x: Tensor<B, 4> = Tensor::from_data(TensorData::new(pixels.to_vec(), shape), device);
    let mean = Tensor::<B, 1>::from_floats(IMAGENET_MEAN, device).reshape([1, 3, 1, 1]);
    let std = Tensor::<B, 1>::from_floats(IMAGENET_STD, device).reshape([1, 3, 1, 1]);
    x.div_scalar(255.0).sub(mean).div(std)
}

/// Uploads already-normalised f32 CHW pixels.
///
/// # Shapes
/// `shape = [n, 3, h, w]`.
///
/// # Panics
/// If `pixels.len()` is not the product of `shape`.
pub fn f32_images_to_tensor<B: Backend>(
    pixels: &[f32],
    shape: [usize; 4],
    device: &B::Device,
) -> Tensor<B, 4> {
    assert_eq!(pixels.len(), shape.iter().product::<usize>(), "pixel count");
    Tensor::from_data(TensorData::new(pixels.to_vec(), shape), device)
}
