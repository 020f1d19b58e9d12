//! Tokenizers from GGUF metadata (stub, filled in by its owner).
