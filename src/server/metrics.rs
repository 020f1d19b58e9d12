//! What the server did, for Prometheus, through the `prometheus-client` crate: requests by route and status,
//! tokens, TTFT and inter-token latency histograms, routing decisions, prefill offloads, wire bytes and link rates
//! per peer. Gauges (queue depth, busy slots, node health) are set from the scheduler when `/metrics` is scraped.
//!
//! Every label value comes from a fixed set: routes from [`crate::server::routes::path_label`], nodes and peers from
//! the topology the server was started with, reasons and outcomes from constants. What a client sends never
//! becomes a label, so the exposition stays bounded.

use crate::engine::batcher::BatchStats;
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeLabelSet, EncodeMetric};
use prometheus_client::metrics::counter::{ConstCounter, Counter};
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::Histogram;
use prometheus_client::registry::Registry;
use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

/// The `Content-Type` of what [`Metrics::render`] returns (Prometheus text, version 0.0.4).
pub const CONTENT_TYPE: &str = prometheus_client::encoding::prometheus_text::CONTENT_TYPE;

/// Upper bounds (seconds) of the latency histograms' buckets.
const BUCKETS: [f64; 14] = [
    0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0,
];

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RequestLabels {
    path: &'static str,
    status: u16,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct NodeLabels {
    node: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct RouteLabels {
    node: String,
    reason: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct OutcomeLabels {
    node: String,
    outcome: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct KindLabels {
    node: String,
    kind: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WireLabels {
    peer: String,
    direction: &'static str,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PeerLabels {
    peer: String,
}

type FloatGauge = Gauge<f64, AtomicU64>;

pub struct Metrics {
    registry: Registry,
    requests: Family<RequestLabels, Counter>,
    pub prompt_tokens: Counter,
    pub cached_tokens: Counter,
    pub completion_tokens: Counter,
    pub rejected: Counter,
    pub cancelled: Counter,
    pub retries: Counter,
    ttft: Histogram,
    itl: Histogram,
    routes: Family<RouteLabels, Counter>,
    wire: Family<WireLabels, Counter>,
    prefill_requests: Family<OutcomeLabels, Counter>,
    prefill_tokens: Family<KindLabels, Counter>,
    link_rate: Family<PeerLabels, FloatGauge>,
    queue_depth: Gauge,
    slots: Gauge,
    busy: Gauge,
    dead: Gauge,
    node_up: Family<NodeLabels, Gauge>,
    node_busy: Family<NodeLabels, Gauge>,
    node_slots: Family<NodeLabels, Gauge>,
    node_speed: Family<NodeLabels, FloatGauge>,
    /// Batched decode steps of the local slots (the batcher counts them; read at scrape time).
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

/// The batcher's counters, encoded as they stand when scraped.
struct BatchCollector(Arc<BatchStats>);

impl std::fmt::Debug for BatchCollector {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("BatchCollector")
    }
}

impl Collector for BatchCollector {
    fn encode(&self, mut enc: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        for (name, help, c) in [
            (
                "baton_decode_steps",
                "Batched decode steps over the local slots.",
                &self.0.steps,
            ),
            (
                "baton_decode_rows",
                "Sessions' tokens decoded in those steps (rows / steps: the mean batch size).",
                &self.0.rows,
            ),
        ] {
            let counter = ConstCounter::new(c.load(Ordering::Relaxed));
            counter.encode(enc.encode_descriptor(name, help, None, counter.metric_type())?)?;
        }
        Ok(())
    }
}

fn as_i64(n: usize) -> i64 {
    i64::try_from(n).unwrap_or(i64::MAX)
}

impl Default for Metrics {
    fn default() -> Self {
        let mut r = Registry::default();
        let m = Metrics {
            requests: Family::default(),
            prompt_tokens: Counter::default(),
            cached_tokens: Counter::default(),
            completion_tokens: Counter::default(),
            rejected: Counter::default(),
            cancelled: Counter::default(),
            retries: Counter::default(),
            ttft: Histogram::new(BUCKETS),
            itl: Histogram::new(BUCKETS),
            routes: Family::default(),
            wire: Family::default(),
            prefill_requests: Family::default(),
            prefill_tokens: Family::default(),
            link_rate: Family::default(),
            queue_depth: Gauge::default(),
            slots: Gauge::default(),
            busy: Gauge::default(),
            dead: Gauge::default(),
            node_up: Family::default(),
            node_busy: Family::default(),
            node_slots: Family::default(),
            node_speed: Family::default(),
            batch: Arc::default(),
            registry: Registry::default(),
        };
        // `register` adds `_total` to counters' names and a full stop to each help text.
        r.register("baton_requests", "HTTP requests by path and status", m.requests.clone());
        r.register(
            "baton_prompt_tokens",
            "Prompt tokens of completed requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "baton_cached_prompt_tokens",
            "Prompt tokens served from a cached prefix",
            m.cached_tokens.clone(),
        );
        r.register(
            "baton_completion_tokens",
            "Tokens generated",
            m.completion_tokens.clone(),
        );
        r.register(
            "baton_rejected",
            "Requests refused with 429 because the queue was full",
            m.rejected.clone(),
        );
        r.register(
            "baton_cancelled",
            "Generations stopped because the client went away",
            m.cancelled.clone(),
        );
        r.register(
            "baton_retries",
            "Requests retried on another node after a failure before their first token",
            m.retries.clone(),
        );
        r.register_collector(Box::new(BatchCollector(m.batch.clone())));
        r.register(
            "baton_ttft_seconds",
            "Time from request arrival to the first token",
            m.ttft.clone(),
        );
        r.register(
            "baton_inter_token_seconds",
            "Time between consecutive tokens of a stream",
            m.itl.clone(),
        );
        r.register(
            "baton_queue_depth",
            "Requests waiting for a slot",
            m.queue_depth.clone(),
        );
        r.register("baton_slots", "Sessions the server runs at once", m.slots.clone());
        r.register("baton_slots_busy", "Sessions generating now", m.busy.clone());
        r.register(
            "baton_slots_dead",
            "Slots out of service (crashed, could not be restarted)",
            m.dead.clone(),
        );
        r.register(
            "baton_node_up",
            "Whether a node answers (1) or is taken out (0)",
            m.node_up.clone(),
        );
        r.register(
            "baton_node_busy_slots",
            "Sessions generating now, per node (the node's requests in flight)",
            m.node_busy.clone(),
        );
        r.register(
            "baton_node_slots",
            "Sessions a node runs at once (its share of the server's slots)",
            m.node_slots.clone(),
        );
        r.register(
            "baton_node_tokens_per_second",
            "Decode speed of the last request a node finished, tokens per second",
            m.node_speed.clone(),
        );
        r.register(
            "baton_routed",
            "Requests sent to a node, by why it was chosen",
            m.routes.clone(),
        );
        r.register(
            "baton_prefill_requests",
            "Prompts offloaded to a prefill node, by outcome (offloaded, or fallback: prefilled by the decode side \
             after the node failed)",
            m.prefill_requests.clone(),
        );
        r.register(
            "baton_prefill_tokens",
            "Prompt tokens of offloaded prefills: sent (KV crossed the wire), held (already on the decode side), \
             caught_up (recomputed by the prefill node without sending)",
            m.prefill_tokens.clone(),
        );
        r.register(
            "baton_wire_bytes",
            "Bytes exchanged with each remote peer",
            m.wire.clone(),
        );
        r.register(
            "baton_link_bytes_per_second",
            "Measured rate of the last KV stream from each prefill node, bytes per second",
            m.link_rate.clone(),
        );
        Metrics { registry: r, ..m }
    }
}

impl Metrics {
    /// Counts one request under `label`: a `'static` route label (`routes::path_label`), never a path, so the
    /// series stay a fixed set whatever clients send.
    pub fn request(&self, label: &'static str, status: u16) {
        self.requests
            .get_or_create(&RequestLabels { path: label, status })
            .inc();
    }
    pub fn route(&self, node: &str, reason: &'static str) {
        self.routes
            .get_or_create(&RouteLabels {
                node: node.to_string(),
                reason,
            })
            .inc();
    }
    pub fn wire(&self, peer: &str, sent: u64, recv: u64) {
        for (direction, n) in [("sent", sent), ("received", recv)] {
            self.wire
                .get_or_create(&WireLabels {
                    peer: peer.to_string(),
                    direction,
                })
                .inc_by(n);
        }
    }
    pub fn ttft(&self, d: Duration) {
        self.ttft.observe(d.as_secs_f64());
    }
    pub fn inter_token(&self, d: Duration) {
        self.itl.observe(d.as_secs_f64());
    }
    /// The decode speed of a request node `node` just finished.
    pub fn node_speed(&self, node: &str, tokens: usize, t: Duration) {
        if tokens > 0 && t > Duration::ZERO {
            self.node_speed
                .get_or_create(&NodeLabels { node: node.to_string() })
                .set(tokens as f64 / t.as_secs_f64());
        }
    }
    /// One disaggregated prefill that used prefill node `node` (its KV bytes count as received from that peer; a
    /// stream that moved bytes sets the node's link rate).
    pub fn prefill(&self, node: &str, fallback: bool, counts: [usize; 3], bytes: u64, link_rate: f64) {
        let outcome = if fallback { "fallback" } else { "offloaded" };
        self.prefill_requests
            .get_or_create(&OutcomeLabels {
                node: node.to_string(),
                outcome,
            })
            .inc();
        for (kind, n) in ["sent", "held", "caught_up"].into_iter().zip(counts) {
            self.prefill_tokens
                .get_or_create(&KindLabels {
                    node: node.to_string(),
                    kind,
                })
                .inc_by(n as u64);
        }
        self.wire(node, 0, bytes);
        if bytes > 0 && link_rate.is_finite() && link_rate > 0.0 {
            self.link_rate
                .get_or_create(&PeerLabels { peer: node.to_string() })
                .set(link_rate);
        }
    }

    /// The exposition, with the gauges set from `g` first.
    pub fn render(&self, g: &Gauges) -> String {
        self.queue_depth.set(as_i64(g.queue_depth));
        self.slots.set(as_i64(g.slots));
        self.busy.set(as_i64(g.busy));
        self.dead.set(as_i64(g.dead.len()));
        for (n, up, busy, slots) in &g.nodes {
            let l = NodeLabels { node: n.clone() };
            self.node_up.get_or_create(&l).set(*up as i64);
            self.node_busy.get_or_create(&l).set(as_i64(*busy));
            self.node_slots.get_or_create(&l).set(as_i64(*slots));
        }
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::prometheus_text::encode(&mut out, &self.registry);
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exposition_keeps_names_labels_and_buckets() {
        let m = Metrics::default();
        m.ttft(Duration::from_millis(3));
        m.ttft(Duration::from_millis(300));
        m.request("/v1/completions", 200);
        m.completion_tokens.inc_by(7);
        m.batch.steps.fetch_add(3, Ordering::Relaxed);
        m.prefill("p0", false, [10, 2, 1], 4096, 1e6);
        m.node_speed("a\"b", 20, Duration::from_secs(2));
        let g = Gauges {
            queue_depth: 2,
            slots: 1,
            busy: 1,
            dead: vec!["slot 0: gone".into()],
            nodes: vec![("a\"b".into(), true, 1, 1)],
        };
        let s = m.render(&g);
        for want in [
            "baton_ttft_seconds_bucket{le=\"0.005\"} 1\n",
            "baton_ttft_seconds_bucket{le=\"0.5\"} 2\n",
            "baton_ttft_seconds_bucket{le=\"+Inf\"} 2\n",
            "baton_ttft_seconds_count 2\n",
            "baton_queue_depth 2\n",
            "baton_slots_dead 1\n",
            "baton_completion_tokens_total 7\n",
            "baton_decode_steps_total 3\n",
            "baton_requests_total{path=\"/v1/completions\",status=\"200\"} 1\n",
            "baton_node_up{node=\"a\\\"b\"} 1\n",
            "baton_node_slots{node=\"a\\\"b\"} 1\n",
            "baton_node_tokens_per_second{node=\"a\\\"b\"} 10",
            "baton_prefill_tokens_total{node=\"p0\",kind=\"sent\"} 10\n",
            "baton_prefill_requests_total{node=\"p0\",outcome=\"offloaded\"} 1\n",
            "baton_wire_bytes_total{peer=\"p0\",direction=\"received\"} 4096\n",
            "baton_link_bytes_per_second{peer=\"p0\"} 1000000",
            "# TYPE baton_requests_total counter\n",
            "# HELP baton_queue_depth Requests waiting for a slot.\n",
        ] {
            assert!(s.contains(want), "no {want:?} in:\n{s}");
        }
        assert!(!s.contains("# EOF"), "{s}");
    }
}
