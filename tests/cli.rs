//! The `baton` command as a user meets it: real processes, standard output and error, exit codes, bad input.

mod common;

use baton::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use std::path::Path;
use std::process::{Command, Output};

fn baton(args: &[&str]) -> Output {
    Command::new(common::baton_bin())
        .args(args)
        .output()
        .expect("baton runs")
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A failure must be one clear line on standard error, a non-zero exit, and no panic.
fn assert_clean_failure(o: &Output, must_contain: &str) {
    let err = stderr(o);
    assert!(!o.status.success(), "expected failure, got success; stderr: {err}");
    assert!(!err.contains("panicked"), "panic instead of an error: {err}");
    let last = err.lines().last().unwrap_or("");
    assert!(last.starts_with("error: "), "no error line: {err}");
    assert!(
        last.contains(must_contain),
        "error line {last:?} does not mention {must_contain:?}"
    );
}

#[test]
fn greedy_run_prints_only_the_completion_on_stdout() {
    let m = common::model("smollm2");
    let args = [
        "run",
        "-m",
        m.to_str().unwrap(),
        "--temp",
        "0",
        "-n",
        "12",
        "The capital of France is",
    ];
    let o = baton(&args);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert!(
        !out.contains("The capital of France is"),
        "stdout echoes the prompt without --echo: {out:?}"
    );
    assert!(out.contains("Paris"), "unexpected completion {out:?}");
    assert!(stderr(&o).contains("tok/s"), "no speed line on stderr");
    // Greedy is deterministic.
    assert_eq!(String::from_utf8(baton(&args).stdout).unwrap(), out);
}

/// `run -v` over a prompt of many batches draws its prefill bar only on a terminal: piped, standard error holds
/// log lines and nothing else (no carriage returns, no terminal escapes).
#[test]
fn verbose_run_with_stderr_piped_draws_no_progress_bar() {
    let m = common::model("smollm2");
    let prompt = "The quick brown fox jumps over the lazy dog. ".repeat(20);
    let o = baton(&[
        "run",
        "-m",
        m.to_str().unwrap(),
        "-v",
        "-b",
        "16",
        "--temp",
        "0",
        "-n",
        "2",
        &prompt,
    ]);
    let err = stderr(&o);
    assert!(o.status.success(), "{err}");
    let n_prompt: usize = err
        .split("prompt: ")
        .nth(1)
        .and_then(|s| s.split(' ').next())
        .and_then(|n| n.parse().ok())
        .unwrap_or_else(|| panic!("no prompt line: {err}"));
    assert!(
        n_prompt > 16 * 4,
        "the prompt took only {n_prompt} tokens, not several batches"
    );
    assert!(
        !err.contains('\r') && !err.contains('\x1b'),
        "control codes on a piped stderr: {err:?}"
    );
}

#[test]
fn echo_and_chat_and_seeded_sampling() {
    let m = common::model("smollm2");
    let m = m.to_str().unwrap();
    let o = baton(&["run", "-m", m, "--echo", "--temp", "0", "-n", "4", "Once upon a time"]);
    assert!(String::from_utf8_lossy(&o.stdout).starts_with("Once upon a time"));
    let o = baton(&[
        "run",
        "-m",
        m,
        "--chat",
        "--temp",
        "0",
        "-n",
        "40",
        "What is 2+2? Answer with a number.",
    ]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        !out.contains("<|im_start|>") && !out.contains("<|im_end|>"),
        "control tokens leaked: {out:?}"
    );
    assert!(out.contains('4'), "chat answer {out:?}");
    let a = baton(&["run", "-m", m, "--seed", "7", "-n", "16", "Tell me a story"]);
    let b = baton(&["run", "-m", m, "--seed", "7", "-n", "16", "Tell me a story"]);
    assert_eq!(a.stdout, b.stdout, "the same seed must give the same text");
}

#[test]
fn missing_and_non_gguf_and_truncated_files_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let o = baton(&["info", "/nonexistent/model.gguf"]);
    assert_clean_failure(&o, "model.gguf");

    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"this is not a model at all").unwrap();
    assert_clean_failure(&baton(&["info", junk.to_str().unwrap()]), "not a GGUF file");

    // The real model cut in the middle of its tensor data.
    let real = std::fs::read(common::model("smollm2")).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &real[..real.len() / 2]).unwrap();
    assert_clean_failure(&baton(&["run", "-m", cut.to_str().unwrap(), "hi"]), "truncated");
    // Cut inside the metadata.
    std::fs::write(&cut, &real[..5000]).unwrap();
    assert_clean_failure(&baton(&["run", "-m", cut.to_str().unwrap(), "hi"]), "truncated");
}

fn write_model_with(path: &Path, arch: &str, ty: GgmlType) {
    let base = GgufFile::open(&common::model("smollm2")).unwrap();
    let mut w = GgufWriter::new();
    w.meta("general.architecture", Value::Str(arch.into()));
    for k in [
        "block_count",
        "context_length",
        "embedding_length",
        "feed_forward_length",
        "attention.head_count",
    ] {
        w.meta(&format!("{arch}.{k}"), Value::U32(256));
    }
    w.meta(&format!("{arch}.attention.layer_norm_rms_epsilon"), Value::F32(1e-5));
    for (k, v) in &base.metadata {
        if k.starts_with("tokenizer.") {
            w.meta(k, base.owned_value(v).unwrap());
        }
    }
    w.tensor(
        "token_embd.weight",
        vec![256, 49152],
        ty,
        vec![0; ty.row_bytes(256).unwrap() * 49152],
    );
    w.write(path).unwrap();
}

#[test]
fn unsupported_architecture_and_tensor_type_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("mamba.gguf");
    write_model_with(&p, "mamba", GgmlType::F32);
    assert_clean_failure(
        &baton(&["run", "-m", p.to_str().unwrap(), "hi"]),
        "unsupported architecture \"mamba\"",
    );

    let p = dir.path().join("q8k.gguf");
    write_model_with(&p, "llama", GgmlType::Q8K);
    let o = baton(&["run", "-m", p.to_str().unwrap(), "hi"]);
    assert!(
        !o.status.success() && !stderr(&o).contains("panicked"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn prompt_over_the_context_is_refused() {
    let m = common::model("smollm2");
    let long = "word ".repeat(400);
    let o = baton(&["run", "-m", m.to_str().unwrap(), "-c", "128", "-n", "4", &long]);
    assert_clean_failure(&o, "context");
}

#[test]
fn unreadable_cache_dir_is_reported() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("a-file");
    std::fs::write(&file, b"x").unwrap();
    // A cache "directory" below a regular file can be neither read nor created.
    let bad = file.join("models");
    let o = Command::new(common::baton_bin())
        .args(["run", "-m", "gemma3", "hi"])
        .env("BATON_MODELS", &bad)
        .output()
        .unwrap();
    assert_clean_failure(&o, "a-file");
}

#[test]
fn tokenize_prints_ids_on_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let f = dir.path().join("t.txt");
    std::fs::write(&f, "Hello world").unwrap();
    let m = common::model("smollm2");
    let o = baton(&["tokenize", m.to_str().unwrap(), f.to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    assert_eq!(out.lines().count(), 1);
    let ids: Vec<u32> = out.split_whitespace().map(|s| s.parse().unwrap()).collect();
    assert!(!ids.is_empty() && ids[0] != 1, "no BOS in tokenize output: {ids:?}");
}

#[test]
fn info_describes_the_model() {
    let o = baton(&["info", common::model("gemma3").to_str().unwrap()]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8(o.stdout.clone()).unwrap();
    for needle in [
        "gemma3",
        "sliding window",
        "Q4_K",
        "Q6_K",
        "Q5_0",
        "Q8_0",
        "fingerprint",
        "tokenizer",
    ] {
        assert!(out.contains(needle), "info lacks {needle:?}:\n{out}");
    }
}

/// `--compare-llama-cpp` interleaves the reference tool's repetitions with Baton's and prints the ratio and both ISAs; a stand-in
/// script plays llama-ref here (the real one is a 50-minute build, never in CI). A missing tool is a clear error.
#[test]
fn bench_compares_with_the_llama_cpp_tool_in_the_same_run() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let log = dir.path().join("calls");
    let tool = dir.path().join("llama-ref");
    std::fs::write(
        &tool,
        format!(
            "#!/bin/sh\necho \"$@\" >> {}\necho '{{\"engine\":\"llama.cpp\",\"cpu\":\"AVX2 FMA\",\"median_tokens_per_s\":0.5}}'\n",
            log.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(&tool, std::fs::Permissions::from_mode(0o755)).unwrap();
    let m = common::model("smollm2");
    let run = |tool: &Path| {
        Command::new(common::baton_bin())
            .env("BATON_LLAMA_REF", tool)
            .env("BATON_ISA", "scalar")
            .args([
                "bench",
                "-m",
                m.to_str().unwrap(),
                "-p",
                "16",
                "-n",
                "4",
                "-r",
                "3",
                "-t",
                "1",
            ])
            .args(["--compare-llama-cpp", "--json"])
            .output()
            .unwrap()
    };
    let o = run(&tool);
    assert!(o.status.success(), "{}", stderr(&o));
    let figures: Vec<serde_json::Value> = String::from_utf8_lossy(&o.stdout)
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(figures.len(), 2);
    for f in &figures {
        assert_eq!(f["llama_cpp_tps_median"], 0.5);
        // Both sides say what they ran: Baton's kernel level (forced here) and the llama.cpp build's features.
        assert_eq!(f["isa"], "scalar");
        assert_eq!(f["llama_cpp_cpu"], "AVX2 FMA");
        let ratio = f["ratio_vs_llama_cpp"].as_f64().unwrap();
        assert!((ratio - f["tps_median"].as_f64().unwrap() / 0.5).abs() < 1e-9);
    }
    // One llama.cpp repetition after each of Baton's: 3 for pp16, 3 for tg4, with the same threads.
    let calls = std::fs::read_to_string(&log).unwrap();
    assert_eq!(calls.lines().filter(|l| l.contains("-p 16 -n 0")).count(), 3, "{calls}");
    assert_eq!(calls.lines().filter(|l| l.contains("-p 0 -n 4")).count(), 3, "{calls}");
    assert!(calls.lines().all(|l| l.contains("-t 1")), "{calls}");

    let o = run(&dir.path().join("absent"));
    assert_clean_failure(&o, "needs the llama.cpp reference tool");
}

/// `--chat-template-kwargs` reaches the template of `baton run --chat` (the generated qwen3 model with Baton's
/// Qwen-3-style test template: `enable_thinking` false closes an empty think block in the prompt), is refused
/// without --chat, and is checked like a request's `chat_template_kwargs`.
#[test]
fn chat_template_kwargs_reach_the_template() {
    let dir = tempfile::tempdir().unwrap();
    let file = GgufFile::open(&common::model("qwen3")).unwrap();
    let mut w = GgufWriter::from_file(&file).unwrap();
    w.metadata.retain(|(k, _)| k != "tokenizer.chat_template");
    let template = include_str!("chat_templates/thinking.jinja").to_string();
    w.meta("tokenizer.chat_template", Value::Str(template));
    let path = dir.path().join("thinking.gguf");
    w.write(&path).unwrap();
    let m = path.to_str().unwrap();
    let run = |extra: &[&str]| baton(&[&["run", "-m", m, "--echo", "--temp", "0", "-n", "1"], extra, &["Hi"]].concat());
    let prompt = "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n";
    let o = run(&["--chat", "--chat-template-kwargs", r#"{"enable_thinking": false}"#]);
    assert!(o.status.success(), "{}", stderr(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with(&format!("{prompt}<think>\n\n</think>\n\n")), "{out:?}");
    let o = run(&["--chat"]);
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.starts_with(prompt) && !out.contains("<think>"), "{out:?}");
    assert_clean_failure(&run(&["--chat-template-kwargs", "{}"]), "needs --chat");
    for (bad, why) in [
        (r#"{"messages": 1}"#, "cannot be overridden"),
        ("{enable_thinking: false}", "not valid JSON"),
        ("[1]", "JSON object"),
    ] {
        let o = run(&["--chat", "--chat-template-kwargs", bad]);
        assert!(!o.status.success() && stderr(&o).contains(why), "{bad}: {}", stderr(&o));
        assert!(!stderr(&o).contains("panicked"), "{}", stderr(&o));
    }
}
