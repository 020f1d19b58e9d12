//! Model fetching and cache (stub, filled in by its owner).
