//! Q6_K weights repacked 16 rows at a time, for the AVX2 group kernel in [`super::avx2`] (which the AVX-512 levels
//! run too: no 512-bit Q6_K kernel exists yet).
//!
//! Why: Gemma 3 keeps some of its feed-forward matrices in Q6_K; the row-major kernel spends a horizontal sum per row
//! and rebuilds each 16-value sub-block's scale per row. Interleaved, one multiply-add serves 8 rows, the rows'
//! scales of a sub-block are one byte vector, and the sums stay in registers to the end of the row.
//!
//! Layout of one group of 16 rows, per super-block column (256 weights; 16 × 210 bytes, the same bytes rearranged):
//! `d[16]` (f16), the scales `sc[16][16]` (i8, sub-block major: byte `16s + r`), then the quants as quads: the 32
//! 4-byte quads `k` of `ql` (`ql_r[4k..4k + 4]` for `r` in 0..16, 64 bytes each), then the 16 quads of `qh`. Rows
//! past the last whole group stay row-major after the groups.

use super::group::ROWS;
use crate::kernels::kquants::Q6_K_BYTES;

/// Bytes of one super-block column of one group.
pub const GROUP_BLOCK: usize = ROWS * Q6_K_BYTES;
/// Offsets in a group block: the scales, the `ql` quads, the `qh` quads.
pub(crate) const SC: usize = 2 * ROWS;
pub(crate) const QL: usize = SC + 16 * ROWS;
pub(crate) const QH: usize = QL + 128 * ROWS;

/// Where byte `i` of row `r`'s block goes in its group block.
#[inline]
fn position(i: usize, r: usize) -> usize {
    match i {
        0..128 => QL + (i / 4) * 4 * ROWS + 4 * r + i % 4,
        128..192 => QH + ((i - 128) / 4) * 4 * ROWS + 4 * r + i % 4,
        192..208 => SC + (i - 192) * ROWS + r,
        _ => 2 * r + (i - 208),
    }
}

/// Repacks `rows` rows of `nb` Q6_K super-blocks into the interleaved layout.
pub fn repack(src: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    let rb = nb * Q6_K_BYTES;
    assert_eq!(src.len(), rows * rb, "Q6_K data does not match its shape");
    let groups = rows / ROWS;
    let mut out = vec![0u8; src.len()];
    for g in 0..groups {
        for b in 0..nb {
            let o = &mut out[(g * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
            for r in 0..ROWS {
                let blk = &src[(g * ROWS + r) * rb + b * Q6_K_BYTES..][..Q6_K_BYTES];
                // The bytes `position` gives, a quad at a time where it can.
                for (k, q) in blk[..192].chunks_exact(4).enumerate() {
                    o[QL + k * 4 * ROWS + 4 * r..][..4].copy_from_slice(q);
                }
                for (s, &v) in blk[192..208].iter().enumerate() {
                    o[SC + s * ROWS + r] = v;
                }
                o[2 * r..2 * r + 2].copy_from_slice(&blk[208..210]);
            }
        }
    }
    let tail = groups * ROWS * rb;
    out[tail..].copy_from_slice(&src[tail..]);
    out
}

/// Row `r`'s super-block of an interleaved group block, back in the file's form (references, row lookups).
pub fn unpack_block(gb: &[u8], r: usize) -> Vec<u8> {
    let mut blk = vec![0u8; Q6_K_BYTES];
    unpack_block_into(gb, r, &mut blk);
    blk
}

/// [`unpack_block`] into `blk` (at least `Q6_K_BYTES`), without allocating. Returns the block's length.
pub fn unpack_block_into(gb: &[u8], r: usize, blk: &mut [u8]) -> usize {
    for (i, b) in blk[..Q6_K_BYTES].iter_mut().enumerate() {
        *b = gb[position(i, r)];
    }
    Q6_K_BYTES
}

/// Scalar reference: the 16 dots of one group (`nb` group blocks at `w`) with one Q8_K activation row.
pub fn dot_group_scalar(nb: usize, w: &[u8], x: &[u8], out: &mut [f32; ROWS]) {
    for (r, o) in out.iter_mut().enumerate() {
        let row: Vec<u8> = (0..nb)
            .flat_map(|b| unpack_block(&w[b * GROUP_BLOCK..(b + 1) * GROUP_BLOCK], r))
            .collect();
        *o = crate::kernels::kquants::dot_q6_k_q8_k(nb, &row, x);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::kquants::{Q8_K_BYTES, dot_q6_k_q8_k, quantize_row_q8_k};
    use crate::kernels::testutil::{Rng, random_blocks};

    #[test]
    fn repack_round_trips_every_row() {
        let mut rng = Rng(31);
        let (rows, nb) = (35, 2);
        let src = random_blocks(&mut rng, rows * nb, Q6_K_BYTES, &[208]);
        let packed = repack(&src, rows, nb);
        for r in 0..32 {
            for b in 0..nb {
                let gb = &packed[((r / 16) * nb + b) * GROUP_BLOCK..][..GROUP_BLOCK];
                assert_eq!(
                    unpack_block(gb, r % 16),
                    src[(r * nb + b) * Q6_K_BYTES..][..Q6_K_BYTES],
                    "row {r}"
                );
            }
        }
        assert_eq!(
            packed[32 * nb * Q6_K_BYTES..],
            src[32 * nb * Q6_K_BYTES..],
            "tail rows stay row-major"
        );
    }

    /// The group kernels of every level this CPU runs against the row-major dot, 1..=8 tokens; the extreme case
    /// (every quant 63 or 0, scales ±128/127, activations ±127) reaches the i16 and i32 bounds the kernel argues.
    #[test]
    fn group_kernel_matches_the_row_dots() {
        use crate::kernels::interleaved::TILE;
        use crate::kernels::testutil::check_group_levels;
        let ty = crate::gguf::GgmlType::Q6K;
        let mut rng = Rng(32);
        for (nb, extreme) in [(1, false), (3, false), (2, true)] {
            let mut src = random_blocks(&mut rng, 16 * nb, Q6_K_BYTES, &[208]);
            if extreme {
                for (i, blk) in src.chunks_exact_mut(Q6_K_BYTES).enumerate() {
                    let q = if i % 2 == 0 { 0xff } else { 0x00 };
                    blk[..192].fill(q);
                    for (s, sc) in blk[192..208].iter_mut().enumerate() {
                        *sc = if s % 2 == 0 { 0x80 } else { 0x7f };
                    }
                }
            }
            let packed = repack(&src, 16, nb);
            let xs = nb * Q8_K_BYTES;
            let mut xq = vec![0u8; TILE * xs];
            for t in 0..TILE {
                let sign = if t % 2 == 0 { 1.0 } else { -1.0 };
                let x: Vec<f32> = (0..nb * 256)
                    .map(|_| if extreme { sign } else { rng.normal() })
                    .collect();
                quantize_row_q8_k(&x, &mut xq[t * xs..(t + 1) * xs]);
            }
            check_group_levels(ty, nb, &packed, &xq, xs, dot_group_scalar, |t, r| {
                dot_q6_k_q8_k(nb, &src[r * nb * Q6_K_BYTES..], &xq[t * xs..])
            });
        }
    }
}
