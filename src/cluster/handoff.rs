//! Disaggregated prefill and decode: a prefill node computes layers `0..k` of the prompt and streams their KV, layer
//! by layer and chunk by chunk, as soon as each is computed; the decode side writes the rows straight into its own
//! cache, runs layers `k..n` itself on the hidden state it receives (partial offload), then samples and decodes
//! alone. Any failure (node down, refusing, stalled, corrupt chunk) falls back to a local prefill with a warning.
//!
//! Wire messages: PREFILL, KV, PREFILL_HIDDEN, PREFILL_DONE (docs/protocol.md); a KV chunk is a buffer in the snapshot
//! format (docs/kv-format.md), one layer and one position range, every tensor checksummed. See docs/disaggregation.md.

use super::handshake::{self, Conn, Timeouts};
use super::stage::StageCore;
use super::wire::{self, Hidden, HiddenRows, ModelInfo, Msg, Open, Prefill, PrefillHidden, PullReport};
use super::{PrefixHash, prefix_next, prefix_root};
use crate::engine::disk_cache::DiskCache;
use crate::engine::kv_cache::KvBlock;
use crate::engine::snapshot::{self, RowDtype};
use crate::engine::{Input, Session, Want};
use anyhow::{Context, Result, anyhow, bail};
use sha2::{Digest, Sha256};
use std::collections::HashMap;
use std::net::{Shutdown, TcpStream};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn checksum8(b: &[u8]) -> [u8; 8] {
    Sha256::digest(b)[..8].try_into().unwrap()
}

fn prefix_hash(tokens: &[u32]) -> PrefixHash {
    tokens.iter().fold(prefix_root(), |h, &t| prefix_next(&h, t))
}

// ---------------------------------------------------------------------------------------------------------------
// Node side.

/// What the compute loop hands to the sender thread, in order.
enum Out {
    Kv(KvBlock),
    Hidden(usize, Vec<f32>),
    Last(Msg),
}

/// The tail of a prefill stream still being written after the compute finished; [`Drain::finish`] waits for it (the
/// node calls it after releasing its compute lock, so another request can compute meanwhile).
pub struct Drain(Option<std::thread::JoinHandle<Result<()>>>);

impl Drain {
    pub fn finish(self) -> Result<()> {
        match self.0 {
            None => Ok(()),
            Some(h) => h.join().map_err(|_| anyhow!("prefill sender panicked"))?,
        }
    }
}

/// Serves one PREFILL on a node session (`core` holds layers `0..k`). The chunks are computed here; a sender thread
/// encodes and writes each layer's KV as soon as that layer is done, so the socket write overlaps the compute. A bad
/// request is answered with ERROR (or MISMATCH) and the connection stays usable; `Err` means the peer is gone.
pub fn serve_prefill(
    s: &mut TcpStream,
    core: &mut StageCore,
    p: &Prefill,
    queued: Duration,
    hidden_wire: RowDtype,
    disk: Option<&DiskCache>,
) -> Result<Drain> {
    let model = core.session().model().clone();
    let hp = &model.hp;
    let (pos, send_from, n) = (p.pos as usize, p.send_from as usize, p.tokens.len());
    let end = pos + n;
    let bad = if !model.is_first() {
        Some(format!(
            "layers {:?} do not start at 0: a prefill runs from the tokens",
            model.range
        ))
    } else if n == 0 || send_from < pos || send_from >= end {
        Some(format!(
            "prefill of positions {pos}..{end} sending from {send_from}: nothing to send or out of range"
        ))
    } else if end > core.session().n_ctx() {
        Some(format!(
            "positions {pos}..{end} exceed the context size {}",
            core.session().n_ctx()
        ))
    } else if let Some(&t) = p.tokens.iter().find(|&&t| t as usize >= hp.n_vocab) {
        Some(format!("token id {t} is outside the vocabulary of {}", hp.n_vocab))
    } else {
        None
    };
    if let Some(message) = bad {
        wire::write_msg(s, &Msg::Error { message }).map_err(|e| anyhow!("sending: {e}"))?;
        return Ok(Drain(None));
    }
    if !core.holds_prefix(pos, &p.prefix) {
        let n_past = core.n_past() as u32;
        wire::write_msg(s, &Msg::Mismatch { req: p.req, n_past }).map_err(|e| anyhow!("sending: {e}"))?;
        return Ok(Drain(None));
    }
    core.rewind(pos);
    // The prompt from position 0, when the session knows the ids before `pos` (a range fed from token ids does).
    let full: Option<Vec<u32>> =
        (core.session().tokens().len() == pos).then(|| [core.session().tokens(), &p.tokens[..]].concat());
    // Positions on disk (`--kv-cache-dir`) are read instead of computed. Only when no hidden state is asked for
    // before the last position (full offload): a cached position has KV but no hidden state to send.
    let start = match (disk, &full) {
        (Some(d), Some(full)) if p.hidden != HiddenRows::All => core.load_from_disk(d, full).unwrap_or_else(|e| {
            tracing::warn!("kv-cache: not reading the prefill's prefix: {e:#}");
            core.n_past()
        }),
        _ => pos,
    };
    let kv_dt = p.kv;
    let fp = model.fingerprint()?.to_string();
    let e = hp.n_embd;
    let req = p.req;

    // The sender: encodes (snapshot format, checksums) and writes, in order. Two chunks' worth may queue up; beyond
    // that the compute waits for the link (bounded memory).
    let mut writer = s.try_clone()?;
    let (tx, rx) = mpsc::sync_channel::<Out>(2 * model.range.len() + 4);
    let hp2 = hp.clone();
    let sender = std::thread::spawn(move || -> Result<()> {
        for out in rx {
            let msg = match out {
                Out::Kv(block) => Msg::Kv {
                    req,
                    data: snapshot::encode_block(&hp2, &fp, &block, kv_dt)?,
                },
                Out::Hidden(pos, rows) => {
                    let hidden = Hidden::encode(&rows, e, hidden_wire);
                    Msg::PrefillHidden(PrefillHidden {
                        req,
                        pos: pos as u32,
                        checksum: checksum8(&hidden.data),
                        hidden,
                    })
                }
                Out::Last(m) => m,
            };
            wire::write_msg(&mut writer, &msg).map_err(|e| anyhow!("sending {}: {e}", msg.name()))?;
        }
        Ok(())
    });

    // The KV read from disk that the decode side lacks goes first, all layers in one chunk.
    let mut gone = start > send_from
        && tx
            .send(Out::Kv(KvBlock::from_cache(
                core.session().kv(),
                model.range.clone(),
                send_from..start,
            )))
            .is_err();
    let nb = core.session().n_batch();
    let mut compute_us = 0u64;
    let mut failed: Option<String> = None;
    // From `start`: below `pos` only when a damaged block on disk rewound the session before it was refused.
    let todo = full.as_deref().map_or(&p.tokens[..], |f| &f[start..]);
    for (ci, chunk) in todo.chunks(nb).enumerate() {
        let c0 = start + ci * nb;
        let c1 = c0 + chunk.len();
        let t0 = Instant::now();
        let res = core
            .session_mut()
            .forward_layers(Input::Tokens(chunk), 0, Want::Hidden, &mut |il, kv, r| {
                let from = r.start.max(send_from);
                if !gone
                    && from < r.end
                    && tx
                        .send(Out::Kv(KvBlock::from_cache(kv, il..il + 1, from..r.end)))
                        .is_err()
                {
                    gone = true;
                }
            });
        compute_us += t0.elapsed().as_micros() as u64;
        let h = match res {
            Ok(h) => h,
            Err(err) => {
                core.rewind(c0);
                failed = Some(format!("{err:#}"));
                break;
            }
        };
        let rows = match p.hidden {
            HiddenRows::None => None,
            HiddenRows::All => {
                let from = c0.max(send_from);
                (from < c1).then(|| (from, h[(from - c0) * e..].to_vec()))
            }
            HiddenRows::Last => (c1 == end).then(|| (end - 1, h[(chunk.len() - 1) * e..].to_vec())),
        };
        core.record(chunk);
        if let Some((at, rows)) = rows
            && !gone
            && tx.send(Out::Hidden(at, rows)).is_err()
        {
            gone = true;
        }
        if gone {
            break;
        }
    }
    if let (Some(d), Some(full), None, false) = (disk, &full, &failed, gone)
        && let Err(e) = d.store_prefix(core.session(), full, start)
    {
        tracing::warn!("kv-cache: not storing this prefill: {e:#}");
    }
    let last = match failed {
        Some(message) => Msg::Error { message },
        None => Msg::PrefillDone {
            req,
            n_past: core.n_past() as u32,
            queue_us: queued.as_micros() as u64,
            compute_us,
        },
    };
    let _ = tx.send(Out::Last(last));
    drop(tx);
    Ok(Drain(Some(sender)))
}

// ---------------------------------------------------------------------------------------------------------------
// Decode side.

/// Where the time to first token went, and what crossed the wire (`-v`).
#[derive(Clone, Debug, Default)]
pub struct HandoffReport {
    /// Layers computed remotely (0: local prefill).
    pub layers: usize,
    pub n_layer: usize,
    /// Prompt tokens, those the decode side already held, and those it received KV for.
    pub prompt: usize,
    pub held: usize,
    pub sent: usize,
    /// Tokens the prefill node recomputed without sending (it lacked them: tokens decoded locally last turn).
    pub catch_up: usize,
    pub connect: Duration,
    pub queue: Duration,
    pub remote: Duration,
    /// Local forward time of layers `k..n` (partial offload) or of the whole prompt (local prefill).
    pub local: Duration,
    /// Wall time of the remote part not covered by queueing and remote compute: transfer not hidden behind compute.
    pub exposed: Duration,
    /// From the last byte received to the logits being ready (remaining local layers, checks, output head).
    pub handoff: Duration,
    pub total: Duration,
    pub bytes: u64,
    /// Bytes received divided by the time between the first and the last frame of the stream.
    pub link_rate: f64,
    /// Why the remote prefill was abandoned, when it was.
    pub fallback: Option<String>,
    /// Tokens per chunk of this prefill (the decode side's batch size; 0: unknown).
    pub chunk: usize,
}

impl HandoffReport {
    /// The `-v` lines.
    pub fn lines(&self) -> Vec<String> {
        let ms = |d: Duration| d.as_secs_f64() * 1e3;
        let mut v = Vec::new();
        if self.layers == 0 {
            v.push(format!(
                "prefill: local, {} tokens ({} held) in {:.1} ms{}",
                self.prompt - self.held,
                self.held,
                ms(self.total),
                self.fallback
                    .as_ref()
                    .map_or(String::new(), |f| format!(" (fallback: {f})"))
            ));
            return v;
        }
        v.push(format!(
            "prefill: layers 0..{} of {} remote, {} tokens sent ({} held locally, {} caught up remotely) in {:.1} ms",
            self.layers,
            self.n_layer,
            self.sent,
            self.held,
            self.catch_up,
            ms(self.total)
        ));
        v.push(format!(
            "ttft: connect {:.1} ms | queueing {:.1} ms | remote prefill {:.1} ms | local layers {:.1} ms | exposed \
             transfer {:.1} ms | handoff {:.1} ms",
            ms(self.connect),
            ms(self.queue),
            ms(self.remote),
            ms(self.local),
            ms(self.exposed),
            ms(self.handoff)
        ));
        v.push(format!(
            "kv: {} bytes moved ({:.1} KB/token), link rate {:.2} MB/s during the stream",
            self.bytes,
            self.bytes as f64 / self.sent.max(1) as f64 / 1e3,
            self.link_rate / 1e6
        ));
        v
    }
}

/// A message cut to 4 KiB (on a character boundary), so a report always fits a small frame.
fn clip(s: &str) -> String {
    let mut end = s.len().min(4096);
    while !s.is_char_boundary(end) {
        end -= 1;
    }
    s[..end].to_string()
}

impl HandoffReport {
    /// The report as a decode node sends it to its coordinator (PULL_REPORT), with the planner's reason.
    pub fn to_wire(&self, req: u64, plan: &str) -> PullReport {
        let us = |d: Duration| d.as_micros() as u64;
        PullReport {
            req,
            layers: self.layers as u32,
            n_layer: self.n_layer as u32,
            prompt: self.prompt as u32,
            held: self.held as u32,
            sent: self.sent as u32,
            catch_up: self.catch_up as u32,
            connect_us: us(self.connect),
            queue_us: us(self.queue),
            remote_us: us(self.remote),
            local_us: us(self.local),
            exposed_us: us(self.exposed),
            handoff_us: us(self.handoff),
            total_us: us(self.total),
            bytes: self.bytes,
            link_rate: if self.link_rate.is_finite() {
                self.link_rate as u64
            } else {
                0
            },
            plan: clip(plan),
            fallback: clip(self.fallback.as_deref().unwrap_or_default()),
        }
    }

    /// The report a coordinator received from a remote decode node.
    pub fn from_wire(r: &PullReport) -> HandoffReport {
        let d = Duration::from_micros;
        HandoffReport {
            layers: r.layers as usize,
            n_layer: r.n_layer as usize,
            prompt: r.prompt as usize,
            held: r.held as usize,
            sent: r.sent as usize,
            catch_up: r.catch_up as usize,
            connect: d(r.connect_us),
            queue: d(r.queue_us),
            remote: d(r.remote_us),
            local: d(r.local_us),
            exposed: d(r.exposed_us),
            handoff: d(r.handoff_us),
            total: d(r.total_us),
            bytes: r.bytes,
            link_rate: r.link_rate as f64,
            fallback: (!r.fallback.is_empty()).then(|| r.fallback.clone()),
            chunk: 0,
        }
    }
}

/// How a prefill node is reached and what goes on the wire.
#[derive(Clone, Debug)]
pub struct NodeOpts {
    pub addr: String,
    pub secret: Option<Vec<u8>>,
    pub timeouts: Timeouts,
    pub kv: RowDtype,
}

/// What the reader thread passes on, decoded and checked.
enum Item {
    Kv(KvBlock),
    Hidden(usize, Vec<f32>),
    Done {
        at: Instant,
        queue_us: u64,
        compute_us: u64,
    },
    Mismatch(usize),
}

/// The decode side's link to one prefill node: the connection (reopened on demand) and, per offloaded layer count,
/// the tokens the node holds by our records (its session keeps them between requests).
pub struct PrefillNode {
    pub opts: NodeOpts,
    session_id: u64,
    conn: Option<(Conn, usize)>,
    held: HashMap<usize, Vec<u32>>,
    req: u64,
    /// The request being served (empty: none), carried in OPEN and PREFILL so the node logs it.
    pub request_id: String,
}

impl PrefillNode {
    pub fn new(opts: NodeOpts) -> PrefillNode {
        PrefillNode {
            opts,
            session_id: rand::random(),
            conn: None,
            held: HashMap::new(),
            req: 0,
            request_id: String::new(),
        }
    }

    /// Forgets the connection and what the node holds (after any failure).
    pub fn reset(&mut self) {
        self.conn = None;
        self.held.clear();
    }

    /// An open connection for layers `0..k`; returns the time spent connecting (zero when reused).
    fn connect(&mut self, s: &Session, k: usize) -> Result<Duration> {
        if matches!(&self.conn, Some((_, kk)) if *kk == k) {
            return Ok(Duration::ZERO);
        }
        self.conn = None;
        let t0 = Instant::now();
        let hp = &s.model().hp;
        let open = Open {
            request_id: self.request_id.clone(),
            ..Open::unsampled(
                ModelInfo::of(hp, s.model().fingerprint()?),
                (0, k as u32),
                s.n_ctx() as u32,
                s.n_batch() as u32,
                self.session_id,
            )
        };
        let (conn, ready) =
            handshake::connect(&self.opts.addr, self.opts.secret.as_deref(), &open, self.opts.timeouts)?;
        // The node may have lost the session (restart, eviction): keep only what it still can hold.
        let held = self.held.entry(k).or_default();
        held.truncate(ready.n_past as usize);
        self.conn = Some((conn, k));
        Ok(t0.elapsed())
    }

    /// Prefills `tokens[s.n_past()..]` with layers `0..k` on the node and the rest locally, writing the received KV
    /// into `s`; returns the last token's logits. On error `s` may hold partial KV beyond its old `n_past` (the caller
    /// rewinds) and the connection is dropped.
    pub fn prefill(&mut self, s: &mut Session, tokens: &[u32], k: usize, rep: &mut HandoffReport) -> Result<Vec<f32>> {
        let r = self.prefill_inner(s, tokens, k, rep);
        if r.is_err() {
            self.reset();
        }
        r
    }

    fn prefill_inner(
        &mut self,
        s: &mut Session,
        tokens: &[u32],
        k: usize,
        rep: &mut HandoffReport,
    ) -> Result<Vec<f32>> {
        let hp = s.model().hp.clone();
        let n_layer = hp.n_layer;
        if k == 0 || k > n_layer || !s.model().is_first() || !s.model().is_last() {
            bail!("a disaggregated prefill needs a full-model session and 1..={n_layer} offloaded layers");
        }
        let held = s.n_past();
        let end = tokens.len();
        if held >= end || s.tokens().len() != held || s.tokens() != &tokens[..held] {
            bail!("the session must hold a strict prefix of the prompt");
        }
        rep.connect += self.connect(s, k)?;
        let fp = s.model().fingerprint()?.to_string();
        let n_ctx = s.n_ctx();
        let mut attempt = 0;
        loop {
            attempt += 1;
            // Start where the node's records and the prompt agree, never after what we hold.
            let node_held = self.held.get(&k).map_or(&[][..], |v| &v[..]);
            let q = node_held
                .iter()
                .zip(tokens)
                .take_while(|(a, b)| a == b)
                .count()
                .min(held);
            self.req += 1;
            let req = self.req;
            let msg = Msg::Prefill(Prefill {
                req,
                pos: q as u32,
                prefix: prefix_hash(&tokens[..q]),
                send_from: held as u32,
                kv: self.opts.kv,
                hidden: if k < n_layer { HiddenRows::All } else { HiddenRows::Last },
                tokens: tokens[q..].to_vec(),
                request_id: self.request_id.clone(),
            });
            let (mut conn, _) = self.conn.take().expect("connected");
            conn.send(&msg, "the prefill request")?;
            let t_sent = Instant::now();
            rep.catch_up = held - q;
            self.held.insert(k, tokens[..q].to_vec());
            let bytes0 = conn.bytes_recv;
            let io = conn.timeouts.io;
            let shutdown = conn.stream.try_clone()?;

            // Reader: frames off the socket, decoded and checked, in order. It ends after DONE or MISMATCH (giving
            // the connection back) or at the first error.
            let (tx, rx) = mpsc::channel::<Result<(Item, Instant)>>();
            let (hp2, fp2) = (hp.clone(), fp.clone());
            let reader = std::thread::spawn(move || -> Option<Conn> {
                loop {
                    let item = (|| -> Result<Item> {
                        Ok(match conn.recv("the prefill stream")? {
                            Msg::Kv { req: r, data } if r == req => {
                                let (block, _) =
                                    snapshot::decode_block(&hp2, &fp2, n_ctx, &data).context("refusing a KV chunk")?;
                                Item::Kv(block)
                            }
                            Msg::PrefillHidden(h) if h.req == req => {
                                if checksum8(&h.hidden.data) != h.checksum {
                                    bail!("a hidden-state chunk fails its checksum: the data is corrupt");
                                }
                                if h.hidden.width as usize != hp2.n_embd {
                                    bail!(
                                        "hidden-state chunk of width {}, expected {}",
                                        h.hidden.width,
                                        hp2.n_embd
                                    );
                                }
                                Item::Hidden(h.pos as usize, h.hidden.decode())
                            }
                            Msg::PrefillDone {
                                req: r,
                                queue_us,
                                compute_us,
                                ..
                            } if r == req => Item::Done {
                                at: Instant::now(),
                                queue_us,
                                compute_us,
                            },
                            Msg::Mismatch { req: r, n_past } if r == req => Item::Mismatch(n_past as usize),
                            m => bail!("unexpected {} in the prefill stream", m.name()),
                        })
                    })();
                    let last = !matches!(item, Ok(Item::Kv(_)) | Ok(Item::Hidden(..)));
                    let ok = item.is_ok();
                    if tx.send(item.map(|i| (i, Instant::now()))).is_err() {
                        return None;
                    }
                    if last {
                        return ok.then_some(conn);
                    }
                }
            });

            let outcome = self.consume(s, tokens, k, held, &rx, io, rep);
            if outcome.is_err() {
                let _ = shutdown.shutdown(Shutdown::Both);
            }
            let conn = reader.join().map_err(|_| anyhow!("prefill reader panicked"))?;
            let (first_at, done) = outcome?;
            let Some(conn) = conn else {
                bail!("the prefill stream ended early");
            };
            rep.bytes += conn.bytes_recv - bytes0;
            self.conn = Some((conn, k));
            match done {
                Done::Mismatch(n_past) => {
                    // Our records were wrong (node restarted, evicted): replay from 0, once.
                    self.held.insert(k, Vec::new());
                    if attempt >= 2 {
                        bail!(
                            "prefill node {} keeps refusing the prefix (it holds {n_past})",
                            self.opts.addr
                        );
                    }
                    continue;
                }
                Done::Ok {
                    at,
                    queue_us,
                    compute_us,
                    logits,
                } => {
                    self.held.insert(k, tokens.to_vec());
                    rep.layers = k;
                    rep.n_layer = n_layer;
                    rep.sent = end - held;
                    rep.queue = Duration::from_micros(queue_us);
                    rep.remote = Duration::from_micros(compute_us);
                    let wall = at.duration_since(t_sent);
                    rep.exposed = wall.saturating_sub(rep.queue + rep.remote);
                    rep.handoff = at.elapsed();
                    let stream = at.duration_since(first_at.unwrap_or(t_sent)).as_secs_f64();
                    rep.link_rate = rep.bytes as f64 / stream.max(1e-6);
                    return Ok(logits);
                }
            }
        }
    }

    /// The decode side of one stream: writes KV rows as they come, runs layers `k..n` on each hidden chunk (partial
    /// offload) or the output head on the last row (full offload), and checks that every layer got every position.
    #[allow(clippy::too_many_arguments)]
    fn consume(
        &self,
        s: &mut Session,
        tokens: &[u32],
        k: usize,
        held: usize,
        rx: &mpsc::Receiver<Result<(Item, Instant)>>,
        io: Duration,
        rep: &mut HandoffReport,
    ) -> Result<(Option<Instant>, Done)> {
        let n_layer = s.model().hp.n_layer;
        let e = s.model().hp.n_embd;
        let end = tokens.len();
        // Next position expected per offloaded layer.
        let mut next = vec![held; k];
        let mut logits: Option<Vec<f32>> = None;
        let mut first_at = None;
        loop {
            let (item, at) = match rx.recv_timeout(io + Duration::from_secs(1)) {
                Ok(r) => r?,
                Err(_) => bail!("the prefill stream stalled"),
            };
            first_at.get_or_insert(at);
            match item {
                Item::Kv(block) => {
                    if block.layers.end > k || block.layers.is_empty() {
                        bail!("KV chunk for layers {:?}, we offloaded 0..{k}", block.layers);
                    }
                    for il in block.layers.clone() {
                        if block.pos.start != next[il] || block.pos.end > end {
                            bail!(
                                "KV chunk for layer {il} positions {:?}, expected to start at {}",
                                block.pos,
                                next[il]
                            );
                        }
                        next[il] = block.pos.end;
                    }
                    s.import_kv(&block)?;
                }
                Item::Hidden(pos, rows) => {
                    let n = rows.len() / e;
                    if k < n_layer {
                        if pos != s.n_past() || pos + n > end || n == 0 {
                            bail!("hidden chunk at position {pos}, expected {}", s.n_past());
                        }
                        let want = if pos + n == end { Want::LastLogits } else { Want::Hidden };
                        let t0 = Instant::now();
                        let out = s.forward_layers(Input::Hidden(&rows), k, want, &mut |_, _, _| {})?;
                        if want == Want::LastLogits {
                            logits = Some(out.to_vec());
                        }
                        rep.local += t0.elapsed();
                    } else {
                        if pos + 1 != end || n != 1 {
                            bail!("final hidden row at position {pos}, expected {}", end - 1);
                        }
                        logits = Some(s.logits_of_hidden(&rows)?.to_vec());
                    }
                }
                Item::Mismatch(n_past) => return Ok((first_at, Done::Mismatch(n_past))),
                Item::Done {
                    at,
                    queue_us,
                    compute_us,
                } => {
                    if let Some(il) = next.iter().position(|&p| p != end) {
                        bail!(
                            "the prefill node sent layer {il} up to position {}, not {end}",
                            next[il]
                        );
                    }
                    let Some(logits) = logits else {
                        bail!("the prefill node did not send the final hidden state");
                    };
                    // The offloaded layers' KV is all in; the local layers' forward passes reached `end` already.
                    s.hold_positions(end, tokens)?;
                    return Ok((
                        first_at,
                        Done::Ok {
                            at,
                            queue_us,
                            compute_us,
                            logits,
                        },
                    ));
                }
            }
        }
    }
}

enum Done {
    Ok {
        at: Instant,
        queue_us: u64,
        compute_us: u64,
        logits: Vec<f32>,
    },
    Mismatch(usize),
}

/// Prefills `tokens` into `s` (a full-model session): keeps the prefix it already holds, offloads layers `0..k` of
/// the rest to `node` when `k > 0`, and falls back to a local prefill with a warning on standard error if the node
/// fails in any way. Returns the last token's logits and the report.
pub fn prefill_with_fallback(
    s: &mut Session,
    node: Option<&mut PrefillNode>,
    tokens: &[u32],
    k: usize,
) -> Result<(Vec<f32>, HandoffReport)> {
    let t0 = Instant::now();
    let held = s.reuse_prefix(tokens);
    let mut rep = HandoffReport {
        prompt: tokens.len(),
        held,
        n_layer: s.model().hp.n_layer,
        chunk: s.n_batch(),
        ..Default::default()
    };
    if let Some(node) = node
        && k > 0
    {
        match node.prefill(s, tokens, k, &mut rep) {
            Ok(logits) => {
                rep.total = t0.elapsed();
                return Ok((logits, rep));
            }
            Err(e) => {
                tracing::warn!(
                    "disaggregated prefill on {} failed ({e:#}); prefilling locally",
                    node.opts.addr
                );
                rep = HandoffReport {
                    prompt: tokens.len(),
                    held,
                    n_layer: s.model().hp.n_layer,
                    chunk: s.n_batch(),
                    fallback: Some(format!("{e:#}")),
                    ..Default::default()
                };
                s.rewind(held);
            }
        }
    }
    let t1 = Instant::now();
    let logits = s.eval(&tokens[held..])?.to_vec();
    rep.local = t1.elapsed();
    rep.total = t0.elapsed();
    Ok((logits, rep))
}
