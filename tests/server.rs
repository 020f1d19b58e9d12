//! `baton serve` as a process on an ephemeral port, driven over raw HTTP (and by the official `openai` Python
//! package when it is installed): the OpenAI endpoints, streaming, stop strings, logprobs, every bad-input case,
//! 429 under a tiny queue, cancellation, `/metrics`, a node dying mid-stream, prefix routing and fail-over.

mod cluster_util;

use cluster_util::{NodeProc, ServeProc, smollm2};
use serde_json::{Value, json};
use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::process::Command;
use std::time::{Duration, Instant};

/// `baton serve` with one thread and a small context, plus ARGS.
struct Server;

impl Server {
    fn try_start(args: &[&str]) -> Result<ServeProc, String> {
        ServeProc::try_start(&[&["-t", "1", "-c", "256"], args].concat())
    }

    fn start(args: &[&str]) -> ServeProc {
        ServeProc::start(&[&["-t", "1", "-c", "256"], args].concat())
    }
}

trait Stream {
    fn stream(&self, path: &str, body: &Value) -> SseReader;
}

impl Stream for ServeProc {
    fn stream(&self, path: &str, body: &Value) -> SseReader {
        SseReader::open(&self.addr, path, &body.to_string())
    }
}

fn connect(addr: &str) -> TcpStream {
    let s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    s
}

fn send_request(s: &mut TcpStream, method: &str, path: &str, body: &str, headers: &[(&str, &str)]) {
    let mut req = format!(
        "{method} {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\n",
        body.len()
    );
    for (k, v) in headers {
        req.push_str(&format!("{k}: {v}\r\n"));
    }
    req.push_str("\r\n");
    req.push_str(body);
    s.write_all(req.as_bytes()).unwrap();
}

/// Status line and headers (lower-cased names).
fn read_head(r: &mut impl BufRead) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let code: u16 = line.split_whitespace().nth(1).expect("status line").parse().unwrap();
    let mut headers = Vec::new();
    loop {
        line.clear();
        r.read_line(&mut line).unwrap();
        let l = line.trim_end();
        if l.is_empty() {
            break;
        }
        let (k, v) = l.split_once(':').unwrap();
        headers.push((k.to_ascii_lowercase(), v.trim().to_string()));
    }
    (code, headers)
}

fn is_chunked(h: &[(String, String)]) -> bool {
    h.iter().any(|(k, v)| k == "transfer-encoding" && v.contains("chunked"))
}

/// One chunk of a chunked body; `None` at the end.
fn read_chunk(r: &mut impl BufRead) -> Option<Vec<u8>> {
    let mut line = String::new();
    if r.read_line(&mut line).ok()? == 0 {
        return None;
    }
    let n = usize::from_str_radix(line.trim(), 16).ok()?;
    let mut buf = vec![0; n + 2];
    r.read_exact(&mut buf).ok()?;
    buf.truncate(n);
    (n > 0).then_some(buf)
}

/// A minimal HTTP/1.1 client: status, headers, body.
fn http(
    addr: &str,
    method: &str,
    path: &str,
    body: &str,
    headers: &[(&str, &str)],
) -> (u16, Vec<(String, String)>, String) {
    let mut s = connect(addr);
    send_request(&mut s, method, path, body, headers);
    let mut r = BufReader::new(s);
    let (code, h) = read_head(&mut r);
    let mut out = Vec::new();
    if is_chunked(&h) {
        while let Some(c) = read_chunk(&mut r) {
            out.extend_from_slice(&c);
        }
    } else {
        r.read_to_end(&mut out).unwrap();
    }
    (code, h, String::from_utf8(out).unwrap())
}

/// Reads server-sent events one `data:` payload at a time.
struct SseReader {
    code: u16,
    headers: Vec<(String, String)>,
    r: BufReader<TcpStream>,
    buf: String,
}

impl SseReader {
    fn open(addr: &str, path: &str, body: &str) -> SseReader {
        let mut s = connect(addr);
        send_request(&mut s, "POST", path, body, &[]);
        let mut r = BufReader::new(s);
        let (code, headers) = read_head(&mut r);
        SseReader {
            code,
            headers,
            r,
            buf: String::new(),
        }
    }

    /// The next event's data, or `None` when the stream ends.
    fn next(&mut self) -> Option<String> {
        loop {
            if let Some(i) = self.buf.find("\n\n") {
                let ev: String = self.buf.drain(..i + 2).collect();
                return Some(ev.trim().strip_prefix("data: ").expect("data line").to_string());
            }
            let c = read_chunk(&mut self.r)?;
            self.buf.push_str(&String::from_utf8(c).unwrap());
        }
    }

    fn all(&mut self) -> Vec<String> {
        std::iter::from_fn(|| self.next()).collect()
    }
}

fn chat(content: &str, extra: Value) -> Value {
    let mut v = json!({"model": "smollm2", "messages": [{"role": "user", "content": content}], "temperature": 0});
    for (k, x) in extra.as_object().unwrap() {
        v[k] = x.clone();
    }
    v
}

/// Concatenated text of a chat or completion stream, and its parsed chunks (without `[DONE]`).
fn stream_text(events: &[String]) -> (String, Vec<Value>) {
    let chunks: Vec<Value> = events
        .iter()
        .filter(|e| *e != "[DONE]")
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let text = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0))
        .filter_map(|c| c["delta"]["content"].as_str().or(c["text"].as_str()))
        .collect();
    (text, chunks)
}

#[test]
fn chat_completions_streaming_stop_and_logprobs() {
    let srv = Server::start(&[]);
    let (code, models) = srv.get("/v1/models");
    assert_eq!(code, 200);
    assert!(models.contains("\"smollm2\""), "{models}");

    // Non-streaming, greedy: usage adds up, max_tokens is honoured.
    let (code, a) = srv.post(
        "/v1/chat/completions",
        &chat("Name three colors.", json!({"max_tokens": 8})),
    );
    assert_eq!(code, 200, "{a}");
    let text = a["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    assert!(!text.is_empty());
    assert_eq!(a["object"], "chat.completion");
    assert_eq!(a["choices"][0]["finish_reason"], "length");
    let u = &a["usage"];
    assert_eq!(u["completion_tokens"], 8);
    assert!(u["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        u["total_tokens"].as_u64(),
        Some(u["prompt_tokens"].as_u64().unwrap() + 8)
    );

    // The same request streamed: role first, the same text, a finish chunk, the usage chunk, [DONE].
    let mut s = srv.stream(
        "/v1/chat/completions",
        &chat(
            "Name three colors.",
            json!({"max_tokens": 8, "stream": true, "stream_options": {"include_usage": true}}),
        ),
    );
    assert_eq!(s.code, 200);
    assert!(
        s.headers
            .iter()
            .any(|(k, v)| k == "content-type" && v.starts_with("text/event-stream"))
    );
    let events = s.all();
    assert_eq!(events.last().unwrap(), "[DONE]");
    let (streamed, chunks) = stream_text(&events);
    assert_eq!(streamed, text, "streamed and non-streamed greedy text differ");
    assert_eq!(chunks[0]["choices"][0]["delta"]["role"], "assistant");
    assert_eq!(chunks[0]["object"], "chat.completion.chunk");
    let fin = &chunks[chunks.len() - 2];
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    let usage = chunks.last().unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(usage["usage"]["completion_tokens"], 8);
    // The second identical prompt reused the first one's KV.
    assert!(
        usage["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "{usage}"
    );

    // A stop string from the middle of the greedy text: the reply ends just before it, streamed or not.
    let cut = text.char_indices().nth(text.chars().count() / 2).unwrap().0;
    let stop: String = text[cut..].chars().take(2).collect();
    let want = &text[..text.find(&stop).unwrap()];
    let (code, b) = srv.post(
        "/v1/chat/completions",
        &chat("Name three colors.", json!({"max_tokens": 8, "stop": [stop]})),
    );
    assert_eq!(code, 200, "{b}");
    assert_eq!(b["choices"][0]["message"]["content"], want);
    assert_eq!(b["choices"][0]["finish_reason"], "stop");
    let mut s = srv.stream(
        "/v1/chat/completions",
        &chat(
            "Name three colors.",
            json!({"max_tokens": 8, "stop": stop, "stream": true}),
        ),
    );
    let (streamed, _) = stream_text(&s.all());
    assert_eq!(streamed, want);

    // Chat logprobs: one entry per token, top alternatives sorted, the greedy choice is the most likely.
    let (code, c) = srv.post(
        "/v1/chat/completions",
        &chat(
            "Name three colors.",
            json!({"max_tokens": 4, "logprobs": true, "top_logprobs": 3}),
        ),
    );
    assert_eq!(code, 200, "{c}");
    let content = c["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(content.len(), 4);
    for e in content {
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0);
        assert!(
            (lp - top[0]["logprob"].as_f64().unwrap()).abs() < 1e-6,
            "greedy picks the top token: {e}"
        );
        assert!(top[0]["logprob"].as_f64() >= top[1]["logprob"].as_f64());
    }

    // Completions with logprobs, streamed and not.
    let body = json!({"model": "smollm2", "prompt": "The sky is", "max_tokens": 5, "temperature": 0, "logprobs": 2});
    let (code, d) = srv.post("/v1/completions", &body);
    assert_eq!(code, 200, "{d}");
    assert_eq!(d["object"], "text_completion");
    let lp = &d["choices"][0]["logprobs"];
    assert_eq!(lp["tokens"].as_array().unwrap().len(), 5);
    assert_eq!(lp["top_logprobs"][0].as_object().unwrap().len(), 2);
    let joined: String = lp["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(joined, d["choices"][0]["text"].as_str().unwrap());
    let mut body_s = body.clone();
    body_s["stream"] = json!(true);
    let (streamed, _) = stream_text(&srv.stream("/v1/completions", &body_s).all());
    assert_eq!(streamed, d["choices"][0]["text"].as_str().unwrap());

    // Seeded sampling is reproducible.
    let seeded = chat(
        "Tell me a word.",
        json!({"max_tokens": 6, "temperature": 1.0, "seed": 42}),
    );
    let (_, x) = srv.post("/v1/chat/completions", &seeded);
    let (_, y) = srv.post("/v1/chat/completions", &seeded);
    assert_eq!(
        x["choices"][0]["message"]["content"],
        y["choices"][0]["message"]["content"]
    );

    // /metrics saw it all.
    let (code, m) = srv.get("/metrics");
    assert_eq!(code, 200);
    assert!(
        srv.metric("baton_requests_total{path=\"/v1/chat/completions\",status=\"200\"}") >= 6.0,
        "{m}"
    );
    assert!(srv.metric("baton_completion_tokens_total") >= 40.0, "{m}");
    assert!(srv.metric("baton_ttft_seconds_count") >= 8.0, "{m}");
    assert!(srv.metric("baton_inter_token_seconds_count") >= 20.0, "{m}");
    assert!(srv.metric("baton_cached_prompt_tokens_total") > 0.0, "{m}");
    // The slot is released just after the last event is sent.
    let t0 = Instant::now();
    while srv.metric("baton_slots_busy") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "a slot stayed busy");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert!(
        m.contains("baton_queue_depth 0\n") && m.contains("baton_slots 1\n"),
        "{m}"
    );
    assert!(m.contains("baton_ttft_seconds_bucket{le=\"+Inf\"}"), "{m}");
}

#[test]
fn bad_inputs_get_openai_errors() {
    let srv = Server::start(&[]);
    let long = "word ".repeat(400);
    let cases: Vec<(&str, String, u16, Option<&str>)> = vec![
        ("/v1/chat/completions", "{not json".into(), 400, None),
        ("/v1/chat/completions", "[1,2]".into(), 400, None),
        ("/v1/chat/completions", json!({"messages": "hi"}).to_string(), 400, None),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": "5"}).to_string(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "temperature": "hot"}).to_string(),
            400,
            None,
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [], "max_tokens": 5}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"model": "gpt-4", "messages": [{"role": "user", "content": "hi"}]}).to_string(),
            404,
            Some("model"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": -3}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 0}).to_string(),
            400,
            Some("max_completion_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "max_tokens": 5000}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": long}]}).to_string(),
            400,
            Some("messages"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "n": 3}).to_string(),
            400,
            Some("n"),
        ),
        (
            "/v1/chat/completions",
            json!({"messages": [{"role": "user", "content": "hi"}], "top_logprobs": 50, "logprobs": true}).to_string(),
            400,
            Some("top_logprobs"),
        ),
        ("/v1/completions", json!({"prompt": 5}).to_string(), 400, None),
        (
            "/v1/completions",
            json!({"prompt": "hi", "max_tokens": 0}).to_string(),
            400,
            Some("max_tokens"),
        ),
        (
            "/v1/completions",
            json!({"prompt": long, "max_tokens": 5}).to_string(),
            400,
            Some("prompt"),
        ),
        (
            "/v1/completions",
            json!({"prompt": "", "max_tokens": 5}).to_string(),
            400,
            Some("prompt"),
        ),
        ("/v1/nothing", "{}".into(), 404, None),
    ];
    for (path, body, want, param) in cases {
        let (code, _, text) = http(&srv.addr, "POST", path, &body, &[]);
        assert_eq!(code, want, "{path} {body:.80}: {text}");
        let v: Value = serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}"));
        let err = &v["error"];
        assert!(err["message"].as_str().is_some_and(|m| !m.is_empty()), "{text}");
        assert!(err["type"].is_string(), "{text}");
        if let Some(p) = param {
            assert_eq!(err["param"], p, "{text}");
        }
    }
    // The prompt-too-long answer says it in OpenAI's code.
    let (_, v) = srv.post("/v1/chat/completions", &chat(&long, json!({})));
    assert_eq!(v["error"]["code"], "context_length_exceeded");
    // None of it hurt the server.
    let (code, ok) = srv.post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 2})));
    assert_eq!(code, 200, "{ok}");
    assert_eq!(srv.get("/health").0, 200);
}

#[test]
fn api_key_and_non_loopback() {
    let err = Server::try_start(&["--listen", "0.0.0.0:0"])
        .err()
        .expect("must refuse to start");
    assert!(err.contains("--api-key"), "{err}");
    let srv = Server::start(&["--api-key", "sekrit"]);
    let (code, _, text) = http(&srv.addr, "GET", "/v1/models", "", &[]);
    assert_eq!(code, 401, "{text}");
    assert!(text.contains("invalid_api_key"));
    let (code, _, _) = http(&srv.addr, "GET", "/v1/models", "", &[("Authorization", "Bearer wrong")]);
    assert_eq!(code, 401);
    let (code, _, _) = http(
        &srv.addr,
        "GET",
        "/v1/models",
        "",
        &[("Authorization", "Bearer sekrit")],
    );
    assert_eq!(code, 200);
    assert_eq!(srv.get("/health").0, 200, "health stays open");
}

#[test]
fn queue_full_is_429_and_cancellation_frees_the_slot() {
    // Long greedy generations (counting never meets an end-of-generation token), so that on a fast machine neither
    // finishes before its client leaves: 1500 tokens take several seconds even at 300 tokens/s.
    let srv = ServeProc::start(&["-t", "1", "-c", "2048", "--parallel", "1", "--queue", "1"]);
    let counting = |stream: bool| {
        json!({"model": "smollm2", "prompt": "1, 2, 3, 4, 5, 6, 7, 8,", "max_tokens": 1500, "temperature": 0,
               "stream": stream})
    };
    // Occupy the only slot, and see it generating.
    let mut a = srv.stream("/v1/completions", &counting(true));
    assert_eq!(a.code, 200);
    a.next().unwrap();
    a.next().unwrap();
    // One request may wait...
    let addr = srv.addr.clone();
    let waiting = std::thread::spawn(move || {
        let body = chat("Say yes.", json!({"max_tokens": 2})).to_string();
        let t0 = Instant::now();
        let (code, _, text) = http(&addr, "POST", "/v1/chat/completions", &body, &[]);
        (code, text, t0.elapsed())
    });
    let t0 = Instant::now();
    while srv.metric("baton_queue_depth") < 1.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the second request never queued"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // ...the next one is refused with 429 and Retry-After.
    let (code, h, text) = http(
        &srv.addr,
        "POST",
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 2})).to_string(),
        &[],
    );
    assert_eq!(code, 429, "{text}");
    assert!(h.iter().any(|(k, _)| k == "retry-after"), "{h:?}");
    assert!(text.contains("rate_limit_error"), "{text}");
    // The streaming client goes away mid-generation: its slot is freed within a token or so, and the queued
    // request then runs.
    drop(a);
    let (code, text, took) = waiting.join().unwrap();
    assert_eq!(code, 200, "{text}");
    assert!(took < Duration::from_secs(40), "the queued request waited {took:?}");
    let t0 = Instant::now();
    while srv.metric("baton_cancelled_total") < 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(10), "no cancellation recorded");
        std::thread::sleep(Duration::from_millis(50));
    }
    assert_eq!(srv.metric("baton_rejected_total"), 1.0);
    let t0 = Instant::now();
    while srv.metric("baton_slots_busy") != 0.0 {
        assert!(t0.elapsed() < Duration::from_secs(5), "the slot stayed busy");
        std::thread::sleep(Duration::from_millis(20));
    }
    // A non-streaming client that gives up is noticed too: its generation stops and the slot is freed.
    let before = srv.metric("baton_completion_tokens_total");
    let mut c = connect(&srv.addr);
    let body = counting(false).to_string();
    send_request(&mut c, "POST", "/v1/completions", &body, &[]);
    std::thread::sleep(Duration::from_millis(1500));
    drop(c);
    let t0 = Instant::now();
    while srv.metric("baton_cancelled_total") < 2.0 || srv.metric("baton_slots_busy") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the abandoned request kept its slot"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    let abandoned = srv.metric("baton_completion_tokens_total") - before;
    assert!(abandoned < 1400.0, "{abandoned} tokens for the abandoned request");
    // Far fewer than 1500 tokens were generated for the cancelled stream (and 2 for the queued request).
    assert!(before < 1000.0, "{before} tokens");
}

/// Several local slots decode together in batched steps: concurrent requests get the greedy text each gets alone,
/// a client leaving mid-stream stops only its own generation, and `/metrics` shows steps of more than one row.
#[test]
fn parallel_slots_decode_together_with_the_text_each_gets_alone() {
    let srv = Server::start(&["--parallel", "3"]);
    let prompts = ["Name three colors.", "What is the capital of Italy?", "Count to five."];
    let body = |p: &str| chat(p, json!({"max_tokens": 12}));
    let text = |v: &Value| v["choices"][0]["message"]["content"].as_str().unwrap().to_string();
    let alone: Vec<String> = prompts
        .iter()
        .map(|p| {
            let (code, v) = srv.post("/v1/chat/completions", &body(p));
            assert_eq!(code, 200, "{v}");
            text(&v)
        })
        .collect();
    let (steps0, rows0) = (
        srv.metric("baton_decode_steps_total"),
        srv.metric("baton_decode_rows_total"),
    );
    assert_eq!(steps0, rows0, "requests one after another are decoded alone");

    // All three at once, and a fourth, streaming, that leaves after a few tokens.
    let mut leaver = srv.stream(
        "/v1/chat/completions",
        &chat(
            "Write a long story about a dragon.",
            json!({"max_tokens": 200, "stream": true}),
        ),
    );
    assert_eq!(leaver.code, 200);
    leaver.next().unwrap();
    let together: Vec<_> = prompts
        .iter()
        .map(|p| {
            let (addr, b) = (srv.addr.clone(), body(p).to_string());
            std::thread::spawn(move || http(&addr, "POST", "/v1/chat/completions", &b, &[]))
        })
        .collect();
    leaver.next().unwrap();
    drop(leaver);
    let together: Vec<String> = together
        .into_iter()
        .map(|t| {
            let (code, _, body) = t.join().unwrap();
            assert_eq!(code, 200, "{body}");
            text(&serde_json::from_str(&body).unwrap())
        })
        .collect();
    assert_eq!(together, alone, "batched decode changed the greedy text");
    let (steps, rows) = (
        srv.metric("baton_decode_steps_total"),
        srv.metric("baton_decode_rows_total"),
    );
    assert!(
        rows - rows0 > steps - steps0,
        "no step decoded more than one session: {steps} steps, {rows} rows"
    );
    let t0 = Instant::now();
    while srv.metric("baton_cancelled_total") < 1.0 || srv.metric("baton_slots_busy") != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "the stream that left kept its slot"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(srv.metric("baton_completion_tokens_total") < 150.0);
}

/// Writes a cluster file of decode nodes named d0, d1, ... with one slot each.
fn cluster_file(dir: &tempfile::TempDir, addrs: &[&str]) -> String {
    let mut s = format!("model = {:?}\n", smollm2().display().to_string());
    for (i, a) in addrs.iter().enumerate() {
        s.push_str(&format!(
            "[[node]]\nname = \"d{i}\"\naddr = \"{a}\"\nrole = \"decode\"\nslots = 1\n"
        ));
    }
    let p = dir.path().join("cluster.toml");
    std::fs::write(&p, s).unwrap();
    p.display().to_string()
}

#[test]
fn node_dying_mid_stream_ends_the_stream_with_an_error() {
    let mut node = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let dir = tempfile::tempdir().unwrap();
    let file = cluster_file(&dir, &[&node.addr]);
    let srv = Server::start(&["--cluster", &file, "--node-timeout", "30"]);
    let mut s = srv.stream(
        "/v1/chat/completions",
        &chat(
            "Write a long story about a dragon.",
            json!({"max_tokens": 200, "stream": true}),
        ),
    );
    assert_eq!(s.code, 200);
    s.next().unwrap();
    s.next().unwrap();
    node.kill();
    let t0 = Instant::now();
    let rest = s.all();
    assert!(t0.elapsed() < Duration::from_secs(30), "the stream hung");
    let last: Value = serde_json::from_str(rest.last().expect("an error event")).unwrap();
    assert!(last["error"]["message"].as_str().unwrap().contains("failed"), "{last}");
    assert!(!rest.iter().any(|e| e == "[DONE]"));
    // With its only node gone, the server answers 503 (not a hang, not a crash).
    let t0 = Instant::now();
    let (code, v) = srv.post("/v1/chat/completions", &chat("hi", json!({"max_tokens": 2})));
    assert_eq!(code, 503, "{v}");
    assert!(t0.elapsed() < Duration::from_secs(30));
    assert_eq!(srv.get("/health").0, 503);
}

#[test]
fn router_prefers_the_cached_prefix_and_fails_over() {
    let n0 = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let n1 = NodeProc::spawn(&smollm2(), "127.0.0.1:0", &[]);
    let dir = tempfile::tempdir().unwrap();
    let file = cluster_file(&dir, &[&n0.addr, &n1.addr]);
    let srv = Server::start(&["--cluster", &file, "--node-timeout", "30"]);
    let mut nodes = [Some(n0), Some(n1)];
    let node_of = |srv: &ServeProc, before: [f64; 2]| -> usize {
        let after = [0, 1].map(|i| {
            srv.metric(&format!("baton_routed_total{{node=\"d{i}\",reason=\"prefix\"}}"))
                + srv.metric(&format!("baton_routed_total{{node=\"d{i}\",reason=\"least_loaded\"}}"))
        });
        (0..2).find(|&i| after[i] > before[i]).expect("a node was routed to")
    };
    let counts = |srv: &ServeProc| {
        [0, 1].map(|i| {
            srv.metric(&format!("baton_routed_total{{node=\"d{i}\",reason=\"prefix\"}}"))
                + srv.metric(&format!("baton_routed_total{{node=\"d{i}\",reason=\"least_loaded\"}}"))
        })
    };
    let story = "Once upon a time, in a quiet village by the sea, there lived an old fisherman named Tom.";
    let other = "List the planets of the solar system in order from the sun.";

    let c = counts(&srv);
    let (code, a) = srv.post("/v1/chat/completions", &chat(story, json!({"max_tokens": 3})));
    assert_eq!(code, 200, "{a}");
    let home = node_of(&srv, c);
    let c = counts(&srv);
    let (code, _) = srv.post("/v1/chat/completions", &chat(other, json!({"max_tokens": 3})));
    assert_eq!(code, 200);
    assert_ne!(
        node_of(&srv, c),
        home,
        "an unrelated prompt goes to the idle, colder node"
    );

    // The conversation's next turn goes where its prefix is cached, and reuses it over the wire.
    let reply = a["choices"][0]["message"]["content"].as_str().unwrap();
    let next = json!({"model": "smollm2", "temperature": 0, "max_tokens": 3, "messages": [
        {"role": "user", "content": story}, {"role": "assistant", "content": reply},
        {"role": "user", "content": "What happened next?"}]});
    let c = counts(&srv);
    let prefix_before = srv.metric(&format!("baton_routed_total{{node=\"d{home}\",reason=\"prefix\"}}"));
    let (code, b) = srv.post("/v1/chat/completions", &next);
    assert_eq!(code, 200, "{b}");
    assert_eq!(node_of(&srv, c), home);
    assert_eq!(
        srv.metric(&format!("baton_routed_total{{node=\"d{home}\",reason=\"prefix\"}}")),
        prefix_before + 1.0
    );
    let cached = b["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap();
    assert!(cached > 20, "the node kept the session's KV: {b}");
    assert!(
        srv.metric(&format!(
            "baton_wire_bytes_total{{peer=\"{}\",direction=\"sent\"}}",
            nodes[home].as_ref().unwrap().addr
        )) > 0.0
    );

    // The node holding the prefix dies: the same request still completes, on the other node.
    nodes[home].as_mut().unwrap().kill();
    let (code, c2) = srv.post("/v1/chat/completions", &next);
    assert_eq!(code, 200, "{c2}");
    assert_eq!(
        c2["choices"][0]["message"]["content"], b["choices"][0]["message"]["content"],
        "same greedy reply"
    );
    let t0 = Instant::now();
    while srv.metric(&format!("baton_node_up{{node=\"d{home}\"}}")) != 0.0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the dead node is still marked up"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // It comes back on the same address: the health check puts it back.
    let addr = nodes[home].as_ref().unwrap().addr.clone();
    nodes[home] = Some(NodeProc::spawn(&smollm2(), &addr, &[]));
    let t0 = Instant::now();
    while srv.metric(&format!("baton_node_up{{node=\"d{home}\"}}")) != 1.0 {
        assert!(t0.elapsed() < Duration::from_secs(20), "the node was not put back");
        std::thread::sleep(Duration::from_millis(100));
    }
    let (code, _) = srv.post("/v1/chat/completions", &chat(other, json!({"max_tokens": 2})));
    assert_eq!(code, 200);
}

#[test]
fn official_openai_python_client() {
    let probe = Command::new("python3").args(["-c", "import openai"]).output();
    if !probe.is_ok_and(|o| o.status.success()) {
        eprintln!("SKIPPED: python3 cannot import the openai package (scripts/test installs it with pip)");
        return;
    }
    let srv = Server::start(&["--api-key", "k"]);
    let script = r#"
import sys, openai
c = openai.OpenAI(base_url=sys.argv[1] + "/v1", api_key="k", max_retries=0, timeout=60)
assert [m.id for m in c.models.list().data] == ["smollm2"]
r = c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Name a fruit."}],
                              max_tokens=6, temperature=0)
full = r.choices[0].message.content
assert full and r.usage.completion_tokens == 6, r
parts, usage = [], None
for ch in c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Name a fruit."}],
                                    max_tokens=6, temperature=0, stream=True, stream_options={"include_usage": True}):
    if ch.choices and ch.choices[0].delta.content:
        parts.append(ch.choices[0].delta.content)
    if ch.usage:
        usage = ch.usage
assert "".join(parts) == full, (parts, full)
assert usage.completion_tokens == 6
t = c.completions.create(model="smollm2", prompt="One, two,", max_tokens=3, temperature=0)
assert t.choices[0].text
try:
    c.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    raise SystemExit("unknown model accepted")
except openai.NotFoundError:
    pass
try:
    c.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "x"}], max_tokens=0)
    raise SystemExit("max_tokens=0 accepted")
except openai.BadRequestError:
    pass
print("ok")
"#;
    let out = Command::new("python3")
        .args(["-c", script, &format!("http://{}", srv.addr)])
        .output()
        .unwrap();
    let so = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && so.contains("ok"),
        "{so}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `--ensemble` serves several models as one (listed in `/v1/models` under its members' names) and `--draft` puts a
/// draft model behind the local one; a self-ensemble and a same-model draft must answer greedily exactly as the
/// plain server does.
#[test]
fn ensemble_and_draft_serve_the_plain_greedy_answer() {
    let body = json!({"model": "smollm2", "prompt": "The capital of France is", "max_tokens": 12, "temperature": 0});
    let plain = Server::start(&[]);
    let (code, want) = plain.post("/v1/completions", &body);
    assert_eq!(code, 200, "{want}");
    let want = want["choices"][0]["text"].as_str().unwrap().to_string();
    assert!(!want.is_empty());
    drop(plain);

    let ens = Server::start(&["--ensemble", "smollm2@local,smollm2@local", "--parallel", "2"]);
    let (_, models) = ens.get("/v1/models");
    let models: Value = serde_json::from_str(&models).unwrap();
    assert_eq!(models["data"][0]["id"], "smollm2+smollm2", "{models}");
    let mut body_e = body.clone();
    body_e["model"] = json!("smollm2+smollm2");
    let (code, got) = ens.post("/v1/completions", &body_e);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want.as_str(), "{got}");
    body_e["model"] = json!("smollm2");
    let (code, err) = ens.post("/v1/completions", &body_e);
    assert_eq!(code, 404, "the ensemble is not smollm2 alone: {err}");
    assert!(
        ens.log
            .lock()
            .unwrap()
            .contains("ensemble smollm2@local + smollm2@local")
    );
    drop(ens);

    let spec = Server::start(&["--draft", "smollm2", "--draft-tokens", "3"]);
    let (code, got) = spec.post("/v1/completions", &body);
    assert_eq!(code, 200, "{got}");
    assert_eq!(got["choices"][0]["text"], want.as_str(), "{got}");

    // A draft that cannot be opened fails the start with a clear message.
    let e = Server::try_start(&["--draft", "/nonexistent.gguf"])
        .err()
        .expect("a missing draft must fail");
    assert!(e.contains("cannot open the draft") || e.contains("nonexistent"), "{e}");
}

/// The generated qwen3 model (SmolLM2's vocabulary cut down: no `<think>` token, so the tags are plain text) with
/// Baton's own thinking template (tests/chat_templates/thinking.jinja) in place of its ChatML one.
fn thinking_model(dir: &tempfile::TempDir) -> String {
    let src = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/models/qwen3.gguf");
    assert!(
        src.exists(),
        "{} missing: scripts/gen-test-models.py writes it",
        src.display()
    );
    let file = baton::gguf::GgufFile::open(&src).unwrap();
    let mut w = baton::gguf::GgufWriter::from_file(&file).unwrap();
    let template = include_str!("chat_templates/thinking.jinja").to_string();
    w.metadata.retain(|(k, _)| k != "tokenizer.chat_template");
    w.meta("tokenizer.chat_template", baton::gguf::Value::Str(template));
    let out = dir.path().join("qwen3-thinking.gguf");
    w.write(&out).unwrap();
    out.to_string_lossy().into_owned()
}

/// Qwen 3's thinking convention end to end: the server's `--chat-template-kwargs` default (here `force_thinking`,
/// which opens a think block in the generation prompt as DeepSeek R1's template does) and a request's
/// `chat_template_kwargs` over it; the reply of a prompt that opens the block comes back as `reasoning_content`,
/// streaming and not, with usage unchanged; `reasoning_format: "none"` leaves it in `content`; `enable_thinking:
/// false` closes an empty block in the prompt; reserved variables and unknown formats are 400s; assistant turns may
/// carry `reasoning_content`.
#[test]
fn thinking_models_reasoning_and_template_kwargs() {
    let dir = tempfile::tempdir().unwrap();
    let model = thinking_model(&dir);
    let srv = Server::start(&["-m", &model, "--chat-template-kwargs", r#"{"force_thinking": true}"#]);
    let ask = |extra: Value| -> Value {
        let mut body = chat(
            "Why is the sky blue?",
            json!({"model": "qwen3-thinking", "max_tokens": 8}),
        );
        for (k, x) in extra.as_object().unwrap() {
            body[k] = x.clone();
        }
        let (code, v) = srv.post("/v1/chat/completions", &body);
        assert_eq!(code, 200, "{v}");
        v
    };
    let msg = |v: &Value| v["choices"][0]["message"].clone();

    // The raw reply (no split), then the same greedy reply split: all of it is reasoning (the prompt opened the
    // block and a random model never closes it), trimmed as the template trims reasoning it is given back.
    let raw = ask(json!({"reasoning_format": "none"}));
    let raw_text = msg(&raw)["content"].as_str().unwrap().to_string();
    assert!(msg(&raw).get("reasoning_content").is_none(), "{raw}");
    assert!(
        !raw_text.trim().is_empty() && !raw_text.contains("</think>"),
        "{raw_text:?}"
    );
    let split = ask(json!({}));
    assert_eq!(
        msg(&split)["reasoning_content"].as_str(),
        Some(raw_text.trim()),
        "{split}"
    );
    assert_eq!(msg(&split)["content"], "", "{split}");
    // Usage counts tokens, however the text is split (only the cached share of the prompt differs: the second
    // request finds the first one's prefix).
    let counts = |u: &Value| {
        (
            u["prompt_tokens"].clone(),
            u["completion_tokens"].clone(),
            u["total_tokens"].clone(),
        )
    };
    assert_eq!(counts(&split["usage"]), counts(&raw["usage"]));
    assert_eq!(split["usage"]["completion_tokens"], 8);

    // Streaming: the same text, in reasoning_content deltas only.
    let mut body = chat(
        "Why is the sky blue?",
        json!({"model": "qwen3-thinking", "max_tokens": 8, "stream": true}),
    );
    body["stream_options"] = json!({"include_usage": true});
    let mut sse = srv.stream("/v1/chat/completions", &body);
    assert_eq!(sse.code, 200);
    let (content, chunks) = stream_text(&sse.all());
    assert_eq!(content, "");
    let reasoning: String = chunks
        .iter()
        .filter_map(|c| c["choices"].get(0)?["delta"]["reasoning_content"].as_str())
        .collect();
    assert_eq!(reasoning, raw_text.trim());
    assert_eq!(counts(&chunks.last().unwrap()["usage"]), counts(&raw["usage"]));

    // The request's variables over the server's: no open block, so the reply is all content; `enable_thinking`
    // false adds the empty block's tokens to the prompt.
    let plain = ask(json!({"chat_template_kwargs": {"force_thinking": false}}));
    assert!(msg(&plain).get("reasoning_content").is_none(), "{plain}");
    let off = ask(json!({"chat_template_kwargs": {"force_thinking": false, "enable_thinking": false}}));
    assert!(msg(&off).get("reasoning_content").is_none(), "{off}");
    let n = |v: &Value| v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(n(&off) > n(&plain), "{off} {plain}");
    assert!(n(&split) > n(&plain), "{split} {plain}");

    // A past turn's reasoning is accepted (and rendered by the template in a tool loop, dropped otherwise).
    let (code, v) = srv.post(
        "/v1/chat/completions",
        &json!({"messages": [{"role": "user", "content": "Hi"},
                             {"role": "assistant", "content": "Hello", "reasoning_content": "greet back"},
                             {"role": "user", "content": "<result>1</result>"}],
                "max_tokens": 2}),
    );
    assert_eq!(code, 200, "{v}");

    // Bad variables and formats: 400 naming the field.
    for (extra, param) in [
        (
            json!({"chat_template_kwargs": {"messages": []}}),
            "chat_template_kwargs",
        ),
        (
            json!({"chat_template_kwargs": {"add_generation_prompt": false}}),
            "chat_template_kwargs",
        ),
        (json!({"chat_template_kwargs": [true]}), "chat_template_kwargs"),
        (json!({"reasoning_format": "legacy"}), "reasoning_format"),
    ] {
        let mut body = chat("hi", json!({"model": "qwen3-thinking", "max_tokens": 2}));
        for (k, x) in extra.as_object().unwrap() {
            body[k] = x.clone();
        }
        let (code, v) = srv.post("/v1/chat/completions", &body);
        assert_eq!(code, 400, "{extra}: {v}");
        assert_eq!(v["error"]["param"], param, "{v}");
    }

    // The flags are checked at start.
    let bad = Server::try_start(&["-m", &model, "--chat-template-kwargs", r#"{"bos_token": "x"}"#]);
    assert!(
        bad.as_ref().is_err_and(|log| log.contains("cannot be overridden")),
        "{:?}",
        bad.err()
    );
}
