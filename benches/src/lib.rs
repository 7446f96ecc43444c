//! Benchmarks for the workspace: `allreduce` (collectives, nccl-tests style), `data` (the input
//! pipeline) and `train_step` (model forward, backward and optimizer step). Each is a binary under
//! `src/bin`; the Python scripts beside this crate time the anchors (Gloo, torchvision, PyTorch) on
//! the same inputs, and are run by hand, never by the tests.
