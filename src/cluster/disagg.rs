//! The disaggregated generator: prompts are prefilled (all or the first `k` layers) on a prefill node, this process
//! holds the full KV afterwards and decodes alone. `--offload auto` picks `k` per request from measured speeds.

use super::handoff::{HandoffReport, NodeOpts, PrefillNode, prefill_with_fallback};
use crate::engine::sampler::Sampler;
use crate::engine::{Input, Session, Want};
use crate::generate::{GenParams, Generator, Outcome, Piece, Prompt, TextModel, check_fits, decode_loop};
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
    /// Whole-model prefill tokens/s here.
    pub local: Option<f64>,
    /// Whole-model prefill tokens/s on the prefill node.
    pub remote: Option<f64>,
    /// Highest link rate seen during a handoff, bytes/s (a lower bound of the link's capacity).
    pub link: Option<f64>,
    /// Fixed cost of a remote prefill (request round trip, stream start).
    pub overhead: Duration,
}

/// The shape of one prefill, as the planner sees it.
#[derive(Clone, Copy, Debug)]
pub struct Job {
    pub n_layer: usize,
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

/// Estimated prefill time with `k` layers remote. The three stages (remote compute, link, local layers) overlap chunk
/// by chunk, so the slowest dominates and the others add about one chunk's worth.
pub fn estimate(sp: &Speeds, k: usize, j: &Job) -> Option<f64> {
    let Job {
        n_layer,
        n,
        catch_up,
        chunk,
        kv_bytes,
        hidden_bytes,
    } = *j;
    let local = sp.local?;
    let f = k as f64 / n_layer as f64;
    let local_part = n as f64 * (1.0 - f) / local;
    if k == 0 {
        return Some(n as f64 / local);
    }
    let remote = (n + catch_up) as f64 * f / sp.remote?;
    let bytes = n as f64 * (k as f64 * kv_bytes + if k < n_layer { hidden_bytes } else { 0.0 });
    let link = bytes / sp.link.unwrap_or(f64::INFINITY);
    let parts = [remote, link, local_part];
    let max = parts.iter().cloned().fold(0.0, f64::max);
    let sum: f64 = parts.iter().sum();
    let share = (chunk.min(n) as f64 / n.max(1) as f64).min(1.0);
    Some(sp.overhead.as_secs_f64() + max + (sum - max) * share)
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
    if rep.layers == 0 {
        // Only a prompt long enough to be representative updates the local speed.
        if n >= 64 && rep.local > Duration::ZERO {
            sp.local = blend(sp.local, n as f64 / rep.local.as_secs_f64());
        }
        return;
    }
    let f = rep.layers as f64 / rep.n_layer as f64;
    let computed = (rep.sent + rep.catch_up) as f64;
    if computed >= 64.0 && rep.remote > Duration::ZERO {
        sp.remote = blend(sp.remote, computed * f / rep.remote.as_secs_f64());
    }
    if rep.layers < rep.n_layer && n >= 64 && rep.local > Duration::ZERO {
        sp.local = blend(sp.local, n as f64 * (1.0 - f) / rep.local.as_secs_f64());
    }
    if rep.link_rate.is_finite() && rep.bytes > 1 << 20 {
        sp.link = Some(sp.link.map_or(rep.link_rate, |l| l.max(rep.link_rate)));
    }
    sp.overhead = rep.connect.min(Duration::from_millis(50)) + Duration::from_millis(1);
}

/// `baton run --prefill-node`: a full model here, prompts prefilled on a node.
pub struct DisaggGenerator {
    pub model: Arc<Model>,
    pub text: TextModel,
    pub session: Session,
    pub node: PrefillNode,
    pub offload: Offload,
    pub speeds: Speeds,
}

impl DisaggGenerator {
    /// Loads nothing remote yet: the node is connected on the first request (and again after any failure). With
    /// `auto`, the local prefill speed is measured once here on a 128-token batch.
    pub fn new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        n_ctx: usize,
        n_batch: usize,
        node: NodeOpts,
        offload: Offload,
    ) -> Result<DisaggGenerator> {
        let text = TextModel::from_gguf(&model.file)?;
        let n_ctx = n_ctx.min(model.hp.n_ctx_train.max(1));
        let mut session = Session::new(model.clone(), pool, n_ctx, n_batch)?;
        let mut speeds = Speeds::default();
        if offload == Offload::Auto {
            let n = 128.min(n_batch).min(n_ctx - 1);
            let probe: Vec<u32> = (0..n as u32).map(|i| 100 + i % 500).collect();
            let t0 = Instant::now();
            session.forward(Input::Tokens(&probe), Want::Hidden)?;
            speeds.local = Some(n as f64 / t0.elapsed().as_secs_f64());
            session.rewind(0);
        }
        Ok(DisaggGenerator {
            model,
            text,
            session,
            node: PrefillNode::new(node),
            offload,
            speeds,
        })
    }

    /// Layers to offload for `tokens` and the reason.
    fn choose(&self, tokens: &[u32]) -> (usize, String) {
        let hp = &self.model.hp;
        let held = {
            let t = &self.session.tokens()[..self.session.tokens().len().min(self.session.n_past())];
            t.iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(tokens.len() - 1)
        };
        let n = tokens.len() - held;
        let el = match self.node.opts.kv {
            crate::engine::snapshot::KvDtype::F32 => 4.0,
            crate::engine::snapshot::KvDtype::Q8 => 1.0 + 8.0 / hp.head_dim_k as f64,
            _ => 2.0,
        };
        let kv_bytes = (hp.n_head_kv * (hp.head_dim_k + hp.head_dim_v)) as f64 * el;
        let hidden_bytes = hp.n_embd as f64 * 4.0;
        let job = Job {
            n_layer: hp.n_layer,
            n,
            catch_up: 0,
            chunk: self.session.n_batch(),
            kv_bytes,
            hidden_bytes,
        };
        plan(self.offload, &self.speeds, &job)
    }
}

impl Generator for DisaggGenerator {
    fn render(&self, prompt: &Prompt) -> Result<String> {
        self.text.render(prompt)
    }

    fn describe(&self) -> String {
        format!("{}, prefill on {}", self.text.name(), self.node.opts.addr)
    }

    fn n_ctx(&self) -> usize {
        self.session.n_ctx()
    }

    fn count_prompt(&self, prompt: &Prompt) -> Result<usize> {
        Ok(self.text.tokenize(prompt)?.len())
    }

    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome> {
        let tokens = self.text.tokenize(prompt)?;
        check_fits(tokens.len(), self.n_ctx())?;
        let t0 = Instant::now();
        let mut sampler = Sampler::new(params.sampler.clone(), self.model.hp.n_vocab);
        for &t in &tokens {
            sampler.accept(t);
        }
        let (k, why) = self.choose(&tokens);
        let (logits, rep) = prefill_with_fallback(&mut self.session, Some(&mut self.node), &tokens, k)?;
        learn(&mut self.speeds, &rep);
        let top_k = params.top_logprobs;
        let text = &self.text;
        let pick = |sampler: &mut Sampler, logits: &[f32]| text.pick(sampler, logits, top_k);
        let ts = Instant::now();
        let first = pick(&mut sampler, &logits);
        let t_sample = ts.elapsed();
        let t_prompt = t0.elapsed();
        let t1 = Instant::now();
        let session = &mut self.session;
        let mut first_step: Option<Duration> = None;
        let (n_gen, finish) = decode_loop(&text.vocab, first, params.max_tokens, sink, |tok| {
            sampler.accept(tok);
            if session.n_past() + 1 >= session.n_ctx() {
                return Ok(None);
            }
            let ts = Instant::now();
            let logits = session.forward(Input::Tokens(&[tok]), Want::LastLogits)?;
            let next = pick(&mut sampler, logits);
            first_step.get_or_insert(ts.elapsed());
            Ok(Some(next))
        })?;
        let mut detail = vec![format!("plan: {why}")];
        detail.extend(rep.lines());
        detail.push(format!(
            "ttft: {:.1} ms = prefill {:.1} ms + first sample {:.2} ms; first decode step {:.1} ms",
            t_prompt.as_secs_f64() * 1e3,
            rep.total.as_secs_f64() * 1e3,
            t_sample.as_secs_f64() * 1e3,
            first_step.unwrap_or_default().as_secs_f64() * 1e3
        ));
        Ok(Outcome {
            prompt_tokens: tokens.len(),
            cached_tokens: rep.held,
            completion_tokens: n_gen,
            finish,
            t_prompt,
            t_gen: t1.elapsed(),
            detail,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
}
