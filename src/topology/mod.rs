//! Generators over nodes, above `cluster` (which they drive) and `generate` (whose trait they implement).
//!
//! - [`pipeline`]: [`PipelineGenerator`], layers spread over `baton node`s, or one remote decode node;
//! - [`disagg`]: [`DisaggGenerator`], a model here whose prompts a prefill pool prefills.

pub mod disagg;
pub mod pipeline;

pub use disagg::DisaggGenerator;
pub use pipeline::PipelineGenerator;
