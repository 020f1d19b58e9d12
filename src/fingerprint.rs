//! Model fingerprint (stub, filled in by its owner).
