//! Data parallelism on top of the collectives: gradient averaging in buckets ([`gradient`]), the
//! optimizer wrapper and the broadcasts of parameters, state and metrics ([`optimizer`]), and the
//! tensor-level collectives that move Burn tensors through a communicator ([`tensor`], and
//! [`cuda_tensor`] for device buffers with feature `cuda`).

#[cfg(feature = "cuda")]
pub(crate) mod cuda_tensor;
pub(crate) mod gradient;
pub(crate) mod optimizer;
pub(crate) mod tensor;
