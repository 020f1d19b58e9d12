//! Disaggregated prefill: prompts are prefilled (all or the first `k` layers) on a prefill node and the decode side
//! holds the full KV afterwards and decodes alone. The decode side is this process (`topology::DisaggGenerator`) or
//! a remote node ([`RemotePrefill`] on the coordinator, [`serve_pull`] on the node: protocol 3's PULL). `--offload auto`
//! picks `k` per request from measured speeds; a [`PrefillPool`] picks the least-loaded healthy prefill node.

use super::handoff::{HandoffReport, PrefillNode, prefill_with_fallback};
use super::pipeline::{PipelineSession, PullSpec};
use super::stage::{Sampled, StageCore};
use super::wire::{OFFLOAD_AUTO, Pull, PullReport};
use crate::engine::snapshot::RowDtype;
use crate::engine::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Context, Result, bail};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
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
    let matmul = e * q * dk + e * kv * (dk + dv) + q * dv * e + 3.0 * e * ff;
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
    let hp = &s.model.hp;
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

// ---------------------------------------------------------------------------------------------------------------
// The prefill nodes a decode side may use.

/// One prefill node of a pool.
#[derive(Clone, Debug)]
pub struct PoolMember {
    /// Name in logs and `/metrics` (the cluster file's name, or the address).
    pub name: String,
    pub addr: String,
}

#[derive(Clone, Copy, Debug, Default)]
struct MemberState {
    up: bool,
    busy: usize,
    chosen: u64,
}

/// Called after every prefill that used a member (the server counts choices and bytes per peer with it).
pub type PoolObserver = Box<dyn Fn(&PoolMember, &HandoffReport) + Send + Sync>;

/// Prefill nodes shared by every decode slot of a process: per request the least-loaded healthy one is leased. With
/// a health loop running, a node whose prefill failed is taken out and put back when it accepts connections again;
/// without one (`baton run`), a failure only costs that request its offload.
pub struct PrefillPool {
    pub members: Vec<PoolMember>,
    state: Mutex<Vec<MemberState>>,
    checked: AtomicBool,
    observer: Option<PoolObserver>,
}

/// A prefill node in use by one request; dropping it frees the node's load count.
pub struct Lease {
    pool: Arc<PrefillPool>,
    pub index: usize,
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut st = self.pool.state.lock().unwrap_or_else(|p| p.into_inner());
        st[self.index].busy = st[self.index].busy.saturating_sub(1);
    }
}

/// The policy, a pure function: among healthy nodes the least busy; among those the one this decode slot used last
/// (its session there already holds the conversation), then the one chosen least often (spreads idle traffic).
pub fn choose_prefill(up_busy_chosen: &[(bool, usize, u64)], prefer: Option<usize>) -> Option<usize> {
    up_busy_chosen
        .iter()
        .enumerate()
        .filter(|(_, m)| m.0)
        .min_by_key(|&(i, m)| (m.1, Some(i) != prefer, m.2, i))
        .map(|(i, _)| i)
}

impl PrefillPool {
    pub fn new(members: Vec<PoolMember>, observer: Option<PoolObserver>) -> Arc<PrefillPool> {
        let state = vec![
            MemberState {
                up: true,
                ..Default::default()
            };
            members.len()
        ];
        Arc::new(PrefillPool {
            members,
            state: Mutex::new(state),
            checked: AtomicBool::new(false),
            observer,
        })
    }

    /// A pool from `--prefill-node HOST:PORT[,HOST:PORT...]`, each node named by its address.
    pub fn from_list(list: &str) -> Result<Arc<PrefillPool>> {
        let members: Vec<PoolMember> = list
            .split(',')
            .map(str::trim)
            .filter(|a| !a.is_empty())
            .map(|a| PoolMember {
                name: a.to_string(),
                addr: a.to_string(),
            })
            .collect();
        if members.is_empty() || members.iter().any(|m| !m.addr.contains(':')) {
            bail!("--prefill-node {list:?} must be HOST:PORT[,HOST:PORT...]");
        }
        Ok(PrefillPool::new(members, None))
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Vec<MemberState>> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases the node for one request; `None` when every node is out.
    pub fn pick(self: &Arc<Self>, prefer: Option<usize>) -> Option<Lease> {
        let mut st = self.lock();
        let view: Vec<_> = st.iter().map(|m| (m.up, m.busy, m.chosen)).collect();
        let i = choose_prefill(&view, prefer)?;
        st[i].busy += 1;
        st[i].chosen += 1;
        Some(Lease {
            pool: self.clone(),
            index: i,
        })
    }

    pub fn is_up(&self, i: usize) -> bool {
        self.lock()[i].up
    }

    fn set_up(&self, i: usize, up: bool, why: &str) {
        let mut st = self.lock();
        if st[i].up != up {
            st[i].up = up;
            eprintln!(
                "prefill node {} ({}) is {}{why}",
                self.members[i].name,
                self.members[i].addr,
                if up { "back up" } else { "out: " }
            );
        }
    }

    /// What a prefill on member `i` did: a fallback takes the node out (when health checks can put it back).
    pub fn report(&self, i: usize, rep: &HandoffReport) {
        if let Some(why) = &rep.fallback
            && self.checked.load(Ordering::Relaxed)
        {
            self.set_up(i, false, why);
        }
        if let Some(f) = &self.observer {
            f(&self.members[i], rep);
        }
    }

    /// Checks every member once per `every` (a TCP connect within a second); ends when the pool is dropped.
    pub fn health_loop(self: &Arc<Self>, every: Duration) {
        self.checked.store(true, Ordering::Relaxed);
        let weak = Arc::downgrade(self);
        let targets = self.members.iter().map(|m| m.addr.clone()).enumerate().collect();
        let res = super::health::spawn_loop("prefill-health", targets, every, move |i, r| {
            let Some(pool) = weak.upgrade() else { return false };
            match r {
                Ok(()) => pool.set_up(i, true, ""),
                Err(e) => pool.set_up(i, false, &format!("{e:#}")),
            }
            true
        });
        if let Err(e) = res {
            eprintln!("cannot start the prefill pool's health checks: {e:#}");
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Decode on a remote node (protocol 3, PULL): the coordinator names the prefill node, the decode node pulls the KV.

/// Layers to offload as PULL carries them.
pub fn offload_on_wire(offload: Offload, n_layer: usize) -> u32 {
    match offload {
        Offload::Auto => OFFLOAD_AUTO,
        o => {
            plan(
                o,
                &Speeds::default(),
                &Job {
                    n_layer,
                    start: 0,
                    n: 1,
                    catch_up: 0,
                    chunk: 1,
                    kv_bytes: 0.0,
                    hidden_bytes: 0.0,
                },
            )
            .0 as u32
        }
    }
}

/// The coordinator's side when the decode node is remote: per request, lease the least-loaded prefill node and have
/// the decode node pull the prompt's KV from it (the pipeline's single full-model stage runs the handoff).
#[derive(Clone)]
pub struct RemotePrefill {
    pub pool: Arc<PrefillPool>,
    pub offload: Offload,
    pub kv: RowDtype,
    /// The decode node's deadline for each wait on the prefill node.
    pub timeout: Duration,
    last: Option<usize>,
}

impl RemotePrefill {
    pub fn new(pool: Arc<PrefillPool>, offload: Offload, kv: RowDtype, timeout: Duration) -> RemotePrefill {
        RemotePrefill {
            pool,
            offload,
            kv,
            timeout,
            last: None,
        }
    }

    /// Appends `new` to `p` with a pulled prefill and samples the first token; returns it and the `-v` lines. With
    /// every prefill node out, the decode node prefills alone (an ordinary FORWARD).
    pub fn eval(&mut self, p: &mut PipelineSession, new: &[u32]) -> Result<(Sampled, Vec<String>)> {
        let Some(lease) = self.pool.pick(self.last) else {
            let s = p.eval(new)?;
            return Ok((s, vec!["prefill: on the decode node (no prefill node is up)".into()]));
        };
        let i = lease.index;
        let member = &self.pool.members[i];
        let spec = PullSpec {
            addr: member.addr.clone(),
            offload: offload_on_wire(self.offload, p.hparams().n_layer),
            kv: self.kv,
            timeout: self.timeout,
        };
        let (s, report) = p.eval_pulled(new, &spec)?;
        drop(lease);
        let rep = HandoffReport::from_wire(&report);
        self.pool.report(i, &rep);
        if rep.layers > 0 {
            self.last = Some(i);
        }
        let mut lines = vec![format!(
            "plan (decode node): {} with prefill node {}",
            report.plan, member.name
        )];
        lines.extend(rep.lines());
        Ok((s, lines))
    }

    /// The last request's prefill node, if it was offloaded to one.
    pub fn last(&self) -> Option<&PoolMember> {
        self.last.map(|i| &self.pool.members[i])
    }
}

/// What a decode node answers a PULL with.
pub enum Pulled {
    /// It does not hold the prefix the request builds on (it holds this many positions).
    Mismatch(usize),
    Done {
        report: PullReport,
        sample: Sampled,
        compute_us: u64,
    },
}

/// Serves one PULL on a decode node's full-model session: pulls the KV of `tokens` from the prefill node through
/// `link` (exactly as `topology::DisaggGenerator` does locally, with the same fallback), then samples the first token.
/// `speeds` are this node's measurements for that prefill node (`auto`). No `link` means the PULL named this node
/// itself as the prefill node: it prefills here (pulling from itself would wait on its own compute lock).
pub fn serve_pull(
    core: &mut StageCore,
    link: Option<&mut PrefillNode>,
    speeds: &mut Speeds,
    pool: &Arc<ThreadPool>,
    p: &Pull,
) -> Result<Pulled> {
    let model = core.session.model.clone();
    let hp = &model.hp;
    let (pos, n) = (p.pos as usize, p.tokens.len());
    if !model.is_first() || !model.is_last() {
        bail!(
            "layers {:?} are not the whole model: a pulled prefill needs a full-model session",
            model.range
        );
    }
    if n == 0 || pos + n >= core.session.n_ctx() {
        bail!(
            "prefill of positions {pos}..{} does not fit the context of {} with room to decode",
            pos + n,
            core.session.n_ctx()
        );
    }
    if let Some(&t) = p.tokens.iter().find(|&&t| t as usize >= hp.n_vocab) {
        bail!("token id {t} is outside the vocabulary of {}", hp.n_vocab);
    }
    if p.offload != OFFLOAD_AUTO && p.offload as usize > hp.n_layer {
        bail!("offload of {} layers, the model has {}", p.offload, hp.n_layer);
    }
    if !core.holds_prefix(pos, &p.prefix) {
        return Ok(Pulled::Mismatch(core.n_past()));
    }
    core.rewind(pos);
    if core.session.tokens().len() != pos {
        bail!("this session does not know the token ids of its first {pos} positions");
    }
    let mut tokens = core.session.tokens().to_vec();
    tokens.extend_from_slice(&p.tokens);
    let (link, k, why) = match link {
        // This node was named as its own prefill node: it prefills here.
        None => (
            None,
            0,
            "the prefill node named is this node: prefilled here".to_string(),
        ),
        Some(link) => {
            link.opts.kv = p.kv;
            link.opts.timeouts.io = Duration::from_millis(p.timeout_ms.clamp(100, 600_000) as u64);
            let job = job_for(&core.session, &tokens, link.opts.kv);
            let (k, why) = if p.offload == OFFLOAD_AUTO {
                if speeds.local.is_none() {
                    speeds.local = Some(probe_local_speed(&model, pool.clone(), core.session.n_batch())?);
                }
                plan(Offload::Auto, speeds, &job)
            } else {
                plan(Offload::Layers(p.offload as usize), speeds, &job)
            };
            (Some(link), k, why)
        }
    };
    let res = prefill_with_fallback(&mut core.session, link, &tokens, k);
    let (logits, rep) = match res {
        Ok(r) => r,
        Err(e) => {
            core.rewind(pos);
            return Err(e);
        }
    };
    learn(speeds, &rep);
    core.record(&p.tokens);
    let sample = core.sample_next(&logits);
    Ok(Pulled::Done {
        report: rep.to_wire(p.req, &why),
        sample,
        compute_us: rep.total.as_micros() as u64,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_loaded_healthy_prefill_node_wins() {
        // (up, busy, chosen before)
        let v = [(true, 1, 0), (true, 0, 5), (true, 0, 2), (false, 0, 0)];
        assert_eq!(
            choose_prefill(&v, None),
            Some(2),
            "idle, chosen least often; the down node never"
        );
        assert_eq!(
            choose_prefill(&v, Some(1)),
            Some(1),
            "among the idle ones, the one holding the conversation"
        );
        assert_eq!(choose_prefill(&v, Some(0)), Some(2), "a busier preferred node loses");
        assert_eq!(choose_prefill(&[(false, 0, 0)], None), None);
    }

    #[test]
    fn pool_leases_spread_and_fallbacks_take_a_node_out() {
        let pool = PrefillPool::new(
            vec![
                PoolMember {
                    name: "p1".into(),
                    addr: "127.0.0.1:1".into(),
                },
                PoolMember {
                    name: "p2".into(),
                    addr: "127.0.0.1:2".into(),
                },
            ],
            None,
        );
        let a = pool.pick(None).unwrap();
        let b = pool.pick(None).unwrap();
        assert_ne!(
            a.index, b.index,
            "a busy node is not leased twice while another is idle"
        );
        drop((a, b));
        let failed = HandoffReport {
            fallback: Some("closed".into()),
            ..Default::default()
        };
        pool.report(0, &failed);
        assert!(
            pool.is_up(0),
            "without health checks nothing can put it back, so it stays in"
        );
        pool.checked.store(true, Ordering::Relaxed);
        pool.report(0, &failed);
        assert!(!pool.is_up(0));
        assert_eq!(pool.pick(Some(0)).unwrap().index, 1);
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
