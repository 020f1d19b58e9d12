//! KV on disk, through real processes: the prefix cache (`--kv-cache-dir`) across a restart and with its files
//! corrupted, truncated or deleted under a running server; the router sending a prompt to where the disk holds its
//! prefix; sessions saved and restored across processes (`run --save-session/--load-session`, `POST /slots/{id}`),
//! refused for other weights or a path outside the directory; across the cluster, a prefill node (`baton node
//! --kv-cache-dir`) that serves its cached prefixes to a decode side, and a two-stage pipeline whose stages each
//! read their own layer range back and recompute one stage's damaged entries.

mod cluster_util;

use cluster_util::{NodeProc, ServeProc, smollm2};
use serde_json::{Value, json};
use std::path::Path;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const BLOCK: usize = baton::engine::disk_cache::BLOCK;

/// About 600 tokens of text: two whole cache blocks and a tail.
fn long_prompt(seed: u32) -> String {
    let words = [
        "river", "stone", "cloud", "lamp", "market", "violin", "harbor", "seven", "quiet", "garden",
    ];
    let mut x = seed.wrapping_mul(2654435761).wrapping_add(12345);
    let mut out = String::from("Notes:");
    for _ in 0..600 {
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        out.push(' ');
        out.push_str(words[(x % 10) as usize]);
    }
    out.push_str(". Summary:");
    out
}

/// Longest a `baton run` of these tests may take (cold 600-token prefills on a loaded 2-core machine).
const RUN_LIMIT: Duration = Duration::from_secs(300);

fn spawn_run(args: &[&str]) -> std::process::Child {
    Command::new(env!("CARGO_BIN_EXE_baton"))
        .args(["run", "-t", "2", "-c", "1024", "--temp", "0", "-n", "8"])
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap()
}

/// Waits for a run (its output is small enough to stay in the pipes), killing it past [`RUN_LIMIT`].
fn finish(mut child: std::process::Child) -> Output {
    let t0 = Instant::now();
    while child.try_wait().unwrap().is_none() {
        if t0.elapsed() > RUN_LIMIT {
            let _ = child.kill();
            panic!("baton run took more than {RUN_LIMIT:?}: {:?}", child.wait_with_output());
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    child.wait_with_output().unwrap()
}

fn run(args: &[&str]) -> Output {
    finish(spawn_run(args))
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// `(prompt tokens, cached tokens)` from `baton run`'s summary line.
fn prompt_counts(o: &Output) -> (usize, usize) {
    let err = stderr(o);
    let line = err
        .lines()
        .find(|l| l.starts_with("prompt: "))
        .unwrap_or_else(|| panic!("no summary line:\n{err}"));
    let mut w = line.split_whitespace();
    let n: usize = w.nth(1).unwrap().parse().unwrap();
    let cached: usize = w.nth(1).unwrap().trim_start_matches('(').parse().unwrap();
    (n, cached)
}

fn ok_stdout(o: &Output) -> String {
    assert!(o.status.success(), "baton run failed:\n{}", stderr(o));
    String::from_utf8_lossy(&o.stdout).into_owned()
}

fn entries(dir: &Path) -> Vec<std::path::PathBuf> {
    let mut v: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "kv"))
        .collect();
    v.sort();
    v
}

/// Waits (bounded) until the background writer has put `n` entries in `dir`.
fn wait_entries(dir: &Path, n: usize) {
    let t0 = Instant::now();
    while entries(dir).len() < n {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "only {} of {n} entries written",
            entries(dir).len()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn run_prefills_only_the_suffix_after_a_restart_with_the_cold_output() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let prompt = long_prompt(1);
    let cold = run(&["-m", smollm2().to_str().unwrap(), "--kv-cache-dir", d, &prompt]);
    let cold_text = ok_stdout(&cold);
    let (n, cached) = prompt_counts(&cold);
    assert_eq!(cached, 0);
    assert!(n > 2 * BLOCK + 1, "prompt of {n} tokens is too short for the test");
    let blocks = (n - 1) / BLOCK;
    assert_eq!(
        entries(dir.path()).len(),
        n / BLOCK,
        "the run exits only once its blocks are written"
    );

    let warm = run(&["-m", smollm2().to_str().unwrap(), "--kv-cache-dir", d, &prompt]);
    assert_eq!(
        ok_stdout(&warm),
        cold_text,
        "a hit must compute exactly what a cold prefill does"
    );
    assert_eq!(prompt_counts(&warm), (n, blocks * BLOCK), "{}", stderr(&warm));
    assert!(stderr(&warm).contains(&format!("kv-cache: hit {} tokens", blocks * BLOCK)));

    // A size bound below one entry keeps the directory under it.
    let small = tempfile::tempdir().unwrap();
    let o = run(&[
        "-m",
        smollm2().to_str().unwrap(),
        "--kv-cache-dir",
        small.path().to_str().unwrap(),
        "--kv-cache-size",
        "0.007",
        &prompt,
    ]);
    ok_stdout(&o);
    let bytes: u64 = entries(small.path()).iter().map(|p| p.metadata().unwrap().len()).sum();
    assert!(bytes <= (0.007 * (1u64 << 30) as f64) as u64, "{bytes} bytes kept");
    assert_eq!(
        entries(small.path()).len(),
        1,
        "one 5.9 MB entry fits 7.5 MB, two do not"
    );
}

#[test]
fn two_processes_writing_one_directory_leave_only_whole_entries() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (m, prompt) = (smollm2(), long_prompt(3));
    let args = ["-m", m.to_str().unwrap(), "--kv-cache-dir", d, &prompt];
    let (a, b) = (spawn_run(&args), spawn_run(&args));
    let (a, b) = (finish(a), finish(b));
    assert_eq!(ok_stdout(&a), ok_stdout(&b));
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| !n.ends_with(".kv"))
        .collect();
    assert!(left.is_empty(), "temporary files left: {left:?}");
    let third = run(&args);
    assert_eq!(ok_stdout(&third), ok_stdout(&a));
    let (n, cached) = prompt_counts(&third);
    assert_eq!(cached, (n - 1) / BLOCK * BLOCK, "{}", stderr(&third));
}

/// Damages one cache entry in place.
type Damage = fn(&Path);

/// Ways a cache entry is damaged under a running process.
const DAMAGES: [(&str, Damage); 3] = [
    ("corrupt byte", |f| {
        let mut b = std::fs::read(f).unwrap();
        let i = b.len() / 2;
        b[i] ^= 0x40;
        std::fs::write(f, b).unwrap();
    }),
    ("truncated", |f| {
        let len = f.metadata().unwrap().len();
        std::fs::File::options()
            .write(true)
            .open(f)
            .unwrap()
            .set_len(len / 2)
            .unwrap();
    }),
    ("deleted", |f| std::fs::remove_file(f).unwrap()),
];

/// Damages every one of `files`; returns what each holds now (`None`: gone).
fn damage_all(files: &[std::path::PathBuf], damage: Damage) -> Vec<Option<Vec<u8>>> {
    files.iter().for_each(|f| damage(f));
    files.iter().map(|f| std::fs::read(f).ok()).collect()
}

/// Waits (bounded) until every one of `files` is there again and is not its `damaged` copy: rewritten (entries are
/// renamed into place whole).
fn wait_rewritten(files: &[std::path::PathBuf], damaged: &[Option<Vec<u8>>], why: &str, log: &dyn Fn() -> String) {
    let t0 = Instant::now();
    while !files
        .iter()
        .zip(damaged)
        .all(|(f, bad)| std::fs::read(f).is_ok_and(|b| Some(&b) != bad.as_ref()))
    {
        assert!(
            t0.elapsed() < Duration::from_secs(60),
            "{why}: entries not rewritten\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// Completion request: text and cached tokens.
fn complete(s: &ServeProc, prompt: &str) -> (String, u64) {
    let (code, v) = s.post(
        "/v1/completions",
        &json!({"prompt": prompt, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(code, 200, "{v}");
    (
        v["choices"][0]["text"].as_str().unwrap().to_string(),
        v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().unwrap(),
    )
}

/// `baton serve` with SmolLM2 on 2 threads, a 1024-token context and its prefix cache in `dir`, plus `args`.
fn serve_cached(dir: &Path, args: &[&str]) -> ServeProc {
    let m = smollm2();
    let base = [
        "-m",
        m.to_str().unwrap(),
        "-t",
        "2",
        "-c",
        "1024",
        "--kv-cache-dir",
        dir.to_str().unwrap(),
    ];
    ServeProc::start(&[&base[..], args].concat())
}

#[test]
fn damaged_cache_files_under_a_running_server_cost_only_recomputation() {
    let dir = tempfile::tempdir().unwrap();
    let s = serve_cached(dir.path(), &[]);
    let (p, other) = (long_prompt(2), "Hello there, how are you?");
    let (cold, cached) = complete(&s, &p);
    assert_eq!(cached, 0);
    wait_entries(dir.path(), 2);
    let n_entries = entries(dir.path()).len();

    // Another prompt takes the slot's KV, so the next request for `p` finds its prefix on disk only.
    let again = |why: &str| {
        complete(&s, other);
        let (text, cached) = complete(&s, &p);
        assert_eq!(text, cold, "{why}: output differs from the cold run");
        cached
    };
    assert_eq!(again("clean hit"), 2 * BLOCK as u64, "{}", s.log());

    for (why, damage) in DAMAGES {
        let files = entries(dir.path());
        assert_eq!(files.len(), n_entries);
        let damaged = damage_all(&files, damage);
        assert!(
            again(why) < BLOCK as u64,
            "{why}: a damaged entry was used\n{}",
            s.log()
        );
        // Recomputed and written again (whole files, renamed into place): the next request hits.
        wait_rewritten(&files, &damaged, why, &|| s.log());
        assert_eq!(
            again(why),
            2 * BLOCK as u64,
            "{why}: rewritten entries not used\n{}",
            s.log()
        );
    }
    assert!(s.log().contains("kv-cache: dropping"), "{}", s.log());
}

/// The router counts what the local slots' disk holds (the one kind of node whose disk it counts today,
/// docs/kv-cache.md): with two slots that both moved on to other prompts, a prompt whose prefix only the disk still
/// has is routed for it (`reason="disk_prefix"`) and reads it back; the slot that took it then holds it resident.
#[test]
fn the_router_counts_a_prefix_on_the_slots_disk() {
    let dir = tempfile::tempdir().unwrap();
    let s = serve_cached(dir.path(), &["--parallel", "2"]);
    let routed = |why: &str| s.metric(&format!("baton_routed_total{{node=\"local\",reason=\"{why}\"}}"));
    let p = long_prompt(6);
    let (cold, cached) = complete(&s, &p);
    assert_eq!(cached, 0);
    wait_entries(dir.path(), 2);
    // Each slot takes another prompt (the least recently used one first): no slot holds `p` any more.
    complete(&s, "Hello there, how are you?");
    complete(&s, "Why is the sea salty?");
    assert_eq!((routed("disk_prefix"), routed("prefix")), (0.0, 0.0), "{}", s.log());
    let (text, cached) = complete(&s, &p);
    assert_eq!(text, cold);
    assert_eq!(cached, 2 * BLOCK as u64, "{}", s.log());
    assert_eq!(routed("disk_prefix"), 1.0, "{}", s.log());
    assert!(
        s.log().contains(&format!("kv-cache: hit {} tokens", 2 * BLOCK)),
        "{}",
        s.log()
    );
    // Now resident in that slot: a plain prefix choice.
    complete(&s, &p);
    assert_eq!((routed("disk_prefix"), routed("prefix")), (1.0, 1.0), "{}", s.log());
}

#[test]
fn a_session_saved_by_one_run_continues_in_another_and_other_weights_are_refused() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("chat.kv");
    let f = f.to_str().unwrap();
    let m = smollm2();
    let m = m.to_str().unwrap();
    let first = "The three primary colors are";
    let o1 = ok_stdout(&run(&["-m", m, "--save-session", f, first]));
    let next = format!("{first}{}. The sky is", o1.trim_end_matches('\n'));

    let restored = run(&["-m", m, "--load-session", f, &next]);
    let cold = run(&["-m", m, &next]);
    assert_eq!(
        ok_stdout(&restored),
        ok_stdout(&cold),
        "the restored conversation continues exactly"
    );
    let (n, cached) = prompt_counts(&restored);
    assert!(
        cached > 3 && cached < n,
        "{cached} of {n} tokens restored\n{}",
        stderr(&restored)
    );
    assert!(stderr(&restored).contains("session: restored"));

    let g = cluster_util::gemma3();
    let other = run(&["-m", g.to_str().unwrap(), "--load-session", f, &next]);
    assert!(!other.status.success());
    let err = stderr(&other);
    assert!(err.contains("fingerprint is"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

#[test]
fn slots_save_and_restore_across_servers_behind_the_key_and_inside_their_directory() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let m = smollm2();
    let args = [
        "-m",
        m.to_str().unwrap(),
        "-t",
        "2",
        "-c",
        "1024",
        "--api-key",
        "k",
        "--slot-save-path",
        d,
    ];
    let auth = "Authorization: Bearer k\r\n";
    let post = |s: &ServeProc, path: &str, body: Value| -> (u16, Value) {
        let (code, text) = s.http_with("POST", path, &body.to_string(), auth);
        (
            code,
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("{e}: {text}")),
        )
    };
    let prompt = "Once upon a time, in a small village by the sea, there lived";
    let req = json!({"prompt": prompt, "max_tokens": 8, "temperature": 0});

    let a = ServeProc::start(&args);
    let (code, first) = post(&a, "/v1/completions", req.clone());
    assert_eq!(code, 200, "{first}");
    let (code, v) = post(&a, "/slots/0?action=save", json!({"filename": "tale"}));
    assert_eq!(code, 200, "{v}");
    assert!(v["n_saved"].as_u64().unwrap() > 10, "{v}");
    let (code, _) = a.http("POST", "/slots/0?action=save", &json!({"filename": "x"}).to_string());
    assert_eq!(code, 401, "the endpoints are behind the API key");
    for bad in ["../escape", "/tmp/abs", ".hidden", "a/b"] {
        let (code, v) = post(&a, "/slots/0?action=save", json!({"filename": bad}));
        assert_eq!(code, 400, "{bad}: {v}");
    }
    let (code, _) = post(&a, "/slots/7?action=save", json!({"filename": "x"}));
    assert_eq!(code, 404);
    let (code, v) = post(&a, "/slots/0?action=restore", json!({"filename": "missing"}));
    assert_eq!(code, 400, "{v}");
    drop(a);
    let names: Vec<_> = std::fs::read_dir(d).unwrap().map(|e| e.unwrap().file_name()).collect();
    assert_eq!(names, ["tale"], "nothing written outside the name given");

    let b = ServeProc::start(&args);
    let (code, v) = post(&b, "/slots/0?action=restore", json!({"filename": "tale"}));
    assert_eq!(code, 200, "{v}");
    let (code, again) = post(&b, "/v1/completions", req);
    assert_eq!(code, 200, "{again}");
    assert_eq!(again["choices"][0]["text"], first["choices"][0]["text"]);
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(cached > 5, "the restored session was not reused: {again}");
}

/// The layer range an entry holds, from its snapshot header (docs/kv-format.md).
fn entry_layers(path: &Path) -> (usize, usize) {
    let b = std::fs::read(path).unwrap();
    let n = u64::from_le_bytes(b[..8].try_into().unwrap()) as usize;
    let h: Value = serde_json::from_slice(&b[8..8 + n]).unwrap();
    let field = |k: &str| h["__metadata__"][k].as_str().unwrap().parse().unwrap();
    (field("layer_start"), field("layer_end"))
}

#[test]
fn a_prefill_node_serves_its_cached_prefix_after_a_restart_and_recomputes_damaged_entries() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_str().unwrap();
    let (m, prompt) = (smollm2(), long_prompt(4));
    let m = m.to_str().unwrap();
    let local = run(&["-m", m, &prompt]);
    let (n, _) = prompt_counts(&local);
    let local = ok_stdout(&local);
    let blocks = (n - 1) / BLOCK;
    let spawn = || NodeProc::spawn(Path::new(m), "127.0.0.1:0", &["--kv-cache-dir", d]);
    let via = |node: &NodeProc| {
        let o = run(&[
            "-m",
            m,
            "-v",
            "--prefill-node",
            &node.addr,
            "--offload",
            "always",
            &prompt,
        ]);
        let err = stderr(&o);
        assert!(
            err.contains(&format!("prefill: layers 0..30 of 30 remote, {n} tokens sent")) && !err.contains("fallback"),
            "the decode side got every position's KV from the node:\n{err}\nnode:\n{}",
            node.log()
        );
        ok_stdout(&o)
    };

    let mut node = spawn();
    assert_eq!(via(&node), local, "cold, through the prefill node");
    wait_entries(dir.path(), n / BLOCK);
    node.kill();

    // A new node process on the same directory: the prefix is read back, only the suffix is computed.
    let node = spawn();
    assert_eq!(via(&node), local, "the prefix read from the node's disk");
    let hit = format!("kv-cache: hit {} tokens", blocks * BLOCK);
    assert!(node.log().contains(&hit), "{}", node.log());

    // Damaged entries cost only recomputation, then are written again and hit.
    let files = entries(dir.path());
    let damaged = damage_all(&files, DAMAGES[0].1);
    assert_eq!(via(&node), local, "damaged entries are recomputed");
    assert!(node.log().contains("kv-cache: dropping"), "{}", node.log());
    assert_eq!(
        node.log().matches(&hit).count(),
        1,
        "a damaged entry was used:\n{}",
        node.log()
    );
    wait_rewritten(&files, &damaged, DAMAGES[0].0, &|| node.log());
    assert_eq!(via(&node), local);
    assert_eq!(node.log().matches(&hit).count(), 2, "{}", node.log());
}

#[test]
fn each_stage_of_a_restarted_pipeline_reads_its_own_layer_range_back() {
    let dirs = [tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap()];
    let (m, prompt) = (smollm2(), long_prompt(5));
    let m = m.to_str().unwrap();
    let ranges = [("0:15", (0, 15)), ("15:end", (15, 30))];
    let spawn = || -> Vec<NodeProc> {
        ranges
            .iter()
            .zip(&dirs)
            .map(|((r, _), d)| {
                NodeProc::spawn(
                    Path::new(m),
                    "127.0.0.1:0",
                    &["--layers", r, "--kv-cache-dir", d.path().to_str().unwrap()],
                )
            })
            .collect()
    };
    let via = |nodes: &[NodeProc]| {
        let spec = format!("{}=0:15,{}=15:end", nodes[0].addr, nodes[1].addr);
        run(&["-m", m, "-v", "--pipeline", &spec, &prompt])
    };

    let mut nodes = spawn();
    let cold = via(&nodes);
    let (n, cached) = prompt_counts(&cold);
    assert_eq!(cached, 0);
    let cold = ok_stdout(&cold);
    for ((_, range), d) in ranges.iter().zip(&dirs) {
        wait_entries(d.path(), n / BLOCK);
        for f in entries(d.path()) {
            assert_eq!(entry_layers(&f), *range, "{} holds another stage's layers", f.display());
        }
    }
    nodes.iter_mut().for_each(NodeProc::kill);

    let nodes = spawn();
    let warm = via(&nodes);
    let blocks = (n - 1) / BLOCK;
    assert_eq!(ok_stdout(&warm), cold, "both stages read back: same text");
    assert_eq!(prompt_counts(&warm), (n, blocks * BLOCK), "{}", stderr(&warm));
    let hit = format!("kv-cache: hit {} tokens", blocks * BLOCK);
    let hits = |node: &NodeProc| node.log().matches(&hit).count();
    for node in &nodes {
        assert_eq!(hits(node), 1, "{}", node.log());
    }

    // One stage's entries damaged under the running nodes: the pipeline recomputes (same text), that stage drops
    // what it cannot use and writes it again, and the run after hits on both stages again.
    let (stage, dir) = (&nodes[1], dirs[1].path());
    for (why, damage) in DAMAGES {
        let files = entries(dir);
        assert_eq!(files.len(), n / BLOCK, "{why}");
        let drops = || stage.log().matches("kv-cache: dropping").count();
        let (before, dropped) = (hits(stage), drops());
        let damaged = damage_all(&files, damage);
        let o = via(&nodes);
        assert_eq!(ok_stdout(&o), cold, "{why}: recomputed, same text");
        assert!(
            prompt_counts(&o).1 < blocks * BLOCK && hits(stage) == before,
            "{why}: a damaged entry was used\n{}\nstage:\n{}",
            stderr(&o),
            stage.log()
        );
        // A missing entry is only a miss; a damaged one is dropped (deleted, with a warning).
        let want_drop = why != "deleted";
        assert_eq!(drops() > dropped, want_drop, "{why}: {}", stage.log());
        wait_rewritten(&files, &damaged, why, &|| stage.log());
        let o = via(&nodes);
        assert_eq!(ok_stdout(&o), cold, "{why}");
        assert_eq!(prompt_counts(&o), (n, blocks * BLOCK), "{why}: {}", stderr(&o));
        assert_eq!(hits(stage), before + 1, "{why}: {}", stage.log());
    }
}
