//! Tokenizers built from GGUF metadata, matching llama.cpp's `llama_tokenize` token for token.
//!
//! Two tokenizer families are supported: byte-level BPE (`tokenizer.ggml.model = gpt2`, with the GPT-2,
//! SmolLM/StarCoder, Llama-3 and Qwen2 pre-tokenizer splits) and llama.cpp's SentencePiece-style merge
//! tokenizer (`tokenizer.ggml.model = llama`). Everything that decides ids follows llama.cpp's `llama-vocab.cpp`:
//! the token attributes and their text-based fix-ups, the special-token partition that runs before the
//! tokenizer proper, BOS/EOS insertion and the end-of-generation set.
//!
//! The `tokenizers` crate is not used: it needs tokenizer.json rather than GGUF metadata, and llama.cpp's
//! algorithms differ from the reference ones in places that change ids (see `spm.rs`, `bpe.rs`,
//! `pretokenize.rs`).
//!
//! Verified id for id against llama.cpp (llama-cpp-sys-2 0.1.161) on SmolLM2 (gpt2/smollm) and Gemma 3
//! (llama SPM); see tests/tokenizer.rs. The gpt-2, llama3 and qwen2 splits were checked the same way on
//! copies of SmolLM2 with `tokenizer.ggml.pre` rewritten, and the SPM space prefix on a copy of Gemma 3
//! with `add_space_prefix` set (130 texts, both modes, all equal).
//!
//! Known, deliberate differences, none of which affects those models:
//! - the name-based LSTRIP/RSTRIP attributes llama.cpp sets (phi-3, jina, modern-bert) are applied in one pass,
//!   so a whitespace-only special token inside the stripped whitespace would still be matched (none is known);
//! - where llama.cpp's order is unspecified (equal-length special tokens in its std::sort; which of several
//!   candidate texts its unordered_map yields first as EOT/FIM token) the lower id is taken;
//! - a byte with no byte token gives `<unk>` instead of llama.cpp's exception;
//! - codepoint categories are Unicode 16 (llama.cpp's table is 15.x);

mod bpe;
mod pretokenize;
mod spm;
mod unicode;

use crate::gguf::{GgufFile, Value};
use anyhow::{Context, Result, bail};
use pretokenize::PreSplit;
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::hash::{BuildHasher, Hasher};

/// Which tokenizer algorithm a vocabulary uses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum VocabKind {
    /// `tokenizer.ggml.model = gpt2`: byte-level BPE with merge ranks.
    Bpe,
    /// `tokenizer.ggml.model = llama`: SentencePiece pieces with scores and byte fallback.
    Spm,
}

// llama.cpp's `llama_token_attr` bits.
const ATTR_UNKNOWN: u16 = 1 << 0;
const ATTR_UNUSED: u16 = 1 << 1;
const ATTR_NORMAL: u16 = 1 << 2;
const ATTR_CONTROL: u16 = 1 << 3;
const ATTR_USER_DEFINED: u16 = 1 << 4;
const ATTR_BYTE: u16 = 1 << 5;
/// Whitespace before the token is dropped when the token is split out of a text (llama.cpp sets it by model name).
const ATTR_LSTRIP: u16 = 1 << 7;
/// Whitespace after the token is dropped when the token is split out of a text (Phi-3's `<|end|>`, `<|user|>`...).
const ATTR_RSTRIP: u16 = 1 << 8;
/// Baton's own mark, not llama.cpp's: the token's piece is its text, so it is not stored twice.
const PIECE_IS_TEXT: u16 = 1 << 15;

/// `tokenizer.ggml.token_type` values mapped to attributes, as llama.cpp does on load.
fn attr_from_type(t: i64) -> u16 {
    match t {
        1 => ATTR_NORMAL,
        2 => ATTR_UNKNOWN,
        3 => ATTR_CONTROL,
        4 => ATTR_USER_DEFINED,
        5 => ATTR_UNUSED,
        6 => ATTR_BYTE,
        _ => 0, // undefined
    }
}

/// A small, fast hasher for the piece-to-id map (FxHash's mixing). The map is built once from the model
/// file and only read afterwards, so flooding is not a concern; SipHash made loading a 262k-entry vocab
/// noticeably slower.
#[derive(Clone, Copy, Default)]
pub(crate) struct FastHash;

pub(crate) struct FxHasher(u64);

const FX_K: u64 = 0x51_7c_c1_b7_27_22_0a_95;

impl Hasher for FxHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut h = self.0;
        let mut chunks = bytes.chunks_exact(8);
        for c in &mut chunks {
            let w = u64::from_le_bytes(c.try_into().expect("chunk of 8"));
            h = (h.rotate_left(5) ^ w).wrapping_mul(FX_K);
        }
        for &b in chunks.remainder() {
            h = (h.rotate_left(5) ^ b as u64).wrapping_mul(FX_K);
        }
        self.0 = h;
    }
    fn write_u8(&mut self, b: u8) {
        self.0 = (self.0.rotate_left(5) ^ b as u64).wrapping_mul(FX_K);
    }
    fn finish(&self) -> u64 {
        self.0
    }
}

impl BuildHasher for FastHash {
    type Hasher = FxHasher;
    fn build_hasher(&self) -> FxHasher {
        FxHasher(0)
    }
}

/// All token texts in one buffer plus an open-addressing index from text to id. Loading a 262k-entry
/// vocabulary this way needs no per-token allocation (a `HashMap<String, u32>` made Gemma's load several
/// times slower).
struct TokenTable {
    blob: String,
    /// `offs[id]..offs[id + 1]` is the text of `id`.
    offs: Vec<u32>,
    /// id + 1 per slot, 0 for empty; the length is a power of two, at most 3/4 full.
    slots: Vec<u32>,
}

fn hash_str(s: &str) -> u64 {
    let mut h = FastHash.build_hasher();
    h.write(s.as_bytes());
    // Finalize so that the low bits used for the slot depend on all input bits.
    let x = h.finish();
    (x ^ (x >> 29)).wrapping_mul(0xbf58_476d_1ce4_e5b9) ^ (x >> 32)
}

impl TokenTable {
    /// Fails on a repeated text, as llama.cpp does.
    fn new<S: AsRef<str>>(texts: &[S]) -> Result<TokenTable> {
        let total: usize = texts.iter().map(|t| t.as_ref().len()).sum();
        if total > u32::MAX as usize {
            bail!("token texts too large ({total} bytes)");
        }
        let mut blob = String::with_capacity(total);
        let mut offs = Vec::with_capacity(texts.len() + 1);
        offs.push(0u32);
        for t in texts {
            blob.push_str(t.as_ref());
            offs.push(blob.len() as u32);
        }
        let cap = (texts.len() * 4).div_ceil(3).next_power_of_two().max(16);
        let mut table = TokenTable {
            blob,
            offs,
            slots: vec![0u32; cap],
        };
        let mask = cap - 1;
        for id in 0..texts.len() {
            let text = table.text(id as u32);
            let mut i = hash_str(text) as usize & mask;
            loop {
                match table.slots[i] {
                    0 => {
                        table.slots[i] = id as u32 + 1;
                        break;
                    }
                    other if table.text(other - 1) == text => {
                        bail!("duplicate token in vocabulary: {text:?} has ids {} and {id}", other - 1)
                    }
                    _ => i = (i + 1) & mask,
                }
            }
        }
        Ok(table)
    }

    fn len(&self) -> usize {
        self.offs.len() - 1
    }

    fn text(&self, id: u32) -> &str {
        &self.blob[self.offs[id as usize] as usize..self.offs[id as usize + 1] as usize]
    }

    fn get(&self, s: &str) -> Option<u32> {
        let mask = self.slots.len() - 1;
        let mut i = hash_str(s) as usize & mask;
        loop {
            match self.slots[i] {
                0 => return None,
                v if self.text(v - 1) == s => return Some(v - 1),
                _ => i = (i + 1) & mask,
            }
        }
    }
}

/// Byte trie over the special tokens' texts, for finding every occurrence in one pass over the input.
#[derive(Default)]
struct SpecialTrie {
    /// Node 0 is the root. Children are kept sorted by byte.
    nodes: Vec<TrieNode>,
}

#[derive(Default)]
struct TrieNode {
    children: Vec<(u8, u32)>,
    token: Option<u32>,
}

impl SpecialTrie {
    fn new() -> SpecialTrie {
        SpecialTrie {
            nodes: vec![TrieNode::default()],
        }
    }

    fn insert(&mut self, text: &[u8], id: u32) {
        let mut n = 0usize;
        for &b in text {
            n = match self.nodes[n].children.binary_search_by_key(&b, |c| c.0) {
                Ok(i) => self.nodes[n].children[i].1 as usize,
                Err(i) => {
                    let new = self.nodes.len() as u32;
                    self.nodes.push(TrieNode::default());
                    self.nodes[n].children.insert(i, (b, new));
                    new as usize
                }
            };
        }
        self.nodes[n].token = Some(id);
    }

    /// Calls `f(id, len)` for every special token that starts at `text[0]`.
    fn prefixes(&self, text: &[u8], mut f: impl FnMut(u32, usize)) {
        let mut n = 0usize;
        for (i, &b) in text.iter().enumerate() {
            match self.nodes[n].children.binary_search_by_key(&b, |c| c.0) {
                Ok(k) => n = self.nodes[n].children[k].1 as usize,
                Err(_) => return,
            }
            if let Some(id) = self.nodes[n].token {
                f(id, i + 1);
            }
        }
    }
}

/// A piece of the input after the special-token partition.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Fragment {
    Text(usize, usize),
    Token(u32),
}

/// A tokenizer loaded from GGUF metadata.
pub struct Vocab {
    kind: VocabKind,
    model: String,
    pre: String,
    split: Option<PreSplit>,
    ignore_merges: bool,
    table: TokenTable,
    /// Empty when the vocabulary has none.
    scores: Vec<f32>,
    attrs: Vec<u16>,
    merges: Option<bpe::Merges>,
    /// `token_to_piece(id, special = true)` for every token whose piece is not its text ([`PIECE_IS_TEXT`]),
    /// concatenated; `piece_offs[id]..piece_offs[id+1]`.
    pieces: Vec<u8>,
    piece_offs: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    eot: Option<u32>,
    unk: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
    /// SPM byte-fallback tokens, indexed by byte.
    byte_tokens: Vec<Option<u32>>,
    /// Special token -> its position in llama.cpp's special-token cache order (longest text first).
    special_rank: HashMap<u32, u32, FastHash>,
    specials: SpecialTrie,
    eog: Vec<u32>,
}

impl Vocab {
    /// Builds the tokenizer from the `tokenizer.ggml.*` metadata, with llama.cpp's defaults and fix-ups.
    pub fn from_gguf(g: &GgufFile) -> Result<Vocab> {
        let vocab = Self::from_metadata(g);
        // The token texts and merges were read in place from the map; their pages (and the page-cache folios
        // mapped around them) are not needed any more.
        g.release_array("tokenizer.ggml.tokens");
        g.release_array("tokenizer.ggml.merges");
        // Building made short-lived values (the texts' table, the merge pairs). glibc keeps freed pages in the
        // middle of its heap resident; hand them back so they do not count for the life of the process.
        #[cfg(all(target_os = "linux", target_env = "gnu"))]
        // SAFETY: malloc_trim only returns free memory to the kernel.
        unsafe {
            libc::malloc_trim(0);
        }
        vocab
    }

    fn from_metadata(g: &GgufFile) -> Result<Vocab> {
        let model = g
            .get_str("tokenizer.ggml.model")
            .context("GGUF has no tokenizer.ggml.model")?
            .to_string();
        let pre = g.get_str("tokenizer.ggml.pre").unwrap_or("").to_string();
        let mut texts = g
            .str_array("tokenizer.ggml.tokens")?
            .context("GGUF has no tokenizer.ggml.tokens")?;
        for (i, t) in texts.iter_mut().enumerate() {
            // llama.cpp renames empty pieces so that every text is unique and non-empty.
            if t.is_empty() {
                *t = Cow::Owned(format!("[EMPTY_{i}]"));
            }
        }
        let token_types = g.num_array("tokenizer.ggml.token_type", Value::as_i64)?;
        let scores = g.num_array("tokenizer.ggml.scores", Value::as_f32)?;
        let md = Metadata {
            get_u64: &|k| g.get_u64(k),
            get_bool: &|k| g.get_bool(k),
            general_name: g.get_str("general.name").unwrap_or(""),
            general_arch: g.get_str("general.architecture").unwrap_or(""),
        };
        let merges = g.str_array("tokenizer.ggml.merges")?;
        let merges = merges
            .as_ref()
            .map(|m| m.iter().map(|s| s.as_ref()).collect::<Vec<&str>>());
        Vocab::build(&model, &pre, texts, scores, token_types, merges, &md)
    }

    /// The construction shared by [`Vocab::from_gguf`] and the tests' synthetic vocabularies.
    fn build(
        model: &str,
        pre: &str,
        texts: Vec<Cow<str>>,
        scores: Option<Vec<f32>>,
        token_types: Option<Vec<i64>>,
        merges: Option<Vec<&str>>,
        md: &Metadata,
    ) -> Result<Vocab> {
        let n = texts.len();
        if n == 0 {
            bail!("tokenizer has no tokens");
        }
        if n > u32::MAX as usize / 2 {
            bail!("tokenizer has too many tokens ({n})");
        }
        let n32 = n as u32;

        // Type-dependent defaults (llama.cpp `llama_vocab::impl::load`).
        let (kind, mut bos, mut eos, mut unk) = match model {
            "llama" => (VocabKind::Spm, Some(1), Some(2), Some(0)),
            "gpt2" => (VocabKind::Bpe, Some(11), Some(11), None),
            other => bail!("unsupported tokenizer model '{other}' (supported: gpt2, llama)"),
        };
        let mut add_bos = kind == VocabKind::Spm;
        let mut add_space_prefix = kind == VocabKind::Spm;
        let mut ignore_merges = false;
        let mut split = None;
        let mut merge_lines = None;
        if kind == VocabKind::Bpe {
            merge_lines = Some(merges.context("BPE tokenizer without tokenizer.ggml.merges")?);
            split = Some(match pre {
                "smollm" | "starcoder" | "refact" | "command-r" | "codeshell" | "exaone" | "minerva-7b" | "mellum2" => {
                    PreSplit::DigitsThenGpt2
                }
                "gpt-2" | "phi-2" | "jina-es" | "jina-de" | "gigachat" | "jina-v2-es" | "jina-v2-de" | "a.x-4.0"
                | "mellum" | "modern-bert" | "mpt" | "olmo" | "jais" | "trillion" | "granite-docling" | "exaone4"
                | "jina-v1-en" | "jina-v2-code" | "roberta-bpe" => PreSplit::Gpt2,
                "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0" | "lfm2"
                | "jina-v5-nano" => {
                    ignore_merges = true;
                    add_bos = true;
                    PreSplit::Llama3
                }
                "dbrx" | "smaug-bpe" => PreSplit::Llama3,
                "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "megrez" | "stablelm2" | "hunyuan"
                | "solar-open" => PreSplit::Qwen2,
                "glm4" | "chatglm-bpe" => {
                    bos = None;
                    PreSplit::Llama3
                }
                other => bail!(
                    "unsupported BPE pre-tokenizer '{other}' (supported: smollm/starcoder, gpt-2, llama3 and qwen2 families)"
                ),
            });
        }
        if let Some(v) = md.bool("tokenizer.ggml.add_space_prefix") {
            add_space_prefix = v;
        }

        let mut attrs: Vec<u16> = match &token_types {
            Some(t) => {
                if t.len() < n {
                    bail!("tokenizer.ggml.token_type has {} entries for {n} tokens", t.len());
                }
                t[..n].iter().map(|&v| attr_from_type(v)).collect()
            }
            None => vec![ATTR_NORMAL; n],
        };
        let scores = match scores {
            Some(s) => {
                if s.len() < n {
                    bail!("tokenizer.ggml.scores has {} entries for {n} tokens", s.len());
                }
                s[..n].to_vec()
            }
            // No scores (byte-level BPE vocabularies): every score reads as 0 (`token_score`, `score`).
            None => Vec::new(),
        };

        let table = TokenTable::new(&texts)?;
        drop(texts);
        let ids = &table;
        let merges_table = merge_lines.map(|lines| bpe::Merges::new(lines.into_iter(), |t| ids.get(t)));

        // Special ids from metadata; a default out of range is disabled, a metadata id out of range ignored.
        let pick = |default: Option<u32>, key: &str| -> Option<u32> {
            let default = default.filter(|&d| d < n32);
            match md.u64(key) {
                Some(v) if v < n as u64 => Some(v as u32),
                _ => default,
            }
        };
        bos = pick(bos, "tokenizer.ggml.bos_token_id");
        eos = pick(eos, "tokenizer.ggml.eos_token_id");
        let mut eot = pick(None, "tokenizer.ggml.eot_token_id");
        let mut eom = pick(None, "tokenizer.ggml.eom_token_id");
        unk = pick(unk, "tokenizer.ggml.unknown_token_id");
        let pad = pick(None, "tokenizer.ggml.padding_token_id");
        let mut fim_pre = pick(
            pick(None, "tokenizer.ggml.fim_pre_token_id"),
            "tokenizer.ggml.prefix_token_id",
        );
        let mut fim_suf = pick(
            pick(None, "tokenizer.ggml.fim_suf_token_id"),
            "tokenizer.ggml.suffix_token_id",
        );
        let mut fim_mid = pick(
            pick(None, "tokenizer.ggml.fim_mid_token_id"),
            "tokenizer.ggml.middle_token_id",
        );
        let mut fim_pad = pick(None, "tokenizer.ggml.fim_pad_token_id");
        let mut fim_rep = pick(None, "tokenizer.ggml.fim_rep_token_id");
        let mut fim_sep = pick(None, "tokenizer.ggml.fim_sep_token_id");

        let mut add_eos = false;
        if let Some(v) = md.bool("tokenizer.ggml.add_bos_token") {
            add_bos = v;
        }
        if let Some(v) = md.bool("tokenizer.ggml.add_eos_token") {
            add_eos = v;
        }
        if add_bos && bos.is_none() {
            bail!("tokenizer.ggml.add_bos_token is true, but there is no BOS token");
        }
        if add_eos && eos.is_none() {
            bail!("tokenizer.ggml.add_eos_token is true, but there is no EOS token");
        }

        // Text-based detection of special tokens. llama.cpp walks an unordered map and takes the first match;
        // this takes the lowest id, which agrees whenever a vocabulary has one candidate per role.
        let find = |names: &[&str]| -> Option<u32> { names.iter().filter_map(|t| ids.get(t)).min() };
        let detect = |slot: &mut Option<u32>, names: &[&str], attrs: &mut Vec<u16>| {
            if slot.is_none()
                && let Some(id) = find(names)
            {
                *slot = Some(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        };
        detect(
            &mut eot,
            &[
                "<|eot_id|>",
                "<|im_end|>",
                "<|end|>",
                "<end_of_turn>",
                "<|endoftext|>",
                "<|end_of_text|>",
                "<EOT>",
                "_<EOT>",
                "[EOT]",
                "<｜end▁of▁sentence｜>",
                "<end_of_utterance>",
            ],
            &mut attrs,
        );
        detect(&mut eom, &["<|eom_id|>"], &mut attrs);
        detect(
            &mut fim_pre,
            &[
                "<|fim_prefix|>",
                "<fim-prefix>",
                "<fim_prefix>",
                "<｜fim▁begin｜>",
                "<PRE>",
                "▁<PRE>",
                "<|code_prefix|>",
                "<|prefix|>",
            ],
            &mut attrs,
        );
        detect(
            &mut fim_suf,
            &[
                "<|fim_suffix|>",
                "<fim-suffix>",
                "<fim_suffix>",
                "<｜fim▁hole｜>",
                "<SUF>",
                "▁<SUF>",
                "<|code_suffix|>",
                "<|suffix|>",
            ],
            &mut attrs,
        );
        detect(
            &mut fim_mid,
            &[
                "<|fim_middle|>",
                "<fim-middle>",
                "<fim_middle>",
                "<｜fim▁end｜>",
                "<MID>",
                "▁<MID>",
                "<|code_middle|>",
                "<|middle|>",
            ],
            &mut attrs,
        );
        detect(
            &mut fim_pad,
            &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
            &mut attrs,
        );
        detect(
            &mut fim_rep,
            &["<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>"],
            &mut attrs,
        );
        detect(&mut fim_sep, &["<|file_sep|>"], &mut attrs);
        // The FIM prefix/suffix/middle ids are not used further; detecting them matters only because it
        // marks the tokens as control, which changes how they are partitioned and rendered.
        let _ = (fim_pre, fim_suf, fim_mid);

        // Control tokens whose text says "unused" are marked unused.
        for (i, attr) in attrs.iter_mut().enumerate() {
            if *attr & ATTR_CONTROL != 0 && ids.text(i as u32).contains("unused") {
                *attr |= ATTR_UNUSED;
            }
        }

        // End-of-generation set.
        let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        const EOG_TEXTS: &[&str] = &[
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<|return|>",
            "<|call|>",
            "<|flush|>",
            "<|calls|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "</s>",
            "<|eom_id|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "[EOS]",
            "<|end_of_text|>",
            "<end_of_utterance>",
            "<eos>",
            "<turn|>",
            "<|tool_response>",
            "<｜end▁of▁sentence｜>",
            "[e~[",
        ];
        for t in EOG_TEXTS {
            if let Some(id) = ids.get(t) {
                eog.push(id);
                attrs[id as usize] |= ATTR_CONTROL;
            }
        }
        // gpt-oss: these are always rendered, so they become user-defined.
        for t in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = ids.get(t) {
                attrs[id as usize] = ATTR_USER_DEFINED;
            }
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();
        let text_of = |id: u32| ids.text(id);
        let has = |eog: &[u32], t: &str| eog.iter().copied().find(|&id| text_of(id) == t);
        // o200k_harmony / solar-open: "<|end|>" is not end-of-generation when the call/return markers exist.
        if let Some(end_id) = has(&eog, "<|end|>") {
            let ret = has(&eog, "<|return|>").is_some();
            let call = has(&eog, "<|call|>").is_some() || has(&eog, "<|calls|>").is_some();
            let flush = has(&eog, "<|flush|>").is_some();
            if call && (ret || flush) {
                eog.retain(|&id| id != end_id);
                attrs[end_id as usize] = ATTR_USER_DEFINED;
            }
        }
        // gemma4 / plamo: "</s>" is a normal token there.
        if let Some(s_id) = has(&eog, "</s>")
            && (has(&eog, "<|tool_response>").is_some() || has(&eog, "<|plamo:eos|>").is_some())
        {
            eog.retain(|&id| id != s_id);
            attrs[s_id as usize] = ATTR_NORMAL;
        }

        // Special-token cache: control, user-defined and unknown tokens, longest text first. llama.cpp's
        // std::sort leaves the order of equal lengths unspecified; ids break the tie here.
        let mut special_ids: Vec<u32> = (0..n32)
            .filter(|&i| attrs[i as usize] & (ATTR_CONTROL | ATTR_USER_DEFINED | ATTR_UNKNOWN) != 0)
            .collect();
        special_ids.sort_by(|&a, &b| ids.text(b).len().cmp(&ids.text(a).len()).then(a.cmp(&b)));
        // Attributes llama.cpp sets by model, tokenizer or architecture name (`llama_vocab::impl::load`); the
        // GGUF does not carry them. A named token missing from the vocabulary is skipped.
        let set_attr = |attrs: &mut [u16], text: &str, attr: u16, on: bool| {
            if let Some(id) = ids.get(text) {
                let a = &mut attrs[id as usize];
                *a = if on { *a | attr } else { *a & !attr };
            }
        };
        let name = md.general_name.to_lowercase();
        let has_any = |s: &str, subs: &[&str]| subs.iter().any(|sub| s.contains(sub));
        if has_any(pre, &["jina-v2-de", "jina-v2-es", "jina-v2-code", "mmbert"])
            || has_any(md.general_arch, &["nomic-bert-moe", "jina-bert-v3"])
        {
            set_attr(&mut attrs, "<mask>", ATTR_LSTRIP, true);
        } else if has_any(&name, &["phi-3", "phi3"]) {
            for &id in &special_ids {
                attrs[id as usize] |= ATTR_RSTRIP;
            }
            set_attr(&mut attrs, "</s>", ATTR_RSTRIP, true);
            for t in ["<unk>", "<s>", "<|endoftext|>"] {
                set_attr(&mut attrs, t, ATTR_RSTRIP, false);
            }
        } else if name.contains("modern-bert") {
            set_attr(&mut attrs, "[MASK]", ATTR_LSTRIP, true);
        }
        let mut specials = SpecialTrie::new();
        let mut special_rank = HashMap::with_capacity_and_hasher(special_ids.len(), FastHash);
        for (rank, &id) in special_ids.iter().enumerate() {
            specials.insert(ids.text(id).as_bytes(), id);
            special_rank.insert(id, rank as u32);
        }

        let byte_tokens: Vec<Option<u32>> = if kind == VocabKind::Spm {
            (0..=255u8)
                .map(|b| {
                    ids.get(&format!("<0x{b:02X}>"))
                        .or_else(|| std::str::from_utf8(&[b]).ok().and_then(|s| ids.get(s)))
                })
                .collect()
        } else {
            Vec::new()
        };

        let mut v = Vocab {
            kind,
            model: model.to_string(),
            pre: pre.to_string(),
            split,
            ignore_merges,
            table,
            scores,
            attrs,
            merges: merges_table,
            pieces: Vec::new(),
            piece_offs: Vec::new(),
            bos,
            eos,
            eot,
            unk,
            pad,
            add_bos,
            add_eos,
            add_space_prefix,
            byte_tokens,
            special_rank,
            specials,
            eog,
        };
        v.build_pieces();
        Ok(v)
    }

    /// Precomputes llama.cpp's `token_to_piece(id, special = true)` for every token, keeping only those that
    /// differ from the token's text (about half: Gemma 3's pieces take 1.2 MiB instead of 2.2).
    fn build_pieces(&mut self) {
        let n = self.table.len();
        let mut pieces = Vec::with_capacity(self.table.blob.len());
        let mut offs = Vec::with_capacity(n + 1);
        offs.push(0u32);
        for i in 0..n {
            let text = self.table.text(i as u32);
            let attr = self.attrs[i];
            let start = pieces.len();
            if attr & (ATTR_UNKNOWN | ATTR_CONTROL | ATTR_USER_DEFINED) != 0 {
                pieces.extend_from_slice(text.as_bytes());
            } else if attr & ATTR_NORMAL != 0 {
                match self.kind {
                    VocabKind::Spm => {
                        let mut rest = text;
                        while let Some(p) = rest.find('▁') {
                            pieces.extend_from_slice(&rest.as_bytes()[..p]);
                            pieces.push(b' ');
                            rest = &rest[p + '▁'.len_utf8()..];
                        }
                        pieces.extend_from_slice(rest.as_bytes());
                    }
                    VocabKind::Bpe => {
                        for c in text.chars() {
                            match unicode::char_to_byte(c) {
                                Some(b) => pieces.push(b),
                                // llama.cpp's marker for a char outside the byte table.
                                None => {
                                    pieces.extend_from_slice(b"[UNK_BYTE_0x");
                                    let mut buf = [0u8; 4];
                                    for b in c.encode_utf8(&mut buf).bytes() {
                                        pieces.extend_from_slice(format!("{b:02x}").as_bytes());
                                    }
                                    pieces.extend_from_slice(text.as_bytes());
                                    pieces.push(b']');
                                }
                            }
                        }
                    }
                }
            } else if attr & ATTR_BYTE != 0 {
                // "<0xAB>" -> the byte 0xAB
                let b = text.get(3..5).and_then(|h| u8::from_str_radix(h, 16).ok()).unwrap_or(0);
                pieces.push(b);
            }
            // unused / undefined tokens render as nothing
            if pieces.len() > start && &pieces[start..] == text.as_bytes() {
                pieces.truncate(start);
                self.attrs[i] |= PIECE_IS_TEXT;
            }
            offs.push(pieces.len() as u32);
        }
        pieces.shrink_to_fit();
        self.pieces = pieces;
        self.piece_offs = offs;
    }

    /// llama.cpp's `tokenizer_st_partition`: for each special token, longest first, every occurrence in the
    /// text not yet claimed becomes a token fragment. Computed in one pass: all occurrences are found with
    /// the trie, then accepted in cache order (and left to right per token) unless they overlap an accepted
    /// one, which is what splitting fragment by fragment amounts to. Control and unknown tokens are matched
    /// only with `parse_special`; user-defined ones always.
    /// `plain`: byte ranges where control and unknown tokens are not matched even with `parse_special` (chat
    /// message contents, see [`Vocab::tokenize_chat`]).
    fn partition(&self, text: &str, parse_special: bool, plain: &[std::ops::Range<usize>]) -> Vec<Fragment> {
        let bytes = text.as_bytes();
        let mut found: Vec<(u32, usize, usize, u32)> = Vec::new(); // (rank, start, len, id)
        for start in 0..bytes.len() {
            self.specials.prefixes(&bytes[start..], |id, len| {
                let attr = self.attrs[id as usize];
                if attr & (ATTR_CONTROL | ATTR_UNKNOWN) != 0
                    && (!parse_special || plain.iter().any(|r| start < r.end && r.start < start + len))
                {
                    return;
                }
                found.push((self.special_rank[&id], start, len, id));
            });
        }
        if found.is_empty() {
            return vec![Fragment::Text(0, bytes.len())];
        }
        found.sort_unstable();
        let mut taken: BTreeMap<usize, (usize, u32)> = BTreeMap::new(); // start -> (end, id)
        for (_, start, len, id) in found {
            let end = start + len;
            // Intervals in `taken` are disjoint, so only the last one starting before `end` can overlap.
            if let Some((_, &(e, _))) = taken.range(..end).next_back()
                && e > start
            {
                continue;
            }
            taken.insert(start, (end, id));
        }
        // The text between tokens, less the whitespace an RSTRIP token on its left or an LSTRIP token on its
        // right drops (C `isspace` bytes, as llama.cpp).
        let space = |b: u8| matches!(b, b' ' | b'\t' | b'\n' | 0x0b | 0x0c | b'\r');
        let mut frags = Vec::with_capacity(taken.len() * 2 + 1);
        let mut pos = 0;
        let mut rstrip = false;
        for (start, (end, id)) in taken {
            let (mut a, mut b) = (pos, start);
            if rstrip {
                while a < b && space(bytes[a]) {
                    a += 1;
                }
            }
            if self.attrs[id as usize] & ATTR_LSTRIP != 0 {
                while a < b && space(bytes[b - 1]) {
                    b -= 1;
                }
            }
            if b > a {
                frags.push(Fragment::Text(a, b));
            }
            frags.push(Fragment::Token(id));
            pos = end;
            rstrip = self.attrs[id as usize] & ATTR_RSTRIP != 0;
        }
        let mut a = pos;
        if rstrip {
            while a < bytes.len() && space(bytes[a]) {
                a += 1;
            }
        }
        if a < bytes.len() {
            frags.push(Fragment::Text(a, bytes.len()));
        }
        frags
    }

    /// llama_tokenize semantics: `add_special` adds BOS (and EOS) where the metadata asks for them;
    /// `parse_special` recognises control-token texts such as `<|im_start|>` in the text (user-defined
    /// token texts are always recognised, as in llama.cpp).
    pub fn tokenize(&self, text: &str, add_special: bool, parse_special: bool) -> Vec<u32> {
        self.tokenize_ranges(text, add_special, parse_special, &[])
    }

    /// A rendered chat prompt: the template's markers become control tokens, while inside `contents` (the
    /// messages' text, [`crate::chat::ChatTemplate::render_marked`]) control-token texts stay plain text, so a
    /// user cannot forge a role marker. Text without such tokens tokenizes exactly as with [`Vocab::tokenize`].
    pub fn tokenize_chat(&self, text: &str, add_special: bool, contents: &[std::ops::Range<usize>]) -> Vec<u32> {
        self.tokenize_ranges(text, add_special, true, contents)
    }

    fn tokenize_ranges(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
        plain: &[std::ops::Range<usize>],
    ) -> Vec<u32> {
        let frags = if text.is_empty() {
            Vec::new()
        } else {
            self.partition(text, parse_special, plain)
        };
        let mut out = Vec::with_capacity(text.len() / 3 + 2);
        if add_special
            && self.add_bos
            && let Some(b) = self.bos
        {
            out.push(b);
        }
        match self.kind {
            VocabKind::Spm => {
                let mut prev_special = true;
                let mut buf = String::new();
                for f in frags {
                    match f {
                        Fragment::Text(a, b) => {
                            buf.clear();
                            if self.add_space_prefix && prev_special {
                                buf.push(' ');
                            }
                            buf.push_str(&text[a..b]);
                            let escaped = buf.replace(' ', "▁");
                            spm::tokenize(&escaped, self, &mut out);
                            prev_special = false;
                        }
                        Fragment::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
            VocabKind::Bpe => {
                for f in frags {
                    match f {
                        Fragment::Text(a, b) => self.bpe_fragment(&text[a..b], &mut out),
                        Fragment::Token(id) => out.push(id),
                    }
                }
            }
        }
        if add_special
            && self.add_eos
            && let Some(e) = self.eos
        {
            out.push(e);
        }
        out
    }

    fn bpe_fragment(&self, text: &str, out: &mut Vec<u32>) {
        let (Some(split), Some(merges)) = (self.split, self.merges.as_ref()) else {
            return;
        };
        let table = byte_table();
        let mut enc = String::new();
        let mut syms = Vec::new();
        for (a, b) in pretokenize::split(text, split) {
            enc.clear();
            enc.extend(text.as_bytes()[a..b].iter().map(|&byte| table[byte as usize]));
            syms.clear();
            if self.ignore_merges
                && let Some(id) = self.table.get(&enc)
            {
                syms.push((0, enc.len(), Some(id)));
            } else {
                bpe::merge_word(&enc, merges, |t| self.table.get(t), &mut syms);
            }
            for &(s, e, id) in &syms {
                let piece = &enc[s..e];
                match id {
                    Some(id) => out.push(id),
                    None => {
                        // llama.cpp looks each byte of the (encoded) symbol up as a one-byte token.
                        for byte in piece.bytes() {
                            if let Some(id) = std::str::from_utf8(&[byte]).ok().and_then(|s| self.table.get(s)) {
                                out.push(id);
                            }
                        }
                    }
                }
            }
        }
    }

    /// The bytes a token stands for (llama_token_to_piece with special = true).
    pub fn token_bytes(&self, id: u32) -> &[u8] {
        let i = id as usize;
        if i + 1 >= self.piece_offs.len() {
            return &[];
        }
        if self.attrs[i] & PIECE_IS_TEXT != 0 {
            return self.table.text(id).as_bytes();
        }
        &self.pieces[self.piece_offs[i] as usize..self.piece_offs[i + 1] as usize]
    }

    /// The bytes a token renders as in generated text (llama_token_to_piece with special = false): empty
    /// for control and unknown tokens, otherwise as [`Vocab::token_bytes`].
    pub fn token_bytes_visible(&self, id: u32) -> &[u8] {
        match self.attrs.get(id as usize) {
            Some(a) if a & (ATTR_CONTROL | ATTR_UNKNOWN) == 0 => self.token_bytes(id),
            _ => &[],
        }
    }

    /// The raw vocabulary entry (empty for an out-of-range id).
    pub fn token_text(&self, id: u32) -> &str {
        if (id as usize) < self.table.len() {
            self.table.text(id)
        } else {
            ""
        }
    }

    /// The id of an exact vocabulary entry.
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.table.get(text)
    }

    pub fn token_score(&self, id: u32) -> f32 {
        self.scores.get(id as usize).copied().unwrap_or(0.0)
    }

    /// Control tokens (and tokens llama.cpp promoted to control by their text).
    pub fn is_control(&self, id: u32) -> bool {
        self.attrs.get(id as usize).is_some_and(|a| a & ATTR_CONTROL != 0)
    }

    pub fn n_tokens(&self) -> usize {
        self.table.len()
    }
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }
    /// End-of-turn token, when the vocabulary has one.
    pub fn eot(&self) -> Option<u32> {
        self.eot
    }
    pub fn unk(&self) -> Option<u32> {
        self.unk
    }
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }
    /// Whether tokenizing with `add_special` prepends BOS (llama_vocab_get_add_bos).
    pub fn add_bos(&self) -> bool {
        self.add_bos
    }
    pub fn add_eos(&self) -> bool {
        self.add_eos
    }
    /// End of generation: EOS, EOT, `<|im_end|>`, `<end_of_turn>`, ... exactly llama.cpp's set.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }
    /// All end-of-generation ids, sorted.
    pub fn eog_ids(&self) -> &[u32] {
        &self.eog
    }
    pub fn kind(&self) -> VocabKind {
        self.kind
    }
    pub fn describe(&self) -> String {
        match self.kind {
            VocabKind::Bpe => format!(
                "{} BPE (pre: {}), {} tokens, {} merges",
                self.model,
                self.pre,
                self.n_tokens(),
                self.merges.as_ref().map_or(0, |m| m.len())
            ),
            VocabKind::Spm => format!("{} SPM, {} tokens", self.model, self.n_tokens()),
        }
    }

    /// Concatenated pieces, lossily decoded (control tokens included as text).
    pub fn detokenize(&self, ids: &[u32]) -> String {
        let mut bytes = Vec::new();
        for &id in ids {
            bytes.extend_from_slice(self.token_bytes(id));
        }
        String::from_utf8_lossy(&bytes).into_owned()
    }
}

impl spm::SpmVocab for Vocab {
    fn lookup(&self, text: &str) -> Option<u32> {
        self.table.get(text)
    }
    fn score(&self, id: u32) -> f32 {
        self.token_score(id)
    }
    fn byte_token(&self, b: u8) -> Option<u32> {
        // llama.cpp throws when a byte has no token; falling back to <unk> keeps going.
        self.byte_tokens.get(b as usize).copied().flatten().or(self.unk)
    }
}

fn byte_table() -> &'static [char; 256] {
    static TABLE: std::sync::OnceLock<[char; 256]> = std::sync::OnceLock::new();
    TABLE.get_or_init(unicode::byte_to_char_table)
}

/// Metadata accessors, so tests can build vocabularies without a GGUF file.
struct Metadata<'a> {
    get_u64: &'a dyn Fn(&str) -> Option<u64>,
    get_bool: &'a dyn Fn(&str) -> Option<bool>,
    /// `general.name`: llama.cpp picks some token attributes by model name.
    general_name: &'a str,
    /// `general.architecture`.
    general_arch: &'a str,
}

impl Metadata<'_> {
    fn u64(&self, k: &str) -> Option<u64> {
        (self.get_u64)(k)
    }
    fn bool(&self, k: &str) -> Option<bool> {
        (self.get_bool)(k)
    }
}

/// Streaming detokenizer: feed ids, get back only complete UTF-8 text. A multi-byte character split across
/// tokens is held back until it completes; bytes that can never form a character become U+FFFD at once;
/// [`StreamDecoder::flush`] turns an incomplete tail into U+FFFD.
#[derive(Default, Debug, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> StreamDecoder {
        StreamDecoder::default()
    }

    /// Appends the token's bytes and returns whatever text is now complete.
    pub fn push(&mut self, vocab: &Vocab, id: u32) -> String {
        self.push_bytes(vocab.token_bytes(id))
    }

    pub fn push_bytes(&mut self, bytes: &[u8]) -> String {
        self.pending.extend_from_slice(bytes);
        let mut out = String::new();
        let mut consumed = 0;
        loop {
            let rest = &self.pending[consumed..];
            match std::str::from_utf8(rest) {
                Ok(s) => {
                    out.push_str(s);
                    consumed = self.pending.len();
                    break;
                }
                Err(e) => {
                    let good = e.valid_up_to();
                    out.push_str(std::str::from_utf8(&rest[..good]).expect("validated prefix"));
                    match e.error_len() {
                        // An invalid sequence: replace it and go on.
                        Some(bad) => {
                            out.push('\u{FFFD}');
                            consumed += good + bad;
                        }
                        // A character cut short at the end: keep it for the next token.
                        None => {
                            consumed += good;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..consumed);
        out
    }

    /// Bytes held back waiting for the rest of a character.
    pub fn pending(&self) -> &[u8] {
        &self.pending
    }

    /// Ends the stream: an incomplete character left over becomes U+FFFD.
    pub fn flush(&mut self) -> String {
        let s = String::from_utf8_lossy(&self.pending).into_owned();
        self.pending.clear();
        s
    }
}

#[cfg(test)]
mod tests;
