use burn::module::Module;
use burn::tensor::{Tensor, backend::Backend};

/// A model that maps a batch of images to class logits: what `train` needs to train it.
///
/// Implement it for your own Burn module (one method) and pass the module to the trainer; the
/// ResNets implement it too.
pub trait ImageClassifier<B: Backend>: Module<B> {
    /// Class logits for a batch of normalised images.
    ///
    /// # Shapes
    /// - `images`: `[N, 3, H, W]`
    /// - returns: `[N, num_classes]`
    fn classify(&self, images: Tensor<B, 4>) -> Tensor<B, 2>;
}
