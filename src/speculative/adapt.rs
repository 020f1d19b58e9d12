//! Choosing the draft length: a cost model fed by measurements, so speculation is used only where it pays.
//!
//! Per round with `k` draft tokens the coordinator pays `k · t_draft` (a draft forward, plus the round trip when the
//! draft is remote) and one target verify of `k + 1` positions, `t_verify(k) ≈ t_1 + k · δ`. Drafted tokens are
//! accepted one after another with probability `α` each, so a round emits `E(k) = (1 - α^(k+1)) / (1 - α)` tokens
//! (the accepted ones plus the target's own). The chosen `k` maximises `E(k) / (k · t_draft + t_verify(k))`; `k = 0`
//! is the target alone (`1 / t_1`). When off, a 2-token probe round runs after [`PROBE_EVERY`] tokens (the interval
//! doubling while the probes keep failing) so a change in acceptance (a new topic, a faster link) is noticed.
//!
//! `t_1` anchors every estimate, so it is measured with care: `auto` runs its first two steps plain and keeps the
//! faster (the very first decode step after a prefill runs on cold caches), and while speculating it runs one plain
//! step every [`REMEASURE_EVERY`] rounds. Without that, an inflated first `t_1` made every verify look cheap
//! (`δ = (t_verify - t_1) / m` came out near zero) and `auto` kept drafting at 0.63× the target's speed.

/// Tokens generated with speculation off before the first probe round; the interval doubles while probes keep
/// finding that the draft does not pay, up to [`PROBE_MAX`].
pub const PROBE_EVERY: usize = 32;
pub const PROBE_MAX: usize = 512;
/// While speculating, one plain target step per this many rounds keeps `t_1` current.
pub const REMEASURE_EVERY: usize = 8;
/// The predicted gain drafting must show before `auto` drafts: the estimates are noisy, and near break-even a
/// wrong "on" (a draft and a wider verify every round) costs more than a wrong "off" (one plain step).
pub const MIN_GAIN: f64 = 1.1;
/// Weight of a new measurement in the running averages.
const EMA: f64 = 0.25;

#[derive(Clone, Debug)]
pub struct Adapt {
    /// `None`: choose; `Some(k)`: always `k`.
    pub fixed: Option<usize>,
    pub k_max: usize,
    /// Accepted and tried draft positions (a rejection counts as a try), with decay.
    accepted: f64,
    tried: f64,
    /// Seconds per draft token (EMA), target seconds for one position (EMA), extra target seconds per verified
    /// position (EMA).
    t_draft: Option<f64>,
    t_one: Option<f64>,
    t_extra: Option<f64>,
    /// Target candidates per draft token (1 for one vocabulary; differs across vocabularies).
    ratio: f64,
    /// Tokens emitted so far (all requests), when speculation last went off, the current probe interval.
    tokens_done: usize,
    off_since: Option<usize>,
    probe_every: usize,
    /// Plain steps measured so far, and speculative rounds since the last one.
    plain_steps: usize,
    since_plain: usize,
}

impl Adapt {
    pub fn new(fixed: Option<usize>, k_max: usize) -> Adapt {
        Adapt {
            fixed,
            k_max: k_max.max(1),
            // A mild prior: 2 of 3 accepted.
            accepted: 2.0,
            tried: 3.0,
            t_draft: None,
            t_one: None,
            t_extra: None,
            ratio: 1.0,
            tokens_done: 0,
            off_since: None,
            probe_every: PROBE_EVERY,
            plain_steps: 0,
            since_plain: 0,
        }
    }

    /// Per-token acceptance estimate.
    pub fn alpha(&self) -> f64 {
        (self.accepted / self.tried).clamp(0.0, 0.99)
    }

    /// Estimated target-alone speed (tokens/s), once measured.
    pub fn target_alone_tps(&self) -> Option<f64> {
        self.t_one.map(|t| 1.0 / t)
    }

    /// Expected tokens per second with `k` draft tokens (`None` before the costs are measured).
    pub fn rate(&self, k: usize) -> Option<f64> {
        let t1 = self.t_one?;
        if k == 0 {
            return Some(1.0 / t1);
        }
        let td = self.t_draft?;
        let extra = self.t_extra.unwrap_or(0.1 * t1);
        let m = (k as f64 * self.ratio).max(1.0);
        let a = self.alpha();
        let e = (1.0 - a.powf(m + 1.0)) / (1.0 - a);
        Some(e / (k as f64 * td + t1 + m * extra))
    }

    /// Draft tokens for the next round.
    pub fn next_k(&mut self) -> usize {
        match self.fixed {
            // The first decode step runs alone: it measures the target's single-position cost.
            _ if self.t_one.is_none() => 0,
            Some(k) => k,
            // A second plain step: the first one ran on cold caches.
            None if self.plain_steps < 2 => 0,
            // Then a short first try measures the draft.
            None if self.t_draft.is_none() => self.k_max.min(2),
            None => {
                let best = (1..=self.k_max)
                    .max_by(|&a, &b| self.rate(a).unwrap_or(0.0).total_cmp(&self.rate(b).unwrap_or(0.0)))
                    .unwrap_or(0);
                let pays = self.rate(best).unwrap_or(0.0) > MIN_GAIN * self.rate(0).unwrap_or(f64::INFINITY);
                if pays {
                    self.off_since = None;
                    self.probe_every = PROBE_EVERY;
                    if self.since_plain >= REMEASURE_EVERY {
                        return 0;
                    }
                    return best;
                }
                let since = *self.off_since.get_or_insert(self.tokens_done);
                if self.tokens_done >= since + self.probe_every {
                    // Probe: a short round refreshes α and the draft's cost.
                    self.off_since = Some(self.tokens_done);
                    self.probe_every = (self.probe_every * 2).min(PROBE_MAX);
                    2.min(self.k_max)
                } else {
                    0
                }
            }
        }
    }

    /// Records a round: `k` draft tokens (0: target alone) took `draft_s` seconds, the target verified `m`
    /// candidates (+1 position) in `verify_s` seconds and accepted `accepted` of them.
    pub fn record(&mut self, k: usize, m: usize, accepted: usize, draft_s: f64, verify_s: f64) {
        self.tokens_done += accepted + 1;
        let ema = |old: Option<f64>, new: f64| Some(old.map_or(new, |o| o + EMA * (new - o)));
        if m == 0 {
            self.plain_steps += 1;
            self.since_plain = 0;
            self.t_one = match self.t_one {
                // The second plain step replaces a slower (cold) first one.
                Some(t) if self.plain_steps == 2 => Some(t.min(verify_s)),
                old => ema(old, verify_s),
            };
        } else {
            self.since_plain += 1;
            if let Some(t1) = self.t_one {
                self.t_extra = ema(self.t_extra, ((verify_s - t1) / m as f64).max(0.0));
            }
        }
        if k > 0 {
            self.t_draft = ema(self.t_draft, draft_s / k as f64);
            self.ratio += EMA * (m as f64 / k as f64 - self.ratio);
            // Trials until the first rejection; decay keeps the estimate current.
            let tries = if accepted < m { accepted + 1 } else { accepted };
            self.accepted = 0.97 * self.accepted + accepted as f64;
            self.tried = 0.97 * self.tried + tries as f64;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(a: &mut Adapt, alpha: f64, t_draft: f64, t1: f64, extra: f64, rounds: usize) -> Vec<usize> {
        let mut ks = Vec::new();
        let mut seed = 1u64;
        for _ in 0..rounds {
            let k = a.next_k();
            ks.push(k);
            let mut acc = 0;
            while acc < k {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if ((seed >> 33) as f64 / (1u64 << 31) as f64) < alpha {
                    acc += 1;
                } else {
                    break;
                }
            }
            a.record(k, k, acc, k as f64 * t_draft, t1 + k as f64 * extra);
        }
        ks
    }

    #[test]
    fn a_cheap_good_draft_is_used_long() {
        let mut a = Adapt::new(None, 8);
        let ks = run(&mut a, 0.9, 0.002, 0.02, 0.001, 60);
        assert_eq!(ks[0], 0, "first step measures the target");
        let tail = &ks[40..];
        // Drafting rounds are long; the zeros are the periodic plain steps that re-measure `t_1`.
        assert!(tail.iter().all(|&k| k >= 4 || k == 0), "{ks:?}");
        assert!(
            tail.iter().filter(|&&k| k == 0).count() <= tail.len() / REMEASURE_EVERY + 1,
            "{ks:?}"
        );
        assert!(a.rate(*tail.last().unwrap()).unwrap() > 2.0 * a.rate(0).unwrap());
    }

    #[test]
    fn a_useless_or_slow_draft_is_turned_off_and_probed() {
        // A random draft: nothing is accepted.
        let mut a = Adapt::new(None, 8);
        let ks = run(&mut a, 0.0, 0.002, 0.02, 0.001, 200);
        let off = ks[20..].iter().filter(|&&k| k == 0).count();
        assert!(off as f64 > 0.9 * 180.0, "{ks:?}");
        assert!(ks[20..].iter().any(|&k| k > 0), "probes continue: {ks:?}");
        // A draft as slow as the target, even with good acceptance.
        let mut a = Adapt::new(None, 8);
        let ks = run(&mut a, 0.7, 0.02, 0.02, 0.002, 200);
        let off = ks[20..].iter().filter(|&&k| k == 0).count();
        assert!(off as f64 > 0.8 * 180.0, "{ks:?}");
    }

    /// The case `auto` used to misjudge (a Q4_1 draft for a Q8_0 target of the same network): verifying is nearly
    /// linear in positions and the first plain step ran 3× slow. Drafting loses here; `auto` must settle at off.
    #[test]
    fn a_slow_first_step_does_not_make_a_losing_draft_look_good() {
        let mut a = Adapt::new(None, 8);
        let (t1, td, extra) = (0.105, 0.05, 0.09);
        let mut ks = Vec::new();
        let mut seed = 7u64;
        for round in 0..300 {
            let k = a.next_k();
            ks.push(k);
            let mut acc = 0;
            while acc < k {
                seed = seed.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                if ((seed >> 33) as f64 / (1u64 << 31) as f64) < 0.825 {
                    acc += 1;
                } else {
                    break;
                }
            }
            let cold = if round == 0 { 3.0 } else { 1.0 };
            a.record(k, k, acc, k as f64 * td, cold * t1 + k as f64 * extra);
        }
        let on = ks[40..].iter().filter(|&&k| k > 0).count();
        assert!(on < 30, "{on} of 260 rounds drafted: {ks:?}");
        assert!(a.rate(0).unwrap() >= a.rate(4).unwrap());
    }

    /// A draft that would gain only a few percent on paper (the cross-vocabulary Gemma 3 case: SmolLM2 at about half
    /// the target's step time, 75% acceptance, an expensive verify per position) stays off.
    #[test]
    fn a_break_even_draft_stays_off() {
        let mut a = Adapt::new(None, 8);
        let (alpha, td, t1, extra) = (0.75f64, 0.0045, 0.0114, 0.0025);
        let gain = |k: i32| (1.0 - alpha.powi(k + 1)) / (1.0 - alpha) / (k as f64 * (td + extra) + t1) * t1;
        let best = (1..=8).map(gain).fold(0.0, f64::max);
        assert!(best > 1.0 && best < 1.1, "the case is break-even: {best}");
        let ks = run(&mut a, alpha, td, t1, extra, 200);
        let on = ks[20..].iter().filter(|&&k| k > 0).count();
        assert!(on < 20, "{on} of 180 rounds drafted: {ks:?}");
    }

    #[test]
    fn speculating_re_measures_the_plain_step() {
        let mut a = Adapt::new(None, 8);
        let ks = run(&mut a, 0.9, 0.002, 0.02, 0.001, 100);
        let plain = ks[20..].iter().filter(|&&k| k == 0).count();
        assert!(
            (80 / (REMEASURE_EVERY + 1)..=80 / REMEASURE_EVERY + 1).contains(&plain),
            "{ks:?}"
        );
    }

    #[test]
    fn fixed_is_fixed() {
        let mut a = Adapt::new(Some(3), 8);
        let ks = run(&mut a, 0.0, 1.0, 0.01, 0.0, 10);
        assert!(ks[0] == 0 && ks[1..].iter().all(|&k| k == 3), "{ks:?}");
    }
}
