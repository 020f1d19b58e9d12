//! Speculative decoding: a small draft model proposes tokens, the target verifies them all in one batched forward
//! and keeps the longest correct prefix. The draft runs here or on its own `baton node`; draft and target may have
//! different vocabularies. Output is exactly the target's (see [`verify`] for the rules and why they are lossless).
//!
//! One round, from the target's last emitted token `t` (not yet in its KV):
//! 1. the draft is re-synced to the committed text (KV rewound to the common prefix, the difference fed in one
//!    batch) and proposes `k` tokens ([`adapt`] picks `k`; 0 means the target steps alone);
//! 2. same vocabulary: the proposed ids are the candidates; different vocabularies: the proposed text is
//!    re-tokenized with the target's tokenizer ([`align`]) and those ids are the candidates;
//! 3. the target runs `[t, c_1..c_m]` in one forward with every position's logits, accepts `a` candidates and
//!    emits one more token of its own; its KV is rewound past `t, c_1..c_a`.
//!
//! A draft that fails or stalls is dropped for the rest of the request (the user is told once on standard error);
//! the target goes on alone, and the next request tries the draft again.

pub mod adapt;
pub mod align;
pub mod draft;
pub mod verify;

pub use draft::Draft;

use crate::engine::sampler::{Sampler, SamplerParams, top_logprobs};
use crate::engine::{Input, Session, Want};
use crate::generate::{GenParams, Generator, Next, Outcome, Piece, Prompt, TextModel, decode_loop};
use crate::kernels::{ThreadPool, ops};
use crate::model::{Model, ModelCache};
use adapt::Adapt;
use anyhow::{Context, Result, bail};
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};
use verify::Dist;

/// `--draft MODEL[@HOST:PORT]`.
#[derive(Clone, Debug, PartialEq)]
pub struct DraftSpec {
    pub model: String,
    pub addr: Option<String>,
}

impl DraftSpec {
    pub fn parse(s: &str) -> Result<DraftSpec> {
        let (model, addr) = match s.rsplit_once('@') {
            Some((m, a)) => {
                if !a.contains(':') {
                    bail!("--draft {s:?}: the node address must look like HOST:PORT");
                }
                (m, Some(a.to_string()))
            }
            None => (s, None),
        };
        if model.is_empty() {
            bail!("--draft {s:?} names no model");
        }
        Ok(DraftSpec {
            model: model.to_string(),
            addr,
        })
    }
}

/// `--draft-tokens N|auto`: `None` adapts.
pub fn parse_draft_tokens(s: &str) -> Result<Option<usize>> {
    if s == "auto" {
        return Ok(None);
    }
    let n: usize = s
        .parse()
        .with_context(|| format!("--draft-tokens {s:?}: give a number of tokens or `auto`"))?;
    if n > MAX_DRAFT {
        bail!("--draft-tokens {n}: at most {MAX_DRAFT}");
    }
    Ok(Some(n))
}

/// The longest draft `auto` considers and the longest a user may ask for.
pub const MAX_DRAFT: usize = 16;

#[derive(Clone, Debug)]
pub struct SpecOptions {
    /// Draft tokens per round; `None` adapts (see [`adapt`]).
    pub draft_tokens: Option<usize>,
    /// Upper bound for `auto`.
    pub k_max: usize,
    pub n_ctx: usize,
    pub n_batch: usize,
    /// Shared secret for a remote draft node.
    pub secret: Option<Vec<u8>>,
    /// Longest wait for one remote draft step.
    pub draft_timeout: Duration,
    /// Where a local draft's model comes from when it is shared with other generators (the server's slots).
    pub models: Option<Arc<ModelCache>>,
}

impl Default for SpecOptions {
    fn default() -> Self {
        SpecOptions {
            draft_tokens: None,
            k_max: 8,
            n_ctx: 4096,
            n_batch: 512,
            secret: None,
            draft_timeout: Duration::from_secs(2),
            models: None,
        }
    }
}

/// Counters of one request (for `-v` and tests).
#[derive(Clone, Debug, Default)]
pub struct SpecStats {
    /// Rounds with a draft, and rounds the target ran alone.
    pub rounds: usize,
    pub plain_steps: usize,
    /// Draft tokens proposed, target candidates verified, and how many of those were accepted.
    pub drafted: usize,
    pub candidates: usize,
    pub accepted: usize,
    pub t_draft: Duration,
    pub t_verify: Duration,
    /// Why the draft stopped helping, if it did (failure, full context).
    pub draft_lost: Option<String>,
    /// Whether this request printed the warning (once per failure, not again while the draft stays down).
    pub warned: bool,
}

pub struct SpecGenerator {
    text: TextModel,
    core: Core,
    last: SpecStats,
}

/// Everything but the target's text side (kept apart so the decode loop can borrow both).
struct Core {
    model: Arc<Model>,
    session: Session,
    draft: Draft,
    same_vocab: bool,
    adapt: Adapt,
    /// The draft failed during an earlier request (it is tried again on the next one; the user was told).
    draft_failed: bool,
}

/// Whether two vocabularies spell every token id the same way (then draft ids are target ids).
pub fn same_vocabulary(a: &TextModel, b: &TextModel) -> bool {
    let (va, vb) = (&a.vocab, &b.vocab);
    va.n_tokens() == vb.n_tokens()
        && va.eog_ids() == vb.eog_ids()
        && (0..va.n_tokens() as u32)
            .all(|i| va.token_bytes(i) == vb.token_bytes(i) && va.is_control(i) == vb.is_control(i))
}

impl SpecGenerator {
    /// A target running here with `draft` proposing for it.
    pub fn new(model: Arc<Model>, pool: Arc<ThreadPool>, draft: Draft, opts: SpecOptions) -> Result<SpecGenerator> {
        let text = TextModel::from_gguf(&model.file)?;
        let n_ctx = opts.n_ctx.min(model.hp.n_ctx_train.max(1));
        let session = Session::new(model.clone(), pool, n_ctx, opts.n_batch)?;
        let same_vocab = same_vocabulary(&text, &draft.text) && model.hp.n_vocab == draft.n_vocab();
        let k_max = opts.draft_tokens.unwrap_or(opts.k_max).max(1);
        Ok(SpecGenerator {
            text,
            core: Core {
                adapt: Adapt::new(opts.draft_tokens, k_max),
                model,
                session,
                draft,
                same_vocab,
                draft_failed: false,
            },
            last: SpecStats::default(),
        })
    }

    /// Opens the draft `spec` names (loaded here, or on a node) for a target running here.
    pub fn open(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        spec: &DraftSpec,
        opts: SpecOptions,
    ) -> Result<SpecGenerator> {
        let path = crate::fetch::resolve(&spec.model)?;
        // Tokens of the same text differ across vocabularies: give the draft room.
        let draft_ctx = opts.n_ctx * 2;
        let draft = match &spec.addr {
            None => {
                let m = match &opts.models {
                    Some(c) => c.get(&path)?,
                    None => Arc::new(Model::load(&path)?),
                };
                Draft::local(m, pool.clone(), draft_ctx, opts.n_batch)?
            }
            // A node caps the context it grants (`baton node -c`): ask for the target's.
            Some(addr) => Draft::remote(&path, addr, opts.n_ctx, opts.secret.clone(), opts.draft_timeout)
                .with_context(|| format!("cannot open the draft on {addr}"))?,
        };
        SpecGenerator::new(model, pool, draft, opts)
    }

    pub fn same_vocab(&self) -> bool {
        self.core.same_vocab
    }

    /// Counters of the last request.
    pub fn stats(&self) -> &SpecStats {
        &self.last
    }

    pub fn adapt(&self) -> &Adapt {
        &self.core.adapt
    }
}

/// The state of one request between rounds.
struct Run {
    /// Target tokens: the prompt, then every emitted token (the last one is not yet in the target's KV).
    tokens: Vec<u32>,
    /// The generated text (bytes of the emitted tokens), for re-syncing a draft of another vocabulary.
    gen_bytes: Vec<u8>,
    /// Draft side: its prompt tokens, and its tokens spelling (a prefix of, after a re-sync) the generated text.
    draft_prompt: Vec<u32>,
    draft_gen: Vec<u32>,
    draft_ok: bool,
    repeat_last_n: usize,
    sampler: Sampler,
    draft_sampler: Sampler,
    /// Draft draws and acceptance draws of the standard rule.
    rng: StdRng,
    /// Tokens verified but not yet handed to the decode loop.
    queue: VecDeque<Next>,
    emitted: usize,
    stats: SpecStats,
}

/// Candidates, their proposal distributions (same vocabulary only), draft tokens used, catch-up time.
type Proposal = (Vec<u32>, Vec<Dist>, usize, Duration);

/// The token after `logits` with its log-probability and top alternatives when asked.
fn next_of(text: &TextModel, id: u32, logits: &[f32], k: usize) -> Next {
    if k == 0 {
        return (id, None, Vec::new());
    }
    let lse = ops::log_sum_exp(logits);
    let top = top_logprobs(logits, k);
    (id, Some((logits[id as usize] as f64 - lse) as f32), text.top_text(&top))
}

impl Core {
    /// Brings the draft to `seq`; the time of a catch-up longer than a couple of tokens (the prompt, the tokens
    /// generated while speculation was off) is returned apart, so it does not count as the draft's per-token cost.
    fn sync_draft(&mut self, seq: &[u32]) -> Result<(Vec<f32>, Duration)> {
        let t0 = Instant::now();
        let (logits, fed) = self.draft.sync(seq)?;
        let logits = logits.to_vec();
        let catch_up = if fed > 2 { t0.elapsed() } else { Duration::ZERO };
        Ok((logits, catch_up))
    }

    /// The draft's proposal: target candidates, each candidate's `q` (same vocabulary), how many draft tokens it
    /// took, and the time spent catching up (see [`Core::sync_draft`]).
    fn propose(&mut self, text: &TextModel, run: &mut Run, k: usize, room: usize) -> Result<Proposal> {
        if self.same_vocab {
            let k = k.min(room);
            let mut cands = Vec::with_capacity(k);
            let mut qs = Vec::with_capacity(k);
            if k == 0 {
                return Ok((cands, qs, 0, Duration::ZERO));
            }
            let (first, catch_up) = self.sync_draft(&run.tokens)?;
            let mut logits: &[f32] = &first;
            loop {
                let q = run.draft_sampler.probs(logits);
                let x = verify::draw(&q, &mut run.rng);
                cands.push(x);
                qs.push(q);
                if cands.len() == k {
                    break;
                }
                logits = self.draft.step(x)?;
            }
            return Ok((cands, qs, k, catch_up));
        }

        // Another vocabulary: re-sync the draft to the committed text, draft greedily (the exact-match rule accepts
        // a candidate with the target's probability of it, so the draft's most likely text is the best bet), and
        // re-tokenize the new text with the target's tokenizer.
        let dv = &self.draft.text.vocab;
        let draft_eog = dv.eog_ids().to_vec();
        let (j, _) = align::consistent_prefix(dv, &run.draft_gen, &run.gen_bytes);
        run.draft_gen.truncate(j);
        let spelled = align::spell(dv, &run.draft_gen).len();
        let mut held = run.draft_prompt.clone();
        held.extend_from_slice(&run.draft_gen);
        let more = align::continue_tokens(dv, &held, &run.gen_bytes[spelled..]);
        run.draft_gen.extend_from_slice(&more);
        held.extend_from_slice(&more);

        let (first, catch_up) = self.sync_draft(&held)?;
        let mut logits: &[f32] = &first;
        let mut drafted = Vec::with_capacity(k);
        let mut eog = false;
        loop {
            let x = ops::argmax(logits) as u32;
            if draft_eog.contains(&x) {
                eog = true;
                break;
            }
            drafted.push(x);
            if drafted.len() == k {
                break;
            }
            logits = self.draft.step(x)?;
        }
        let dv = &self.draft.text.vocab;
        let mut spelled = align::spell(dv, &run.draft_gen);
        spelled.extend(align::spell(dv, &drafted));
        run.draft_gen.extend_from_slice(&drafted);
        let mut cands = Vec::new();
        if spelled.len() >= run.gen_bytes.len() && spelled.starts_with(&run.gen_bytes) {
            let new = &spelled[run.gen_bytes.len()..];
            cands = align::continue_tokens(&text.vocab, &run.tokens, new);
            // The whole text re-tokenized: the draft's end of generation becomes the target's.
            let tv = &text.vocab;
            if eog
                && align::spell(tv, &cands).len() == new.len()
                && let Some(e) = tv.eot().or(tv.eos()).filter(|&e| tv.is_eog(e))
            {
                cands.push(e);
            }
        }
        cands.truncate(room);
        Ok((cands, Vec::new(), drafted.len() + eog as usize, catch_up))
    }

    /// One round after the emitted token `tok` (already in `run.tokens`); false when the context is full.
    fn round(&mut self, text: &TextModel, run: &mut Run, tok: u32, params: &GenParams) -> Result<bool> {
        let n_past = self.session.n_past();
        if n_past + 1 >= self.session.n_ctx() {
            return Ok(false);
        }
        // The penalty history: the last committed tokens, as the target alone would have it.
        run.sampler.reset();
        for &t in &run.tokens[run.tokens.len().saturating_sub(run.repeat_last_n)..] {
            run.sampler.accept(t);
        }
        // Candidates must fit the context (keeping the slot the next round's token needs), the batch, and what is
        // left to emit.
        let left = params.max_tokens.saturating_sub(run.emitted);
        let room = (self.session.n_ctx() - n_past - 2)
            .min(left.saturating_sub(1))
            .min(self.session.n_batch() - 1);
        let k = if run.draft_ok && room > 0 {
            self.adapt.next_k()
        } else {
            0
        };
        let t0 = Instant::now();
        let (cands, qs, n_drafted, catch_up) = if k > 0 {
            match self.propose(text, run, k, room) {
                Ok(p) => p,
                Err(e) => {
                    self.lose_draft(run, &e);
                    (Vec::new(), Vec::new(), 0, Duration::ZERO)
                }
            }
        } else {
            (Vec::new(), Vec::new(), 0, Duration::ZERO)
        };
        let t_draft = t0.elapsed();

        // Verify: one forward over the emitted token and the candidates, every position's logits.
        let t1 = Instant::now();
        let mut feed = Vec::with_capacity(cands.len() + 1);
        feed.push(tok);
        feed.extend_from_slice(&cands);
        let want = if cands.is_empty() {
            Want::LastLogits
        } else {
            Want::AllLogits
        };
        let n_vocab = self.model.hp.n_vocab;
        let logits = self.session.forward(Input::Tokens(&feed), want)?;
        let row = |i: usize| &logits[i * n_vocab..(i + 1) * n_vocab];
        // Positions are asked for in order; the penalty history grows with the accepted candidates.
        let mut sp = run.sampler.clone();
        let mut seen = 0;
        let mut advance = |sp: &mut Sampler, i: usize| {
            while seen < i {
                sp.accept(cands[seen]);
                seen += 1;
            }
        };
        let verdict = if self.same_vocab && !cands.is_empty() {
            verify::speculative_sample(
                &cands,
                &qs,
                |i| {
                    advance(&mut sp, i);
                    sp.probs(row(i))
                },
                &mut run.rng,
            )
        } else {
            verify::exact_match(&cands, |i| {
                advance(&mut sp, i);
                sp.sample(row(i))
            })
        };
        let k_lp = params.top_logprobs;
        for (i, &c) in cands[..verdict.accepted].iter().enumerate() {
            run.queue.push_back(next_of(text, c, row(i), k_lp));
        }
        run.queue
            .push_back(next_of(text, verdict.next, row(verdict.accepted), k_lp));
        // The RNG stream goes on from where verification left it.
        run.sampler = sp;
        // Keep `tok` and the accepted candidates in the KV, forget the rest.
        self.session.rewind(n_past + 1 + verdict.accepted);
        let t_verify = t1.elapsed();

        if n_drafted > 0 {
            run.stats.rounds += 1;
            run.stats.drafted += n_drafted;
            run.stats.candidates += cands.len();
            run.stats.accepted += verdict.accepted;
            run.stats.t_draft += t_draft;
        } else {
            run.stats.plain_steps += 1;
        }
        run.stats.t_verify += t_verify;
        self.adapt.record(
            n_drafted,
            cands.len(),
            verdict.accepted,
            (t_draft - catch_up).as_secs_f64(),
            t_verify.as_secs_f64(),
        );
        Ok(true)
    }

    fn lose_draft(&mut self, run: &mut Run, e: &anyhow::Error) {
        run.draft_ok = false;
        let why = format!("{e:#}");
        if !self.draft_failed {
            tracing::warn!("draft {} stopped ({why}); the target continues alone", self.draft.label);
            run.stats.warned = true;
        }
        self.draft_failed = true;
        run.stats.draft_lost = Some(why);
    }

    fn detail(&self, s: &SpecStats, n_gen: usize, t_gen: Duration) -> Vec<String> {
        let mode = if self.same_vocab {
            "same vocabulary, speculative sampling"
        } else {
            "different vocabularies, text re-tokenized, exact-match verification"
        };
        let pct = |a: usize, b: usize| if b == 0 { 0.0 } else { 100.0 * a as f64 / b as f64 };
        let alone = self
            .adapt
            .target_alone_tps()
            .map_or("not measured".to_string(), |t| format!("{t:.1} tok/s (measured steps)"));
        let mut d = vec![
            format!("speculative: draft {} ({mode})", self.draft.label),
            format!(
                "speculative: {} rounds with a draft, {} steps alone; {} draft tokens, {} candidates, {} accepted \
                 ({:.1}%); mean draft length {:.2}; {:.2} tokens per target forward",
                s.rounds,
                s.plain_steps,
                s.drafted,
                s.candidates,
                s.accepted,
                pct(s.accepted, s.candidates),
                if s.rounds == 0 {
                    0.0
                } else {
                    s.drafted as f64 / s.rounds as f64
                },
                n_gen as f64 / (s.rounds + s.plain_steps).max(1) as f64,
            ),
            format!(
                "speculative: {:.1} tok/s with speculation; target alone {alone}; draft {:.2} s, verify {:.2} s",
                n_gen as f64 / t_gen.as_secs_f64().max(1e-9),
                s.t_draft.as_secs_f64(),
                s.t_verify.as_secs_f64(),
            ),
        ];
        if let Some(why) = &s.draft_lost {
            d.push(format!("speculative: draft lost: {why}"));
        }
        d
    }
}

impl Generator for SpecGenerator {
    fn describe(&self) -> String {
        format!("{}, local + draft {}", self.text.name(), self.core.draft.label)
    }

    fn n_ctx(&self) -> usize {
        self.core.session.n_ctx()
    }

    fn text(&self) -> &TextModel {
        &self.text
    }

    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome> {
        let tokens = self.text.prompt_tokens(prompt, self.n_ctx())?;
        let core = &mut self.core;
        core.draft.set_request_id(&params.request_id);
        let text = &self.text;
        let draft_prompt = if core.same_vocab {
            tokens.clone()
        } else {
            core.draft.text.tokenize(prompt)?
        };
        let t0 = Instant::now();
        let mut sampler = Sampler::after_prompt(params.sampler, core.model.hp.n_vocab, &tokens);
        // The draft samples with the same chain (without the penalty: any proposal is exact, this one is cheap).
        let draft_params = SamplerParams {
            repeat_penalty: 1.0,
            ..params.sampler
        };
        let draft_sampler = Sampler::new(draft_params, core.draft.n_vocab());
        let n_prompt = tokens.len();
        let cached = core.session.reuse_prefix(&tokens);
        let logits = core
            .session
            .eval(&tokens[cached..])
            .context("prompt processing failed")?;
        let first = next_of(text, sampler.sample(logits), logits, params.top_logprobs);
        let t_prompt = t0.elapsed();

        let mut run = Run {
            tokens,
            gen_bytes: Vec::new(),
            draft_prompt,
            draft_gen: Vec::new(),
            draft_ok: true,
            repeat_last_n: params.sampler.repeat_last_n,
            rng: StdRng::seed_from_u64(sampler.seed() ^ 0x0acc_e975_eed5),
            sampler,
            draft_sampler,
            queue: VecDeque::new(),
            emitted: 0,
            stats: SpecStats::default(),
        };
        let t1 = Instant::now();
        let (n_gen, finish) = decode_loop(&text.vocab, first, params.max_tokens, sink, |tok| {
            run.emitted += 1;
            run.tokens.push(tok);
            run.gen_bytes.extend_from_slice(text.vocab.token_bytes(tok));
            if run.queue.is_empty() && !core.round(text, &mut run, tok, params)? {
                return Ok(None);
            }
            Ok(run.queue.pop_front())
        })?;
        let t_gen = t1.elapsed();
        let detail = core.detail(&run.stats, n_gen, t_gen);
        core.draft_failed = run.stats.draft_lost.is_some();
        self.last = run.stats;
        Ok(Outcome {
            prompt_tokens: n_prompt,
            cached_tokens: cached,
            completion_tokens: n_gen,
            finish,
            t_prompt,
            t_gen,
            detail,
        })
    }
}
