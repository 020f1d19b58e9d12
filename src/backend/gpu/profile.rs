//! `BATON_GPU_PROFILE=1`: where a pass's time goes on a real GPU. The GPU writes a timestamp before a compute
//! pass's first dispatch and after each dispatch; the time between two is the kernel's (dispatches run one after
//! another, each ordered after the writes it reads). The host's time recording a pass and waiting for it is
//! counted too. Sums per kernel are kept until [`Gpu::take_profile`] prints them (`baton bench` does after each
//! test). Off by default: the timestamps are writes the GPU orders with the dispatches, and their read-back a copy.

use super::device::Gpu;
use anyhow::Result;
use std::collections::{BTreeMap, HashMap};
use std::sync::Mutex;
use std::time::Instant;

/// Timestamps a pass writes at most (wgpu's limit for one query set); a longer pass is profiled up to there.
const CAP: u32 = 4096;

/// A profiling device's sums, and the kernel each pipeline is.
#[derive(Default)]
pub(super) struct Profiler {
    /// Nanoseconds a timestamp tick is.
    period_ns: f64,
    /// Per kernel (or host step): calls and nanoseconds.
    totals: Mutex<BTreeMap<String, (u64, f64)>>,
    labels: Mutex<HashMap<wgpu::ComputePipeline, String>>,
}

impl Profiler {
    /// A profiler where `BATON_GPU_PROFILE` asks for one and the adapter has timestamps inside compute passes
    /// (`features` then holds what to request); a warning where it asks but the adapter cannot.
    pub(super) fn from_env(adapter: &wgpu::Adapter, features: &mut wgpu::Features) -> Option<Profiler> {
        if std::env::var("BATON_GPU_PROFILE").map_or(true, |v| v.is_empty() || v == "0") {
            return None;
        }
        let need = wgpu::Features::TIMESTAMP_QUERY | wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES;
        if !adapter.features().contains(need) {
            tracing::warn!("BATON_GPU_PROFILE: this adapter has no timestamps inside compute passes; not profiling");
            return None;
        }
        *features |= need;
        Some(Profiler::default())
    }

    pub(super) fn set_period(&mut self, queue: &wgpu::Queue) {
        self.period_ns = queue.get_timestamp_period() as f64;
    }

    /// Names `pipeline` as shader `key`'s entry point `entry`.
    pub(super) fn name(&self, pipeline: &wgpu::ComputePipeline, key: &str, entry: &str) {
        let mut labels = self.labels.lock().unwrap_or_else(|p| p.into_inner());
        labels.insert(pipeline.clone(), format!("{key}::{entry}"));
    }

    pub(super) fn add(&self, what: &str, ns: f64) {
        let mut totals = self.totals.lock().unwrap_or_else(|p| p.into_inner());
        let e = totals.entry(what.to_string()).or_default();
        e.0 += 1;
        e.1 += ns;
    }

    /// The sums since the last take, as a table by time, and empties them; `None` when nothing was profiled.
    fn take(&self) -> Option<String> {
        let totals = std::mem::take(&mut *self.totals.lock().unwrap_or_else(|p| p.into_inner()));
        if totals.is_empty() {
            return None;
        }
        let gpu: f64 = totals
            .iter()
            .filter(|(k, _)| !k.starts_with("host "))
            .map(|(_, v)| v.1)
            .sum();
        let mut rows: Vec<_> = totals.into_iter().collect();
        rows.sort_by(|a, b| b.1.1.total_cmp(&a.1.1));
        let mut s = format!(
            "GPU time in kernels {:.2} ms; by kernel (host steps last):\n",
            gpu / 1e6
        );
        s += "| share | total ms | calls | mean us | kernel |\n|---:|---:|---:|---:|---|\n";
        let (host, kernels): (Vec<_>, Vec<_>) = rows.into_iter().partition(|(k, _)| k.starts_with("host "));
        for (k, (n, ns)) in kernels.into_iter().chain(host) {
            let share = if k.starts_with("host ") {
                "-".to_string()
            } else {
                format!("{:.1}%", ns / gpu * 100.0)
            };
            s += &format!(
                "| {share} | {:.2} | {n} | {:.1} | {k} |\n",
                ns / 1e6,
                ns / n as f64 / 1e3
            );
        }
        Some(s)
    }
}

/// One pass's timestamps: query i written after the dispatch `labels[i]` (`None`: a compute pass's start).
pub(super) struct Stamps {
    qs: wgpu::QuerySet,
    labels: Vec<Option<String>>,
    started: Instant,
}

/// A profiled pass's timestamps, resolved into `staging` by the submission, and its host times so far.
pub(super) struct Resolved {
    staging: wgpu::Buffer,
    labels: Vec<Option<String>>,
    recorded: Instant,
    started: Instant,
}

impl Stamps {
    pub(super) fn new(gpu: &Gpu) -> Option<Stamps> {
        gpu.profiler()?;
        let qs = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("profile"),
            ty: wgpu::QueryType::Timestamp,
            count: CAP,
        });
        Some(Stamps {
            qs,
            labels: Vec::new(),
            started: Instant::now(),
        })
    }

    /// Writes the next timestamp in `cp`, after the dispatch of `pipeline` (`None`: at the pass's start).
    pub(super) fn mark(
        &mut self,
        gpu: &Gpu,
        cp: &mut wgpu::ComputePass<'static>,
        pipeline: Option<&wgpu::ComputePipeline>,
    ) {
        if self.labels.len() as u32 >= CAP {
            return;
        }
        let label = pipeline.map(|p| {
            let labels = gpu
                .profiler()
                .map(|pr| pr.labels.lock().unwrap_or_else(|p| p.into_inner()));
            labels
                .and_then(|l| l.get(p).cloned())
                .unwrap_or_else(|| "unnamed".into())
        });
        cp.write_timestamp(&self.qs, self.labels.len() as u32);
        self.labels.push(label);
    }

    /// Records the copy of the timestamps to a buffer the host can read, after every op of the pass.
    pub(super) fn resolve(self, gpu: &Gpu, enc: &mut wgpu::CommandEncoder) -> Resolved {
        let n = self.labels.len().max(1) as u64;
        let usage = wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC;
        let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("profile"),
            size: 8 * n,
            usage,
            mapped_at_creation: false,
        });
        let staging = gpu.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some("profile readback"),
            size: 8 * n,
            usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
            mapped_at_creation: false,
        });
        if !self.labels.is_empty() {
            enc.resolve_query_set(&self.qs, 0..self.labels.len() as u32, &resolve, 0);
            enc.copy_buffer_to_buffer(&resolve, 0, &staging, 0, 8 * n);
        }
        Resolved {
            staging,
            labels: self.labels,
            recorded: Instant::now(),
            started: self.started,
        }
    }
}

impl Resolved {
    /// Adds the pass's times to the sums, once its submission `idx` is done (waits for it): `submit` is when its
    /// last submission began and returned.
    pub(super) fn count(self, gpu: &Gpu, idx: wgpu::SubmissionIndex, submit: [Instant; 2]) -> Result<()> {
        let Some(pr) = gpu.profiler() else { return Ok(()) };
        pr.add("host recording", (self.recorded - self.started).as_nanos() as f64);
        pr.add("host submitting", (submit[1] - submit[0]).as_nanos() as f64);
        pr.add("host waiting", submit[1].elapsed().as_nanos() as f64);
        if self.labels.is_empty() {
            return Ok(());
        }
        let bytes = gpu.map_read(&self.staging, idx, 8 * self.labels.len())?;
        let ticks: Vec<u64> = bytes
            .chunks_exact(8)
            .map(|c| u64::from_le_bytes(c.try_into().unwrap()))
            .collect();
        for i in 1..ticks.len() {
            if let Some(label) = &self.labels[i] {
                pr.add(label, ticks[i].saturating_sub(ticks[i - 1]) as f64 * pr.period_ns);
            }
        }
        Ok(())
    }
}

impl Gpu {
    /// The kernel times summed since the last call, as a table, when `BATON_GPU_PROFILE` is on (and empties them).
    pub fn take_profile(&self) -> Option<String> {
        self.profiler()?.take()
    }
}
