//! Small helpers shared by every layer: atomic file writes, the model cache directory, byte progress bars, hex.
//! The cache directory lives here, not in [`crate::fetch`], so that the model layer (fingerprints cached beside
//! the models) does not depend on the downloader.

use anyhow::{Context, Result, anyhow, bail};
use indicatif::{ProgressBar, ProgressStyle};
use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};

/// Writes `bytes` to `path` atomically: a temporary file in the same directory, fsynced, then renamed over the
/// target, so a crash or a full disk never leaves a half-written file under the final name.
pub fn write_atomic(path: &Path, bytes: &[u8]) -> Result<()> {
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let mut tmp = tempfile::NamedTempFile::new_in(dir)
        .with_context(|| format!("cannot create a temporary file in {}", dir.display()))?;
    tmp.write_all(bytes)
        .with_context(|| format!("cannot write {}", path.display()))?;
    tmp.as_file().sync_all().ok();
    tmp.persist(path)
        .with_context(|| format!("cannot rename into {}", path.display()))?;
    Ok(())
}

/// The model cache directory (created if missing): `$BATON_MODELS`, else `<user cache dir>/baton/models`.
pub fn models_dir() -> Result<PathBuf> {
    let dir = match std::env::var_os("BATON_MODELS") {
        Some(d) if !d.is_empty() => PathBuf::from(d),
        _ => dirs::cache_dir()
            .ok_or_else(|| anyhow!("cannot find the user cache directory; set BATON_MODELS to a writable directory"))?
            .join("baton")
            .join("models"),
    };
    ensure_dir(&dir)?;
    Ok(dir)
}

pub(crate) fn ensure_dir(dir: &Path) -> Result<()> {
    fs::create_dir_all(dir).map_err(|e| anyhow!("cannot create model cache directory {}: {e}", dir.display()))?;
    if !dir.is_dir() {
        bail!("model cache directory {} is not a directory", dir.display());
    }
    Ok(())
}

/// A byte progress bar on stderr (drawn only when stderr is a terminal).
pub fn byte_bar(len: u64, msg: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template("{msg} [{bar:30}] {bytes}/{total_bytes} {bytes_per_sec} eta {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(msg.to_owned());
    bar
}

/// A counted progress bar on stderr (`msg [====>   ] 3/17 UNIT eta 4s`), drawn only when stderr is a terminal
/// (indicatif's stderr target checks), so logs and pipes never see it. Every long job's progress goes through this
/// or [`byte_bar`].
pub fn count_bar(len: u64, msg: &str, unit: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!("{{msg}} [{{bar:30}}] {{pos}}/{{len}} {unit} eta {{eta}}"))
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    bar.set_message(msg.to_owned());
    bar
}

/// Lower-case hex of `bytes` (digests).
pub fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    let mut s = String::with_capacity(bytes.len() * 2);
    for b in bytes {
        let _ = write!(s, "{b:02x}");
    }
    s
}

/// Longest timeout any flag or request may ask for: a week (longer is a typo, and Duration would overflow at 2^64 s).
pub const MAX_TIMEOUT_SECS: f64 = 7.0 * 24.0 * 3600.0;

/// The one checked parser of a timeout given in seconds (CLI flags, the HTTP API, config files): a finite number
/// above zero and at most [`MAX_TIMEOUT_SECS`]. Zero is refused because a zero wait fails every operation at once;
/// NaN, negative and infinite values because `Duration` cannot hold them.
pub fn timeout_secs(secs: f64) -> Result<std::time::Duration> {
    if !secs.is_finite() || secs <= 0.0 || secs > MAX_TIMEOUT_SECS {
        bail!("timeout {secs} s must be a number of seconds above 0 and at most {MAX_TIMEOUT_SECS}");
    }
    Ok(std::time::Duration::from_secs_f64(secs))
}

/// [`timeout_secs`] from text: clap's `value_parser` for every timeout flag.
pub fn parse_timeout(s: &str) -> std::result::Result<std::time::Duration, String> {
    let secs: f64 = s
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a number of seconds"))?;
    timeout_secs(secs).map_err(|e| e.to_string())
}

/// Largest counts an operator may ask for, one table for every front end (CLI flags, `baton-node`, the cluster
/// file, `NodeConfig`): far above any real use, low enough that no product of them overflows or asks the allocator
/// for an absurd size before a clear error.
pub mod limits {
    /// Threads of a pool (`-t`).
    pub const MAX_THREADS: u64 = 1024;
    /// Tokens of a context (`-c`, a bench depth, an OPEN's context).
    pub const MAX_CTX: u64 = 1 << 20;
    /// Tokens per forward pass (`-b`).
    pub const MAX_BATCH: u64 = 1 << 16;
    /// Sessions generating at once in a server (`--parallel`, a decode node's `slots`).
    pub const MAX_SLOTS: u64 = 256;
    /// Requests waiting for a slot (`--queue`).
    pub const MAX_QUEUE: u64 = 65536;
    /// HTTP connections a server keeps open (`--max-connections` of `serve`).
    pub const MAX_HTTP_CONNECTIONS: u64 = 65536;
    /// A node's sessions kept, connections and handshakes at once.
    pub const MAX_NODE_COUNT: u64 = 4096;
    /// GiB any size flag may name (`--kv-cache-size`, `--kv-budget`): a PiB.
    pub const MAX_GIB: f64 = (1u64 << 20) as f64;
}

/// The one checked conversion of an operator count: `v` within `range`, or an error naming `what` (the flag or
/// field as the operator wrote it).
pub fn count_in(what: &str, v: u64, range: std::ops::RangeInclusive<u64>) -> Result<usize> {
    if !range.contains(&v) {
        bail!("{what} must be in {}..={}, not {v}", range.start(), range.end());
    }
    usize::try_from(v).map_err(|_| anyhow!("{what}: {v} does not fit this machine"))
}

/// [`count_in`] from text (`baton-node`'s hand-written flags).
pub fn parse_count(what: &str, s: &str, range: std::ops::RangeInclusive<u64>) -> Result<usize> {
    let v: u64 = s
        .trim()
        .parse()
        .map_err(|_| anyhow!("{what}: {s:?} is not a whole number"))?;
    count_in(what, v, range)
}

/// A size in GiB for a flag: finite, above zero, at most [`limits::MAX_GIB`]; clap's `value_parser`.
pub fn parse_gib(s: &str) -> std::result::Result<f64, String> {
    let gib: f64 = s.trim().parse().map_err(|_| format!("{s:?} is not a number of GiB"))?;
    if !(gib.is_finite() && gib > 0.0 && gib <= limits::MAX_GIB) {
        return Err(format!("{gib} GiB must be above 0 and at most {}", limits::MAX_GIB));
    }
    Ok(gib)
}

/// Bytes of `gib` GiB (a value [`parse_gib`] accepted).
pub fn gib_bytes(gib: f64) -> u64 {
    (gib * (1u64 << 30) as f64) as u64
}

/// `s` fit for one log line when it may come from a peer: control characters (newlines, terminal escapes)
/// escaped, at most `max` characters kept, so a peer can neither forge log lines nor flood them.
pub fn printable(s: &str, max: usize) -> String {
    let mut out = String::with_capacity(s.len().min(max) + 8);
    for (i, c) in s.chars().enumerate() {
        if i == max {
            out.push('…');
            break;
        }
        if c.is_control() {
            out.extend(c.escape_default());
        } else {
            out.push(c);
        }
    }
    out
}

/// Longest request id carried in logs, the `x-request-id` header and the wire protocol.
pub const MAX_REQUEST_ID: usize = 64;

/// Whether `s` may serve as a request id: 1 to [`MAX_REQUEST_ID`] ASCII letters, digits, `-`, `_`, `.` or `:`, so
/// it can go into a log line, a header or a frame as is.
pub fn valid_request_id(s: &str) -> bool {
    !s.is_empty()
        && s.len() <= MAX_REQUEST_ID
        && s.bytes()
            .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'-' | b'_' | b'.' | b':'))
}

/// A fresh request id: 16 random hex digits.
pub fn new_request_id() -> String {
    format!("{:016x}", rand::random::<u64>())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn request_ids_are_short_and_plain() {
        assert!(valid_request_id("abc-123_X.y:z"));
        assert!(valid_request_id(&new_request_id()));
        assert!(valid_request_id(&"a".repeat(MAX_REQUEST_ID)));
        for bad in ["", "a b", "a\nb", "é", "a\"b", &"a".repeat(MAX_REQUEST_ID + 1)] {
            assert!(!valid_request_id(bad), "{bad:?} accepted");
        }
    }

    #[test]
    fn peer_text_is_one_bounded_line() {
        assert_eq!(printable("a\nb\x1b[31m", 100), "a\\nb\\u{1b}[31m");
        assert_eq!(printable(&"x".repeat(500), 10), format!("{}…", "x".repeat(10)));
    }

    #[test]
    fn timeouts_outside_zero_to_a_week_are_refused() {
        for bad in ["nan", "NaN", "-1", "0", "0.0", "inf", "1e300", "x", ""] {
            assert!(parse_timeout(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(parse_timeout("1.5").unwrap(), std::time::Duration::from_millis(1500));
        assert_eq!(parse_timeout(" 30 ").unwrap(), std::time::Duration::from_secs(30));
    }

    #[test]
    fn counts_and_sizes_outside_their_range_are_refused_by_name() {
        let e = count_in("--max-sessions", 0, 1..=4096).unwrap_err().to_string();
        assert!(e.contains("--max-sessions") && e.contains("1..=4096"), "{e}");
        assert_eq!(count_in("x", 4096, 1..=4096).unwrap(), 4096);
        for bad in ["-1", "1e3", "x", "", "99999999999999999999999"] {
            let e = parse_count("-c", bad, 1..=limits::MAX_CTX).unwrap_err().to_string();
            assert!(e.contains("-c"), "{bad}: {e}");
        }
        assert!(parse_count("-c", "2000000", 1..=limits::MAX_CTX).is_err());
        assert_eq!(parse_count("-c", " 4096 ", 1..=limits::MAX_CTX).unwrap(), 4096);
        for bad in ["nan", "inf", "0", "-2", "1e300", "x"] {
            assert!(parse_gib(bad).is_err(), "{bad} accepted");
        }
        assert_eq!(parse_gib("0.5").unwrap(), 0.5);
    }
}
