//! One NCCL call on device memory, described without any CUDA type so that the API is the same
//! with and without the `cuda` feature.

use crate::comm::{DType, ReduceOp};

/// Which collective an NCCL call runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Collective {
    /// `ncclAllReduce` with this operator.
    AllReduce(ReduceOp),
    /// `ncclBroadcast` from rank `root`.
    Broadcast {
        /// The rank whose buffer is sent.
        root: usize,
    },
    /// `ncclAllGather`: `count` elements from each rank, `count × world_size` received.
    AllGather,
}

impl Collective {
    /// The NCCL function's name, for errors.
    #[cfg_attr(not(feature = "cuda"), allow(dead_code))]
    pub(crate) fn nccl_name(self) -> &'static str {
        match self {
            Collective::AllReduce(_) => "ncclAllReduce",
            Collective::Broadcast { .. } => "ncclBroadcast",
            Collective::AllGather => "ncclAllGather",
        }
    }
}

/// One NCCL call on device memory: `count` elements of `dtype` read at `send` and written at
/// `recv` (`count × world_size` for [`Collective::AllGather`]). The two may be equal (in place;
/// for all-gather, `send` must then be `recv + rank × count` elements).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DeviceCall {
    /// The collective.
    pub collective: Collective,
    /// Device address of the input.
    pub send: u64,
    /// Device address of the output.
    pub recv: u64,
    /// Elements per rank.
    pub count: usize,
    /// Element type.
    pub dtype: DType,
}
