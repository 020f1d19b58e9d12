//! The coordinator's side of the handshake (the node's side is in [`super::node`]):
//!
//! 1. coordinator → HELLO {nonce_c}; node → CHALLENGE {nonce_n, auth_required} (or ERROR on a version mismatch);
//! 2. coordinator → AUTH {HMAC(secret, "…coordinator" ‖ nonce_c ‖ nonce_n)}; node → AUTH_OK {HMAC(secret, "…node" ‖ …)};
//! 3. coordinator → OPEN {model, layers, context, batch, wire precision, session, sampling}; node → READY {its model,
//!    layers, context, positions already held} or ERROR naming every difference. The coordinator checks READY the
//!    same way, so a mismatch is refused on both ends.

use super::auth;
use super::wire::{self, Msg, Open, Ready, WireError};
use anyhow::{Result, anyhow, bail};
use std::collections::HashMap;
use std::net::{TcpStream, ToSocketAddrs};
use std::sync::Mutex;
use std::time::Duration;

/// Addresses whose READY [`built`] remembers; a process dials those of its configuration (a decode node also those
/// its coordinator names), so this only bounds a misuse.
const MAX_BUILDS: usize = 256;

/// What every node this process opened a session on said in READY of where it computes, by the address dialled:
/// pipeline stages, decode and prefill nodes, remote drafts and ensemble members alike, read by the server's cluster
/// view without each connection's owner passing it on.
static BUILDS: Mutex<Option<HashMap<String, (String, String)>>> = Mutex::new(None);

fn remember_build(addr: &str, ready: &Ready) {
    let mut b = BUILDS.lock().unwrap_or_else(|p| p.into_inner());
    let map = b.get_or_insert_with(HashMap::new);
    if map.len() < MAX_BUILDS || map.contains_key(addr) {
        map.insert(addr.to_string(), (ready.backend.clone(), ready.isa.clone()));
    }
}

/// The session [`ask_build`] opens on a node: the same on every call, so asking again reuses it rather than taking
/// another of the node's `--max-sessions`.
const BUILD_SESSION: u64 = u64::from_le_bytes(*b"asklabel");

/// Opens a one-layer, one-position session on the node at `addr` only to read its READY into [`built`]: for a node
/// this process otherwise never opens a session on (a prefill node that only remote decode nodes pull from). The
/// session stays on the node, unused, as the first to go when it needs room.
pub fn ask_build(addr: &str, secret: Option<&[u8]>, model: wire::ModelInfo, t: Timeouts) -> Result<()> {
    let open = Open::unsampled(model, (0, 1), 1, 1, BUILD_SESSION);
    connect(addr, secret, &open, t).map(drop)
}

/// The backend and ISA the node at `addr` reported in its last READY to this process (`None`: never connected).
pub fn built(addr: &str) -> Option<(String, String)> {
    let b = BUILDS.lock().unwrap_or_else(|p| p.into_inner());
    b.as_ref().and_then(|m| m.get(addr).cloned())
}

#[derive(Clone, Copy, Debug)]
pub struct Timeouts {
    pub connect: Duration,
    /// Longest wait for any read or write, including a stage's compute.
    pub io: Duration,
}

impl Default for Timeouts {
    fn default() -> Self {
        Timeouts {
            connect: Duration::from_secs(5),
            io: Duration::from_secs(30),
        }
    }
}

/// Turns a wire error into a one-line message naming the peer and what we were doing.
pub fn describe(e: WireError, peer: &str, what: &str, timeout: Duration) -> anyhow::Error {
    match e {
        WireError::Timeout => anyhow!(
            "stage {peer} did not answer {what} within {:.1} s",
            timeout.as_secs_f64()
        ),
        WireError::Closed => {
            anyhow!("stage {peer} closed the connection during {what} (did it stop or restart?)")
        }
        WireError::Malformed(m) => {
            anyhow!("stage {peer} sent a malformed frame during {what}: {m}")
        }
        WireError::Io(io) => anyhow!("network error with stage {peer} during {what}: {io}"),
    }
}

/// An open, authenticated connection to a node serving one stage of a session.
pub struct Conn {
    pub stream: TcpStream,
    pub peer: String,
    pub timeouts: Timeouts,
    pub bytes_sent: u64,
    pub bytes_recv: u64,
}

impl Conn {
    pub fn send(&mut self, msg: &Msg, what: &str) -> Result<()> {
        let n = wire::write_msg(&mut self.stream, msg).map_err(|e| describe(e, &self.peer, what, self.timeouts.io))?;
        self.bytes_sent += n as u64;
        Ok(())
    }

    pub fn recv(&mut self, what: &str) -> Result<Msg> {
        let (m, n) = wire::read_msg(&mut self.stream).map_err(|e| describe(e, &self.peer, what, self.timeouts.io))?;
        self.bytes_recv += n as u64;
        if let Msg::Error { message } = &m {
            let message = crate::util::printable(message, 2000);
            bail!("stage {} refused {what}: {message}", self.peer);
        }
        Ok(m)
    }
}

/// Connects to `addr`, authenticates and opens the stage described by `open`.
pub fn connect(addr: &str, secret: Option<&[u8]>, open: &Open, t: Timeouts) -> Result<(Conn, Ready)> {
    let addrs: Vec<_> = addr
        .to_socket_addrs()
        .map_err(|e| anyhow!("cannot resolve stage address {addr}: {e}"))?
        .collect();
    let mut last = None;
    let mut stream = None;
    for a in &addrs {
        match TcpStream::connect_timeout(a, t.connect) {
            Ok(s) => {
                stream = Some(s);
                break;
            }
            Err(e) => last = Some(e),
        }
    }
    let Some(stream) = stream else {
        let why = last.map_or("no address".to_string(), |e| e.to_string());
        bail!(
            "cannot connect to stage {addr} within {:.1} s: {why}",
            t.connect.as_secs_f64()
        );
    };
    stream.set_nodelay(true)?;
    stream.set_read_timeout(Some(t.io))?;
    stream.set_write_timeout(Some(t.io))?;
    let mut c = Conn {
        stream,
        peer: addr.to_string(),
        timeouts: t,
        bytes_sent: 0,
        bytes_recv: 0,
    };

    let nonce_c = auth::nonce();
    c.send(&Msg::Hello { nonce: nonce_c }, "the handshake")?;
    let (nonce_n, required) = match c.recv("the handshake")? {
        Msg::Challenge { nonce, auth_required } => (nonce, auth_required),
        m => bail!("stage {addr} answered HELLO with {}", m.name()),
    };
    let mac = match (secret, required) {
        (None, true) => bail!("stage {addr} requires a shared secret (give the coordinator the node's --secret-file)"),
        (Some(_), false) => bail!(
            "stage {addr} does not ask for authentication but we have a secret; it cannot prove it knows it, refusing \
             (start the node with the same --secret-file)"
        ),
        (Some(s), true) => auth::proof(s, auth::LABEL_COORDINATOR, &nonce_c, &nonce_n),
        (None, false) => [0; 32],
    };
    c.send(&Msg::Auth { mac }, "authentication")?;
    match c.recv("authentication")? {
        Msg::AuthOk { mac } => {
            if let Some(s) = secret
                && !auth::verify(s, auth::LABEL_NODE, &nonce_c, &nonce_n, &mac)
            {
                bail!("stage {addr} failed to prove it knows the shared secret");
            }
        }
        m => bail!("stage {addr} answered AUTH with {}", m.name()),
    }

    c.send(&Msg::Open(open.clone()), "opening the session")?;
    let ready = match c.recv("opening the session")? {
        Msg::Ready(r) => r,
        m => bail!("stage {addr} answered OPEN with {}", m.name()),
    };
    let mut diffs = open.model.differences(&ready.model, "we", &format!("node {addr}"));
    if ready.layers != open.layers {
        diffs.push(format!(
            "node {addr} serves layers {}:{}, we asked for {}:{}",
            ready.layers.0, ready.layers.1, open.layers.0, open.layers.1
        ));
    }
    if ready.n_ctx < open.n_ctx {
        diffs.push(format!(
            "node {addr} has a context of {}, we need {}",
            ready.n_ctx, open.n_ctx
        ));
    }
    if !diffs.is_empty() {
        bail!("refusing stage {addr}: {}", diffs.join("; "));
    }
    remember_build(addr, &ready);
    Ok((c, ready))
}
