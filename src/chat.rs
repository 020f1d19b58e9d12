//! Chat templates (stub, filled in by its owner).
