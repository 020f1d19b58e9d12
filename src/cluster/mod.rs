//! The cluster layer: one model's layers split across several processes or machines.
//!
//! - [`wire`]: the framed, versioned binary protocol (documented byte for byte in docs/protocol.md);
//! - [`auth`]: shared-secret challenge-response (HMAC-SHA256 over nonces from both ends);
//! - [`handshake`]: version, authentication, model and layer-range agreement, with named differences on refusal;
//! - [`stage`]: the engine side of one pipeline stage (KV per session, prefix-hash checks, sampling on the last stage);
//! - [`node`]: the `baton node` server (a thread per connection, blocking I/O with timeouts, one handler per message,
//!   decode steps batched by `engine::batcher`);
//! - [`pipeline`]: the coordinator that carries a session across stages ([`pipeline::PipelineSession`]);
//! - [`handoff`]: disaggregated prefill: the prefill node streams KV layer by layer, the decode side writes it into
//!   its cache (and runs the remaining layers), with a local fallback;
//! - [`disagg`]: the `--offload auto` planner, the prefill pool, the remote-prefill client and the node side of PULL
//!   (the generator that uses them is `topology::DisaggGenerator`);
//! - [`experts`]: `--experts-split`, half of each MoE layer's experts on another node holding the same model;
//! - [`demo`]: `baton demo`, a prefill node and a decode node on this machine;
//! - [`topology`]: parsing `--pipeline ADDR=A:B,local=B:end` and checking that every layer is covered exactly once.

pub mod auth;
pub mod demo;
pub mod disagg;
pub mod experts;
pub mod handle;
pub mod handoff;
pub mod handshake;
pub mod health;
pub mod node;
pub mod pipeline;
pub mod pipeline_spec;
pub mod stage;
pub mod wire;

pub use handle::{ModelHandle, Next};
pub use node::{NodeConfig, run as run_node};
pub use pipeline::{PipelineOpts, PipelineSession, StageStats};
pub use pipeline_spec::{StageSpec, parse_pipeline};
pub use stage::Sampled;

use sha2::{Digest, Sha256};

/// Identity of a token prefix: a running hash over token ids, so a stage can tell whether the KV it holds belongs to
/// the prefix a request builds on (restarted, evicted or foreign sessions are detected, never used).
pub type PrefixHash = [u8; 16];

/// Hash of the empty prefix: the first 16 bytes of SHA-256("baton-prefix-v1").
pub fn prefix_root() -> PrefixHash {
    let d = Sha256::digest(b"baton-prefix-v1");
    d[..16].try_into().unwrap()
}

/// Hash of `prefix + [token]`: the first 16 bytes of SHA-256(prev || token as u32 little-endian).
pub fn prefix_next(prev: &PrefixHash, token: u32) -> PrefixHash {
    let mut h = Sha256::new();
    h.update(prev);
    h.update(token.to_le_bytes());
    h.finalize()[..16].try_into().unwrap()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn prefix_chain_depends_on_every_token_and_order() {
        let r = prefix_root();
        let a = prefix_next(&prefix_next(&r, 1), 2);
        let b = prefix_next(&prefix_next(&r, 2), 1);
        assert_ne!(a, b);
        assert_eq!(a, prefix_next(&prefix_next(&r, 1), 2));
        assert_ne!(r, prefix_next(&r, 0));
    }
}
