//! Prefill attention in GEMM form: a tile of query vectors that share one KV head (several consecutive rows × the
//! GQA group's query heads, up to [`MAX_Q`]) walks the positions in chunks of [`CHUNK`], and each chunk's scores
//! and weighted sum of V are small matrix products with no horizontal sums.
//!
//! Why: at a long context the per-row kernel (`kernels::attention`) widens every f16 K and V value once per query
//! head and reduces each score horizontally; on Zen 4 that kept SmolLM2's pp512 at depth 4096 at a quarter of its
//! depth-0 rate, and two attempts that kept its bits (docs/performance.md) did not gain. Here each chunk of K and V
//! is widened to f32 once for the whole tile, and the query vectors lie across the vector lanes: the transposed
//! queries `Qt[d][i]` (scaled) are built once per tile, the scores `St[pos][i] = Σ_d K[pos][d] · Qt[d][i]` take one
//! broadcast K value and one FMA per lane vector, the online softmax (running maximum and sum per query vector) is
//! element-wise over lanes, and `Ot[d][i] = α[i] · Ot[d][i] + Σ_pos V[pos][d] · St[pos][i]` has the same shape.
//!
//! The order of the sums differs from the per-row kernel, so results agree within rounding, not bit for bit: the
//! CPU backend uses tiles only for prefill batches of at least [`MIN_ROWS`] rows of one cache, each row attending to
//! at least [`MIN_SPAN`] positions, so decode, a speculative verify of a few tokens and short prompts keep the
//! per-row kernel. A row's result does not depend on the tile it is in:
//! chunks start at multiples of [`CHUNK`], every lane's sums run in position order, and positions outside a row's
//! span add exact zeros (a chunk with none of them leaves its maximum, sum and output unchanged).
//!
//! AVX-512 and AVX2 kernels; elsewhere (scalar, NEON) the per-row kernel runs. The per-row scalar reference is
//! what the tests compare both against.

use half::f16;
use std::ops::Range;

/// Query vectors (rows × heads) in one lane block.
pub const LANES: usize = 16;

/// Query vectors in one tile: four lane blocks, so the AVX-512 score and output kernels keep 16 sums in registers.
pub const MAX_Q: usize = 4 * LANES;

/// Positions per chunk, counted from position 0: the chunk's widened K and V and its scores stay in L1/L2.
pub const CHUNK: usize = 64;

/// The fewest rows of one cache for which the CPU backend takes tiles: fewer rows (decode, a speculative verify)
/// keep the per-row kernel, so they give the same bits as each other.
pub const MIN_ROWS: usize = 16;

/// The fewest positions every row of the batch must attend to for the CPU backend to take tiles. Short contexts
/// keep the per-row kernel, whose result for a row does not depend on how the rows were batched: a prompt prefilled
/// on another node, or a turn's last tokens decoded one at a time, then gives the local run's bits (the
/// disaggregation tests compare greedy text exactly). Past it a row prefilled in a batch and the same row decoded
/// alone agree within rounding only.
pub const MIN_SPAN: usize = 512;

/// The most rows in one tile (group of one query head per KV head): the causal end of a tile computes scores it
/// then masks, so tiles stay short.
const MAX_ROWS: usize = 32;

/// One tile: `spans.len()` rows of `n_q` query heads each (`hdk` values), sharing one KV head whose K rows have
/// `hdk` values and V rows `hdv`; row `r` attends to the positions `spans[r]`.
pub struct Tile<'a> {
    pub n_q: usize,
    pub hdk: usize,
    pub hdv: usize,
    pub scale: f32,
    pub spans: &'a [Range<usize>],
}

/// Rows per tile for a GQA group of `n_q` query heads; 0 where one row's heads fill more than a tile.
pub fn rows_per_tile(n_q: usize) -> usize {
    MAX_Q.checked_div(n_q).map_or(0, |r| r.min(MAX_ROWS))
}

/// Scratch floats one [`attend`] call needs.
pub fn scratch_len(hdk: usize, hdv: usize) -> usize {
    MAX_Q * (hdk + hdv + CHUNK + 3) + CHUNK * (hdk + hdv)
}

/// Whether this CPU's kernel level has tile kernels (the kernel table's choice, `BATON_ISA` included).
pub fn available() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(super::kernels().isa, "avx512" | "avx2")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// `out[i] = softmax(scale · q_i · Kᵀ) · V` over its row's span, for each query vector `i = r · n_q + h` (row `r`,
/// head `h`, `hdv` values each, contiguous in `out`). Row `r`'s heads start at `q[r · q_stride]`; `k` and `v` hold
/// the KV head's rows from position 0; `scratch` has at least [`scratch_len`] floats. Only where [`available`].
pub fn attend(t: &Tile, q: &[f32], q_stride: usize, k: &[f16], v: &[f16], scratch: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match super::kernels().isa {
        "avx512" => return run::<x86::Avx512>(t, q, q_stride, k, v, scratch, out),
        "avx2" => return run::<x86::Avx2>(t, q, q_stride, k, v, scratch, out),
        _ => {}
    }
    let _ = (t, q, q_stride, k, v, scratch, out);
    panic!("tiled attention needs AVX2 or AVX-512; check `available()` first");
}

/// The vector kernels of one level. The caller ([`run`]) has checked every bound they rely on.
#[cfg(target_arch = "x86_64")]
trait Level {
    /// `dst[..src.len()]` = `src` widened.
    unsafe fn widen(src: &[f16], dst: &mut [f32]);

    /// `C[r][i] = α[i] · C[r][i] + Σ_k A[r·ars + k·aks] · B[k·bs + i]` for `r < rows`, `i < 16 · nb`, `k < kdim`;
    /// `C[r][i]` at `c[r · cs + i]`. Without `alpha`, C starts at zero.
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm(
        a: *const f32,
        ars: usize,
        aks: usize,
        rows: usize,
        b: *const f32,
        bs: usize,
        nb: usize,
        kdim: usize,
        c: *mut f32,
        cs: usize,
        alpha: Option<*const f32>,
    );

    /// One chunk's online softmax step over the scores `St[i][lane]` (`n` positions from `pos0`, rows of `mp`): each
    /// lane's new maximum `mx`, the factor `alpha` its old sum and output are rescaled by, the scores replaced by
    /// their exponentials (0 outside the lane's span `lo..hi` where `span` is given; without it every position is
    /// in every span) and their sum added to `l`.
    #[allow(clippy::too_many_arguments)]
    unsafe fn softmax(
        st: *mut f32,
        n: usize,
        mp: usize,
        nb: usize,
        pos0: usize,
        span: Option<(&[i32; MAX_Q], &[i32; MAX_Q])>,
        mx: *mut f32,
        l: *mut f32,
        alpha: *mut f32,
    );
}

/// [`attend`] with the kernels of level `L`.
#[cfg(target_arch = "x86_64")]
fn run<L: Level>(t: &Tile, q: &[f32], q_stride: usize, k: &[f16], v: &[f16], scratch: &mut [f32], out: &mut [f32]) {
    let (n_q, hdk, hdv, rows) = (t.n_q, t.hdk, t.hdv, t.spans.len());
    let m = rows * n_q;
    assert!(m > 0 && m <= MAX_Q, "a tile of {rows} rows × {n_q} heads");
    assert!(t.spans.iter().all(|s| s.start < s.end), "attention over no positions");
    let first = t.spans.iter().map(|s| s.start).min().unwrap_or(0);
    let end = t.spans.iter().map(|s| s.end).max().unwrap_or(0);
    assert!(i32::try_from(end).is_ok(), "position {end} past i32");
    assert!(q.len() >= (rows - 1) * q_stride + n_q * hdk);
    assert!(k.len() >= end * hdk && v.len() >= end * hdv);
    assert!(scratch.len() >= scratch_len(hdk, hdv) && out.len() >= m * hdv);
    let mp = m.div_ceil(LANES) * LANES;
    let nb = mp / LANES;

    let (qt, rest) = scratch.split_at_mut(hdk * mp);
    let (ot, rest) = rest.split_at_mut(hdv * mp);
    let (st, rest) = rest.split_at_mut(CHUNK * mp);
    let (kf, rest) = rest.split_at_mut(CHUNK * hdk);
    let (vf, rest) = rest.split_at_mut(CHUNK * hdv);
    let (mx, rest) = rest.split_at_mut(mp);
    let (l, rest) = rest.split_at_mut(mp);
    let alpha = &mut rest[..mp];

    // Lane i is row i / n_q, head i % n_q; the padding lanes have empty spans (and zero queries).
    let (mut lo, mut hi) = ([0i32; MAX_Q], [0i32; MAX_Q]);
    qt.fill(0.0);
    for (r, s) in t.spans.iter().enumerate() {
        for h in 0..n_q {
            let i = r * n_q + h;
            (lo[i], hi[i]) = (s.start as i32, s.end as i32);
            let qi = &q[r * q_stride + h * hdk..r * q_stride + (h + 1) * hdk];
            for (d, &x) in qi.iter().enumerate() {
                qt[d * mp + i] = x * t.scale;
            }
        }
    }
    ot.fill(0.0);
    mx.fill(f32::MIN);
    l.fill(0.0);
    // Chunks inside every row's span need no mask.
    let inner_lo = t.spans.iter().map(|s| s.start).max().unwrap_or(0);
    let inner_hi = t.spans.iter().map(|s| s.end).min().unwrap_or(0);

    let mut c0 = first / CHUNK * CHUNK;
    while c0 < end {
        let (a, b) = (c0.max(first), (c0 + CHUNK).min(end));
        let (n, np) = (b - a, (b - a).next_multiple_of(4));
        let whole = a >= inner_lo && b <= inner_hi;
        // SAFETY: the level's kernels run only where the CPU has them (`attend`, the tests); every bound was checked
        // above: kf holds CHUNK ≥ np rows of hdk, vf n rows of hdv, st np rows of mp, qt hdk rows, ot hdv rows.
        unsafe {
            L::widen(&k[a * hdk..b * hdk], kf);
            kf[n * hdk..np * hdk].fill(0.0);
            L::gemm(
                kf.as_ptr(),
                hdk,
                1,
                np,
                qt.as_ptr(),
                mp,
                nb,
                hdk,
                st.as_mut_ptr(),
                mp,
                None,
            );
            let span = (!whole).then_some((&lo, &hi));
            L::softmax(
                st.as_mut_ptr(),
                n,
                mp,
                nb,
                a,
                span,
                mx.as_mut_ptr(),
                l.as_mut_ptr(),
                alpha.as_mut_ptr(),
            );
            L::widen(&v[a * hdv..b * hdv], vf);
            let al = Some(alpha.as_ptr());
            L::gemm(
                vf.as_ptr(),
                1,
                hdv,
                hdv,
                st.as_ptr(),
                mp,
                nb,
                n,
                ot.as_mut_ptr(),
                mp,
                al,
            );
        }
        c0 += CHUNK;
    }
    for i in 0..m {
        let inv = 1.0 / l[i];
        for (d, o) in out[i * hdv..(i + 1) * hdv].iter_mut().enumerate() {
            *o = ot[d * mp + i] * inv;
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::{LANES, Level, MAX_Q};
    use crate::kernels::ops::x86::{exp8, exp16};
    use half::f16;
    use std::arch::x86_64::*;

    /// Rows of C per register tile.
    const RB: usize = 4;

    /// AVX-512F: a lane block is one register.
    pub struct Avx512;

    #[target_feature(enable = "avx512f")]
    unsafe fn widen16(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        assert!(dst.len() >= n);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY: i + 16 ≤ n ≤ both lengths.
        unsafe {
            while i + 16 <= n {
                _mm512_storeu_ps(
                    d.add(i),
                    _mm512_cvtph_ps(_mm256_loadu_si256(s.add(i) as *const __m256i)),
                );
                i += 16;
            }
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// `R` rows × `NB` lane blocks of C in registers, over all of `k`.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block16<const R: usize, const NB: usize>(
        a: *const f32,
        ars: usize,
        aks: usize,
        b: *const f32,
        bs: usize,
        kdim: usize,
        c: *mut f32,
        cs: usize,
        alpha: Option<*const f32>,
    ) {
        unsafe {
            let mut acc = [[_mm512_setzero_ps(); NB]; R];
            if let Some(al) = alpha {
                for j in 0..NB {
                    let f = _mm512_loadu_ps(al.add(16 * j));
                    for (r, row) in acc.iter_mut().enumerate() {
                        row[j] = _mm512_mul_ps(_mm512_loadu_ps(c.add(r * cs + 16 * j)), f);
                    }
                }
            }
            for kk in 0..kdim {
                let bp = b.add(kk * bs);
                let mut bv = [_mm512_setzero_ps(); NB];
                for (j, x) in bv.iter_mut().enumerate() {
                    *x = _mm512_loadu_ps(bp.add(16 * j));
                }
                let ap = a.add(kk * aks);
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = _mm512_set1_ps(*ap.add(r * ars));
                    for (s, y) in row.iter_mut().zip(&bv) {
                        *s = _mm512_fmadd_ps(x, *y, *s);
                    }
                }
            }
            for (r, row) in acc.iter().enumerate() {
                for (j, s) in row.iter().enumerate() {
                    _mm512_storeu_ps(c.add(r * cs + 16 * j), *s);
                }
            }
        }
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn gemm16<const NB: usize>(
        a: *const f32,
        ars: usize,
        aks: usize,
        rows: usize,
        b: *const f32,
        bs: usize,
        kdim: usize,
        c: *mut f32,
        cs: usize,
        alpha: Option<*const f32>,
    ) {
        let mut r = 0;
        unsafe {
            while r + RB <= rows {
                block16::<RB, NB>(a.add(r * ars), ars, aks, b, bs, kdim, c.add(r * cs), cs, alpha);
                r += RB;
            }
            while r < rows {
                block16::<1, NB>(a.add(r * ars), ars, aks, b, bs, kdim, c.add(r * cs), cs, alpha);
                r += 1;
            }
        }
    }

    /// The lanes whose span `lo..hi` holds position `p`.
    #[target_feature(enable = "avx512f")]
    #[inline]
    fn inside16(lo: __m512i, hi: __m512i, p: usize) -> __mmask16 {
        let p = _mm512_set1_epi32(p as i32);
        _mm512_cmple_epi32_mask(lo, p) & _mm512_cmpgt_epi32_mask(hi, p)
    }

    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn softmax16(
        st: *mut f32,
        n: usize,
        mp: usize,
        nb: usize,
        pos0: usize,
        span: Option<(&[i32; MAX_Q], &[i32; MAX_Q])>,
        mx: *mut f32,
        l: *mut f32,
        alpha: *mut f32,
    ) {
        unsafe {
            for j in 0..nb {
                let o = LANES * j;
                // Lanes whose span holds position pos0 + i (all of them without spans).
                let (lov, hiv) = match span {
                    Some((lo, hi)) => (
                        _mm512_loadu_si512(lo.as_ptr().add(o) as *const _),
                        _mm512_loadu_si512(hi.as_ptr().add(o) as *const _),
                    ),
                    None => (_mm512_set1_epi32(i32::MIN), _mm512_set1_epi32(i32::MAX)),
                };
                let inside = |i: usize| inside16(lov, hiv, pos0 + i);
                let mut cmax = _mm512_set1_ps(f32::MIN);
                for i in 0..n {
                    let s = _mm512_loadu_ps(st.add(i * mp + o));
                    cmax = _mm512_mask_max_ps(cmax, inside(i), cmax, s);
                }
                let mold = _mm512_loadu_ps(mx.add(o));
                let mnew = _mm512_max_ps(mold, cmax);
                let f = exp16(_mm512_sub_ps(mold, mnew));
                let mut sum = _mm512_setzero_ps();
                for i in 0..n {
                    let p = st.add(i * mp + o);
                    let e = _mm512_maskz_mov_ps(inside(i), exp16(_mm512_sub_ps(_mm512_loadu_ps(p), mnew)));
                    _mm512_storeu_ps(p, e);
                    sum = _mm512_add_ps(sum, e);
                }
                _mm512_storeu_ps(l.add(o), _mm512_fmadd_ps(_mm512_loadu_ps(l.add(o)), f, sum));
                _mm512_storeu_ps(mx.add(o), mnew);
                _mm512_storeu_ps(alpha.add(o), f);
            }
        }
    }

    impl Level for Avx512 {
        unsafe fn widen(src: &[f16], dst: &mut [f32]) {
            unsafe { widen16(src, dst) }
        }

        unsafe fn gemm(
            a: *const f32,
            ars: usize,
            aks: usize,
            rows: usize,
            b: *const f32,
            bs: usize,
            nb: usize,
            kdim: usize,
            c: *mut f32,
            cs: usize,
            alpha: Option<*const f32>,
        ) {
            unsafe {
                match nb {
                    1 => gemm16::<1>(a, ars, aks, rows, b, bs, kdim, c, cs, alpha),
                    2 => gemm16::<2>(a, ars, aks, rows, b, bs, kdim, c, cs, alpha),
                    3 => gemm16::<3>(a, ars, aks, rows, b, bs, kdim, c, cs, alpha),
                    4 => gemm16::<4>(a, ars, aks, rows, b, bs, kdim, c, cs, alpha),
                    _ => unreachable!("a tile has 1 to 4 lane blocks"),
                }
            }
        }

        unsafe fn softmax(
            st: *mut f32,
            n: usize,
            mp: usize,
            nb: usize,
            pos0: usize,
            span: Option<(&[i32; MAX_Q], &[i32; MAX_Q])>,
            mx: *mut f32,
            l: *mut f32,
            alpha: *mut f32,
        ) {
            unsafe { softmax16(st, n, mp, nb, pos0, span, mx, l, alpha) }
        }
    }

    /// AVX2 + FMA + F16C: a lane block is two registers, done one block at a time (8 sums in registers).
    pub struct Avx2;

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn widen8(src: &[f16], dst: &mut [f32]) {
        let n = src.len();
        assert!(dst.len() >= n);
        let (s, d) = (src.as_ptr(), dst.as_mut_ptr());
        let mut i = 0;
        // SAFETY: i + 8 ≤ n ≤ both lengths.
        unsafe {
            while i + 8 <= n {
                _mm256_storeu_ps(d.add(i), _mm256_cvtph_ps(_mm_loadu_si128(s.add(i) as *const __m128i)));
                i += 8;
            }
        }
        for j in i..n {
            dst[j] = src[j].to_f32();
        }
    }

    /// `R` rows × one lane block (two registers) of C, over all of `k`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn block8<const R: usize>(
        a: *const f32,
        ars: usize,
        aks: usize,
        b: *const f32,
        bs: usize,
        kdim: usize,
        c: *mut f32,
        cs: usize,
        alpha: Option<*const f32>,
    ) {
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; R];
            if let Some(al) = alpha {
                let f = [_mm256_loadu_ps(al), _mm256_loadu_ps(al.add(8))];
                for (r, row) in acc.iter_mut().enumerate() {
                    row[0] = _mm256_mul_ps(_mm256_loadu_ps(c.add(r * cs)), f[0]);
                    row[1] = _mm256_mul_ps(_mm256_loadu_ps(c.add(r * cs + 8)), f[1]);
                }
            }
            for kk in 0..kdim {
                let bp = b.add(kk * bs);
                let (b0, b1) = (_mm256_loadu_ps(bp), _mm256_loadu_ps(bp.add(8)));
                let ap = a.add(kk * aks);
                for (r, row) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*ap.add(r * ars));
                    row[0] = _mm256_fmadd_ps(x, b0, row[0]);
                    row[1] = _mm256_fmadd_ps(x, b1, row[1]);
                }
            }
            for (r, row) in acc.iter().enumerate() {
                _mm256_storeu_ps(c.add(r * cs), row[0]);
                _mm256_storeu_ps(c.add(r * cs + 8), row[1]);
            }
        }
    }

    /// All ones in the lanes whose span `lo..hi` holds position `p`.
    #[target_feature(enable = "avx2")]
    #[inline]
    fn inside8(lo: __m256i, hi: __m256i, p: usize) -> __m256 {
        let p = _mm256_set1_epi32(p as i32);
        _mm256_castsi256_ps(_mm256_andnot_si256(
            _mm256_cmpgt_epi32(lo, p),
            _mm256_cmpgt_epi32(hi, p),
        ))
    }

    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)]
    unsafe fn softmax8(
        st: *mut f32,
        n: usize,
        mp: usize,
        nb: usize,
        pos0: usize,
        span: Option<(&[i32; MAX_Q], &[i32; MAX_Q])>,
        mx: *mut f32,
        l: *mut f32,
        alpha: *mut f32,
    ) {
        unsafe {
            for j in 0..2 * nb {
                let o = 8 * j;
                let (lov, hiv) = match span {
                    Some((lo, hi)) => (
                        _mm256_loadu_si256(lo.as_ptr().add(o) as *const __m256i),
                        _mm256_loadu_si256(hi.as_ptr().add(o) as *const __m256i),
                    ),
                    None => (_mm256_set1_epi32(i32::MIN), _mm256_set1_epi32(i32::MAX)),
                };
                let inside = |i: usize| inside8(lov, hiv, pos0 + i);
                let low = _mm256_set1_ps(f32::MIN);
                let mut cmax = low;
                for i in 0..n {
                    let s = _mm256_blendv_ps(low, _mm256_loadu_ps(st.add(i * mp + o)), inside(i));
                    cmax = _mm256_max_ps(cmax, s);
                }
                let mold = _mm256_loadu_ps(mx.add(o));
                let mnew = _mm256_max_ps(mold, cmax);
                let f = exp8(_mm256_sub_ps(mold, mnew));
                let mut sum = _mm256_setzero_ps();
                for i in 0..n {
                    let p = st.add(i * mp + o);
                    let e = _mm256_and_ps(inside(i), exp8(_mm256_sub_ps(_mm256_loadu_ps(p), mnew)));
                    _mm256_storeu_ps(p, e);
                    sum = _mm256_add_ps(sum, e);
                }
                _mm256_storeu_ps(l.add(o), _mm256_fmadd_ps(_mm256_loadu_ps(l.add(o)), f, sum));
                _mm256_storeu_ps(mx.add(o), mnew);
                _mm256_storeu_ps(alpha.add(o), f);
            }
        }
    }

    impl Level for Avx2 {
        unsafe fn widen(src: &[f16], dst: &mut [f32]) {
            unsafe { widen8(src, dst) }
        }

        unsafe fn gemm(
            a: *const f32,
            ars: usize,
            aks: usize,
            rows: usize,
            b: *const f32,
            bs: usize,
            nb: usize,
            kdim: usize,
            c: *mut f32,
            cs: usize,
            alpha: Option<*const f32>,
        ) {
            for j in 0..nb {
                let (b, c) = unsafe { (b.add(LANES * j), c.add(LANES * j)) };
                let alpha = alpha.map(|p| unsafe { p.add(LANES * j) });
                let mut r = 0;
                unsafe {
                    while r + RB <= rows {
                        block8::<RB>(a.add(r * ars), ars, aks, b, bs, kdim, c.add(r * cs), cs, alpha);
                        r += RB;
                    }
                    while r < rows {
                        block8::<1>(a.add(r * ars), ars, aks, b, bs, kdim, c.add(r * cs), cs, alpha);
                        r += 1;
                    }
                }
            }
        }

        unsafe fn softmax(
            st: *mut f32,
            n: usize,
            mp: usize,
            nb: usize,
            pos0: usize,
            span: Option<(&[i32; MAX_Q], &[i32; MAX_Q])>,
            mx: *mut f32,
            l: *mut f32,
            alpha: *mut f32,
        ) {
            unsafe { softmax8(st, n, mp, nb, pos0, span, mx, l, alpha) }
        }
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;
    use crate::kernels::attention::{self, Group};
    use crate::kernels::testutil::Rng;

    /// One row's heads by the per-row scalar reference (`attention::partial_scalar`, folded in chunk order).
    fn per_row(n_q: usize, hdk: usize, hdv: usize, span: &Range<usize>, q: &[f32], k: &[f16], v: &[f16]) -> Vec<f32> {
        let g = Group {
            n_q,
            hdk,
            hdv,
            lo: span.start,
            hi: span.end,
            scale: 1.0 / (hdk as f32).sqrt(),
        };
        let mut sc = vec![0.0; attention::scores_len(n_q)];
        let mut acc = vec![0.0; g.partial_len()];
        let mut part = acc.clone();
        attention::partial_scalar(&g, g.chunk(0), q, k, v, &mut sc, &mut acc);
        for c in 1..g.n_chunks() {
            attention::partial_scalar(&g, g.chunk(c), q, k, v, &mut sc, &mut part);
            attention::fold(&g, &mut acc, &part);
        }
        let mut out = vec![0.0; n_q * hdv];
        attention::finish(&g, &acc, &mut out);
        out
    }

    struct Case {
        spans: Vec<Range<usize>>,
        q_stride: usize,
        q: Vec<f32>,
        k: Vec<f16>,
        v: Vec<f16>,
    }

    /// `rows` consecutive rows ending at position `end - 1`, each over the last `window` positions (all without).
    fn case(rng: &mut Rng, n_q: usize, hdk: usize, hdv: usize, rows: usize, end: usize, window: Option<usize>) -> Case {
        let spans: Vec<Range<usize>> = (end - rows..end)
            .map(|p| window.map_or(0, |w| (p + 1).saturating_sub(w))..p + 1)
            .collect();
        // Rows further apart than their heads, as in the batch's Q (the other KV heads' queries between them).
        let q_stride = n_q * hdk + 7;
        let q: Vec<f32> = (0..rows * q_stride).map(|_| rng.normal() * 2.0).collect();
        let k: Vec<f16> = (0..end * hdk).map(|_| f16::from_f32(rng.normal())).collect();
        let v: Vec<f16> = (0..end * hdv).map(|_| f16::from_f32(rng.normal())).collect();
        Case {
            spans,
            q_stride,
            q,
            k,
            v,
        }
    }

    // (heads in the group, head dims, rows, end, window): SmolLM2 (3 × 64) and Gemma 3 (4 × 256) at a few depths,
    // tiles that start and end mid-chunk (ragged causal ends), sliding windows, one lane block and four, partly
    // padded blocks, head dims that are not multiples of 4, 8 or 16.
    #[allow(clippy::type_complexity)]
    const SHAPES: [(usize, usize, usize, usize, usize, Option<usize>); 11] = [
        (3, 64, 64, 21, 21, None),
        (3, 64, 64, 21, 600, None),
        (3, 64, 64, 5, 131, None),
        (4, 256, 256, 16, 530, None),
        (4, 256, 256, 16, 1100, Some(512)),
        (3, 64, 64, 21, 300, Some(40)),
        (1, 64, 64, 32, 97, Some(7)),
        (1, 40, 24, 3, 20, None),
        (2, 16, 80, 16, 70, None),
        (2, 18, 10, 9, 75, Some(3)),
        (5, 8, 8, 12, 200, None),
    ];

    /// Every row's heads within 2e-5 of the per-row scalar reference.
    fn check<L: Level>(level: &str) {
        let mut rng = Rng(31);
        for (n_q, hdk, hdv, rows, end, window) in SHAPES {
            let c = case(&mut rng, n_q, hdk, hdv, rows, end, window);
            let t = Tile {
                n_q,
                hdk,
                hdv,
                scale: 1.0 / (hdk as f32).sqrt(),
                spans: &c.spans,
            };
            let mut sc = vec![f32::NAN; scratch_len(hdk, hdv)];
            let mut got = vec![0.0; rows * n_q * hdv];
            run::<L>(&t, &c.q, c.q_stride, &c.k, &c.v, &mut sc, &mut got);
            for (r, span) in c.spans.iter().enumerate() {
                let want = per_row(n_q, hdk, hdv, span, &c.q[r * c.q_stride..], &c.k, &c.v);
                for (i, (a, b)) in want.iter().zip(&got[r * n_q * hdv..]).enumerate() {
                    assert!(
                        (a - b).abs() <= 2e-5 * (1.0 + a.abs()),
                        "{level} {n_q}x{hdk}/{hdv} rows {rows} end {end} window {window:?}: row {r} [{i}] {a} vs {b}"
                    );
                }
            }
            // A row alone gives the bits it gets in the tile.
            let r = rows / 2;
            let one = Tile {
                spans: &c.spans[r..r + 1],
                ..t
            };
            let mut alone = vec![0.0; n_q * hdv];
            run::<L>(
                &one,
                &c.q[r * c.q_stride..],
                c.q_stride,
                &c.k,
                &c.v,
                &mut sc,
                &mut alone,
            );
            assert_eq!(
                alone[..],
                got[r * n_q * hdv..(r + 1) * n_q * hdv],
                "{level} {n_q}x{hdk} row {r} alone"
            );
        }
    }

    #[test]
    fn avx512_tiles_match_the_scalar_reference() {
        if !crate::kernels::x86::has_avx512() {
            eprintln!("SKIPPED: no AVX-512 here, the AVX-512 tile kernels not tested");
            return;
        }
        check::<x86::Avx512>("avx512");
    }

    #[test]
    fn avx2_tiles_match_the_scalar_reference() {
        if !crate::kernels::x86::has_avx2() {
            eprintln!("SKIPPED: no AVX2 here, the AVX2 tile kernels not tested");
            return;
        }
        check::<x86::Avx2>("avx2");
    }

    #[test]
    fn a_tile_holds_at_most_max_q_vectors() {
        assert_eq!(rows_per_tile(3), 21);
        assert_eq!(rows_per_tile(4), 16);
        assert_eq!(rows_per_tile(1), MAX_ROWS);
        assert_eq!(rows_per_tile(65), 0);
    }
}
