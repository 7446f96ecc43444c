//! How the processes of a job find each other: who they are ([`world`], from torchrun's, SLURM's,
//! OpenMPI's or our [`launcher`]'s environment), the key-value [`store`] they meet in (served by
//! rank 0 in [`store_server`], or torchrun's own through [`torch_store`]), the authenticated
//! handshake and framing of every connection ([`wire`]), and [`setup`], which turns all that into a
//! communicator.

pub(crate) mod launcher;
pub(crate) mod local_rank;
pub(crate) mod setup;
pub(crate) mod slurm;
pub(crate) mod store;
pub(crate) mod store_server;
pub(crate) mod torch_store;
pub(crate) mod wire;
pub(crate) mod world;
