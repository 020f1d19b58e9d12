//! Deterministic random data for the kernel tests.

/// xorshift64*: small, seedable, good enough for test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next(&mut self) -> u64 {
        let mut x = self.0 | 1;
        x ^= x >> 12;
        x ^= x << 25;
        x ^= x >> 27;
        self.0 = x;
        x.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    /// Uniform in [0, 1).
    pub fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32
    }

    /// Roughly standard normal (sum of uniforms).
    pub fn normal(&mut self) -> f32 {
        (0..4).map(|_| self.uniform()).sum::<f32>() * 1.732 - 3.464
    }
}

/// `n` blocks of random bytes with sane f16 scales (0.001..0.05, either sign) at the given offsets, so any bit
/// pattern of quants and packed sub-scales is exercised.
pub fn random_blocks(rng: &mut Rng, n: usize, bytes: usize, f16_offsets: &[usize]) -> Vec<u8> {
    let mut v: Vec<u8> = (0..n * bytes).map(|_| rng.next() as u8).collect();
    for b in v.chunks_mut(bytes) {
        for &o in f16_offsets {
            let mut s = 0.001 + rng.uniform() * 0.05;
            if rng.next() & 1 == 1 {
                s = -s;
            }
            b[o..o + 2].copy_from_slice(&half::f16::from_f32(s).to_bits().to_le_bytes());
        }
    }
    v
}

pub fn rel_close(a: f32, b: f32, tol: f32) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-6)
}

/// Runs the group kernel of `ty` at every level this CPU runs, for 1..=`TILE` tokens of `xq` (`xs` bytes apart):
/// the SIMD levels give the same bits, the scalar reference `scalar_ref` reads the repacked rows exactly as the
/// row-major dot `direct(t, r)` (token `t`, row `r`) does, and every level is within 1e-4 (relative) of it.
pub fn check_group_levels(
    ty: crate::gguf::GgmlType,
    nb: usize,
    packed: &[u8],
    xq: &[u8],
    xs: usize,
    scalar_ref: fn(usize, &[u8], &[u8], &mut [f32; super::interleaved::ROWS]),
    direct: impl Fn(usize, usize) -> f32,
) {
    use super::interleaved::{Level, ROWS, TILE, dot_group_with, levels};
    for n in 1..=TILE {
        let mut simd: Option<(Level, [[f32; ROWS]; TILE])> = None;
        for lvl in levels() {
            let mut out = [[0.0f32; ROWS]; TILE];
            dot_group_with(lvl, ty, nb, packed, xq, xs, n, &mut out);
            if lvl != Level::Scalar {
                match &simd {
                    Some((first, bits)) => assert_eq!(&out, bits, "nb {nb} n {n}: {lvl:?} differs from {first:?}"),
                    None => simd = Some((lvl, out)),
                }
            }
            for t in 0..n {
                let mut want = [0.0f32; ROWS];
                scalar_ref(nb, packed, &xq[t * xs..], &mut want);
                for (r, &want) in want.iter().enumerate() {
                    let direct = direct(t, r);
                    assert_eq!(want, direct, "the reference reads the repacked rows");
                    let got = out[t][r];
                    assert!(
                        (got - direct).abs() <= 1e-4 * direct.abs().max(1.0),
                        "nb {nb} n {n} t {t} r {r} {lvl:?}: {got} vs {direct}"
                    );
                }
            }
        }
    }
}
