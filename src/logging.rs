//! Diagnostics through `tracing`: levels, `RUST_LOG` filters, and a text or JSON line per event on standard error.
//!
//! The text format is what Baton printed before it had levels: the message as is for `info`, with `warning:` /
//! `error:` / `debug:` before it otherwise, then the fields of the event and of its spans (`request_id=…`); no
//! timestamps (journald and `docker logs` add their own) and no colour. Control characters anywhere in a line are
//! escaped, so a peer-supplied string cannot start a forged line. JSON lines carry a timestamp, the level, the
//! target and every field, the spans' fields included.

use std::fmt;
use tracing::{Event, Level, Subscriber};
use tracing_subscriber::EnvFilter;
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields, FormattedFields};
use tracing_subscriber::registry::LookupSpan;

/// How events are written (`--log-format`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum LogFormat {
    #[default]
    Text,
    Json,
}

/// The filter when `RUST_LOG` is unset: Baton's own events at `info` and above.
const DEFAULT_FILTER: &str = "info";

/// Installs the process-wide subscriber; a second call (tests) changes nothing.
pub fn init(format: LogFormat) {
    let (filter, bad) = match std::env::var("RUST_LOG") {
        Ok(s) if !s.trim().is_empty() => match EnvFilter::try_new(&s) {
            Ok(f) => (f, None),
            Err(e) => (EnvFilter::new(DEFAULT_FILTER), Some(format!("{s:?}: {e}"))),
        },
        _ => (EnvFilter::new(DEFAULT_FILTER), None),
    };
    // No colour: spans' fields are formatted once, for every line, and a log file is no terminal.
    let b = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(false)
        .with_writer(std::io::stderr);
    let _ = match format {
        LogFormat::Text => b.event_format(Plain).try_init(),
        LogFormat::Json => b
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(true)
            .try_init(),
    };
    if let Some(bad) = bad {
        tracing::warn!("RUST_LOG {bad}; using {DEFAULT_FILTER:?}");
    }
}

/// The span every event of one request is logged in, so each line carries `request_id=…`; no span for an empty
/// id. Ids are checked by [`crate::util::valid_request_id`] wherever they enter (HTTP header, wire), so they are
/// written as they are.
pub fn request_span(id: &str) -> tracing::Span {
    if id.is_empty() {
        tracing::Span::none()
    } else {
        tracing::info_span!("request", request_id = %id)
    }
}

/// The text format (see the module's doc).
struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(&self, ctx: &FmtContext<'_, S, N>, mut w: Writer<'_>, event: &Event<'_>) -> fmt::Result {
        let mut line = String::new();
        line.push_str(match *event.metadata().level() {
            Level::ERROR => "error: ",
            Level::WARN => "warning: ",
            Level::INFO => "",
            Level::DEBUG => "debug: ",
            Level::TRACE => "trace: ",
        });
        ctx.format_fields(Writer::new(&mut line), event)?;
        if let Some(scope) = ctx.event_scope() {
            for span in scope.from_root() {
                let ext = span.extensions();
                if let Some(f) = ext.get::<FormattedFields<N>>()
                    && !f.is_empty()
                {
                    line.push(' ');
                    line.push_str(f);
                }
            }
        }
        writeln!(w, "{}", crate::util::printable(&line, usize::MAX))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_lines_carry_level_fields_and_span_fields() {
        use std::sync::{Arc, Mutex};
        #[derive(Clone, Default)]
        struct Buf(Arc<Mutex<Vec<u8>>>);
        impl std::io::Write for Buf {
            fn write(&mut self, b: &[u8]) -> std::io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> std::io::Result<()> {
                Ok(())
            }
        }
        let buf = Buf::default();
        let b2 = buf.clone();
        let sub = tracing_subscriber::fmt()
            .with_env_filter(EnvFilter::new("info"))
            .with_ansi(false)
            .with_writer(move || b2.clone())
            .event_format(Plain)
            .finish();
        tracing::subscriber::with_default(sub, || {
            let _s = tracing::info_span!("request", request_id = %"abc-1").entered();
            tracing::info!("serve: listening on http://x");
            tracing::warn!(node = ?"evil\nerror: forged", "node down");
            tracing::debug!("hidden at info");
        });
        let out = String::from_utf8(buf.0.lock().unwrap().clone()).unwrap();
        let lines: Vec<&str> = out.lines().collect();
        assert_eq!(lines.len(), 2, "{out}");
        assert_eq!(lines[0], "serve: listening on http://x request_id=abc-1");
        assert!(lines[1].starts_with("warning: node down node="), "{out}");
        assert!(lines[1].contains("request_id=abc-1"), "{out}");
        assert!(!out.contains("\nerror: forged"), "{out}");
    }
}
