//! Causal attention of the query heads that share one KV head (GQA group) over a run of cached positions, reading
//! K and V as stored in the cache: f16, as llama.cpp keeps them (half the bytes of f32 to read per decoded token at
//! a long context).
//!
//! Positions are taken in fixed chunks of [`CHUNK`] counted from the first attended position. Each chunk gives a
//! partial result per head (its score maximum, its sum of exponentials and its unnormalised weighted sum of V), and
//! the partials are folded in chunk order, as in flash decoding. A row's result therefore has the same bits whether
//! one thread walks its chunks ([`attend`], prefill) or the chunks are spread over the threads and folded after
//! ([`partial`] + [`fold`] + [`finish`], decode: one row with Gemma 3's single KV head would otherwise run on one
//! thread), and the scratch is one chunk of scores, however long the context.
//!
//! Why a kernel of its own: done one query head at a time with the portable element loops, attention read every
//! cached row once per head, called the scalar `exp` per score and ran on SSE2. Here each K and V row is loaded once
//! for the whole group, the dot products and the weighted sum of V use 512-bit FMAs over f16 rows widened in
//! registers, and the exponentials are computed 16 at a time (the Cephes `expf` reduction and polynomial, about
//! 1 ulp), on CPUs with AVX-512F; AVX2 and AArch64 NEON versions do the same in 8- and 4-lane vectors. The scalar version is the
//! reference the SIMD ones are tested against.

use half::f16;
use std::ops::Range;

/// Positions per chunk: small enough that a decode step at a few thousand positions splits over the threads, large
/// enough that folding partials costs nothing next to the dot products.
pub const CHUNK: usize = 256;

/// Shapes of one call: `n_q` query heads of `hdk` values each (contiguous), K rows of `hdk` and V rows of `hdv`
/// values, one per cached position, and the positions `lo..hi` every query attends to.
#[derive(Clone, Copy, Debug)]
pub struct Group {
    pub n_q: usize,
    pub hdk: usize,
    pub hdv: usize,
    pub lo: usize,
    pub hi: usize,
    pub scale: f32,
}

impl Group {
    pub fn n_chunks(&self) -> usize {
        (self.hi - self.lo).div_ceil(CHUNK)
    }

    /// Positions of chunk `c`.
    pub fn chunk(&self, c: usize) -> Range<usize> {
        let a = self.lo + c * CHUNK;
        a..(a + CHUNK).min(self.hi)
    }

    /// Floats of one partial result: every head's unnormalised output (`n_q × hdv`), then the heads' score maxima,
    /// then their sums of exponentials.
    pub fn partial_len(&self) -> usize {
        partial_len(self.n_q, self.hdv)
    }

    /// Scratch floats [`attend`] needs.
    pub fn scratch_len(&self) -> usize {
        scratch_len(self.n_q, self.hdv)
    }
}

/// [`Group::partial_len`] for a group of `n_q` heads with V rows of `hdv`.
pub fn partial_len(n_q: usize, hdv: usize) -> usize {
    n_q * (hdv + 2)
}

/// Scratch floats of one [`attend`] call for a group of `n_q` heads: one chunk of scores and two partials.
pub fn scratch_len(n_q: usize, hdv: usize) -> usize {
    n_q * CHUNK + 2 * partial_len(n_q, hdv)
}

/// Scratch floats of one [`partial`] call: one chunk of scores.
pub fn scores_len(n_q: usize) -> usize {
    n_q * CHUNK
}

/// `out[g] = softmax(scale · q[g] · Kᵀ) · V` over positions `lo..hi`, for each query head `g` of the group, chunk
/// by chunk. `k` and `v` hold the KV head's rows from position 0; `scratch` has at least [`Group::scratch_len`]
/// floats.
pub fn attend(g: &Group, q: &[f32], k: &[f16], v: &[f16], scratch: &mut [f32], out: &mut [f32]) {
    let pl = g.partial_len();
    assert!(scratch.len() >= g.scratch_len());
    let (sc, rest) = scratch.split_at_mut(scores_len(g.n_q));
    let (acc, rest) = rest.split_at_mut(pl);
    let tmp = &mut rest[..pl];
    partial(g, 0, q, k, v, sc, acc);
    for c in 1..g.n_chunks() {
        partial(g, c, q, k, v, sc, tmp);
        fold(g, acc, tmp);
    }
    finish(g, acc, out);
}

/// The partial result of chunk `c` (layout of [`Group::partial_len`]) into `part`; `scores` has at least
/// [`scores_len`] floats.
pub fn partial(g: &Group, c: usize, q: &[f32], k: &[f16], v: &[f16], scores: &mut [f32], part: &mut [f32]) {
    assert!(g.lo < g.hi, "attention over no positions");
    assert!(c < g.n_chunks());
    assert!(q.len() >= g.n_q * g.hdk);
    assert!(k.len() >= g.hi * g.hdk && v.len() >= g.hi * g.hdv);
    assert!(scores.len() >= scores_len(g.n_q) && part.len() >= g.partial_len());
    #[cfg(target_arch = "x86_64")]
    if avx512() {
        // SAFETY: AVX-512F is present; the slice lengths were checked above.
        unsafe { x86::partial(g, g.chunk(c), q, k, v, scores, part) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if super::kernels().isa == "avx2" {
        // SAFETY: the table is AVX2 only where the CPU has AVX2, FMA and F16C; the slice lengths were checked above.
        unsafe { avx2::partial(g, g.chunk(c), q, k, v, scores, part) };
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if super::kernels().isa != "scalar" {
        // SAFETY: the slice lengths were checked above (NEON is part of the AArch64 baseline).
        unsafe { neon::partial(g, g.chunk(c), q, k, v, scores, part) };
        return;
    }
    partial_scalar(g, g.chunk(c), q, k, v, scores, part);
}

/// Folds the next chunk's partial `part` into the running `acc` (both [`Group::partial_len`]): the two are rescaled
/// to their common maximum and added. Always done by this one function, in chunk order, so the result does not
/// depend on who computed the partials.
pub fn fold(g: &Group, acc: &mut [f32], part: &[f32]) {
    let (n_q, hdv) = (g.n_q, g.hdv);
    let (ms, ss) = (n_q * hdv, n_q * hdv + n_q);
    for h in 0..n_q {
        let (ma, mb) = (acc[ms + h], part[ms + h]);
        let m = ma.max(mb);
        let (fa, fb) = ((ma - m).exp(), (mb - m).exp());
        acc[ms + h] = m;
        acc[ss + h] = acc[ss + h] * fa + part[ss + h] * fb;
        for (a, &b) in acc[h * hdv..(h + 1) * hdv]
            .iter_mut()
            .zip(&part[h * hdv..(h + 1) * hdv])
        {
            *a = *a * fa + b * fb;
        }
    }
}

/// The normalised output of every head from the folded partial.
pub fn finish(g: &Group, acc: &[f32], out: &mut [f32]) {
    let (n_q, hdv) = (g.n_q, g.hdv);
    for h in 0..n_q {
        let inv = 1.0 / acc[n_q * hdv + n_q + h];
        for (o, &a) in out[h * hdv..(h + 1) * hdv].iter_mut().zip(&acc[h * hdv..(h + 1) * hdv]) {
            *o = a * inv;
        }
    }
}

/// The kernel table's choice (`BATON_ISA` included), so attention runs at the same ISA as the matmuls.
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    super::kernels().isa == "avx512"
}

/// The portable reference of [`partial`] over the positions `pos`.
pub fn partial_scalar(
    g: &Group,
    pos: Range<usize>,
    q: &[f32],
    k: &[f16],
    v: &[f16],
    scores: &mut [f32],
    part: &mut [f32],
) {
    let n = pos.len();
    let (n_q, hdk, hdv) = (g.n_q, g.hdk, g.hdv);
    for h in 0..n_q {
        let qh = &q[h * hdk..(h + 1) * hdk];
        let sc = &mut scores[h * n..(h + 1) * n];
        let mut max = f32::NEG_INFINITY;
        for (j, s) in pos.clone().zip(sc.iter_mut()) {
            let kr = &k[j * hdk..(j + 1) * hdk];
            *s = qh.iter().zip(kr).map(|(a, b)| a * b.to_f32()).sum::<f32>() * g.scale;
            max = max.max(*s);
        }
        let mut sum = 0.0f32;
        for s in sc.iter_mut() {
            *s = (*s - max).exp();
            sum += *s;
        }
        let o = &mut part[h * hdv..(h + 1) * hdv];
        o.fill(0.0);
        for (j, &s) in pos.clone().zip(sc.iter()) {
            for (od, vd) in o.iter_mut().zip(&v[j * hdv..(j + 1) * hdv]) {
                *od += s * vd.to_f32();
            }
        }
        part[n_q * hdv + h] = max;
        part[n_q * hdv + n_q + h] = sum;
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{Group, Range};
    use crate::kernels::ops::x86::exp16;
    use half::f16;
    use std::arch::x86_64::*;

    /// 16 f16 values at `p`, widened.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn load16(p: *const f16) -> __m512 {
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }

    /// Dot of `len` f32 (`a`) with `len` f16 (`b`); multiples of 16 in vectors, the rest scalar.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn dot(a: *const f32, b: *const f16, len: usize) -> f32 {
        unsafe {
            let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
            let mut d = 0;
            while d + 32 <= len {
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(d)), load16(b.add(d)), acc0);
                acc1 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(d + 16)), load16(b.add(d + 16)), acc1);
                d += 32;
            }
            if d + 16 <= len {
                acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(a.add(d)), load16(b.add(d)), acc0);
                d += 16;
            }
            let mut s = _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1));
            while d < len {
                s += *a.add(d) * (*b.add(d)).to_f32();
                d += 1;
            }
            s
        }
    }

    /// The horizontal sums of eight vectors, as one vector `[Σa[0], …, Σa[7]]`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn sum8(a: &[__m512; 8]) -> __m256 {
        // Halve each to 8 lanes, then pairwise adds across the eight (the classic hadd transpose).
        let y = a.map(|v| {
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(v), 1));
            _mm256_add_ps(_mm512_castps512_ps256(v), hi)
        });
        let t0 = _mm256_hadd_ps(y[0], y[1]);
        let t1 = _mm256_hadd_ps(y[2], y[3]);
        let t2 = _mm256_hadd_ps(y[4], y[5]);
        let t3 = _mm256_hadd_ps(y[6], y[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        _mm256_add_ps(
            _mm256_permute2f128_ps(u0, u1, 0x20),
            _mm256_permute2f128_ps(u0, u1, 0x31),
        )
    }

    /// See [`super::partial`]; the caller checked the lengths.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn partial(
        g: &Group,
        pos: Range<usize>,
        q: &[f32],
        k: &[f16],
        v: &[f16],
        scores: &mut [f32],
        part: &mut [f32],
    ) {
        let n = pos.len();
        let (n_q, hdk, hdv) = (g.n_q, g.hdk, g.hdv);
        let (qp, kp, vp, sp) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), scores.as_mut_ptr());
        unsafe {
            // Scores: eight positions at a time per head, their sums reduced together (a horizontal sum per
            // position cost as much as its dot product at a head size of 64); the rest one at a time.
            let mut i = 0;
            if hdk % 16 == 0 {
                while i + 8 <= n {
                    let k0 = kp.add((pos.start + i) * hdk);
                    for h in 0..n_q {
                        let qh = qp.add(h * hdk);
                        let mut acc = [_mm512_setzero_ps(); 8];
                        let mut d = 0;
                        while d < hdk {
                            let qv = _mm512_loadu_ps(qh.add(d));
                            for (r, a) in acc.iter_mut().enumerate() {
                                *a = _mm512_fmadd_ps(qv, load16(k0.add(r * hdk + d)), *a);
                            }
                            d += 16;
                        }
                        let s = _mm256_mul_ps(sum8(&acc), _mm256_set1_ps(g.scale));
                        _mm256_storeu_ps(sp.add(h * n + i), s);
                    }
                    i += 8;
                }
            }
            for (i, j) in pos.clone().enumerate().skip(i) {
                let kr = kp.add(j * hdk);
                for h in 0..n_q {
                    *sp.add(h * n + i) = dot(qp.add(h * hdk), kr, hdk) * g.scale;
                }
            }
            // Softmax numerators, 16 scores at a time; each head's maximum and sum of them.
            for h in 0..n_q {
                let row = sp.add(h * n);
                let mut vmax = _mm512_set1_ps(f32::NEG_INFINITY);
                let mut i = 0;
                while i + 16 <= n {
                    vmax = _mm512_max_ps(vmax, _mm512_loadu_ps(row.add(i)));
                    i += 16;
                }
                let mut max = _mm512_reduce_max_ps(vmax);
                for t in i..n {
                    max = max.max(*row.add(t));
                }
                let m = _mm512_set1_ps(max);
                let mut vsum = _mm512_setzero_ps();
                let mut i = 0;
                while i + 16 <= n {
                    let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(row.add(i)), m));
                    _mm512_storeu_ps(row.add(i), e);
                    vsum = _mm512_add_ps(vsum, e);
                    i += 16;
                }
                if i < n {
                    let mask: __mmask16 = (1u32 << (n - i)) as u16 - 1;
                    let x = _mm512_mask_loadu_ps(m, mask, row.add(i));
                    let e = _mm512_maskz_mov_ps(mask, exp16(_mm512_sub_ps(x, m)));
                    _mm512_mask_storeu_ps(row.add(i), mask, e);
                    vsum = _mm512_add_ps(vsum, e);
                }
                part[n_q * hdv + h] = max;
                part[n_q * hdv + n_q + h] = _mm512_reduce_add_ps(vsum);
            }
            // Unnormalised output: 64 values of a head at a time in four registers, over every V row of the chunk.
            for h in 0..n_q {
                let row = sp.add(h * n);
                let o = part.as_mut_ptr().add(h * hdv);
                let mut d = 0;
                while d + 64 <= hdv {
                    let mut acc = [_mm512_setzero_ps(); 4];
                    for (i, j) in pos.clone().enumerate() {
                        let p = _mm512_set1_ps(*row.add(i));
                        let vr = vp.add(j * hdv + d);
                        for (c, a) in acc.iter_mut().enumerate() {
                            *a = _mm512_fmadd_ps(p, load16(vr.add(16 * c)), *a);
                        }
                    }
                    for (c, a) in acc.iter().enumerate() {
                        _mm512_storeu_ps(o.add(d + 16 * c), *a);
                    }
                    d += 64;
                }
                while d + 16 <= hdv {
                    let mut acc = _mm512_setzero_ps();
                    for (i, j) in pos.clone().enumerate() {
                        acc = _mm512_fmadd_ps(_mm512_set1_ps(*row.add(i)), load16(vp.add(j * hdv + d)), acc);
                    }
                    _mm512_storeu_ps(o.add(d), acc);
                    d += 16;
                }
                for dd in d..hdv {
                    let mut s = 0.0f32;
                    for (i, j) in pos.clone().enumerate() {
                        s += *row.add(i) * (*vp.add(j * hdv + dd)).to_f32();
                    }
                    *o.add(dd) = s;
                }
            }
        }
    }
}

/// The AVX2 version (x86-64 without AVX-512): the AVX-512 kernel's structure in 8-lane vectors, f16 widened with
/// F16C. Without it, AVX2 machines ran the scalar reference, and attention took two thirds of a 512-token prefill.
#[cfg(target_arch = "x86_64")]
pub(crate) mod avx2 {
    use super::{Group, Range};
    use crate::kernels::ops::x86::exp8;
    use half::f16;
    use std::arch::x86_64::*;

    /// 8 f16 values at `p`, widened.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn load8(p: *const f16) -> __m256 {
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn hsum(v: __m256) -> f32 {
        let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)))
    }

    /// Dot of `len` f32 (`a`) with `len` f16 (`b`); multiples of 8 in vectors, the rest scalar.
    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn dot(a: *const f32, b: *const f16, len: usize) -> f32 {
        unsafe {
            let (mut acc0, mut acc1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut d = 0;
            while d + 16 <= len {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(d)), load8(b.add(d)), acc0);
                acc1 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(d + 8)), load8(b.add(d + 8)), acc1);
                d += 16;
            }
            if d + 8 <= len {
                acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(a.add(d)), load8(b.add(d)), acc0);
                d += 8;
            }
            let mut s = hsum(_mm256_add_ps(acc0, acc1));
            while d < len {
                s += *a.add(d) * (*b.add(d)).to_f32();
                d += 1;
            }
            s
        }
    }

    /// The horizontal sums of eight vectors, as one vector `[Σa[0], …, Σa[7]]` (the hadd transpose).
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    fn sum8(y: &[__m256; 8]) -> __m256 {
        let t0 = _mm256_hadd_ps(y[0], y[1]);
        let t1 = _mm256_hadd_ps(y[2], y[3]);
        let t2 = _mm256_hadd_ps(y[4], y[5]);
        let t3 = _mm256_hadd_ps(y[6], y[7]);
        let u0 = _mm256_hadd_ps(t0, t1);
        let u1 = _mm256_hadd_ps(t2, t3);
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(u0, u1),
            _mm256_permute2f128_ps::<0x31>(u0, u1),
        )
    }

    /// See [`super::partial`]; the caller checked the lengths.
    ///
    /// # Safety
    /// The CPU must have AVX2, FMA and F16C; the slices must be as [`super::partial`] asserts.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn partial(
        g: &Group,
        pos: Range<usize>,
        q: &[f32],
        k: &[f16],
        v: &[f16],
        scores: &mut [f32],
        part: &mut [f32],
    ) {
        let n = pos.len();
        let (n_q, hdk, hdv) = (g.n_q, g.hdk, g.hdv);
        let (qp, kp, vp, sp) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), scores.as_mut_ptr());
        unsafe {
            // Scores: eight positions at a time per head, their sums reduced together; the rest one at a time.
            let mut i = 0;
            if hdk % 8 == 0 {
                while i + 8 <= n {
                    let k0 = kp.add((pos.start + i) * hdk);
                    for h in 0..n_q {
                        let qh = qp.add(h * hdk);
                        let mut acc = [_mm256_setzero_ps(); 8];
                        let mut d = 0;
                        while d < hdk {
                            let qv = _mm256_loadu_ps(qh.add(d));
                            for (r, a) in acc.iter_mut().enumerate() {
                                *a = _mm256_fmadd_ps(qv, load8(k0.add(r * hdk + d)), *a);
                            }
                            d += 8;
                        }
                        let s = _mm256_mul_ps(sum8(&acc), _mm256_set1_ps(g.scale));
                        _mm256_storeu_ps(sp.add(h * n + i), s);
                    }
                    i += 8;
                }
            }
            for (i, j) in pos.clone().enumerate().skip(i) {
                let kr = kp.add(j * hdk);
                for h in 0..n_q {
                    *sp.add(h * n + i) = dot(qp.add(h * hdk), kr, hdk) * g.scale;
                }
            }
            // Softmax numerators, 8 scores at a time (the tail through a padded copy); each head's maximum and sum.
            for h in 0..n_q {
                let row = sp.add(h * n);
                let mut vmax = _mm256_set1_ps(f32::NEG_INFINITY);
                let mut i = 0;
                while i + 8 <= n {
                    vmax = _mm256_max_ps(vmax, _mm256_loadu_ps(row.add(i)));
                    i += 8;
                }
                let mut lanes = [0.0f32; 8];
                _mm256_storeu_ps(lanes.as_mut_ptr(), vmax);
                let mut max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                for t in i..n {
                    max = max.max(*row.add(t));
                }
                let m = _mm256_set1_ps(max);
                let mut vsum = _mm256_setzero_ps();
                let mut i = 0;
                while i + 8 <= n {
                    let e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row.add(i)), m));
                    _mm256_storeu_ps(row.add(i), e);
                    vsum = _mm256_add_ps(vsum, e);
                    i += 8;
                }
                if i < n {
                    // Padding with the maximum gives e^0 = 1 in the unused lanes, dropped before the sum.
                    let mut t = [max; 8];
                    std::ptr::copy_nonoverlapping(row.add(i), t.as_mut_ptr(), n - i);
                    _mm256_storeu_ps(t.as_mut_ptr(), exp8(_mm256_sub_ps(_mm256_loadu_ps(t.as_ptr()), m)));
                    t[n - i..].fill(0.0);
                    std::ptr::copy_nonoverlapping(t.as_ptr(), row.add(i), n - i);
                    vsum = _mm256_add_ps(vsum, _mm256_loadu_ps(t.as_ptr()));
                }
                part[n_q * hdv + h] = max;
                part[n_q * hdv + n_q + h] = hsum(vsum);
            }
            // Unnormalised output: 32 values of a head at a time in four registers, over every V row of the chunk.
            for h in 0..n_q {
                let row = sp.add(h * n);
                let o = part.as_mut_ptr().add(h * hdv);
                let mut d = 0;
                while d + 32 <= hdv {
                    let mut acc = [_mm256_setzero_ps(); 4];
                    for (i, j) in pos.clone().enumerate() {
                        let p = _mm256_set1_ps(*row.add(i));
                        let vr = vp.add(j * hdv + d);
                        for (c, a) in acc.iter_mut().enumerate() {
                            *a = _mm256_fmadd_ps(p, load8(vr.add(8 * c)), *a);
                        }
                    }
                    for (c, a) in acc.iter().enumerate() {
                        _mm256_storeu_ps(o.add(d + 8 * c), *a);
                    }
                    d += 32;
                }
                while d + 8 <= hdv {
                    let mut acc = _mm256_setzero_ps();
                    for (i, j) in pos.clone().enumerate() {
                        acc = _mm256_fmadd_ps(_mm256_set1_ps(*row.add(i)), load8(vp.add(j * hdv + d)), acc);
                    }
                    _mm256_storeu_ps(o.add(d), acc);
                    d += 8;
                }
                for dd in d..hdv {
                    let mut s = 0.0f32;
                    for (i, j) in pos.clone().enumerate() {
                        s += *row.add(i) * (*vp.add(j * hdv + dd)).to_f32();
                    }
                    *o.add(dd) = s;
                }
            }
        }
    }
}

/// The NEON version (AArch64): the x86 kernel's structure in 4-lane vectors, f16 widened with `fcvtl`.
#[cfg(target_arch = "aarch64")]
mod neon {
    use super::{Group, Range};
    use crate::kernels::ops::neon::exp4;
    use half::f16;
    use std::arch::aarch64::*;

    /// 4 f16 values at `p`, widened.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn load4(p: *const f16) -> float32x4_t {
        unsafe { vcvt_f32_f16(vreinterpret_f16_u16(vld1_u16(p as *const u16))) }
    }

    /// Dot of `len` f32 (`a`) with `len` f16 (`b`); multiples of 4 in vectors, the rest scalar.
    #[target_feature(enable = "neon")]
    #[inline]
    unsafe fn dot(a: *const f32, b: *const f16, len: usize) -> f32 {
        unsafe {
            let (mut acc0, mut acc1) = (vdupq_n_f32(0.0), vdupq_n_f32(0.0));
            let mut d = 0;
            while d + 8 <= len {
                acc0 = vfmaq_f32(acc0, vld1q_f32(a.add(d)), load4(b.add(d)));
                acc1 = vfmaq_f32(acc1, vld1q_f32(a.add(d + 4)), load4(b.add(d + 4)));
                d += 8;
            }
            if d + 4 <= len {
                acc0 = vfmaq_f32(acc0, vld1q_f32(a.add(d)), load4(b.add(d)));
                d += 4;
            }
            let mut s = vaddvq_f32(vaddq_f32(acc0, acc1));
            while d < len {
                s += *a.add(d) * (*b.add(d)).to_f32();
                d += 1;
            }
            s
        }
    }

    /// See [`super::partial`]; the caller checked the lengths.
    #[target_feature(enable = "neon")]
    pub unsafe fn partial(
        g: &Group,
        pos: Range<usize>,
        q: &[f32],
        k: &[f16],
        v: &[f16],
        scores: &mut [f32],
        part: &mut [f32],
    ) {
        let n = pos.len();
        let (n_q, hdk, hdv) = (g.n_q, g.hdk, g.hdv);
        let (qp, kp, vp, sp) = (q.as_ptr(), k.as_ptr(), v.as_ptr(), scores.as_mut_ptr());
        unsafe {
            // Scores: four positions at a time per head, their sums reduced together by pairwise adds; the rest
            // one at a time.
            let mut i = 0;
            if hdk % 4 == 0 {
                while i + 4 <= n {
                    let k0 = kp.add((pos.start + i) * hdk);
                    for h in 0..n_q {
                        let qh = qp.add(h * hdk);
                        let mut acc = [vdupq_n_f32(0.0); 4];
                        let mut d = 0;
                        while d < hdk {
                            let qv = vld1q_f32(qh.add(d));
                            for (r, a) in acc.iter_mut().enumerate() {
                                *a = vfmaq_f32(*a, qv, load4(k0.add(r * hdk + d)));
                            }
                            d += 4;
                        }
                        let s = vpaddq_f32(vpaddq_f32(acc[0], acc[1]), vpaddq_f32(acc[2], acc[3]));
                        vst1q_f32(sp.add(h * n + i), vmulq_n_f32(s, g.scale));
                    }
                    i += 4;
                }
            }
            for (i, j) in pos.clone().enumerate().skip(i) {
                let kr = kp.add(j * hdk);
                for h in 0..n_q {
                    *sp.add(h * n + i) = dot(qp.add(h * hdk), kr, hdk) * g.scale;
                }
            }
            // Softmax numerators, 4 scores at a time (the tail through a padded copy); each head's maximum and sum.
            for h in 0..n_q {
                let row = sp.add(h * n);
                let mut vmax = vdupq_n_f32(f32::NEG_INFINITY);
                let mut i = 0;
                while i + 4 <= n {
                    vmax = vmaxq_f32(vmax, vld1q_f32(row.add(i)));
                    i += 4;
                }
                let mut max = vmaxvq_f32(vmax);
                for t in i..n {
                    max = max.max(*row.add(t));
                }
                let m = vdupq_n_f32(max);
                let mut vsum = vdupq_n_f32(0.0);
                let mut i = 0;
                while i + 4 <= n {
                    let e = exp4(vsubq_f32(vld1q_f32(row.add(i)), m));
                    vst1q_f32(row.add(i), e);
                    vsum = vaddq_f32(vsum, e);
                    i += 4;
                }
                if i < n {
                    // Padding with the maximum gives e^0 = 1 in the unused lanes, dropped before the sum.
                    let mut t = [max; 4];
                    std::ptr::copy_nonoverlapping(row.add(i), t.as_mut_ptr(), n - i);
                    vst1q_f32(t.as_mut_ptr(), exp4(vsubq_f32(vld1q_f32(t.as_ptr()), m)));
                    t[n - i..].fill(0.0);
                    std::ptr::copy_nonoverlapping(t.as_ptr(), row.add(i), n - i);
                    vsum = vaddq_f32(vsum, vld1q_f32(t.as_ptr()));
                }
                part[n_q * hdv + h] = max;
                part[n_q * hdv + n_q + h] = vaddvq_f32(vsum);
            }
            // Unnormalised output: 16 values of a head at a time in four registers, over every V row of the chunk.
            for h in 0..n_q {
                let row = sp.add(h * n);
                let o = part.as_mut_ptr().add(h * hdv);
                let mut d = 0;
                while d + 16 <= hdv {
                    let mut acc = [vdupq_n_f32(0.0); 4];
                    for (i, j) in pos.clone().enumerate() {
                        let p = vdupq_n_f32(*row.add(i));
                        let vr = vp.add(j * hdv + d);
                        for (c, a) in acc.iter_mut().enumerate() {
                            *a = vfmaq_f32(*a, p, load4(vr.add(4 * c)));
                        }
                    }
                    for (c, a) in acc.iter().enumerate() {
                        vst1q_f32(o.add(d + 4 * c), *a);
                    }
                    d += 16;
                }
                while d + 4 <= hdv {
                    let mut acc = vdupq_n_f32(0.0);
                    for (i, j) in pos.clone().enumerate() {
                        acc = vfmaq_f32(acc, vdupq_n_f32(*row.add(i)), load4(vp.add(j * hdv + d)));
                    }
                    vst1q_f32(o.add(d), acc);
                    d += 4;
                }
                for dd in d..hdv {
                    let mut s = 0.0f32;
                    for (i, j) in pos.clone().enumerate() {
                        s += *row.add(i) * (*vp.add(j * hdv + dd)).to_f32();
                    }
                    *o.add(dd) = s;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::testutil::Rng;

    /// Softmax attention of one head in f64 over all positions at once: the mathematical definition.
    fn reference(g: &Group, q: &[f32], k: &[f16], v: &[f16]) -> Vec<f32> {
        let mut out = vec![0.0f32; g.n_q * g.hdv];
        for h in 0..g.n_q {
            let qh = &q[h * g.hdk..(h + 1) * g.hdk];
            let s: Vec<f64> = (g.lo..g.hi)
                .map(|j| {
                    let kr = &k[j * g.hdk..(j + 1) * g.hdk];
                    qh.iter().zip(kr).map(|(a, b)| *a as f64 * b.to_f64()).sum::<f64>() * g.scale as f64
                })
                .collect();
            let max = s.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|x| (x - max).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..g.hdv {
                let o: f64 = (g.lo..g.hi).zip(&e).map(|(j, w)| w * v[j * g.hdv + d].to_f64()).sum();
                out[h * g.hdv + d] = (o / sum) as f32;
            }
        }
        out
    }

    /// Every value of `got` within 2e-5 (relative, plus absolute near 0) of `want`.
    fn assert_close(want: &[f32], got: &[f32], what: &str) {
        for (i, (a, b)) in want.iter().zip(got).enumerate() {
            assert!((a - b).abs() <= 2e-5 * (1.0 + a.abs()), "{what} [{i}]: {a} vs {b}");
        }
    }

    fn case(
        rng: &mut Rng,
        n_q: usize,
        hdk: usize,
        hdv: usize,
        lo: usize,
        hi: usize,
    ) -> (Group, Vec<f32>, Vec<f16>, Vec<f16>) {
        let g = Group {
            n_q,
            hdk,
            hdv,
            lo,
            hi,
            scale: 1.0 / (hdk as f32).sqrt(),
        };
        let q: Vec<f32> = (0..n_q * hdk).map(|_| rng.normal() * 2.0).collect();
        let k: Vec<f16> = (0..hi * hdk).map(|_| f16::from_f32(rng.normal())).collect();
        let v: Vec<f16> = (0..hi * hdv).map(|_| f16::from_f32(rng.normal())).collect();
        (g, q, k, v)
    }

    // (heads in the group, head dims, positions): SmolLM2 (3 × 64), Gemma 3 (4 × 256), one and several chunks,
    // ragged chunk tails, odd head dims.
    const SHAPES: [(usize, usize, usize, usize, usize); 9] = [
        (3, 64, 64, 0, 1),
        (3, 64, 64, 0, 37),
        (3, 64, 64, 100, 613),
        (3, 64, 64, 0, 1024),
        (4, 256, 256, 0, 530),
        (4, 256, 256, 300, 812),
        (1, 40, 24, 3, 20),
        (2, 16, 80, 0, 16),
        (2, 18, 10, 1, 9),
    ];

    #[test]
    fn chunked_attention_matches_the_definition() {
        let mut rng = Rng(11);
        for (n_q, hdk, hdv, lo, hi) in SHAPES {
            let (g, q, k, v) = case(&mut rng, n_q, hdk, hdv, lo, hi);
            let want = reference(&g, &q, &k, &v);
            let mut sc = vec![0.0; g.scratch_len()];
            let mut got = vec![0.0; n_q * hdv];
            attend(&g, &q, &k, &v, &mut sc, &mut got);
            assert_close(&want, &got, &format!("{n_q}x{hdk} {lo}..{hi}"));
        }
    }

    #[test]
    fn simd_partials_match_the_scalar_reference() {
        let mut rng = Rng(12);
        for (n_q, hdk, hdv, lo, hi) in SHAPES {
            let (g, q, k, v) = case(&mut rng, n_q, hdk, hdv, lo, hi);
            let mut sc = vec![0.0; scores_len(n_q)];
            for c in 0..g.n_chunks() {
                let (mut want, mut got) = (vec![0.0; g.partial_len()], vec![0.0; g.partial_len()]);
                partial_scalar(&g, g.chunk(c), &q, &k, &v, &mut sc, &mut want);
                partial(&g, c, &q, &k, &v, &mut sc, &mut got);
                assert_close(&want, &got, &format!("{n_q}x{hdk} {lo}..{hi} chunk {c}"));
            }
        }
    }

    /// The AVX2 kernel against the scalar reference, whatever level the dispatch picked on this machine.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx2_partials_match_the_scalar_reference() {
        if !crate::kernels::x86::has_avx2() {
            eprintln!("SKIPPED: no AVX2 here, the AVX2 attention kernel not tested");
            return;
        }
        let mut rng = Rng(14);
        for (n_q, hdk, hdv, lo, hi) in SHAPES {
            let (g, q, k, v) = case(&mut rng, n_q, hdk, hdv, lo, hi);
            let mut sc = vec![0.0; scores_len(n_q)];
            for c in 0..g.n_chunks() {
                let (mut want, mut got) = (vec![0.0; g.partial_len()], vec![0.0; g.partial_len()]);
                partial_scalar(&g, g.chunk(c), &q, &k, &v, &mut sc, &mut want);
                // SAFETY: AVX2 checked above; the shapes satisfy `partial`'s assertions.
                unsafe { avx2::partial(&g, g.chunk(c), &q, &k, &v, &mut sc, &mut got) };
                assert_close(&want, &got, &format!("avx2 {n_q}x{hdk} {lo}..{hi} chunk {c}"));
            }
        }
    }

    /// Partials computed separately (as threads do at decode) and folded in order give [`attend`]'s bits.
    #[test]
    fn split_chunks_give_the_same_bits() {
        let mut rng = Rng(13);
        for (n_q, hdk, hdv, lo, hi) in SHAPES {
            let (g, q, k, v) = case(&mut rng, n_q, hdk, hdv, lo, hi);
            let mut sc = vec![0.0; g.scratch_len()];
            let mut whole = vec![0.0; n_q * hdv];
            attend(&g, &q, &k, &v, &mut sc, &mut whole);
            let parts: Vec<Vec<f32>> = (0..g.n_chunks())
                .rev()
                .map(|c| {
                    let mut p = vec![0.0; g.partial_len()];
                    partial(&g, c, &q, &k, &v, &mut sc, &mut p);
                    p
                })
                .collect();
            let mut acc = parts[parts.len() - 1].clone();
            for p in parts.iter().rev().skip(1) {
                fold(&g, &mut acc, p);
            }
            let mut split = vec![0.0; n_q * hdv];
            finish(&g, &acc, &mut split);
            assert_eq!(whole, split, "{n_q}x{hdk} {lo}..{hi}");
        }
    }
}
