//! Baton: run large language models across several machines of different kinds.
//!
//! Layers of the code, dependencies pointing down only (see docs/architecture.md):
//! 1. [`gguf`], [`vocab`], [`model`]: what a model is (file, tokenizer, weights, per-architecture math);
//! 2. [`kernels`]: the few coarse ops a forward pass needs, SIMD with runtime dispatch and scalar references;
//! 3. [`engine`]: a session on one node (KV cache, layer-range forward, sampler, snapshots);
//! 4. [`cluster`]: the wire protocol, `baton node`, and the pipeline coordinator;
//! 5. [`generate`] (one Generator trait for every topology) and [`server`] (`baton serve`, OpenAI-compatible) on top.

pub mod bench;
pub mod chat;
pub mod cluster;
pub mod engine;
pub mod ensemble;
pub mod fetch;
pub mod fingerprint;
pub mod generate;
pub mod gguf;
pub mod kernels;
pub mod model;
pub mod server;
pub mod speculative;
pub mod topology;
pub mod util;
pub mod vocab;
