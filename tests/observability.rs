//! Following one request across machines: `baton serve` and the `baton-node` processes that serve a request (real
//! processes on loopback) each log its request id, the client's `X-Request-Id` or one the server assigns, and the
//! server returns it in `x-request-id`.

mod cluster_util;

use cluster_util::{NodeProc, ServeProc, smollm2, wait_for_line};
use serde_json::{Value, json};

/// One greedy 4-token chat request with extra header lines; the reply's `x-request-id`.
fn chat(srv: &ServeProc, q: &str, headers: &str) -> String {
    let body = json!({"model": "smollm2", "temperature": 0, "max_tokens": 4,
                      "messages": [{"role": "user", "content": q}]});
    let (code, head, text) = srv.exchange("POST", "/v1/chat/completions", &body.to_string(), headers);
    assert_eq!(code, 200, "{text}\nserver log:\n{}", srv.log());
    head.lines()
        .find_map(|l| {
            let (k, v) = l.split_once(':')?;
            k.eq_ignore_ascii_case("x-request-id").then(|| v.trim().to_string())
        })
        .unwrap_or_else(|| panic!("no x-request-id in:\n{head}"))
}

/// A text-format line naming `id` as its request.
fn names(line: &str, id: &str) -> bool {
    line.contains(&format!("request_id={id}"))
}

/// Whether a JSON-format line is an event whose spans name `id`.
fn json_names(line: &str, id: &str) -> bool {
    let Ok(v) = serde_json::from_str::<Value>(line) else {
        return false;
    };
    v["spans"]
        .as_array()
        .is_some_and(|s| s.iter().any(|s| s["request_id"] == id))
        && v["level"].is_string()
        && v["timestamp"].is_string()
}

/// `baton serve --cluster` routing to a decode node that pulls the prompt's KV from a prefill node: the client's id is in
/// the response header and in the logs of all three processes (the decode node logs JSON).
#[test]
fn request_id_reaches_the_router_the_decode_node_and_the_prefill_node() {
    let model = smollm2();
    let p = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let d = NodeProc::spawn(&model, "127.0.0.1:0", &["--log-format", "json"]);
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("cluster.toml");
    std::fs::write(
        &file,
        format!(
            "model = {:?}\noffload = \"always\"\n[[node]]\nname = \"p0\"\naddr = \"{}\"\nrole = \"prefill\"\n\
             [[node]]\nname = \"d0\"\naddr = \"{}\"\nrole = \"decode\"\nslots = 1\n",
            model.display().to_string(),
            p.addr,
            d.addr
        ),
    )
    .unwrap();
    let srv = ServeProc::start(&["-t", "1", "-c", "512", "-b", "32", "--cluster", file.to_str().unwrap()]);
    let id = "trace-7f3a:e2e.1";
    let q = "Once upon a time, in a quiet village by the sea, there lived an old fisherman named Tom.";
    assert_eq!(chat(&srv, q, &format!("X-Request-Id: {id}\r\n")), id);
    wait_for_line(
        "server",
        || srv.log(),
        |l| names(l, id) && l.contains("/v1/chat/completions 200"),
    );
    wait_for_line("decode node", || d.log(), |l| json_names(l, id));
    wait_for_line(
        "prefill node",
        || p.log(),
        |l| names(l, id) && l.contains("prefill of positions"),
    );
    // The decode node's log is JSON throughout.
    for l in d.log().lines() {
        assert!(serde_json::from_str::<Value>(l).is_ok(), "not JSON: {l}");
    }
}

/// `baton serve --pipeline` over a node: an id the server assigns (the client's is refused for its characters)
/// reaches the node on the connection's OPEN, and the next request's id on its first FORWARD over the same
/// connection.
#[test]
fn pipeline_node_logs_each_request_id() {
    let model = smollm2();
    let n = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let spec = format!("{}=0:15,local=15:end", n.addr);
    let srv = ServeProc::start(&[
        "-t",
        "1",
        "-c",
        "512",
        "-m",
        model.to_str().unwrap(),
        "--pipeline",
        &spec,
    ]);
    let first = chat(&srv, "Name a colour.", "X-Request-Id: not allowed!\r\n");
    assert!(
        baton::util::valid_request_id(&first) && first != "not allowed!",
        "{first:?}"
    );
    wait_for_line("node, first request", || n.log(), |l| names(l, &first));
    wait_for_line("server, first request", || srv.log(), |l| names(l, &first));
    let second = chat(&srv, "Name a fruit.", "X-Request-Id: second-request\r\n");
    assert_eq!(second, "second-request");
    wait_for_line("node, second request", || n.log(), |l| names(l, &second));
    let long = "x".repeat(baton::util::MAX_REQUEST_ID + 1);
    let third = chat(&srv, "Name a tree.", &format!("X-Request-Id: {long}\r\n"));
    assert_ne!(third, long, "an id over the length limit is replaced");
}

/// A draft model and an ensemble member on a node: each request's id reaches the node on the first frame of the
/// request, over the connection the server opened once, before any request.
#[test]
fn draft_and_ensemble_nodes_log_each_request_id() {
    let model = smollm2();
    let n = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let draft = format!("smollm2@{}", n.addr);
    let srv = ServeProc::start(&["-t", "1", "-c", "512", "--draft", &draft, "--draft-tokens", "2"]);
    for id in ["draft-request-1", "draft-request-2"] {
        assert_eq!(chat(&srv, "Name a colour.", &format!("X-Request-Id: {id}\r\n")), id);
        wait_for_line("draft node", || n.log(), |l| names(l, id));
    }
    drop(srv);
    let ensemble = format!("smollm2@local,smollm2@{}", n.addr);
    let srv = ServeProc::start(&["-t", "1", "-c", "512", "--ensemble", &ensemble]);
    let body = json!({"model": "smollm2+smollm2", "temperature": 0, "max_tokens": 4,
                      "messages": [{"role": "user", "content": "Name a fruit."}]});
    let (code, _, text) = srv.exchange(
        "POST",
        "/v1/chat/completions",
        &body.to_string(),
        "X-Request-Id: ensemble-request\r\n",
    );
    assert_eq!(code, 200, "{text}\nserver log:\n{}", srv.log());
    wait_for_line("ensemble member node", || n.log(), |l| names(l, "ensemble-request"));
}
