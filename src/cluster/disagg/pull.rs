//! Decode on a remote node (protocol 3, PULL): the coordinator names the prefill node, the decode node pulls the KV.

use super::planner::{Job, Offload, Speeds, job_for, learn, plan, probe_local_speed};
use super::pool::{PoolMember, PrefillPool};
use crate::cluster::handoff::{HandoffReport, PrefillNode, prefill_with_fallback};
use crate::cluster::pipeline::{PipelineSession, PullSpec};
use crate::cluster::stage::{Sampled, StageCore};
use crate::cluster::wire::{OFFLOAD_AUTO, Pull, PullReport};
use crate::engine::snapshot::RowDtype;
use crate::kernels::ThreadPool;
use anyhow::{Result, bail};
use std::sync::Arc;
use std::time::Duration;

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
    let model = core.session().model().clone();
    let hp = &model.hp;
    let (pos, n) = (p.pos as usize, p.tokens.len());
    if !model.is_first() || !model.is_last() {
        bail!(
            "layers {:?} are not the whole model: a pulled prefill needs a full-model session",
            model.range
        );
    }
    if n == 0 || pos + n >= core.session().n_ctx() {
        bail!(
            "prefill of positions {pos}..{} does not fit the context of {} with room to decode",
            pos + n,
            core.session().n_ctx()
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
    if core.session().tokens().len() != pos {
        bail!("this session does not know the token ids of its first {pos} positions");
    }
    let mut tokens = core.session().tokens().to_vec();
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
            link.request_id = p.request_id.clone();
            link.opts.timeouts.io = Duration::from_millis(p.timeout_ms.clamp(100, 600_000) as u64);
            let job = job_for(core.session(), &tokens, link.opts.kv);
            let (k, why) = if p.offload == OFFLOAD_AUTO {
                if speeds.local.is_none() {
                    speeds.local = Some(probe_local_speed(&model, pool.clone(), core.session().n_batch())?);
                }
                plan(Offload::Auto, speeds, &job)
            } else {
                plan(Offload::Layers(p.offload as usize), speeds, &job)
            };
            (Some(link), k, why)
        }
    };
    let res = prefill_with_fallback(core.session_mut(), link, &tokens, k);
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
