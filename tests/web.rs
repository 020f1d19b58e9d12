//! The page at `/`, `GET /v1/cluster` and `baton cluster status` against a real two-node topology on loopback: a
//! `baton-node` holding layers 0..15 and `baton serve` computing the rest (`--pipeline ADDR=0:15,local=15:end`).
//! The browser test drives Debian's Chromium through `tests/js/web.mjs`; it prints SKIPPED only when Node.js,
//! Chromium or `tests/js/node_modules` are missing.

mod cluster_util;

use cluster_util::{NodeProc, ServeProc, smollm2};
use serde_json::{Value, json};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

const KEY: &str = "web-test-key";

/// A node with the first half of SmolLM2's 30 layers and a server with the second half, behind an API key.
fn two_nodes() -> (NodeProc, ServeProc) {
    let model = smollm2();
    let node = NodeProc::spawn(&model, "127.0.0.1:0", &[]);
    let spec = format!("{}=0:15,local=15:end", node.addr);
    let srv = ServeProc::start(&[
        "--model",
        model.to_str().unwrap(),
        "-t",
        "1",
        "-c",
        "512",
        "--pipeline",
        &spec,
        "--api-key",
        KEY,
    ]);
    (node, srv)
}

fn auth() -> String {
    format!("Authorization: Bearer {KEY}\r\n")
}

fn cluster(srv: &ServeProc) -> Value {
    let (code, body) = srv.http_with("GET", "/v1/cluster", "", &auth());
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).unwrap()
}

/// `baton ARGS` within 60 s: exit status and standard output.
fn baton(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn cluster_endpoint_and_cli_show_both_nodes_their_link_and_the_request() {
    let (node, srv) = two_nodes();
    // The page is open; its data is not.
    let (code, html) = srv.get("/");
    assert_eq!(code, 200);
    assert!(
        html.contains("<title>Baton</title>") && html.contains("/web/app.js"),
        "{html}"
    );
    assert_eq!(srv.get("/web/app.js").0, 200);
    assert_eq!(srv.get("/web/nope.js").0, 404);
    assert_eq!(srv.get("/v1/cluster").0, 401);

    let v = cluster(&srv);
    assert_eq!(v["nodes"].as_array().unwrap().len(), 2, "{v}");
    assert_eq!(v["requests"], json!([]), "no request yet: {v}");
    // The node said in READY (protocol 5) where it computes, at the server's start: both processes run here.
    let (remote, local) = (&v["nodes"][0], &v["nodes"][1]);
    assert_eq!(remote["backend"], "cpu", "{v}");
    assert!(remote["isa"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    assert_eq!(remote["isa"], local["isa"], "one machine, one ISA: {v}");

    let (code, r) = srv.post_with(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8, "temperature": 0}),
        &auth(),
    );
    assert_eq!(code, 200, "{r}");
    let completion = r["usage"]["completion_tokens"].as_u64().unwrap();
    let prompt = r["usage"]["prompt_tokens"].as_u64().unwrap();

    let v = cluster(&srv);
    let nodes = v["nodes"].as_array().unwrap();
    let remote = &nodes[0];
    assert_eq!(remote["name"], node.addr.as_str(), "{v}");
    assert_eq!(remote["role"], "stage");
    assert_eq!(remote["layers"], "0:15");
    assert_eq!(remote["addr"], node.addr.as_str());
    assert_eq!(remote["up"], true);
    let local = &nodes[1];
    assert_eq!(
        (local["name"].as_str(), local["role"].as_str()),
        (Some("local"), Some("stage"))
    );
    assert_eq!(local["layers"], "15:30");
    assert_eq!(local["addr"], Value::Null);
    assert_eq!(local["backend"], "cpu");
    assert!(local["isa"].as_str().is_some_and(|s| !s.is_empty()), "{v}");
    assert_eq!(remote["backend"], "cpu", "{v}");
    assert_eq!(remote["isa"], local["isa"], "{v}");
    // Both stages count the pieces streamed (at most the completion tokens: an end token is not sent).
    let tokens = remote["tokens"].as_u64().unwrap();
    assert!((1..=completion).contains(&tokens), "{v}");
    for n in nodes {
        assert_eq!(
            n["tokens"].as_u64(),
            Some(tokens),
            "every stage computed every token: {v}"
        );
        assert_eq!((n["slots"].as_u64(), n["busy"].as_u64()), (Some(1), Some(0)), "{v}");
    }
    let links = v["links"].as_array().unwrap();
    assert_eq!(links.len(), 1, "{v}");
    assert_eq!(
        (links[0]["a"].as_str(), links[0]["b"].as_str()),
        (Some("local"), Some(node.addr.as_str()))
    );
    assert!(
        links[0]["bytes_ab"].as_u64().unwrap() > 0 && links[0]["bytes_ba"].as_u64().unwrap() > 0,
        "{v}"
    );
    assert!(links[0]["throughput"].as_f64().unwrap() > 0.0, "{v}");
    let reqs = v["requests"].as_array().unwrap();
    assert_eq!(reqs.len(), 1, "{v}");
    let q = &reqs[0];
    let both = format!("{}+local", node.addr);
    assert_eq!(
        (q["prefill"].as_str(), q["decode"].as_str()),
        (Some(both.as_str()), Some(both.as_str()))
    );
    assert_eq!(
        (q["prompt_tokens"].as_u64(), q["completion_tokens"].as_u64()),
        (Some(prompt), Some(completion))
    );
    let ms = |k: &str| q[k].as_f64().unwrap_or_else(|| panic!("{k}: {q}"));
    let split = ms("queue_ms") + ms("prefill_ms") + ms("first_token_ms");
    assert!(
        (split - ms("ttft_ms")).abs() < 1.0,
        "the split adds up to the TTFT: {q}"
    );
    assert!(ms("prefill_ms") > 0.0 && ms("ttft_ms") < 60_000.0, "{q}");
    assert!(matches!(q["finish"].as_str(), Some("stop" | "length")), "{q}");

    // The CLI prints the same: tables, or the JSON.
    let addr = format!("http://{}", srv.addr);
    let (ok, out, err) = baton(&["cluster", "status", &addr, "--api-key", KEY]);
    assert!(ok, "{err}");
    for want in [
        "NODE",
        &node.addr,
        "stage",
        "0:15",
        "15:30",
        "this server",
        "cpu",
        &both,
    ] {
        assert!(out.contains(want), "{want:?} missing from:\n{out}");
    }
    let isa = v["nodes"][1]["isa"].as_str().unwrap();
    assert!(
        out.lines()
            .any(|l| l.starts_with(node.addr.as_str()) && l.contains("0:15") && l.contains("cpu") && l.contains(isa)),
        "the remote node's row with its backend and ISA:\n{out}"
    );
    let (ok, out, err) = baton(&["cluster", "status", &srv.addr, "--api-key", KEY, "--json"]);
    assert!(ok, "{err}");
    let j: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(j["nodes"][0]["addr"], node.addr.as_str());
    assert_eq!(j["requests"][0]["decode"], both.as_str());
    let (ok, _, err) = baton(&["cluster", "status", &srv.addr]);
    assert!(!ok && err.contains("401"), "without the key: {err}");
}

/// Why the browser test cannot run here, if it cannot.
fn missing_browser_tools(js: &Path) -> Option<String> {
    let chromium = std::env::var("CHROMIUM").unwrap_or_else(|_| "/usr/bin/chromium".into());
    if Command::new("node").arg("--version").output().is_err() {
        return Some("node (Node.js) is not installed".into());
    }
    if !Path::new(&chromium).exists() {
        return Some(format!("{chromium} is not installed (Debian package chromium)"));
    }
    if !js.join("node_modules/playwright-core").is_dir() {
        return Some("tests/js/node_modules is missing (npm ci --prefix tests/js)".into());
    }
    None
}

#[test]
fn web_page_chats_stops_and_shows_the_two_node_cluster_in_chromium() {
    let js = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/js");
    if let Some(why) = missing_browser_tools(&js) {
        println!("SKIPPED: {why}");
        return;
    }
    let (node, srv) = two_nodes();
    let shot = Path::new(env!("CARGO_TARGET_TMPDIR")).join("web-ui.png");
    let _ = std::fs::remove_file(&shot);
    let url = format!("http://{}/", srv.addr);
    let mut child = Command::new("node")
        .arg(js.join("web.mjs"))
        .args([url.as_str(), "--key", KEY, "--shot", shot.to_str().unwrap()])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > Duration::from_secs(300) {
            let _ = child.kill();
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let out = child.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "web.mjs failed:\n{stdout}\n{stderr}");
    let seen: Value = serde_json::from_str(stdout.trim()).unwrap_or_else(|e| panic!("{e}: {stdout}"));
    assert_eq!(seen["asked_for_key"], true, "{seen}");
    assert!(seen["partial"].as_str().is_some_and(|p| !p.is_empty()), "{seen}");
    assert!(
        seen["model_line"].as_str().unwrap().contains("2 node(s), 1 remote"),
        "{seen}"
    );
    let nodes = seen["nodes"].as_array().unwrap();
    let cell = |row: &Value, i: usize| row[i].as_str().unwrap_or_default().to_string();
    assert!(
        nodes.iter().any(|r| cell(r, 0) == node.addr
            && cell(r, 1) == "stage"
            && cell(r, 2) == "0:15"
            && cell(r, 4) == "cpu"
            && !cell(r, 5).is_empty()
            && cell(r, 6) == "up"),
        "the remote stage: {seen}"
    );
    assert!(
        nodes
            .iter()
            .any(|r| cell(r, 0) == "local" && cell(r, 2) == "15:30" && cell(r, 3) == "this server"),
        "this server's stage: {seen}"
    );
    assert_eq!(seen["links"].as_array().unwrap().len(), 1, "{seen}");
    let reqs = seen["requests"].as_array().unwrap();
    assert!(
        reqs.iter().any(|r| cell(r, 8) == "cancelled"),
        "the stopped reply: {seen}"
    );
    assert!(
        reqs.iter().all(|r| cell(r, 2) == format!("{}+local", node.addr)),
        "{seen}"
    );
    assert!(shot.exists(), "no screenshot at {}", shot.display());
    println!("screenshot: {}", shot.display());
}
