//! Tokenizer tests on the two real models and the generated ones (tests/models/) against llama.cpp's ids
//! (tests/golden/tokens-<model>.json, written by tools/llama-ref). The models are fetched into the cache on first
//! use; a missing model or golden file fails.

mod common;

use baton::gguf::GgufFile;
use baton::vocab::{StreamDecoder, Vocab};
use serde_json::Value;
use std::path::{Path, PathBuf};
use std::time::Instant;

const SMOLLM2: &str = "smollm2";
const GEMMA3: &str = "gemma3";

fn load(model: &str) -> Vocab {
    let g = GgufFile::open(&common::model(model)).expect("model opens");
    let t = Instant::now();
    let v = Vocab::from_gguf(&g).expect("vocab loads");
    eprintln!(
        "{model}: {} (vocab built in {:.1} ms)",
        v.describe(),
        t.elapsed().as_secs_f64() * 1e3
    );
    v
}

fn golden_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden")
}

fn texts() -> Vec<String> {
    let raw = std::fs::read_to_string(golden_dir().join("tokenizer_texts.json")).expect("tokenizer_texts.json");
    let j: Value = serde_json::from_str(&raw).expect("valid json");
    j["texts"]
        .as_array()
        .expect("texts")
        .iter()
        .map(|t| t.as_str().expect("string").to_string())
        .collect()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .expect("id array")
        .iter()
        .map(|x| x.as_u64().expect("id") as u32)
        .collect()
}

fn compare_with_llama_cpp(model: &str) {
    let vocab = load(model);
    // BATON_TOKENS_DIR points the comparison at other llama-ref output (e.g. extra texts) without editing.
    let dir = std::env::var("BATON_TOKENS_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|_| golden_dir());
    let path = dir.join(format!("tokens-{model}.json"));
    let raw = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("golden file {} (written by tools/llama-ref): {e}", path.display()));
    let j: Value = serde_json::from_str(&raw).expect("golden json");
    if let Some(n) = j["n_vocab"].as_u64() {
        assert_eq!(vocab.n_tokens() as u64, n, "vocab size");
    }
    if let Some(b) = j["add_bos"].as_bool() {
        assert_eq!(vocab.add_bos(), b, "add_bos");
    }
    if let Some(b) = j["bos"].as_u64() {
        assert_eq!(vocab.bos(), Some(b as u32), "bos");
    }
    if let Some(e) = j["eos"].as_u64() {
        assert_eq!(vocab.eos(), Some(e as u32), "eos");
    }
    let mut failures = Vec::new();
    let cases = j["cases"].as_array().expect("cases");
    for case in cases {
        let text = case["text"].as_str().expect("text");
        for (mode, add_special, parse_special) in [("plain", false, false), ("special", true, true)] {
            let want = ids(&case[mode]);
            let got = vocab.tokenize(text, add_special, parse_special);
            if got != want {
                failures.push(format!(
                    "{mode} {text:?}\n   llama.cpp: {want:?}\n   baton:     {got:?}"
                ));
            }
        }
    }
    if let Some(pieces) = j["pieces_hex"].as_object() {
        for (id, hex) in pieces {
            let id: u32 = id.parse().expect("id key");
            let hex = hex.as_str().expect("hex");
            let want: Vec<u8> = (0..hex.len())
                .step_by(2)
                .map(|i| u8::from_str_radix(&hex[i..i + 2], 16).expect("hex"))
                .collect();
            if vocab.token_bytes(id) != want.as_slice() {
                failures.push(format!(
                    "piece of {id}: llama.cpp {want:?}, baton {:?}",
                    vocab.token_bytes(id)
                ));
            }
        }
    }
    eprintln!(
        "{}: {} cases x 2 modes compared, {} mismatches",
        model,
        cases.len(),
        failures.len()
    );
    for f in &failures {
        eprintln!("MISMATCH {}: {f}", model);
    }
    assert!(
        failures.is_empty(),
        "{} tokenization differs from llama.cpp in {} places",
        model,
        failures.len()
    );
}

#[test]
fn smollm2_matches_llama_cpp() {
    compare_with_llama_cpp(SMOLLM2);
}

#[test]
fn gemma3_matches_llama_cpp() {
    compare_with_llama_cpp(GEMMA3);
}

/// The llama-bpe (Llama 3) pre-tokenizer, on the generated llama3 model (SmolLM2's vocab cut to 4096 tokens).
#[test]
fn llama_bpe_pretokenizer_matches_llama_cpp() {
    compare_with_llama_cpp("llama3");
}

/// The qwen2 pre-tokenizer (Qwen 2 and 3), on the generated qwen2 and qwen3 models.
#[test]
fn qwen2_pretokenizer_matches_llama_cpp() {
    compare_with_llama_cpp("qwen2");
    compare_with_llama_cpp("qwen3");
}

/// Plain-mode ids decode back to exactly the input, through token_bytes and through the stream decoder.
fn round_trip(model: &str) {
    let vocab = load(model);
    for text in texts() {
        let ids = vocab.tokenize(&text, false, false);
        let bytes: Vec<u8> = ids.iter().flat_map(|&i| vocab.token_bytes(i).iter().copied()).collect();
        assert_eq!(
            String::from_utf8_lossy(&bytes),
            text,
            "{}: round trip of {text:?}",
            model
        );
        assert_eq!(bytes, text.as_bytes());
        let mut dec = StreamDecoder::new();
        let mut streamed = String::new();
        for &id in &ids {
            streamed.push_str(&dec.push(&vocab, id));
        }
        streamed.push_str(&dec.flush());
        assert_eq!(streamed, text, "{}: streamed decode of {text:?}", model);
    }
}

#[test]
fn smollm2_round_trips() {
    round_trip(SMOLLM2);
}

#[test]
fn gemma3_round_trips() {
    round_trip(GEMMA3);
}

#[test]
fn eog_and_special_ids() {
    {
        let v = load(SMOLLM2);
        assert!(!v.add_bos());
        assert_eq!(v.eos(), Some(2));
        assert!(v.is_eog(2)); // <|im_end|>
        assert!(v.is_eog(0)); // <|endoftext|>
        assert!(!v.is_eog(1)); // <|im_start|>
        // As llama.cpp's load log prints them: EOT 0, EOG {0, 2, 4 (<reponame>, taken as FIM repo)}.
        assert_eq!(v.eot(), Some(0));
        assert_eq!(v.eog_ids(), [0, 2, 4]);
        assert_eq!(v.tokenize("<|im_start|>", false, true), [1]);
        assert_eq!(v.token_bytes(1), b"<|im_start|>");
    }
    {
        let v = load(GEMMA3);
        assert!(v.add_bos());
        assert_eq!(v.bos(), Some(2));
        assert!(v.is_eog(1)); // <eos>
        assert!(v.is_eog(v.token_id("<end_of_turn>").unwrap()));
        assert!(!v.is_eog(v.token_id("<start_of_turn>").unwrap()));
        assert_eq!(v.tokenize("", true, true), [2]);
        // llama.cpp: EOT 106, EOG {1 <eos>, 106 <end_of_turn>, 212 </s> (user-defined, promoted by its text)}.
        assert_eq!(v.eot(), Some(106));
        assert_eq!(v.eog_ids(), [1, 106, 212]);
        assert_eq!(v.unk(), Some(3));
        assert_eq!(v.pad(), Some(0));
    }
}

/// 20 KB of mixed text must tokenize quickly (the brief's budget is well under 100 ms).
#[test]
fn tokenizing_20kb_is_fast() {
    let mut text = String::new();
    let all = texts();
    while text.len() < 20_000 {
        for t in &all {
            text.push_str(t);
            text.push('\n');
        }
    }
    for model in [SMOLLM2, GEMMA3] {
        let vocab = load(model);
        let t = Instant::now();
        let ids = vocab.tokenize(&text, true, true);
        let ms = t.elapsed().as_secs_f64() * 1e3;
        eprintln!("{}: {} bytes -> {} tokens in {ms:.1} ms", model, text.len(), ids.len());
        // Generous bound: the machine is shared; typical is a few ms.
        assert!(ms < 1000.0, "{} took {ms:.0} ms", model);
    }
}
