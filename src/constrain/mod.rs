//! Constrained sampling: a JSON schema (or "any JSON object") compiled into a byte-level pushdown matcher, and the
//! per-step mask of tokens whose bytes the matcher can accept. The server compiles a client's `response_format`
//! (or a tool call's shape) once per request; the generators that sample on this machine apply the mask to the
//! logits before the sampler, so temperature, top-k and top-p still choose among valid tokens only.
//!
//! Schemas come from clients: compilation is bounded (size, depth, `$ref`s, enum values, properties) and every
//! keyword this subset does not enforce is refused by name rather than ignored.

mod matcher;
mod pattern;
mod schema;
mod trie;

#[cfg(test)]
mod tests;

pub use matcher::Matcher;
pub use schema::{Grammar, SchemaError};
pub use trie::{Guide, TokenTrie};

use std::sync::Arc;

/// A compiled constraint carried with a request's generation settings.
#[derive(Clone)]
pub struct Constraint {
    pub grammar: Arc<Grammar>,
}

impl std::fmt::Debug for Constraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Constraint({} nodes)", self.grammar.len())
    }
}

impl Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    pub fn json_object() -> Constraint {
        Constraint {
            grammar: Arc::new(Grammar::any_object()),
        }
    }

    /// A value valid against `schema` (the subset in docs/server.md).
    pub fn schema(schema: &serde_json::Value) -> Result<Constraint, SchemaError> {
        Ok(Constraint {
            grammar: Arc::new(Grammar::compile(schema)?),
        })
    }
}
