//! One connection to a node: the handshake (HELLO, AUTH, OPEN), then one handler per request (FORWARD, PREFILL,
//! PULL) until the peer goes away. A request's refusal is an ERROR reply; anything malformed ends the connection.

use super::state::{SharedSlot, State, lock};
use crate::cluster::auth;
use crate::cluster::disagg::Pulled;
use crate::cluster::handoff::serve_prefill;
use crate::cluster::stage::StageOut;
use crate::cluster::wire::{
    self, Body, Experts, ExpertsOut, Forward, Hidden, Msg, Open, Prefill, Pull, Ready, ResultMsg, WireError,
};
use crate::logging::request_span;
use anyhow::{Result, anyhow};
use std::io::Read;
use std::net::TcpStream;
use std::ops::Range;
use std::time::{Duration, Instant};

/// Serves the connection `s` from `peer` to its end; `authenticated` is called once the peer has proved it knows
/// the secret (or, without one, has completed HELLO/AUTH), which frees its place among the pending handshakes.
pub(super) fn serve(s: TcpStream, st: &State, peer: &str, authenticated: impl FnOnce()) -> Result<()> {
    s.set_nodelay(true)?;
    s.set_write_timeout(Some(st.cfg.io_timeout))?;
    let mut c = Conn { s, st, peer };
    let Some(nonces) = c.hello()? else {
        return Ok(());
    };
    c.auth(nonces)?;
    authenticated();
    let o = c.open()?;
    // The request this connection serves now: OPEN's, then that of the last request frame naming one.
    let mut rid = o.open.request_id.clone();
    loop {
        match read_frame(&mut c.s, st.cfg.idle_timeout, st.cfg.io_timeout, wire::MAX_FRAME) {
            Ok(Msg::Forward(f)) => {
                let fresh = !f.request_id.is_empty() && f.request_id != rid;
                if fresh {
                    rid.clone_from(&f.request_id);
                }
                let _s = request_span(&rid).entered();
                if fresh {
                    tracing::info!(
                        "baton node: {} session {:016x}: positions {}.. on layers {}:{}",
                        c.peer,
                        o.open.session,
                        f.pos,
                        o.range.start,
                        o.range.end
                    );
                }
                c.forward(&o, f)?
            }
            Ok(Msg::Prefill(p)) => {
                rid.clone_from(&p.request_id);
                let _s = request_span(&rid).entered();
                tracing::info!(
                    "baton node: {} session {:016x}: prefill of positions {}..{}, sending from {}",
                    c.peer,
                    o.open.session,
                    p.pos,
                    p.pos as usize + p.tokens.len(),
                    p.send_from
                );
                c.prefill(&o, &p)?
            }
            Ok(Msg::Pull(p)) => {
                rid.clone_from(&p.request_id);
                let _s = request_span(&rid).entered();
                tracing::info!(
                    "baton node: {} session {:016x}: pulled prefill of positions {}..{} from prefill node {:?}",
                    c.peer,
                    o.open.session,
                    p.pos,
                    p.pos as usize + p.tokens.len(),
                    p.prefill
                );
                c.pull(&o, &p)?
            }
            Ok(Msg::Lookup { req, tokens }) => {
                let _s = request_span(&rid).entered();
                let reply = match st.lookup(&o.slot, &tokens) {
                    Ok(n) => {
                        tracing::info!(
                            "baton node: {} session {:016x}: lookup of {} tokens on layers {}:{}: {n} held",
                            c.peer,
                            o.open.session,
                            tokens.len(),
                            o.range.start,
                            o.range.end
                        );
                        Msg::Cached { req, n_past: n as u32 }
                    }
                    Err(e) => Msg::Error {
                        message: format!("{e:#}"),
                    },
                };
                c.send(&reply)?
            }
            Ok(Msg::Experts(x)) => c.experts(&o, x)?,
            Ok(m) => return Err(c.refuse(format!("expected FORWARD, got {}", m.name()))),
            Err(WireError::Closed) => {
                c.closed();
                return Ok(());
            }
            Err(WireError::Timeout) => return Err(anyhow!("idle or stalled for longer than the timeout")),
            Err(WireError::Malformed(m)) => return Err(c.refuse(m)),
            Err(e) => return Err(wire_err(e, "reading a request")),
        }
    }
}

struct Conn<'a> {
    s: TcpStream,
    st: &'a State,
    peer: &'a str,
}

/// The session this connection opened.
struct Opened {
    open: Open,
    range: Range<usize>,
    slot: SharedSlot,
}

impl Conn<'_> {
    /// HELLO (its version checked by the codec): answers CHALLENGE with this node's nonce. Returns both nonces, or
    /// `None` when the peer connected and closed without a word: a health check (`baton serve`'s router), not worth
    /// a log line.
    fn hello(&mut self) -> Result<Option<([u8; 32], [u8; 32])>> {
        let nonce_c = match self.read_handshake(wire::MAX_PREAUTH_FRAME) {
            Ok(Msg::Hello { nonce }) => nonce,
            Ok(m) => return Err(self.refuse(format!("expected HELLO, got {}", m.name()))),
            Err(WireError::Malformed(m)) => return Err(self.refuse(m)),
            Err(WireError::Closed) => return Ok(None),
            Err(WireError::Timeout) => return Err(self.stalled("HELLO")),
            Err(e) => return Err(wire_err(e, "reading HELLO")),
        };
        let nonce_n = auth::nonce();
        self.send(&Msg::Challenge {
            nonce: nonce_n,
            auth_required: self.st.cfg.secret.is_some(),
        })?;
        Ok(Some((nonce_c, nonce_n)))
    }

    /// AUTH: checks the peer's proof of the shared secret (when this node has one) and answers AUTH_OK with its own.
    fn auth(&mut self, (nonce_c, nonce_n): ([u8; 32], [u8; 32])) -> Result<()> {
        let mac = match self.read_handshake(wire::MAX_PREAUTH_FRAME) {
            Ok(Msg::Auth { mac }) => mac,
            Ok(m) => return Err(self.refuse(format!("expected AUTH, got {}", m.name()))),
            Err(WireError::Malformed(m)) => return Err(self.refuse(m)),
            Err(WireError::Timeout) => return Err(self.stalled("AUTH")),
            Err(e) => return Err(wire_err(e, "reading AUTH")),
        };
        let our_mac = match &self.st.cfg.secret {
            Some(secret) => {
                if !auth::verify(secret, auth::LABEL_COORDINATOR, &nonce_c, &nonce_n, &mac) {
                    return Err(self.refuse("authentication failed: wrong shared secret".into()));
                }
                auth::proof(secret, auth::LABEL_NODE, &nonce_c, &nonce_n)
            }
            None => [0; 32],
        };
        self.send(&Msg::AuthOk { mac: our_mac })
    }

    /// OPEN (model, layers, context, sampling): opens the session, or finds it again with its KV, and answers READY
    /// with the positions it holds.
    fn open(&mut self) -> Result<Opened> {
        let open = match self.read_handshake(wire::MAX_SMALL_FRAME) {
            Ok(Msg::Open(o)) => o,
            Ok(m) => return Err(self.refuse(format!("expected OPEN, got {}", m.name()))),
            Err(WireError::Malformed(m)) => return Err(self.refuse(m)),
            Err(e) => return Err(wire_err(e, "reading OPEN")),
        };
        let diffs = self.st.check_open(&open, self.peer);
        if !diffs.is_empty() {
            return Err(self.refuse(diffs.join("; ")));
        }
        let range = open.layers.0 as usize..open.layers.1 as usize;
        let key = (range.clone(), open.n_ctx as usize, open.n_batch as usize);
        let slot = match self.st.session(open.session, key, &open) {
            Ok(s) => s,
            Err(e) => {
                let msg = format!("cannot open layers {}:{}: {e:#}", range.start, range.end);
                return Err(self.refuse(msg));
            }
        };
        let n_past = lock(&slot).core.n_past();
        self.send(&Msg::Ready(Ready {
            model: self.st.info.clone(),
            layers: open.layers,
            n_ctx: open.n_ctx,
            n_past: n_past as u32,
            backend: crate::engine::placement::Placement::process_label().unwrap_or_default(),
            isa: crate::kernels::isa_label(),
        }))?;
        let _s = request_span(&open.request_id).entered();
        tracing::info!(
            "baton node: {} opened session {:016x} on layers {}:{} ({} positions held)",
            self.peer,
            open.session,
            range.start,
            range.end,
            n_past
        );
        Ok(Opened { open, range, slot })
    }

    /// FORWARD: one batch through the session's layers (a decode step batched with other sessions'), answered with
    /// RESULT, MISMATCH (the session does not hold the prefix) or ERROR.
    fn forward(&mut self, o: &Opened, f: Forward) -> Result<()> {
        let (n, e) = (f.tokens.len(), self.st.hp.n_embd);
        let bad = if n == 0 || n > o.open.n_batch as usize {
            Some(format!(
                "batch of {n} tokens, the session allows 1..={}",
                o.open.n_batch
            ))
        } else if let Some(h) = &f.hidden
            && (h.width as usize != e || h.n_rows as usize != n)
        {
            Some(format!("hidden state of {}x{}, expected {n}x{e}", h.n_rows, h.width))
        } else {
            None
        };
        if let Some(msg) = bad {
            return self.send(&Msg::Error { message: msg });
        }
        let hidden = f.hidden.as_ref().map(Hidden::decode);
        let reply = match self.st.forward(&o.slot, &o.range, &f, hidden.as_deref()) {
            Ok((StageOut::Mismatch(n_past), _)) => Msg::Mismatch {
                req: f.req,
                n_past: n_past as u32,
            },
            Ok((out, us)) => {
                let body = match out {
                    StageOut::Ack => Body::Ack,
                    StageOut::Hidden(h) => Body::Hidden(Hidden::encode(&h, e, o.open.wire)),
                    StageOut::Sample(sm) => Body::Sample {
                        token: sm.token,
                        logprob: sm.logprob,
                        top: sm.top,
                    },
                    StageOut::Logits(l) => Body::Logits(l),
                    StageOut::Mismatch(_) => unreachable!(),
                };
                Msg::Result(ResultMsg {
                    req: f.req,
                    compute_us: us,
                    body,
                })
            }
            Err(err) => Msg::Error {
                message: format!("{err:#}"),
            },
        };
        self.send(&reply)
    }

    /// PREFILL (disaggregated prefill): the KV streams back while the chunks compute (see handoff.rs).
    fn prefill(&mut self, o: &Opened, p: &Prefill) -> Result<()> {
        let drain = {
            let t_wait = Instant::now();
            let _c = lock(&self.st.compute);
            let queued = t_wait.elapsed();
            let mut g = lock(&o.slot);
            g.last_used = Instant::now();
            serve_prefill(&mut self.s, &mut g.core, p, queued, o.open.wire, self.st.disk.as_ref())?
        };
        drain.finish()
    }

    /// PULL (protocol 3): this node decodes; it pulls the prompt's KV from the prefill node named (disagg/pull.rs).
    /// Answered with PULL_REPORT and the first token's RESULT, MISMATCH or ERROR.
    fn pull(&mut self, o: &Opened, p: &Pull) -> Result<()> {
        let req = p.req;
        let replies = match self.st.pull(&o.slot, p) {
            Ok(Pulled::Mismatch(n_past)) => vec![Msg::Mismatch {
                req,
                n_past: n_past as u32,
            }],
            Ok(Pulled::Done {
                report,
                sample,
                compute_us,
            }) => vec![
                Msg::PullReport(report),
                Msg::Result(ResultMsg {
                    req,
                    compute_us,
                    body: Body::Sample {
                        token: sample.token,
                        logprob: sample.logprob,
                        top: sample.top,
                    },
                }),
            ],
            Err(e) => vec![Msg::Error {
                message: format!("{e:#}"),
            }],
        };
        replies.iter().try_for_each(|m| self.send(m))
    }

    /// EXPERTS (protocol 6, `--experts-split`): runs a MoE layer's picks for a coordinator that runs the layer's
    /// other experts and its attention itself; answered with EXPERTS_OUT, or ERROR naming what does not fit.
    fn experts(&mut self, o: &Opened, x: Experts) -> Result<()> {
        let e = self.st.hp.n_embd;
        let (n, w) = (x.rows.n_rows as usize, x.rows.width as usize);
        if w != e || n == 0 || n > o.open.n_batch as usize {
            let message = format!("EXPERTS rows of {n}x{w}, expected 1..={}x{e}", o.open.n_batch);
            return self.send(&Msg::Error { message });
        }
        let rows = x.rows.decode();
        let (out, us) = {
            let _c = lock(&self.st.compute);
            let t = Instant::now();
            let mut g = lock(&o.slot);
            g.last_used = Instant::now();
            let out = g.core.session_mut().serve_experts(x.layer as usize, &rows, &x.picks);
            (out, t.elapsed().as_micros() as u64)
        };
        let reply = match out {
            Ok(y) => Msg::ExpertsOut(ExpertsOut {
                req: x.req,
                compute_us: us,
                out: Hidden::encode(&y, e, o.open.wire),
            }),
            Err(err) => Msg::Error {
                message: format!("{err:#}"),
            },
        };
        self.send(&reply)
    }

    /// The peer closed: logs the node's batched decode so far once some step carried more than one session.
    fn closed(&self) {
        let (steps, rows) = self.st.batched();
        if rows > steps {
            tracing::info!(
                "baton node: {} closed; batched decode so far: {rows} rows in {steps} steps",
                self.peer
            );
        }
    }

    /// Reads a handshake message of at most `max` payload bytes: the I/O timeout for the first byte and again for
    /// the rest of the frame.
    fn read_handshake(&mut self, max: usize) -> Result<Msg, WireError> {
        let io = self.st.cfg.io_timeout;
        read_frame(&mut self.s, io, io, max)
    }

    /// The peer did not complete a handshake frame in time: told why (best effort), then dropped.
    fn stalled(&mut self, what: &str) -> anyhow::Error {
        let t = self.st.cfg.io_timeout.as_secs_f64();
        self.refuse(format!("{what} not received within {t:.1} s"))
    }

    fn send(&mut self, m: &Msg) -> Result<()> {
        wire::write_msg(&mut self.s, m).map_err(|e| wire_err(e, "sending"))?;
        Ok(())
    }

    /// Refuses the peer with a message (best effort) and ends the connection with that error.
    fn refuse(&mut self, msg: String) -> anyhow::Error {
        let _ = wire::write_msg(&mut self.s, &Msg::Error { message: msg.clone() });
        anyhow!(msg)
    }
}

/// Reads one message of at most `max` payload bytes. The first byte may take up to `first` (the idle wait); from
/// then on the whole rest of the frame has `io` in all (a deadline, not a per-read timeout, so a peer trickling a
/// byte at a time cannot hold the connection). A larger announced length is refused before anything is allocated,
/// and the payload buffer grows only as its bytes arrive.
fn read_frame(s: &mut TcpStream, first: Duration, io: Duration, max: usize) -> Result<Msg, WireError> {
    s.set_read_timeout(Some(first))?;
    let mut head = [0u8; wire::HEADER_LEN];
    s.read_exact(&mut head[..1])?;
    let deadline = Instant::now() + io;
    read_by(s, &mut head[1..], deadline)?;
    let (code, len) = wire::check_header(&head)?;
    if len > max {
        return Err(WireError::Malformed(format!(
            "{} frame of {len} bytes exceeds the limit of {max} bytes at this point of the connection",
            wire::type_name(code)
        )));
    }
    const STEP: usize = 1 << 20;
    let mut payload = Vec::new();
    while payload.len() < len {
        let got = payload.len();
        payload.resize((got + STEP).min(len), 0);
        read_by(s, &mut payload[got..], deadline)?;
    }
    Msg::decode(code, &payload)
}

/// Fills `buf` from `s` by `deadline`.
fn read_by(s: &mut TcpStream, buf: &mut [u8], deadline: Instant) -> Result<(), WireError> {
    let mut done = 0;
    while done < buf.len() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(WireError::Timeout);
        }
        s.set_read_timeout(Some(left))?;
        match s.read(&mut buf[done..]) {
            Ok(0) => return Err(WireError::Closed),
            Ok(n) => done += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

fn wire_err(e: WireError, what: &str) -> anyhow::Error {
    anyhow!("{what}: {e}")
}
