//! Frames and messages of the Baton cluster protocol (docs/protocol.md is the byte-exact reference).
//!
//! A frame is a 12-byte header (magic `BTON`, version, type, reserved, payload length; little-endian) and a payload.
//! The payload length is checked against [`MAX_FRAME`] and the type's own limit before anything is allocated, and
//! every field inside is bounds-checked against the bytes actually present, so a hostile peer can make us allocate
//! at most one frame's worth of memory and never panic.
//!
//! Here: the frame (header, limits, reading and writing) and [`Msg`], which dispatches each type code to its body's
//! codec. The bodies and their codecs are in `messages.rs` and `hidden.rs`, the byte-level reader and writer in
//! `codec.rs`.

mod codec;
pub use codec::MAX_LABEL;
mod hidden;
mod messages;
#[cfg(test)]
mod tests;

pub use hidden::Hidden;
pub use messages::{
    Body, Experts, ExpertsOut, Forward, HiddenRows, ModelInfo, OFFLOAD_AUTO, Open, Prefill, PrefillHidden, Pull,
    PullReport, Ready, ResultMsg, WantOut,
};

use codec::{Codec, Dec, Enc, malformed};
use std::io::{self, Read, Write};

pub const MAGIC: [u8; 4] = *b"BTON";
pub const VERSION: u8 = 6;
pub const HEADER_LEN: usize = 12;
/// Largest payload of any frame.
pub const MAX_FRAME: usize = 256 << 20;
/// Largest payload of a handshake frame (HELLO .. READY, ERROR).
pub const MAX_SMALL_FRAME: usize = 64 << 10;
/// Largest payload a node accepts before the peer has authenticated (HELLO and AUTH carry 32 bytes each): an
/// unauthenticated peer can make it hold no more than this per connection.
pub const MAX_PREAUTH_FRAME: usize = 1 << 10;
/// Most token ids one LOOKUP may carry (a node also refuses more than its session's context).
pub const MAX_LOOKUP_TOKENS: usize = 1 << 20;

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
    pub const LOOKUP: u8 = 17;
    pub const CACHED: u8 = 18;
    pub const EXPERTS: u8 = 19;
    pub const EXPERTS_OUT: u8 = 20;
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
    /// Protocol 5: hold the longest prefix of `tokens` this session can, from its KV or its node's disk cache
    /// (`--kv-cache-dir`); answered with CACHED.
    Lookup {
        req: u64,
        tokens: Vec<u32>,
    },
    /// The session now holds positions `0..n_past` of the LOOKUP's tokens.
    Cached {
        req: u64,
        n_past: u32,
    },
    /// Protocol 6: run these picks of a MoE layer's experts (`--experts-split`).
    Experts(Experts),
    ExpertsOut(ExpertsOut),
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
            Msg::Lookup { .. } => ty::LOOKUP,
            Msg::Cached { .. } => ty::CACHED,
            Msg::Experts(_) => ty::EXPERTS,
            Msg::ExpertsOut(_) => ty::EXPERTS_OUT,
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
            Msg::Open(o) => o.put(&mut e),
            Msg::Ready(r) => r.put(&mut e),
            Msg::Forward(f) => f.put(&mut e),
            Msg::Result(r) => r.put(&mut e),
            Msg::Mismatch { req, n_past } => {
                e.u64(*req);
                e.u32(*n_past);
            }
            Msg::Error { message } => e.str(message),
            Msg::Prefill(p) => p.put(&mut e),
            Msg::Kv { req, data } => {
                e.u64(*req);
                e.u32(data.len() as u32);
                e.raw(data);
            }
            Msg::PrefillHidden(h) => h.put(&mut e),
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
            Msg::Pull(p) => p.put(&mut e),
            Msg::PullReport(r) => r.put(&mut e),
            Msg::Lookup { req, tokens } => {
                e.u64(*req);
                e.tokens(tokens);
            }
            Msg::Cached { req, n_past } => {
                e.u64(*req);
                e.u32(*n_past);
            }
            Msg::Experts(x) => x.put(&mut e),
            Msg::ExpertsOut(x) => x.put(&mut e),
        }
        e.0
    }

    /// Parses a payload of type `code`; every length is checked against the bytes present, and bytes left over are
    /// an error.
    pub fn decode(code: u8, payload: &[u8]) -> Result<Msg, WireError> {
        let d = &mut Dec { b: payload, pos: 0 };
        let m = match code {
            ty::HELLO => Msg::Hello { nonce: d.arr()? },
            ty::CHALLENGE => Msg::Challenge {
                nonce: d.arr()?,
                auth_required: d.flag("auth")?,
            },
            ty::AUTH => Msg::Auth { mac: d.arr()? },
            ty::AUTH_OK => Msg::AuthOk { mac: d.arr()? },
            ty::OPEN => Msg::Open(Open::get(d)?),
            ty::READY => Msg::Ready(Ready::get(d)?),
            ty::FORWARD => Msg::Forward(Forward::get(d)?),
            ty::RESULT => Msg::Result(ResultMsg::get(d)?),
            ty::MISMATCH => Msg::Mismatch {
                req: d.u64()?,
                n_past: d.u32()?,
            },
            ty::ERROR => Msg::Error { message: d.str()? },
            ty::PREFILL => Msg::Prefill(Prefill::get(d)?),
            ty::KV => {
                let req = d.u64()?;
                let n = d.count(1)?;
                Msg::Kv {
                    req,
                    data: d.take(n)?.to_vec(),
                }
            }
            ty::PREFILL_HIDDEN => Msg::PrefillHidden(PrefillHidden::get(d)?),
            ty::PREFILL_DONE => Msg::PrefillDone {
                req: d.u64()?,
                n_past: d.u32()?,
                queue_us: d.u64()?,
                compute_us: d.u64()?,
            },
            ty::PULL => Msg::Pull(Pull::get(d)?),
            ty::PULL_REPORT => Msg::PullReport(PullReport::get(d)?),
            ty::LOOKUP => {
                let req = d.u64()?;
                let tokens = d.tokens()?;
                if tokens.len() > MAX_LOOKUP_TOKENS {
                    return malformed(format!(
                        "LOOKUP of {} tokens, at most {MAX_LOOKUP_TOKENS}",
                        tokens.len()
                    ));
                }
                Msg::Lookup { req, tokens }
            }
            ty::CACHED => Msg::Cached {
                req: d.u64()?,
                n_past: d.u32()?,
            },
            ty::EXPERTS => Msg::Experts(Experts::get(d)?),
            ty::EXPERTS_OUT => Msg::ExpertsOut(ExpertsOut::get(d)?),
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
        ty::LOOKUP => "LOOKUP",
        ty::CACHED => "CACHED",
        ty::EXPERTS => "EXPERTS",
        ty::EXPERTS_OUT => "EXPERTS_OUT",
        _ => "unknown",
    }
}

/// Largest payload a frame of type `code` may carry.
pub fn max_payload(code: u8) -> usize {
    match code {
        ty::FORWARD
        | ty::RESULT
        | ty::PREFILL
        | ty::KV
        | ty::PREFILL_HIDDEN
        | ty::PULL
        | ty::LOOKUP
        | ty::EXPERTS
        | ty::EXPERTS_OUT => MAX_FRAME,
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
