//! Engine: sessions, KV cache, sampler (stub).
pub mod sampler;
