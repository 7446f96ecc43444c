//! The edges of our backend extensions: Burn's `Tensor` to and from backend primitives, and Flex
//! tensors to and from contiguous `f32` buffers for the CPU kernels.

use burn::tensor::backend::Backend;
use burn::tensor::ops::FloatTensor;
use burn::tensor::{Shape, Tensor, TensorData, TensorPrimitive};
use burn_flex::FlexTensor;

/// A float primitive as a `Tensor`.
pub(crate) fn float<B: Backend, const D: usize>(t: FloatTensor<B>) -> Tensor<B, D> {
    Tensor::from_primitive(TensorPrimitive::Float(t))
}

/// A float `Tensor` as its primitive.
pub(crate) fn primitive<B: Backend, const D: usize>(t: Tensor<B, D>) -> FloatTensor<B> {
    t.into_primitive().tensor()
}

/// The tensor with its elements contiguous, in order, and nothing else in its storage; copies
/// only a strided or offset layout.
pub(crate) fn contiguous(t: FlexTensor) -> FlexTensor {
    t.to_contiguous()
}

/// The `f32` elements of a tensor that went through [`contiguous`] (then its storage is exactly
/// the tensor).
pub(crate) fn values(t: &FlexTensor) -> &[f32] {
    t.storage::<f32>()
}

/// A Flex tensor owning `values`, laid out contiguously in `shape`.
pub(crate) fn flex_f32(values: Vec<f32>, shape: &[usize]) -> FlexTensor {
    FlexTensor::from_data(TensorData::new(values, Shape::from(shape.to_vec())))
}
