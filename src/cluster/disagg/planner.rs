//! The offload planner: how many layers of a prompt to prefill remotely (`--offload`), from measured speeds.

use crate::cluster::handoff::HandoffReport;
use crate::engine::snapshot::RowDtype;
use crate::engine::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Context, Result, bail};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// How much of a prompt to prefill remotely (`--offload`, `--offload-layers`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Offload {
    /// Decide per request from measured speeds.
    Auto,
    Never,
    /// All layers.
    Always,
    /// This fraction of the layers (rounded), `0.0..=1.0`.
    Fraction(f32),
    /// Exactly this many layers (`--offload-layers K`).
    Layers(usize),
}

impl Offload {
    /// `auto`, `never`, `always` or a percentage such as `60%`.
    pub fn parse(s: &str) -> Result<Offload> {
        Ok(match s {
            "auto" => Offload::Auto,
            "never" => Offload::Never,
            "always" => Offload::Always,
            p if p.ends_with('%') => {
                let v: f32 = p[..p.len() - 1]
                    .trim()
                    .parse()
                    .with_context(|| format!("bad offload percentage {p:?}"))?;
                if !(0.0..=100.0).contains(&v) {
                    bail!("offload percentage {v} is outside 0..100");
                }
                Offload::Fraction(v / 100.0)
            }
            other => bail!("unknown --offload {other:?} (auto, never, always or a percentage like 60%)"),
        })
    }
}

/// What the planner knows: speeds measured on this machine, the prefill node and the link, updated by every request.
#[derive(Clone, Debug, Default)]
pub struct Speeds {
    /// Whole-model prefill speed here, in work units/s ([`work`]: one unit is one token's matmuls, so this is
    /// tokens/s at the start of a context).
    pub local: Option<f64>,
    /// The same on the prefill node.
    pub remote: Option<f64>,
    /// Highest link rate seen during a handoff, bytes/s (a lower bound of the link's capacity).
    pub link: Option<f64>,
    /// Fixed cost of a remote prefill (request round trip, stream start).
    pub overhead: Duration,
    /// The model's attention cost per cached position relative to one token's matmuls ([`attn_ratio`]); 0 treats
    /// every token alike.
    pub attn: f64,
    /// How far the local layers of a partial offload really run beside the node's (1: fully, as on two machines;
    /// 0: not at all, as when both share the same cores), learned from partial offloads; `None` assumes 1.
    pub overlap: Option<f64>,
}

impl Speeds {
    /// Nothing measured yet, for `hp`'s cost model.
    pub fn for_model(hp: &crate::model::Hparams) -> Speeds {
        Speeds {
            attn: attn_ratio(hp),
            ..Default::default()
        }
    }
}

/// Attention FLOPs of one query against one cached position, relative to the matmul FLOPs of one token: a prompt's
/// cost grows with its length (a 4k-token prompt costs far more than 8 × 512 tokens), and the planner compares
/// prompts of every length with speeds measured on others. Sliding-window layers are counted as free (their
/// attention stops growing at the window).
pub fn attn_ratio(hp: &crate::model::Hparams) -> f64 {
    let (e, q, kv) = (hp.n_embd as f64, hp.n_head as f64, hp.n_head_kv as f64);
    let (dk, dv, ff) = (hp.head_dim_k as f64, hp.head_dim_v as f64, hp.n_ff as f64);
    // A mixture's token runs its router, its k experts and the shared ones, not every expert.
    let ffn = match &hp.moe {
        Some(m) => 3.0 * e * ((m.n_expert_used + m.routing.n_shared) * m.n_ff_exp) as f64 + e * m.n_expert as f64,
        None => 3.0 * e * ff,
    };
    let matmul = e * q * dk + e * kv * (dk + dv) + q * dv * e + ffn;
    let attention = q * (dk + dv);
    let global = (0..hp.n_layer).filter(|&il| hp.window(il).is_none()).count() as f64 / hp.n_layer.max(1) as f64;
    ATTN_SLOWER * attention * global / matmul
}

/// Attention runs in f32 (16 multiply-adds per instruction), the quantized matmuls on 8-bit integers (64 per
/// instruction): per FLOP attention costs about 3× more. Measured: with this factor SmolLM2's node spent the same
/// time per work unit on 2048- and 4096-token prompts (1087 and 1070 units/s); with 1 it looked 20% slower on the
/// longer one.
const ATTN_SLOWER: f64 = 3.0;

/// Work of computing `n` tokens at positions `start..start + n`, in tokens at position 0.
pub fn work(attn: f64, start: usize, n: usize) -> f64 {
    let (s, n) = (start as f64, n as f64);
    n + attn * (n * s + n * (n - 1.0).max(0.0) / 2.0)
}

/// The shape of one prefill, as the planner sees it.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    pub n_layer: usize,
    /// Positions the decode side already holds: the new tokens start there.
    pub start: usize,
    /// New tokens (their KV crosses the wire).
    pub n: usize,
    /// Tokens the node must recompute without sending (multi-turn catch-up).
    pub catch_up: usize,
    /// Tokens per chunk.
    pub chunk: usize,
    /// KV bytes per token and layer on the wire.
    pub kv_bytes: f64,
    /// Hidden-state bytes per token (partial offload).
    pub hidden_bytes: f64,
}

/// Estimated prefill time with `k` layers remote. The node sends each layer's KV of a chunk as soon as that layer is
/// computed, so remote compute and the link overlap layer by layer (even within one chunk): the slower dominates and
/// the other adds one layer-chunk's worth. The local layers of a chunk wait for its hidden state, so they overlap
/// that stream only chunk by chunk (a single-chunk prompt runs them after it).
pub fn estimate(sp: &Speeds, k: usize, j: &Job) -> Option<f64> {
    let Job {
        n_layer,
        start,
        n,
        catch_up,
        chunk,
        kv_bytes,
        hidden_bytes,
    } = *j;
    let local = sp.local?;
    let f = k as f64 / n_layer as f64;
    let new_work = work(sp.attn, start, n);
    let local_part = new_work * (1.0 - f) / local;
    if k == 0 {
        return Some(new_work / local);
    }
    let remote = work(sp.attn, start.saturating_sub(catch_up), n + catch_up) * f / sp.remote?;
    let bytes = n as f64 * (k as f64 * kv_bytes + if k < n_layer { hidden_bytes } else { 0.0 });
    let link = bytes / sp.link.unwrap_or(f64::INFINITY);
    let chunks = n.div_ceil(chunk.max(1)).max(1);
    let stream = remote.max(link) + remote.min(link) / (chunks * k) as f64;
    let share = 1.0 / chunks as f64;
    let ov = sp.overlap.unwrap_or(1.0);
    let serial = share + (1.0 - share) * (1.0 - ov);
    Some(sp.overhead.as_secs_f64() + stream.max(local_part) + stream.min(local_part) * serial)
}

/// The planner's choice for one request: layers to offload and why.
pub fn plan(offload: Offload, sp: &Speeds, j: &Job) -> (usize, String) {
    let n_layer = j.n_layer;
    match offload {
        Offload::Never => (0, "offload never".into()),
        Offload::Always => (n_layer, "offload always".into()),
        Offload::Layers(k) => (k.min(n_layer), format!("offload {k} layers")),
        Offload::Fraction(f) => {
            let k = ((f * n_layer as f32).round() as usize).min(n_layer);
            (k, format!("offload {:.0}% = {k} layers", f * 100.0))
        }
        Offload::Auto => {
            if sp.remote.is_none() || sp.local.is_none() {
                // Nothing measured yet: a full offload measures the node and the link.
                return (
                    n_layer,
                    "auto: first request, full offload to measure the prefill node".into(),
                );
            }
            let steps = 8;
            let mut best = (0, f64::INFINITY);
            let mut all = Vec::new();
            for i in 0..=steps {
                let k = n_layer * i / steps;
                let t = estimate(sp, k, j).unwrap();
                all.push(format!("{k}:{:.0}ms", t * 1e3));
                if t < best.1 {
                    best = (k, t);
                }
            }
            (
                best.0,
                format!(
                    "auto: {} layers (est. {:.0} ms; local {:.0} tok/s, node {:.0} tok/s, link {:.0} MB/s; {})",
                    best.0,
                    best.1 * 1e3,
                    sp.local.unwrap(),
                    sp.remote.unwrap(),
                    sp.link.unwrap_or(f64::INFINITY) / 1e6,
                    all.join(" ")
                ),
            )
        }
    }
}

/// Folds one request's measurements into the planner's speeds.
pub fn learn(sp: &mut Speeds, rep: &HandoffReport) {
    let blend = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| 0.5 * o + 0.5 * new));
    let n = rep.prompt - rep.held;
    let new_work = work(sp.attn, rep.held, n);
    if rep.layers == 0 {
        // Only a prompt long enough to be representative updates the local speed.
        if n >= 64 && rep.local > Duration::ZERO {
            sp.local = blend(sp.local, new_work / rep.local.as_secs_f64());
        }
        return;
    }
    let f = rep.layers as f64 / rep.n_layer as f64;
    let computed = rep.sent + rep.catch_up;
    let remote_work = work(sp.attn, rep.held.saturating_sub(rep.catch_up), computed) * f;
    let partial = rep.layers < rep.n_layer;
    // The node's speed comes from full offloads, this side's from local prefills: during a partial offload both
    // sides compute at once, and where they share cores (one machine emulating two) each runs slower than alone.
    if computed >= 64 && rep.remote > Duration::ZERO && (!partial || sp.remote.is_none()) {
        sp.remote = blend(sp.remote, remote_work / rep.remote.as_secs_f64());
    }
    if partial && n >= 64 && rep.local > Duration::ZERO {
        let local_work = new_work * (1.0 - f);
        if sp.local.is_none() {
            sp.local = Some(local_work / rep.local.as_secs_f64());
        }
        // How much the two sides really overlapped, judged against their speeds alone: total = max + min · (share +
        // (1 - share)(1 - overlap)), share being the one chunk that cannot overlap. Only several chunks tell.
        let chunks = if rep.chunk > 0 { n.div_ceil(rep.chunk) } else { 0 };
        if let (Some(rs), Some(ls), true) = (sp.remote, sp.local, chunks >= 2) {
            let (r, l) = (remote_work / rs, local_work / ls);
            let share = 1.0 / chunks as f64;
            let serial = (rep.total.as_secs_f64() - r.max(l)) / r.min(l).max(1e-9);
            let ov = (1.0 - (serial - share) / (1.0 - share)).clamp(0.0, 1.0);
            sp.overlap = blend(sp.overlap, ov);
        }
    }
    if rep.link_rate.is_finite() && rep.bytes > 1 << 20 {
        sp.link = Some(sp.link.map_or(rep.link_rate, |l| l.max(rep.link_rate)));
    }
    sp.overhead = rep.connect.min(Duration::from_millis(50)) + Duration::from_millis(1);
}

/// Measures this machine's whole-model prefill speed (work units/s, see [`Speeds::local`]) on a 128-token batch in a
/// scratch session, for the `auto` planner.
pub fn probe_local_speed(model: &Arc<Model>, pool: Arc<ThreadPool>, n_batch: usize) -> Result<f64> {
    let n = 128.min(n_batch).max(1);
    let mut s = Session::new(model.clone(), pool, n + 1, n)?;
    let probe: Vec<u32> = (0..n as u32).map(|i| 100 + i % 500).collect();
    let t0 = Instant::now();
    s.forward(Input::Tokens(&probe), Want::Hidden)?;
    Ok(work(attn_ratio(&model.hp), 0, n) / t0.elapsed().as_secs_f64())
}

/// The planner's view of prefilling `tokens` into `s`: the tokens not already held, the chunk size and the bytes per
/// token that would cross the wire at `kv` precision.
pub fn job_for(s: &Session, tokens: &[u32], kv: RowDtype) -> Job {
    let hp = &s.model().hp;
    let held = s.tokens()[..s.tokens().len().min(s.n_past())]
        .iter()
        .zip(tokens)
        .take_while(|(a, b)| a == b)
        .count()
        .min(tokens.len().saturating_sub(1));
    let el = match kv {
        RowDtype::F32 => 4.0,
        RowDtype::Q8 => 1.0 + 8.0 / hp.head_dim_k as f64,
        _ => 2.0,
    };
    Job {
        n_layer: hp.n_layer,
        start: held,
        n: tokens.len() - held,
        catch_up: 0,
        chunk: s.n_batch(),
        kv_bytes: (hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v)) as f64 * el,
        hidden_bytes: hp.n_embd as f64 * 4.0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A MoE model's matmul work per token is its active experts': the generated qwen3moe (n_ff 128 dense-sized,
    /// 2 of 8 experts of width 32) counts 2 × 32 of feed-forward, not n_ff.
    #[test]
    fn moe_work_counts_the_active_experts() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/qwen3moe.gguf");
        let hp = crate::model::Hparams::from_gguf(&crate::gguf::GgufFile::open(&path).unwrap()).unwrap();
        let m = hp.moe.clone().unwrap();
        let (e, q, kv, dk, dv) = (64.0, 4.0, 2.0, 32.0, 32.0);
        let matmul = e * q * dk + e * kv * (dk + dv) + q * dv * e + 3.0 * e * 64.0 + e * 8.0;
        assert_eq!((m.n_expert_used * m.n_ff_exp, m.n_expert), (64, 8));
        let want = ATTN_SLOWER * q * (dk + dv) / matmul;
        assert!((attn_ratio(&hp) - want).abs() < 1e-12, "{} vs {want}", attn_ratio(&hp));
    }

    #[test]
    fn offload_parses() {
        assert_eq!(Offload::parse("auto").unwrap(), Offload::Auto);
        assert_eq!(Offload::parse("60%").unwrap(), Offload::Fraction(0.6));
        assert!(Offload::parse("160%").is_err());
        assert!(Offload::parse("most").is_err());
    }

    fn job(n_layer: usize, n: usize) -> Job {
        Job {
            n_layer,
            start: 0,
            n,
            catch_up: 0,
            chunk: 512,
            kv_bytes: 1536.0,
            hidden_bytes: 2304.0,
        }
    }

    #[test]
    fn auto_offloads_to_a_faster_node_and_not_to_a_slow_one() {
        let mut sp = Speeds {
            local: Some(100.0),
            remote: Some(1000.0),
            link: Some(1e9),
            overhead: Duration::from_millis(2),
            attn: 0.0,
            overlap: None,
        };
        let (k, _) = plan(Offload::Auto, &sp, &job(30, 2000));
        assert_eq!(k, 30, "a 10x faster node and a fast link: offload everything");
        sp.remote = Some(5.0);
        let (k, _) = plan(Offload::Auto, &sp, &job(30, 2000));
        assert_eq!(k, 0, "a much slower node: keep it local");
        // A node half as fast still helps: a few layers there run beside the rest here.
        sp.remote = Some(50.0);
        let (k, _) = plan(Offload::Auto, &sp, &job(32, 2000));
        assert!(k > 0 && k <= 12, "{k}");
        // Equal speeds: splitting the layers overlaps the two machines.
        sp.remote = Some(100.0);
        let (k, _) = plan(Offload::Auto, &sp, &job(32, 4000));
        assert!(k > 0 && k < 32, "{k}");
        // A slow link makes shipping all KV too costly.
        sp.remote = Some(1000.0);
        sp.link = Some(1e5);
        let (k, _) = plan(Offload::Auto, &sp, &job(30, 2000));
        assert_eq!(k, 0);
    }

    /// Speeds learned on one prompt length predict another: a prompt's attention grows with its length, so a
    /// speed measured on 4096 tokens (slow per token) must not make a 512-token prompt look slow, and the time of the
    /// measured prompt itself comes back exactly.
    #[test]
    fn speeds_carry_across_prompt_lengths() {
        let mut sp = Speeds {
            attn: 3.26e-4, // SmolLM2-135M
            ..Default::default()
        };
        let rep = HandoffReport {
            prompt: 4096,
            n_layer: 30,
            local: Duration::from_secs(40),
            ..Default::default()
        };
        learn(&mut sp, &rep);
        let at = |n| estimate(&sp, 0, &Job { n, ..job(30, n) }).unwrap();
        assert!((at(4096) - 40.0).abs() < 1e-6);
        assert!(
            at(512) < 40.0 / 8.0 * 0.7,
            "512 tokens: {} s (linear would be 5)",
            at(512)
        );
        assert!((work(0.0, 100, 10) - 10.0).abs() < 1e-12, "no attention term: tokens");
        assert!(
            (work(1e-3, 1000, 1) - 2.0).abs() < 1e-12,
            "one token at 1000: its matmuls plus 1000 positions"
        );
    }

    /// Two processes on the same cores do not run side by side: a partial offload there took remote + local time.
    /// Learning that from one such run makes the planner stop splitting layers and send the whole prompt to the
    /// faster node.
    #[test]
    fn partial_offload_that_did_not_overlap_teaches_the_planner() {
        let mut sp = Speeds {
            local: Some(400.0),
            remote: Some(600.0),
            link: Some(1e9),
            ..Default::default()
        };
        let j = Job {
            n: 2048,
            ..job(30, 2048)
        };
        let (k, why) = plan(Offload::Auto, &sp, &j);
        assert!(k > 0 && k < 30, "side by side, splitting wins: {why}");
        let rep = HandoffReport {
            layers: 15,
            n_layer: 30,
            prompt: 2048,
            sent: 2048,
            remote: Duration::from_secs_f64(1024.0 / 600.0),
            local: Duration::from_secs_f64(1024.0 / 400.0),
            total: Duration::from_secs_f64(1024.0 / 600.0 + 1024.0 / 400.0),
            chunk: 512,
            ..Default::default()
        };
        learn(&mut sp, &rep);
        assert!(sp.overlap.unwrap() < 0.05, "{:?}", sp.overlap);
        let (k, why) = plan(Offload::Auto, &sp, &j);
        assert_eq!(k, 30, "{why}");
    }

    /// Measured on the emulated 2.5 GbE link (docs/disaggregation.md): a 512-token prompt in one chunk, this side
    /// 253 tok/s, the node 433 tok/s, 24 MB/s seen on the link (the node's production rate). Full offload took
    /// 1351 ms, half 1657 ms, local 2042 ms. The KV leaves layer by layer while the node computes, so even one chunk
    /// overlaps compute and link; the estimate that summed them (2207 ms for full) kept this prompt local.
    #[test]
    fn one_chunk_still_overlaps_compute_and_link() {
        let sp = Speeds {
            local: Some(253.0),
            remote: Some(433.0),
            link: Some(24e6),
            overhead: Duration::from_millis(1),
            attn: 0.0,
            overlap: None,
        };
        let j = Job {
            n_layer: 30,
            start: 0,
            n: 512,
            catch_up: 0,
            chunk: 512,
            kv_bytes: 1536.0,
            hidden_bytes: 2304.0,
        };
        let (k, why) = plan(Offload::Auto, &sp, &j);
        assert_eq!(k, 30, "{why}");
        for (k, measured) in [(0, 2.042), (15, 1.657), (30, 1.351)] {
            let est = estimate(&sp, k, &j).unwrap();
            assert!(
                (est / measured - 1.0).abs() < 0.15,
                "{k} layers: est {est:.3} s, measured {measured} s"
            );
        }
    }
}
