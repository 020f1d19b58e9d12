//! Whether nodes answer: the one probe and health loop shared by the server's node slots and the prefill pool.

use anyhow::{Result, anyhow};
use std::net::ToSocketAddrs;
use std::time::Duration;

/// Whether `addr` accepts a TCP connection within a second (a node ignores a connection closed without a word).
pub fn probe(addr: &str) -> Result<()> {
    let sa = addr
        .to_socket_addrs()?
        .next()
        .ok_or_else(|| anyhow!("{addr} resolves to no address"))?;
    std::net::TcpStream::connect_timeout(&sa, Duration::from_secs(1))?;
    Ok(())
}

/// On a thread named `name`, probes each `(key, addr)` of `targets` once per `every` and tells `report(key,
/// result)`; the thread ends when `report` returns false (its owner is gone).
pub fn spawn_loop(
    name: &str,
    targets: Vec<(usize, String)>,
    every: Duration,
    report: impl Fn(usize, Result<()>) -> bool + Send + 'static,
) -> Result<()> {
    std::thread::Builder::new().name(name.into()).spawn(move || {
        loop {
            for (key, addr) in &targets {
                if !report(*key, probe(addr)) {
                    return;
                }
            }
            std::thread::sleep(every);
        }
    })?;
    Ok(())
}
