//! A session on one node: a layer range's forward pass with its KV cache, prefix reuse, rewind, snapshots, and
//! the sampler that turns logits into tokens.

pub mod batch;
pub mod batcher;
pub mod disk_cache;
pub mod kv_cache;
pub mod memory;
pub mod perplexity;
pub mod placement;
pub mod sampler;
pub mod session;
pub mod snapshot;

pub use batch::Batch;
pub use kv_cache::KvCache;
pub use session::{Input, Session, Want};
