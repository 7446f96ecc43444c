//! The [`Communicator`] trait, element types and reduction operators.

pub(crate) mod device_call;
#[cfg(feature = "cuda")]
pub(crate) mod nccl;
#[cfg(not(feature = "cuda"))]
#[path = "nccl_stub.rs"]
pub(crate) mod nccl;
pub(crate) mod ring;

use crate::error::Result;
use half::{bf16, f16};
use std::time::Duration;

/// Default deadline of every collective (as NCCL's watchdog order of magnitude: minutes).
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(300);

/// The argument check every communicator's broadcast makes: `root` is a rank.
pub(crate) fn check_root(root: usize, world_size: usize) -> Result<()> {
    if root >= world_size {
        return Err(crate::DistError::InvalidBuffer {
            op: "broadcast",
            detail: format!("root {root} ≥ world size {world_size}"),
        });
    }
    Ok(())
}

/// The argument check every communicator's all-gather makes: the buffer splits into one equal
/// part per rank.
pub(crate) fn check_gather_len(len: usize, world_size: usize) -> Result<()> {
    if !len.is_multiple_of(world_size) {
        return Err(crate::DistError::InvalidBuffer {
            op: "all_gather",
            detail: format!("length {len} is not a multiple of the world size {world_size}"),
        });
    }
    Ok(())
}

/// Reduction operator of [`Communicator::all_reduce`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Element-wise sum.
    Sum,
    /// Sum divided by the world size (integer division for `i64`).
    Avg,
    /// Element-wise maximum.
    Max,
    /// Element-wise minimum.
    Min,
}

/// Element type carried by a collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum DType {
    /// `f32`.
    F32,
    /// `f64`.
    F64,
    /// IEEE half.
    F16,
    /// bfloat16.
    BF16,
    /// `i64`.
    I64,
    /// Raw bytes (broadcast / all-gather of serialised data; sums wrap).
    U8,
}

impl DType {
    /// Size of one element in bytes.
    pub fn size(self) -> usize {
        match self {
            DType::F32 => 4,
            DType::F64 | DType::I64 => 8,
            DType::F16 | DType::BF16 => 2,
            DType::U8 => 1,
        }
    }
}

/// An element type the communicators can reduce.
pub trait Element: bytemuck::Pod + Send + Sync + std::fmt::Debug + PartialEq + 'static {
    /// Its [`DType`].
    const DTYPE: DType;
    /// `acc[i] = op(acc[i], other[i])` for `Sum`, `Max`, `Min` (`Avg` sums; see [`Element::divide`]).
    fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]);
    /// `acc[i] /= n`.
    fn divide(acc: &mut [Self], n: usize);
    /// Wraps a slice as a [`HostBuf`].
    fn host_buf(s: &mut [Self]) -> HostBuf<'_>;
}

/// Gives a closure literal its types; the closure stays inlinable (no fn pointer per element).
#[inline(always)]
fn typed_add<T>(f: impl Fn(T, T) -> T) -> impl Fn(T, T) -> T {
    f
}

#[inline(always)]
fn typed_div<T>(f: impl Fn(T, usize) -> T) -> impl Fn(T, usize) -> T {
    f
}

macro_rules! native_element {
    ($t:ty, $d:expr, $var:ident, $add:expr, $div:expr) => {
        impl Element for $t {
            const DTYPE: DType = $d;
            fn reduce(op: ReduceOp, acc: &mut [Self], other: &[Self]) {
                let add = typed_add::<$t>($add);
                match op {
                    ReduceOp::Sum | ReduceOp::Avg => acc
                        .iter_mut()
                        .zip(other)
                        .for_each(|(a, b)| *a = add(*a, *b)),
                    ReduceOp::Max => acc.iter_mut().zip(other).for_each(|(a, b)| {
                        if *b > *a {
                            *a = *b
                        }
                    }),
                    ReduceOp::Min => acc.iter_mut().zip(other).for_each(|(a, b)| {
                        if *b < *a {
                            *a = *b
                        }
                    }),
                }
            }
            fn divide(acc: &mut [Self], n: usize) {
                let div = typed_div::<$t>($div);
                acc.iter_mut().for_each(|a| *a = div(*a, n));
            }
            fn host_buf(s: &mut [Self]) -> HostBuf<'_> {
                HostBuf::$var(s)
            }
        }
    };
}

native_element!(f32, DType::F32, F32, |a, b| a + b, |a, n| a / n as f32);
native_element!(f64, DType::F64, F64, |a, b| a + b, |a, n| a / n as f64);
native_element!(i64, DType::I64, I64, |a, b| a.wrapping_add(b), |a, n| a / n
    as i64);
native_element!(u8, DType::U8, U8, |a, b| a.wrapping_add(b), |a, n| a
    / n.clamp(1, 255) as u8);
native_element!(
    f16,
    DType::F16,
    F16,
    |a, b| f16::from_f32(a.to_f32() + b.to_f32()),
    |a, n| f16::from_f32(a.to_f32() / n as f32)
);
native_element!(
    bf16,
    DType::BF16,
    BF16,
    |a, b| bf16::from_f32(a.to_f32() + b.to_f32()),
    |a, n| bf16::from_f32(a.to_f32() / n as f32)
);

/// A host buffer of one of the supported element types, reduced in place.
#[derive(Debug)]
pub enum HostBuf<'a> {
    /// `f32` data.
    F32(&'a mut [f32]),
    /// `f64` data.
    F64(&'a mut [f64]),
    /// `f16` data.
    F16(&'a mut [f16]),
    /// `bf16` data.
    BF16(&'a mut [bf16]),
    /// `i64` data.
    I64(&'a mut [i64]),
    /// Bytes.
    U8(&'a mut [u8]),
}

/// Runs `$body` with `$s` bound to the typed slice inside a [`HostBuf`] (by value, `&` or
/// `&mut`, as `$buf` is): the one place that lists the element types, so every generic operation
/// on a buffer is one line.
macro_rules! with_slice {
    ($buf:expr, $s:ident => $body:expr) => {
        match $buf {
            $crate::comm::HostBuf::F32($s) => $body,
            $crate::comm::HostBuf::F64($s) => $body,
            $crate::comm::HostBuf::F16($s) => $body,
            $crate::comm::HostBuf::BF16($s) => $body,
            $crate::comm::HostBuf::I64($s) => $body,
            $crate::comm::HostBuf::U8($s) => $body,
        }
    };
}
pub(crate) use with_slice;

fn dtype_of<T: Element>(_: &[T]) -> DType {
    T::DTYPE
}

impl HostBuf<'_> {
    /// Element type.
    pub fn dtype(&self) -> DType {
        with_slice!(self, s => dtype_of(s))
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        with_slice!(self, s => s.len())
    }

    /// Whether there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The raw bytes.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        with_slice!(self, s => bytemuck::cast_slice_mut(s))
    }
}

/// Collective operations between the processes of a job. Every operation must be called by every
/// rank in the same order with the same sizes; each is bounded by the communicator's deadline and
/// returns an error naming the failing rank instead of hanging.
pub trait Communicator: Send + Sync + std::fmt::Debug {
    /// The NCCL communicator behind this one, if it is one: lets CUDA tensors go to NCCL by
    /// device pointer instead of through host memory.
    fn as_nccl(&self) -> Option<&crate::Nccl> {
        None
    }

    /// This process's rank.
    fn rank(&self) -> usize;
    /// Number of processes.
    fn world_size(&self) -> usize;
    /// Deadline of each collective.
    fn timeout(&self) -> Duration;
    /// Short name of the backend ("host", "nccl").
    fn backend_name(&self) -> &'static str;
    /// Reduces `buf` element-wise across all ranks, in place; every rank ends with the result.
    ///
    /// # Errors
    /// A [`crate::DistError`] naming the failed or hung rank, or describing a mismatch.
    fn all_reduce(&self, buf: HostBuf<'_>, op: ReduceOp) -> Result<()>;
    /// Copies `root`'s `buf` to every rank.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn broadcast(&self, buf: HostBuf<'_>, root: usize) -> Result<()>;
    /// In-place all-gather: `buf` holds `world_size` equal blocks; rank `r` provides block `r`,
    /// every rank ends with all blocks.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`]; [`crate::DistError::InvalidBuffer`] when the length is not
    /// a multiple of the world size.
    fn all_gather(&self, buf: HostBuf<'_>) -> Result<()>;
    /// How data moves, for logs and benchmark headers (default: the backend's name).
    fn transport(&self) -> &'static str {
        self.backend_name()
    }

    /// Whether collectives may be skipped because they cannot change anything: a world of one
    /// whose backend has nothing to exercise. The NCCL backend answers `false`, so that one GPU
    /// still runs (and checks) NCCL.
    fn skips_collectives(&self) -> bool {
        self.world_size() == 1
    }

    /// Tells every rank that this one failed by itself (an error outside the communicator, in a
    /// collective helper: data that cannot be read, a record that does not load), so they stop
    /// at once naming this rank and `cause` instead of waiting out their deadline. The
    /// communicator is unusable afterwards. Default: nothing to tell (a world of one).
    fn abort(&self, cause: &str) {
        let _ = cause;
    }

    /// Returns once every rank has called `barrier` (an all-reduce of one integer).
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn barrier(&self) -> Result<()> {
        let mut one = [1i64];
        self.all_reduce(HostBuf::I64(&mut one), ReduceOp::Sum)
    }
}

/// Typed conveniences over any [`Communicator`].
pub trait CommunicatorExt: Communicator {
    /// [`Communicator::all_reduce`] on a typed slice.
    ///
    /// # Errors
    /// As [`Communicator::all_reduce`].
    fn all_reduce_slice<T: Element>(&self, data: &mut [T], op: ReduceOp) -> Result<()> {
        self.all_reduce(T::host_buf(data), op)
    }
    /// [`Communicator::broadcast`] on a typed slice.
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    fn broadcast_slice<T: Element>(&self, data: &mut [T], root: usize) -> Result<()> {
        self.broadcast(T::host_buf(data), root)
    }
    /// Gathers every rank's `data` (same length on all ranks) in rank order.
    ///
    /// # Errors
    /// As [`Communicator::all_gather`].
    fn all_gather_vec<T: Element>(&self, data: &[T]) -> Result<Vec<T>> {
        let n = data.len();
        let mut out = vec![T::zeroed(); n * self.world_size()];
        out[self.rank() * n..(self.rank() + 1) * n].copy_from_slice(data);
        self.all_gather(T::host_buf(&mut out))?;
        Ok(out)
    }
    /// Broadcasts a byte vector of any length from `root` (the others' input is replaced).
    ///
    /// # Errors
    /// As [`Communicator::broadcast`].
    fn broadcast_bytes(&self, data: &mut Vec<u8>, root: usize) -> Result<()> {
        let mut len = [data.len() as i64];
        self.broadcast_slice(&mut len, root)?;
        data.resize(len[0].max(0) as usize, 0);
        self.broadcast_slice(data.as_mut_slice(), root)
    }
}

impl<C: Communicator + ?Sized> CommunicatorExt for C {}
