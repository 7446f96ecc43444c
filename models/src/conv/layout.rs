//! How a CUDA tensor's memory is described to cuDNN.
//!
//! cubecl-cuda allocates most tensors with a pitched layout: each row (the last dimension) is
//! padded to a power of two of bytes, up to 512 B (`PitchedMemoryLayoutPolicy` in
//! cubecl-runtime's `allocator.rs`). A `[N, C, 7, 7]` f32 tensor has rows of 8 floats, so its
//! strides are `[C·56, 56, 8, 1]`, not the packed `[C·49, 49, 7, 1]`. cuDNN must be told the real
//! strides of every tensor it reads or writes (`cudnnSetTensor4dDescriptorEx`); a filter
//! descriptor has no strides at all, so filters must be packed. Anything else is refused here,
//! before cuDNN sees a pointer.

use std::ffi::c_int;

/// Why a tensor's layout cannot be handed to cuDNN as it is.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LayoutError {
    /// Not a 4-D shape and 4 strides.
    Rank { dims: usize, strides: usize },
    /// A dimension longer than 1 with stride 0 (a broadcast view: several indices, one element).
    Broadcast { dim: usize },
    /// Two indices reach the same element.
    Overlap,
    /// A dimension or stride beyond what cuDNN's `int` arguments hold.
    TooLarge { value: usize },
    /// The layout reaches past the end of the buffer.
    PastBuffer { needed: usize, available: usize },
    /// A filter that is not packed NCHW (cuDNN's filter descriptors take no strides).
    FilterNotPacked { strides: [usize; 4] },
}

impl std::fmt::Display for LayoutError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Rank { dims, strides } => {
                write!(
                    f,
                    "{dims} dimensions and {strides} strides, cuDNN convs take 4"
                )
            }
            Self::Broadcast { dim } => write!(f, "dimension {dim} is broadcast (stride 0)"),
            Self::Overlap => write!(f, "the strides make elements overlap"),
            Self::TooLarge { value } => write!(f, "{value} does not fit cuDNN's int arguments"),
            Self::PastBuffer { needed, available } => write!(
                f,
                "the layout needs {needed} elements, the buffer holds {available}"
            ),
            Self::FilterNotPacked { strides } => {
                write!(f, "a filter with strides {strides:?} is not packed NCHW")
            }
        }
    }
}

/// A 4-D tensor as `cudnnSetTensor4dDescriptorEx` takes it: dims and strides in elements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct TensorLayout {
    pub dims: [c_int; 4],
    pub strides: [c_int; 4],
}

fn int(value: usize) -> Result<c_int, LayoutError> {
    c_int::try_from(value).map_err(|_| LayoutError::TooLarge { value })
}

fn four(shape: &[usize], strides: &[usize]) -> Result<([usize; 4], [usize; 4]), LayoutError> {
    let err = || LayoutError::Rank {
        dims: shape.len(),
        strides: strides.len(),
    };
    Ok((
        shape.try_into().map_err(|_| err())?,
        strides.try_into().map_err(|_| err())?,
    ))
}

/// Packed NCHW strides of `shape`.
pub(crate) fn packed_strides(shape: [usize; 4]) -> [usize; 4] {
    [
        shape[1] * shape[2] * shape[3],
        shape[2] * shape[3],
        shape[3],
        1,
    ]
}

impl TensorLayout {
    /// The descriptor of a tensor with `shape` and `strides` (in elements) in a buffer of
    /// `buffer_elems` elements. Any positive, non-overlapping strides are accepted (pitched rows,
    /// channels-last); a dimension of length 1 gets the stride a packed tensor would have there,
    /// since its stride is never used and cuDNN checks it.
    pub(crate) fn describe(
        shape: &[usize],
        strides: &[usize],
        buffer_elems: usize,
    ) -> Result<Self, LayoutError> {
        let (shape, mut strides) = four(shape, strides)?;
        for dim in (0..4).rev() {
            if shape[dim] == 1 {
                strides[dim] = if dim == 3 {
                    1
                } else {
                    strides[dim + 1] * shape[dim + 1]
                };
            } else if strides[dim] == 0 {
                return Err(LayoutError::Broadcast { dim });
            }
        }
        // Non-overlapping: sorted by stride, each stride passes the furthest element of the
        // smaller dimensions.
        let mut order: Vec<usize> = (0..4).filter(|&d| shape[d] > 1).collect();
        order.sort_by_key(|&d| strides[d]);
        let mut reach = 0usize;
        for &d in &order {
            if strides[d] <= reach {
                return Err(LayoutError::Overlap);
            }
            reach += (shape[d] - 1) * strides[d];
        }
        let needed = if shape.contains(&0) { 0 } else { reach + 1 };
        if needed > buffer_elems {
            return Err(LayoutError::PastBuffer {
                needed,
                available: buffer_elems,
            });
        }
        Ok(Self {
            dims: [
                int(shape[0])?,
                int(shape[1])?,
                int(shape[2])?,
                int(shape[3])?,
            ],
            strides: [
                int(strides[0])?,
                int(strides[1])?,
                int(strides[2])?,
                int(strides[3])?,
            ],
        })
    }

    /// The descriptor of a filter: `shape` must be packed NCHW (length-1 dimensions aside), as
    /// `cudnnSetFilter4dDescriptor` assumes.
    pub(crate) fn filter(
        shape: &[usize],
        strides: &[usize],
        buffer_elems: usize,
    ) -> Result<Self, LayoutError> {
        let layout = Self::describe(shape, strides, buffer_elems)?;
        let (shape, _) = four(shape, strides)?;
        let packed = packed_strides(shape);
        let canonical = layout.strides.map(|s| s as usize);
        if canonical != packed {
            let mut given = [0; 4];
            given.copy_from_slice(&strides[..4]);
            return Err(LayoutError::FilterNotPacked { strides: given });
        }
        Ok(layout)
    }

    /// Whether the elements sit back to back in NCHW order.
    pub(crate) fn is_packed(&self) -> bool {
        let shape = self.dims.map(|d| d as usize);
        self.strides.map(|s| s as usize) == packed_strides(shape)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use cubecl::Runtime;
    use cubecl::cuda::CudaRuntime;
    use cubecl::server::{ComputeServer, MemoryLayoutDescriptor, MemoryLayoutPolicy};
    use cubecl::stream_id::StreamId;
    use cubecl::zspace::Shape;

    type Policy = <<CudaRuntime as Runtime>::Server as ComputeServer>::MemoryLayoutPolicy;

    /// cubecl-cuda's buffer alignment (`cubecl-cuda` `runtime.rs`: `mem_alignment = 512`), which
    /// also caps the row pitch.
    const CUDA_ALIGNMENT: usize = 512;

    /// Strides and buffer size (in elements) that cubecl-cuda's own allocator gives an
    /// `empty_tensor` of `shape` (what `float_empty` returns on CUDA), computed by its policy.
    fn cubecl_layout(shape: [usize; 4], elem_size: usize) -> (Vec<usize>, usize) {
        let policy = Policy::new(CUDA_ALIGNMENT);
        let descriptor = MemoryLayoutDescriptor::optimized(Shape::from(shape.to_vec()), elem_size);
        let (_, layouts) = policy.apply(StreamId::current(), &[descriptor]);
        let layout = &layouts[0];
        (
            layout.strides.to_vec(),
            layout.memory.size_in_used() as usize / elem_size,
        )
    }

    /// Where element `[n, c, h, w]` lives, for a layout's strides.
    fn offset(strides: [c_int; 4], i: [usize; 4]) -> usize {
        (0..4).map(|d| i[d] * strides[d] as usize).sum()
    }

    #[test]
    fn pitched_activations_are_described_with_their_real_strides() {
        // ResNet's spatial sizes at 224 px, f32 and bf16.
        for (width, elem) in [(7, 4), (14, 4), (56, 4), (112, 4), (7, 2), (14, 2), (56, 2)] {
            let shape = [2, 3, width, width];
            let (strides, elems) = cubecl_layout(shape, elem);
            let row_bytes = (width * elem).next_power_of_two().clamp(16, CUDA_ALIGNMENT);
            let pitch = (width * elem).next_multiple_of(row_bytes) / elem;
            assert_eq!(strides[2], pitch, "W={width}, {elem}-byte elements");
            let layout = TensorLayout::describe(&shape, &strides, elems).expect("describable");
            assert_eq!(layout.dims, [2, 3, width as c_int, width as c_int]);
            assert_eq!(
                layout.strides,
                [
                    (3 * width * pitch) as c_int,
                    (width * pitch) as c_int,
                    pitch as c_int,
                    1
                ]
            );
            // The padding is real (a packed descriptor would be wrong) except where the row is
            // already a power of two of bytes.
            assert_eq!(
                layout.is_packed(),
                pitch == width,
                "W={width}, {elem}-byte elements: pitch {pitch}"
            );
            // Every element a cuDNN kernel addresses is inside the buffer, and the last one is
            // where cubecl put it.
            let last = offset(layout.strides, [1, 2, width - 1, width - 1]);
            assert!(last < elems, "W={width}: {last} >= {elems}");
            assert_eq!(
                last,
                strides[0] + 2 * strides[1] + (width - 1) * (pitch + 1)
            );
        }
    }

    #[test]
    fn widths_that_fill_their_pitch_stay_packed() {
        // 28 floats = 112 B -> pitch 128 B = 32 floats; 32 floats = 128 B exactly.
        let (strides, _) = cubecl_layout([1, 1, 4, 28], 4);
        assert_eq!(strides[2], 32);
        let (strides, elems) = cubecl_layout([1, 1, 4, 32], 4);
        assert_eq!(strides[2], 32);
        let layout = TensorLayout::describe(&[1, 1, 4, 32], &strides, elems).expect("packed");
        assert!(layout.is_packed());
    }

    #[test]
    fn pitched_filters_are_refused_and_packed_ones_accepted() {
        // 3x3 and 7x7 filters (f32 and bf16): rows of 12/28 B (f32) are padded to 16/32 B.
        for (k, elem) in [(3, 4), (7, 4), (3, 2), (7, 2)] {
            let shape = [64, 3, k, k];
            let (strides, elems) = cubecl_layout(shape, elem);
            assert!(strides[2] > k, "a {k}x{k} filter row is padded by cubecl");
            let refused = TensorLayout::filter(&shape, &strides, elems).expect_err("pitched");
            assert!(matches!(refused, LayoutError::FilterNotPacked { .. }));
            assert!(refused.to_string().contains("not packed NCHW"), "{refused}");
            let packed = packed_strides(shape);
            let layout =
                TensorLayout::filter(&shape, &packed, shape.iter().product()).expect("packed");
            assert!(layout.is_packed());
        }
        // 1x1 filters: a row of one element is not padded (cubecl aligns it to the element).
        let shape = [64, 256, 1, 1];
        let (strides, elems) = cubecl_layout(shape, 4);
        TensorLayout::filter(&shape, &strides, elems).expect("1x1 filters are packed");
    }

    #[test]
    fn indescribable_layouts_are_refused_with_the_reason() {
        let shape = [2, 3, 4, 5];
        let packed = packed_strides(shape);
        assert_eq!(
            TensorLayout::describe(&shape, &[60, 20, 0, 1], 120),
            Err(LayoutError::Broadcast { dim: 2 })
        );
        assert_eq!(
            TensorLayout::describe(&shape, &[60, 20, 4, 1], 120),
            Err(LayoutError::Overlap)
        );
        assert_eq!(
            TensorLayout::describe(&shape, &packed, 119),
            Err(LayoutError::PastBuffer {
                needed: 120,
                available: 119
            })
        );
        assert!(matches!(
            TensorLayout::describe(&[2, 3, 4], &[12, 4, 1], 24),
            Err(LayoutError::Rank { dims: 3, .. })
        ));
        assert!(matches!(
            TensorLayout::describe(&[1, 1, 1, 1 << 31], &[1, 1, 1, 1], usize::MAX),
            Err(LayoutError::TooLarge { .. })
        ));
        // Channels-last (NHWC in memory) is positive and non-overlapping: describable.
        let nhwc = TensorLayout::describe(&shape, &[60, 1, 15, 3], 120).expect("NHWC");
        assert_eq!(nhwc.strides, [60, 1, 15, 3]);
        assert!(!nhwc.is_packed());
        // A length-1 dimension's stride is whatever Burn left; the descriptor gets a sane one.
        let one = TensorLayout::describe(&[1, 3, 4, 5], &[0, 20, 5, 1], 60).expect("N = 1");
        assert_eq!(one.strides, [60, 20, 5, 1]);
    }
}
