//! `baton-node`: serves pipeline stages of one model (the same server as `baton node`).
//!
//! Usage: baton-node --model PATH --listen ADDR [--layers A:B] [--secret-file S] [-t N] [-c CTX] [-b BATCH]
//!        [--timeout SECS] [--idle-timeout SECS] [--max-sessions N] [--max-connections N] [--max-handshakes N]
//!        [--no-batch] [--kv-budget GIB] [--no-mem-check] [--experts-on-disk] [--kv-cache-dir DIR] [--kv-cache-size GIB]
//!        [--log-format text|json]

use anyhow::{Context, Result, bail};
use baton::cluster::{NodeConfig, auth, run_node};
use baton::logging::LogFormat;
use std::path::PathBuf;
use std::time::Duration;

/// A timeout flag's value, through the one checked parser.
fn timeout(flag: &str, v: &str) -> Result<Duration> {
    baton::util::parse_timeout(v).map_err(|e| anyhow::anyhow!("{flag}: {e}"))
}

/// A count flag's value: a whole number here; its range is checked with the others' by `NodeConfig::check`.
fn count(flag: &str, v: &str) -> Result<usize> {
    baton::util::parse_count(flag, v, 0..=u64::MAX)
}

fn main() {
    let json = std::env::args().any(|a| a == "--log-format=json")
        || std::env::args()
            .collect::<Vec<_>>()
            .windows(2)
            .any(|w| w[0] == "--log-format" && w[1] == "json");
    baton::logging::init(if json { LogFormat::Json } else { LogFormat::Text });
    if let Err(e) = real_main() {
        tracing::error!("baton-node: {e:#}");
        std::process::exit(1);
    }
}

fn real_main() -> Result<()> {
    let mut args = std::env::args().skip(1);
    let mut model = None;
    let mut listen = None;
    let mut cfg = NodeConfig::new(PathBuf::new(), "");
    while let Some(a) = args.next() {
        let mut val = || args.next().with_context(|| format!("{a} needs a value"));
        match a.as_str() {
            "--model" | "-m" => model = Some(PathBuf::from(val()?)),
            "--listen" => listen = Some(val()?),
            "--layers" => cfg.layers = Some(val()?),
            "--secret-file" => cfg.secret = Some(auth::load_secret(&PathBuf::from(val()?))?),
            "-t" | "--threads" => cfg.threads = count(&a, &val()?)?,
            "-c" | "--ctx-size" => cfg.max_ctx = count(&a, &val()?)?,
            "-b" | "--batch-size" => cfg.max_batch = count(&a, &val()?)?,
            "--max-sessions" => cfg.max_sessions = count(&a, &val()?)?,
            "--timeout" => cfg.io_timeout = timeout(&a, &val()?)?,
            "--idle-timeout" => cfg.idle_timeout = timeout(&a, &val()?)?,
            "--max-connections" => cfg.max_connections = count(&a, &val()?)?,
            "--max-handshakes" => cfg.max_handshakes = count(&a, &val()?)?,
            "--no-batch" => cfg.batch = false,
            "--kv-budget" => {
                let gib = baton::util::parse_gib(&val()?).map_err(|e| anyhow::anyhow!("{a}: {e}"))?;
                cfg.kv_budget = Some(baton::util::gib_bytes(gib));
            }
            "--no-mem-check" => cfg.no_mem_check = true,
            // SAFETY: set while parsing the arguments, before this process starts any thread; the loader reads it.
            "--experts-on-disk" => unsafe { std::env::set_var("BATON_EXPERTS_ON_DISK", "1") },
            "--kv-cache-dir" => cfg.kv_cache_dir = Some(PathBuf::from(val()?)),
            "--kv-cache-size" => {
                cfg.kv_cache_gib = baton::util::parse_gib(&val()?).map_err(|e| anyhow::anyhow!("{a}: {e}"))?
            }
            // Read by `main` before anything is logged.
            "--log-format" => match val()?.as_str() {
                "text" | "json" => {}
                v => bail!("--log-format: {v:?} is neither text nor json"),
            },
            "--log-format=text" | "--log-format=json" => {}
            "-h" | "--help" => {
                println!(
                    "baton-node --model PATH --listen ADDR [--layers A:B] [--secret-file S] [-t N] [-c CTX] [-b BATCH] \
                     [--timeout SECS] [--idle-timeout SECS] [--max-sessions N] [--max-connections N] \
                     [--max-handshakes N] [--no-batch] [--kv-budget GIB] [--no-mem-check] [--experts-on-disk] [--kv-cache-dir DIR] \
                     [--kv-cache-size GIB] [--log-format text|json]"
                );
                return Ok(());
            }
            other => bail!("unknown argument {other:?} (try --help)"),
        }
    }
    cfg.model = model.context("--model is required")?;
    cfg.listen = listen.context("--listen is required")?;
    run_node(cfg)
}
