//! The shape every interleaved layout shares: groups of [`ROWS`] weight rows, dotted with up to [`TILE`] activation
//! rows per kernel call.

/// Rows per group.
pub const ROWS: usize = 16;

/// Activation rows one call of [`super::dot_group`] takes: the prefill tile. The AVX-512 4-bit kernels unpack a
/// group's weights once for all of them (8 rows halve that work per token against 4); the Q8_0 and Q4_K kernels keep
/// more registers per row and take them 4 at a time, and so do the AVX2 kernels but Q5_0's and Q6_K's (see
/// [`super::avx2`]).
pub const TILE: usize = 8;
