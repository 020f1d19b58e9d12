//! The coordinator's side of `--experts-split HOST:PORT`: the seed's "vertical split" of a mixture-of-experts model.
//! Both processes hold the whole model. For every MoE layer this process routes the batch, sends the node the rows
//! and the picks of about half of the picked experts (EXPERTS), computes the other half while the node works, and
//! adds the node's weighted outputs (EXPERTS_OUT) in each row's top-k order: at 32 bits the result has the bits of
//! one process alone. Attention, the router and everything dense run here only. The split itself is
//! `model::moe::ffn`'s; this file is the connection.
//!
//! A node that fails (an error, a timeout, a closed connection) is reported once, its share of the experts runs here
//! from then on, and it is tried again after [`RETRY`]: the request goes on, slower, with the same output.

use super::handshake::{self, Conn, Timeouts};
use super::wire::{Experts, Hidden, ModelInfo, Msg, Open};
use crate::engine::placement;
use crate::engine::snapshot::RowDtype;
use crate::model::Model;
use crate::model::blocks::LAYER_SLICE;
use crate::model::moe::{Pick, RemoteExperts};
use anyhow::{Result, anyhow, bail};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

/// How long a node that failed is left alone before it is dialled again.
pub const RETRY: Duration = Duration::from_secs(30);

/// Where the experts go and how: `--experts-split`, `--secret-file`, `--wire-bits`.
#[derive(Clone, Debug)]
pub struct SplitConfig {
    pub addr: String,
    pub secret: Option<Vec<u8>>,
    /// Precision of the rows sent and of the outputs returned.
    pub wire: RowDtype,
    pub timeouts: Timeouts,
}

/// Makes every session of a MoE model in this process split its experts with the node of `cfg` (one connection per
/// model, opened with the first session, so a node that is down or holds other weights fails the command at start).
pub fn install(cfg: SplitConfig) -> Result<()> {
    let peers: Mutex<Vec<(String, Arc<ExpertsPeer>)>> = Mutex::new(Vec::new());
    placement::set_experts_split(Box::new(move |model: &Arc<Model>| {
        let key = format!("{}:{:?}", model.fingerprint()?, model.range);
        let mut peers = lock(&peers);
        if let Some((_, p)) = peers.iter().find(|(k, _)| *k == key) {
            return Ok(p.clone() as Arc<dyn RemoteExperts>);
        }
        let p = Arc::new(ExpertsPeer::connect(cfg.clone(), model)?);
        peers.push((key, p.clone()));
        Ok(p as Arc<dyn RemoteExperts>)
    }))
}

/// Traffic and time of the split so far (process-wide), for `run -v` and `bench`.
#[derive(Debug, Default)]
pub struct SplitStats {
    /// EXPERTS requests answered, and the picks they carried.
    pub requests: AtomicU64,
    pub picks: AtomicU64,
    pub bytes_sent: AtomicU64,
    pub bytes_recv: AtomicU64,
    /// The node's compute, and the time this side waited for the answer after its own share was done.
    pub remote_us: AtomicU64,
    pub wait_us: AtomicU64,
    /// Requests whose picks ran here because the node failed.
    pub fallbacks: AtomicU64,
}

pub static STATS: SplitStats = SplitStats {
    requests: AtomicU64::new(0),
    picks: AtomicU64::new(0),
    bytes_sent: AtomicU64::new(0),
    bytes_recv: AtomicU64::new(0),
    remote_us: AtomicU64::new(0),
    wait_us: AtomicU64::new(0),
    fallbacks: AtomicU64::new(0),
};

impl SplitStats {
    /// One line: requests, picks, bytes each way, the node's compute and this side's wait.
    pub fn summary(&self) -> String {
        let g = |a: &AtomicU64| a.load(Ordering::Relaxed);
        let n = g(&self.requests).max(1);
        format!(
            "experts split: {} requests ({} picks), {:.1} KiB sent and {:.1} KiB received per request, node compute \
             {:.2} ms and wait {:.2} ms per request, {} requests run here after a failure",
            g(&self.requests),
            g(&self.picks),
            g(&self.bytes_sent) as f64 / n as f64 / 1024.0,
            g(&self.bytes_recv) as f64 / n as f64 / 1024.0,
            g(&self.remote_us) as f64 / n as f64 / 1000.0,
            g(&self.wait_us) as f64 / n as f64 / 1000.0,
            g(&self.fallbacks),
        )
    }
}

/// One connection to the node running part of a model's experts.
pub struct ExpertsPeer {
    cfg: SplitConfig,
    open: Open,
    n_embd: usize,
    link: Mutex<Link>,
}

struct Link {
    conn: Option<Conn>,
    /// After a failure: not before this instant.
    retry_at: Option<Instant>,
    next_req: u64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl ExpertsPeer {
    /// Dials the node and opens a session on `model`'s layers: the handshake refuses a node whose model file
    /// (fingerprint), shape or layers differ.
    pub fn connect(cfg: SplitConfig, model: &Model) -> Result<ExpertsPeer> {
        if model.hp.moe.is_none() {
            bail!("--experts-split: the model ({}) has no experts", model.hp.arch.name());
        }
        let info = ModelInfo::of(&model.hp, model.fingerprint()?);
        let layers = (model.range.start as u32, model.range.end as u32);
        let mut open = Open::unsampled(info, layers, 1, LAYER_SLICE as u32, rand::random());
        open.wire = cfg.wire;
        let (conn, _) = handshake::connect(&cfg.addr, cfg.secret.as_deref(), &open, cfg.timeouts)
            .map_err(|e| anyhow!("--experts-split {}: {e:#}", cfg.addr))?;
        tracing::info!(
            "experts split: node {} runs about half of each MoE layer's experts ({} wire)",
            cfg.addr,
            cfg.wire.name()
        );
        Ok(ExpertsPeer {
            n_embd: model.hp.n_embd,
            open,
            link: Mutex::new(Link {
                conn: Some(conn),
                retry_at: None,
                next_req: 1,
            }),
            cfg,
        })
    }

    /// One request: EXPERTS out, `local` while the node computes, EXPERTS_OUT in.
    fn exchange(
        &self,
        l: &mut Link,
        layer: usize,
        x: &[f32],
        picks: &[Pick],
        local: &mut dyn FnMut(),
    ) -> Result<Vec<f32>> {
        if l.conn.is_none() {
            let (c, _) = handshake::connect(
                &self.cfg.addr,
                self.cfg.secret.as_deref(),
                &self.open,
                self.cfg.timeouts,
            )?;
            tracing::info!("experts split: node {} is back", self.cfg.addr);
            l.conn = Some(c);
        }
        let c = l.conn.as_mut().expect("connected above");
        let req = l.next_req;
        l.next_req += 1;
        let (sent0, recv0) = (c.bytes_sent, c.bytes_recv);
        let msg = Msg::Experts(Experts {
            req,
            layer: layer as u32,
            rows: Hidden::encode(x, self.n_embd, self.cfg.wire),
            picks: picks.to_vec(),
        });
        c.send(&msg, "sending a layer's experts")?;
        local();
        let t = Instant::now();
        let out = match c.recv("the experts' outputs")? {
            Msg::ExpertsOut(o) => o,
            m => bail!("answered EXPERTS with {}", m.name()),
        };
        let waited = t.elapsed();
        if out.req != req || out.out.n_rows as usize != picks.len() || out.out.width as usize != self.n_embd {
            bail!(
                "answered request {req} ({} picks) with request {} of {}x{}",
                picks.len(),
                out.req,
                out.out.n_rows,
                out.out.width
            );
        }
        let s = &STATS;
        s.requests.fetch_add(1, Ordering::Relaxed);
        s.picks.fetch_add(picks.len() as u64, Ordering::Relaxed);
        s.bytes_sent.fetch_add(c.bytes_sent - sent0, Ordering::Relaxed);
        s.bytes_recv.fetch_add(c.bytes_recv - recv0, Ordering::Relaxed);
        s.remote_us.fetch_add(out.compute_us, Ordering::Relaxed);
        s.wait_us.fetch_add(waited.as_micros() as u64, Ordering::Relaxed);
        Ok(out.out.decode())
    }
}

impl RemoteExperts for ExpertsPeer {
    fn available(&self) -> bool {
        lock(&self.link).retry_at.is_none_or(|t| Instant::now() >= t)
    }

    fn run(&self, layer: usize, x: &[f32], picks: &[Pick], local: &mut dyn FnMut()) -> Result<Vec<f32>> {
        let mut l = lock(&self.link);
        let mut ran = false;
        let got = self.exchange(&mut l, layer, x, picks, &mut || {
            local();
            ran = true;
        });
        if !ran {
            local();
        }
        match got {
            Ok(y) => {
                l.retry_at = None;
                Ok(y)
            }
            Err(e) => {
                l.conn = None;
                l.retry_at = Some(Instant::now() + RETRY);
                STATS.fallbacks.fetch_add(1, Ordering::Relaxed);
                tracing::warn!(
                    "experts split: node {} failed ({e:#}); its experts run here, trying it again in {} s",
                    self.cfg.addr,
                    RETRY.as_secs()
                );
                Err(e)
            }
        }
    }
}
