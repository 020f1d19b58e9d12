//! Baton: run large language models across several machines of different kinds.
//!
//! Layers of the code, dependencies pointing down only (see docs/architecture.md):
//! 1. [`gguf`], [`vocab`], [`chat`], [`util`]: the file format, tokenizers, chat templates, small shared helpers;
//! 2. [`kernels`]: the few coarse ops a forward pass needs, SIMD with runtime dispatch and scalar references;
//!    [`backend`]: the seam between what a layer computes and where it runs (the CPU kernels, llama.cpp's
//!    arithmetic; a GPU backend goes beside them), and the backend-neutral view of one layer's KV cache;
//! 3. [`model`] (what a model is: hyperparameters, weights, per-architecture math), [`fingerprint`] (model
//!    identity) and [`fetch`] (the downloader and model cache; model loading never sees it);
//! 4. [`engine`]: a session on one node (KV cache, layer-range forward, batched decode, sampler, snapshots);
//! 5. [`generate`]: the [`generate::Generator`] trait every topology implements, its data types, the shared
//!    decode loop, and the local generator; it sees the engine, never `cluster`;
//! 6. [`cluster`]: the wire protocol, `baton node`, the pipeline coordinator, the KV handoff and prefill pool;
//!    [`speculative`] and [`ensemble`]: generators over several models, local or on nodes; [`bench`]: speed runs;
//! 7. [`topology`]: the one builder that turns the topology flags into a generator (secret read once), and the
//!    generators over nodes (pipeline, disaggregated);
//! 8. [`server`] (`baton serve`, OpenAI-compatible) and the `baton` binary on top.
//!
//! One token of `baton run`: `main` → `topology::Builder::generator` → a `Generator` → `generate::decode_loop`
//! asks the generator's step for the next token → `engine::Session::forward` (locally) or `cluster::pipeline`
//! (over nodes, each `baton node` running `engine` on its layer range) → `engine::sampler` → the text sink.

pub mod backend;
pub mod bench;
pub mod chat;
pub mod cluster;
pub mod constrain;
pub mod engine;
pub mod ensemble;
pub mod fetch;
pub mod fingerprint;
pub mod generate;
pub mod gguf;
pub mod kernels;
pub mod logging;
pub mod model;
pub mod server;
pub mod speculative;
pub mod topology;
pub mod util;
pub mod vocab;
