//! Shared helpers of the integration tests.
#![allow(dead_code)]

use baton::generate::{GenParams, Generator, Outcome, Prompt};
use std::path::PathBuf;
use std::time::{Duration, Instant};

/// The small random-weight models committed in tests/models/ (written by scripts/gen-test-models.py).
pub const GENERATED: [&str; 11] = [
    "llama3",
    "qwen2",
    "qwen3",
    "qwen3moe",
    "iquants",
    "phi3",
    "dots1",
    "glm4moe",
    "deepseek2",
    "deepseek2-mla",
    "qwen3-yarn",
];

/// Path of a default model (`smollm2` or `gemma3`), fetched into the cache on first use, or of a generated one
/// ([`GENERATED`]), which must be there.
pub fn model(name: &str) -> PathBuf {
    if GENERATED.contains(&name) {
        let p = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join(format!("tests/models/{name}.gguf"));
        assert!(
            p.exists(),
            "{} missing: scripts/gen-test-models.py writes it",
            p.display()
        );
        return p;
    }
    baton::fetch::resolve(name).unwrap_or_else(|e| panic!("model {name} unavailable: {e:#}"))
}

/// The `baton` binary built for this test run.
pub fn baton_bin() -> PathBuf {
    PathBuf::from(env!("CARGO_BIN_EXE_baton"))
}

/// Runs one request to its end: the token ids (where the generator reports them), the text, the outcome.
pub fn collect(g: &mut dyn Generator, prompt: &Prompt, p: &GenParams) -> (Vec<u32>, String, Outcome) {
    let (mut ids, mut text) = (Vec::new(), String::new());
    let o = g
        .generate(prompt, p, &mut |piece| {
            ids.extend(piece.token);
            text.push_str(&piece.text);
            true
        })
        .unwrap();
    (ids, text, o)
}

/// A golden file of tests/golden/ (written by tools/llama-ref; see tests/golden/README.md).
pub fn golden(name: &str) -> serde_json::Value {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/golden")
        .join(name);
    let text = std::fs::read_to_string(&p).unwrap_or_else(|e| {
        panic!(
            "golden file {} unreadable ({e}); tools/llama-ref writes it",
            p.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

/// Waits (at most 10 s: a child's stderr is read by another thread) until `log()` has a line that `matches`.
pub fn wait_for_line(what: &str, log: impl Fn() -> String, matches: impl Fn(&str) -> bool) {
    let t0 = Instant::now();
    while !log().lines().any(&matches) {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "{what}: no such line in:\n{}",
            log()
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}
