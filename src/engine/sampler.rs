//! Sampling with llama.cpp's semantics, so a seed and a set of flags mean the same thing here as there.
//!
//! The chain is llama.cpp's common sampler order restricted to the knobs we expose:
//! repetition penalty → top-k → top-p → min-p → temperature → draw. Top-p and min-p look at the distribution at
//! temperature 1 (temperature only reshapes what survived), exactly as in llama.cpp. `temp <= 0` is greedy argmax
//! (after the penalty). Everything works in one candidate buffer allocated at construction, so sampling a token does
//! not touch the heap.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::VecDeque;

/// Sampling parameters, the one set for local runs, requests and pipeline stages (OPEN carries them to the last
/// stage; see `cluster::wire::Open::sampler`); [`Default`] gives llama.cpp's defaults.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SamplerParams {
    /// Temperature; `<= 0` means greedy argmax.
    pub temp: f32,
    /// Keep the `top_k` most likely tokens; 0 disables.
    pub top_k: usize,
    /// Keep the smallest set of most likely tokens whose probability reaches `top_p`; `>= 1` disables.
    pub top_p: f32,
    /// Drop tokens less likely than `min_p` times the most likely one; `<= 0` disables.
    pub min_p: f32,
    /// Divide positive logits (multiply negative ones) of recently seen tokens by this; 1 disables.
    pub repeat_penalty: f32,
    /// How many of the last accepted tokens the penalty looks at; 0 disables.
    pub repeat_last_n: usize,
    /// RNG seed; `None` picks a random one (see [`Sampler::seed`] to reproduce the run).
    pub seed: Option<u64>,
}

impl Default for SamplerParams {
    fn default() -> Self {
        SamplerParams {
            temp: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: None,
        }
    }
}

impl SamplerParams {
    /// Greedy decoding: always the most likely token.
    pub fn greedy() -> Self {
        SamplerParams {
            temp: 0.0,
            ..Default::default()
        }
    }

    /// The one range check of the sampling settings, used by the CLI, the HTTP API and a node's OPEN: `Err` names
    /// the parameter (by the `name` its caller uses: a flag, a JSON field) and its range, in plain words. Outside
    /// these ranges the sampler would keep no candidate (`min_p > 1`) or compute with NaN.
    pub fn check(&self, name: impl Fn(SamplerField) -> &'static str) -> Result<(), (SamplerField, String)> {
        let bad = |f: SamplerField, v: f32, range: &str| Err((f, format!("{} must be {range}, got {v}", name(f))));
        if !(self.temp.is_finite() && self.temp >= 0.0) {
            return bad(SamplerField::Temp, self.temp, "a number of at least 0 (0: greedy)");
        }
        if !(0.0..=1.0).contains(&self.top_p) {
            return bad(SamplerField::TopP, self.top_p, "between 0 and 1");
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return bad(SamplerField::MinP, self.min_p, "between 0 and 1");
        }
        if !(self.repeat_penalty.is_finite() && self.repeat_penalty > 0.0) {
            return bad(
                SamplerField::RepeatPenalty,
                self.repeat_penalty,
                "a number above 0 (1: off)",
            );
        }
        Ok(())
    }

    /// `self` when [`SamplerParams::check`] passes, named by the CLI's flags.
    pub fn checked_cli(self) -> anyhow::Result<Self> {
        self.check(SamplerField::flag).map_err(|(_, m)| anyhow::Error::msg(m))?;
        Ok(self)
    }
}

/// A range-checked sampling setting, for [`SamplerParams::check`]'s messages.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum SamplerField {
    Temp,
    TopP,
    MinP,
    RepeatPenalty,
}

impl SamplerField {
    /// The command-line flag.
    pub fn flag(self) -> &'static str {
        match self {
            SamplerField::Temp => "--temp",
            SamplerField::TopP => "--top-p",
            SamplerField::MinP => "--min-p",
            SamplerField::RepeatPenalty => "--repeat-penalty",
        }
    }

    /// The HTTP API's JSON field (OpenAI's names where it has them, llama.cpp's otherwise).
    pub fn json(self) -> &'static str {
        match self {
            SamplerField::Temp => "temperature",
            SamplerField::TopP => "top_p",
            SamplerField::MinP => "min_p",
            SamplerField::RepeatPenalty => "repeat_penalty",
        }
    }

    /// The OPEN field (docs/protocol.md).
    pub fn wire(self) -> &'static str {
        match self {
            SamplerField::Temp => "temperature",
            SamplerField::TopP => "top_p",
            SamplerField::MinP => "min_p",
            SamplerField::RepeatPenalty => "repeat_penalty",
        }
    }
}

#[derive(Debug, Clone, Copy)]
struct Candidate {
    id: u32,
    logit: f32,
    p: f32,
}

impl Candidate {
    /// Ranking used everywhere: higher logit first, lower id first among equals (so results never depend on
    /// which selection algorithm ran).
    fn better(&self, other: &Candidate) -> bool {
        self.logit > other.logit || (self.logit == other.logit && self.id < other.id)
    }
}

/// A stateful sampler for one sequence: parameters, RNG and the recent-token history for the penalty.
#[derive(Debug, Clone)]
pub struct Sampler {
    params: SamplerParams,
    seed: u64,
    rng: StdRng,
    /// Penalised logits, NaN replaced by -inf (capacity `n_vocab`).
    scratch: Vec<f32>,
    /// Surviving candidates (capacity `n_vocab`).
    candidates: Vec<Candidate>,
    history: VecDeque<u32>,
    /// Scratch for de-duplicating the penalty window (capacity `repeat_last_n`).
    window: Vec<u32>,
}

impl Sampler {
    pub fn new(params: SamplerParams, n_vocab: usize) -> Self {
        let seed = params.seed.unwrap_or_else(rand::random);
        Sampler {
            seed,
            rng: StdRng::seed_from_u64(seed),
            scratch: Vec::with_capacity(n_vocab),
            candidates: Vec::with_capacity(n_vocab),
            history: VecDeque::with_capacity(params.repeat_last_n),
            window: Vec::with_capacity(params.repeat_last_n),
            params,
        }
    }

    pub fn params(&self) -> &SamplerParams {
        &self.params
    }

    /// The seed actually in use (random when none was given), to reproduce a run.
    pub fn seed(&self) -> u64 {
        self.seed
    }

    /// A sampler that has already seen `prompt` (for the repetition penalty): where every generation starts.
    pub fn after_prompt(params: SamplerParams, n_vocab: usize, prompt: &[u32]) -> Self {
        let mut s = Sampler::new(params, n_vocab);
        for &t in prompt {
            s.accept(t);
        }
        s
    }

    /// Records a token of the sequence (prompt or generated) for the repetition penalty.
    pub fn accept(&mut self, token: u32) {
        let n = self.params.repeat_last_n;
        if n == 0 {
            return;
        }
        if self.history.len() == n {
            self.history.pop_front();
        }
        self.history.push_back(token);
    }

    /// Forgets the history (new sequence); the RNG stream continues.
    pub fn reset(&mut self) {
        self.history.clear();
    }

    /// Picks the next token from `logits` (one per vocabulary entry). NaN logits are never picked unless all are NaN.
    /// An empty slice yields token 0.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        match self.prepare(logits) {
            Some(t) => t,
            None => self.draw(),
        }
    }

    /// The distribution [`Sampler::sample`] draws from, as (token, probability) pairs with probability > 0: the
    /// survivors of the chain after temperature, or one token with probability 1 when greedy. Speculative decoding
    /// needs it to accept or reject a drafted token exactly. Does not touch the RNG.
    pub fn probs(&mut self, logits: &[f32]) -> Vec<(u32, f32)> {
        if let Some(t) = self.prepare(logits) {
            return vec![(t, 1.0)];
        }
        let c = &mut self.candidates;
        softmax(c);
        let total: f64 = c.iter().map(|x| x.p as f64).sum();
        if total <= 0.0 || !total.is_finite() {
            return vec![(c.iter().fold(c[0], |b, x| if x.better(&b) { *x } else { b }).id, 1.0)];
        }
        c.iter()
            .filter(|x| x.p > 0.0)
            .map(|x| (x.id, (x.p as f64 / total) as f32))
            .collect()
    }

    /// Runs the chain up to the draw: `Some(token)` when the choice is already made (greedy, empty input),
    /// otherwise leaves the temperature-scaled survivors in `self.candidates`.
    fn prepare(&mut self, logits: &[f32]) -> Option<u32> {
        if logits.is_empty() {
            return Some(0);
        }
        let SamplerParams {
            temp,
            top_k,
            top_p,
            min_p,
            repeat_penalty,
            ..
        } = self.params;
        if temp <= 0.0 && (repeat_penalty == 1.0 || self.history.is_empty()) {
            return Some(argmax(logits)); // nothing to rewrite: skip the copy
        }
        self.scratch.clear();
        self.scratch
            .extend(logits.iter().map(|&l| if l.is_nan() { f32::NEG_INFINITY } else { l }));
        self.apply_penalty();

        if temp <= 0.0 {
            return Some(argmax(&self.scratch));
        }
        let n = self.scratch.len();
        // `full` means "every token is still a candidate": the vocabulary is materialised as candidates only when
        // a step really needs it, since that is the expensive part with 262k-entry vocabularies.
        let mut full = true;
        if top_k > 0 && top_k < n {
            select_top(&self.scratch, top_k, &mut self.candidates);
            full = false;
        }
        if top_p < 1.0 {
            if full {
                self.top_p_full(top_p);
                full = false;
            } else {
                top_p_sorted(&mut self.candidates, top_p);
            }
        }
        if min_p > 0.0 {
            let src: &[f32] = &self.scratch;
            let max = if full {
                src.iter().copied().fold(f32::NEG_INFINITY, f32::max)
            } else {
                self.candidates
                    .iter()
                    .map(|c| c.logit)
                    .fold(f32::NEG_INFINITY, f32::max)
            };
            let threshold = max + min_p.ln();
            if max > f32::NEG_INFINITY {
                if full {
                    self.candidates.clear();
                    self.candidates
                        .extend(
                            src.iter()
                                .enumerate()
                                .filter(|&(_, &l)| l >= threshold)
                                .map(|(i, &l)| Candidate {
                                    id: i as u32,
                                    logit: l,
                                    p: 0.0,
                                }),
                        );
                    full = false;
                } else {
                    self.candidates.retain(|c| c.logit >= threshold);
                }
            }
        }
        if full {
            materialise(&self.scratch, &mut self.candidates);
        }
        for c in &mut self.candidates {
            c.logit /= temp;
        }
        None
    }

    /// llama.cpp's repetition penalty: each distinct token of the last `repeat_last_n` has its logit divided by the
    /// penalty if positive, multiplied if not.
    fn apply_penalty(&mut self) {
        let penalty = self.params.repeat_penalty;
        if penalty == 1.0 || self.history.is_empty() {
            return;
        }
        self.window.clear();
        self.window.extend(self.history.iter().copied());
        self.window.sort_unstable();
        self.window.dedup();
        for &t in &self.window {
            if let Some(l) = self.scratch.get_mut(t as usize) {
                if *l <= 0.0 {
                    *l *= penalty;
                } else {
                    *l /= penalty;
                }
            }
        }
    }

    /// Top-p over the whole vocabulary without sorting all of it. The normaliser takes one pass; peaked
    /// distributions then reach `p` within the best 64 tokens (a heap pass). Flat ones go to a weighted
    /// quickselect, linear on average, which leaves exactly llama.cpp's kept set at the front (not in order:
    /// the order does not change what is drawn).
    fn top_p_full(&mut self, p: f32) {
        let src: &[f32] = &self.scratch;
        let max = src.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max.is_infinite() {
            materialise(src, &mut self.candidates);
            return;
        }
        let z: f64 = src.iter().map(|&l| ((l - max) as f64).exp()).sum();
        let target = p as f64 * z;
        select_top(src, 64.min(src.len()), &mut self.candidates);
        let mut cum = 0.0f64;
        for i in 0..self.candidates.len() {
            cum += ((self.candidates[i].logit - max) as f64).exp();
            if cum >= target {
                self.candidates.truncate(i + 1);
                return;
            }
        }
        let c = &mut self.candidates;
        c.clear();
        c.extend(src.iter().enumerate().map(|(i, &l)| Candidate {
            id: i as u32,
            logit: l,
            p: (l - max).exp(),
        }));
        let k = weighted_select(c, target);
        c.truncate(k);
    }

    /// Softmax over the survivors and one draw from it.
    fn draw(&mut self) -> u32 {
        let c = &mut self.candidates;
        softmax(c);
        let total: f64 = c.iter().map(|x| x.p as f64).sum();
        if total <= 0.0 || !total.is_finite() {
            return c.iter().fold(c[0], |b, x| if x.better(&b) { *x } else { b }).id;
        }
        let u = self.rng.r#gen::<f64>() * total;
        let mut cum = 0.0f64;
        for x in c.iter() {
            cum += x.p as f64;
            if u < cum {
                return x.id;
            }
        }
        // Rounding left u at the very top: the last token with non-zero probability.
        c.iter().rev().find(|x| x.p > 0.0).map_or(c[0].id, |x| x.id)
    }
}

/// Index of the largest value, the lowest index among equals; NaN is skipped. Eight running maxima let the
/// compiler vectorise the scan, which matters at 262k entries per token.
fn argmax(v: &[f32]) -> u32 {
    let mut lanes = [f32::NEG_INFINITY; 8];
    let chunks = v.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for j in 0..8 {
            if c[j] > lanes[j] {
                lanes[j] = c[j];
            }
        }
    }
    let mut max = lanes.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    for &x in rest {
        if x > max {
            max = x;
        }
    }
    v.iter().position(|&x| x == max).unwrap_or(0) as u32
}

fn materialise(src: &[f32], out: &mut Vec<Candidate>) {
    out.clear();
    out.extend(src.iter().enumerate().map(|(i, &l)| Candidate {
        id: i as u32,
        logit: l,
        p: 0.0,
    }));
}

/// The `k` best of `src` into `out`, sorted best first, in one pass with a k-sized min-heap (the heap's root is
/// the worst kept candidate, so most tokens cost one comparison). `out` must have capacity >= k to stay
/// allocation-free.
fn select_top(src: &[f32], k: usize, out: &mut Vec<Candidate>) {
    out.clear();
    if k == 0 {
        return;
    }
    for (i, &l) in src.iter().enumerate() {
        let c = Candidate {
            id: i as u32,
            logit: l,
            p: 0.0,
        };
        if out.len() < k {
            out.push(c);
            // Sift up.
            let mut j = out.len() - 1;
            while j > 0 {
                let parent = (j - 1) / 2;
                if out[parent].better(&out[j]) {
                    out.swap(parent, j);
                    j = parent;
                } else {
                    break;
                }
            }
        } else if c.better(&out[0]) {
            out[0] = c;
            // Sift down: move the worse child up while it is worse than the new element.
            let mut j = 0;
            loop {
                let (l, r) = (2 * j + 1, 2 * j + 2);
                let mut worst = j;
                if l < k && out[worst].better(&out[l]) {
                    worst = l;
                }
                if r < k && out[worst].better(&out[r]) {
                    worst = r;
                }
                if worst == j {
                    break;
                }
                out.swap(j, worst);
                j = worst;
            }
        }
    }
    sort_desc(out);
}

/// Reorders `c` so that its first `k` entries are the best candidates (by [`Candidate::better`]) whose weights
/// `p` first reach `target` when summed best first; returns that `k` (all of `c` if the total falls short).
/// Quickselect with a median-of-three pivot; `better` is a strict total order, so ties cannot degrade it.
fn weighted_select(c: &mut [Candidate], target: f64) -> usize {
    let (mut lo, mut hi) = (0, c.len());
    let mut acc = 0.0f64; // weight of c[..lo], all known to be in the set; always < target
    while lo < hi {
        let mid = lo + (hi - lo) / 2;
        let last = hi - 1;
        // Median of c[lo], c[mid], c[last] into c[last].
        if c[mid].better(&c[lo]) {
            c.swap(mid, lo);
        }
        if c[last].better(&c[lo]) {
            c.swap(last, lo);
        }
        if c[mid].better(&c[last]) {
            c.swap(mid, last);
        }
        let pivot = c[last];
        let mut store = lo;
        let mut mass = 0.0f64;
        for i in lo..last {
            if c[i].better(&pivot) {
                mass += c[i].p as f64;
                c.swap(i, store);
                store += 1;
            }
        }
        c.swap(store, last);
        if acc + mass >= target {
            hi = store;
        } else if acc + mass + pivot.p as f64 >= target {
            return store + 1;
        } else {
            acc += mass + pivot.p as f64;
            lo = store + 1;
        }
    }
    lo
}

/// Top-p over candidates already sorted best first; softmax over the candidates themselves, like llama.cpp.
fn top_p_sorted(c: &mut Vec<Candidate>, p: f32) {
    softmax(c);
    let mut cum = 0.0f64;
    for i in 0..c.len() {
        cum += c[i].p as f64;
        if cum >= p as f64 {
            c.truncate(i + 1);
            return;
        }
    }
}

fn sort_desc(c: &mut [Candidate]) {
    c.sort_unstable_by(|a, b| b.logit.total_cmp(&a.logit).then(a.id.cmp(&b.id)));
}

/// Writes softmax(logit) into `p`; all `-inf` gives all zeros.
fn softmax(c: &mut [Candidate]) {
    let max = c.iter().map(|x| x.logit).fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        c.iter_mut().for_each(|x| x.p = 0.0);
        return;
    }
    let mut sum = 0.0f64;
    for x in c.iter_mut() {
        x.p = (x.logit - max).exp();
        sum += x.p as f64;
    }
    for x in c.iter_mut() {
        x.p = (x.p as f64 / sum) as f32;
    }
}

/// The `k` most likely tokens under log-softmax(logits), most likely first (for logprob output and ensembles).
pub fn top_logprobs(logits: &[f32], k: usize) -> Vec<(u32, f32)> {
    let k = k.min(logits.len());
    if k == 0 {
        return Vec::new();
    }
    let max = logits
        .iter()
        .copied()
        .filter(|l| !l.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return Vec::new();
    }
    let sum: f64 = logits
        .iter()
        .filter(|l| !l.is_nan())
        .map(|&l| ((l - max) as f64).exp())
        .sum();
    let log_z = max as f64 + sum.ln();

    // Insertion into a short sorted list: O(n) for the small k this is used with, no n-sized allocation.
    let mut top: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    for (i, &l) in logits.iter().enumerate() {
        if l.is_nan() || (top.len() == k && l <= top[k - 1].1) {
            continue;
        }
        let pos = top.partition_point(|&(_, v)| v >= l);
        top.insert(pos, (i as u32, l));
        top.truncate(k);
    }
    top.into_iter().map(|(i, l)| (i, (l as f64 - log_z) as f32)).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temp: f32, top_k: usize, top_p: f32, min_p: f32, seed: u64) -> SamplerParams {
        SamplerParams {
            temp,
            top_k,
            top_p,
            min_p,
            seed: Some(seed),
            ..Default::default()
        }
    }

    /// Distinct, shuffled logits: a permutation of `0..n` (n a multiple of 1000; 7919 is prime) scaled to ±5.
    fn pseudo_logits(n: usize, salt: u32) -> Vec<f32> {
        let n32 = n as u32;
        (0..n32)
            .map(|i| ((i * 7919 + salt * 13) % n32) as f32 * 10.0 / n as f32 - 5.0)
            .collect()
    }

    #[test]
    fn defaults_are_llama_cpp_defaults() {
        let d = SamplerParams::default();
        assert_eq!((d.temp, d.top_k, d.top_p, d.min_p), (0.8, 40, 0.95, 0.05));
        assert_eq!((d.repeat_penalty, d.repeat_last_n, d.seed), (1.0, 64, None));
        assert_ne!(
            Sampler::new(d, 4).seed(),
            Sampler::new(d, 4).seed(),
            "unseeded samplers differ"
        );
    }

    #[test]
    fn greedy_is_argmax() {
        for salt in 0..20 {
            let logits = pseudo_logits(1000, salt);
            let best = (0..logits.len())
                .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
                .unwrap() as u32;
            let mut s = Sampler::new(
                SamplerParams {
                    temp: 0.0,
                    seed: Some(salt as u64),
                    ..Default::default()
                },
                1000,
            );
            assert_eq!(s.sample(&logits), best);
            let mut s = Sampler::new(
                SamplerParams {
                    temp: -1.0,
                    ..Default::default()
                },
                1000,
            );
            assert_eq!(s.sample(&logits), best);
            // top-k 1 at any temperature is greedy too.
            let mut s = Sampler::new(params(1.5, 1, 1.0, 0.0, salt as u64), 1000);
            for _ in 0..5 {
                assert_eq!(s.sample(&logits), best);
            }
        }
    }

    #[test]
    fn seeded_runs_are_reproducible() {
        let logits = pseudo_logits(500, 7);
        let run = |seed| {
            let mut s = Sampler::new(params(1.2, 0, 1.0, 0.0, seed), 500);
            (0..200).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        let distinct = {
            let mut v = run(42);
            v.sort_unstable();
            v.dedup();
            v.len()
        };
        assert!(
            distinct > 20,
            "a wide distribution should give many distinct tokens, got {distinct}"
        );
    }

    /// Draws many tokens and checks the frequencies against `expected` (probability per token id) with a chi-square
    /// statistic; tokens with expected probability 0 must never appear.
    fn check_distribution(p: SamplerParams, logits: &[f32], expected: &[f64]) {
        let n = 200_000;
        let mut s = Sampler::new(p, logits.len());
        let mut counts = vec![0u64; logits.len()];
        for _ in 0..n {
            counts[s.sample(logits) as usize] += 1;
        }
        let mut chi2 = 0.0;
        for (i, (&c, &e)) in counts.iter().zip(expected).enumerate() {
            if e == 0.0 {
                assert_eq!(c, 0, "token {i} should have been cut, drawn {c} times");
            } else {
                let want = e * n as f64;
                chi2 += (c as f64 - want).powi(2) / want;
            }
        }
        // At most 4 degrees of freedom here; 30 is far beyond the 0.9999 quantile (≈ 23.5 for df 4).
        assert!(chi2 < 30.0, "chi2 {chi2}: counts {counts:?}, expected {expected:?}");
    }

    const BASE: [f64; 7] = [0.4, 0.25, 0.15, 0.1, 0.06, 0.03, 0.01];

    fn base_logits() -> Vec<f32> {
        BASE.iter().map(|p| (p.ln() + 3.0) as f32).collect() // an offset must not matter
    }

    #[test]
    fn frequencies_follow_the_truncated_distribution() {
        let l = base_logits();
        // Untruncated.
        check_distribution(params(1.0, 0, 1.0, 0.0, 1), &l, &BASE);
        // top-k 5 → renormalise over 0.96; top-p 0.8 → 0.4167 + 0.2604 + 0.1563 reaches 0.8 at the third token.
        check_distribution(
            params(1.0, 5, 0.8, 0.0, 2),
            &l,
            &[0.5, 0.3125, 0.1875, 0.0, 0.0, 0.0, 0.0],
        );
        // Same truncation, temperature 0.5 squares the survivors' probabilities: top-p is decided before temperature.
        let sq = [0.16, 0.0625, 0.0225];
        let z: f64 = sq.iter().sum();
        check_distribution(
            params(0.5, 5, 0.8, 0.0, 3),
            &l,
            &[sq[0] / z, sq[1] / z, sq[2] / z, 0.0, 0.0, 0.0, 0.0],
        );
        // min-p 0.5 keeps p >= 0.2.
        check_distribution(
            params(1.0, 0, 1.0, 0.5, 4),
            &l,
            &[0.4 / 0.65, 0.25 / 0.65, 0.0, 0.0, 0.0, 0.0, 0.0],
        );
        // top-k 3 alone.
        check_distribution(
            params(1.0, 3, 1.0, 0.0, 5),
            &l,
            &[0.5, 0.3125, 0.1875, 0.0, 0.0, 0.0, 0.0],
        );
        // Temperature 2 without truncation: p^(1/2) renormalised.
        let sqrt: Vec<f64> = BASE.iter().map(|p| p.sqrt()).collect();
        let z: f64 = sqrt.iter().sum();
        check_distribution(
            params(2.0, 0, 1.0, 0.0, 6),
            &l,
            &sqrt.iter().map(|p| p / z).collect::<Vec<_>>(),
        );
    }

    #[test]
    fn top_p_over_the_whole_vocabulary() {
        let l = base_logits();
        // No top-k: 0.4 + 0.25 < 0.7 <= 0.4 + 0.25 + 0.15.
        let want = [0.5, 0.3125, 0.1875, 0.0, 0.0, 0.0, 0.0];
        check_distribution(params(1.0, 0, 0.7, 0.0, 7), &l, &want);
        // A flat distribution needs 500 of 1000 tokens (more than the first selection round); ties go to low ids.
        let flat = vec![0.5f32; 1000];
        let mut s = Sampler::new(params(1.0, 0, 0.4995, 0.0, 8), 1000);
        let mut seen = [false; 1000];
        for _ in 0..20_000 {
            seen[s.sample(&flat) as usize] = true;
        }
        assert!(seen[..500].iter().all(|&x| x), "every kept token is drawn");
        assert!(seen[500..].iter().all(|&x| !x), "no cut token is drawn");
    }

    #[test]
    fn weighted_selection_matches_a_sorted_prefix() {
        for salt in 0..10u32 {
            let v: Vec<f32> = (0..500u32)
                .map(|i| ((i * 7919 + salt * 31) % 60) as f32 / 10.0)
                .collect();
            let mut sorted = Vec::new();
            materialise(&v, &mut sorted);
            sort_desc(&mut sorted);
            let total: f64 = v.iter().map(|&l| (l as f64).exp()).sum();
            for frac in [0.0001, 0.1, 0.5, 0.9, 0.999, 1.0] {
                let target = frac * total;
                let mut cum = 0.0;
                let want_k = sorted
                    .iter()
                    .position(|c| {
                        cum += (c.logit as f64).exp();
                        cum >= target
                    })
                    .map_or(sorted.len(), |i| i + 1);
                let mut c: Vec<Candidate> = v
                    .iter()
                    .enumerate()
                    .map(|(i, &l)| Candidate {
                        id: i as u32,
                        logit: l,
                        p: (l as f64).exp() as f32,
                    })
                    .collect();
                let k = weighted_select(&mut c, target);
                // Summation order differs; allow the boundary to move by one in a near-tie.
                assert!(k.abs_diff(want_k) <= 1, "k {k} want {want_k} frac {frac} salt {salt}");
                let mut got: Vec<u32> = c[..k].iter().map(|c| c.id).collect();
                got.sort_unstable();
                let mut want: Vec<u32> = sorted[..k].iter().map(|c| c.id).collect();
                want.sort_unstable();
                assert_eq!(got, want, "frac {frac} salt {salt}");
            }
        }
    }

    #[test]
    fn heap_selection_matches_a_full_sort() {
        let mut out = Vec::with_capacity(300);
        for salt in 0..10u32 {
            // Many ties: values in 0..50 over 300 tokens.
            let v: Vec<f32> = (0..300u32).map(|i| ((i * 7919 + salt * 31) % 50) as f32).collect();
            let mut all = Vec::new();
            materialise(&v, &mut all);
            sort_desc(&mut all);
            for k in [1, 2, 7, 40, 299, 300] {
                select_top(&v, k, &mut out);
                let got: Vec<u32> = out.iter().map(|c| c.id).collect();
                let want: Vec<u32> = all[..k].iter().map(|c| c.id).collect();
                assert_eq!(got, want, "k {k} salt {salt}");
            }
        }
    }

    #[test]
    fn repetition_penalty_follows_llama_cpp() {
        let logits = [3.0, 2.9, -1.0, -1.1, 0.0];
        let p = SamplerParams {
            temp: 0.0,
            repeat_penalty: 1.5,
            repeat_last_n: 2,
            ..Default::default()
        };
        let mut s = Sampler::new(p, 5);
        assert_eq!(s.sample(&logits), 0);
        s.accept(0);
        s.accept(0); // counted once
        assert_eq!(s.sample(&logits), 1, "3.0 / 1.5 = 2.0 < 2.9");
        s.accept(1);
        assert_eq!(s.sample(&logits), 0, "3.0/1.5 = 2.0 > 2.9/1.5 = 1.93");
        s.accept(1);
        assert_eq!(s.sample(&logits), 0, "token 0 left the 2-token window");

        // Negative logits are multiplied: -1.0 * 1.5 = -1.5 < -1.1.
        let negative = [-1.0, -1.1];
        let mut s = Sampler::new(
            SamplerParams {
                temp: 0.0,
                repeat_penalty: 1.5,
                ..Default::default()
            },
            2,
        );
        assert_eq!(s.sample(&negative), 0);
        s.accept(0);
        assert_eq!(s.sample(&negative), 1);
        s.reset();
        assert_eq!(s.sample(&negative), 0);

        // Out-of-vocabulary history is ignored, not a panic; repeat_last_n 0 disables.
        s.accept(1_000_000);
        assert_eq!(s.sample(&negative), 0);
        let mut s = Sampler::new(
            SamplerParams {
                temp: 0.0,
                repeat_penalty: 2.0,
                repeat_last_n: 0,
                ..Default::default()
            },
            2,
        );
        s.accept(0);
        assert_eq!(s.sample(&negative), 0);
    }

    #[test]
    fn odd_inputs_do_not_panic() {
        let mut s = Sampler::new(
            SamplerParams {
                seed: Some(1),
                ..Default::default()
            },
            3,
        );
        assert_eq!(s.sample(&[]), 0);
        assert_eq!(s.sample(&[f32::NAN, 1.0, f32::NAN]), 1);
        let all_neg_inf = [f32::NEG_INFINITY; 3];
        assert!(s.sample(&all_neg_inf) < 3);
        assert!(s.sample(&[0.0, 1.0, 2.0, 3.0, 4.0]) < 5, "longer than n_vocab");
        assert!(s.sample(&[f32::INFINITY, 0.0, 0.0]) < 3);
    }

    #[test]
    fn top_logprobs_are_log_softmax() {
        let logits = [1.0f32, 3.0, 2.0, f32::NAN, -1.0];
        let top = top_logprobs(&logits, 3);
        let z: f64 = [1.0f64, 3.0, 2.0, -1.0].iter().map(|l| l.exp()).sum();
        let want = [(1u32, 3.0f64), (2, 2.0), (0, 1.0)];
        assert_eq!(top.len(), 3);
        for ((id, lp), (wid, wl)) in top.iter().zip(want) {
            assert_eq!(*id, wid);
            assert!((*lp as f64 - (wl - z.ln())).abs() < 1e-5, "{lp}");
        }
        assert_eq!(top_logprobs(&logits, 10).len(), 4, "NaN is never a candidate");
        assert!(top_logprobs(&logits, 0).is_empty());
        assert!(top_logprobs(&[], 3).is_empty());
        let total: f64 = top_logprobs(&logits, 5).iter().map(|&(_, lp)| (lp as f64).exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    /// Counts heap allocations made by the current thread only, so tests running in parallel don't interfere.
    mod counting {
        use std::alloc::{GlobalAlloc, Layout, System};
        use std::cell::Cell;

        thread_local! { pub static ALLOCS: Cell<u64> = const { Cell::new(0) }; }

        pub struct Counting;
        // SAFETY: forwards to the system allocator unchanged; the thread-local is const-initialised with no
        // destructor, so touching it never allocates or recurses.
        unsafe impl GlobalAlloc for Counting {
            unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
                let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
                unsafe { System.alloc(layout) }
            }
            unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
                unsafe { System.dealloc(ptr, layout) }
            }
            unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
                let _ = ALLOCS.try_with(|c| c.set(c.get() + 1));
                unsafe { System.realloc(ptr, layout, new_size) }
            }
        }

        #[global_allocator]
        static GLOBAL: Counting = Counting;
    }

    #[test]
    fn sampling_does_not_allocate() {
        let logits = pseudo_logits(50_000, 3);
        let mut s = Sampler::new(
            SamplerParams {
                repeat_penalty: 1.1,
                seed: Some(9),
                ..Default::default()
            },
            50_000,
        );
        let mut all = Sampler::new(params(1.0, 0, 0.9, 0.0, 9), 50_000);
        for t in 0..100 {
            s.accept(t);
        }
        let before = counting::ALLOCS.with(|c| c.get());
        for _ in 0..50 {
            let t = s.sample(&logits);
            s.accept(t);
            all.sample(&logits);
        }
        assert_eq!(counting::ALLOCS.with(|c| c.get()) - before, 0);
        // The counter does see allocations.
        let v = std::hint::black_box(vec![1u8; 16]);
        assert_eq!(counting::ALLOCS.with(|c| c.get()) - before, 1);
        drop(v);
    }

    /// Per-token cost on Gemma's vocabulary size: `cargo test --lib -- --ignored sampler_speed --nocapture`.
    #[test]
    #[ignore]
    fn sampler_speed() {
        let n = 262_000;
        let uniform = pseudo_logits(n, 5);
        // Zipf-like, as a language model's logits roughly are: logit = -1.2 ln(rank), ranks shuffled.
        let zipf: Vec<f32> = uniform
            .iter()
            .map(|&u| -1.2 * ((u + 5.0) / 10.0 * n as f32 + 1.0).ln())
            .collect();
        let default = SamplerParams {
            seed: Some(1),
            ..Default::default()
        };
        let top_p_only = params(0.8, 0, 0.95, 0.0, 1);
        for (name, logits, p) in [
            ("default chain, zipf", &zipf, default),
            ("default chain, uniform in +-5", &uniform, default),
            ("greedy", &zipf, SamplerParams::greedy()),
            ("top-p only, zipf", &zipf, top_p_only),
            ("top-p only, uniform in +-5 (worst case)", &uniform, top_p_only),
            ("no truncation, zipf", &zipf, params(0.8, 0, 1.0, 0.0, 1)),
        ] {
            let mut s = Sampler::new(p, n);
            // Thread CPU time, not wall time: the machine is shared, and waiting for a core is not our cost.
            let cpu = || {
                let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
                // SAFETY: clock_gettime only writes the timespec we own.
                unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
                ts.tv_sec as f64 + ts.tv_nsec as f64 * 1e-9
            };
            let (t, wall) = (cpu(), std::time::Instant::now());
            for _ in 0..20 {
                std::hint::black_box(s.sample(logits));
            }
            let ms = (cpu() - t) * 1e3 / 20.0;
            let wall_ms = wall.elapsed().as_secs_f64() * 1e3 / 20.0;
            eprintln!("{name}: {ms:.2} ms CPU ({wall_ms:.2} ms wall) per token, n_vocab {n}");
        }
    }

    #[test]
    fn probs_is_the_distribution_sample_draws_from() {
        let logits = pseudo_logits(1000, 3);
        for (temp, k, p, m) in [
            (0.8, 40, 0.95, 0.05),
            (1.5, 0, 0.9, 0.0),
            (1.0, 5, 1.0, 0.0),
            (0.0, 40, 0.95, 0.05),
        ] {
            let mut s = Sampler::new(params(temp, k, p, m, 11), 1000);
            let dist = s.probs(&logits);
            let total: f32 = dist.iter().map(|e| e.1).sum();
            assert!((total - 1.0).abs() < 1e-4, "sums to {total}");
            let n = 20000;
            let mut counts = std::collections::HashMap::new();
            for _ in 0..n {
                *counts.entry(s.sample(&logits)).or_insert(0usize) += 1;
            }
            assert!(
                counts.keys().all(|t| dist.iter().any(|e| e.0 == *t)),
                "drew outside the support"
            );
            for &(t, pr) in &dist {
                let f = *counts.get(&t).unwrap_or(&0) as f32 / n as f32;
                let sd = (pr * (1.0 - pr) / n as f32).sqrt();
                assert!((f - pr).abs() <= 5.0 * sd + 1e-3, "token {t}: p {pr}, frequency {f}");
            }
        }
    }

    #[test]
    fn out_of_range_settings_are_refused_by_name() {
        let ok = SamplerParams::default();
        assert!(ok.check(SamplerField::flag).is_ok());
        assert!(SamplerParams::greedy().check(SamplerField::flag).is_ok());
        let cases: [(SamplerParams, &str); 8] = [
            (
                SamplerParams { min_p: 1.5, ..ok },
                "--min-p must be between 0 and 1, got 1.5",
            ),
            (SamplerParams { min_p: f32::NAN, ..ok }, "--min-p"),
            (SamplerParams { min_p: -0.1, ..ok }, "--min-p"),
            (SamplerParams { top_p: 1.01, ..ok }, "--top-p"),
            (SamplerParams { top_p: f32::NAN, ..ok }, "--top-p"),
            (SamplerParams { temp: -1.0, ..ok }, "--temp"),
            (SamplerParams { temp: f32::NAN, ..ok }, "--temp"),
            (
                SamplerParams {
                    repeat_penalty: 0.0,
                    ..ok
                },
                "--repeat-penalty",
            ),
        ];
        for (p, want) in cases {
            let (f, e) = p.check(SamplerField::flag).unwrap_err();
            assert!(e.starts_with(want) && want.starts_with(f.flag()), "{e}");
            assert!(p.check(SamplerField::json).unwrap_err().1.starts_with(f.json()));
        }
    }
}
