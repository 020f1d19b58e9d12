//! `baton serve` with prefill nodes (real `baton serve` and `baton-node` processes on loopback): a local decode side
//! whose turn 2 offloads only the new suffix, and a router over 2 prefill + 2 decode nodes that keeps answering
//! while nodes die.

mod cluster_util;

use cluster_util::{NodeProc, ServeProc, smollm2, wait_for_line};
use serde_json::{Value, json};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// `baton serve` with one thread, a 512-token context and 32-token prompt batches, plus ARGS.
struct Server;

impl Server {
    fn start(args: &[&str]) -> ServeProc {
        ServeProc::start(&[&["-t", "1", "-c", "512", "-b", "32"], args].concat())
    }
}

/// A greedy 4-token chat request that must succeed.
fn chat(srv: &ServeProc, messages: Value) -> Value {
    let body = json!({"model": "smollm2", "temperature": 0, "max_tokens": 4, "messages": messages});
    let (code, text) = srv.http("POST", "/v1/chat/completions", &body.to_string());
    assert_eq!(code, 200, "{text}\nserver log:\n{}", srv.log());
    serde_json::from_str(&text).unwrap()
}

fn user(content: &str) -> Value {
    json!({"role": "user", "content": content})
}

fn reply(v: &Value) -> String {
    v["choices"][0]["message"]["content"].as_str().unwrap().to_string()
}

fn usage(v: &Value) -> (f64, f64) {
    let u = &v["usage"];
    (
        u["prompt_tokens"].as_f64().unwrap(),
        u["prompt_tokens_details"]["cached_tokens"].as_f64().unwrap(),
    )
}

/// `baton serve --prefill-node P`: the server decodes with its own model, P prefills. Turn 2 of a conversation keeps
/// turn 1 and the reply in the decode side's cache and sends only the new suffix's KV (the report, as metrics).
#[test]
fn serve_with_a_prefill_node_offloads_only_the_new_suffix() {
    let p = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let model = smollm2();
    let srv = Server::start(&[
        "-m",
        model.to_str().unwrap(),
        "--prefill-node",
        &p.addr,
        "--offload",
        "always",
    ]);
    let sent = |srv: &ServeProc, kind: &str| {
        srv.metric(&format!(
            "baton_prefill_tokens_total{{node=\"{}\",kind=\"{kind}\"}}",
            p.addr
        ))
    };
    let q1 = "Name three colours of the rainbow.";
    let a = chat(&srv, json!([user(q1)]));
    let (n1, cached1) = usage(&a);
    assert_eq!(cached1, 0.0);
    assert_eq!(
        sent(&srv, "sent"),
        n1,
        "turn 1: the whole prompt was prefilled remotely"
    );
    let bytes1 = srv.metric(&format!(
        "baton_wire_bytes_total{{peer=\"{}\",direction=\"received\"}}",
        p.addr
    ));
    // SmolLM2's KV is 23 KB per token at f16 (the default --kv-bits 16).
    assert!(bytes1 > n1 * 20_000.0, "{bytes1} bytes of KV for {n1} tokens");

    // The prefill node said where it computes when the server's decode side opened its session (READY).
    let (code, body) = srv.get("/v1/cluster");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let pn = v["nodes"].as_array().unwrap().iter().find(|n| n["role"] == "prefill");
    let pn = pn.unwrap_or_else(|| panic!("no prefill node: {v}"));
    assert_eq!((&pn["addr"], &pn["backend"]), (&json!(p.addr), &json!("cpu")), "{v}");
    assert!(pn["isa"].as_str().is_some_and(|s| !s.is_empty()), "{v}");

    let turn2 = json!([user(q1), {"role": "assistant", "content": reply(&a)}, user("And two more?")]);
    let b = chat(&srv, turn2);
    let (n2, cached2) = usage(&b);
    assert!(cached2 >= n1, "turn 2 keeps turn 1 (and its reply): {cached2} of {n2}");
    assert_eq!(
        sent(&srv, "sent") - n1,
        n2 - cached2,
        "only the new suffix crossed the wire"
    );
    assert_eq!(sent(&srv, "held"), cached2);
    assert_eq!(
        srv.metric(&format!(
            "baton_prefill_requests_total{{node=\"{}\",outcome=\"offloaded\"}}",
            p.addr
        )),
        2.0
    );
    // The same conversation on a plain local server gives the same replies.
    drop(srv);
    let local = Server::start(&["-m", model.to_str().unwrap()]);
    let a2 = chat(&local, json!([user(q1)]));
    assert_eq!(reply(&a2), reply(&a));
}

/// 2 prefill + 2 decode nodes behind the router: concurrent requests use both prefill nodes, a conversation's next
/// turn goes to the decode node holding its prefix (`/metrics`), and after a prefill node and then a decode node are
/// killed, requests still complete (prefill fallback / retry on the other decode node).
#[test]
fn router_over_two_prefill_and_two_decode_nodes() {
    let t_start = Instant::now();
    let model = smollm2();
    let mut p = [0, 1].map(|_| NodeProc::spawn(&model, "127.0.0.1:0", &[]));
    let mut d = [0, 1].map(|_| NodeProc::spawn(&model, "127.0.0.1:0", &[]));
    let dir = tempfile::tempdir().unwrap();
    let mut file = format!(
        "model = {:?}\noffload = \"always\"\nprefill_timeout = 5.0\n",
        model.display().to_string()
    );
    for (i, n) in p.iter().enumerate() {
        file.push_str(&format!(
            "[[node]]\nname = \"p{i}\"\naddr = \"{}\"\nrole = \"prefill\"\n",
            n.addr
        ));
    }
    for (i, n) in d.iter().enumerate() {
        file.push_str(&format!(
            "[[node]]\nname = \"d{i}\"\naddr = \"{}\"\nrole = \"decode\"\nslots = 1\n",
            n.addr
        ));
    }
    let path = dir.path().join("cluster.toml");
    std::fs::write(&path, file).unwrap();
    let srv = Arc::new(Server::start(&[
        "--cluster",
        path.to_str().unwrap(),
        "--node-timeout",
        "30",
    ]));
    let offloaded = |srv: &ServeProc, i: usize| {
        srv.metric(&format!(
            "baton_prefill_requests_total{{node=\"p{i}\",outcome=\"offloaded\"}}"
        ))
    };

    // Two conversations at once: one per decode node, each prefilled by a different prefill node.
    let story = "Once upon a time, in a quiet village by the sea, there lived an old fisherman named Tom.";
    let planets = "List the planets of the solar system in order from the sun.";
    let threads: Vec<_> = [story, planets]
        .map(|q| {
            let srv = srv.clone();
            std::thread::spawn(move || chat(&srv, json!([user(q)])))
        })
        .into_iter()
        .collect();
    let first: Vec<Value> = threads.into_iter().map(|t| t.join().unwrap()).collect();
    assert_eq!(
        (offloaded(&srv, 0), offloaded(&srv, 1)),
        (1.0, 1.0),
        "one prompt per prefill node"
    );
    let routed = |i: usize, why: &str| srv.metric(&format!("baton_routed_total{{node=\"d{i}\",reason=\"{why}\"}}"));
    assert_eq!(routed(0, "least_loaded") + routed(1, "least_loaded"), 2.0);

    // The decode nodes pulled the KV themselves and told the server how many bytes (PULL_REPORT): `/v1/cluster`
    // counts them on the links prefill node → decode node, the same bytes as `/metrics`, and each decode node says
    // where it computes (READY), as each prefill node does when the server asks it at start.
    let (code, body) = srv.get("/v1/cluster");
    assert_eq!(code, 200, "{body}");
    let v: Value = serde_json::from_str(&body).unwrap();
    let pulled = |pi: usize, dj: usize| {
        let l = v["links"]
            .as_array()
            .unwrap()
            .iter()
            .find(|l| l["a"] == format!("p{pi}") && l["b"] == format!("d{dj}"));
        l.unwrap_or_else(|| panic!("no link p{pi} → d{dj}: {v}"))["bytes_ab"]
            .as_u64()
            .unwrap()
    };
    for pi in 0..2 {
        let got = pulled(pi, 0) + pulled(pi, 1);
        let metric = srv.metric(&format!(
            "baton_wire_bytes_total{{peer=\"p{pi}\",direction=\"received\"}}"
        ));
        assert!(
            got > 0 && got as f64 == metric,
            "p{pi}: {got} bytes on its links, {metric} in /metrics: {v}"
        );
    }
    assert!(
        pulled(0, 0).min(pulled(0, 1)) == 0 && pulled(1, 0).min(pulled(1, 1)) == 0,
        "each prompt went from one prefill node to one decode node: {v}"
    );
    let kinds = |n: &&Value| n["role"] == "decode" || n["role"] == "prefill";
    assert_eq!(v["nodes"].as_array().unwrap().iter().filter(kinds).count(), 4, "{v}");
    for n in v["nodes"].as_array().unwrap().iter().filter(kinds) {
        assert_eq!(n["backend"], "cpu", "{v}");
        assert!(n["isa"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    }

    // The story's next turn: routed for its prefix, and the decode node only receives the new suffix's KV.
    let next = json!([user(story), {"role": "assistant", "content": reply(&first[0])}, user("What happened next?")]);
    let prefix_before = routed(0, "prefix") + routed(1, "prefix");
    let b = chat(&srv, next.clone());
    assert_eq!(
        routed(0, "prefix") + routed(1, "prefix"),
        prefix_before + 1.0,
        "prefix-affine routing"
    );
    let (n2, cached2) = usage(&b);
    assert!(cached2 > 20.0 && cached2 < n2, "{b}");

    // A prefill node dies: requests still complete (the one that hits it falls back; it is taken out).
    p[0].kill();
    for q in ["Say hello in French.", "Say hello in Spanish.", "Count to three."] {
        chat(&srv, json!([user(q)]));
    }
    wait_for_line("p0 taken out", || srv.log(), |l| l.contains("prefill node p0"));
    assert!(offloaded(&srv, 1) >= 2.0);
    // It comes back on the same address: the health check puts it back.
    let addr = p[0].addr.clone();
    p[0] = NodeProc::spawn(&model, &addr, &[]);
    let back = format!("prefill node p0 ({addr}) is back up");
    wait_for_line("p0 put back", || srv.log(), |l| l.contains(&back));

    // A decode node dies too: its requests are retried on the other one.
    d[0].kill();
    for q in ["Name a fruit.", "Name a tree."] {
        chat(&srv, json!([user(q)]));
    }
    assert_eq!(
        srv.metric("baton_requests_total{path=\"/v1/chat/completions\",status=\"200\"}"),
        8.0
    );
    eprintln!("router test took {:.1} s", t_start.elapsed().as_secs_f64());
    assert!(t_start.elapsed() < Duration::from_secs(120));
}
