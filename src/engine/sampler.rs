//! Sampling (stub, filled in by its owner).
