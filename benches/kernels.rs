//! Matmul throughput on the real models' shapes: GEMV (decode, GB/s of weights streamed) and GEMM (prefill of 512
//! tokens, GFLOP/s), plus the matmuls of one whole SmolLM2 token / 512-token prefill as tokens per second.
//!
//! `cargo bench --bench kernels [-- filter]`; `BATON_ISA=scalar|avx2|avx512` picks the kernel table,
//! `BATON_THREADS=n` the pool size (default 2).
//!
//! `cargo bench --bench kernels -- --gpu [filter]`: the GPU backend's matmuls instead (see [`gpu_main`]).

use baton::gguf::GgmlType;
use baton::kernels::matrix::Bytes;
use baton::kernels::{Matrix, Scratch, ThreadPool, kernels, matmul};
use std::time::Instant;

struct Rng(u64);
impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 - 0.5
    }
}

fn f16_offsets(ty: GgmlType) -> &'static [usize] {
    use GgmlType::*;
    match ty {
        Q4_0 | Q5_0 | Q8_0 => &[0],
        Q4_1 | Q5_1 | Q4K | Q5K => &[0, 2],
        Q2K => &[80, 82],
        Q3K => &[108],
        Q6K => &[208],
        _ => &[],
    }
}

fn matrix(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Matrix {
    let mut m = matrix_rows(rng, ty, rows, cols);
    // As a model's load does: interleaved where this CPU's kernels want it (`BATON_ISA=scalar` keeps rows).
    m.repack_for_kernels();
    m
}

/// Random weights of `ty` in the file's row layout, with small finite scales.
fn matrix_rows(rng: &mut Rng, ty: GgmlType, rows: usize, cols: usize) -> Matrix {
    let bytes = ty.row_bytes(cols).unwrap() * rows;
    let mut data: Vec<u8> = (0..bytes).map(|_| rng.next() as u8).collect();
    if ty == GgmlType::F32 {
        data = (0..rows * cols).flat_map(|_| rng.f().to_le_bytes()).collect();
    } else {
        for b in data.chunks_mut(ty.type_size()) {
            for &o in f16_offsets(ty) {
                b[o..o + 2].copy_from_slice(&half::f16::from_f32(0.01 + rng.f() * 0.01).to_bits().to_le_bytes());
            }
        }
    }
    Matrix {
        ty,
        rows,
        cols,
        data: Bytes::Owned(data),
        layout: baton::kernels::matrix::Layout::Rows,
    }
}

/// Median seconds of `reps` timed runs after a warm-up.
fn time(reps: usize, mut f: impl FnMut()) -> f64 {
    f();
    let mut v: Vec<f64> = (0..reps)
        .map(|_| {
            let t = Instant::now();
            f();
            t.elapsed().as_secs_f64()
        })
        .collect();
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    v[reps / 2]
}

fn main() {
    let filter = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with('-'))
        .unwrap_or_default();
    if std::env::args().any(|a| a == "--gpu") {
        return gpu_main(&filter);
    }
    let threads: usize = std::env::var("BATON_THREADS")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(2);
    let pool = ThreadPool::new(threads);
    let mut scratch = Scratch::default();
    let mut rng = Rng(0x9e3779b97f4a7c15);
    println!("kernels: {}, threads: {threads}", kernels().isa);
    use GgmlType::*;
    // (label, type, rows, cols): rows = outputs, cols = the dot length (ggml's ne0).
    let shapes = [
        ("smollm2 ffn_up", Q4_1, 1536, 576),
        ("smollm2 ffn_down", Q4_1, 576, 1536),
        ("smollm2 attn_q", Q4_1, 576, 576),
        ("smollm2 output", Q8_0, 49152, 576),
        ("gemma ffn_up", Q5_0, 2048, 640),
        ("gemma attn_v", Q8_0, 256, 640),
        ("gemma ffn_down", Q4K, 640, 2048),
        ("gemma ffn_down", Q6K, 640, 2048),
        ("gemma attn_out", Q4K, 640, 1024),
        ("gemma output", Q8_0, 262144, 640),
    ];
    for (label, ty, rows, cols) in shapes {
        let name = format!("{label} {ty} {rows}x{cols}");
        if !name.contains(&filter) {
            continue;
        }
        let w = matrix(&mut rng, ty, rows, cols);
        let big = rows >= 100_000;
        for n_tok in [1usize, 512] {
            if big && n_tok > 1 {
                continue;
            }
            let x: Vec<f32> = (0..n_tok * cols).map(|_| rng.f()).collect();
            let mut y = vec![0.0; n_tok * rows];
            let reps = if n_tok == 1 { if big { 11 } else { 201 } } else { 5 };
            let s = time(reps, || matmul(&pool, &w, &x, n_tok, &mut y, &mut scratch));
            if n_tok == 1 {
                println!(
                    "GEMV {name:<36} {:>9.1} us  {:>6.1} GB/s",
                    s * 1e6,
                    w.size_bytes() as f64 / s / 1e9
                );
            } else {
                let flops = 2.0 * (rows * cols * n_tok) as f64;
                println!(
                    "GEMM {name:<36} {:>9.1} us  {:>6.1} GFLOP/s (512 tokens)",
                    s * 1e6,
                    flops / s / 1e9
                );
            }
        }
    }

    // The matmuls of SmolLM2-135M (30 layers + the Q8_0 head) for one decoded token and for a 512-token prefill.
    if "smollm2 model".contains(&filter) || filter.is_empty() {
        let layer: Vec<(usize, usize)> = vec![
            (576, 576),
            (192, 576),
            (192, 576),
            (576, 576),
            (1536, 576),
            (1536, 576),
            (576, 1536),
        ];
        let ws: Vec<Matrix> = (0..30)
            .flat_map(|_| layer.clone())
            .map(|(r, c)| matrix(&mut rng, Q4_1, r, c))
            .collect();
        let head = matrix(&mut rng, Q8_0, 49152, 576);
        for n_tok in [1usize, 512] {
            let x: Vec<f32> = (0..n_tok * 1536).map(|_| rng.f()).collect();
            let mut y = vec![0.0; n_tok * 49152];
            let s = time(if n_tok == 1 { 21 } else { 3 }, || {
                for w in &ws {
                    matmul(
                        &pool,
                        w,
                        &x[..n_tok * w.cols],
                        n_tok,
                        &mut y[..n_tok * w.rows],
                        &mut scratch,
                    );
                }
                // llama.cpp computes the head for the last token only.
                matmul(&pool, &head, &x[..576], 1, &mut y[..49152], &mut scratch);
            });
            println!(
                "SmolLM2 matmuls, {n_tok} token(s): {:.2} ms -> {:.1} tok/s",
                s * 1e3,
                n_tok as f64 / s
            );
        }
    }
}

/// `--gpu`: the GPU backend's matmuls on the adapter `BATON_GPU_ADAPTER` picks (default a hardware GPU), on Llama 3
/// 8B's and 1B's shapes: each batch size (`BATON_BENCH_NS`, default 1,2,4,8,16,64,512) with the per-row kernel at
/// several lane counts (and, for one token, rows a thread), the tiled one and, where the adapter has them, the
/// matrix units' (coop.rs), as GB/s of weights and GFLOP/s; and the time one submission with a read-back takes to come back (a decode step makes one).
/// Every matrix is uploaded in copies that together pass 256 MiB, taken in turn, so repeats are not served from the
/// GPU's L2 cache (50 MB on an H100); a figure is the difference between `2r` and `r` dispatches in one submission
/// (medians of 5), divided by `r`, so the submission's own cost drops out.
fn gpu_main(filter: &str) {
    use GgmlType::*;
    use baton::backend::gpu::Binds;
    use baton::backend::gpu::device::{AdapterChoice, Gpu};
    let choice = AdapterChoice::from_env_or(AdapterChoice::Auto).expect("BATON_GPU_ADAPTER");
    let gpu = match Gpu::open(choice) {
        Ok(g) => g,
        Err(e) => {
            eprintln!("--gpu: {e:#}");
            std::process::exit(1);
        }
    };
    let ns: Vec<usize> = std::env::var("BATON_BENCH_NS")
        .unwrap_or_else(|_| "1,2,4,8,16,64,512".into())
        .split(',')
        .map(|n| n.trim().parse().expect("BATON_BENCH_NS: comma-separated batch sizes"))
        .collect();
    println!("gpu: {}", gpu.describe());
    let binds = Binds::default();
    let probe = gpu.upload(&[0.0; 64]).unwrap();
    let s = time(51, || {
        let mut p = gpu.pass_cached(&binds);
        p.read(&probe, 0, 64).unwrap();
        p.finish_read().unwrap();
    });
    println!("submission with a 256-byte read-back: {:.1} us", s * 1e6);
    // What one more dispatch costs when its work is nothing: a chain of mat-vecs of a 64 × 64 matrix (one
    // workgroup each), as a decode step chains its ops.
    let mut rng = Rng(0x2545f4914f6cdd1d);
    let tiny = gpu.upload_matrix(&matrix_rows(&mut rng, Q4_0, 64, 64)).unwrap();
    let (tx, ty) = (gpu.upload(&[0.5; 64]).unwrap(), gpu.zeros(64).unwrap());
    let chain = |r: usize| {
        time(5, || {
            let mut p = gpu.pass_cached(&binds);
            for _ in 0..r {
                p.matmul(&tiny, &tx, 1, &ty).unwrap();
            }
            p.finish().unwrap();
        })
    };
    println!(
        "one more dispatch in a chain: {:.1} us",
        (chain(400) - chain(200)) / 200.0 * 1e6
    );

    let shapes = [
        ("8b attn_q", Q4K, 4096, 4096),
        ("8b attn_v", Q6K, 1024, 4096),
        ("8b ffn_up", Q4K, 14336, 4096),
        ("8b ffn_down", Q6K, 4096, 14336),
        ("8b output", Q6K, 49152, 4096),
        ("1b ffn_up", Q4K, 8192, 2048),
        ("1b attn_q", Q4K, 2048, 2048),
        ("1b attn_v", Q6K, 512, 2048),
        ("1b ffn_down", Q6K, 2048, 8192),
        ("8b attn_q", Q4_0, 4096, 4096),
        ("8b attn_q", Q8_0, 4096, 4096),
        ("8b attn_q", F16, 4096, 4096),
    ];
    for (label, ty, rows, cols) in shapes {
        let name = format!("{label} {ty} {rows}x{cols}");
        if !name.contains(filter) {
            continue;
        }
        let m = matrix_rows(&mut rng, ty, rows, cols);
        let copies = (256usize << 20).div_ceil(m.size_bytes());
        let ws: Vec<_> = (0..copies).map(|_| gpu.upload_matrix(&m).unwrap()).collect();
        let bytes = m.size_bytes() as f64;
        drop(m);
        for &n in &ns {
            let x: Vec<f32> = (0..n * cols).map(|_| rng.f()).collect();
            let (x, y) = (gpu.upload(&x).unwrap(), gpu.zeros(n * rows).unwrap());
            // (kernel, lanes, mat-vec rows a thread, tiled_min, split-K target, matrix units): lane counts and
            // rows a thread for the per-row kernel at small batches, the f32 tiled kernel from 2 tokens on and,
            // where the adapter has them, the matrix units'. The software adapter runs its own layout (a thread a
            // row), and at one token the GPUs' too, to compare rows a thread on a kernel's instructions.
            let mut kernels: Vec<(String, u32, u32, usize, Option<usize>, bool)> = Vec::new();
            if n <= 64 {
                let layouts: &[(u32, u32)] = match (gpu.is_software(), n) {
                    (true, 1) => &[(1, 1), (32, 1), (32, 2)],
                    (true, _) => &[(1, 1)],
                    (false, 1) => &[(16, 2), (32, 1), (32, 2), (32, 4), (64, 2)],
                    (false, _) => &[(16, 1)],
                };
                kernels.extend(
                    layouts
                        .iter()
                        .map(|&(l, r)| (format!("per-row {l:>2}x{r} lanes"), l, r, usize::MAX, None, false)),
                );
            }
            if n >= 2 {
                // The tiled kernels as a pass takes them (split-K where they have few tiles), and never split.
                kernels.push(("tiled".into(), 16, 1, 1, None, false));
                kernels.push(("tiled, no split-K".into(), 16, 1, 1, Some(0), false));
                if gpu.coop() > 0 {
                    kernels.push(("matrix units".into(), 16, 1, 1, None, true));
                    kernels.push(("units, no split-K".into(), 16, 1, 1, Some(0), true));
                }
            }
            for (kname, lanes, mv_rows, tiled_min, ksplit, coop) in kernels {
                let run = |r: usize| {
                    time(5, || {
                        let mut p = gpu
                            .pass_cached(&binds)
                            .with_lanes(lanes)
                            .with_mv_rows(mv_rows)
                            .with_tiled_min(tiled_min)
                            .with_coop(coop);
                        if let Some(k) = ksplit {
                            p = p.with_ksplit(k);
                        }
                        for i in 0..r {
                            p.matmul(&ws[i % copies], &x, n, &y).unwrap();
                        }
                        p.finish().unwrap();
                    })
                };
                // Mat-vecs stream about 1 GiB of weights per run; larger batches go over the copies once.
                let r = if n <= 16 { 4 * copies } else { copies.max(2) };
                let s = ((run(2 * r) - run(r)) / r as f64).max(1e-9);
                let flops = 2.0 * (rows * cols * n) as f64;
                println!(
                    "GPU {name:<28} n={n:<4} {kname:<18} {:>9.1} us  {:>7.1} GB/s  {:>8.1} GFLOP/s",
                    s * 1e6,
                    bytes / s / 1e9,
                    flops / s / 1e9
                );
            }
        }
    }
}
