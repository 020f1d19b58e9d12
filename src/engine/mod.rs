//! Engine: sessions, KV cache, sampler (stub).
