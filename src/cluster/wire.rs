//! Frames and messages of the Baton cluster protocol (docs/protocol.md is the byte-exact reference).
//!
//! A frame is a 12-byte header (magic `BTON`, version, type, reserved, payload length; little-endian) and a payload.
//! The payload length is checked against [`MAX_FRAME`] and the type's own limit before anything is allocated, and
//! every field inside is bounds-checked against the bytes actually present, so a hostile peer can make us allocate
//! at most one frame's worth of memory and never panic.

use crate::engine::sampler::SamplerParams;
use crate::engine::snapshot::RowDtype;
use anyhow::Result;
use half::{bf16, f16};
use std::io::{self, Read, Write};

pub const MAGIC: [u8; 4] = *b"BTON";
pub const VERSION: u8 = 3;
pub const HEADER_LEN: usize = 12;
/// Largest payload of any frame.
pub const MAX_FRAME: usize = 256 << 20;
/// Largest payload of a handshake frame (HELLO .. READY, ERROR).
pub const MAX_SMALL_FRAME: usize = 64 << 10;

/// Message type codes (byte 5 of the header).
pub mod ty {
    pub const HELLO: u8 = 1;
    pub const CHALLENGE: u8 = 2;
    pub const AUTH: u8 = 3;
    pub const AUTH_OK: u8 = 4;
    pub const OPEN: u8 = 5;
    pub const READY: u8 = 6;
    pub const FORWARD: u8 = 7;
    pub const RESULT: u8 = 8;
    pub const MISMATCH: u8 = 9;
    pub const ERROR: u8 = 10;
    pub const PREFILL: u8 = 11;
    pub const KV: u8 = 12;
    pub const PREFILL_HIDDEN: u8 = 13;
    pub const PREFILL_DONE: u8 = 14;
    pub const PULL: u8 = 15;
    pub const PULL_REPORT: u8 = 16;
}

/// Why reading or writing a frame failed; the caller turns it into a message naming the peer.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("timed out")]
    Timeout,
    #[error("connection closed")]
    Closed,
    #[error("{0}")]
    Io(io::Error),
    #[error("malformed frame: {0}")]
    Malformed(String),
}

impl From<io::Error> for WireError {
    fn from(e: io::Error) -> Self {
        match e.kind() {
            io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut => WireError::Timeout,
            io::ErrorKind::UnexpectedEof
            | io::ErrorKind::ConnectionReset
            | io::ErrorKind::ConnectionAborted
            | io::ErrorKind::BrokenPipe => WireError::Closed,
            _ => WireError::Io(e),
        }
    }
}

fn malformed<T>(msg: impl Into<String>) -> Result<T, WireError> {
    Err(WireError::Malformed(msg.into()))
}

/// The wire's code for a row type (hidden states and KV chunks; docs/protocol.md).
fn dtype_code(d: RowDtype) -> u8 {
    match d {
        RowDtype::F32 => 0,
        RowDtype::F16 => 1,
        RowDtype::BF16 => 2,
        RowDtype::Q8 => 3,
    }
}

fn dtype_from_code(c: u8) -> Result<RowDtype, WireError> {
    Ok(match c {
        0 => RowDtype::F32,
        1 => RowDtype::F16,
        2 => RowDtype::BF16,
        3 => RowDtype::Q8,
        _ => return malformed(format!("unknown hidden-state type {c}")),
    })
}

/// A hidden state `[n_rows, width]` encoded for the wire.
#[derive(Clone, Debug, PartialEq)]
pub struct Hidden {
    pub dtype: RowDtype,
    pub n_rows: u32,
    pub width: u32,
    /// Row-major values (f32/f16/bf16 little-endian, or i8); for Q8 followed by `n_rows` f32 scales.
    pub data: Vec<u8>,
}

impl Hidden {
    pub fn encode(x: &[f32], width: usize, dtype: RowDtype) -> Hidden {
        let n_rows = x.len() / width;
        let mut data = Vec::with_capacity(n_rows * dtype.row_bytes(width));
        match dtype {
            RowDtype::F32 => x.iter().for_each(|v| data.extend_from_slice(&v.to_le_bytes())),
            RowDtype::F16 => x
                .iter()
                .for_each(|&v| data.extend_from_slice(&f16::from_f32(v).to_le_bytes())),
            RowDtype::BF16 => x
                .iter()
                .for_each(|&v| data.extend_from_slice(&bf16::from_f32(v).to_le_bytes())),
            RowDtype::Q8 => {
                let mut scales = Vec::with_capacity(n_rows);
                for row in x.chunks(width) {
                    let amax = row.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let scale = amax / 127.0;
                    let inv = if scale > 0.0 { 1.0 / scale } else { 0.0 };
                    data.extend(row.iter().map(|&v| (v * inv).round().clamp(-127.0, 127.0) as i8 as u8));
                    scales.push(scale);
                }
                scales.iter().for_each(|s| data.extend_from_slice(&s.to_le_bytes()));
            }
        }
        Hidden {
            dtype,
            n_rows: n_rows as u32,
            width: width as u32,
            data,
        }
    }

    /// Decodes into f32 values; the length was checked when the frame was parsed.
    pub fn decode(&self) -> Vec<f32> {
        let (n, w) = (self.n_rows as usize, self.width as usize);
        let d = &self.data;
        match self.dtype {
            RowDtype::F32 => d
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
            RowDtype::F16 => d
                .chunks_exact(2)
                .map(|c| f16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            RowDtype::BF16 => d
                .chunks_exact(2)
                .map(|c| bf16::from_le_bytes([c[0], c[1]]).to_f32())
                .collect(),
            RowDtype::Q8 => {
                let (q, s) = d.split_at(n * w);
                let mut out = Vec::with_capacity(n * w);
                for (row, sc) in q.chunks_exact(w.max(1)).zip(s.chunks_exact(4)) {
                    let sc = f32::from_le_bytes(sc.try_into().unwrap());
                    out.extend(row.iter().map(|&b| (b as i8) as f32 * sc));
                }
                out
            }
        }
    }
}

/// The model as each end sees it; the handshake compares these field by field.
#[derive(Clone, Debug, PartialEq, Eq)]
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

impl WantOut {
    fn from_code(c: u8) -> Result<WantOut, WireError> {
        Ok(match c {
            0 => WantOut::Hidden,
            1 => WantOut::Sample,
            2 => WantOut::LastLogits,
            3 => WantOut::AllLogits,
            4 => WantOut::Ack,
            _ => return malformed(format!("unknown output kind {c}")),
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
}

impl Open {
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

#[derive(Clone, Debug, PartialEq)]
pub struct Ready {
    pub model: ModelInfo,
    pub layers: (u32, u32),
    pub n_ctx: u32,
    /// Positions this session already holds on the node (0 for a new session).
    pub n_past: u32,
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

#[derive(Clone, Debug, PartialEq)]
pub struct ResultMsg {
    pub req: u64,
    /// Time the node spent computing, microseconds.
    pub compute_us: u64,
    pub body: Body,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Msg {
    Hello {
        nonce: [u8; 32],
    },
    Challenge {
        nonce: [u8; 32],
        auth_required: bool,
    },
    Auth {
        mac: [u8; 32],
    },
    AuthOk {
        mac: [u8; 32],
    },
    Open(Open),
    Ready(Ready),
    Forward(Forward),
    Result(ResultMsg),
    Mismatch {
        req: u64,
        n_past: u32,
    },
    Error {
        message: String,
    },
    Prefill(Prefill),
    /// One KV chunk of a disaggregated prefill: a buffer in the KV snapshot format (docs/kv-format.md).
    Kv {
        req: u64,
        data: Vec<u8>,
    },
    PrefillHidden(PrefillHidden),
    /// End of a disaggregated prefill: the node now holds `n_past` positions; it waited `queue_us` for the compute
    /// lock and spent `compute_us` in forward passes.
    PrefillDone {
        req: u64,
        n_past: u32,
        queue_us: u64,
        compute_us: u64,
    },
    Pull(Pull),
    PullReport(PullReport),
}

impl Msg {
    pub fn type_code(&self) -> u8 {
        match self {
            Msg::Hello { .. } => ty::HELLO,
            Msg::Challenge { .. } => ty::CHALLENGE,
            Msg::Auth { .. } => ty::AUTH,
            Msg::AuthOk { .. } => ty::AUTH_OK,
            Msg::Open(_) => ty::OPEN,
            Msg::Ready(_) => ty::READY,
            Msg::Forward(_) => ty::FORWARD,
            Msg::Result(_) => ty::RESULT,
            Msg::Mismatch { .. } => ty::MISMATCH,
            Msg::Error { .. } => ty::ERROR,
            Msg::Prefill(_) => ty::PREFILL,
            Msg::Kv { .. } => ty::KV,
            Msg::PrefillHidden(_) => ty::PREFILL_HIDDEN,
            Msg::PrefillDone { .. } => ty::PREFILL_DONE,
            Msg::Pull(_) => ty::PULL,
            Msg::PullReport(_) => ty::PULL_REPORT,
        }
    }

    pub fn name(&self) -> &'static str {
        type_name(self.type_code())
    }

    /// The payload bytes.
    pub fn encode(&self) -> Vec<u8> {
        let mut e = Enc(Vec::new());
        match self {
            Msg::Hello { nonce } => e.raw(nonce),
            Msg::Challenge { nonce, auth_required } => {
                e.raw(nonce);
                e.u8(*auth_required as u8);
            }
            Msg::Auth { mac } | Msg::AuthOk { mac } => e.raw(mac),
            Msg::Open(o) => {
                e.model(&o.model);
                e.u32(o.layers.0);
                e.u32(o.layers.1);
                e.u32(o.n_ctx);
                e.u32(o.n_batch);
                e.u8(dtype_code(o.wire));
                e.u64(o.session);
                e.f32(o.temperature);
                e.f32(o.top_p);
                e.u64(o.seed);
                e.u16(o.top_k);
                e.u32(o.sample_top_k);
                e.f32(o.min_p);
                e.f32(o.repeat_penalty);
                e.u32(o.repeat_last_n);
            }
            Msg::Ready(r) => {
                e.model(&r.model);
                e.u32(r.layers.0);
                e.u32(r.layers.1);
                e.u32(r.n_ctx);
                e.u32(r.n_past);
            }
            Msg::Forward(f) => {
                e.u64(f.req);
                e.u32(f.pos);
                e.raw(&f.prefix);
                e.u8(f.want as u8);
                e.u32(f.tokens.len() as u32);
                f.tokens.iter().for_each(|&t| e.u32(t));
                match &f.hidden {
                    None => e.u8(0),
                    Some(h) => {
                        e.u8(1);
                        e.hidden(h);
                    }
                }
            }
            Msg::Result(r) => {
                e.u64(r.req);
                e.u64(r.compute_us);
                match &r.body {
                    Body::Ack => e.u8(0),
                    Body::Hidden(h) => {
                        e.u8(1);
                        e.hidden(h);
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
            Msg::Mismatch { req, n_past } => {
                e.u64(*req);
                e.u32(*n_past);
            }
            Msg::Error { message } => e.str(message),
            Msg::Prefill(p) => {
                e.u64(p.req);
                e.u32(p.pos);
                e.raw(&p.prefix);
                e.u32(p.send_from);
                e.u8(dtype_code(p.kv));
                e.u8(p.hidden as u8);
                e.u32(p.tokens.len() as u32);
                p.tokens.iter().for_each(|&t| e.u32(t));
            }
            Msg::Kv { req, data } => {
                e.u64(*req);
                e.u32(data.len() as u32);
                e.raw(data);
            }
            Msg::PrefillHidden(h) => {
                e.u64(h.req);
                e.u32(h.pos);
                e.raw(&h.checksum);
                e.hidden(&h.hidden);
            }
            Msg::PrefillDone {
                req,
                n_past,
                queue_us,
                compute_us,
            } => {
                e.u64(*req);
                e.u32(*n_past);
                e.u64(*queue_us);
                e.u64(*compute_us);
            }
            Msg::Pull(p) => {
                e.u64(p.req);
                e.u32(p.pos);
                e.raw(&p.prefix);
                e.u32(p.tokens.len() as u32);
                p.tokens.iter().for_each(|&t| e.u32(t));
                e.str(&p.prefill);
                e.u32(p.offload);
                e.u8(dtype_code(p.kv));
                e.u32(p.timeout_ms);
            }
            Msg::PullReport(r) => {
                e.u64(r.req);
                for v in [r.layers, r.n_layer, r.prompt, r.held, r.sent, r.catch_up] {
                    e.u32(v);
                }
                for v in [
                    r.connect_us,
                    r.queue_us,
                    r.remote_us,
                    r.local_us,
                    r.exposed_us,
                    r.handoff_us,
                    r.total_us,
                    r.bytes,
                    r.link_rate,
                ] {
                    e.u64(v);
                }
                e.str(&r.plan);
                e.str(&r.fallback);
            }
        }
        e.0
    }

    /// Parses a payload of type `code`; every length is checked against the bytes present.
    pub fn decode(code: u8, payload: &[u8]) -> Result<Msg, WireError> {
        let mut d = Dec { b: payload, pos: 0 };
        let m = match code {
            ty::HELLO => Msg::Hello { nonce: d.arr()? },
            ty::CHALLENGE => Msg::Challenge {
                nonce: d.arr()?,
                auth_required: match d.u8()? {
                    0 => false,
                    1 => true,
                    v => return malformed(format!("auth flag {v} is neither 0 nor 1")),
                },
            },
            ty::AUTH => Msg::Auth { mac: d.arr()? },
            ty::AUTH_OK => Msg::AuthOk { mac: d.arr()? },
            ty::OPEN => Msg::Open(Open {
                model: d.model()?,
                layers: (d.u32()?, d.u32()?),
                n_ctx: d.u32()?,
                n_batch: d.u32()?,
                wire: dtype_from_code(d.u8()?)?,
                session: d.u64()?,
                temperature: d.f32()?,
                top_p: d.f32()?,
                seed: d.u64()?,
                top_k: d.u16()?,
                sample_top_k: d.u32()?,
                min_p: d.f32()?,
                repeat_penalty: d.f32()?,
                repeat_last_n: d.u32()?,
            }),
            ty::READY => Msg::Ready(Ready {
                model: d.model()?,
                layers: (d.u32()?, d.u32()?),
                n_ctx: d.u32()?,
                n_past: d.u32()?,
            }),
            ty::FORWARD => {
                let req = d.u64()?;
                let pos = d.u32()?;
                let prefix = d.arr()?;
                let want = WantOut::from_code(d.u8()?)?;
                let n = d.count(4)?;
                let tokens = (0..n).map(|_| d.u32()).collect::<Result<Vec<_>, _>>()?;
                let hidden = match d.u8()? {
                    0 => None,
                    1 => Some(d.hidden()?),
                    v => return malformed(format!("hidden-state flag {v} is neither 0 nor 1")),
                };
                Msg::Forward(Forward {
                    req,
                    pos,
                    prefix,
                    tokens,
                    hidden,
                    want,
                })
            }
            ty::RESULT => {
                let req = d.u64()?;
                let compute_us = d.u64()?;
                let body = match d.u8()? {
                    0 => Body::Ack,
                    1 => Body::Hidden(d.hidden()?),
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
                };
                Msg::Result(ResultMsg { req, compute_us, body })
            }
            ty::MISMATCH => Msg::Mismatch {
                req: d.u64()?,
                n_past: d.u32()?,
            },
            ty::ERROR => Msg::Error { message: d.str()? },
            ty::PREFILL => {
                let req = d.u64()?;
                let pos = d.u32()?;
                let prefix = d.arr()?;
                let send_from = d.u32()?;
                let kv = dtype_from_code(d.u8()?)?;
                let hidden = match d.u8()? {
                    0 => HiddenRows::None,
                    1 => HiddenRows::All,
                    2 => HiddenRows::Last,
                    v => return malformed(format!("unknown hidden-rows choice {v}")),
                };
                let n = d.count(4)?;
                let tokens = (0..n).map(|_| d.u32()).collect::<Result<Vec<_>, _>>()?;
                Msg::Prefill(Prefill {
                    req,
                    pos,
                    prefix,
                    send_from,
                    kv,
                    hidden,
                    tokens,
                })
            }
            ty::KV => {
                let req = d.u64()?;
                let n = d.count(1)?;
                Msg::Kv {
                    req,
                    data: d.take(n)?.to_vec(),
                }
            }
            ty::PREFILL_HIDDEN => Msg::PrefillHidden(PrefillHidden {
                req: d.u64()?,
                pos: d.u32()?,
                checksum: d.arr()?,
                hidden: d.hidden()?,
            }),
            ty::PREFILL_DONE => Msg::PrefillDone {
                req: d.u64()?,
                n_past: d.u32()?,
                queue_us: d.u64()?,
                compute_us: d.u64()?,
            },
            ty::PULL => {
                let req = d.u64()?;
                let pos = d.u32()?;
                let prefix = d.arr()?;
                let n = d.count(4)?;
                let tokens = (0..n).map(|_| d.u32()).collect::<Result<Vec<_>, _>>()?;
                Msg::Pull(Pull {
                    req,
                    pos,
                    prefix,
                    tokens,
                    prefill: d.str()?,
                    offload: d.u32()?,
                    kv: dtype_from_code(d.u8()?)?,
                    timeout_ms: d.u32()?,
                })
            }
            ty::PULL_REPORT => Msg::PullReport(PullReport {
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
            }),
            other => return malformed(format!("unknown message type {other}")),
        };
        if d.left() != 0 {
            return malformed(format!(
                "{} trailing bytes after a {} message",
                d.left(),
                type_name(code)
            ));
        }
        Ok(m)
    }
}

pub fn type_name(code: u8) -> &'static str {
    match code {
        ty::HELLO => "HELLO",
        ty::CHALLENGE => "CHALLENGE",
        ty::AUTH => "AUTH",
        ty::AUTH_OK => "AUTH_OK",
        ty::OPEN => "OPEN",
        ty::READY => "READY",
        ty::FORWARD => "FORWARD",
        ty::RESULT => "RESULT",
        ty::MISMATCH => "MISMATCH",
        ty::ERROR => "ERROR",
        ty::PREFILL => "PREFILL",
        ty::KV => "KV",
        ty::PREFILL_HIDDEN => "PREFILL_HIDDEN",
        ty::PREFILL_DONE => "PREFILL_DONE",
        ty::PULL => "PULL",
        ty::PULL_REPORT => "PULL_REPORT",
        _ => "unknown",
    }
}

/// Largest payload a frame of type `code` may carry.
pub fn max_payload(code: u8) -> usize {
    match code {
        ty::FORWARD | ty::RESULT | ty::PREFILL | ty::KV | ty::PREFILL_HIDDEN | ty::PULL => MAX_FRAME,
        _ => MAX_SMALL_FRAME,
    }
}

/// Writes one frame; returns the bytes written (header included).
pub fn write_msg(w: &mut impl Write, msg: &Msg) -> Result<usize, WireError> {
    let payload = msg.encode();
    if payload.len() > max_payload(msg.type_code()) {
        return malformed(format!(
            "{} message of {} bytes exceeds the frame limit",
            msg.name(),
            payload.len()
        ));
    }
    let mut head = [0u8; HEADER_LEN];
    head[..4].copy_from_slice(&MAGIC);
    head[4] = VERSION;
    head[5] = msg.type_code();
    head[8..12].copy_from_slice(&(payload.len() as u32).to_le_bytes());
    w.write_all(&head)?;
    w.write_all(&payload)?;
    w.flush()?;
    Ok(HEADER_LEN + payload.len())
}

/// Reads one frame's header, validates it, then reads and parses the payload; returns the message and the bytes read.
pub fn read_msg(r: &mut impl Read) -> Result<(Msg, usize), WireError> {
    let mut head = [0u8; HEADER_LEN];
    r.read_exact(&mut head)?;
    let (code, len) = check_header(&head)?;
    let mut payload = vec![0u8; len];
    r.read_exact(&mut payload)?;
    Ok((Msg::decode(code, &payload)?, HEADER_LEN + len))
}

/// Checks magic, version, reserved bits and the length bound; returns (type, payload length).
pub fn check_header(head: &[u8; HEADER_LEN]) -> Result<(u8, usize), WireError> {
    if head[..4] != MAGIC {
        return malformed(format!("bad magic {:02x?} (not a Baton peer)", &head[..4]));
    }
    if head[4] != VERSION {
        return malformed(format!("peer speaks protocol version {}, we speak {VERSION}", head[4]));
    }
    let code = head[5];
    if type_name(code) == "unknown" {
        return malformed(format!("unknown message type {code}"));
    }
    if head[6] != 0 || head[7] != 0 {
        return malformed("reserved header bytes are not zero");
    }
    let len = u32::from_le_bytes(head[8..12].try_into().unwrap()) as usize;
    if len > max_payload(code) {
        return malformed(format!(
            "{} frame of {len} bytes exceeds the limit of {}",
            type_name(code),
            max_payload(code)
        ));
    }
    Ok((code, len))
}

struct Enc(Vec<u8>);

impl Enc {
    fn raw(&mut self, b: &[u8]) {
        self.0.extend_from_slice(b);
    }
    fn u8(&mut self, v: u8) {
        self.0.push(v);
    }
    fn u16(&mut self, v: u16) {
        self.raw(&v.to_le_bytes());
    }
    fn u32(&mut self, v: u32) {
        self.raw(&v.to_le_bytes());
    }
    fn u64(&mut self, v: u64) {
        self.raw(&v.to_le_bytes());
    }
    fn f32(&mut self, v: f32) {
        self.raw(&v.to_le_bytes());
    }
    /// u16 length + UTF-8 bytes (truncated at 65 535 bytes on a char boundary).
    fn str(&mut self, s: &str) {
        let mut end = s.len().min(u16::MAX as usize);
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        self.u16(end as u16);
        self.raw(&s.as_bytes()[..end]);
    }
    fn model(&mut self, m: &ModelInfo) {
        self.str(&m.fingerprint);
        self.str(&m.arch);
        for v in [m.n_layer, m.n_embd, m.n_vocab, m.n_head, m.n_head_kv] {
            self.u32(v);
        }
    }
    fn hidden(&mut self, h: &Hidden) {
        self.u8(dtype_code(h.dtype));
        self.u32(h.n_rows);
        self.u32(h.width);
        self.u32(h.data.len() as u32);
        self.raw(&h.data);
    }
}

struct Dec<'a> {
    b: &'a [u8],
    pos: usize,
}

impl<'a> Dec<'a> {
    fn left(&self) -> usize {
        self.b.len() - self.pos
    }
    fn take(&mut self, n: usize) -> Result<&'a [u8], WireError> {
        if n > self.left() {
            return malformed(format!(
                "field of {n} bytes at offset {} runs past the payload end",
                self.pos
            ));
        }
        let s = &self.b[self.pos..self.pos + n];
        self.pos += n;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self) -> Result<[u8; N], WireError> {
        Ok(self.take(N)?.try_into().unwrap())
    }
    fn u8(&mut self) -> Result<u8, WireError> {
        Ok(self.take(1)?[0])
    }
    fn u16(&mut self) -> Result<u16, WireError> {
        Ok(u16::from_le_bytes(self.arr()?))
    }
    fn u32(&mut self) -> Result<u32, WireError> {
        Ok(u32::from_le_bytes(self.arr()?))
    }
    fn u64(&mut self) -> Result<u64, WireError> {
        Ok(u64::from_le_bytes(self.arr()?))
    }
    fn f32(&mut self) -> Result<f32, WireError> {
        Ok(f32::from_le_bytes(self.arr()?))
    }
    /// A u32 element count whose elements of `size` bytes must fit in what is left.
    fn count(&mut self, size: usize) -> Result<usize, WireError> {
        let n = self.u32()? as usize;
        if n.saturating_mul(size) > self.left() {
            return malformed(format!("count {n} runs past the payload end"));
        }
        Ok(n)
    }
    fn str(&mut self) -> Result<String, WireError> {
        let n = self.u16()? as usize;
        let b = self.take(n)?;
        match std::str::from_utf8(b) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => malformed("string is not UTF-8"),
        }
    }
    fn model(&mut self) -> Result<ModelInfo, WireError> {
        Ok(ModelInfo {
            fingerprint: self.str()?,
            arch: self.str()?,
            n_layer: self.u32()?,
            n_embd: self.u32()?,
            n_vocab: self.u32()?,
            n_head: self.u32()?,
            n_head_kv: self.u32()?,
        })
    }
    fn hidden(&mut self) -> Result<Hidden, WireError> {
        let dtype = dtype_from_code(self.u8()?)?;
        let n_rows = self.u32()?;
        let width = self.u32()?;
        let len = self.u32()? as usize;
        let need = (n_rows as u64).saturating_mul(dtype.row_bytes(width as usize) as u64);
        if need != len as u64 {
            return malformed(format!(
                "hidden state of {n_rows}x{width} {} needs {need} bytes, frame says {len}",
                dtype.name()
            ));
        }
        if width == 0 {
            return malformed("hidden state of width 0");
        }
        let data = self.take(len)?.to_vec();
        Ok(Hidden {
            dtype,
            n_rows,
            width,
            data,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn roundtrip(m: Msg) {
        let mut buf = Vec::new();
        let n = write_msg(&mut buf, &m).unwrap();
        assert_eq!(n, buf.len());
        let (back, read) = read_msg(&mut &buf[..]).unwrap();
        assert_eq!(read, n);
        assert_eq!(back, m);
    }

    fn info() -> ModelInfo {
        ModelInfo {
            fingerprint: "ab".repeat(32),
            arch: "llama".into(),
            n_layer: 30,
            n_embd: 576,
            n_vocab: 49152,
            n_head: 9,
            n_head_kv: 3,
        }
    }

    #[test]
    fn every_message_roundtrips() {
        roundtrip(Msg::Hello { nonce: [7; 32] });
        roundtrip(Msg::Challenge {
            nonce: [8; 32],
            auth_required: true,
        });
        roundtrip(Msg::Auth { mac: [9; 32] });
        roundtrip(Msg::AuthOk { mac: [1; 32] });
        roundtrip(Msg::Open(Open {
            model: info(),
            layers: (3, 17),
            n_ctx: 4096,
            n_batch: 128,
            wire: RowDtype::Q8,
            session: 0xdead_beef,
            temperature: 0.7,
            top_p: 0.9,
            seed: 42,
            top_k: 5,
            sample_top_k: 40,
            min_p: 0.05,
            repeat_penalty: 1.1,
            repeat_last_n: 64,
        }));
        roundtrip(Msg::Ready(Ready {
            model: info(),
            layers: (0, 30),
            n_ctx: 512,
            n_past: 12,
        }));
        let h = Hidden::encode(&[1.0, -2.0, 3.5, 0.25, 8.0, -1.0], 3, RowDtype::Q8);
        roundtrip(Msg::Forward(Forward {
            req: 5,
            pos: 10,
            prefix: [3; 16],
            tokens: vec![1, 2],
            hidden: Some(h.clone()),
            want: WantOut::Sample,
        }));
        roundtrip(Msg::Forward(Forward {
            req: 5,
            pos: 0,
            prefix: [0; 16],
            tokens: vec![9],
            hidden: None,
            want: WantOut::Ack,
        }));
        roundtrip(Msg::Result(ResultMsg {
            req: 1,
            compute_us: 99,
            body: Body::Hidden(h),
        }));
        roundtrip(Msg::Result(ResultMsg {
            req: 1,
            compute_us: 99,
            body: Body::Sample {
                token: 4,
                logprob: -0.5,
                top: vec![(4, -0.5), (7, -1.5)],
            },
        }));
        roundtrip(Msg::Result(ResultMsg {
            req: 2,
            compute_us: 0,
            body: Body::Logits(vec![0.5; 10]),
        }));
        roundtrip(Msg::Result(ResultMsg {
            req: 2,
            compute_us: 0,
            body: Body::Ack,
        }));
        roundtrip(Msg::Mismatch { req: 3, n_past: 77 });
        roundtrip(Msg::Prefill(Prefill {
            req: 9,
            pos: 4,
            prefix: [5; 16],
            send_from: 6,
            kv: RowDtype::F16,
            hidden: HiddenRows::Last,
            tokens: vec![1, 2, 3],
        }));
        roundtrip(Msg::Kv {
            req: 9,
            data: vec![1, 2, 3, 4, 5],
        });
        roundtrip(Msg::PrefillHidden(PrefillHidden {
            req: 9,
            pos: 6,
            checksum: [1; 8],
            hidden: Hidden::encode(&[1.0, 2.0], 2, RowDtype::F32),
        }));
        roundtrip(Msg::PrefillDone {
            req: 9,
            n_past: 12,
            queue_us: 7,
            compute_us: 1000,
        });
        roundtrip(Msg::Pull(Pull {
            req: 10,
            pos: 3,
            prefix: [6; 16],
            tokens: vec![4, 5, 6],
            prefill: "10.0.0.2:7070".into(),
            offload: OFFLOAD_AUTO,
            kv: RowDtype::Q8,
            timeout_ms: 10_000,
        }));
        roundtrip(Msg::PullReport(PullReport {
            req: 10,
            layers: 30,
            n_layer: 30,
            prompt: 40,
            held: 3,
            sent: 37,
            catch_up: 1,
            connect_us: 1,
            queue_us: 2,
            remote_us: 3,
            local_us: 4,
            exposed_us: 5,
            handoff_us: 6,
            total_us: 7,
            bytes: 8,
            link_rate: 9,
            plan: "offload always".into(),
            fallback: String::new(),
        }));
        roundtrip(Msg::Error {
            message: "nope ✓".into(),
        });
    }

    #[test]
    fn hidden_codecs_bound_their_error() {
        let x: Vec<f32> = (0..64).map(|i| ((i * 37 % 23) as f32 - 11.0) * 0.37).collect();
        for (code, (dt, tol)) in [
            (RowDtype::F32, 0.0),
            (RowDtype::F16, 2e-3),
            (RowDtype::BF16, 2e-2),
            (RowDtype::Q8, 0.03),
        ]
        .into_iter()
        .enumerate()
        {
            // docs/protocol.md's dtype codes.
            assert_eq!(dtype_code(dt), code as u8);
            assert_eq!(dtype_from_code(code as u8).unwrap(), dt);
            let h = Hidden::encode(&x, 16, dt);
            assert_eq!(h.data.len(), 4 * dt.row_bytes(16));
            let y = h.decode();
            let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
            for (a, b) in x.iter().zip(&y) {
                assert!((a - b).abs() <= tol * amax, "{dt:?}: {a} vs {b}");
            }
        }
    }

    #[test]
    fn bad_headers_are_refused_before_allocation() {
        let mut head = [0u8; HEADER_LEN];
        head[..4].copy_from_slice(&MAGIC);
        head[4] = VERSION;
        head[5] = ty::FORWARD;
        head[8..12].copy_from_slice(&u32::MAX.to_le_bytes());
        assert!(matches!(check_header(&head), Err(WireError::Malformed(m)) if m.contains("exceeds")));
        head[5] = ty::HELLO;
        head[8..12].copy_from_slice(&(1u32 << 20).to_le_bytes());
        assert!(check_header(&head).is_err(), "handshake frames have a small limit");
        head[4] = VERSION + 1;
        assert!(
            matches!(check_header(&head), Err(WireError::Malformed(m)) if m.contains(&format!("version {}", VERSION + 1)))
        );
        let junk = b"GET / HTTP/1.1\r\n\r\n";
        assert!(matches!(read_msg(&mut &junk[..]), Err(WireError::Malformed(m)) if m.contains("magic")));
        assert!(matches!(read_msg(&mut &MAGIC[..]), Err(WireError::Closed)));
    }

    #[test]
    fn inner_lengths_are_checked() {
        // A FORWARD that claims a billion tokens in a 40-byte payload.
        let mut p = Vec::new();
        p.extend_from_slice(&1u64.to_le_bytes());
        p.extend_from_slice(&0u32.to_le_bytes());
        p.extend_from_slice(&[0; 16]);
        p.push(0);
        p.extend_from_slice(&1_000_000_000u32.to_le_bytes());
        assert!(Msg::decode(ty::FORWARD, &p).is_err());
        // A hidden state whose byte count disagrees with its shape.
        let mut h = Hidden::encode(&[1.0; 8], 4, RowDtype::F16);
        h.data.pop();
        let f = Msg::Forward(Forward {
            req: 1,
            pos: 0,
            prefix: [0; 16],
            tokens: vec![1, 2],
            hidden: Some(h),
            want: WantOut::Hidden,
        });
        assert!(Msg::decode(ty::FORWARD, &f.encode()).is_err());
        // Trailing bytes.
        let mut ok = Msg::Mismatch { req: 1, n_past: 2 }.encode();
        ok.push(0);
        assert!(Msg::decode(ty::MISMATCH, &ok).is_err());
        // Every truncation of a valid message fails cleanly.
        let full = Msg::Open(Open {
            model: info(),
            layers: (0, 1),
            n_ctx: 1,
            n_batch: 1,
            wire: RowDtype::F32,
            session: 1,
            temperature: 0.0,
            top_p: 1.0,
            seed: 0,
            top_k: 0,
            sample_top_k: 0,
            min_p: 0.0,
            repeat_penalty: 1.0,
            repeat_last_n: 0,
        })
        .encode();
        for n in 0..full.len() {
            assert!(Msg::decode(ty::OPEN, &full[..n]).is_err());
        }
    }
}
