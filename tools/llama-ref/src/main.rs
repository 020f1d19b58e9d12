//! llama-ref: runs llama.cpp (through the `llama-cpp-2` bindings) to produce the reference data Baton's
//! tests compare against: tokenizer ids, greedy continuations with logit statistics, perplexity, and speed.
//!
//! Every subcommand writes one JSON file (or JSON lines for `bench`) and prints a one-line summary.

mod dump;
mod json;

use std::num::NonZeroU32;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use clap::{Args, Parser, Subcommand};
use llama_cpp_2::context::LlamaContext;
use llama_cpp_2::context::params::LlamaContextParams;
use llama_cpp_2::llama_backend::LlamaBackend;
use llama_cpp_2::llama_batch::LlamaBatch;
use llama_cpp_2::model::LlamaModel;
use llama_cpp_2::model::params::LlamaModelParams;
use llama_cpp_2::token::LlamaToken;
use serde_json::{Value, json};

#[derive(Parser)]
#[command(about = "llama.cpp reference outputs for Baton's golden tests")]
struct Cli {
    /// Show llama.cpp's own log output (silenced by default).
    #[arg(long, global = true)]
    verbose: bool,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Token ids for every text of a tokenizer_texts.json, plain and with special handling.
    Tokens(TokensArgs),
    /// Greedy continuations of a fixed prompt set, with top-2 gaps and last-prompt-position logit stats.
    Greedy(GreedyArgs),
    /// Perplexity with llama-perplexity's conventions (chunks of n_ctx, second half scored).
    Perplexity(PplArgs),
    /// Prompt-processing and generation speed, llama-bench style (pp<N> / tg<N>), JSON lines.
    Bench(BenchArgs),
    /// Everything for both cached models: tokens, greedy and perplexity files into a golden dir.
    All(AllArgs),
    /// Evaluates token ids in one batch and writes llama.cpp's intermediate f32 tensors (op-by-op debugging).
    Dump(dump::DumpArgs),
    /// Mean-pooled embeddings (llama-server's `/v1/embeddings` pooling, before normalisation) of every text of a
    /// JSON file.
    Embed(EmbedArgs),
}

#[derive(Args)]
struct EmbedArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON file with {"texts": [...]}.
    #[arg(long)]
    texts: PathBuf,
    #[arg(long, short)]
    out: PathBuf,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// Short model name written into the file ("smollm2", "gemma3").
    #[arg(long)]
    name: String,
    /// CPU threads for llama.cpp.
    #[arg(long, short, default_value_t = 2)]
    threads: i32,
}

#[derive(Args)]
struct TokensArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// JSON file with {"texts": [...]}.
    #[arg(long)]
    texts: PathBuf,
    #[arg(long, short)]
    out: PathBuf,
}

#[derive(Args)]
struct GreedyArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long, default_value_t = 48)]
    n_predict: usize,
    #[arg(long, default_value_t = 2048)]
    n_ctx: u32,
    #[arg(long, short)]
    out: PathBuf,
}

#[derive(Args)]
struct PplArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Plain text file to score.
    #[arg(long)]
    text: PathBuf,
    #[arg(long, default_value_t = 512)]
    n_ctx: u32,
    #[arg(long, short)]
    out: PathBuf,
    /// Also write chunk 0's scored logits (f32 little-endian, row per scored position) here, so the
    /// arithmetic can be checked independently (e.g. with numpy).
    #[arg(long)]
    dump_logits: Option<PathBuf>,
    /// Chunks evaluated together as separate sequences of one batch (llama-perplexity's default
    /// `-b 2048` with `-c 512` uses 4); results differ from 1 only by float summation order.
    #[arg(long, default_value_t = 1)]
    n_seq: usize,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(long, short)]
    model: PathBuf,
    /// Prompt tokens for the pp test (0 skips it).
    #[arg(short = 'p', long, default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens for the tg test (0 skips it).
    #[arg(short = 'n', long, default_value_t = 128)]
    n_gen: usize,
    #[arg(long, short, default_value_t = 2)]
    threads: i32,
    /// Timed repetitions; the median is reported.
    #[arg(short = 'r', long, default_value_t = 5)]
    repetitions: usize,
    /// Batch size for the pp test.
    #[arg(short = 'b', long, default_value_t = 2048)]
    n_batch: u32,
    /// Context depth: this many filler tokens are decoded (untimed) before each timed run, as `baton bench
    /// --ctx-depth` does, so pp/tg run with that much context already in the KV cache.
    #[arg(short = 'd', long, default_value_t = 0)]
    depth: usize,
    /// Layers offloaded to the GPU, as llama.cpp's `-ngl` (a build with `--features vulkan`; 999 for all).
    #[arg(long = "gpu-layers", visible_alias = "ngl", default_value_t = 0)]
    gpu_layers: u32,
}

#[derive(Args)]
struct AllArgs {
    #[arg(long, default_value = "~/.cache/baton/models/SmolLM2-135M-Instruct.Q4_1.gguf")]
    smollm2: String,
    #[arg(long, default_value = "~/.cache/baton/models/gemma-3-270m-q4_k_m.gguf")]
    gemma3: String,
    /// The repo's tests/golden directory (reads tokenizer_texts.json and ppl-text.txt from it).
    #[arg(long, default_value = "tests/golden")]
    golden: PathBuf,
    #[arg(long, short, default_value_t = 2)]
    threads: i32,
}

fn main() {
    if let Err(e) = run() {
        eprintln!("error: {e:#}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let cli = Cli::parse();
    let mut backend = LlamaBackend::init().context("initialising llama.cpp")?;
    if !cli.verbose {
        backend.void_logs();
    }
    match cli.cmd {
        Cmd::Tokens(a) => tokens_cmd(&backend, &a.model, &a.texts, &a.out),
        Cmd::Greedy(a) => greedy_cmd(&backend, &a.model, a.n_predict, a.n_ctx, &a.out),
        Cmd::Perplexity(a) => ppl_cmd(
            &backend,
            &a.model,
            &a.text,
            a.n_ctx,
            a.n_seq,
            &a.out,
            a.dump_logits.as_deref(),
        ),
        Cmd::Bench(a) => bench_cmd(&backend, &a),
        Cmd::All(a) => all_cmd(&backend, &a),
        Cmd::Dump(a) => dump::dump_cmd(&a),
        Cmd::Embed(a) => embed_cmd(&backend, &a.model, &a.texts, &a.out),
    }
}

fn expand_home(p: &str) -> PathBuf {
    match p.strip_prefix("~/") {
        Some(rest) => PathBuf::from(std::env::var("HOME").unwrap_or_default()).join(rest),
        None => PathBuf::from(p),
    }
}

/// The x86 level of this llama.cpp build as golden file names carry it (`avx512`, `avx2`), or its architecture
/// elsewhere: greedy continuations and perplexities depend on it, the tokenizer does not.
fn build_level() -> &'static str {
    let cpu = cpu_features();
    let has = |f: &str| cpu.split(' ').any(|x| x == f);
    if has("AVX512") {
        "avx512"
    } else if has("AVX2") {
        "avx2"
    } else if cfg!(target_arch = "aarch64") {
        "neon"
    } else {
        "generic"
    }
}

fn all_cmd(backend: &LlamaBackend, a: &AllArgs) -> Result<()> {
    let level = build_level();
    let texts = a.golden.join("tokenizer_texts.json");
    let ppl_text = a.golden.join("ppl-text.txt");
    for (name, path) in [("smollm2", &a.smollm2), ("gemma3", &a.gemma3)] {
        let m = ModelArgs {
            model: expand_home(path),
            name: name.to_string(),
            threads: a.threads,
        };
        tokens_cmd(backend, &m, &texts, &a.golden.join(format!("tokens-{name}.json")))?;
        greedy_cmd(
            backend,
            &m,
            48,
            2048,
            &a.golden.join(format!("greedy-{name}-{level}.json")),
        )?;
        ppl_cmd(
            backend,
            &m,
            &ppl_text,
            512,
            1,
            &a.golden.join(format!("perplexity-{name}-{level}.json")),
            None,
        )?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// shared helpers

fn load_model(backend: &LlamaBackend, path: &Path) -> Result<LlamaModel> {
    load_model_on(backend, path, 0)
}

/// Loads with the first `gpu_layers` layers offloaded to a GPU backend compiled in (the `vulkan` feature); every
/// golden file is made with 0, on the CPU.
fn load_model_on(backend: &LlamaBackend, path: &Path, gpu_layers: u32) -> Result<LlamaModel> {
    if !path.is_file() {
        bail!("model file {} not found", path.display());
    }
    if gpu_layers > 0 && !cfg!(feature = "vulkan") {
        bail!("--gpu-layers needs a llama-ref built with `--features vulkan`");
    }
    let params = LlamaModelParams::default().with_n_gpu_layers(gpu_layers);
    LlamaModel::load_from_file(backend, path, &params)
        .with_context(|| format!("llama.cpp could not load {}", path.display()))
}

fn new_context<'a>(
    backend: &LlamaBackend,
    model: &'a LlamaModel,
    n_ctx: u32,
    n_batch: u32,
    n_ubatch: u32,
    threads: i32,
) -> Result<LlamaContext<'a>> {
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_ctx))
        .with_n_batch(n_batch)
        .with_n_ubatch(n_ubatch)
        .with_n_threads(threads)
        .with_n_threads_batch(threads);
    model
        .new_context(backend, params)
        .map_err(|e| anyhow!("llama.cpp could not create a context: {e}"))
}

/// Model facts every golden file records, so a test can tell which model and settings produced it.
fn model_info(model: &LlamaModel, name: &str, path: &Path) -> Value {
    let vocab = model.vocab();
    json!({
        "model": name,
        "file": path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "arch": model.meta_val_str("general.architecture").ok(),
        "n_vocab": vocab.n_tokens(),
        "add_bos": vocab.should_add_bos(),
        "bos": vocab.bos().0,
        "eos": vocab.eos().0,
        "llama_cpp": llama_cpp_version(),
        "llama_cpp_cpu": cpu_features(),
    })
}

/// The CPU features this llama.cpp build uses (those `llama_print_system_info` reports as 1, e.g.
/// "AVX2 F16C FMA ... REPACK"), so a golden file or a speed figure says which ISA it came from: llama.cpp's AVX2
/// and AVX-512 builds part ways after a few greedy tokens of a small model.
fn cpu_features() -> String {
    // SAFETY: returns a static NUL-terminated string owned by llama.cpp.
    let info = unsafe { std::ffi::CStr::from_ptr(llama_cpp_sys_2::llama_print_system_info()) };
    let info = info.to_string_lossy();
    let cpu = info.split("CPU :").nth(1).unwrap_or(&info);
    cpu.split('|')
        .filter_map(|kv| {
            let (k, v) = kv.split_once('=')?;
            (v.trim() == "1").then(|| k.trim().to_string())
        })
        .collect::<Vec<_>>()
        .join(" ")
}

/// The vendored llama.cpp is identified by the sys crate version (which pins one llama.cpp commit).
fn llama_cpp_version() -> &'static str {
    "llama-cpp-sys-2 0.1.161 (vendored llama.cpp, ggml 0.26.0)"
}

fn ids(tokens: &[LlamaToken]) -> Vec<i32> {
    tokens.iter().map(|t| t.0).collect()
}

/// Index of the largest logit; the first one wins a tie, as llama.cpp's greedy sampler does.
fn argmax(logits: &[f32]) -> usize {
    let mut best = 0;
    for (i, &v) in logits.iter().enumerate() {
        if v > logits[best] {
            best = i;
        }
    }
    best
}

/// The k largest (id, logit) pairs, largest first, ties broken by lower id.
fn top_k(logits: &[f32], k: usize) -> Vec<(usize, f32)> {
    let mut idx: Vec<usize> = (0..logits.len()).collect();
    let k = k.min(idx.len());
    let cmp = |a: &usize, b: &usize| logits[*b].total_cmp(&logits[*a]).then(a.cmp(b));
    idx.select_nth_unstable_by(k.saturating_sub(1), cmp);
    let mut top: Vec<usize> = idx[..k].to_vec();
    top.sort_by(cmp);
    top.into_iter().map(|i| (i, logits[i])).collect()
}

/// Mean and population standard deviation, accumulated in f64.
fn mean_std(logits: &[f32]) -> (f64, f64) {
    let n = logits.len() as f64;
    let mean = logits.iter().map(|&v| v as f64).sum::<f64>() / n;
    let var = logits.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / n;
    (mean, var.sqrt())
}

fn write_json(path: &Path, v: &Value) -> Result<()> {
    if let Some(dir) = path.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let text = json::render(v);
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn file_size(path: &Path) -> u64 {
    std::fs::metadata(path).map(|m| m.len()).unwrap_or(0)
}

// ---------------------------------------------------------------------------------------------
// tokens

fn tokens_cmd(backend: &LlamaBackend, m: &ModelArgs, texts: &Path, out: &Path) -> Result<()> {
    let list = read_texts(texts)?;
    let model = load_model(backend, &m.model)?;
    let vocab = model.vocab();
    let mut cases = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for text in &list {
        let plain = vocab.tokenize(text.as_bytes(), false, false);
        let special = vocab.tokenize(text.as_bytes(), true, true);
        seen.extend(plain.iter().chain(&special).map(|t| t.0));
        cases.push(json!({"text": text, "plain": ids(&plain), "special": ids(&special)}));
    }
    // Piece bytes (special tokens rendered) as hex, so a detokenizer test can check every id used.
    let pieces: serde_json::Map<String, Value> = seen
        .iter()
        .map(|&id| {
            let bytes = vocab.token_to_piece(LlamaToken(id), true, None);
            (id.to_string(), Value::String(hex(&bytes)))
        })
        .collect();
    let mut doc = model_info(&model, &m.name, &m.model);
    doc["cases"] = Value::Array(cases);
    doc["pieces_hex"] = Value::Object(pieces);
    write_json(out, &doc)?;
    println!(
        "{}: {} texts, {} distinct ids ({} bytes)",
        out.display(),
        list.len(),
        seen.len(),
        file_size(out)
    );
    Ok(())
}

/// Each text tokenized as llama-server tokenizes an embeddings input (special tokens added and parsed), evaluated
/// alone in a fresh context with mean pooling; the pooled vector is written as llama.cpp returns it (unnormalised).
fn embed_cmd(backend: &LlamaBackend, m: &ModelArgs, texts: &Path, out: &Path) -> Result<()> {
    use llama_cpp_2::context::params::LlamaPoolingType;
    let list = read_texts(texts)?;
    let model = load_model(backend, &m.model)?;
    let mut cases = Vec::new();
    for text in &list {
        let tokens = model.vocab().tokenize(text.as_bytes(), true, true);
        let n = tokens.len() as u32;
        let params = LlamaContextParams::default()
            .with_n_ctx(NonZeroU32::new(n.max(64)))
            .with_n_batch(n.max(64))
            .with_n_ubatch(n.max(64))
            .with_n_threads(m.threads)
            .with_n_threads_batch(m.threads)
            .with_embeddings(true)
            .with_pooling_type(LlamaPoolingType::Mean);
        let mut ctx = model
            .new_context(backend, params)
            .map_err(|e| anyhow!("llama.cpp could not create a context: {e}"))?;
        let mut batch = LlamaBatch::new(tokens.len(), 1);
        for (i, &tok) in tokens.iter().enumerate() {
            batch.add(tok, i as i32, &[0], true)?;
        }
        ctx.decode(&mut batch)
            .map_err(|e| anyhow!("llama.cpp decode failed: {e}"))?;
        let emb = ctx
            .embeddings_seq_ith(0)
            .map_err(|e| anyhow!("llama.cpp gave no pooled embedding: {e}"))?;
        cases.push(json!({"text": text, "tokens": ids(&tokens), "embedding": emb}));
    }
    let mut doc = model_info(&model, &m.name, &m.model);
    doc["pooling"] = json!("mean");
    doc["cases"] = Value::Array(cases);
    write_json(out, &doc)?;
    println!("{}: {} texts ({} bytes)", out.display(), list.len(), file_size(out));
    Ok(())
}

/// The strings of a `{"texts": [...]}` file.
fn read_texts(path: &Path) -> Result<Vec<String>> {
    let raw = std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    let parsed: Value = serde_json::from_str(&raw).with_context(|| format!("parsing {}", path.display()))?;
    let list = parsed
        .get("texts")
        .and_then(Value::as_array)
        .ok_or_else(|| anyhow!("{} has no \"texts\" array", path.display()))?;
    list.iter()
        .map(|t| {
            t.as_str()
                .map(str::to_string)
                .ok_or_else(|| anyhow!("a text in {} is not a string", path.display()))
        })
        .collect()
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

// ---------------------------------------------------------------------------------------------
// greedy

/// A ~200-token paragraph (written for this tool) to exercise longer prompts.
const LONG_PARAGRAPH: &str = "The old lighthouse stood at the edge of the harbour for more than a century, \
watching fishing boats leave before dawn and return in the late afternoon with their holds full of cod and \
mackerel. Its keeper, a quiet woman named Margaret, climbed the spiral staircase every evening to light the lamp, \
polish the great lens, and write a few lines in the logbook about the weather, the tides, and the ships that \
passed. Over the years the logbook grew into a remarkable record of the town's life: storms that tore roofs \
from houses, summers so calm that the sea looked like glass, the arrival of the first steamship, and the night \
the whole village gathered on the cliffs to watch a comet cross the sky. When the lighthouse was finally \
automated, Margaret donated the logbooks to the local library, where schoolchildren still read them today. \
Asked once what she had learned from all those years of watching the sea, she smiled and said that";

/// Chat prompt rendered with the model family's own template (gemma's GGUF carries none, so both are
/// written out here; gemma's leading <bos> is left out because add_special already adds it).
fn chat_prompt(arch: &str) -> Result<String> {
    let user = "What are three tips for staying healthy?";
    match arch {
        "llama" => Ok(format!(
            "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
             <|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        )),
        "gemma3" => Ok(format!(
            "<start_of_turn>user\n{user}<end_of_turn>\n<start_of_turn>model\n"
        )),
        other => bail!("no chat template written for architecture {other}"),
    }
}

fn greedy_cmd(backend: &LlamaBackend, m: &ModelArgs, n_predict: usize, n_ctx: u32, out: &Path) -> Result<()> {
    let model = load_model(backend, &m.model)?;
    let arch = model.meta_val_str("general.architecture").unwrap_or_default();
    let prompts: Vec<(&str, String)> = vec![
        ("capital", "The capital of France is".to_string()),
        ("code", "def fibonacci(n):".to_string()),
        ("question", "Why is the sky blue?".to_string()),
        ("story", "Once upon a time, in a small village by the sea,".to_string()),
        ("paragraph", LONG_PARAGRAPH.to_string()),
        ("chat", chat_prompt(&arch)?),
    ];
    let vocab = model.vocab();
    let mut ctx = new_context(backend, &model, n_ctx, n_ctx, 512, m.threads)?;
    let mut results = Vec::new();
    let mut total_steps = 0;
    let mut min_gap = f32::INFINITY;
    for (label, text) in &prompts {
        let prompt = vocab.tokenize(text.as_bytes(), true, true);
        if prompt.is_empty() || prompt.len() + n_predict > n_ctx as usize {
            bail!(
                "prompt {label} has {} tokens, which does not fit n_ctx {n_ctx}",
                prompt.len()
            );
        }
        ctx.clear_kv_cache();
        let mut batch = LlamaBatch::new(prompt.len().max(1), 1);
        let last = prompt.len() - 1;
        for (i, &t) in prompt.iter().enumerate() {
            batch.add(t, i as i32, &[0], i == last)?;
        }
        ctx.decode(&mut batch)
            .map_err(|e| anyhow!("decode failed on prompt {label}: {e}"))?;

        let logits = ctx.get_logits_ith(batch.n_tokens() - 1).to_vec();
        let (mean, std) = mean_std(&logits);
        let top20: Vec<Value> = top_k(&logits, 20).into_iter().map(|(i, v)| json!([i, v])).collect();

        let mut steps = Vec::new();
        let mut output = Vec::new();
        let mut cur = logits;
        // Generation runs the full n_predict steps even past an end-of-generation token, so every prompt
        // yields the same amount of comparison data; first_eog marks where a chat front end would stop.
        let mut first_eog = None;
        for step in 0..n_predict {
            let top2 = top_k(&cur, 2);
            let (id, logit) = top2[0];
            let gap = logit - top2[1].1;
            debug_assert_eq!(id, argmax(&cur));
            min_gap = min_gap.min(gap);
            steps.push(json!({"id": id, "logit": logit, "second": top2[1].0, "gap": gap}));
            let tok = LlamaToken(id as i32);
            if first_eog.is_none() && vocab.is_eog(tok) {
                first_eog = Some(output.len());
            }
            output.push(tok);
            if step + 1 == n_predict {
                break;
            }
            batch.clear();
            batch.add(tok, (prompt.len() + step) as i32, &[0], true)?;
            ctx.decode(&mut batch)
                .map_err(|e| anyhow!("decode failed while generating for {label}: {e}"))?;
            cur = ctx.get_logits_ith(0).to_vec();
        }
        total_steps += output.len();
        let text_out = String::from_utf8_lossy(&vocab.detokenize(&output, false, true)).into_owned();
        results.push(json!({
            "label": label,
            "prompt": text,
            "prompt_ids": ids(&prompt),
            "output_ids": ids(&output),
            "first_eog": first_eog,
            "output_text": text_out,
            "steps": steps,
            "last_prompt_logits": {"top20": top20, "mean": mean, "std": std},
        }));
    }
    let mut doc = model_info(&model, &m.name, &m.model);
    doc["settings"] = json!({
        "n_ctx": n_ctx, "n_batch": n_ctx, "n_ubatch": 512, "threads": m.threads, "n_predict": n_predict,
        "add_special": true, "parse_special": true, "sampling": "argmax, first index wins ties; always n_predict steps, even past an end-of-generation token",
    });
    doc["prompts"] = Value::Array(results);
    write_json(out, &doc)?;
    println!(
        "{}: {} prompts, {} generated tokens, smallest top-2 gap {:.4} ({} bytes)",
        out.display(),
        prompts.len(),
        total_steps,
        min_gap,
        file_size(out)
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// perplexity

/// Negative log-likelihood of `tok`, computed exactly as llama-perplexity's log_softmax: max in f32,
/// sum of expf(logit - max) accumulated in f64, then (logit - max) - ln(sum).
fn nll(logits: &[f32], tok: usize) -> f64 {
    let max = logits.iter().copied().fold(logits[0], f32::max);
    let sum: f64 = logits.iter().map(|&v| (v - max).exp() as f64).sum();
    -(((logits[tok] - max) as f64) - sum.ln())
}

fn ppl_cmd(
    backend: &LlamaBackend,
    m: &ModelArgs,
    text_path: &Path,
    n_ctx: u32,
    n_seq: usize,
    out: &Path,
    dump_logits: Option<&Path>,
) -> Result<()> {
    if n_seq == 0 {
        bail!("--n-seq must be at least 1");
    }
    let mut text = std::fs::read_to_string(text_path).with_context(|| format!("reading {}", text_path.display()))?;
    // llama-perplexity's `-f` drops one trailing newline from the file before tokenizing.
    if text.ends_with('\n') {
        text.pop();
    }
    let model = load_model(backend, &m.model)?;
    let vocab = model.vocab();
    if vocab.should_add_eos() {
        bail!("llama-perplexity refuses models that add EOS; so does this tool");
    }
    let add_bos = vocab.should_add_bos();
    // common_tokenize(ctx, text, add_special = true) with parse_special left at false.
    let tokens = vocab.tokenize(text.as_bytes(), true, false);
    let n = n_ctx as usize;
    if tokens.len() < 2 * n {
        bail!(
            "{} tokenizes to {} tokens; perplexity needs at least {}",
            text_path.display(),
            tokens.len(),
            2 * n
        );
    }
    let n_chunk = tokens.len() / n;
    let first = n / 2;
    // n_seq chunks per decode, each its own sequence of n_ctx cells; with n_seq = 1 this is
    // llama-perplexity with -b equal to -c.
    let n_kv = (n * n_seq) as u32;
    let params = LlamaContextParams::default()
        .with_n_ctx(NonZeroU32::new(n_kv))
        .with_n_batch(n_kv)
        .with_n_ubatch(n_ctx.min(512))
        .with_n_seq_max(n_seq as u32)
        .with_n_threads(m.threads)
        .with_n_threads_batch(m.threads);
    let mut ctx = model
        .new_context(backend, params)
        .map_err(|e| anyhow!("llama.cpp could not create a context: {e}"))?;
    let mut batch = LlamaBatch::new(n * n_seq, n_seq as i32);
    let n_vocab = vocab.n_tokens() as usize;

    let mut nll_sum = 0.0f64;
    let mut nll2_sum = 0.0f64;
    let mut count = 0usize;
    let mut running = Vec::new();
    let mut argmaxes = Vec::new();
    let mut nlls = Vec::new();
    let mut matches = 0usize;
    let mut dump = Vec::new();
    let t0 = Instant::now();
    for group in (0..n_chunk).step_by(n_seq) {
        let n_seq_batch = n_seq.min(n_chunk - group);
        ctx.clear_kv_cache();
        batch.clear();
        for s in 0..n_seq_batch {
            let start = (group + s) * n;
            for k in 0..n {
                let mut tok = tokens[start + k];
                if k == 0 && add_bos {
                    tok = vocab.bos();
                }
                // Only positions >= first produce logits, as in llama-perplexity.
                batch.add(tok, k as i32, &[s as i32], k >= first)?;
            }
        }
        ctx.decode(&mut batch)
            .map_err(|e| anyhow!("decode failed on chunk {group}: {e}"))?;
        for s in 0..n_seq_batch {
            let c = group + s;
            let start = c * n;
            // Positions first .. n-2 predict tokens first+1 .. n-1 (n - first - 1 scores per chunk).
            for j in first..n - 1 {
                let logits = ctx.get_logits_ith((s * n + j) as i32);
                if logits.len() != n_vocab {
                    bail!("unexpected logits length {}", logits.len());
                }
                if c == 0 && dump_logits.is_some() {
                    dump.extend(logits.iter().flat_map(|v| v.to_le_bytes()));
                }
                let target = tokens[start + j + 1].0 as usize;
                let v = nll(logits, target);
                nll_sum += v;
                nll2_sum += v * v;
                count += 1;
                let am = argmax(logits);
                matches += usize::from(am == target);
                argmaxes.push(am);
                nlls.push((v * 1e6).round() / 1e6);
            }
            running.push((nll_sum / count as f64).exp());
        }
    }
    if let Some(p) = dump_logits {
        std::fs::write(p, &dump).with_context(|| format!("writing {}", p.display()))?;
    }
    let mean = nll_sum / count as f64;
    let ppl = mean.exp();
    let var = nll2_sum / count as f64 - mean * mean;
    let ppl_err = if var > 0.0 {
        (var / (count as f64 - 1.0)).sqrt() * ppl
    } else {
        f64::NAN
    };

    let mut doc = model_info(&model, &m.name, &m.model);
    doc["settings"] = json!({
        "text_file": text_path.file_name().map(|f| f.to_string_lossy().into_owned()),
        "n_ctx": n_ctx, "n_batch": n_kv, "n_seq": n_seq, "threads": m.threads, "first": first,
        "add_special": true, "parse_special": false, "bos_replaces_first_token": add_bos,
    });
    doc["n_tokens"] = json!(tokens.len());
    doc["n_chunks"] = json!(n_chunk);
    doc["scored_per_chunk"] = json!(n - first - 1);
    doc["n_scored"] = json!(count);
    doc["ppl"] = json!(ppl);
    doc["ppl_stderr"] = json!(ppl_err);
    doc["mean_nll"] = json!(mean);
    doc["chunk_running_ppl"] = json!(running);
    doc["top1_matches_target"] = json!(matches);
    doc["tokens"] = json!(ids(&tokens));
    doc["argmax"] = json!(argmaxes);
    doc["nll"] = json!(nlls);
    write_json(out, &doc)?;
    println!(
        "{}: {} tokens, {} chunks of {}, ppl {:.4} +/- {:.5}, top-1 = target {}/{} ({:.1}s, {} bytes)",
        out.display(),
        tokens.len(),
        n_chunk,
        n_ctx,
        ppl,
        ppl_err,
        matches,
        count,
        t0.elapsed().as_secs_f64(),
        file_size(out)
    );
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// bench

/// Deterministic pseudo-random token ids (xorshift), like llama-bench's random prompt tokens.
fn random_tokens(n: usize, n_vocab: i32, seed: &mut u64) -> Vec<LlamaToken> {
    (0..n)
        .map(|_| {
            *seed ^= *seed << 13;
            *seed ^= *seed >> 7;
            *seed ^= *seed << 17;
            LlamaToken((*seed % n_vocab as u64) as i32)
        })
        .collect()
}

fn bench_cmd(backend: &LlamaBackend, a: &BenchArgs) -> Result<()> {
    if a.repetitions == 0 {
        bail!("-r must be at least 1");
    }
    let model = load_model_on(backend, &a.model, a.gpu_layers)?;
    let n_vocab = model.vocab().n_tokens();
    let bos = model.vocab().bos();
    let n_ctx = (a.depth + a.n_prompt.max(a.n_gen) + 1).max(16) as u32;
    let n_batch = a.n_batch.max(1);
    let mut ctx = new_context(backend, &model, n_ctx, n_batch, n_batch.min(512), a.threads)?;
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let file = a.model.file_name().map(|f| f.to_string_lossy().into_owned());

    // Decodes `toks` at positions `pos0..` in batches of `n_batch`, logits for the last token only.
    let feed = |ctx: &mut LlamaContext, toks: &[LlamaToken], pos0: usize| -> Result<()> {
        for (ci, chunk) in toks.chunks(n_batch as usize).enumerate() {
            let mut batch = LlamaBatch::new(chunk.len(), 1);
            let base = pos0 + ci * n_batch as usize;
            for (i, &tok) in chunk.iter().enumerate() {
                batch.add(tok, (base + i) as i32, &[0], i == chunk.len() - 1)?;
            }
            ctx.decode(&mut batch).map_err(|e| anyhow!("decode failed: {e}"))?;
        }
        Ok(())
    };
    // Clears the cache and fills it with `depth` filler tokens (untimed), BOS first.
    let fill = |ctx: &mut LlamaContext, seed: &mut u64| -> Result<()> {
        ctx.clear_kv_cache();
        if a.depth > 0 {
            let mut toks = random_tokens(a.depth, n_vocab, seed);
            toks[0] = bos;
            feed(ctx, &toks, 0)?;
        }
        Ok(())
    };
    let run_pp = |ctx: &mut LlamaContext, seed: &mut u64| -> Result<f64> {
        fill(ctx, seed)?;
        let mut toks = random_tokens(a.n_prompt, n_vocab, seed);
        if a.depth == 0 {
            toks[0] = bos;
        }
        let t = Instant::now();
        feed(ctx, &toks, a.depth)?;
        let _ = ctx.get_logits_ith(-1);
        Ok(t.elapsed().as_secs_f64())
    };
    let run_tg = |ctx: &mut LlamaContext, seed: &mut u64| -> Result<f64> {
        fill(ctx, seed)?;
        let toks = random_tokens(a.n_gen, n_vocab, seed);
        let mut batch = LlamaBatch::new(1, 1);
        let t = Instant::now();
        let mut tok = if a.depth == 0 { bos } else { toks[0] };
        for (i, &next) in toks.iter().enumerate() {
            batch.clear();
            batch.add(tok, (a.depth + i) as i32, &[0], true)?;
            ctx.decode(&mut batch).map_err(|e| anyhow!("decode failed: {e}"))?;
            let _ = ctx.get_logits_ith(0);
            tok = next;
        }
        Ok(t.elapsed().as_secs_f64())
    };

    let mut tests: Vec<(String, usize, bool)> = Vec::new();
    if a.n_prompt > 0 {
        tests.push((format!("pp{}", a.n_prompt), a.n_prompt, true));
    }
    if a.n_gen > 0 {
        tests.push((format!("tg{}", a.n_gen), a.n_gen, false));
    }
    for (name, n, is_pp) in tests {
        // One warm-up run, as llama-bench does.
        let _warmup = if is_pp {
            run_pp(&mut ctx, &mut seed)?
        } else {
            run_tg(&mut ctx, &mut seed)?
        };
        let mut rates = Vec::new();
        for _ in 0..a.repetitions {
            let secs = if is_pp {
                run_pp(&mut ctx, &mut seed)?
            } else {
                run_tg(&mut ctx, &mut seed)?
            };
            rates.push(n as f64 / secs);
        }
        let mut sorted = rates.clone();
        sorted.sort_by(f64::total_cmp);
        let median = if sorted.len() % 2 == 1 {
            sorted[sorted.len() / 2]
        } else {
            (sorted[sorted.len() / 2 - 1] + sorted[sorted.len() / 2]) / 2.0
        };
        let line = json!({
            "engine": "llama.cpp", "llama_cpp": llama_cpp_version(), "cpu": cpu_features(), "model": file, "test": name,
            "threads": a.threads, "n_batch": n_batch, "depth": a.depth, "gpu_layers": a.gpu_layers, "repetitions": a.repetitions,
            "median_tokens_per_s": median, "all_tokens_per_s": rates,
        });
        println!("{line}");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn argmax_prefers_first_of_ties() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]), 1);
    }

    #[test]
    fn top_k_orders_by_value_then_id() {
        let t = top_k(&[0.5, 2.0, 1.0, 2.0, -1.0], 3);
        assert_eq!(t, vec![(1, 2.0), (3, 2.0), (2, 1.0)]);
    }

    #[test]
    fn nll_matches_log_softmax() {
        let logits = [1.0f32, 2.0, 3.0];
        let z: f64 = logits.iter().map(|&v| (v as f64).exp()).sum();
        let want = -(2.0f64 - z.ln());
        assert!((nll(&logits, 1) - want).abs() < 1e-6);
    }

    #[test]
    fn mean_std_of_constant_is_zero_spread() {
        let (m, s) = mean_std(&[2.0, 2.0, 2.0]);
        assert_eq!((m, s), (2.0, 0.0));
    }
}
