//! Choosing and opening an adapter, and what the ops share: the device, its queue, compiled pipelines, and the
//! errors wgpu reports asynchronously (collected here so an op returns them instead of wgpu panicking).

use anyhow::{Context, Result, anyhow, bail};
use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Which adapter to open. `Auto` is what a user gets: a real GPU or nothing, because a software rasteriser
/// (lavapipe, WARP, SwiftShader) runs a model slower than Baton's CPU kernels. `Software` is for the tests, which
/// run on lavapipe where there is no GPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdapterChoice {
    Auto,
    Software,
}

impl AdapterChoice {
    /// The choice `BATON_GPU_ADAPTER` names (`auto` or `software`), or `default` when it is unset.
    pub fn from_env_or(default: AdapterChoice) -> Result<AdapterChoice> {
        match std::env::var("BATON_GPU_ADAPTER") {
            Err(_) => Ok(default),
            Ok(v) => v.parse(),
        }
    }
}

impl std::str::FromStr for AdapterChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<AdapterChoice> {
        match s.trim().to_ascii_lowercase().as_str() {
            "" | "auto" | "gpu" => Ok(AdapterChoice::Auto),
            "software" | "cpu" | "lavapipe" => Ok(AdapterChoice::Software),
            other => bail!("BATON_GPU_ADAPTER={other:?}: expected `auto` or `software`"),
        }
    }
}

/// No adapter of the kind asked for: the caller may fall back to the CPU (and a test skips).
#[derive(Debug, thiserror::Error)]
#[error("no {wanted} adapter found (adapters seen: {seen})")]
pub struct NoAdapter {
    pub wanted: &'static str,
    pub seen: String,
}

/// How long one submission may run before it counts as a hung or lost device: long enough for the slowest op on
/// lavapipe, short enough that a vanished GPU gives an error rather than a hang.
pub(super) const WAIT: Duration = Duration::from_secs(120);

/// An opened adapter: everything an op needs to record and run its shaders.
pub struct Gpu {
    pub(super) device: wgpu::Device,
    pub(super) queue: wgpu::Queue,
    info: wgpu::AdapterInfo,
    limits: wgpu::Limits,
    /// Compiled pipelines by shader key and entry point, built on first use.
    pipelines: Mutex<HashMap<(String, &'static str), Arc<wgpu::ComputePipeline>>>,
    /// The first error wgpu reported outside an error scope (validation, out of memory, device lost), taken by
    /// the next [`Gpu::check`].
    error: Arc<Mutex<Option<String>>>,
    /// The grid i-quants' codebooks, uploaded at the first matmul of such a type (`matmul::grid_buffer`).
    pub(super) iq_grid: std::sync::OnceLock<wgpu::Buffer>,
    /// Kernel times, where `BATON_GPU_PROFILE` asks for them (profile.rs).
    profiler: Option<super::profile::Profiler>,
    /// The subgroup size the reducing shaders count on, 0 where they keep workgroup memory (subgroup.rs).
    subgroup: u32,
    /// The size S of the matrix units the batches' matmuls may take (coop.rs), 0 where there are none; set to 0
    /// when a kernel for them fails to compile ([`Gpu::stop_coop`]).
    coop: std::sync::atomic::AtomicU32,
}

/// Preference among real adapters: a discrete GPU over an integrated one over anything else that is not software.
fn rank(t: wgpu::DeviceType) -> Option<u8> {
    match t {
        wgpu::DeviceType::DiscreteGpu => Some(0),
        wgpu::DeviceType::IntegratedGpu => Some(1),
        wgpu::DeviceType::VirtualGpu | wgpu::DeviceType::Other => Some(2),
        wgpu::DeviceType::Cpu => None,
    }
}

impl Gpu {
    /// Opens the adapter `choice` asks for on Vulkan, Metal or DX12. Fails with [`NoAdapter`] when there is none.
    pub fn open(choice: AdapterChoice) -> Result<Gpu> {
        let instance = wgpu::Instance::new(wgpu::InstanceDescriptor {
            backends: wgpu::Backends::PRIMARY,
            ..wgpu::InstanceDescriptor::new_without_display_handle()
        });
        let adapters = pollster::block_on(instance.enumerate_adapters(wgpu::Backends::PRIMARY));
        let seen = adapters
            .iter()
            .map(|a| {
                let i = a.get_info();
                format!("{} ({:?}, {:?})", i.name, i.device_type, i.backend)
            })
            .collect::<Vec<_>>();
        let seen = if seen.is_empty() {
            "none".to_string()
        } else {
            seen.join(", ")
        };
        let adapter = match choice {
            AdapterChoice::Auto => adapters
                .into_iter()
                .filter_map(|a| rank(a.get_info().device_type).map(|r| (r, a)))
                .min_by_key(|(r, _)| *r)
                .map(|(_, a)| a),
            AdapterChoice::Software => adapters
                .into_iter()
                .find(|a| a.get_info().device_type == wgpu::DeviceType::Cpu),
        };
        let Some(adapter) = adapter else {
            let wanted = match choice {
                AdapterChoice::Auto => "hardware GPU",
                AdapterChoice::Software => "software (CPU) Vulkan",
            };
            return Err(NoAdapter { wanted, seen }.into());
        };
        let info = adapter.get_info();
        // The adapter's own limits: the defaults cap storage buffers at 128 MiB, less than an output head.
        let limits = adapter.limits();
        let mut features = wgpu::Features::empty();
        let subgroup = super::subgroup::usable_size(&adapter);
        if subgroup > 0 {
            features |= wgpu::Features::SUBGROUP;
        }
        let mut profiler = super::profile::Profiler::from_env(&adapter, &mut features);
        let mut coop = super::coop::size_for(&adapter, subgroup);
        let open = |features: wgpu::Features| {
            let experimental = if features.contains(super::coop::FEATURES) {
                // SAFETY: wgpu marks cooperative matrices experimental: its implementation may have bugs that are
                // undefined behaviour. The kernel that uses them is checked at load (`coop::probe`) and by the
                // tests against the CPU's products, and `BATON_GPU_COOPMAT=0` opens the device without them.
                unsafe { wgpu::ExperimentalFeatures::enabled() }
            } else {
                wgpu::ExperimentalFeatures::disabled()
            };
            pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
                label: Some("baton"),
                required_features: features,
                required_limits: limits.clone(),
                experimental_features: experimental,
                ..Default::default()
            }))
        };
        let opened = match coop {
            0 => open(features),
            _ => open(features | super::coop::FEATURES).or_else(|e| {
                tracing::warn!("GPU {}: no matrix units ({e}); opening without them", info.name);
                coop = 0;
                open(features)
            }),
        };
        let (device, queue) = opened.with_context(|| format!("opening GPU adapter {}", info.name))?;
        let error = Arc::new(Mutex::new(None::<String>));
        let sink = error.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| e.to_string());
        }));
        let sink = error.clone();
        device.set_device_lost_callback(move |reason, msg| {
            let mut slot = sink.lock().unwrap_or_else(|p| p.into_inner());
            slot.get_or_insert_with(|| format!("GPU device lost ({reason:?}): {msg}"));
        });
        if let Some(p) = &mut profiler {
            p.set_period(&queue);
        }
        let mut gpu = Gpu {
            device,
            queue,
            info,
            limits,
            pipelines: Mutex::new(HashMap::new()),
            error,
            iq_grid: std::sync::OnceLock::new(),
            profiler,
            subgroup,
            coop: coop.into(),
        };
        if subgroup > 0 {
            // A driver whose subgroups are not runs of consecutive threads, or whose shuffles fail to compile or
            // to give the partners asked for, keeps the workgroup-memory reductions.
            let why = match super::subgroup::probe(&gpu) {
                Ok(true) => None,
                Ok(false) => Some("its subgroups do not hold consecutive threads".to_string()),
                Err(e) => Some(format!("{e:#}")),
            };
            if let Some(why) = why {
                tracing::warn!(
                    "GPU {}: no subgroup reductions ({why}); reducing in workgroup memory",
                    gpu.info.name
                );
                gpu.subgroup = 0;
            }
        }
        if gpu.coop() > 0 {
            // The kernel counts on the subgroups above; and a driver whose units do not multiply as expected keeps
            // the f32 tiled kernel.
            let why = match gpu.subgroup {
                0 => Some("no usable subgroups".to_string()),
                _ => match super::coop::probe(&gpu, gpu.coop()) {
                    Ok(true) => None,
                    Ok(false) => Some("a test multiplication came out wrong".to_string()),
                    Err(e) => Some(format!("{e:#}")),
                },
            };
            if let Some(why) = why {
                tracing::warn!("GPU {}: not using its matrix units ({why})", gpu.info.name);
                gpu.coop = 0.into();
            }
        }
        Ok(gpu)
    }

    /// Name, kind and API of the adapter, as printed at load: `llvmpipe (LLVM 15.0.6, 256 bits) (Cpu, Vulkan,
    /// driver llvmpipe Mesa 22.3.6 (LLVM 15.0.6), subgroups of 8)`, and the matrix units where the batches'
    /// matmuls take them (`, 16x16 f16 matrix units`).
    pub fn describe(&self) -> String {
        let subgroups = match self.subgroup {
            0 => "no subgroups".to_string(),
            n => format!("subgroups of {n}"),
        };
        let units = match self.coop() {
            0 => String::new(),
            s if self.is_software() && super::coop::wanted() != Some(true) => {
                format!(", {s}x{s} f16 matrix units unused (software; BATON_GPU_COOPMAT=1 uses them)")
            }
            s => format!(", {s}x{s} f16 matrix units"),
        };
        format!(
            "{} ({:?}, {:?}, driver {} {}, {subgroups}{units})",
            self.info.name, self.info.device_type, self.info.backend, self.info.driver, self.info.driver_info
        )
    }

    /// The size S of the matrix units the batches' matmuls may take (coop.rs), 0 where there are none.
    pub fn coop(&self) -> u32 {
        self.coop.load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Gives up the matrix units for good, with a warning saying why (a kernel that does not compile on this
    /// driver): the passes made from now on take the f32 tiled kernel.
    pub(super) fn stop_coop(&self, why: &anyhow::Error) {
        if self.coop.swap(0, std::sync::atomic::Ordering::Relaxed) > 0 {
            tracing::warn!("GPU {}: not using its matrix units any more ({why:#})", self.info.name);
        }
    }

    /// The subgroup size the reducing shaders count on, 0 where they reduce in workgroup memory (subgroup.rs).
    pub fn subgroup(&self) -> u32 {
        self.subgroup
    }

    pub fn info(&self) -> &wgpu::AdapterInfo {
        &self.info
    }

    /// Whether this is a software adapter (lavapipe): fine for tests, never chosen by `auto`.
    pub fn is_software(&self) -> bool {
        self.info.device_type == wgpu::DeviceType::Cpu
    }

    pub(super) fn profiler(&self) -> Option<&super::profile::Profiler> {
        self.profiler.as_ref()
    }

    /// Storage buffers one dispatch may bind (8 is the portable least; desktop GPUs and Metal allow more).
    pub fn storage_buffers(&self) -> u32 {
        self.limits.max_storage_buffers_per_shader_stage
    }

    /// Largest buffer one binding may cover, in bytes.
    pub fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// The error wgpu reported since the last check, if any.
    pub(super) fn check(&self) -> Result<()> {
        let mut slot = self.error.lock().unwrap_or_else(|p| p.into_inner());
        match slot.take() {
            Some(e) => Err(anyhow!("GPU error on {}: {e}", self.info.name)),
            None => Ok(()),
        }
    }

    /// Waits for the submission `idx`, at most [`WAIT`].
    pub(super) fn wait(&self, idx: wgpu::SubmissionIndex) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(idx),
                timeout: Some(WAIT),
            })
            .map_err(|e| anyhow!("waiting for GPU {}: {e}", self.info.name))?;
        self.check()
    }

    /// Runs the device's completed work's callbacks without waiting.
    pub(super) fn poll(&self) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Poll)
            .map_err(|e| anyhow!("polling GPU {}: {e}", self.info.name))?;
        Ok(())
    }

    /// The pipeline of entry point `entry` in the shader `key` with its `override` constants set to `constants`,
    /// the WGSL `source` given on first use. A shader that fails to compile is an error naming it, not a panic.
    pub(super) fn pipeline(
        &self,
        key: &str,
        entry: &'static str,
        constants: &[(&str, f64)],
        source: impl FnOnce() -> String,
    ) -> Result<Arc<wgpu::ComputePipeline>> {
        let mut map = self.pipelines.lock().unwrap_or_else(|p| p.into_inner());
        let name = key;
        let key = format!("{key}{constants:?}");
        if let Some(p) = map.get(&(key.clone(), entry)) {
            return Ok(p.clone());
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(&key),
            source: wgpu::ShaderSource::Wgsl(source().into()),
        };
        let module = match shader_checks() {
            // SAFETY: by default only loop bounding is left out, and every loop of these shaders ends (see
            // `shader_checks`); the `bounds` and `none` settings, which also drop the division guards (and `none`
            // the bounds checks), are for measuring only.
            Some(checks) => unsafe { self.device.create_shader_module_trusted(desc, checks) },
            None => self.device.create_shader_module(desc),
        };
        let pipeline = self.device.create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
            label: Some(&key),
            layout: None,
            module: &module,
            entry_point: Some(entry),
            compilation_options: wgpu::PipelineCompilationOptions {
                constants,
                // Every shader writes its workgroup memory before reading it; zeroing it first costs each workgroup
                // a pass over it and a barrier.
                zero_initialize_workgroup_memory: false,
            },
            cache: None,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            bail!("GPU shader {key}::{entry} does not compile: {e}");
        }
        if let Some(pr) = &self.profiler {
            pr.name(&pipeline, name, entry);
        }
        let p = Arc::new(pipeline);
        map.insert((key, entry), p.clone());
        Ok(p)
    }
}

/// The runtime checks naga adds to the shaders. Buffer bounds and integer-division guards stay; loop bounding (a
/// counter in every loop, so that a loop the compiler could prove endless is not undefined behaviour) goes: every
/// loop here is a `for` whose step is a positive constant (`WG`, `CHUNK`, `LANES` a power of two, asserted in
/// `Pass::with_lanes`) or a halving towards 0, toward a bound the host sets, so each ends. On an H200 the counters
/// cost a third of the 1B prefill and a sixth of its decode (docs/gpu.md, "naga's runtime checks").
/// `BATON_GPU_CHECKS` picks others, to measure them: `all` (naga's default), `bounds` (only the bounds), `none`.
fn shader_checks() -> Option<wgpu::ShaderRuntimeChecks> {
    let mut checks = wgpu::ShaderRuntimeChecks::unchecked();
    match std::env::var("BATON_GPU_CHECKS").as_deref() {
        Ok("all") => None,
        Ok("none") => Some(checks),
        Ok("bounds") => {
            checks.bounds_checks = true;
            Some(checks)
        }
        _ => {
            checks.bounds_checks = true;
            checks.int_div_checks = true;
            checks.ray_query_initialization_tracking = true;
            checks.task_shader_dispatch_tracking = true;
            checks.mesh_shader_primitive_indices_clamp = true;
            Some(checks)
        }
    }
}

/// Workgroups of a 1-D grid of `n` laid out as `(x, y)` within the 65535-per-dimension limit; a shader finds its
/// index as `wid.x + wid.y * x`.
pub(super) fn grid(n: u32) -> (u32, u32) {
    const MAX: u32 = 65535;
    if n <= MAX {
        (n.max(1), 1)
    } else {
        (MAX, n.div_ceil(MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adapter_choice_parses() {
        assert_eq!("auto".parse::<AdapterChoice>().unwrap(), AdapterChoice::Auto);
        assert_eq!(" Software ".parse::<AdapterChoice>().unwrap(), AdapterChoice::Software);
        assert!("cuda".parse::<AdapterChoice>().is_err());
        assert_eq!(grid(10), (10, 1));
        assert_eq!(grid(0), (1, 1));
        assert_eq!(grid(70000), (65535, 2));
    }

    /// `auto` never picks the software adapter: on a machine whose only adapter is lavapipe it finds none.
    #[test]
    fn auto_never_picks_software() {
        match Gpu::open(AdapterChoice::Auto) {
            Ok(g) => assert!(!g.is_software(), "auto opened {}", g.describe()),
            Err(e) => assert!(e.downcast_ref::<NoAdapter>().is_some(), "{e:#}"),
        }
    }
}
