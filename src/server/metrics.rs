//! Prometheus text exposition of what the server did: requests by endpoint and status, tokens, TTFT and
//! inter-token latency histograms, routing decisions, wire bytes per peer. Gauges (queue depth, busy slots, node
//! health) are read from the scheduler when `/metrics` is scraped.

use crate::engine::batcher::BatchStats;
use std::collections::BTreeMap;
use std::fmt::Write;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Default)]
struct Hist {
    counts: [u64; BUCKETS.len()],
    count: u64,
    sum: f64,
}

#[derive(Default)]
pub struct Histogram(Mutex<Hist>);

impl Histogram {
    pub fn observe(&self, d: Duration) {
        let s = d.as_secs_f64();
        let mut h = self.0.lock().unwrap();
        for (i, b) in BUCKETS.iter().enumerate() {
            if s <= *b {
                h.counts[i] += 1;
            }
        }
        h.count += 1;
        h.sum += s;
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.0.lock().unwrap();
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
        for (i, b) in BUCKETS.iter().enumerate() {
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {}", h.counts[i]);
        }
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {}", h.count);
        let _ = writeln!(out, "{name}_sum {}\n{name}_count {}", h.sum, h.count);
    }
}

#[derive(Default)]
pub struct Metrics {
    /// (route label from a fixed set, status) → count.
    requests: Mutex<BTreeMap<(&'static str, u16), u64>>,
    pub prompt_tokens: AtomicU64,
    pub cached_tokens: AtomicU64,
    pub completion_tokens: AtomicU64,
    pub rejected: AtomicU64,
    pub cancelled: AtomicU64,
    pub retries: AtomicU64,
    pub ttft: Histogram,
    pub itl: Histogram,
    /// (node, reason) → requests routed.
    routes: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// peer → (bytes sent, bytes received).
    wire: Mutex<BTreeMap<String, (u64, u64)>>,
    /// (prefill node, counter) → value: requests offloaded / fallen back, tokens sent / held / caught up.
    prefill: Mutex<BTreeMap<(String, &'static str), u64>>,
    /// Batched decode steps of the local slots.
    pub batch: Arc<BatchStats>,
}

/// Gauges read at scrape time.
pub struct Gauges {
    pub queue_depth: usize,
    pub slots: usize,
    pub busy: usize,
    /// Why each slot out of service is (crashed and could not be restarted).
    pub dead: Vec<String>,
    /// (node label, up, busy slots, slots).
    pub nodes: Vec<(String, bool, usize, usize)>,
}

fn esc(s: &str) -> String {
    s.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Metrics {
    /// Counts one request under `label`: a `'static` route label (`routes::path_label`), never a path, so the
    /// series stay a fixed set whatever clients send.
    pub fn request(&self, label: &'static str, status: u16) {
        *self.requests.lock().unwrap().entry((label, status)).or_default() += 1;
    }
    pub fn route(&self, node: &str, reason: &'static str) {
        *self
            .routes
            .lock()
            .unwrap()
            .entry((node.to_string(), reason))
            .or_default() += 1;
    }
    pub fn wire(&self, peer: &str, sent: u64, recv: u64) {
        let mut w = self.wire.lock().unwrap();
        let e = w.entry(peer.to_string()).or_default();
        e.0 += sent;
        e.1 += recv;
    }
    /// One disaggregated prefill that used prefill node `node` (its KV bytes count as received from that peer).
    pub fn prefill(&self, node: &str, fallback: bool, sent: usize, held: usize, caught_up: usize, bytes: u64) {
        let mut p = self.prefill.lock().unwrap();
        let outcome = if fallback { "fallback" } else { "offloaded" };
        for (what, n) in [(outcome, 1), ("sent", sent), ("held", held), ("caught_up", caught_up)] {
            *p.entry((node.to_string(), what)).or_default() += n as u64;
        }
        drop(p);
        self.wire(node, 0, bytes);
    }
    pub fn add(c: &AtomicU64, n: usize) {
        c.fetch_add(n as u64, Ordering::Relaxed);
    }

    pub fn render(&self, g: &Gauges) -> String {
        let mut o = String::new();
        let _ = writeln!(o, "# HELP baton_requests_total HTTP requests by path and status.");
        let _ = writeln!(o, "# TYPE baton_requests_total counter");
        for ((path, status), n) in self.requests.lock().unwrap().iter() {
            let _ = writeln!(
                o,
                "baton_requests_total{{path=\"{}\",status=\"{status}\"}} {n}",
                esc(path)
            );
        }
        for (name, help, c) in [
            (
                "baton_prompt_tokens_total",
                "Prompt tokens of completed requests.",
                &self.prompt_tokens,
            ),
            (
                "baton_cached_prompt_tokens_total",
                "Prompt tokens served from a cached prefix.",
                &self.cached_tokens,
            ),
            (
                "baton_completion_tokens_total",
                "Tokens generated.",
                &self.completion_tokens,
            ),
            (
                "baton_rejected_total",
                "Requests refused with 429 because the queue was full.",
                &self.rejected,
            ),
            (
                "baton_cancelled_total",
                "Generations stopped because the client went away.",
                &self.cancelled,
            ),
            (
                "baton_retries_total",
                "Requests retried on another node after a failure before their first token.",
                &self.retries,
            ),
            (
                "baton_decode_steps_total",
                "Batched decode steps over the local slots.",
                &self.batch.steps,
            ),
            (
                "baton_decode_rows_total",
                "Sessions' tokens decoded in those steps (rows / steps: the mean batch size).",
                &self.batch.rows,
            ),
        ] {
            let _ = writeln!(
                o,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {}",
                c.load(Ordering::Relaxed)
            );
        }
        self.ttft.render(
            &mut o,
            "baton_ttft_seconds",
            "Time from request arrival to the first token.",
        );
        self.itl.render(
            &mut o,
            "baton_inter_token_seconds",
            "Time between consecutive tokens of a stream.",
        );
        let _ = writeln!(
            o,
            "# HELP baton_queue_depth Requests waiting for a slot.\n# TYPE baton_queue_depth gauge"
        );
        let _ = writeln!(o, "baton_queue_depth {}", g.queue_depth);
        let _ = writeln!(
            o,
            "# HELP baton_slots Sessions the server runs at once.\n# TYPE baton_slots gauge"
        );
        let _ = writeln!(o, "baton_slots {}", g.slots);
        let _ = writeln!(
            o,
            "# HELP baton_slots_busy Sessions generating now.\n# TYPE baton_slots_busy gauge"
        );
        let _ = writeln!(o, "baton_slots_busy {}", g.busy);
        let _ = writeln!(
            o,
            "# HELP baton_slots_dead Slots out of service (crashed, could not be restarted).\n# TYPE baton_slots_dead gauge"
        );
        let _ = writeln!(o, "baton_slots_dead {}", g.dead.len());
        let _ = writeln!(
            o,
            "# HELP baton_node_up Whether a node answers (1) or is taken out (0)."
        );
        let _ = writeln!(o, "# TYPE baton_node_up gauge");
        for (n, up, _, _) in &g.nodes {
            let _ = writeln!(o, "baton_node_up{{node=\"{}\"}} {}", esc(n), *up as u8);
        }
        let _ = writeln!(o, "# HELP baton_node_busy_slots Sessions generating now, per node.");
        let _ = writeln!(o, "# TYPE baton_node_busy_slots gauge");
        for (n, _, busy, _) in &g.nodes {
            let _ = writeln!(o, "baton_node_busy_slots{{node=\"{}\"}} {busy}", esc(n));
        }
        let _ = writeln!(
            o,
            "# HELP baton_routed_total Requests sent to a node, by why it was chosen."
        );
        let _ = writeln!(o, "# TYPE baton_routed_total counter");
        for ((n, why), c) in self.routes.lock().unwrap().iter() {
            let _ = writeln!(o, "baton_routed_total{{node=\"{}\",reason=\"{why}\"}} {c}", esc(n));
        }
        let p = self.prefill.lock().unwrap();
        let _ = writeln!(
            o,
            "# HELP baton_prefill_requests_total Prompts offloaded to a prefill node, by outcome (offloaded, or \
             fallback: prefilled by the decode side after the node failed).\n# TYPE baton_prefill_requests_total counter"
        );
        for ((n, what), c) in p.iter().filter(|((_, w), _)| matches!(*w, "offloaded" | "fallback")) {
            let _ = writeln!(
                o,
                "baton_prefill_requests_total{{node=\"{}\",outcome=\"{what}\"}} {c}",
                esc(n)
            );
        }
        let _ = writeln!(
            o,
            "# HELP baton_prefill_tokens_total Prompt tokens of offloaded prefills: sent (KV crossed the wire), held \
             (already on the decode side), caught_up (recomputed by the prefill node without sending).\n# TYPE \
             baton_prefill_tokens_total counter"
        );
        for ((n, what), c) in p
            .iter()
            .filter(|((_, w), _)| matches!(*w, "sent" | "held" | "caught_up"))
        {
            let _ = writeln!(
                o,
                "baton_prefill_tokens_total{{node=\"{}\",kind=\"{what}\"}} {c}",
                esc(n)
            );
        }
        drop(p);
        let _ = writeln!(
            o,
            "# HELP baton_wire_bytes_total Bytes exchanged with each remote peer."
        );
        let _ = writeln!(o, "# TYPE baton_wire_bytes_total counter");
        for (peer, (s, r)) in self.wire.lock().unwrap().iter() {
            let _ = writeln!(
                o,
                "baton_wire_bytes_total{{peer=\"{}\",direction=\"sent\"}} {s}",
                esc(peer)
            );
            let _ = writeln!(
                o,
                "baton_wire_bytes_total{{peer=\"{}\",direction=\"received\"}} {r}",
                esc(peer)
            );
        }
        o
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_is_cumulative() {
        let m = Metrics::default();
        m.ttft.observe(Duration::from_millis(3));
        m.ttft.observe(Duration::from_millis(300));
        m.request("/v1/completions", 200);
        let g = Gauges {
            queue_depth: 2,
            slots: 1,
            busy: 1,
            dead: Vec::new(),
            nodes: vec![("a\"b".into(), true, 1, 1)],
        };
        let s = m.render(&g);
        assert!(s.contains("baton_ttft_seconds_bucket{le=\"0.005\"} 1\n"), "{s}");
        assert!(s.contains("baton_ttft_seconds_bucket{le=\"0.5\"} 2\n"));
        assert!(s.contains("baton_ttft_seconds_count 2\n"));
        assert!(s.contains("baton_queue_depth 2\n"));
        assert!(s.contains("baton_requests_total{path=\"/v1/completions\",status=\"200\"} 1\n"));
        assert!(s.contains("baton_node_up{node=\"a\\\"b\"} 1\n"));
    }
}
