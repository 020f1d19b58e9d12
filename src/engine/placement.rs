//! Where a session's layers run: all on the CPU, or the first `--gpu-layers` of the model on a GPU and the rest on
//! the CPU (`--backend gpu|auto`). Chosen once per process, as `--numerics` is: the flags set `BATON_BACKEND` and
//! `BATON_GPU_LAYERS`, which nodes started by a parent inherit. Each loaded model's GPU weights are uploaded once
//! and shared by its sessions; each session has its own KV cache on the device.

use crate::backend::gpu::layers::GpuWeights;
use crate::backend::gpu::{AdapterChoice, Gpu, NoAdapter};
use crate::model::Model;
use crate::model::moe::RemoteExperts;
use anyhow::{Result, anyhow, bail};
use std::ops::Range;
use std::sync::{Arc, Mutex, OnceLock, Weak};

/// Opens the peer that runs part of a MoE model's experts (`--experts-split`; made by `cluster::experts`, which sits
/// above this module).
pub type ExpertsConnector = dyn Fn(&Arc<Model>) -> Result<Arc<dyn RemoteExperts>> + Send + Sync;

static EXPERTS: OnceLock<Box<ExpertsConnector>> = OnceLock::new();

/// Makes every session of a mixture-of-experts model in this process send part of its experts to the peer
/// `connect` opens (once per process, at start, as `--backend` is chosen once).
pub fn set_experts_split(connect: Box<ExpertsConnector>) -> Result<()> {
    EXPERTS
        .set(connect)
        .map_err(|_| anyhow!("--experts-split is set once per process"))
}

/// The experts peer for a session of `model` (a MoE model), when the process has one.
pub fn experts_peer(model: &Arc<Model>) -> Result<Option<Arc<dyn RemoteExperts>>> {
    EXPERTS.get().map(|connect| connect(model)).transpose()
}

/// What `--backend` asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BackendChoice {
    Cpu,
    /// A GPU, or an error when there is none.
    Gpu,
    /// A hardware GPU when there is one (never a software adapter), else the CPU.
    Auto,
}

impl std::str::FromStr for BackendChoice {
    type Err = anyhow::Error;
    fn from_str(s: &str) -> Result<Self> {
        match s.trim().to_ascii_lowercase().as_str() {
            "cpu" => Ok(BackendChoice::Cpu),
            "gpu" => Ok(BackendChoice::Gpu),
            "auto" => Ok(BackendChoice::Auto),
            _ => bail!("backend {s:?}: expected cpu, gpu or auto"),
        }
    }
}

/// A process's choice of where layers run, and the GPU weights uploaded so far.
pub struct Placement {
    gpu: Option<Arc<Gpu>>,
    /// Layers of the model on the GPU, counted from layer 0 (`None`: all of them).
    gpu_layers: Option<usize>,
    /// Weights on the GPU, by model (and the layers uploaded).
    uploaded: Mutex<Vec<Uploaded>>,
    /// `--backend auto`: a model the GPU backend cannot run ([`GpuWeights::unsupported`]) runs on the CPU instead of
    /// failing.
    cpu_fallback: bool,
}

/// One model's layers on the GPU; the entry goes when the model does.
type Uploaded = (Weak<Model>, Range<usize>, Arc<GpuWeights>);

impl Placement {
    /// Every layer on the CPU.
    pub fn cpu() -> Placement {
        Placement {
            gpu: None,
            gpu_layers: None,
            uploaded: Mutex::new(Vec::new()),
            cpu_fallback: false,
        }
    }

    /// The first `gpu_layers` layers of every model (`None`: all) on `gpu`.
    pub fn on_gpu(gpu: Arc<Gpu>, gpu_layers: Option<usize>) -> Placement {
        Placement {
            gpu: Some(gpu),
            gpu_layers,
            uploaded: Mutex::new(Vec::new()),
            cpu_fallback: false,
        }
    }

    /// `--backend auto`'s placement: a model the GPU cannot run runs on the CPU, with a warning, rather than failing.
    pub fn with_cpu_fallback(self) -> Placement {
        Placement {
            cpu_fallback: true,
            ..self
        }
    }

    /// The process's placement: `BATON_BACKEND` (`cpu` by default) and `BATON_GPU_LAYERS`, the GPU opened on
    /// first use (the adapter named on stderr). `auto` without a hardware GPU runs on the CPU, saying so.
    pub fn process() -> Result<&'static Placement> {
        static P: OnceLock<std::result::Result<Placement, String>> = OnceLock::new();
        P.get_or_init(|| Placement::from_env().map_err(|e| format!("{e:#}")))
            .as_ref()
            .map_err(|e| anyhow!("{e}"))
    }

    /// [`Placement::describe`] of the process's placement, `None` where it cannot be opened (the cluster view).
    pub fn process_label() -> Option<String> {
        Placement::process().ok().map(Placement::describe)
    }

    fn from_env() -> Result<Placement> {
        let choice: BackendChoice = match std::env::var("BATON_BACKEND") {
            Ok(s) if !s.is_empty() => s.parse()?,
            _ => BackendChoice::Cpu,
        };
        let gpu_layers = match std::env::var("BATON_GPU_LAYERS") {
            Ok(s) if !s.is_empty() => Some(
                s.trim()
                    .parse::<usize>()
                    .map_err(|_| anyhow!("--gpu-layers {s:?}: expected a number of layers"))?,
            ),
            _ => None,
        };
        if choice == BackendChoice::Cpu {
            if gpu_layers.is_some_and(|n| n > 0) {
                bail!("--gpu-layers needs --backend gpu or auto");
            }
            return Ok(Placement::cpu());
        }
        match Gpu::open(AdapterChoice::from_env_or(AdapterChoice::Auto)?) {
            Ok(gpu) => {
                tracing::info!("backend: GPU {}", gpu.describe());
                let p = Placement::on_gpu(Arc::new(gpu), gpu_layers);
                Ok(if choice == BackendChoice::Auto {
                    p.with_cpu_fallback()
                } else {
                    p
                })
            }
            Err(e) if choice == BackendChoice::Auto && e.downcast_ref::<NoAdapter>().is_some() => {
                tracing::info!("backend auto: {e}; running on the CPU");
                Ok(Placement::cpu())
            }
            Err(e) if e.downcast_ref::<NoAdapter>().is_some() => Err(e.context(
                "--backend gpu: no GPU to run on (BATON_GPU_ADAPTER=software takes a software Vulkan adapter, \
                 slow, for tests)",
            )),
            Err(e) => Err(e.context("--backend: opening the GPU")),
        }
    }

    pub fn gpu(&self) -> Option<&Arc<Gpu>> {
        self.gpu.as_ref()
    }

    /// What the bench and the logs call it: `cpu`, or the adapter and how many layers go to it.
    pub fn describe(&self) -> String {
        match (&self.gpu, self.gpu_layers) {
            (None, _) => "cpu".into(),
            (Some(g), None) => format!("gpu: {}", g.info().name),
            (Some(g), Some(n)) => format!("gpu: {}, first {n} layers", g.info().name),
        }
    }

    /// The layers of `range` (a session's) that run on the GPU: its first ones, up to the `--gpu-layers`-th layer
    /// of the model. Empty on the CPU.
    pub fn gpu_range(&self, range: &Range<usize>) -> Range<usize> {
        if self.gpu.is_none() {
            return range.start..range.start;
        }
        let end = self.gpu_layers.map_or(range.end, |n| n.clamp(range.start, range.end));
        range.start..end
    }

    /// The GPU weights of a session of `model`, uploaded on first use and shared after; `None` when none of its
    /// layers run on the GPU.
    pub fn gpu_weights(&self, model: &Arc<Model>) -> Result<Option<Arc<GpuWeights>>> {
        let Some(gpu) = &self.gpu else { return Ok(None) };
        let layers = self.gpu_range(&model.range);
        if layers.is_empty() {
            return Ok(None);
        }
        if self.cpu_fallback
            && let Some(why) = GpuWeights::unsupported(&model.hp)
        {
            static SAID: std::sync::Once = std::sync::Once::new();
            SAID.call_once(|| tracing::warn!("backend auto: {why}: running it on the CPU"));
            return Ok(None);
        }
        let mut up = self.uploaded.lock().unwrap_or_else(|p| p.into_inner());
        up.retain(|(m, _, _)| m.strong_count() > 0);
        let me = Arc::downgrade(model);
        if let Some((_, _, w)) = up.iter().find(|(m, r, _)| m.ptr_eq(&me) && *r == layers) {
            return Ok(Some(w.clone()));
        }
        let t = std::time::Instant::now();
        let w = Arc::new(GpuWeights::upload(gpu.clone(), model, layers.clone())?);
        tracing::info!(
            "GPU {}: layers {layers:?} of {} ({} MiB){} uploaded in {:.1} s",
            gpu.info().name,
            model.hp.n_layer,
            w.bytes() >> 20,
            if w.has_head() { " and the output head" } else { "" },
            t.elapsed().as_secs_f32()
        );
        up.push((me, layers, w.clone()));
        Ok(Some(w))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn backend_choice_parses() {
        assert_eq!("GPU".parse::<BackendChoice>().unwrap(), BackendChoice::Gpu);
        assert_eq!(" auto".parse::<BackendChoice>().unwrap(), BackendChoice::Auto);
        assert_eq!("cpu".parse::<BackendChoice>().unwrap(), BackendChoice::Cpu);
        assert!("cuda".parse::<BackendChoice>().is_err());
    }

    #[test]
    fn cpu_placement_puts_no_layer_on_a_gpu() {
        assert!(Placement::cpu().gpu_range(&(0..30)).is_empty());
    }
}
