//! Models: hyperparameters, weights, per-architecture forward (stub).
