//! Disaggregated prefill: prompts are prefilled (all or the first `k` layers) on a prefill node and the decode side
//! holds the full KV afterwards and decodes alone. The decode side is this process (`topology::DisaggGenerator`) or
//! a remote node ([`RemotePrefill`] on the coordinator, [`serve_pull`] on the node: protocol 3's PULL). `--offload auto`
//! picks `k` per request from measured speeds; a [`PrefillPool`] picks the least-loaded healthy prefill node.

mod planner;
mod pool;
mod pull;

pub use planner::*;
pub use pool::*;
pub use pull::*;
