//! The message bodies of the protocol, each with its codec beside it (docs/protocol.md gives the same layouts in
//! bytes). The handshake's small messages (HELLO .. AUTH_OK, MISMATCH, ERROR, KV, PREFILL_DONE) are encoded
//! inline in `mod.rs`.

use super::WireError;
use super::codec::{Codec, Dec, Enc, malformed};
use super::hidden::Hidden;
use crate::engine::sampler::SamplerParams;
use crate::engine::snapshot::RowDtype;
use crate::model::moe::Pick;

/// The model as each end sees it; the handshake compares these field by field.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ModelInfo {
    /// Hex content hash of the model file.
    pub fingerprint: String,
    pub arch: String,
    pub n_layer: u32,
    pub n_embd: u32,
    pub n_vocab: u32,
    pub n_head: u32,
    pub n_head_kv: u32,
}

impl ModelInfo {
    pub fn of(hp: &crate::model::Hparams, fingerprint: &str) -> ModelInfo {
        ModelInfo {
            fingerprint: fingerprint.to_string(),
            arch: hp.arch.name().to_string(),
            n_layer: hp.n_layer as u32,
            n_embd: hp.n_embd as u32,
            n_vocab: hp.n_vocab as u32,
            n_head: hp.n_head as u32,
            n_head_kv: hp.n_head_kv as u32,
        }
    }

    /// Every field that differs, phrased as `"<theirs> has X, <ours> has Y"`; empty when they agree.
    pub fn differences(&self, theirs: &ModelInfo, ours_label: &str, theirs_label: &str) -> Vec<String> {
        let mut out = Vec::new();
        if self.fingerprint != theirs.fingerprint {
            out.push(format!(
                "{theirs_label} has model fingerprint {}… ({}), {ours_label} has {}… ({})",
                &theirs.fingerprint[..theirs.fingerprint.len().min(12)],
                theirs.arch,
                &self.fingerprint[..self.fingerprint.len().min(12)],
                self.arch
            ));
        }
        let mut field = |name: &str, a: String, b: String| {
            if a != b {
                out.push(format!("{theirs_label} has {name} {b}, {ours_label} has {a}"));
            }
        };
        field("architecture", self.arch.clone(), theirs.arch.clone());
        field("n_layer", self.n_layer.to_string(), theirs.n_layer.to_string());
        field("n_embd", self.n_embd.to_string(), theirs.n_embd.to_string());
        field("n_vocab", self.n_vocab.to_string(), theirs.n_vocab.to_string());
        field("n_head", self.n_head.to_string(), theirs.n_head.to_string());
        field("n_head_kv", self.n_head_kv.to_string(), theirs.n_head_kv.to_string());
        out
    }
}

impl Codec for ModelInfo {
    fn put(&self, e: &mut Enc) {
        e.str(&self.fingerprint);
        e.str(&self.arch);
        for v in [self.n_layer, self.n_embd, self.n_vocab, self.n_head, self.n_head_kv] {
            e.u32(v);
        }
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(ModelInfo {
            fingerprint: d.str()?,
            arch: d.str()?,
            n_layer: d.u32()?,
            n_embd: d.u32()?,
            n_vocab: d.u32()?,
            n_head: d.u32()?,
            n_head_kv: d.u32()?,
        })
    }
}

/// What the last stage returns for a FORWARD.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WantOut {
    /// The hidden state leaving the range (any stage but the last).
    Hidden = 0,
    /// The sampled next token and top-k log-probabilities (last stage).
    Sample = 1,
    /// The last token's logits, `[n_vocab]` f32 (last stage).
    LastLogits = 2,
    /// Every token's logits, `[n_tok, n_vocab]` f32 (last stage; perplexity).
    AllLogits = 3,
    /// Nothing but an acknowledgement (a prefill chunk that is not the last).
    Ack = 4,
}

impl Codec for WantOut {
    fn put(&self, e: &mut Enc) {
        e.u8(*self as u8)
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(match d.u8()? {
            0 => WantOut::Hidden,
            1 => WantOut::Sample,
            2 => WantOut::LastLogits,
            3 => WantOut::AllLogits,
            4 => WantOut::Ack,
            c => return malformed(format!("unknown output kind {c}")),
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Open {
    pub model: ModelInfo,
    /// Requested layer range, `start..end` (end exclusive, global indices).
    pub layers: (u32, u32),
    pub n_ctx: u32,
    pub n_batch: u32,
    /// Precision of the hidden states this stage sends back.
    pub wire: RowDtype,
    pub session: u64,
    pub temperature: f32,
    pub top_p: f32,
    pub seed: u64,
    /// How many top log-probabilities a sampled result carries.
    pub top_k: u16,
    /// The sampler's own top-k cut (0: off), min-p (0: off), repetition penalty (1: off) and its window.
    pub sample_top_k: u32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub repeat_last_n: u32,
    /// The request that opens the session (protocol 4; empty: none), for the node's logs.
    pub request_id: String,
}

impl Open {
    /// A session that samples nothing of its own (greedy, no penalties, f32 rows): a prefill node's, or one opened
    /// only for its READY.
    pub fn unsampled(model: ModelInfo, layers: (u32, u32), n_ctx: u32, n_batch: u32, session: u64) -> Open {
        Open {
            model,
            layers,
            n_ctx,
            n_batch,
            wire: RowDtype::F32,
            session,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            top_k: 0,
            sample_top_k: 0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
            request_id: String::new(),
        }
    }

    /// The last stage's sampler settings as OPEN carries them.
    pub fn sampler(&self) -> SamplerParams {
        SamplerParams {
            temp: self.temperature,
            top_k: self.sample_top_k as usize,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n as usize,
            seed: Some(self.seed),
        }
    }

    /// Puts `p` in OPEN's fields: the nodes need a concrete seed (a missing one sends 0; the coordinator resolves it
    /// first), a temperature of at least 0, and a penalty window within `n_ctx`.
    pub fn set_sampler(&mut self, p: &SamplerParams, n_ctx: usize) {
        self.temperature = p.temp.max(0.0);
        self.top_p = p.top_p;
        self.seed = p.seed.unwrap_or(0);
        self.sample_top_k = p.top_k.min(u32::MAX as usize) as u32;
        self.min_p = p.min_p;
        self.repeat_penalty = p.repeat_penalty;
        self.repeat_last_n = p.repeat_last_n.min(n_ctx) as u32;
    }
}

impl Codec for Open {
    fn put(&self, e: &mut Enc) {
        self.model.put(e);
        e.u32(self.layers.0);
        e.u32(self.layers.1);
        e.u32(self.n_ctx);
        e.u32(self.n_batch);
        self.wire.put(e);
        e.u64(self.session);
        e.f32(self.temperature);
        e.f32(self.top_p);
        e.u64(self.seed);
        e.u16(self.top_k);
        e.u32(self.sample_top_k);
        e.f32(self.min_p);
        e.f32(self.repeat_penalty);
        e.u32(self.repeat_last_n);
        e.str(&self.request_id);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(Open {
            model: ModelInfo::get(d)?,
            layers: (d.u32()?, d.u32()?),
            n_ctx: d.u32()?,
            n_batch: d.u32()?,
            wire: RowDtype::get(d)?,
            session: d.u64()?,
            temperature: d.f32()?,
            top_p: d.f32()?,
            seed: d.u64()?,
            top_k: d.u16()?,
            sample_top_k: d.u32()?,
            min_p: d.f32()?,
            repeat_penalty: d.f32()?,
            repeat_last_n: d.u32()?,
            request_id: d.request_id()?,
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Ready {
    pub model: ModelInfo,
    pub layers: (u32, u32),
    pub n_ctx: u32,
    /// Positions this session already holds on the node (0 for a new session).
    pub n_past: u32,
    /// Where the node computes (`cpu`, `gpu: NAME`) and its CPU kernels' ISA (protocol 5), for the cluster view;
    /// each at most [`super::codec::MAX_LABEL`] bytes without control characters.
    pub backend: String,
    pub isa: String,
}

impl Codec for Ready {
    fn put(&self, e: &mut Enc) {
        self.model.put(e);
        e.u32(self.layers.0);
        e.u32(self.layers.1);
        e.u32(self.n_ctx);
        e.u32(self.n_past);
        e.label(&self.backend);
        e.label(&self.isa);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(Ready {
            model: ModelInfo::get(d)?,
            layers: (d.u32()?, d.u32()?),
            n_ctx: d.u32()?,
            n_past: d.u32()?,
            backend: d.label()?,
            isa: d.label()?,
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Forward {
    pub req: u64,
    /// Position of the first token of the batch.
    pub pos: u32,
    /// Hash of the token prefix `0..pos` (see [`crate::cluster::prefix_next`]).
    pub prefix: [u8; 16],
    /// The batch's token ids (every stage gets them, to extend its prefix hash).
    pub tokens: Vec<u32>,
    /// The residual stream entering the stage; absent for a stage that starts at layer 0.
    pub hidden: Option<Hidden>,
    pub want: WantOut,
    /// The request this step serves (protocol 4); empty: the same as the previous FORWARD on the connection, so a
    /// decode step spends 2 bytes on it.
    pub request_id: String,
}

impl Codec for Forward {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u32(self.pos);
        e.raw(&self.prefix);
        self.want.put(e);
        e.tokens(&self.tokens);
        self.hidden.put(e);
        e.str(&self.request_id);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(Forward {
            req: d.u64()?,
            pos: d.u32()?,
            prefix: d.arr()?,
            want: WantOut::get(d)?,
            tokens: d.tokens()?,
            hidden: Option::<Hidden>::get(d)?,
            request_id: d.request_id()?,
        })
    }
}

/// Which hidden-state rows leaving the prefilled range a PREFILL asks for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HiddenRows {
    /// None (the decode side needs only the KV).
    None = 0,
    /// Every position sent (partial offload: the decode side runs the remaining layers on them).
    All = 1,
    /// Only the prompt's last position (full offload: the decode side applies the output head to it).
    Last = 2,
}

impl Codec for HiddenRows {
    fn put(&self, e: &mut Enc) {
        e.u8(*self as u8)
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(match d.u8()? {
            0 => HiddenRows::None,
            1 => HiddenRows::All,
            2 => HiddenRows::Last,
            v => return malformed(format!("unknown hidden-rows choice {v}")),
        })
    }
}

/// Disaggregated prefill request: compute the session's layers (those of OPEN, starting at 0) for `tokens` at
/// positions `pos..`, and stream the KV of positions `send_from..` layer by layer as it is computed.
#[derive(Clone, Debug, PartialEq)]
pub struct Prefill {
    pub req: u64,
    /// Position of the first token to compute (the node must hold `0..pos` with prefix hash `prefix`).
    pub pos: u32,
    pub prefix: [u8; 16],
    /// First position whose KV is sent (`>= pos`); positions before it are computed (catch-up) but not sent, the
    /// decode side holds them already.
    pub send_from: u32,
    /// Element type of the KV chunks (same codes as hidden states).
    pub kv: RowDtype,
    pub hidden: HiddenRows,
    pub tokens: Vec<u32>,
    /// The request whose prompt this is (protocol 4; empty: none), for the node's logs.
    pub request_id: String,
}

impl Codec for Prefill {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u32(self.pos);
        e.raw(&self.prefix);
        e.u32(self.send_from);
        self.kv.put(e);
        self.hidden.put(e);
        e.tokens(&self.tokens);
        e.str(&self.request_id);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(Prefill {
            req: d.u64()?,
            pos: d.u32()?,
            prefix: d.arr()?,
            send_from: d.u32()?,
            kv: RowDtype::get(d)?,
            hidden: HiddenRows::get(d)?,
            tokens: d.tokens()?,
            request_id: d.request_id()?,
        })
    }
}

/// One hidden-state chunk of a disaggregated prefill: rows for positions `pos..pos + n_rows`.
#[derive(Clone, Debug, PartialEq)]
pub struct PrefillHidden {
    pub req: u64,
    pub pos: u32,
    /// First 8 bytes of SHA-256 of `hidden.data`.
    pub checksum: [u8; 8],
    pub hidden: Hidden,
}

impl Codec for PrefillHidden {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u32(self.pos);
        e.raw(&self.checksum);
        self.hidden.put(e);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(PrefillHidden {
            req: d.u64()?,
            pos: d.u32()?,
            checksum: d.arr()?,
            hidden: Hidden::get(d)?,
        })
    }
}

/// `offload` value of a PULL asking the decode node to choose (its `--offload auto` planner).
pub const OFFLOAD_AUTO: u32 = u32::MAX;

/// Disaggregated prefill with a remote decode node (protocol 3): the coordinator asks the node holding a full-model
/// session to prefill `tokens` at `pos..` by pulling their KV from the prefill node `prefill`, then to sample the
/// first token. The node answers PULL_REPORT, then RESULT (a sample), or MISMATCH / ERROR.
#[derive(Clone, Debug, PartialEq)]
pub struct Pull {
    pub req: u64,
    pub pos: u32,
    pub prefix: [u8; 16],
    pub tokens: Vec<u32>,
    /// `HOST:PORT` of the prefill node.
    pub prefill: String,
    /// Layers to prefill remotely (0: locally), or [`OFFLOAD_AUTO`].
    pub offload: u32,
    /// Element type of the KV between the prefill and the decode node.
    pub kv: RowDtype,
    /// The decode node's deadline for each wait on the prefill node, milliseconds.
    pub timeout_ms: u32,
    /// The request whose prompt this is (protocol 4; empty: none); the decode node passes it on in its PREFILL.
    pub request_id: String,
}

impl Codec for Pull {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u32(self.pos);
        e.raw(&self.prefix);
        e.tokens(&self.tokens);
        e.str(&self.prefill);
        e.u32(self.offload);
        self.kv.put(e);
        e.u32(self.timeout_ms);
        e.str(&self.request_id);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(Pull {
            req: d.u64()?,
            pos: d.u32()?,
            prefix: d.arr()?,
            tokens: d.tokens()?,
            prefill: d.str()?,
            offload: d.u32()?,
            kv: RowDtype::get(d)?,
            timeout_ms: d.u32()?,
            request_id: d.request_id()?,
        })
    }
}

/// How a PULL went on the decode node: the fields of its TTFT breakdown (durations in microseconds).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct PullReport {
    pub req: u64,
    pub layers: u32,
    pub n_layer: u32,
    pub prompt: u32,
    pub held: u32,
    pub sent: u32,
    pub catch_up: u32,
    pub connect_us: u64,
    pub queue_us: u64,
    pub remote_us: u64,
    pub local_us: u64,
    pub exposed_us: u64,
    pub handoff_us: u64,
    pub total_us: u64,
    /// KV and hidden-state bytes received from the prefill node.
    pub bytes: u64,
    /// Bytes per second during the stream.
    pub link_rate: u64,
    /// The planner's choice and reason.
    pub plan: String,
    /// Why the remote prefill was abandoned (empty: it was not).
    pub fallback: String,
}

impl Codec for PullReport {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        for v in [
            self.layers,
            self.n_layer,
            self.prompt,
            self.held,
            self.sent,
            self.catch_up,
        ] {
            e.u32(v);
        }
        for v in [
            self.connect_us,
            self.queue_us,
            self.remote_us,
            self.local_us,
            self.exposed_us,
            self.handoff_us,
            self.total_us,
            self.bytes,
            self.link_rate,
        ] {
            e.u64(v);
        }
        e.str(&self.plan);
        e.str(&self.fallback);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(PullReport {
            req: d.u64()?,
            layers: d.u32()?,
            n_layer: d.u32()?,
            prompt: d.u32()?,
            held: d.u32()?,
            sent: d.u32()?,
            catch_up: d.u32()?,
            connect_us: d.u64()?,
            queue_us: d.u64()?,
            remote_us: d.u64()?,
            local_us: d.u64()?,
            exposed_us: d.u64()?,
            handoff_us: d.u64()?,
            total_us: d.u64()?,
            bytes: d.u64()?,
            link_rate: d.u64()?,
            plan: d.str()?,
            fallback: d.str()?,
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub enum Body {
    Ack,
    Hidden(Hidden),
    Sample {
        token: u32,
        logprob: f32,
        top: Vec<(u32, f32)>,
    },
    Logits(Vec<f32>),
}

impl Codec for Body {
    fn put(&self, e: &mut Enc) {
        match self {
            Body::Ack => e.u8(0),
            Body::Hidden(h) => {
                e.u8(1);
                h.put(e);
            }
            Body::Sample { token, logprob, top } => {
                e.u8(2);
                e.u32(*token);
                e.f32(*logprob);
                e.u16(top.len() as u16);
                for &(t, lp) in top {
                    e.u32(t);
                    e.f32(lp);
                }
            }
            Body::Logits(l) => {
                e.u8(3);
                e.u32(l.len() as u32);
                l.iter().for_each(|&v| e.f32(v));
            }
        }
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(match d.u8()? {
            0 => Body::Ack,
            1 => Body::Hidden(Hidden::get(d)?),
            2 => {
                let token = d.u32()?;
                let logprob = d.f32()?;
                let n = d.u16()? as usize;
                if n * 8 > d.left() {
                    return malformed("top-k list longer than the frame");
                }
                let top = (0..n)
                    .map(|_| Ok((d.u32()?, d.f32()?)))
                    .collect::<Result<Vec<_>, WireError>>()?;
                Body::Sample { token, logprob, top }
            }
            3 => {
                let n = d.count(4)?;
                Body::Logits((0..n).map(|_| d.f32()).collect::<Result<Vec<_>, _>>()?)
            }
            v => return malformed(format!("unknown result kind {v}")),
        })
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct ResultMsg {
    pub req: u64,
    /// Time the node spent computing, microseconds.
    pub compute_us: u64,
    pub body: Body,
}

impl Codec for ResultMsg {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u64(self.compute_us);
        self.body.put(e);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(ResultMsg {
            req: d.u64()?,
            compute_us: d.u64()?,
            body: Body::get(d)?,
        })
    }
}

/// Protocol 6 (`--experts-split`): one MoE layer's picks for the node to run over `rows`, the batch's normalised
/// inputs to the layer's feed-forward. Answered with EXPERTS_OUT (or ERROR).
#[derive(Clone, Debug, PartialEq)]
pub struct Experts {
    pub req: u64,
    /// Global layer index.
    pub layer: u32,
    pub rows: Hidden,
    /// Each pick names a row of `rows`, an expert and its routing weight.
    pub picks: Vec<Pick>,
}

impl Codec for Experts {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u32(self.layer);
        self.rows.put(e);
        e.u32(self.picks.len() as u32);
        for p in &self.picks {
            e.u32(p.row);
            e.u32(p.expert);
            e.f32(p.weight);
        }
    }

    /// Each pick's row must be one of `rows` and its weight finite; the node checks the expert and layer against its
    /// model.
    fn get(d: &mut Dec) -> Result<Self, WireError> {
        let req = d.u64()?;
        let layer = d.u32()?;
        let rows = Hidden::get(d)?;
        let n = d.count(12)?;
        let mut picks = Vec::with_capacity(n);
        for _ in 0..n {
            let p = Pick {
                row: d.u32()?,
                expert: d.u32()?,
                weight: d.f32()?,
            };
            if p.row >= rows.n_rows || !p.weight.is_finite() {
                return malformed(format!(
                    "EXPERTS pick of row {} with weight {} ({} rows sent)",
                    p.row, p.weight, rows.n_rows
                ));
            }
            picks.push(p);
        }
        Ok(Experts {
            req,
            layer,
            rows,
            picks,
        })
    }
}

/// The weighted outputs of an EXPERTS request's picks, one row each in the request's order.
#[derive(Clone, Debug, PartialEq)]
pub struct ExpertsOut {
    pub req: u64,
    /// Time the node spent computing, microseconds.
    pub compute_us: u64,
    pub out: Hidden,
}

impl Codec for ExpertsOut {
    fn put(&self, e: &mut Enc) {
        e.u64(self.req);
        e.u64(self.compute_us);
        self.out.put(e);
    }

    fn get(d: &mut Dec) -> Result<Self, WireError> {
        Ok(ExpertsOut {
            req: d.u64()?,
            compute_us: d.u64()?,
            out: Hidden::get(d)?,
        })
    }
}
