//! Ensembles: different models, possibly with different vocabularies and on different machines, combined at every
//! step in byte space (docs/ensemble.md).
//!
//! Data flow of one step: every live member holds its next-token distribution; [`combine`] turns their top-k
//! candidates (byte strings with log-probabilities) into one choice; the choice's bytes are appended to the shared
//! text and streamed; every member then catches up with the text ([`member::Member::commit`]: its own token when the
//! choice was one of its candidates, else a tail re-tokenization) and computes its next distribution. Members step in
//! parallel threads, so a remote member's forward pass overlaps the local one's.
//!
//! A member that fails ends the request with an error naming it, or, with `degrade`, is dropped and the others go on.

pub mod combine;
pub mod fit;
pub mod member;

pub use combine::{Choice, Combine, Key, Pick};
pub use member::{Member, MemberOpts, MemberSpec, Place, Synced, parse_members};

use crate::generate::{Finish, GenParams, Generator, Outcome, Piece, Prompt, TextModel, check_fits};
use crate::vocab::StreamDecoder;
use anyhow::{Result, bail};
use combine::View;
use rand::SeedableRng;
use rand::rngs::StdRng;
use std::time::{Duration, Instant};

/// Everything an ensemble needs to start.
#[derive(Clone, Debug)]
pub struct EnsembleOpts {
    pub members: Vec<MemberSpec>,
    pub combine: Combine,
    /// Continue without a member that fails, instead of ending the request.
    pub degrade: bool,
    pub member: MemberOpts,
    /// Print member failures and degradations to standard error as they happen.
    pub verbose: bool,
    /// How long a dropped member sits out before a request tries it again ([`RETRY_DROPPED`] by default).
    pub retry_dropped: Duration,
}

pub struct Ensemble {
    pub members: Vec<Member>,
    alive: Vec<bool>,
    /// When each dropped member failed: it gets another chance at the first request [`RETRY_DROPPED`] later.
    dropped_at: Vec<Option<Instant>>,
    combine: Combine,
    /// One weight per member (normalised over the live ones at each step).
    weights: Vec<f64>,
    degrade: bool,
    verbose: bool,
    /// Lines about members dropped during the current request.
    notes: Vec<String>,
    retry_after: Duration,
}

/// How long a member dropped under `--ensemble-degrade` sits out before a request tries it again (a remote member
/// reconnects; one that is still down costs that request one connect timeout, then is dropped again).
pub const RETRY_DROPPED: Duration = Duration::from_secs(10);

/// Totals of one request, for `-v` and the docs.
#[derive(Clone, Debug, Default)]
struct Cost {
    steps: u64,
    bytes: u64,
    /// Steps where each member was the first to propose the chosen candidate.
    wins: Vec<u64>,
    bounded: u64,
}

impl Ensemble {
    /// Opens every member (loading local ones, connecting to remote ones).
    pub fn open(opts: &EnsembleOpts) -> Result<Ensemble> {
        if opts.members.is_empty() {
            bail!("an ensemble needs at least one member");
        }
        let weights = match &opts.combine {
            Combine::Mix(w) => {
                if w.len() != opts.members.len() {
                    bail!(
                        "--combine mix has {} weights for {} members",
                        w.len(),
                        opts.members.len()
                    );
                }
                w.clone()
            }
            _ => vec![1.0; opts.members.len()],
        };
        let mut members = Vec::with_capacity(opts.members.len());
        for spec in &opts.members {
            members.push(Member::open(spec, &opts.member)?);
        }
        Ok(Ensemble {
            alive: vec![true; members.len()],
            dropped_at: vec![None; members.len()],
            members,
            combine: opts.combine.clone(),
            weights,
            degrade: opts.degrade,
            verbose: opts.verbose,
            notes: Vec::new(),
            retry_after: opts.retry_dropped,
        })
    }

    /// Changes the combination rule for the next requests (weights reset to the rule's).
    pub fn set_combine(&mut self, combine: Combine) -> Result<()> {
        self.weights = match &combine {
            Combine::Mix(w) if w.len() == self.members.len() => w.clone(),
            Combine::Mix(w) => bail!(
                "--combine mix has {} weights for {} members",
                w.len(),
                self.members.len()
            ),
            _ => vec![1.0; self.members.len()],
        };
        self.combine = combine;
        Ok(())
    }

    pub fn weights(&self) -> &[f64] {
        &self.weights
    }

    /// Members still taking part.
    pub fn live(&self) -> usize {
        self.alive.iter().filter(|&&a| a).count()
    }

    /// Runs `f` on every live member at once (one thread each); a failure drops the member when degrading (with a
    /// note), otherwise it ends the request with the member's error. Returns the live members' results.
    fn each<T: Send>(&mut self, f: impl Fn(usize, &mut Member) -> Result<T> + Sync) -> Result<Vec<Option<T>>> {
        let alive = self.alive.clone();
        let f = &f;
        let results: Vec<Option<Result<T>>> = std::thread::scope(|sc| {
            let handles: Vec<_> = self
                .members
                .iter_mut()
                .zip(&alive)
                .enumerate()
                .map(|(i, (m, &a))| a.then(|| sc.spawn(move || f(i, m))))
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.map(|h| {
                        h.join()
                            .unwrap_or_else(|_| Err(anyhow::anyhow!("ensemble member thread panicked")))
                    })
                })
                .collect()
        });
        let mut out = Vec::with_capacity(results.len());
        let mut failed = Vec::new();
        for (i, r) in results.into_iter().enumerate() {
            match r {
                None => out.push(None),
                Some(Ok(v)) => out.push(Some(v)),
                Some(Err(e)) => {
                    failed.push((i, e));
                    out.push(None);
                }
            }
        }
        for (i, e) in failed {
            let left = self.live() - 1;
            if !self.degrade || left == 0 {
                let why = if self.degrade { " (no member left)" } else { "" };
                return Err(e.context(format!("ensemble member {} failed{why}", self.members[i].name())));
            }
            self.alive[i] = false;
            self.dropped_at[i] = Some(Instant::now());
            let names: Vec<&str> = self
                .members
                .iter()
                .zip(&self.alive)
                .filter(|(_, a)| **a)
                .map(|(m, _)| m.name())
                .collect();
            let note = format!(
                "ensemble: member {} failed ({e:#}); continuing with {}",
                self.members[i].name(),
                names.join(", ")
            );
            if self.verbose {
                tracing::info!("{note}");
            }
            self.notes.push(note);
        }
        Ok(out)
    }

    /// Gives members dropped at least `after` ago another chance (they rejoin for this request).
    fn retry_dropped(&mut self, after: Duration) {
        for i in 0..self.members.len() {
            if self.dropped_at[i].is_some_and(|t| t.elapsed() >= after) {
                self.alive[i] = true;
                self.dropped_at[i] = None;
                let note = format!("ensemble: trying member {} again", self.members[i].name());
                if self.verbose {
                    tracing::info!("{note}");
                }
                self.notes.push(note);
            }
        }
    }

    /// The combination of the live members' current distributions.
    fn choose(&self, pick: Pick, rng: &mut StdRng) -> Result<Choice> {
        let views: Vec<Option<&dyn View>> = self
            .members
            .iter()
            .zip(&self.alive)
            .map(|(m, &a)| a.then_some(m as &dyn View))
            .collect();
        let w = combine::live_weights(&self.weights, &self.alive);
        match self.combine {
            Combine::Confident => combine::confident(&views, &w, pick, rng),
            Combine::Union | Combine::Mix(_) => combine::union(&views, &w, pick, rng),
        }
    }

    /// Tokens of `prompt` for each member (each with its own template and BOS convention).
    fn tokenize(&self, prompt: &Prompt) -> Result<Vec<Vec<u32>>> {
        self.members.iter().map(|m| m.text.tokenize(prompt)).collect()
    }
}

impl Generator for Ensemble {
    fn describe(&self) -> String {
        let names: Vec<String> = self
            .members
            .iter()
            .zip(&self.alive)
            .map(|(m, &a)| format!("{}{}", m.name(), if a { "" } else { " (dropped)" }))
            .collect();
        format!("ensemble {} ({})", names.join(" + "), self.combine.name())
    }

    fn n_ctx(&self) -> usize {
        self.members.iter().map(|m| m.n_ctx()).min().unwrap_or(0)
    }

    fn count_prompt(&self, prompt: &Prompt) -> Result<usize> {
        Ok(self.tokenize(prompt)?.iter().map(|t| t.len()).max().unwrap_or(0))
    }

    fn text(&self) -> &TextModel {
        &self.members[0].text
    }

    fn generate(
        &mut self,
        prompt: &Prompt,
        params: &GenParams,
        sink: &mut dyn FnMut(&Piece) -> bool,
    ) -> Result<Outcome> {
        self.notes.clear();
        for m in &mut self.members {
            m.stats = Default::default();
            m.set_request_id(&params.request_id);
        }
        self.retry_dropped(self.retry_after);
        let prompts = self.tokenize(prompt)?;
        for (m, p) in self.members.iter().zip(&prompts) {
            check_fits(p.len(), m.n_ctx())?;
        }
        let wire0: Vec<(u64, u64, u64)> = self
            .members
            .iter()
            .map(|m| {
                let (s, r) = m.wire_bytes();
                (s, r, m.wire_requests())
            })
            .collect();
        let pick = Pick {
            temp: params.sampler.temp,
            top_p: params.sampler.top_p,
            min_p: params.sampler.min_p,
        };
        let mut rng = StdRng::seed_from_u64(params.sampler.seed.unwrap_or_else(rand::random));

        // Prompt: every member reads its own rendering of it.
        let t0 = Instant::now();
        let prompts_ref = &prompts;
        let started = self.each(|i, m| m.start(&prompts_ref[i]))?;
        if started.iter().flatten().any(|(_, s)| *s == Synced::ContextFull) {
            bail!("the prompt does not fit a member's context");
        }
        let cached = started.iter().flatten().map(|(k, _)| *k).min().unwrap_or(0);
        let t_prompt = t0.elapsed();

        // Steps.
        let t1 = Instant::now();
        let mut text: Vec<u8> = Vec::new();
        let mut decoder = StreamDecoder::new();
        let mut cost = Cost {
            wins: vec![0; self.members.len()],
            ..Default::default()
        };
        let mut n_gen = 0;
        let finish = loop {
            if n_gen >= params.max_tokens {
                break Finish::Length;
            }
            let choice = self.choose(pick, &mut rng)?;
            let bytes = match &choice.key {
                Key::End => break Finish::Eog,
                Key::Text(b) => b.clone(),
            };
            n_gen += 1;
            cost.steps += 1;
            cost.bytes += bytes.len() as u64;
            cost.wins[choice.from] += 1;
            cost.bounded += choice.bounded as u64;
            let old = text.len();
            text.extend_from_slice(&bytes);
            let top = choice
                .top
                .iter()
                .take(params.top_logprobs)
                .map(|(k, lp)| {
                    let s = match k {
                        Key::End => String::new(),
                        Key::Text(b) => String::from_utf8_lossy(b).into_owned(),
                    };
                    (s, *lp)
                })
                .collect();
            let piece = Piece {
                text: decoder.push_bytes(&bytes),
                token: None,
                logprob: Some(choice.logprob),
                top,
            };
            if !sink(&piece) {
                break Finish::Stopped;
            }
            if n_gen == params.max_tokens {
                break Finish::Length;
            }
            let text_ref = &text;
            let synced = self.each(|_, m| m.commit(text_ref, old))?;
            if synced.iter().flatten().any(|s| *s == Synced::ContextFull) {
                break Finish::ContextFull;
            }
        };
        let tail = decoder.flush();
        if !tail.is_empty() {
            sink(&Piece {
                text: tail,
                ..Default::default()
            });
        }
        let t_gen = t1.elapsed();

        let mut detail = std::mem::take(&mut self.notes);
        detail.push(format!(
            "ensemble: {} steps, {} bytes ({:.2} bytes/step), {} scores bounded by a member's k-th probability",
            cost.steps,
            cost.bytes,
            cost.bytes as f64 / cost.steps.max(1) as f64,
            cost.bounded
        ));
        for (i, m) in self.members.iter().enumerate() {
            let s = &m.stats;
            let mut line = format!(
                "member {}{}: first proposer of {} chosen pieces, {} forwards, {} tokens fed, {} own-token steps, {} re-tokenized ({} tokens \
                 rewound), busy {:.2} s",
                m.name(),
                if self.alive[i] { "" } else { " (dropped)" },
                cost.wins[i],
                s.forwards,
                s.fed,
                s.own,
                s.retokenized,
                s.rewound,
                s.busy.as_secs_f64()
            );
            if m.is_remote() {
                let (snt, rcv) = m.wire_bytes();
                let req = m.wire_requests() - wire0[i].2;
                let (snt, rcv) = (snt - wire0[i].0, rcv - wire0[i].1);
                let per = cost.bytes.max(1) as f64;
                line.push_str(&format!(
                    ", wire: {req} round trips, sent {snt} B, received {rcv} B ({:.2} round trips, {:.0} B per \
                     generated byte)",
                    req as f64 / per,
                    (snt + rcv) as f64 / per
                ));
            }
            detail.push(line);
        }
        Ok(Outcome {
            prompt_tokens: prompts.iter().map(|p| p.len()).max().unwrap_or(0),
            cached_tokens: cached,
            completion_tokens: n_gen,
            finish,
            t_prompt,
            t_gen,
            detail,
        })
    }
}
