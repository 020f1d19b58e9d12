//! The `baton` command. Standard output carries only what the user asked for (generated text, token ids,
//! figures); progress, logs and the closing speed line go to standard error.

use anyhow::{Context, Result, bail};
use baton::chat::{ChatExtras, ChatMessage, ChatTemplate, TemplateKwargs};
use baton::engine::Session;
use baton::engine::sampler::SamplerParams;
use baton::generate::{GenParams, Prompt};
use baton::gguf::GgufFile;
use baton::kernels::ThreadPool;
use baton::logging::LogFormat;
use baton::model::Hparams;
use baton::topology::{Builder, TopologyArgs, load};
use baton::util::limits::*;
use baton::vocab::Vocab;
use baton::{fetch, fingerprint};
use clap::{Args, Parser, Subcommand};
use std::collections::BTreeMap;
use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

#[derive(Parser)]
#[command(
    name = "baton",
    version,
    about = "Run LLMs across several machines of different kinds"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
    /// Arithmetic of every forward pass: `fast` (Baton's kernels) or `ggml` (llama.cpp's CPU arithmetic reproduced
    /// bit for bit: slower, for checking against llama.cpp). Same as the BATON_NUMERICS variable.
    #[arg(long, global = true, value_parser = ["fast", "ggml"])]
    numerics: Option<String>,
    /// Where layers run: `cpu` (default), `gpu` (Vulkan, Metal or DX12; an error when there is no GPU) or `auto`
    /// (a hardware GPU when there is one, else the CPU; never a software adapter). Same as BATON_BACKEND.
    #[arg(long, global = true, value_parser = ["cpu", "gpu", "auto"])]
    backend: Option<String>,
    /// With a GPU backend, only the model's first N layers run on the GPU and the rest on the CPU, for a model
    /// larger than the GPU's memory (llama.cpp's -ngl). Default: all. Same as BATON_GPU_LAYERS.
    #[arg(long = "gpu-layers", global = true, value_name = "N")]
    gpu_layers: Option<usize>,
    /// Leave a mixture-of-experts model's experts in the mapped file, read on demand, instead of repacking them into
    /// memory at load: for a model whose experts exceed the RAM (the kernel keeps the hot ones cached). Slower
    /// (row-major kernels, page faults); the memory check then counts only the other weights. Same as
    /// BATON_EXPERTS_ON_DISK=1.
    #[arg(long = "experts-on-disk", global = true)]
    experts_on_disk: bool,
    /// How diagnostics on standard error are written: `text` (one plain line per event) or `json` (one object per
    /// line). Which events: the RUST_LOG variable (default `info`; e.g. `RUST_LOG=debug`, `RUST_LOG=baton::cluster=debug`).
    #[arg(long = "log-format", global = true, value_enum, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Cmd {
    /// Generate text from a prompt.
    Run(Box<RunArgs>),
    /// Print a model's architecture, hyperparameters, tensors, tokenizer and chat template.
    Info {
        /// Model: `smollm2`, `gemma3`, or a path to a GGUF file.
        model: String,
        /// List every tensor.
        #[arg(long)]
        tensors: bool,
    },
    /// Print the token ids of a file's bytes (no BOS), space-separated on one line.
    Tokenize {
        model: String,
        file: PathBuf,
        /// Show each token's text next to its id.
        #[arg(long)]
        pieces: bool,
    },
    /// Perplexity in llama-perplexity's convention (second half of each chunk scored).
    Perplexity(PerplexityArgs),
    /// Measure prompt-processing (pp) and generation (tg) speed, like llama-bench.
    Bench(BenchArgs),
    /// Rewrite a model with its weight matrices in another type (f32, f16, q8_0, q5_0, q5_1, q4_0, q4_1, q4_k,
    /// iq4_nl, iq4_xs; rows that are not whole 256-weight blocks fall back to q5_0 for q4_k, to iq4_nl for iq4_xs).
    Quantize {
        /// Input model (name or path).
        input: String,
        /// Output GGUF path.
        output: PathBuf,
        /// Target type.
        #[arg(long = "type", default_value = "q8_0")]
        ty: String,
    },
    /// Serve layer ranges of a model to coordinators on other machines.
    Node(NodeArgs),
    /// Disaggregated prefill on this machine: a prefill node and a decode node, next to the local run.
    Demo(DemoArgs),
    /// OpenAI-compatible HTTP server (local, --pipeline, or --cluster with a router over nodes).
    Serve(Box<ServeArgs>),
    /// Ensembles of models with different vocabularies.
    Ensemble {
        #[command(subcommand)]
        cmd: EnsembleCmd,
    },
    /// Manage the model cache.
    Models {
        #[command(subcommand)]
        cmd: ModelsCmd,
    },
    /// What a running `baton serve` drives: its nodes, links and last requests.
    Cluster {
        #[command(subcommand)]
        cmd: ClusterCmd,
    },
}

#[derive(Subcommand)]
enum ClusterCmd {
    /// Prints a server's `/v1/cluster` as tables (or as JSON).
    Status {
        /// The server: `HOST:PORT` or `http://HOST:PORT`.
        addr: String,
        /// The server's API key, if it has one.
        #[arg(long = "api-key")]
        api_key: Option<String>,
        /// The JSON as the server sends it.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Subcommand)]
enum EnsembleCmd {
    /// Fit mixture weights that minimise bits per byte on a development text; prints `mix:W1,W2,...`.
    Fit {
        /// Members: `smollm2@local,gemma3@HOST:PORT`.
        #[arg(long)]
        ensemble: String,
        /// The development text (documents separated by blank lines).
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Each member's context in tokens.
        #[arg(long = "ctx", short = 'c', default_value_t = 512, value_parser = counts(1, MAX_CTX))]
        ctx: usize,
        #[arg(short = 't', long, value_parser = counts(1, MAX_THREADS))]
        threads: Option<usize>,
    },
    /// Accuracy of each member and of the mixture on a cloze file (context, right ending, wrong endings; tab-separated).
    Cloze {
        #[arg(long)]
        ensemble: String,
        #[arg(short = 'f', long = "file")]
        file: PathBuf,
        /// Mixture weights: mix:W1,W2,... (default equal).
        #[arg(long, default_value = "union")]
        combine: String,
        #[arg(short = 't', long, value_parser = counts(1, MAX_THREADS))]
        threads: Option<usize>,
    },
}

#[derive(Subcommand)]
enum ModelsCmd {
    /// Download, verify and cache the default models (or the named ones).
    Fetch { names: Vec<String> },
    /// List the known models and where they are cached.
    List,
}

#[derive(Args)]
struct CommonModelArgs {
    /// Model: `smollm2`, `gemma3`, or a path to a GGUF file.
    #[arg(short = 'm', long, default_value = "smollm2")]
    model: String,
    /// Threads (default: all cores; at most 1024).
    #[arg(short = 't', long, value_parser = counts(1, MAX_THREADS))]
    threads: Option<usize>,
    /// Context size in tokens per session.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096, value_parser = counts(1, MAX_CTX))]
    ctx_size: usize,
    /// Largest batch of tokens run in one forward pass during prompt processing. 256 prefills as fast as 512 with
    /// these kernels (their tiles are 8 tokens) and halves the scratch memory.
    #[arg(short = 'b', long = "batch-size", default_value_t = 256, value_parser = counts(1, MAX_BATCH))]
    batch_size: usize,
    /// Load even when the weights plus the KV (context × sessions) exceed the memory available.
    #[arg(long = "no-mem-check")]
    no_mem_check: bool,
}

/// The prefix cache on disk, for `run` and `serve`.
#[derive(Args)]
struct KvCacheArgs {
    /// Keep prompt prefixes' KV in this directory (every 256 tokens), so a prefix sent again, even after a
    /// restart, is read back instead of prefilled (docs/kv-cache.md).
    #[arg(long = "kv-cache-dir")]
    kv_cache_dir: Option<PathBuf>,
    /// Most GiB the --kv-cache-dir entries take; the least recently used go first.
    #[arg(long = "kv-cache-size", default_value_t = 8.0, value_parser = baton::util::parse_gib)]
    kv_cache_size: f64,
}

impl KvCacheArgs {
    fn open(&self) -> Result<Option<Arc<baton::engine::disk_cache::DiskCache>>> {
        self.kv_cache_dir
            .as_deref()
            .map(|d| baton::engine::disk_cache::DiskCache::open_gib(d, self.kv_cache_size).map(Arc::new))
            .transpose()
    }
}

#[derive(Args)]
struct RunArgs {
    #[command(flatten)]
    common: CommonModelArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// Restore a conversation saved with --save-session before the prompt (same weights only); the prompt then
    /// continues it, and only what it adds is prefilled.
    #[arg(long = "load-session")]
    load_session: Option<PathBuf>,
    /// Save the conversation (KV and token ids) to this file after generating.
    #[arg(long = "save-session")]
    save_session: Option<PathBuf>,
    /// The prompt (or use -f).
    prompt: Option<String>,
    /// Read the prompt from a file.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// Tokens to generate (-1: until end of generation or the context is full).
    #[arg(
        short = 'n',
        long = "n-predict",
        default_value_t = 256,
        allow_negative_numbers = true
    )]
    n_predict: i64,
    /// Apply the model's chat template to the prompt as a user message.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long)]
    system: Option<String>,
    /// Variables for the chat template of --chat, as a JSON object: `{"enable_thinking": false}` asks Qwen 3 to
    /// answer without thinking.
    #[arg(long = "chat-template-kwargs", value_name = "JSON", value_parser = chat_template_kwargs)]
    chat_template_kwargs: Option<TemplateKwargs>,
    /// Print the prompt before the generated text.
    #[arg(long)]
    echo: bool,
    // The sampling defaults are SamplerParams::default() (llama.cpp's), the one set.
    /// Temperature; 0 means greedy.
    #[arg(long, default_value_t = SamplerParams::default().temp)]
    temp: f32,
    #[arg(long = "top-k", default_value_t = SamplerParams::default().top_k)]
    top_k: usize,
    #[arg(long = "top-p", default_value_t = SamplerParams::default().top_p)]
    top_p: f32,
    #[arg(long = "min-p", default_value_t = SamplerParams::default().min_p)]
    min_p: f32,
    #[arg(long = "repeat-penalty", default_value_t = SamplerParams::default().repeat_penalty)]
    repeat_penalty: f32,
    #[arg(long = "repeat-last-n", default_value_t = SamplerParams::default().repeat_last_n)]
    repeat_last_n: usize,
    /// Random seed (default: random).
    #[arg(long)]
    seed: Option<u64>,
    /// Verbose: timings and details on standard error.
    #[arg(short = 'v', long)]
    verbose: bool,
    /// Split the layers over nodes: `HOST:PORT=A:B,...,local=C:end` (B exclusive); every layer exactly once.
    #[arg(long)]
    pipeline: Option<String>,
    /// Hidden-state precision on the wire for --pipeline and --experts-split: 32, 16 (or bf16) or 8.
    #[arg(long = "wire-bits", default_value = "32")]
    wire_bits: String,
    /// Shared secret for nodes that listen beyond loopback.
    #[arg(long = "secret-file")]
    secret_file: Option<PathBuf>,
    /// Run about half of each mixture-of-experts layer's experts on this `baton node` (HOST:PORT, same model file):
    /// this process routes, runs attention and the other half, and adds the node's outputs. With --wire-bits 32 the
    /// output is the single-process output; a node that fails leaves its experts to this process.
    #[arg(long = "experts-split", value_name = "HOST:PORT")]
    experts_split: Option<String>,
    #[command(flatten)]
    mix: MixArgs,
    /// Prefill prompts on this `baton node` (HOST:PORT; a comma list: the least-loaded one per request); the decode
    /// side (this process, or --decode-node) holds the full KV and decodes alone.
    #[arg(long = "prefill-node")]
    prefill_node: Option<String>,
    /// Decode on this `baton node` (HOST:PORT, all layers) instead of here; with --prefill-node it pulls the
    /// prompt's KV from the prefill node itself (authenticating with its own --secret-file).
    #[arg(long = "decode-node")]
    decode_node: Option<String>,
    /// With --prefill-node: auto (decide per request from measured speeds), never, always, or a share of the
    /// layers such as 60%.
    #[arg(long, default_value = "auto")]
    offload: String,
    /// With --prefill-node: prefill exactly the first K layers remotely, the rest here (overrides --offload).
    #[arg(long = "offload-layers")]
    offload_layers: Option<usize>,
    /// With --prefill-node: KV precision on the wire: 16 (exact: the KV cache holds f16), 32, bf16 or 8.
    #[arg(long = "kv-bits", default_value = "16")]
    kv_bits: String,
    /// With --prefill-node: seconds of silence before the prefill node is given up (the prompt is then prefilled
    /// here).
    #[arg(long = "prefill-timeout", default_value = "10", value_parser = baton::util::parse_timeout)]
    prefill_timeout: std::time::Duration,
}

#[derive(Args)]
struct DemoArgs {
    /// Model: `smollm2`, `gemma3`, or a path to a GGUF file (fetched if needed).
    #[arg(short = 'm', long, default_value = "smollm2")]
    model: String,
    /// Threads of the prefill node.
    #[arg(long = "prefill-threads", default_value_t = 2, value_parser = counts(1, MAX_THREADS))]
    prefill_threads: usize,
    /// Threads of the decode node (and of the local run it is compared with).
    #[arg(long = "decode-threads", default_value_t = 1, value_parser = counts(1, MAX_THREADS))]
    decode_threads: usize,
    /// Prompt length in tokens (about).
    #[arg(short = 'p', long = "prompt-tokens", default_value_t = 1500, value_parser = counts(1, MAX_CTX))]
    prompt_tokens: usize,
    #[arg(short = 'n', long = "n-predict", default_value_t = 32, value_parser = counts(1, MAX_CTX))]
    n_predict: usize,
    /// KV precision on the wire: 16 (exact: the KV cache holds f16), 32, bf16 or 8.
    #[arg(long = "kv-bits", default_value = "16")]
    kv_bits: String,
}

#[derive(Args)]
struct NodeArgs {
    /// Model: `smollm2`, `gemma3`, or a path to a GGUF file.
    #[arg(short = 'm', long, default_value = "smollm2")]
    model: String,
    /// Address to listen on (port 0 picks a free one).
    #[arg(long, default_value = "127.0.0.1:7070")]
    listen: String,
    /// Serve only this layer range (`A:B`, B exclusive, or `A:end`), loaded at start.
    #[arg(long)]
    layers: Option<String>,
    /// Shared secret; required to listen on anything but loopback.
    #[arg(long = "secret-file")]
    secret_file: Option<PathBuf>,
    /// Threads (default: all cores; at most 1024).
    #[arg(short = 't', long, value_parser = counts(1, MAX_THREADS))]
    threads: Option<usize>,
    /// Largest context a session may ask for.
    #[arg(short = 'c', long = "ctx-size", default_value_t = 4096, value_parser = counts(1, MAX_CTX))]
    ctx_size: usize,
    /// Largest batch a session may ask for.
    #[arg(short = 'b', long = "batch-size", default_value_t = 512, value_parser = counts(1, MAX_BATCH))]
    batch_size: usize,
    /// Sessions kept at once (least recently used evicted).
    #[arg(long = "max-sessions", default_value_t = 16, value_parser = counts(1, MAX_NODE_COUNT))]
    max_sessions: usize,
    /// Seconds a peer has for each whole frame once its first byte arrived, and for each write (also for each
    /// handshake frame from the moment it connects).
    #[arg(long, default_value = "30", value_parser = baton::util::parse_timeout)]
    timeout: std::time::Duration,
    /// Seconds of silence between requests before a connection is closed.
    #[arg(long = "idle-timeout", default_value = "300", value_parser = baton::util::parse_timeout)]
    idle_timeout: std::time::Duration,
    /// Connections open at once; more are refused with an ERROR (each holds a thread).
    #[arg(long = "max-connections", default_value_t = baton::cluster::node::DEFAULT_MAX_CONNECTIONS,
          value_parser = counts(1, MAX_NODE_COUNT))]
    max_connections: usize,
    /// Connections that have not authenticated yet, at once; more are refused, so strangers cannot lock out peers.
    #[arg(long = "max-handshakes", default_value_t = baton::cluster::node::DEFAULT_MAX_HANDSHAKES,
          value_parser = counts(1, MAX_NODE_COUNT))]
    max_handshakes: usize,
    /// Step each session's decode on its own instead of batching the steps that arrive together.
    #[arg(long = "no-batch")]
    no_batch: bool,
    /// GiB the sessions may hold together in KV and scratch (a session's scratch grows with its batch size); an OPEN
    /// beyond it (idle sessions evicted first) is refused. Default: every session at --ctx-size and --batch-size, as
    /// much as the memory after the weights holds.
    #[arg(long = "kv-budget", value_parser = baton::util::parse_gib)]
    kv_budget: Option<f64>,
    /// Start even when the weights plus one session's KV (or --kv-budget) exceed the memory available.
    #[arg(long = "no-mem-check")]
    no_mem_check: bool,
    // The prefills this node serves (PREFILL) read and write their prompts' prefixes there.
    #[command(flatten)]
    kv_cache: KvCacheArgs,
}

/// Several models behind one generator (`baton run` and `baton serve`): an ensemble, or a target with a draft.
#[derive(Args, Clone)]
struct MixArgs {
    /// Ensemble of models combined per step: `smollm2@local,gemma3@HOST:PORT` (a remote member is a `baton node`
    /// serving all its layers).
    #[arg(long)]
    ensemble: Option<String>,
    /// How --ensemble combines its members: union (default), confident, or mix:W1,W2,...
    #[arg(long, default_value = "union")]
    combine: String,
    /// With --ensemble: a member that fails is dropped and the others continue (said on standard error).
    #[arg(long = "ensemble-degrade")]
    ensemble_degrade: bool,
    /// Speculative decoding: a draft model proposes tokens the target verifies in one pass. `MODEL` runs here,
    /// `MODEL@HOST:PORT` on a `baton node` (the model file is read here for its tokenizer). Output is exactly the
    /// target's; the vocabularies may differ.
    #[arg(long)]
    draft: Option<String>,
    /// Draft tokens per round, or `auto` (adapts to the acceptance rate and the draft's cost; turns speculation off
    /// where it does not pay).
    #[arg(long = "draft-tokens", default_value = "auto")]
    draft_tokens: String,
}

#[derive(Args)]
struct ServeArgs {
    #[command(flatten)]
    common: CommonModelArgs,
    #[command(flatten)]
    kv_cache: KvCacheArgs,
    /// Directory where `POST /slots/{id}?action=save|restore` keep sessions (the endpoints are off without it).
    #[arg(long = "slot-save-path")]
    slot_save_path: Option<PathBuf>,
    /// Model id clients use (default: the --model argument, or the file stem of a path).
    #[arg(long = "served-name")]
    served_name: Option<String>,
    /// Address to listen on (port 0 picks a free one, printed on start).
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: String,
    /// Bearer key clients must send; required when not listening on loopback.
    #[arg(long = "api-key")]
    api_key: Option<String>,
    /// Sessions generating at once (each with its own KV); per decode node with --cluster (1..=256).
    #[arg(long, default_value_t = 1, value_parser = counts(1, MAX_SLOTS))]
    parallel: usize,
    /// Requests that may wait for a free session; beyond them the answer is 429 (at most 65536).
    #[arg(long, default_value_t = 16, value_parser = counts(0, MAX_QUEUE))]
    queue: usize,
    /// Local slots decode one session per forward, taking turns, instead of together in batched steps.
    #[arg(long = "no-batch")]
    no_batch: bool,
    /// Layers over nodes, like `baton run --pipeline`.
    #[arg(long)]
    pipeline: Option<String>,
    /// A TOML file naming nodes, roles (prefill, decode, stage) and links (see docs/server.md).
    #[arg(long)]
    cluster: Option<PathBuf>,
    /// Hidden-state precision on the wire: 32, 16 (or bf16) or 8.
    #[arg(long = "wire-bits", default_value = "32")]
    wire_bits: String,
    /// Shared secret for nodes that listen beyond loopback.
    #[arg(long = "secret-file")]
    secret_file: Option<PathBuf>,
    /// Run about half of each mixture-of-experts layer's experts on this `baton node` (HOST:PORT, same model file):
    /// this process routes, runs attention and the other half, and adds the node's outputs. With --wire-bits 32 the
    /// output is the single-process output; a node that fails leaves its experts to this process.
    #[arg(long = "experts-split", value_name = "HOST:PORT")]
    experts_split: Option<String>,
    /// Seconds to wait on a node's answer before the request fails.
    #[arg(long = "node-timeout", default_value = "30", value_parser = baton::util::parse_timeout)]
    node_timeout: std::time::Duration,
    /// Seconds a client has to send a request's headers; an idle keep-alive connection is closed after as long.
    #[arg(long = "header-timeout", default_value = "30", value_parser = baton::util::parse_timeout)]
    header_timeout: std::time::Duration,
    /// Seconds a client has to send a request's whole body (at most 4 MiB).
    #[arg(long = "body-timeout", default_value = "60", value_parser = baton::util::parse_timeout)]
    body_timeout: std::time::Duration,
    /// Chat template variables of requests that do not set them, as a JSON object (a request's
    /// `chat_template_kwargs` wins key by key), e.g. `{"enable_thinking": false}`.
    #[arg(long = "chat-template-kwargs", value_name = "JSON", value_parser = chat_template_kwargs)]
    chat_template_kwargs: Option<TemplateKwargs>,
    /// Where a thinking model's think block goes when a request's `reasoning_format` does not say: `deepseek` (or
    /// `auto`): `reasoning_content`, the rest in `content`; `none`: left in `content`.
    #[arg(long = "reasoning-format", value_name = "FORMAT", default_value = "auto", value_parser = reasoning_format)]
    reasoning_format: baton::server::reasoning::ReasoningFormat,
    /// HTTP connections open at once; more are answered 503 and closed (default: from the open-file limit, half of
    /// it less a reserve, at most 4096).
    #[arg(long = "max-connections", value_parser = counts(1, MAX_HTTP_CONNECTIONS))]
    max_connections: Option<usize>,
    #[command(flatten)]
    mix: MixArgs,
    /// Prefill prompts on these `baton node`s (HOST:PORT,...; the least-loaded healthy one per request); the server
    /// decodes with the local model.
    #[arg(long = "prefill-node")]
    prefill_node: Option<String>,
    /// With prefill nodes: auto, never, always, or a share of the layers such as 60%.
    #[arg(long, default_value = "auto")]
    offload: String,
    /// With prefill nodes: KV precision on the wire: 16 (exact: the KV cache holds f16), 32, bf16 or 8.
    #[arg(long = "kv-bits", default_value = "16")]
    kv_bits: String,
    /// With prefill nodes: seconds of silence before a prefill node is given up (the prompt is then prefilled by
    /// the decode side).
    #[arg(long = "prefill-timeout", default_value = "10", value_parser = baton::util::parse_timeout)]
    prefill_timeout: std::time::Duration,
}

#[derive(Args)]
struct PerplexityArgs {
    #[arg(short = 'm', long, default_value = "smollm2")]
    model: String,
    /// The text to score.
    #[arg(short = 'f', long = "file")]
    file: PathBuf,
    /// Tokens per chunk.
    #[arg(long = "ctx", short = 'c', default_value_t = 512, value_parser = counts(1, MAX_CTX))]
    ctx: usize,
    /// Tokens per forward pass.
    #[arg(short = 'b', long = "batch-size", default_value_t = 128, value_parser = counts(1, MAX_BATCH))]
    batch_size: usize,
    /// Threads (default: all cores; at most 1024).
    #[arg(short = 't', long, value_parser = counts(1, MAX_THREADS))]
    threads: Option<usize>,
    /// Score at most this many chunks.
    #[arg(long)]
    chunks: Option<usize>,
    /// Bits per byte of each member and of their mixture: `smollm2@local,gemma3@HOST:PORT` (documents are split
    /// at blank lines; --ctx is each member's context).
    #[arg(long)]
    ensemble: Option<String>,
    /// Mixture weights for --ensemble: mix:W1,W2,... (default equal; union and confident mean equal).
    #[arg(long, default_value = "union")]
    combine: String,
}

#[derive(Args)]
struct BenchArgs {
    #[arg(short = 'm', long, default_value = "smollm2")]
    model: String,
    /// Prompt lengths to test (comma-separated; 0 to skip).
    #[arg(short = 'p', long = "n-prompt", default_value = "512", value_delimiter = ',', value_parser = counts(0, MAX_CTX))]
    n_prompt: Vec<usize>,
    /// Generation lengths to test (comma-separated; 0 to skip).
    #[arg(short = 'n', long = "n-gen", default_value = "128", value_delimiter = ',', value_parser = counts(0, MAX_CTX))]
    n_gen: Vec<usize>,
    /// Threads (default: all cores; at most 1024).
    #[arg(short = 't', long, value_parser = counts(1, MAX_THREADS))]
    threads: Option<usize>,
    /// Repetitions of each test.
    #[arg(short = 'r', long = "repetitions", default_value_t = 5, value_parser = counts(1, 10_000))]
    reps: usize,
    /// Context depths to test at (comma-separated).
    #[arg(short = 'd', long = "ctx-depth", default_value = "0", value_delimiter = ',', value_parser = counts(0, MAX_CTX))]
    depths: Vec<usize>,
    /// Tokens per forward pass in prompt processing (llama.cpp gets the same as its batch and micro-batch).
    #[arg(short = 'b', long = "batch-size", default_value_t = 256, value_parser = counts(1, MAX_BATCH))]
    batch_size: usize,
    /// One JSON object per line and test.
    #[arg(long)]
    json: bool,
    /// Also measure llama.cpp on the same model and threads, one repetition after each of Baton's, and print the
    /// ratios. Uses the `tools/llama-ref` binary (build it with `cargo build --release` in tools/llama-ref; path
    /// overridable with BATON_LLAMA_REF).
    #[arg(long = "compare-llama-cpp")]
    compare_llama_cpp: bool,
    /// Measure through a pipeline of nodes instead (`HOST:PORT=A:B,...,local=C:end`, as `baton run --pipeline`).
    #[arg(long)]
    pipeline: Option<String>,
    /// Hidden-state precision on the wire for --pipeline and --experts-split: 32, 16 (or bf16) or 8.
    #[arg(long = "wire-bits", default_value = "32")]
    wire_bits: String,
    /// Shared secret for nodes that listen beyond loopback.
    #[arg(long = "secret-file")]
    secret_file: Option<PathBuf>,
    /// Run about half of each mixture-of-experts layer's experts on this `baton node` (HOST:PORT, same model file):
    /// this process routes, runs attention and the other half, and adds the node's outputs. With --wire-bits 32 the
    /// output is the single-process output; a node that fails leaves its experts to this process.
    #[arg(long = "experts-split", value_name = "HOST:PORT")]
    experts_split: Option<String>,
}

fn main() {
    let cli = Cli::parse();
    baton::logging::init(cli.log_format);
    if let Some(n) = &cli.numerics {
        // SAFETY: set before this process starts any thread; sessions and child processes read it.
        unsafe { std::env::set_var("BATON_NUMERICS", n) };
    }
    if let Some(b) = &cli.backend {
        // SAFETY: as above; `engine::placement` reads it.
        unsafe { std::env::set_var("BATON_BACKEND", b) };
    }
    if let Some(n) = cli.gpu_layers {
        // SAFETY: as above.
        unsafe { std::env::set_var("BATON_GPU_LAYERS", n.to_string()) };
    }
    if cli.experts_on_disk {
        // SAFETY: as above; `model::moe::experts_on_disk` reads it.
        unsafe { std::env::set_var("BATON_EXPERTS_ON_DISK", "1") };
    }
    let result = match cli.cmd {
        Cmd::Run(a) => cmd_run(*a),
        Cmd::Info { model, tensors } => cmd_info(&model, tensors),
        Cmd::Tokenize { model, file, pieces } => cmd_tokenize(&model, &file, pieces),
        Cmd::Perplexity(a) => cmd_perplexity(a),
        Cmd::Ensemble { cmd } => cmd_ensemble(cmd),
        Cmd::Bench(a) => cmd_bench(a),
        Cmd::Quantize { input, output, ty } => cmd_quantize(&input, &output, &ty),
        Cmd::Node(a) => cmd_node(a),
        Cmd::Demo(a) => fetch::resolve(&a.model).and_then(|model| {
            baton::cluster::demo::run(&baton::cluster::demo::DemoOpts {
                model,
                prefill_threads: a.prefill_threads,
                decode_threads: a.decode_threads,
                prompt_tokens: a.prompt_tokens,
                n_predict: a.n_predict,
                kv_bits: a.kv_bits,
            })
        }),
        Cmd::Serve(a) => cmd_serve(*a),
        Cmd::Models { cmd } => cmd_models(cmd),
        Cmd::Cluster {
            cmd: ClusterCmd::Status { addr, api_key, json },
        } => cmd_cluster_status(&addr, api_key.as_deref(), json),
    };
    if let Err(e) = result {
        // One line: the chain of causes, outermost first.
        tracing::error!("{e:#}");
        std::process::exit(1);
    }
}

/// Most threads `-t` may ask for: beyond it a typo would spawn threads until the system refuses (and panic).
/// clap's parser of a count flag: a whole number in `lo..=hi` (bounds from `baton::util::limits`), refused naming
/// the flag.
fn counts(lo: u64, hi: u64) -> clap::builder::RangedU64ValueParser<usize> {
    clap::builder::RangedU64ValueParser::<usize>::new().range(lo..=hi)
}

fn default_threads() -> usize {
    std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
}

/// The thread pool of `-t` (default: every core).
fn thread_pool(threads: Option<usize>) -> Arc<ThreadPool> {
    Arc::new(ThreadPool::new(threads.unwrap_or_else(default_threads)))
}

fn cmd_run(a: RunArgs) -> Result<()> {
    let sampler = sampler_params(&a)?;
    let prompt = match (&a.prompt, &a.file) {
        (Some(p), None) => p.clone(),
        (None, Some(f)) => {
            std::fs::read_to_string(f).with_context(|| format!("cannot read prompt file {}", f.display()))?
        }
        (Some(_), Some(_)) => bail!("give the prompt either as an argument or with -f, not both"),
        (None, None) => bail!("no prompt: pass it as an argument or with -f FILE"),
    };
    let prompt = if a.chat {
        let mut msgs = Vec::new();
        if let Some(s) = &a.system {
            msgs.push(ChatMessage::system(s.clone()));
        }
        msgs.push(ChatMessage::user(prompt));
        match &a.chat_template_kwargs {
            Some(kwargs) => Prompt::ChatWith(
                msgs,
                Arc::new(ChatExtras {
                    tools: None,
                    kwargs: kwargs.clone(),
                }),
            ),
            None => Prompt::Chat(msgs),
        }
    } else if a.chat_template_kwargs.is_some() {
        bail!("--chat-template-kwargs sets chat template variables: it needs --chat");
    } else {
        Prompt::Text(prompt)
    };
    experts_split(
        a.experts_split.as_deref(),
        &a.common.model,
        a.secret_file.as_deref(),
        &a.wire_bits,
        None,
    )?;
    let mut generator = Builder::new(topology_args(&a, sampler)).generator()?;
    if let Some(cache) = a.kv_cache.open()? {
        generator.set_disk_cache(cache)?;
    }
    if let Some(f) = &a.load_session {
        let n = generator.load_session(f)?;
        tracing::info!("session: restored {n} positions from {}", f.display());
    }
    let params = GenParams {
        max_tokens: if a.n_predict < 0 {
            usize::MAX
        } else {
            a.n_predict as usize
        },
        sampler,
        top_logprobs: 0,
        constraint: None,
        request_id: baton::util::new_request_id(),
    };
    // Every line this run logs, here and on the nodes it uses, names its id.
    let _span = baton::logging::request_span(&params.request_id).entered();
    let mut out = std::io::stdout().lock();
    if a.echo {
        out.write_all(generator.render(&prompt)?.as_bytes())?;
        out.flush()?;
    }
    let mut io_err = None;
    let outcome = generator.generate(&prompt, &params, &mut |piece| {
        if let Err(e) = out.write_all(piece.text.as_bytes()).and_then(|_| out.flush()) {
            io_err = Some(e);
            return false;
        }
        true
    })?;
    if let Some(e) = io_err {
        return Err(e).context("cannot write to standard output");
    }
    writeln!(out)?;
    out.flush()?;
    if let Some(f) = &a.save_session {
        let n = generator.save_session(f)?;
        tracing::info!("session: saved {n} positions to {}", f.display());
    }
    if a.verbose {
        for line in &outcome.detail {
            tracing::info!("{line}");
        }
    }
    let o = &outcome;
    tracing::info!(
        "prompt: {} tokens ({} cached) in {:.2} s ({:.1} tok/s) | generated: {} tokens in {:.2} s ({:.1} tok/s) | \
         stop: {} | {}",
        o.prompt_tokens,
        o.cached_tokens,
        o.t_prompt.as_secs_f64(),
        (o.prompt_tokens - o.cached_tokens) as f64 / o.t_prompt.as_secs_f64().max(1e-9),
        o.completion_tokens,
        o.t_gen.as_secs_f64(),
        o.completion_tokens as f64 / o.t_gen.as_secs_f64().max(1e-9),
        o.finish.describe(),
        generator.describe()
    );
    if a.experts_split.is_some() {
        tracing::info!("{}", baton::cluster::experts::STATS.summary());
    }
    Ok(())
}

/// `--experts-split`: checks that the model has experts, then makes this process's sessions of it send about half of
/// each MoE layer's experts to the node (which must hold the same file: the handshake compares fingerprints).
fn experts_split(
    addr: Option<&str>,
    model: &str,
    secret_file: Option<&std::path::Path>,
    wire_bits: &str,
    io: Option<std::time::Duration>,
) -> Result<()> {
    use baton::cluster::experts::{SplitConfig, install};
    use baton::cluster::handshake::Timeouts;
    let Some(addr) = addr else {
        return Ok(());
    };
    let path = fetch::resolve(model)?;
    let hp = baton::model::Hparams::from_gguf(&baton::gguf::GgufFile::open(&path)?)?;
    if hp.moe.is_none() {
        bail!(
            "--experts-split: {} is a {} model without experts; the split is for mixture-of-experts models",
            path.display(),
            hp.arch.name()
        );
    }
    let timeouts = Timeouts {
        io: io.unwrap_or(Timeouts::default().io),
        ..Timeouts::default()
    };
    install(SplitConfig {
        addr: addr.to_string(),
        secret: secret_file.map(baton::cluster::auth::load_secret).transpose()?,
        wire: baton::engine::snapshot::RowDtype::parse(wire_bits)?,
        timeouts,
    })
}

/// `baton run`'s sampling flags, range-checked before anything is loaded.
fn sampler_params(a: &RunArgs) -> Result<SamplerParams> {
    SamplerParams {
        temp: a.temp,
        top_k: a.top_k,
        top_p: a.top_p,
        min_p: a.min_p,
        repeat_penalty: a.repeat_penalty,
        repeat_last_n: a.repeat_last_n,
        seed: a.seed,
    }
    .checked_cli()
}

/// `baton run`'s topology flags, for the library's one builder.
fn topology_args(a: &RunArgs, sampler: SamplerParams) -> TopologyArgs {
    let c = &a.common;
    TopologyArgs {
        model: c.model.clone(),
        threads: c.threads.unwrap_or_else(default_threads),
        n_ctx: c.ctx_size,
        n_batch: c.batch_size,
        pipeline: a.pipeline.clone(),
        wire_bits: a.wire_bits.clone(),
        secret_file: a.secret_file.clone(),
        node_timeout: None,
        prefill_node: a.prefill_node.clone(),
        decode_node: a.decode_node.clone(),
        offload: a.offload.clone(),
        offload_layers: a.offload_layers,
        kv_bits: a.kv_bits.clone(),
        prefill_timeout: a.prefill_timeout,
        draft: a.mix.draft.clone(),
        draft_tokens: a.mix.draft_tokens.clone(),
        ensemble: a.mix.ensemble.clone(),
        combine: a.mix.combine.clone(),
        ensemble_degrade: a.mix.ensemble_degrade,
        sampling: Some(sampler),
        verbose: a.verbose,
        no_mem_check: c.no_mem_check,
    }
}

fn chat_template(file: &GgufFile, vocab: &Vocab) -> Result<ChatTemplate> {
    let piece = |id: Option<u32>| id.map(|i| vocab.token_text(i).to_string()).unwrap_or_default();
    ChatTemplate::from_metadata(
        file.get_str("tokenizer.chat_template"),
        file.architecture()?,
        &piece(vocab.bos()),
        &piece(vocab.eos()),
    )
}

fn cmd_info(model: &str, list_tensors: bool) -> Result<()> {
    let path = fetch::resolve(model)?;
    let g = GgufFile::open(&path)?;
    let size = std::fs::metadata(&path)?.len();
    println!(
        "file:             {} ({:.1} MiB, GGUF v{})",
        path.display(),
        size as f64 / 1048576.0,
        g.version
    );
    println!("fingerprint:      {}", fingerprint::fingerprint(&path)?);
    if let Some(n) = g.get_str("general.name") {
        println!("name:             {n}");
    }
    let hp = Hparams::from_gguf(&g)?;
    println!("{hp}");

    let mut by_type: BTreeMap<&str, (usize, u64, usize)> = BTreeMap::new();
    for name in &g.tensor_order {
        let t = &g.tensors[name];
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.size;
    }
    println!("tensors:          {} in all", g.tensors.len());
    for (ty, (n, elems, bytes)) in &by_type {
        println!(
            "  {ty:<6} {n:>4} tensors {:>12} weights {:>9.2} MiB ({:.2} bits/weight)",
            elems,
            *bytes as f64 / 1048576.0,
            *bytes as f64 * 8.0 / *elems as f64
        );
    }
    if list_tensors {
        for name in &g.tensor_order {
            let t = &g.tensors[name];
            println!("  {name:<40} {:<6} {:?} {} bytes", t.ty.name(), t.dims, t.size);
        }
    }
    let vocab = Vocab::from_gguf(&g)?;
    println!("tokenizer:        {}", vocab.describe());
    println!(
        "special tokens:   bos {:?} eos {:?}, add bos: {}",
        vocab.bos().map(|i| vocab.token_text(i).to_string()),
        vocab.eos().map(|i| vocab.token_text(i).to_string()),
        vocab.add_bos()
    );
    let tmpl = chat_template(&g, &vocab)?;
    match g.get_str("tokenizer.chat_template") {
        Some(t) => println!("chat template (from the GGUF):\n{t}"),
        None => println!("chat template:    none in the file; using the {}", tmpl.source()),
    }
    Ok(())
}

fn cmd_tokenize(model: &str, file: &std::path::Path, pieces: bool) -> Result<()> {
    let path = fetch::resolve(model)?;
    let g = GgufFile::open(&path)?;
    let vocab = Vocab::from_gguf(&g)?;
    let bytes = std::fs::read(file).with_context(|| format!("cannot read {}", file.display()))?;
    let text = String::from_utf8(bytes).with_context(|| format!("{} is not valid UTF-8", file.display()))?;
    let ids = vocab.tokenize(&text, false, false);
    let line: Vec<String> = if pieces {
        ids.iter()
            .map(|&i| format!("{i}:{:?}", String::from_utf8_lossy(vocab.token_bytes(i))))
            .collect()
    } else {
        ids.iter().map(|i| i.to_string()).collect()
    };
    println!("{}", line.join(" "));
    Ok(())
}

fn cmd_perplexity(a: PerplexityArgs) -> Result<()> {
    if let Some(spec) = &a.ensemble {
        let combine = baton::ensemble::Combine::parse(&a.combine)?;
        let file = &a.file;
        return ensemble_cli::perplexity(spec, &combine, file, a.ctx, a.threads.unwrap_or_else(default_threads));
    }
    let pool = thread_pool(a.threads);
    let model = load(&a.model, &pool)?;
    let vocab = Vocab::from_gguf(&model.file)?;
    tracing::info!("tokenizer: {}", vocab.describe());
    let text = std::fs::read_to_string(&a.file).with_context(|| format!("cannot read {}", a.file.display()))?;
    let n_ctx = a.ctx;
    if n_ctx < 8 {
        bail!("--ctx must be at least 8");
    }
    let tokens = vocab.tokenize(&text, true, false);
    let mut n_chunk = tokens.len() / n_ctx;
    if n_chunk == 0 {
        bail!(
            "{} tokens is less than one chunk of {n_ctx}: use a longer text or a smaller --ctx",
            tokens.len()
        );
    }
    if let Some(c) = a.chunks {
        n_chunk = n_chunk.min(c);
    }
    let mut session = Session::new(model.clone(), pool, n_ctx, a.batch_size.min(n_ctx))?;
    let bos = match vocab.add_bos() {
        true => Some(vocab.bos().context("the model adds BOS but has no BOS token")?),
        false => None,
    };
    tracing::info!(
        "perplexity: {} tokens, {n_chunk} chunks of {n_ctx}, scoring the second half of each",
        tokens.len()
    );
    let t0 = Instant::now();
    let bar = baton::util::count_bar(n_chunk as u64, "perplexity", "chunks");
    let s = baton::engine::perplexity::score(
        &mut session,
        &tokens,
        n_chunk,
        bos,
        |_, _| {},
        |c, s| {
            // llama-perplexity's running values, for comparing with it at `RUST_LOG=debug`.
            tracing::debug!("[{}]{:.4}", c + 1, s.ppl());
            bar.set_position(c as u64 + 1);
            bar.set_message(format!("perplexity {:.4}", s.ppl()));
        },
    )?;
    bar.finish_and_clear();
    tracing::info!("{} positions scored in {:.1} s", s.count, t0.elapsed().as_secs_f64());
    println!("perplexity: {:.4} top1: {:.4}", s.ppl(), s.top1_rate());
    Ok(())
}

fn cmd_bench(a: BenchArgs) -> Result<()> {
    let cfg = bench_config(&a);
    // The deepest test is checked before the bandwidth probe and the model load.
    let n_ctx = cfg.n_ctx()?;
    experts_split(
        a.experts_split.as_deref(),
        &a.model,
        a.secret_file.as_deref(),
        &a.wire_bits,
        None,
    )?;
    if a.pipeline.is_some() {
        return bench_pipeline(a, cfg);
    }
    let pool = thread_pool(a.threads);
    // The bandwidth probe's 256 MiB buffer comes and goes before the model is loaded, and the peak is reset after
    // it: the peak RSS reported is then loading's and the tests'.
    let bw = baton::bench::measure_bandwidth(&pool);
    let peak_from_load = baton::bench::reset_peak_rss();
    let model = load(&a.model, &pool)?;
    // Held as every serving process holds its tokenizer, so that the memory figure is theirs.
    let _vocab = Vocab::from_gguf(&model.file)?;
    let name = std::path::Path::new(&model.file.path)
        .file_name()
        .map_or(a.model.clone(), |f| f.to_string_lossy().into());
    let wbytes = model.weight_bytes_per_token();
    tracing::info!(
        "memory read bandwidth: {:.1} GB/s ({} threads); weights read per token: {:.1} MB",
        bw / 1e9,
        pool.n_threads(),
        wbytes as f64 / 1e6
    );
    let llama_bin = std::env::var_os("BATON_LLAMA_REF")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("tools/llama-ref/target/release/llama-ref"));
    if a.compare_llama_cpp && !llama_bin.exists() {
        bail!(
            "--compare-llama-cpp needs the llama.cpp reference tool at {} (build it: cd tools/llama-ref && cargo \
             build --release; or set BATON_LLAMA_REF)",
            llama_bin.display()
        );
    }
    let (threads, n_batch, model_path) = (pool.n_threads(), a.batch_size, model.file.path.clone());
    // The CPU features of the llama.cpp build, as its tool reports them: an AVX-512 llama.cpp against Baton's
    // AVX2 kernels compares unlike with unlike.
    let llama_cpu = std::cell::RefCell::new(None::<String>);
    let mut llama = |test: &str, depth: usize| {
        let f = baton::bench::llama_cpp_once(&llama_bin, &model_path, test, depth, threads, n_batch)?;
        Ok(f.map(|f| {
            if llama_cpu.borrow().is_none() && f.cpu.is_some() {
                tracing::info!("llama.cpp build's CPU features: {}", f.cpu.as_deref().unwrap_or(""));
            }
            *llama_cpu.borrow_mut() = f.cpu.or(llama_cpu.take());
            f.tps
        }))
    };
    let compare: Option<baton::bench::Compare> = if a.compare_llama_cpp { Some(&mut llama) } else { None };
    if !a.json {
        let extra = if a.compare_llama_cpp {
            " llama.cpp median | ratio |"
        } else {
            ""
        };
        println!("| model | backend | isa | threads | test | depth | t/s median | min | max | bw bound |{extra}");
        println!(
            "|---|---|---|---:|---|---:|---:|---:|---:|---:|{}",
            if a.compare_llama_cpp { "---:|---:|" } else { "" }
        );
    }
    let json = a.json;
    let isa = baton::kernels::isa_label();
    let placement = baton::engine::placement::Placement::process()?;
    let backend = placement.describe();
    // The bound is the CPU's memory bandwidth: it says nothing of layers on a GPU.
    let on_cpu = placement.gpu().is_none();
    let mut rss = 0u64;
    let file_bytes = std::fs::metadata(&model.file.path).map_or(0, |m| m.len());
    let kv_bytes = baton::engine::kv_cache::KvCache::bytes_for(&model.hp, model.range.len(), n_ctx) as u64;
    let gpu = placement.gpu().cloned();
    // BATON_GPU_PROFILE: a test's profile leaves out its warm-up (pipelines built, first bind groups).
    let warmed = || drop(gpu.as_ref().and_then(|g| g.take_profile()));
    baton::bench::run(model, pool, &name, &cfg, compare, warmed, |f, other| {
        rss = rss.max(baton::bench::current_rss());
        let bound = if f.test.starts_with("tg") && on_cpu {
            format!("{:.0}%", wbytes as f64 * f.tps_median / bw * 100.0)
        } else {
            "-".into()
        };
        if json {
            let mut v = serde_json::to_value(f).unwrap();
            v["isa"] = serde_json::json!(isa);
            v["backend"] = serde_json::json!(backend);
            v["bw_fraction"] = serde_json::json!(if f.test.starts_with("tg") && on_cpu {
                wbytes as f64 * f.tps_median / bw
            } else {
                0.0
            });
            if let Some(o) = other {
                v["llama_cpp_tps_median"] = serde_json::json!(o.tps_median);
                v["llama_cpp_samples"] = serde_json::json!(o.samples);
                v["ratio_vs_llama_cpp"] = serde_json::json!(f.tps_median / o.tps_median);
                v["llama_cpp_cpu"] = serde_json::json!(*llama_cpu.borrow());
            }
            println!("{v}");
        } else {
            let cmp = match other {
                Some(o) => format!(" {:.1} | {:.2}x |", o.tps_median, f.tps_median / o.tps_median),
                None if a.compare_llama_cpp => " - | - |".into(),
                None => String::new(),
            };
            println!(
                "| {} | {backend} | {isa} | {} | {} | {} | {:.1} | {:.1} | {:.1} | {bound} |{cmp}",
                f.model, f.threads, f.test, f.depth, f.tps_median, f.tps_min, f.tps_max
            );
        }
        // BATON_GPU_PROFILE: the test's kernel times over its repetitions.
        if let Some(p) = gpu.as_ref().and_then(|g| g.take_profile()) {
            eprintln!(
                "GPU profile of {} ({} runs, not the warm-up):\n{p}",
                f.test,
                f.samples.len()
            );
        }
    })?;
    let mib = |b: u64| b as f64 / 1048576.0;
    let budget = file_bytes + kv_bytes;
    let (what, rss) = if peak_from_load {
        ("peak RSS of loading and the tests", baton::bench::peak_rss())
    } else {
        ("RSS after the tests (this system cannot reset the peak)", rss)
    };
    tracing::info!(
        "{what}: {:.1} MiB = {:.2}x of model file {:.1} MiB + KV cache {:.1} MiB ({})",
        mib(rss),
        rss as f64 / budget as f64,
        mib(file_bytes),
        mib(kv_bytes),
        if rss as f64 <= budget as f64 * 1.1 {
            "within 10%"
        } else {
            "more than 10% over"
        },
    );
    Ok(())
}

/// `baton bench --pipeline`: pp and tg through the stages (prefill chunked and overlapped, the last stage samples).
/// `baton bench`'s tests, from its flags.
fn bench_config(a: &BenchArgs) -> baton::bench::BenchConfig {
    baton::bench::BenchConfig {
        pp: a.n_prompt.iter().copied().filter(|&n| n > 0).collect(),
        tg: a.n_gen.iter().copied().filter(|&n| n > 0).collect(),
        depths: a.depths.clone(),
        reps: a.reps,
        n_batch: a.batch_size,
    }
}

fn bench_pipeline(a: BenchArgs, cfg: baton::bench::BenchConfig) -> Result<()> {
    use baton::cluster::PipelineSession;
    use baton::engine::snapshot::RowDtype;
    let spec = a.pipeline.as_deref().expect("checked by the caller");
    let path = fetch::resolve(&a.model)?;
    let threads = a.threads.unwrap_or_else(default_threads);
    let opts = Builder::new(TopologyArgs {
        model: a.model.clone(),
        threads,
        n_ctx: cfg.n_ctx()?,
        n_batch: a.batch_size,
        wire_bits: a.wire_bits.clone(),
        secret_file: a.secret_file.clone(),
        ..Default::default()
    })
    .pipeline_opts()?;
    let mut p = PipelineSession::connect(spec, &path, opts)?;
    let name = format!(
        "{} via {spec} ({} wire)",
        path.file_name().map_or(a.model.clone(), |f| f.to_string_lossy().into()),
        RowDtype::parse(&a.wire_bits)?.name()
    );
    if !a.json {
        println!("| model | local threads | test | depth | t/s median | min | max |");
        println!("|---|---:|---|---:|---:|---:|---:|");
    }
    baton::bench::run_on(
        &mut p,
        &name,
        threads,
        &cfg,
        None,
        || {},
        |f, _| {
            if a.json {
                println!("{}", serde_json::to_value(f).unwrap());
            } else {
                println!(
                    "| {} | {} | {} | {} | {:.1} | {:.1} | {:.1} |",
                    f.model, f.threads, f.test, f.depth, f.tps_median, f.tps_min, f.tps_max
                );
            }
        },
    )?;
    p.reset_stats();
    let n_tok: usize = 16;
    let t0 = Instant::now();
    p.rewind(0);
    let mut tok = p.eval(&[1, 2, 3, 4])?.token;
    for _ in 0..n_tok {
        tok = p.decode_step(tok)?.token;
    }
    let dt = t0.elapsed().as_secs_f64();
    for st in p.stats() {
        tracing::info!(
            "stage {} layers {:?}: {:.0} bytes/token on the wire ({:.1} ms compute, {:.1} ms wall per request)",
            st.label,
            st.layers,
            (st.bytes_sent + st.bytes_recv) as f64 / (n_tok + 1) as f64,
            st.compute.as_secs_f64() * 1e3 / st.requests.max(1) as f64,
            st.wall.as_secs_f64() * 1e3 / st.requests.max(1) as f64,
        );
    }
    tracing::info!(
        "{n_tok} decode steps in {:.2} s after the table, for the per-stage figures above",
        dt
    );
    Ok(())
}

fn cmd_quantize(input: &str, output: &std::path::Path, ty: &str) -> Result<()> {
    let target = baton::model::quantize::parse_target(ty)?;
    let path = fetch::resolve(input)?;
    let bar = baton::util::count_bar(0, &format!("quantizing to {target}"), "tensors");
    let r = baton::model::quantize::quantize_file(&path, output, target, |i, n| {
        bar.set_length(n as u64);
        bar.set_position(i as u64);
    })?;
    bar.finish_and_clear();
    let fell_back = match r.fell_back {
        0 => String::new(),
        k => format!(
            ", {k} to {} as their rows are not whole {target} blocks",
            baton::model::quantize::fallback(target)
        ),
    };
    tracing::info!(
        "wrote {} ({} tensors converted to {target}{fell_back}, {:.1} MiB)",
        output.display(),
        r.converted,
        r.bytes as f64 / 1048576.0
    );
    Ok(())
}

fn cmd_serve(a: ServeArgs) -> Result<()> {
    let c = a.common;
    experts_split(
        a.experts_split.as_deref(),
        &c.model,
        a.secret_file.as_deref(),
        &a.wire_bits,
        Some(a.node_timeout),
    )?;
    baton::server::serve(baton::server::ServeConfig {
        model: c.model,
        served_name: a.served_name,
        listen: a.listen,
        api_key: a.api_key,
        parallel: a.parallel,
        queue: a.queue,
        batch_decode: !a.no_batch,
        threads: c.threads.unwrap_or_else(default_threads),
        ctx_size: c.ctx_size,
        batch_size: c.batch_size,
        pipeline: a.pipeline,
        cluster: a.cluster,
        wire_bits: a.wire_bits,
        secret_file: a.secret_file,
        node_timeout: a.node_timeout,
        ensemble: a.mix.ensemble,
        combine: a.mix.combine,
        ensemble_degrade: a.mix.ensemble_degrade,
        draft: a.mix.draft,
        draft_tokens: a.mix.draft_tokens,
        prefill_node: a.prefill_node,
        offload: a.offload,
        kv_bits: a.kv_bits,
        prefill_timeout: a.prefill_timeout,
        kv_cache: a.kv_cache.open()?,
        slot_save_path: a.slot_save_path,
        header_timeout: a.header_timeout,
        body_timeout: a.body_timeout,
        max_connections: a.max_connections.unwrap_or(0),
        no_mem_check: c.no_mem_check,
        chat_kwargs: a.chat_template_kwargs.unwrap_or_default(),
        reasoning_format: a.reasoning_format,
        ..Default::default()
    })
}

/// clap's parser of `--chat-template-kwargs`: a JSON object of template variables ([`baton::chat::template_kwargs`]).
fn chat_template_kwargs(s: &str) -> Result<TemplateKwargs, String> {
    let v: serde_json::Value = serde_json::from_str(s).map_err(|e| format!("not valid JSON: {e}"))?;
    baton::chat::template_kwargs(&v)
}

/// clap's parser of `--reasoning-format`.
fn reasoning_format(s: &str) -> Result<baton::server::reasoning::ReasoningFormat, String> {
    baton::server::reasoning::ReasoningFormat::parse(s).ok_or_else(|| "must be none, deepseek or auto".into())
}

fn cmd_node(a: NodeArgs) -> Result<()> {
    let path = fetch::resolve(&a.model)?;
    let mut cfg = baton::cluster::NodeConfig::new(path, &a.listen);
    cfg.layers = a.layers;
    cfg.secret = a
        .secret_file
        .map(|p| baton::cluster::auth::load_secret(&p))
        .transpose()?;
    cfg.threads = a.threads.unwrap_or_else(default_threads);
    cfg.max_ctx = a.ctx_size;
    cfg.max_batch = a.batch_size;
    cfg.max_sessions = a.max_sessions;
    cfg.io_timeout = a.timeout;
    cfg.idle_timeout = a.idle_timeout;
    cfg.max_connections = a.max_connections;
    cfg.max_handshakes = a.max_handshakes;
    cfg.batch = !a.no_batch;
    cfg.kv_budget = a.kv_budget.map(baton::util::gib_bytes);
    cfg.no_mem_check = a.no_mem_check;
    cfg.kv_cache_dir = a.kv_cache.kv_cache_dir;
    cfg.kv_cache_gib = a.kv_cache.kv_cache_size;
    baton::cluster::run_node(cfg)
}

fn cmd_cluster_status(addr: &str, api_key: Option<&str>, json: bool) -> Result<()> {
    use baton::server::status;
    let v = status::fetch(addr, api_key, std::time::Duration::from_secs(10))?;
    if json {
        println!("{}", serde_json::to_string_pretty(&v)?);
    } else {
        print!("{}", status::table(&v));
    }
    Ok(())
}

fn cmd_models(cmd: ModelsCmd) -> Result<()> {
    match cmd {
        ModelsCmd::Fetch { names } => {
            let paths = if names.is_empty() {
                fetch::fetch_all()?
            } else {
                names.iter().map(|n| fetch::fetch(n)).collect::<Result<Vec<_>>>()?
            };
            for p in paths {
                println!("{}", p.display());
            }
        }
        ModelsCmd::List => {
            let dir = fetch::models_dir()?;
            println!("cache: {}", dir.display());
            for m in fetch::known_models() {
                let p = dir.join(m.file_name);
                let state = if p.exists() { "cached" } else { "not fetched" };
                println!("  {:<10} {:<40} {state}", m.name, m.file_name);
            }
        }
    }
    Ok(())
}

fn cmd_ensemble(cmd: EnsembleCmd) -> Result<()> {
    match cmd {
        EnsembleCmd::Fit {
            ensemble,
            file,
            ctx,
            threads,
        } => ensemble_cli::fit(&ensemble, &file, ctx, threads.unwrap_or_else(default_threads)),
        EnsembleCmd::Cloze {
            ensemble,
            file,
            combine,
            threads,
        } => ensemble_cli::cloze(&ensemble, &file, &combine, threads.unwrap_or_else(default_threads)),
    }
}

/// `--ensemble` wiring; the logic is in `baton::ensemble`.
mod ensemble_cli {
    use anyhow::{Context, Result};
    use baton::ensemble::{Combine, Ensemble, EnsembleOpts, MemberOpts, fit, parse_members};
    use std::path::Path;

    fn open_scoring(spec: &str, ctx: usize, threads: usize) -> Result<Ensemble> {
        let opts = EnsembleOpts {
            members: parse_members(spec)?,
            combine: Combine::Union,
            degrade: false,
            member: MemberOpts {
                n_ctx: ctx,
                n_batch: ctx.min(128),
                threads,
                ..Default::default()
            },
            verbose: false,
            retry_dropped: baton::ensemble::RETRY_DROPPED,
        };
        Ensemble::open(&opts)
    }

    fn weights(combine: &Combine, n: usize) -> Result<Vec<f64>> {
        Ok(match combine {
            Combine::Mix(w) if w.len() == n => w.clone(),
            Combine::Mix(w) => anyhow::bail!("--combine mix has {} weights for {n} members", w.len()),
            _ => vec![1.0; n],
        })
    }

    pub fn cloze(spec: &str, file: &Path, combine: &str, threads: usize) -> Result<()> {
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
        let items = fit::parse_cloze(&text)?;
        let mut ens = open_scoring(spec, 256, threads)?;
        let w = weights(&Combine::parse(combine)?, ens.members.len())?;
        let r = fit::cloze(&mut ens.members, &items, &w)?;
        for (m, right) in ens.members.iter().zip(&r.member_right) {
            println!("cloze {}: {right}/{}", m.name(), r.items);
        }
        println!("cloze ensemble: {}/{}", r.ensemble_right, r.items);
        Ok(())
    }

    fn score(spec: &str, file: &Path, ctx: usize, threads: usize) -> Result<(Ensemble, Vec<fit::DocScore>)> {
        let text = std::fs::read_to_string(file).with_context(|| format!("cannot read {}", file.display()))?;
        let mut ens = open_scoring(spec, ctx, threads)?;
        // Two bytes per token is a safe floor for both default models on prose: documents fit the context.
        let docs = fit::split_docs(&text, ctx * 2);
        if docs.is_empty() {
            anyhow::bail!("{} holds no text", file.display());
        }
        let t0 = std::time::Instant::now();
        let bar = baton::util::count_bar(docs.len() as u64, "scoring", "documents");
        let mut scored = Vec::with_capacity(docs.len());
        for d in &docs {
            scored.push(fit::score_doc(&mut ens.members, d)?);
            bar.inc(1);
        }
        bar.finish_and_clear();
        tracing::info!("scored {} documents in {:.1} s", docs.len(), t0.elapsed().as_secs_f64());
        Ok((ens, scored))
    }

    fn print_report(ens: &Ensemble, docs: &[fit::DocScore], w: &[f64]) {
        let r = fit::report(docs, w, 1);
        for (m, bpb) in ens.members.iter().zip(&r.member_bpb) {
            println!("bits-per-byte {}: {bpb:.4}", m.name());
        }
        println!("bits-per-byte ensemble: {:.4}", r.ensemble_bpb);
        tracing::info!(
            "{} bytes in {} documents; weights {}; ensemble - best member ({}): {:+.4} bits/byte, 95% paired bootstrap \
             interval [{:+.4}, {:+.4}]; ensemble better on {}/{} documents",
            r.bytes,
            r.docs,
            w.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(","),
            ens.members[r.best].name(),
            r.ensemble_bpb - r.member_bpb[r.best],
            r.ci.0,
            r.ci.1,
            r.wins,
            r.docs
        );
    }

    pub fn perplexity(spec: &str, combine: &Combine, file: &Path, ctx: usize, threads: usize) -> Result<()> {
        let (ens, docs) = score(spec, file, ctx, threads)?;
        let w = match combine {
            Combine::Mix(w) if w.len() == ens.members.len() => w.clone(),
            Combine::Mix(w) => anyhow::bail!(
                "--combine mix has {} weights for {} members",
                w.len(),
                ens.members.len()
            ),
            _ => vec![1.0; ens.members.len()],
        };
        print_report(&ens, &docs, &w);
        Ok(())
    }

    pub fn fit(spec: &str, file: &Path, ctx: usize, threads: usize) -> Result<()> {
        let (ens, docs) = score(spec, file, ctx, threads)?;
        let w = fit::fit_weights(&docs, ens.members.len());
        print_report(&ens, &docs, &w);
        println!(
            "mix:{}",
            w.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(",")
        );
        Ok(())
    }
}
