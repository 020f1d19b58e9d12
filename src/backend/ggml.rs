//! llama.cpp's CPU arithmetic reproduced (`crate::kernels::ggml`): `--numerics ggml`, the backend that checks Baton
//! against llama.cpp bit for bit. Weight types the reproduction lacks go through Baton's kernels.

use super::{AttnShape, Backend, RowsKv, Scratch, cpu::Cpu};
use crate::kernels::ggml::{attention, matmul, ops};
use crate::kernels::ops::RopeTable;
use crate::kernels::{Glu, Matrix, SyncPtr, ThreadPool};

/// llama.cpp's arithmetic: separate gate and up matmuls, ggml's norms, RoPE and flash attention.
pub struct CpuGgml;

impl Backend for CpuGgml {
    fn name(&self) -> &'static str {
        "cpu-ggml"
    }

    fn matmul(&self, pool: &ThreadPool, w: &Matrix, x: &[f32], n: usize, y: &mut [f32], sc: &mut Scratch) {
        if matmul::supports(w.ty) {
            matmul::matmul(pool, w, x, n, y);
        } else {
            Cpu.matmul(pool, w, x, n, y, sc);
        }
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
        let nf = n * up.rows;
        let mut u = std::mem::take(&mut sc.up);
        if u.len() < nf {
            u.resize(nf, 0.0);
        }
        self.matmul(pool, gate, x, n, h, sc);
        self.matmul(pool, up, x, n, &mut u[..nf], sc);
        match glu {
            Glu::Silu => ops::swiglu(h, &u[..nf]),
            Glu::Gelu => ops::geglu(h, &u[..nf]),
        }
        sc.up = u;
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
        let (cos, sin) = table.cos_sin(pos);
        for head in x.chunks_exact_mut(head_dim) {
            ops::rope(head, cos, sin, neox);
        }
    }

    /// ggml's flash attention, parallel over (row, query head).
    fn attend(&self, pool: &ThreadPool, a: &AttnShape, q: &[f32], rows: &dyn RowsKv, out: &mut [f32], _: &mut Scratch) {
        let (hdk, hdv, group) = (a.hdk, a.hdv, a.group());
        let n_tasks = a.n_tok * a.n_head;
        let att = SyncPtr::new(out.as_mut_ptr());
        pool.run(|ith, nth| {
            let mut sc = attention::Scratch::new(hdk);
            let mut task = ith;
            while task < n_tasks {
                let (t, h) = (task / a.n_head, task % a.n_head);
                let pos = rows.pos(t);
                let (kc, vc, kv_ctx) = rows.read(t);
                let kvh = h / group;
                let o = (t * a.n_head + h) * hdv;
                // SAFETY: each task writes its own head's output.
                let out = unsafe { std::slice::from_raw_parts_mut(att.get().add(o), hdv) };
                attention::attend_row(
                    &q[(t * a.n_head + h) * hdk..(t * a.n_head + h + 1) * hdk],
                    &kc[kvh * kv_ctx * hdk..(kvh + 1) * kv_ctx * hdk],
                    &vc[kvh * kv_ctx * hdv..(kvh + 1) * kv_ctx * hdv],
                    hdk,
                    hdv,
                    a.lo(pos),
                    pos + 1,
                    a.scale,
                    &mut sc,
                    out,
                );
                task += nth;
            }
        });
    }

    fn add(&self, x: &mut [f32], y: &[f32]) {
        crate::kernels::ops::add_inplace(x, y);
    }
}
