//! The GPU backend through the front ends and across processes, on Mesa's software Vulkan adapter (lavapipe,
//! `BATON_GPU_ADAPTER=software`): `baton run --backend gpu` gives the CPU's text, a GPU prefill node hands its KV to a
//! CPU decode session and a CPU node to a GPU session, and a pipeline runs one stage on each backend. Tiny
//! random-weight F32 models keep this within a minute on lavapipe; `backend::gpu::layers`'s tests run the default
//! models. Where there is no Vulkan adapter at all, each test says SKIPPED and passes (`scripts/test` installs
//! `mesa-vulkan-drivers`).

mod cluster_util;

use baton::backend::gpu::{AdapterChoice, Gpu, NoAdapter};
use baton::cluster::handoff::{NodeOpts, PrefillNode, prefill_with_fallback};
use baton::cluster::handshake::Timeouts;
use baton::cluster::pipeline::PipelineSession;
use baton::engine::placement::Placement;
use baton::engine::snapshot::RowDtype;
use baton::engine::{Input, Session, Want};
use baton::gguf::GgufFile;
use baton::kernels::ThreadPool;
use baton::model::random::{RandomSpec, write_random_model};
use baton::model::{Arch, Model};
use cluster_util::*;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;
use std::time::Duration;

/// The software adapter, or `None` after printing SKIPPED.
fn software_gpu() -> Option<Arc<Gpu>> {
    match Gpu::open(AdapterChoice::Software) {
        Ok(g) => Some(Arc::new(g)),
        Err(e) if e.downcast_ref::<NoAdapter>().is_some() => {
            println!("SKIPPED: no GPU adapter (install mesa-vulkan-drivers)");
            None
        }
        Err(e) => panic!("opening the software GPU adapter: {e:#}"),
    }
}

/// A tiny random-weight model of `arch` (4 layers, F32) with SmolLM2's tokenizer.
fn tiny(arch: Arch, dir: &Path) -> PathBuf {
    let p = dir.join(format!("{}.gguf", arch.name()));
    write_random_model(&GgufFile::open(&smollm2()).unwrap(), &RandomSpec::tiny(arch), &p).unwrap();
    p
}

/// The environment that puts a child process's layers on the software adapter.
const ON_GPU: [&str; 3] = ["env", "BATON_BACKEND=gpu", "BATON_GPU_ADAPTER=software"];

fn session(model: &Path, placement: &Placement) -> Session {
    let m = Arc::new(Model::load(model).unwrap());
    Session::placed(m, Arc::new(ThreadPool::new(1)), 1024, 32, placement).unwrap()
}

fn greedy(s: &mut Session, logits: &[f32], n: usize) -> Vec<u32> {
    let mut toks = vec![argmax(logits)];
    while toks.len() < n {
        let l = s
            .forward(Input::Tokens(&[*toks.last().unwrap()]), Want::LastLogits)
            .unwrap();
        toks.push(argmax(l));
    }
    toks
}

/// `baton run` on the GPU prints the CPU's greedy text and names its adapter; `--gpu-layers 2` too; `--backend
/// gpu` with only a software adapter and `auto` chosen is a clear error; `auto` alone falls back to the CPU. For the
/// tiny llama and gemma3 and the generated mixtures of experts qwen3moe (all its layers at `--gpu-layers 2`),
/// glm4moe and deepseek2 (a dense layer and a layer of experts on the GPU, one on the CPU).
#[test]
fn run_on_the_gpu_gives_the_cpu_text() {
    if software_gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let generated = |name: &str| Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/{name}.gguf"));
    let models = [
        (Arch::Llama, tiny(Arch::Llama, dir.path())),
        (Arch::Gemma3, tiny(Arch::Gemma3, dir.path())),
        (Arch::Qwen3Moe, generated("qwen3moe")),
        (Arch::Glm4Moe, generated("glm4moe")),
        (Arch::Deepseek2, generated("deepseek2")),
    ];
    for (arch, m) in models {
        let run = |env: &[(&str, &str)], extra: &[&str]| {
            let mut c = Command::new(baton_bin());
            c.args(["run", "-m", m.to_str().unwrap(), "-n", "12", "The capital of France is"])
                .args(["--temp", "0", "-t", "1"])
                .args(extra);
            for (k, v) in env {
                c.env(k, v);
            }
            c.output().unwrap()
        };
        let cpu = run(&[], &[]);
        assert!(cpu.status.success(), "{}", String::from_utf8_lossy(&cpu.stderr));
        for layers in [None, Some("2")] {
            let mut extra = vec!["--backend", "gpu"];
            extra.extend(layers.iter().flat_map(|n| ["--gpu-layers", *n]));
            let gpu = run(&[("BATON_GPU_ADAPTER", "software")], &extra);
            let err = String::from_utf8_lossy(&gpu.stderr);
            assert!(gpu.status.success(), "{err}");
            assert!(
                err.contains("backend: GPU llvmpipe"),
                "the adapter is named at load: {err}"
            );
            assert_eq!(
                String::from_utf8_lossy(&gpu.stdout),
                String::from_utf8_lossy(&cpu.stdout),
                "{arch:?} --gpu-layers {layers:?}"
            );
        }
        let none = run(&[("BATON_GPU_ADAPTER", "auto")], &["--backend", "gpu"]);
        let err = String::from_utf8_lossy(&none.stderr);
        if err.contains("no hardware GPU adapter found") {
            assert!(!none.status.success());
            assert!(err.contains("--backend gpu: no GPU to run on"), "{err}");
            let auto = run(&[], &["--backend", "auto"]);
            let err = String::from_utf8_lossy(&auto.stderr);
            assert!(auto.status.success(), "{err}");
            assert!(err.contains("running on the CPU"), "{err}");
            assert_eq!(auto.stdout, cpu.stdout);
        } else {
            println!("this machine has a hardware GPU: the no-GPU errors are not checked here");
        }
    }
}

/// GPU-prefill → CPU-decode and CPU-prefill → GPU-decode, through a real prefill node and the KV stream: the same
/// logits (within 1e-3 of their scale: the backends' f32 summation order) and greedy tokens as one CPU session
/// alone, for full and partial offload; for the tiny llama and gemma3 and the generated phi3 (fused projections) and
/// deepseek2 (latent attention: K heads of 48 and V heads of 24 cross in the stream).
#[test]
fn handoff_between_backends_gives_the_local_output() {
    let Some(gpu) = software_gpu() else { return };
    let dir = tempfile::tempdir().unwrap();
    let on_gpu = Placement::on_gpu(gpu, None);
    let generated = |name: &str| Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/{name}.gguf"));
    let models = [
        (Arch::Llama, tiny(Arch::Llama, dir.path())),
        (Arch::Gemma3, tiny(Arch::Gemma3, dir.path())),
        (Arch::Phi3, generated("phi3")),
        (Arch::Deepseek2, generated("deepseek2")),
    ];
    for (arch, m) in models {
        let n_layer = Model::load(&m).unwrap().hp.n_layer;
        let prompt = prompt(40);
        let mut reference = session(&m, &Placement::cpu());
        let l = reference.eval(&prompt).unwrap().to_vec();
        let want = greedy(&mut reference, &l, 8);
        let gpu_node = NodeProc::try_spawn_in(&ON_GPU, &m, "127.0.0.1:0", &[])
            .unwrap_or_else(|log| panic!("GPU node failed to start:\n{log}"));
        let cpu_node = NodeProc::spawn(&m, "127.0.0.1:0", &[]);
        for (node, decode_on, what) in [
            (&gpu_node, &Placement::cpu(), "GPU prefill, CPU decode"),
            (&cpu_node, &on_gpu, "CPU prefill, GPU decode"),
        ] {
            let mut pn = PrefillNode::new(NodeOpts {
                addr: node.addr.clone(),
                secret: None,
                timeouts: Timeouts {
                    connect: Duration::from_secs(5),
                    io: Duration::from_secs(120),
                },
                kv: RowDtype::F16,
            });
            for k in [n_layer, n_layer / 2] {
                let mut s = session(&m, decode_on);
                let (logits, rep) = prefill_with_fallback(&mut s, Some(&mut pn), &prompt, k).unwrap();
                assert!(rep.fallback.is_none(), "{what}, {k} layers: {rep:?}\n{}", node.log());
                let d = max_abs_diff(&logits, &l);
                let scale = logit_scale(&l);
                assert!(
                    d <= 1e-3 * scale,
                    "{arch:?} {what}, {k} layers: logits differ by {d} of {scale}"
                );
                assert_eq!(greedy(&mut s, &logits, 8), want, "{arch:?} {what}, {k} layers");
            }
        }
        assert!(gpu_node.log().contains("backend: GPU llvmpipe"), "{}", gpu_node.log());
    }
}

/// A two-stage pipeline, the first stage's node on the GPU and the second's on the CPU, and the reverse: the local
/// run's logits and greedy tokens.
#[test]
fn pipeline_with_a_stage_on_each_backend() {
    if software_gpu().is_none() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = tiny(Arch::Gemma3, dir.path());
    let prompt = prompt(40);
    let (ref_logits, ref_toks) = local_reference(&m, &prompt, 8);
    let g = NodeProc::try_spawn_in(&ON_GPU, &m, "127.0.0.1:0", &[])
        .unwrap_or_else(|log| panic!("GPU node failed to start:\n{log}"));
    let c = NodeProc::spawn(&m, "127.0.0.1:0", &[]);
    for spec in [
        format!("{}=0:2,{}=2:end", g.addr, c.addr),
        format!("{}=0:3,{}=3:end", c.addr, g.addr),
    ] {
        let o = pipeline_opts();
        let mut p = PipelineSession::connect(&spec, &m, o).unwrap();
        let logits = p.eval_logits(&prompt).unwrap();
        let d = max_abs_diff(&logits, &ref_logits);
        let scale = logit_scale(&ref_logits);
        assert!(d <= 1e-3 * scale, "{spec}: logits differ by {d} of a scale of {scale}");
        let mut toks = vec![argmax(&logits)];
        while toks.len() < 8 {
            toks.push(p.decode_step(*toks.last().unwrap()).unwrap().token);
        }
        assert_eq!(toks, ref_toks, "{spec}");
    }
}
