//! The GPU ops, on wgpu: WGSL compute shaders over Vulkan (Linux, the DGX Spark), Metal (Apple Silicon) or DX12,
//! tested on Mesa's software Vulkan device (lavapipe). See docs/gpu.md.
//!
//! The CPU backends ([`super::Backend`]) take host slices op by op; a GPU would pay a round trip per op that way.
//! So the GPU's seam is a layer range instead: weights are uploaded once in their GGUF blocks
//! ([`Gpu::upload_matrix`]), activations and the f16 KV cache live in device buffers ([`Tensor`], [`Halves`]), a
//! [`Pass`] records a whole range's ops and runs them in one submission, and `engine::Session` hands its first layers
//! to [`layers::GpuLayers`] (`--backend gpu`, `--gpu-layers`). Each op is checked against the CPU kernels on random
//! inputs (the tests beside each op).
//!
//! - `device.rs`: adapter choice (`auto` never opens a software adapter), the device and its pipelines.
//! - `buffers.rs`: device buffers and uploads.
//! - `matmul.rs`: quantized mat-vec / mat-mul and the fused gate/up projection.
//! - `coop.rs`: a batch's matmul on the matrix units (cooperative matrices, f16 inputs) where the adapter has them.
//! - `norm.rs`: RMSNorm, and the residual add fused with the next RMSNorm. `rope.rs`: Q/K/V biases, Q/K head norms,
//!   RoPE (both styles) and the KV cache writes, in one dispatch. `elementwise.rs`: residual add, SwiGLU/GeGLU.
//! - `embed.rs`: the embedding lookup of a batch's tokens.
//! - `moe.rs`: a mixture of experts' routing (top-k on the device) and weighted sum; its indexed matmuls are in
//!   `matmul.rs`.
//! - `attention.rs`: causal attention over the f16 cache (GQA, sliding window).
//! - `subgroup.rs`: the reductions across a subgroup where the adapter has them, and the check at load.
//! - `layers.rs`: a layer range of llama / gemma3 (and the families and mixtures of experts built on llama's block)
//!   on the device (weights shared per model, KV per session), and the head when the range ends the model.
//! - `shaders/*.wgsl`: the kernels, composed into modules by [`module`].

pub mod act8;
pub mod attention;
pub mod buffers;
pub mod coop;
pub mod device;
pub mod elementwise;
pub mod embed;
pub mod latent;
pub mod layers;
pub mod matmul;
pub mod moe;
pub mod norm;
pub mod profile;
pub mod rope;
pub mod subgroup;

pub use buffers::{GpuExperts, GpuMatrix, Halves, Tensor, U32s};
pub use device::{AdapterChoice, Gpu, NoAdapter};
pub use moe::{PickGroups, Picks};

use anyhow::{Result, ensure};
use std::collections::HashMap;
use std::sync::Mutex;
use wgpu::util::DeviceExt;

/// WGSL sources: a shader module is the snippets it needs, in order.
mod wgsl {
    pub const F16: &str = include_str!("shaders/f16.wgsl");
    pub const ACT: &str = include_str!("shaders/act.wgsl");
    pub const ACT8: &str = include_str!("shaders/act8.wgsl");
    pub const QUANT: &str = include_str!("shaders/quant.wgsl");
    pub const MATMUL_IO: &str = include_str!("shaders/matmul_io.wgsl");
    pub const MATMUL: &str = include_str!("shaders/matmul.wgsl");
    pub const DOT: &str = include_str!("shaders/dot.wgsl");
    pub const MATMUL_TILED: &str = include_str!("shaders/matmul_tiled.wgsl");
    pub const TILED_SPAN: &str = include_str!("shaders/tiled_span.wgsl");
    pub const TILED_BATCH: &str = include_str!("shaders/tiled_batch.wgsl");
    pub const TILED_PICKS: &str = include_str!("shaders/tiled_picks.wgsl");
    pub const MATMUL_COOP: &str = include_str!("shaders/matmul_coop.wgsl");
    pub const HALVES: &str = include_str!("shaders/halves.wgsl");
    pub const ELEMENTWISE: &str = include_str!("shaders/elementwise.wgsl");
    pub const NORM: &str = include_str!("shaders/norm.wgsl");
    pub const QKV_HEAD: &str = include_str!("shaders/qkv_head.wgsl");
    pub const ROPE: &str = include_str!("shaders/rope.wgsl");
    pub const ATTENTION: &str = include_str!("shaders/attention.wgsl");
    pub const ATTENTION_CACHED: &str = include_str!("shaders/attention_cached.wgsl");
    pub const ATTENTION_FRESH: &str = include_str!("shaders/attention_fresh.wgsl");
    pub const EMBED: &str = include_str!("shaders/embed.wgsl");
    pub const LATENT: &str = include_str!("shaders/latent.wgsl");
    pub const ROUTE: &str = include_str!("shaders/route.wgsl");
    pub const MOE: &str = include_str!("shaders/moe.wgsl");
    pub const PICKS: &str = include_str!("shaders/picks.wgsl");
    pub const SUBGROUP: &str = include_str!("shaders/subgroup.wgsl");
    pub const SUBGROUP_OFF: &str = include_str!("shaders/subgroup_off.wgsl");
    pub const REDUCE: &str = include_str!("shaders/reduce.wgsl");
}

/// The number a measuring variable (`BATON_GPU_LANES`, `BATON_GPU_KSPLIT`, ...) sets, where it is set, parses and
/// `valid` takes it; else `default`. Callers keep it in a `OnceLock`: the hot paths ask for it at every dispatch.
fn env_number<T: std::str::FromStr>(name: &str, valid: impl Fn(&T) -> bool, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(valid)
        .unwrap_or(default)
}

/// One shader module's source: the snippets joined.
fn module(parts: &[&str]) -> String {
    parts.join("\n")
}

/// Bind groups, each with the uniform buffer of its parameters, built once and reused: a session's ops
/// ([`layers::GpuLayers`]) bind the same weights, working buffers and parameters at every decode step, so from the
/// second step on a dispatch records a lookup instead of a buffer and a bind group. A prefill of a new batch size
/// adds one per op; past [`Binds::CAP`] entries the cache starts over.
#[derive(Default)]
pub struct Binds {
    map: Mutex<HashMap<BindKey, wgpu::BindGroup>>,
    /// The working tensor of [`Pass::scratch`], kept so the bind groups that hold it stay valid.
    scratch: Mutex<Option<Tensor>>,
    /// The split-K matmul's partial products ([`Pass::partials`]), apart from `scratch`, which a matmul's caller
    /// may be holding.
    partials: Mutex<Option<Tensor>>,
    /// A batch's activations rounded for a matmul ([`Pass::rounded`]), apart from the two above, which the
    /// matmul may be writing.
    rounded: Mutex<Option<Tensor>>,
    /// The same activations as f16 for the matrix-unit matmul ([`Pass::halves`]), made from `rounded`.
    halves: Mutex<Option<Tensor>>,
    /// The buffer [`Pass::finish_read`] copies back through, kept rather than made for every decode step; unmapped
    /// between uses, dropped after a failed read.
    staging: Mutex<Option<wgpu::Buffer>>,
}

/// What a bind group binds: the pipeline (its layout), the buffers at their bindings and the parameters' words. The
/// key holds the buffers, so none is freed and its identity reused while its bind group is cached.
#[derive(PartialEq, Eq, Hash)]
struct BindKey {
    pipeline: wgpu::ComputePipeline,
    bufs: Vec<(u32, wgpu::Buffer)>,
    params: Vec<u32>,
}

impl Binds {
    /// Entries kept at most: a few batch sizes of every op of a large model's layers (about 20 a layer).
    pub const CAP: usize = 1 << 14;

    /// Bind groups held.
    pub fn len(&self) -> usize {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Drops every cached bind group (tests run a session without the cache this way).
    pub fn clear(&self) {
        self.map.lock().unwrap_or_else(|p| p.into_inner()).clear();
    }
}

/// Ops recorded for one submission. Nothing runs until [`Pass::finish`], which waits for the device and returns
/// any error it reported.
pub struct Pass<'g> {
    gpu: &'g Gpu,
    /// The compute pass the dispatches go into, open from the first dispatch until a copy or the end: one pass for
    /// a run of dispatches rather than one each (wgpu still orders each dispatch after the writes it reads).
    /// Measured on lavapipe only: a chain of small matmuls went from about 55 to 40 µs a dispatch.
    cp: Option<wgpu::ComputePass<'static>>,
    /// Declared after `cp`, so a pass dropped unfinished (an error) closes its compute pass first.
    enc: wgpu::CommandEncoder,
    /// Threads per weight row in the matmuls (`LANES` in `matmul.wgsl`): [`matmul::lanes`], 32 on a GPU and 1 on a
    /// software adapter unless `BATON_GPU_LANES` sets them.
    lanes: u32,
    /// Rows a thread of a decode mat-vec takes where its type has a part walk (`MROWS` in `matmul.wgsl`): on a GPU
    /// [`matmul::gpu_mv_rows`] (2), changed by tests ([`Pass::with_mv_rows`]).
    mv_rows: u32,
    /// A plain tiled matmul of fewer workgroups than this splits its columns into slices until it has about as
    /// many ([`matmul::ksplit_target`], 1024; 0, a software adapter's: never), changed by tests and the kernel bench.
    ksplit_target: usize,
    /// Batches of at least this many tokens take the tiled matmul (`matmul_tiled.wgsl`), smaller ones the
    /// per-row one: [`matmul::TILED_MIN`] (on a software adapter `TILED_MIN_SOFTWARE`), changed by tests and the
    /// kernel bench.
    tiled_min: usize,
    /// Byte runs to copy back at [`Pass::finish_read`], after every op recorded: buffer, offset, length.
    reads: Vec<(wgpu::Buffer, u64, u64)>,
    /// Where bind groups are kept across passes; `None` builds each dispatch's own.
    binds: Option<&'g Binds>,
    /// Dispatches recorded: a decode step pays a fixed cost for each on a GPU (docs/gpu.md).
    dispatches: usize,
    /// Timestamps between the dispatches, where `BATON_GPU_PROFILE` is on (profile.rs).
    stamps: Option<profile::Stamps>,
    /// The subgroup size the reducing shaders count on: the adapter's ([`Gpu::subgroup`]), or 0 for the
    /// workgroup-memory trees ([`Pass::with_subgroups`]).
    subgroup: u32,
    /// The matrix units' size S the batches' matmuls take (coop.rs), 0 for the f32 tiled kernel: the adapter's
    /// ([`Gpu::coop`]) on a GPU, 0 on a software adapter unless `BATON_GPU_COOPMAT=1` ([`Pass::with_coop`]).
    coop: u32,
}

impl Gpu {
    /// An empty pass.
    pub fn pass(&self) -> Pass<'_> {
        Pass {
            gpu: self,
            cp: None,
            enc: self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("baton") }),
            lanes: matmul::lanes(self.is_software()),
            mv_rows: matmul::gpu_mv_rows(),
            tiled_min: if self.is_software() {
                matmul::TILED_MIN_SOFTWARE
            } else {
                matmul::TILED_MIN
            },
            ksplit_target: if self.is_software() { 0 } else { matmul::ksplit_target() },
            reads: Vec::new(),
            binds: None,
            dispatches: 0,
            stamps: profile::Stamps::new(self),
            subgroup: self.subgroup(),
            coop: if self.is_software() && coop::wanted() != Some(true) {
                0
            } else {
                self.coop()
            },
        }
    }

    /// An empty pass whose dispatches take their bind groups from `binds`, building only those it lacks.
    pub fn pass_cached<'a>(&'a self, binds: &'a Binds) -> Pass<'a> {
        Pass {
            binds: Some(binds),
            ..self.pass()
        }
    }

    /// A bind group of `pipeline` with `params` in a new uniform buffer at binding 0 and `bufs` at theirs.
    fn bind_group(
        &self,
        pipeline: &wgpu::ComputePipeline,
        params: &[u32],
        bufs: &[(u32, &wgpu::Buffer)],
    ) -> wgpu::BindGroup {
        let mut words = params.to_vec();
        words.resize(params.len().next_multiple_of(4).max(4), 0);
        let uniform = self.device.create_buffer_init(&wgpu::util::BufferInitDescriptor {
            label: Some("params"),
            contents: bytemuck::cast_slice(&words),
            usage: wgpu::BufferUsages::UNIFORM,
        });
        let mut entries = vec![wgpu::BindGroupEntry {
            binding: 0,
            resource: uniform.as_entire_binding(),
        }];
        entries.extend(bufs.iter().map(|&(binding, b)| wgpu::BindGroupEntry {
            binding,
            resource: b.as_entire_binding(),
        }));
        self.device.create_bind_group(&wgpu::BindGroupDescriptor {
            label: None,
            layout: &pipeline.get_bind_group_layout(0),
            entries: &entries,
        })
    }
}

impl<'g> Pass<'g> {
    pub fn gpu(&self) -> &'g Gpu {
        self.gpu
    }

    /// Dispatches recorded so far.
    pub fn dispatches(&self) -> usize {
        self.dispatches
    }

    /// The pass with `lanes` threads per matmul row (a power of two up to 64), so tests run the GPUs' layout on
    /// the software adapter too, and the kernel bench (`benches/kernels.rs --gpu`) compares lane counts.
    pub fn with_lanes(mut self, lanes: u32) -> Self {
        assert!(lanes.is_power_of_two() && lanes <= 64);
        self.lanes = lanes;
        self
    }

    /// The pass with `rows` (1, 2 or 4) rows a thread in the decode mat-vecs of the types with a part walk, where
    /// the lanes a row are enough for it, so tests run each on the software adapter.
    pub fn with_mv_rows(mut self, rows: u32) -> Self {
        assert!([1, 2, 4].contains(&rows));
        self.mv_rows = rows;
        self
    }

    /// The pass with the tiled matmul taken from `n` tokens on, so tests run both kernels on one batch and the
    /// kernel bench finds the crossover.
    pub fn with_tiled_min(mut self, n: usize) -> Self {
        self.tiled_min = n.max(1);
        self
    }

    /// The pass with split-K matmuls below `target` workgroups (0: none), so tests run them on the software adapter
    /// and the kernel bench compares targets.
    pub fn with_ksplit(mut self, target: usize) -> Self {
        self.ksplit_target = target;
        self
    }

    /// Records one dispatch of `pipeline` over `groups` workgroups, its uniform parameters `params` at binding 0
    /// and the buffers `bufs` at their bindings.
    fn dispatch(
        &mut self,
        pipeline: &wgpu::ComputePipeline,
        params: &[u32],
        bufs: &[(u32, &wgpu::Buffer)],
        groups: (u32, u32, u32),
    ) {
        let bind = match self.binds {
            None => self.gpu.bind_group(pipeline, params, bufs),
            Some(binds) => {
                let key = BindKey {
                    pipeline: pipeline.clone(),
                    bufs: bufs.iter().map(|&(i, b)| (i, b.clone())).collect(),
                    params: params.to_vec(),
                };
                let mut map = binds.map.lock().unwrap_or_else(|p| p.into_inner());
                if map.len() >= Binds::CAP && !map.contains_key(&key) {
                    map.clear();
                }
                map.entry(key)
                    .or_insert_with(|| self.gpu.bind_group(pipeline, params, bufs))
                    .clone()
            }
        };
        let cp = self.cp.get_or_insert_with(|| {
            let mut cp = self
                .enc
                .begin_compute_pass(&wgpu::ComputePassDescriptor::default())
                .forget_lifetime();
            if let Some(st) = &mut self.stamps {
                st.mark(self.gpu, &mut cp, None);
            }
            cp
        });
        cp.set_pipeline(pipeline);
        cp.set_bind_group(0, &bind, &[]);
        cp.dispatch_workgroups(groups.0, groups.1, groups.2);
        if let Some(st) = &mut self.stamps {
            st.mark(self.gpu, cp, Some(pipeline));
        }
        self.dispatches += 1;
    }

    /// A tensor of at least `n` values for an op's intermediate result, used within one op: the one kept in the
    /// pass's [`Binds`] (grown when too small), or a new one for a pass without.
    fn scratch(&self, n: usize) -> Result<Tensor> {
        self.kept(n, |b| &b.scratch)
    }

    /// [`Pass::scratch`] for the split-K matmul's partial products: a slot of its own.
    fn partials(&self, n: usize) -> Result<Tensor> {
        self.kept(n, |b| &b.partials)
    }

    /// [`Pass::scratch`] for the rounded activations of [`Pass::act8`].
    fn rounded(&self, n: usize) -> Result<Tensor> {
        self.kept(n, |b| &b.rounded)
    }

    /// [`Pass::scratch`] for the halves of [`Pass::halves`].
    fn kept_halves(&self, n: usize) -> Result<Tensor> {
        self.kept(n, |b| &b.halves)
    }

    fn kept(&self, n: usize, slot: impl Fn(&Binds) -> &Mutex<Option<Tensor>>) -> Result<Tensor> {
        let Some(binds) = self.binds else {
            return self.gpu.zeros(n);
        };
        let mut slot = slot(binds).lock().unwrap_or_else(|p| p.into_inner());
        match &*slot {
            Some(t) if t.len() >= n => Ok(t.clone()),
            _ => {
                let t = self.gpu.zeros(n)?;
                *slot = Some(t.clone());
                Ok(t)
            }
        }
    }

    /// Copies `n` values of `src` from `src_at` to `dst` at `dst_at` (the last row of a batch to the head).
    pub fn copy(&mut self, src: &Tensor, src_at: usize, dst: &Tensor, dst_at: usize, n: usize) -> Result<()> {
        anyhow::ensure!(
            src_at + n <= src.len() && dst_at + n <= dst.len(),
            "copy of {n} values from {src_at} of {} to {dst_at} of {}",
            src.len(),
            dst.len()
        );
        self.cp = None;
        self.enc
            .copy_buffer_to_buffer(&src.buf, 4 * src_at as u64, &dst.buf, 4 * dst_at as u64, 4 * n as u64);
        Ok(())
    }

    /// Asks for `n` values of `t` from `at` back at [`Pass::finish_read`], as they are after every op of the pass.
    pub fn read(&mut self, t: &Tensor, at: usize, n: usize) -> Result<()> {
        ensure!(at + n <= t.len(), "reading {n} values from {at} of {}", t.len());
        self.reads.push((t.buf.clone(), 4 * at as u64, 4 * n as u64));
        Ok(())
    }

    /// [`Pass::read`] of u32 values (a mixture's expert ids).
    pub fn read_u32(&mut self, u: &U32s, at: usize, n: usize) -> Result<()> {
        ensure!(at + n <= u.len(), "reading {n} values from {at} of {}", u.len());
        self.reads.push((u.buf.clone(), 4 * at as u64, 4 * n as u64));
        Ok(())
    }

    /// [`Pass::read`] of f16 values (KV rows): `at` and `n` even, so the run is whole words.
    pub fn read_halves(&mut self, h: &Halves, at: usize, n: usize) -> Result<()> {
        ensure!(
            at.is_multiple_of(2) && n.is_multiple_of(2) && at + n <= h.len(),
            "reading {n} halves from {at} of {}",
            h.len()
        );
        self.reads.push((h.buf.clone(), 2 * at as u64, 2 * n as u64));
        Ok(())
    }

    /// Starts the ops recorded so far on the device without waiting, and goes on recording into a new encoder: a
    /// long pass (a decode step's layers) then runs while the host records the rest of it, rather than after.
    pub fn flush(&mut self) -> Result<()> {
        self.cp = None;
        self.gpu.check()?;
        let next = self
            .gpu
            .device
            .create_command_encoder(&wgpu::CommandEncoderDescriptor { label: Some("baton") });
        let enc = std::mem::replace(&mut self.enc, next);
        // Timed only when profiling: part of "host recording", what the flushes' submissions cost the host.
        let started = self.gpu.profiler().map(|_| std::time::Instant::now());
        self.gpu.queue.submit([enc.finish()]);
        if let (Some(pr), Some(t)) = (self.gpu.profiler(), started) {
            pr.add("host flushing", t.elapsed().as_nanos() as f64);
        }
        Ok(())
    }

    /// Runs the recorded ops and waits for them.
    pub fn finish(mut self) -> Result<()> {
        ensure!(self.reads.is_empty(), "a pass with reads ends with finish_read");
        self.cp = None;
        let stamps = self.stamps.take().map(|st| st.resolve(self.gpu, &mut self.enc));
        self.gpu.check()?;
        let submitted = std::time::Instant::now();
        let idx = self.gpu.queue.submit([self.enc.finish()]);
        let returned = std::time::Instant::now();
        self.gpu.wait(idx.clone())?;
        match stamps {
            Some(st) => st.count(self.gpu, idx, [submitted, returned]),
            None => Ok(()),
        }
    }

    /// Runs the recorded ops and returns the bytes of each [`Pass::read`] / [`Pass::read_halves`], in order: one
    /// submission and one copy back for all of them.
    pub fn finish_read(mut self) -> Result<Vec<Vec<u8>>> {
        let total: u64 = self.reads.iter().map(|r| r.2).sum();
        let kept = self
            .binds
            .map(|b| b.staging.lock().unwrap_or_else(|p| p.into_inner()).take());
        let staging = match kept.flatten() {
            Some(b) if b.size() >= total => b,
            _ => self.gpu.device.create_buffer(&wgpu::BufferDescriptor {
                label: Some("readback"),
                size: total.max(4),
                usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
                mapped_at_creation: false,
            }),
        };
        self.cp = None;
        let mut at = 0;
        for (buf, offset, len) in &self.reads {
            self.enc.copy_buffer_to_buffer(buf, *offset, &staging, at, *len);
            at += len;
        }
        let stamps = self.stamps.take().map(|st| st.resolve(self.gpu, &mut self.enc));
        self.gpu.check()?;
        let submitted = std::time::Instant::now();
        let idx = self.gpu.queue.submit([self.enc.finish()]);
        let returned = std::time::Instant::now();
        let bytes = self.gpu.map_read(&staging, idx.clone(), total as usize)?;
        // Read and unmapped: the next pass of this session may copy into it again.
        if let Some(b) = self.binds {
            *b.staging.lock().unwrap_or_else(|p| p.into_inner()) = Some(staging);
        }
        if let Some(st) = stamps {
            st.count(self.gpu, idx, [submitted, returned])?;
        }
        let mut out = Vec::with_capacity(self.reads.len());
        let mut at = 0;
        for (_, _, len) in &self.reads {
            out.push(bytes[at..at + *len as usize].to_vec());
            at += *len as usize;
        }
        Ok(out)
    }
}

/// `n` as a `u32` shader parameter, or an error naming `what`.
fn u32_of(n: usize, what: &str) -> Result<u32> {
    u32::try_from(n).map_err(|_| anyhow::anyhow!("{what} ({n}) does not fit the GPU's 32-bit indices"))
}

/// The adapter the tests run on: software (lavapipe) unless `BATON_GPU_ADAPTER` says otherwise. `None`, after
/// printing the one SKIPPED line, where there is none.
#[cfg(test)]
pub(crate) fn test_gpu() -> Option<std::sync::Arc<Gpu>> {
    use std::sync::{Arc, OnceLock};
    static GPU: OnceLock<Option<Arc<Gpu>>> = OnceLock::new();
    let gpu = GPU.get_or_init(|| {
        let choice = AdapterChoice::from_env_or(AdapterChoice::Software).expect("BATON_GPU_ADAPTER");
        match Gpu::open(choice) {
            Ok(g) => {
                eprintln!("GPU tests on {}", g.describe());
                Some(Arc::new(g))
            }
            Err(e) if e.downcast_ref::<NoAdapter>().is_some() => None,
            Err(e) => panic!("opening the GPU adapter: {e:#}"),
        }
    });
    if gpu.is_none() {
        println!("SKIPPED: no GPU adapter (install mesa-vulkan-drivers)");
    }
    gpu.clone()
}

#[cfg(test)]
mod tests {
    use super::{Binds, test_gpu};

    /// A session's passes read back through one kept buffer: a smaller read after a larger one takes it again, a
    /// larger one replaces it, and every read returns its own values, not what an earlier read left there.
    #[test]
    fn reads_back_through_a_kept_buffer() {
        let Some(gpu) = test_gpu() else { return };
        let binds = Binds::default();
        let kept = || binds.staging.lock().unwrap().clone().expect("a kept buffer");
        let read = |x: &[f32]| {
            let t = gpu.upload(x).unwrap();
            let mut pass = gpu.pass_cached(&binds);
            pass.read(&t, 0, x.len()).unwrap();
            let bytes = pass.finish_read().unwrap().remove(0);
            bytemuck::pod_collect_to_vec::<u8, f32>(&bytes)
        };
        let big: Vec<f32> = (0..64).map(|i| i as f32).collect();
        assert_eq!(read(&big), big);
        let first = kept();
        assert_eq!(read(&[7.0, 8.0]), [7.0, 8.0]);
        assert!(kept() == first, "the smaller read made a buffer of its own");
        let bigger: Vec<f32> = (0..100).map(|i| -(i as f32)).collect();
        assert_eq!(read(&bigger), bigger);
        assert!(kept() != first && kept().size() >= 400);
    }
}
