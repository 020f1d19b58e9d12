//! One interface for every way Baton produces text: a local session, a pipeline over nodes, a disaggregated
//! prefill/decode pair, a speculative pair, an ensemble. `baton run` and `baton serve` drive any of them through
//! [`Generator`], so a feature built for one topology works from both front ends.
//!
//! This module sits below `cluster`: it holds the trait, its data types and the decode loop the generators share,
//! and the [`LocalGenerator`], which needs only the engine. Generators over nodes are in [`crate::topology`].

mod local;

pub use local::LocalGenerator;

use crate::chat::{ChatExtras, ChatMessage, ChatTemplate, ThinkTags};
use crate::constrain::{Constraint, Guide, TokenTrie};
use crate::engine::disk_cache::DiskCache;
use crate::engine::sampler::{Sampler, SamplerParams, top_logprobs};
use crate::gguf::GgufFile;
use crate::vocab::{StreamDecoder, Vocab};
use anyhow::{Result, bail};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

/// Why `--kv-cache-dir` is refused on anything but a whole local model: the KV of a split or remote model lives on
/// its nodes, which keep their own cache; a draft or an ensemble would need one per model.
pub const KV_CACHE_ON_NODES: &str = "--kv-cache-dir here needs the whole model in this process; with --pipeline, \
     --cluster, --prefill-node or --decode-node, give it to the nodes (`baton node --kv-cache-dir DIR`): prefill \
     nodes and pipeline stages read and write their own; a `local` stage, a decode side, --draft and --ensemble do \
     not read one";

/// What to continue: raw text (used as given, BOS only where the model asks) or a conversation rendered with each
/// model's own chat template.
#[derive(Clone, Debug)]
pub enum Prompt {
    Text(String),
    Chat(Vec<ChatMessage>),
    /// A conversation with what else the template is given: tool definitions (OpenAI's `tools` array) and the
    /// caller's template variables (`chat_template_kwargs`).
    ChatWith(Vec<ChatMessage>, Arc<ChatExtras>),
}

impl Prompt {
    /// The conversation's messages, and its extras (a text prompt has neither).
    pub fn chat(&self) -> Option<(&[ChatMessage], Option<&ChatExtras>)> {
        match self {
            Prompt::Text(_) => None,
            Prompt::Chat(m) => Some((m, None)),
            Prompt::ChatWith(m, e) => Some((m, Some(e))),
        }
    }
}

/// Per-request generation settings.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// Most tokens to generate (`usize::MAX`: until end of generation or a full context).
    pub max_tokens: usize,
    pub sampler: SamplerParams,
    /// Alternatives reported with each piece (0: none).
    pub top_logprobs: usize,
    /// Output restricted to a grammar (`response_format`, forced tool calls); only generators that sample on this
    /// machine with the one vocabulary apply it ([`Generator::constrains`]).
    pub constraint: Option<Constraint>,
    /// The request's id (empty: none): generators over nodes pass it on, so every process logs it.
    pub request_id: String,
}

impl Default for GenParams {
    fn default() -> Self {
        GenParams {
            max_tokens: 256,
            sampler: SamplerParams::default(),
            top_logprobs: 0,
            constraint: None,
            request_id: String::new(),
        }
    }
}

/// One step of output: the text it completes (possibly empty while a UTF-8 character is split across tokens),
/// the token behind it when the generator has a single vocabulary, and its log-probabilities when asked.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Piece {
    pub text: String,
    pub token: Option<u32>,
    pub logprob: Option<f32>,
    /// The most likely alternatives at this step, as text with their log-probabilities.
    pub top: Vec<(String, f32)>,
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Finish {
    /// The model produced an end-of-generation token.
    Eog,
    /// `max_tokens` reached.
    Length,
    /// The context is full.
    ContextFull,
    /// The caller's sink asked to stop (stop string, client gone).
    Stopped,
}

impl Finish {
    /// The words `baton run` prints; OpenAI's `finish_reason` maps Eog/Stopped to "stop", the rest to "length".
    pub fn describe(self) -> &'static str {
        match self {
            Finish::Eog => "end of generation",
            Finish::Length => "length",
            Finish::ContextFull => "context full",
            Finish::Stopped => "stopped",
        }
    }
}

/// What a finished request did.
#[derive(Clone, Debug)]
pub struct Outcome {
    pub prompt_tokens: usize,
    /// Prompt tokens whose KV was already held (not recomputed).
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub finish: Finish,
    /// Time to the first sampled token (prompt processing).
    pub t_prompt: Duration,
    /// Time from the first token to the end.
    pub t_gen: Duration,
    /// Lines for `-v`: per-stage timings, bytes moved, acceptance rates...
    pub detail: Vec<String>,
}

/// A way of producing text. Implementations keep their KV between calls where they can, so a request that
/// extends the previous one (a chat's next turn) only computes what is new.
pub trait Generator: Send {
    /// What runs where, e.g. "SmolLM2-135M-Instruct.Q4_1.gguf, local".
    fn describe(&self) -> String;
    /// Context size in tokens.
    fn n_ctx(&self) -> usize;
    /// The model whose tokenizer and template read the prompt (a multi-model generator: its first model's).
    fn text(&self) -> &TextModel;
    /// Tokens the prompt takes (for validation and usage counts).
    fn count_prompt(&self, prompt: &Prompt) -> Result<usize> {
        Ok(self.text().tokenize(prompt)?.len())
    }
    /// The text the model reads for `prompt` (`--echo`).
    fn render(&self, prompt: &Prompt) -> Result<String> {
        self.text().render(prompt)
    }
    /// Whether [`GenParams::constraint`] is applied. Generators that sample elsewhere (a pipeline's last stage),
    /// over several vocabularies (ensembles) or from drafts (speculative) say no, and the server refuses the request.
    fn constrains(&self) -> bool {
        false
    }
    /// Generates until end of generation, `max_tokens`, a full context, or until `sink` returns false.
    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome>;
    /// Reads and writes prompt prefixes in a cache on disk (`--kv-cache-dir`); only a generator whose KV is on this
    /// machine can.
    fn set_disk_cache(&mut self, _cache: Arc<DiskCache>) -> Result<()> {
        bail!("{KV_CACHE_ON_NODES} (this run: {})", self.describe())
    }
    /// Saves the conversation held (KV and token ids) to `path` in the snapshot format; returns the positions saved.
    fn save_session(&self, _path: &Path) -> Result<usize> {
        bail!(
            "saving a session needs the whole model on this machine ({})",
            self.describe()
        )
    }
    /// Restores a conversation saved by [`Generator::save_session`] with the same weights; returns its positions.
    fn load_session(&mut self, _path: &Path) -> Result<usize> {
        bail!(
            "loading a session needs the whole model on this machine ({})",
            self.describe()
        )
    }
}

/// A model's text side: tokenizer and chat template, and the one way a [`Prompt`] becomes tokens.
pub struct TextModel {
    pub vocab: Vocab,
    pub template: ChatTemplate,
    /// The tags around a thinking model's reasoning: a known pair of the vocabulary's tokens, else `<think>`.
    pub think: ThinkTags,
    pub path: PathBuf,
    /// The vocabulary as a byte trie for constrained sampling, built on first use.
    trie: std::sync::OnceLock<TokenTrie>,
}

impl TextModel {
    pub fn from_gguf(file: &GgufFile) -> Result<TextModel> {
        let vocab = Vocab::from_gguf(file)?;
        let piece = |id: Option<u32>| id.map(|i| vocab.token_text(i).to_string()).unwrap_or_default();
        let template = ChatTemplate::from_metadata(
            file.get_str("tokenizer.chat_template"),
            file.architecture()?,
            &piece(vocab.bos()),
            &piece(vocab.eos()),
        )?;
        let think = ThinkTags::from_vocab(|t| vocab.token_id(t).is_some());
        Ok(TextModel {
            vocab,
            template,
            think,
            path: file.path.clone(),
            trie: std::sync::OnceLock::new(),
        })
    }

    /// Reads only the tokenizer and template of a GGUF file (a remote member's weights are never loaded here).
    pub fn open(path: &Path) -> Result<TextModel> {
        TextModel::from_gguf(&GgufFile::open(path)?)
    }

    /// The text the model reads: the prompt as given, or the conversation rendered with the chat template (a
    /// leading BOS text dropped when the tokenizer adds BOS itself).
    pub fn render(&self, prompt: &Prompt) -> Result<String> {
        match prompt.chat() {
            None => Ok(self.text_of(prompt)),
            Some((msgs, extras)) => self
                .template
                .render_for_tokenizer(msgs, extras, true, self.vocab.add_bos()),
        }
    }

    /// Whether the rendered prompt leaves a think block open, so the reply starts inside it (a chat prompt whose
    /// template ends the generation prompt with the open tag; never a text prompt, whose reply is not split).
    pub fn prompt_opens_think(&self, prompt: &Prompt) -> Result<bool> {
        Ok(prompt.chat().is_some() && self.think.prompt_opens(&self.render(prompt)?))
    }

    /// Tokens of the prompt: BOS only where the model's metadata asks; special tokens parsed in a text prompt and in
    /// a chat template's own markers, never inside a chat message's content (llama.cpp's `parse_special` split:
    /// users cannot forge role markers).
    pub fn tokenize(&self, prompt: &Prompt) -> Result<Vec<u32>> {
        let tokens = match prompt.chat() {
            None => self.vocab.tokenize(&self.text_of(prompt), true, true),
            Some((msgs, extras)) => {
                let adds_bos = self.vocab.add_bos();
                let (text, spans) = self.template.render_marked(msgs, extras, true, adds_bos)?;
                match spans {
                    Some(spans) => self.vocab.tokenize_chat(&text, true, &spans),
                    None => {
                        // The template rewrites contents, so they cannot be located: refuse control-token text in
                        // them rather than let it become control tokens.
                        let special =
                            |t: &str| self.vocab.tokenize(t, false, true) != self.vocab.tokenize(t, false, false);
                        if let Some(m) = msgs
                            .iter()
                            .find(|m| special(&m.content) || m.reasoning_content.as_deref().is_some_and(special))
                        {
                            bail!(
                                "a {} message holds special-token text, and this model's chat template rewrites \
                                 message contents, so it cannot be kept as plain text; remove it",
                                m.role
                            );
                        }
                        self.vocab.tokenize(&text, true, true)
                    }
                }
            }
        };
        if tokens.is_empty() {
            bail!("the prompt is empty");
        }
        Ok(tokens)
    }

    fn text_of(&self, prompt: &Prompt) -> String {
        match prompt {
            Prompt::Text(t) => t.clone(),
            _ => String::new(),
        }
    }

    /// The prompt's tokens, refused when they leave no room to generate in `n_ctx`: where every generator starts.
    pub fn prompt_tokens(&self, prompt: &Prompt, n_ctx: usize) -> Result<Vec<u32>> {
        let tokens = self.tokenize(prompt)?;
        check_fits(tokens.len(), n_ctx)?;
        Ok(tokens)
    }

    /// The file name, for descriptions.
    pub fn name(&self) -> String {
        self.path
            .file_name()
            .map_or_else(|| self.path.display().to_string(), |f| f.to_string_lossy().into_owned())
    }

    /// The vocabulary's text tokens as a byte trie (control tokens and end-of-generation ids left out; the mask adds
    /// those when a value is complete), built once per model.
    pub fn token_trie(&self) -> &TokenTrie {
        self.trie.get_or_init(|| {
            let v = &self.vocab;
            let ids = (0..v.n_tokens() as u32).filter(|&i| !v.is_control(i) && !v.is_eog(i));
            TokenTrie::new(ids.map(|i| (i, v.token_bytes(i))), v.eog_ids())
        })
    }

    /// A request's constrained-decoding state, when it has a constraint.
    pub fn guide<'a>(&'a self, params: &'a GenParams) -> Option<Guide<'a>> {
        params
            .constraint
            .as_ref()
            .map(|c| Guide::new(&c.grammar, self.token_trie()))
    }

    /// [`pick`](Self::pick) under a constraint: the logits masked to the tokens the grammar allows, and the
    /// grammar moved past the token chosen. Log-probabilities are reported from the masked distribution.
    pub fn pick_guided(&self, sampler: &mut Sampler, guide: Option<&mut Guide>, logits: &[f32], k: usize) -> Next {
        match guide {
            None => self.pick(sampler, logits, k),
            Some(g) => {
                let next = self.pick(sampler, g.mask(logits), k);
                if !self.vocab.is_eog(next.0) {
                    g.accept(self.vocab.token_bytes(next.0));
                }
                next
            }
        }
    }

    /// Samples the next token from `logits` and, when `k > 0`, reports its log-probability and the `k` most likely
    /// alternatives as text: the decode step every single-vocabulary generator shares.
    pub fn pick(&self, sampler: &mut Sampler, logits: &[f32], k: usize) -> Next {
        let id = sampler.sample(logits);
        if k == 0 {
            return (id, None, Vec::new());
        }
        let own = (logits[id as usize] as f64 - crate::kernels::ops::log_sum_exp(logits)) as f32;
        (id, Some(own), self.top_text(&top_logprobs(logits, k)))
    }

    /// The top alternatives as text.
    pub fn top_text(&self, top: &[(u32, f32)]) -> Vec<(String, f32)> {
        top.iter()
            .map(|&(id, lp)| (String::from_utf8_lossy(self.vocab.token_bytes(id)).into_owned(), lp))
            .collect()
    }
}

/// Refuses a prompt that leaves no room to generate.
pub fn check_fits(n_prompt: usize, n_ctx: usize) -> Result<()> {
    if n_prompt >= n_ctx {
        bail!("the prompt is {n_prompt} tokens, the context is {n_ctx}: shorten it or raise the context size");
    }
    Ok(())
}

/// The decode loop every single-vocabulary generator shares: from the first sampled token, stream pieces and ask
/// `step` for the next token until end of generation, `max_tokens`, a full context (`step` returns `None`) or the
/// sink stops it. Returns how many tokens were generated and why it ended.
pub fn decode_loop(
    vocab: &Vocab,
    first: Next,
    max_tokens: usize,
    sink: &mut dyn FnMut(&Piece) -> bool,
    mut step: impl FnMut(u32) -> Result<Option<Next>>,
) -> Result<(usize, Finish)> {
    let mut decoder = StreamDecoder::new();
    let mut next = first;
    let mut n_gen = 0;
    let finish = loop {
        if n_gen >= max_tokens {
            break Finish::Length;
        }
        if vocab.is_eog(next.0) {
            break Finish::Eog;
        }
        n_gen += 1;
        let piece = Piece {
            text: decoder.push(vocab, next.0),
            token: Some(next.0),
            logprob: next.1,
            top: std::mem::take(&mut next.2),
        };
        if !sink(&piece) {
            break Finish::Stopped;
        }
        if n_gen == max_tokens {
            break Finish::Length;
        }
        match step(next.0)? {
            Some(t) => next = t,
            None => break Finish::ContextFull,
        }
    };
    let tail = decoder.flush();
    if !tail.is_empty() {
        sink(&Piece {
            text: tail,
            ..Default::default()
        });
    }
    Ok((n_gen, finish))
}

/// A sampled token, its log-probability and the top alternatives as text (when asked for).
pub type Next = (u32, Option<f32>, Vec<(String, f32)>);
