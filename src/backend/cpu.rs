//! Baton's CPU kernels (`crate::kernels`): the default backend.

use super::{AttnShape, Backend, RowsKv, Scratch};
use crate::kernels::ops::{self, RopeTable};
use crate::kernels::{self, Glu, Matrix, SyncPtr, ThreadPool, attention, attention_tiles as tiles};

/// Baton's own kernels: fastest, results within rounding noise of llama.cpp (docs/correctness.md).
pub struct Cpu;

/// Up to how many (row, KV head) pairs an attention op spreads each pair's chunks of positions over the threads,
/// rather than giving each pair to one thread: a decode step has one row, and Gemma 3 one KV head.
pub(super) fn split_rows(n_threads: usize) -> usize {
    4 * n_threads
}

impl Backend for Cpu {
    fn name(&self) -> &'static str {
        "cpu"
    }

    fn matmul(&self, pool: &ThreadPool, w: &Matrix, x: &[f32], n: usize, y: &mut [f32], sc: &mut Scratch) {
        kernels::matmul(pool, w, x, n, y, &mut sc.mm);
    }

    fn matmul_glu(
        &self,
        pool: &ThreadPool,
        gate: &Matrix,
        up: &Matrix,
        glu: Glu,
        x: &[f32],
        n: usize,
        h: &mut [f32],
        sc: &mut Scratch,
    ) {
        kernels::matmul_glu(pool, gate, up, glu, x, n, h, &mut sc.mm);
    }

    fn rms_norm(&self, x: &[f32], w: &[f32], eps: f32, out: &mut [f32]) {
        for (x, out) in x.chunks_exact(w.len()).zip(out.chunks_exact_mut(w.len())) {
            ops::rms_norm(x, w, eps, out);
        }
    }

    fn rms_norm_inplace(&self, x: &mut [f32], w: &[f32], eps: f32) {
        for row in x.chunks_exact_mut(w.len()) {
            ops::rms_norm_inplace(row, w, eps);
        }
    }

    fn rope(&self, table: &RopeTable, x: &mut [f32], head_dim: usize, pos: usize, neox: bool) {
        for head in x.chunks_exact_mut(head_dim) {
            table.apply(head, pos, neox);
        }
    }

    /// The query heads of one GQA group share the K and V rows they read (`kernels::attention`). A prefill batch of
    /// at least `tiles::MIN_ROWS` rows of one cache, each attending to at least `tiles::MIN_SPAN` positions, goes in
    /// tiles of rows per KV head (`kernels::attention_tiles`), where the CPU has tile kernels. Otherwise, with many (row, KV head) pairs each thread takes whole pairs; with
    /// few (decode) the pairs' chunks of positions are spread over the threads and folded after. A row gets the same
    /// bits either way, except in tiles.
    fn attend(
        &self,
        pool: &ThreadPool,
        a: &AttnShape,
        q: &[f32],
        rows: &dyn RowsKv,
        out: &mut [f32],
        sc: &mut Scratch,
    ) {
        let (hdk, hdv, group) = (a.hdk, a.hdv, a.group());
        if a.n_tok >= tiles::MIN_ROWS && tiles::rows_per_tile(group) > 0 && tiles::available() && long_prefill(a, rows)
        {
            attend_tiles(pool, a, q, rows, out, sc);
            return;
        }
        let n_tasks = a.n_tok * a.n_head_kv;
        let per_thread = attention::scratch_len(group, hdv);
        let att = SyncPtr::new(out.as_mut_ptr());
        let scores = SyncPtr::new(sc.scores.as_mut_ptr());
        // Task `task` is row `t`, KV head `kvh`: its group of query heads, its slice of the cache and its output.
        let task = |task: usize| {
            let (t, kvh) = (task / a.n_head_kv, task % a.n_head_kv);
            let pos = rows.pos(t);
            let (kc, vc, kv_ctx) = rows.read(t);
            let g = attention::Group {
                n_q: group,
                hdk,
                hdv,
                lo: a.lo(pos),
                hi: pos + 1,
                scale: a.scale,
            };
            let h0 = t * a.n_head + kvh * group;
            (
                g,
                &q[h0 * hdk..(h0 + group) * hdk],
                &kc[kvh * kv_ctx * hdk..(kvh + 1) * kv_ctx * hdk],
                &vc[kvh * kv_ctx * hdv..(kvh + 1) * kv_ctx * hdv],
                h0 * hdv,
            )
        };

        if n_tasks > split_rows(pool.n_threads()) {
            pool.run(|ith, nth| {
                // SAFETY: each thread owns its own scratch, and writes only the att rows of its own tasks.
                let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ith * per_thread), per_thread) };
                let mut i = ith;
                while i < n_tasks {
                    let (g, qg, k, v, o) = task(i);
                    let out = unsafe { std::slice::from_raw_parts_mut(att.get().add(o), group * hdv) };
                    attention::attend(&g, qg, k, v, sc, out);
                    i += nth;
                }
            });
            return;
        }

        // Few tasks: every chunk of every task is one work item, dealt round-robin; task `i`'s partials are at
        // `parts[(i * max_chunks + c) * pl]`.
        let pl = attention::partial_len(group, hdv);
        let max_chunks = sc.n_ctx.div_ceil(attention::CHUNK);
        assert!(sc.parts.len() >= n_tasks * max_chunks * pl);
        let parts = SyncPtr::new(sc.parts.as_mut_ptr());
        pool.run(|ith, nth| {
            // SAFETY: each thread owns its own scratch and writes only the partials of its own work items.
            let sc = unsafe { std::slice::from_raw_parts_mut(scores.get().add(ith * per_thread), per_thread) };
            let mut item = 0;
            for i in 0..n_tasks {
                let (g, qg, k, v, _) = task(i);
                for c in 0..g.n_chunks() {
                    if item % nth == ith {
                        let p =
                            unsafe { std::slice::from_raw_parts_mut(parts.get().add((i * max_chunks + c) * pl), pl) };
                        attention::partial(&g, c, qg, k, v, sc, p);
                    }
                    item += 1;
                }
            }
        });
        for i in 0..n_tasks {
            let (g, _, _, _, o) = task(i);
            let (acc, rest) = sc.parts[i * max_chunks * pl..].split_at_mut(pl);
            for c in 1..g.n_chunks() {
                attention::fold(&g, acc, &rest[(c - 1) * pl..c * pl]);
            }
            attention::finish(&g, acc, &mut out[o..o + group * hdv]);
        }
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        ops::add_inplace(x, y);
    }
}

/// Whether the batch's rows all read one cache (a prefill, not a batched decode of several sessions) and each
/// attends to at least `tiles::MIN_SPAN` positions.
fn long_prefill(a: &AttnShape, rows: &dyn RowsKv) -> bool {
    let k0 = rows.read(0).0.as_ptr();
    (0..a.n_tok).all(|t| {
        let pos = rows.pos(t);
        rows.read(t).0.as_ptr() == k0 && pos + 1 - a.lo(pos) >= tiles::MIN_SPAN
    })
}

/// [`Backend::attend`] in tiles of consecutive rows per KV head, each thread taking whole (tile, KV head) pairs.
fn attend_tiles(pool: &ThreadPool, a: &AttnShape, q: &[f32], rows: &dyn RowsKv, out: &mut [f32], sc: &mut Scratch) {
    let (hdk, hdv, group) = (a.hdk, a.hdv, a.group());
    let per_tile = tiles::rows_per_tile(group);
    let n_tasks = a.n_tok.div_ceil(per_tile) * a.n_head_kv;
    let per_thread = tiles::scratch_len(hdk, hdv) + tiles::MAX_Q * hdv;
    let len = pool.n_threads() * per_thread;
    if sc.tiles.len() < len {
        sc.tiles.resize(len, 0.0);
    }
    let (kc, vc, kv_ctx) = rows.read(0);
    let att = SyncPtr::new(out.as_mut_ptr());
    let bufs = SyncPtr::new(sc.tiles.as_mut_ptr());
    pool.run(|ith, nth| {
        // SAFETY: each thread owns its own slice of the tile scratch.
        let buf = unsafe { std::slice::from_raw_parts_mut(bufs.get().add(ith * per_thread), per_thread) };
        let (ts, o) = buf.split_at_mut(tiles::scratch_len(hdk, hdv));
        let mut spans: [std::ops::Range<usize>; tiles::MAX_Q] = std::array::from_fn(|_| 0..0);
        let mut i = ith;
        while i < n_tasks {
            let (tile, kvh) = (i / a.n_head_kv, i % a.n_head_kv);
            let (r0, r1) = (tile * per_tile, ((tile + 1) * per_tile).min(a.n_tok));
            for (s, r) in spans.iter_mut().zip(r0..r1) {
                let pos = rows.pos(r);
                *s = a.lo(pos)..pos + 1;
            }
            let t = tiles::Tile {
                n_q: group,
                hdk,
                hdv,
                scale: a.scale,
                spans: &spans[..r1 - r0],
            };
            let qg = &q[(r0 * a.n_head + kvh * group) * hdk..];
            let k = &kc[kvh * kv_ctx * hdk..(kvh + 1) * kv_ctx * hdk];
            let v = &vc[kvh * kv_ctx * hdv..(kvh + 1) * kv_ctx * hdv];
            tiles::attend(&t, qg, a.n_head * hdk, k, v, ts, o);
            for r in r0..r1 {
                let (src, dst) = (((r - r0) * group) * hdv, (r * a.n_head + kvh * group) * hdv);
                // SAFETY: row r's heads of KV head kvh are this task's alone, inside `out`'s n_tok × n_head × hdv.
                let dst = unsafe { std::slice::from_raw_parts_mut(att.get().add(dst), group * hdv) };
                dst.copy_from_slice(&o[src..src + group * hdv]);
            }
            i += nth;
        }
    });
}
