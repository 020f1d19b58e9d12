//! Weights repacked 16 rows at a time for the SIMD group kernels, in one layout per format family: the 32-weight
//! blocks Q4_1, Q5_0, Q8_0 ([`q32`]), Q4_K ([`q4k`]) and Q6_K ([`q6k`]). The AVX-512 kernels sit beside their
//! layouts; the AVX2 ones, which run each group as two 8-row halves, are in [`avx2`]. This file dispatches: which
//! types are interleaved on this CPU, their sizes, repacking, and [`dot_group`] at the [`Level`] of the kernel table.
//!
//! Why: the row-major kernel spends most of its instructions per 32-weight block on things that are not
//! multiply-adds — two scalar f16 conversions, a scale vector built from scalars, a horizontal sum per row. With 16
//! rows interleaved, one 512-bit register holds the same 4 quants of 16 rows (a 256-bit one those of 8), so each
//! multiply-add instruction serves 16 (8) rows against one broadcast activation quad, the scales convert in one
//! instruction, and the sums stay in registers until the end of the row: about 4× fewer instructions per weight,
//! which is what decode on a few cores needs to reach the memory-bandwidth bound, and 2-3× the prefill GEMM
//! throughput of the row-major AVX2 kernels.
//!
//! The integer sums are the same as the row-major kernels'; only the f32 summation order differs.

#[cfg(target_arch = "x86_64")]
pub mod avx2;
pub mod group;
pub mod q32;
pub mod q4k;
pub mod q6k;

pub use group::{ROWS, TILE};

use crate::gguf::GgmlType;
use crate::kernels::blocks32::{Q8_0_BYTES, Q8_1_BYTES};

/// Whether `ty` has an interleaved kernel.
pub fn supports(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q4_1 | GgmlType::Q5_0 | GgmlType::Q8_0 | GgmlType::Q4K | GgmlType::Q6K
    )
}

/// Whether this CPU's kernels want `ty` interleaved. Q6_K only at the AVX2 level: its group kernel is AVX2, and an
/// AVX-512 CPU keeps the row-major AVX-512 dot whose sums its golden tests were recorded with.
pub fn wanted(ty: GgmlType) -> bool {
    match level() {
        Level::Scalar => false,
        Level::Avx2 => supports(ty),
        _ => supports(ty) && ty != GgmlType::Q6K,
    }
}

/// Bytes of one block column of one group.
pub fn group_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4K => q4k::GROUP_BLOCK,
        GgmlType::Q6K => q6k::GROUP_BLOCK,
        _ => q32::group_block(ty),
    }
}

/// Bytes of `rows` rows of `nb` blocks of `ty` in the interleaved layout: whole groups, then the rest row-major.
pub fn packed_len(ty: GgmlType, rows: usize, nb: usize) -> usize {
    let groups = rows / ROWS;
    groups * nb * group_block(ty) + (rows - groups * ROWS) * ty.row_bytes(nb * ty.block_size()).expect("whole blocks")
}

/// Repacks row-major data of `ty` (`rows` rows of `nb` blocks) into the interleaved layout.
pub fn repack(ty: GgmlType, src: &[u8], rows: usize, nb: usize) -> Vec<u8> {
    match ty {
        GgmlType::Q4K => q4k::repack(src, rows, nb),
        GgmlType::Q6K => q6k::repack(src, rows, nb),
        _ => q32::repack(ty, src, rows, nb),
    }
}

/// Row `r`'s block of an interleaved group block, back in the file's block form (references, row lookups).
pub fn unpack_block(ty: GgmlType, gb: &[u8], r: usize) -> Vec<u8> {
    let mut blk = [0u8; MAX_BLOCK];
    let n = unpack_block_into(ty, gb, r, &mut blk);
    blk[..n].to_vec()
}

/// Bytes of the largest block with an interleaved layout (Q6_K).
pub const MAX_BLOCK: usize = crate::kernels::kquants::Q6_K_BYTES;

/// [`unpack_block`] into `blk` (at least [`MAX_BLOCK`] bytes), without allocating: the embedding lookup of a tied
/// output head reads its rows this way. Returns the block's length.
pub fn unpack_block_into(ty: GgmlType, gb: &[u8], r: usize, blk: &mut [u8]) -> usize {
    match ty {
        GgmlType::Q4K => q4k::unpack_block_into(gb, r, blk),
        GgmlType::Q6K => q6k::unpack_block_into(gb, r, blk),
        _ => q32::unpack_block_into(ty, gb, r, blk),
    }
}

/// The activation type a kernel of `ty` dots with, and its block bytes.
pub(crate) fn act_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q4_1 => Q8_1_BYTES,
        GgmlType::Q4K | GgmlType::Q6K => crate::kernels::kquants::Q8_K_BYTES,
        _ => Q8_0_BYTES,
    }
}

/// Scalar reference: the 16 dots of one group (`nb` group blocks at `w`) with one activation row.
pub fn dot_group_scalar(ty: GgmlType, nb: usize, w: &[u8], x: &[u8], out: &mut [f32; ROWS]) {
    match ty {
        GgmlType::Q4K => q4k::dot_group_scalar(nb, w, x, out),
        GgmlType::Q6K => q6k::dot_group_scalar(nb, w, x, out),
        _ => q32::dot_group_scalar(ty, nb, w, x, out),
    }
}

/// Which group kernels run: those of a kernel table's instruction set ([`crate::kernels::Kernels::isa`]), on AVX-512 with
/// VNNI's where the CPU has it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Level {
    /// [`dot_group_scalar`] (the scalar table, and CPUs without an interleaved kernel).
    Scalar,
    /// [`avx2`]: two 8-row halves per group.
    Avx2,
    /// The AVX-512 kernels with `maddubs` + `madd`.
    Avx512,
    /// The AVX-512 kernels with `vpdpbusd`.
    Vnni,
}

impl Level {
    /// The level of kernel table `k`. Tables are only built for CPUs that run them, so the level runs here too.
    /// `BATON_ISA=avx512` asks for AVX-512 without VNNI, so that level can be measured on a CPU that has VNNI.
    pub fn of(k: &crate::kernels::Kernels) -> Level {
        match k.isa {
            #[cfg(target_arch = "x86_64")]
            "avx512"
                if std::arch::is_x86_feature_detected!("avx512vnni")
                    && std::env::var("BATON_ISA").map_or(true, |v| v != "avx512") =>
            {
                Level::Vnni
            }
            "avx512" => Level::Avx512,
            "avx2" => Level::Avx2,
            _ => Level::Scalar,
        }
    }

    /// Whether this CPU runs the level's kernels.
    pub fn runs_here(self) -> bool {
        #[cfg(target_arch = "x86_64")]
        {
            match self {
                Level::Scalar => true,
                Level::Avx2 => crate::kernels::x86::has_avx2(),
                Level::Avx512 => crate::kernels::x86::has_avx512(),
                Level::Vnni => crate::kernels::x86::has_avx512() && std::arch::is_x86_feature_detected!("avx512vnni"),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            self == Level::Scalar
        }
    }
}

/// The level of the dispatched kernel table ([`crate::kernels::kernels`], which `BATON_ISA` can lower).
pub fn level() -> Level {
    static LEVEL: std::sync::OnceLock<Level> = std::sync::OnceLock::new();
    *LEVEL.get_or_init(|| Level::of(crate::kernels::kernels()))
}

/// Whether this CPU runs an interleaved kernel (AVX2 or AVX-512; repacking is pointless otherwise).
pub fn available() -> bool {
    level() != Level::Scalar
}

/// The 16 dots of one group for `n` (1..=[`TILE`]) activation rows `xs` bytes apart, with the fastest kernel
/// available.
pub fn dot_group(ty: GgmlType, nb: usize, w: &[u8], x: &[u8], xs: usize, n: usize, out: &mut [[f32; ROWS]; TILE]) {
    dot_group_with(level(), ty, nb, w, x, xs, n, out)
}

/// Whether the dispatched kernels are the VNNI ones (AVX512-VNNI, and `BATON_ISA` asks for no level, or
/// none below AVX-512 with VNNI).
pub fn vnni() -> bool {
    level() == Level::Vnni
}

/// [`dot_group`] with the kernels of level `lvl` (tests run every level the CPU has; a matmul with an explicit
/// kernel table runs that table's).
#[allow(clippy::too_many_arguments)]
pub fn dot_group_with(
    lvl: Level,
    ty: GgmlType,
    nb: usize,
    w: &[u8],
    x: &[u8],
    xs: usize,
    n: usize,
    out: &mut [[f32; ROWS]; TILE],
) {
    assert!(
        lvl.runs_here(),
        "interleaved dot: {lvl:?} kernels asked for on a CPU without them"
    );
    assert!(
        (1..=TILE).contains(&n) && w.len() >= nb * group_block(ty) && x.len() >= (n - 1) * xs + nb * act_block(ty),
        "interleaved dot: buffers too short"
    );
    #[cfg(target_arch = "x86_64")]
    if lvl != Level::Scalar {
        let (wp, xp) = (w.as_ptr(), x.as_ptr());
        // SAFETY: the level's CPU features checked above; lengths asserted above (each call below reads rows
        // t0..t0 + m < n).
        unsafe {
            macro_rules! go {
                ($f:ident, $t0:expr, $m:expr) => {{
                    let (o, xq) = (&mut out[$t0..$t0 + $m], xp.add($t0 * xs));
                    match $m {
                        1 => $f::<1>(nb, wp, xq, xs, o.try_into().unwrap()),
                        2 => $f::<2>(nb, wp, xq, xs, o.try_into().unwrap()),
                        3 => $f::<3>(nb, wp, xq, xs, o.try_into().unwrap()),
                        4 => $f::<4>(nb, wp, xq, xs, o.try_into().unwrap()),
                        5 => $f::<5>(nb, wp, xq, xs, o.try_into().unwrap()),
                        6 => $f::<6>(nb, wp, xq, xs, o.try_into().unwrap()),
                        7 => $f::<7>(nb, wp, xq, xs, o.try_into().unwrap()),
                        _ => $f::<8>(nb, wp, xq, xs, o.try_into().unwrap()),
                    }
                }};
            }
            // Kernels that take at most 4 rows per call.
            macro_rules! go4 {
                ($f:ident, $t0:expr, $m:expr) => {{
                    let (o, xq) = (&mut out[$t0..$t0 + $m], xp.add($t0 * xs));
                    match $m {
                        1 => $f::<1>(nb, wp, xq, xs, o.try_into().unwrap()),
                        2 => $f::<2>(nb, wp, xq, xs, o.try_into().unwrap()),
                        3 => $f::<3>(nb, wp, xq, xs, o.try_into().unwrap()),
                        _ => $f::<4>(nb, wp, xq, xs, o.try_into().unwrap()),
                    }
                }};
            }
            macro_rules! by4 {
                ($f:ident) => {{
                    go4!($f, 0, n.min(4));
                    if n > 4 {
                        go4!($f, 4, n - 4);
                    }
                }};
            }
            use avx2::{
                q4_1_group as q4_1_group_avx2, q4_k_group as q4_k_group_avx2, q5_0_group as q5_0_group_avx2,
                q6_k_group as q6_k_group_avx2, q8_0_group as q8_0_group_avx2,
            };
            use q4k::{dot_group_avx512 as q4_k_group_avx512, dot_group_vnni as q4_k_group_vnni};
            use q32::{
                q4_1_group_avx512, q4_1_group_vnni, q5_0_group_avx512, q5_0_group_vnni, q8_0_group_avx512,
                q8_0_group_vnni,
            };
            match (ty, lvl) {
                (GgmlType::Q4_1, Level::Avx2) => by4!(q4_1_group_avx2),
                (GgmlType::Q4_1, Level::Avx512) => go!(q4_1_group_avx512, 0, n),
                (GgmlType::Q4_1, _) => go!(q4_1_group_vnni, 0, n),
                (GgmlType::Q5_0, Level::Avx2) => go!(q5_0_group_avx2, 0, n),
                (GgmlType::Q5_0, Level::Avx512) => go!(q5_0_group_avx512, 0, n),
                (GgmlType::Q5_0, _) => go!(q5_0_group_vnni, 0, n),
                (GgmlType::Q4K, Level::Avx2) => by4!(q4_k_group_avx2),
                (GgmlType::Q4K, Level::Avx512) => by4!(q4_k_group_avx512),
                (GgmlType::Q4K, _) => by4!(q4_k_group_vnni),
                // Every level that runs a Q6_K group has AVX2 (the matmul interleaves Q6_K at AVX2 only, see
                // [`wanted`]; tests run this kernel at every level).
                (GgmlType::Q6K, _) => go!(q6_k_group_avx2, 0, n),
                (_, Level::Avx2) => by4!(q8_0_group_avx2),
                (_, Level::Avx512) => by4!(q8_0_group_avx512),
                (_, _) => by4!(q8_0_group_vnni),
            }
        }
        return;
    }
    for t in 0..n {
        dot_group_scalar(ty, nb, w, &x[t * xs..], &mut out[t]);
    }
}

/// Every level this CPU runs, scalar first (tests).
#[cfg(test)]
pub(crate) fn levels() -> Vec<Level> {
    [Level::Scalar, Level::Avx2, Level::Avx512, Level::Vnni]
        .into_iter()
        .filter(|l| l.runs_here())
        .collect()
}
