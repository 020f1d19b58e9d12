//! The per-step combination rules, on plain data (no model, no socket), so they are tested directly.
//!
//! Every member describes its next-token distribution as a [`View`]: its top-k tokens as byte strings with
//! log-probabilities, and a way to score any other byte string (exactly when the member's full distribution is at
//! hand, bounded by its k-th probability when only its top-k crossed the wire). A combination rule turns the views
//! into one [`Choice`]: the bytes to commit to the shared text (or the end of generation).

use anyhow::{Result, bail};
use rand::Rng;
use rand::rngs::StdRng;

/// How the members' next-token distributions are combined.
#[derive(Clone, Debug, PartialEq)]
pub enum Combine {
    /// UniTE-style: the union of the members' top-k candidates, each scored by every member, renormalised per member
    /// over the union, mixed with the weights, then argmax or sampled.
    Union,
    /// Each member proposes its own next token; the highest log-probability per byte wins.
    Confident,
    /// Union with explicit weights, one per member (normalised).
    Mix(Vec<f64>),
}

impl Combine {
    /// Parses `union`, `confident` or `mix:W1,W2,...`.
    pub fn parse(s: &str) -> Result<Combine> {
        match s.trim() {
            "union" => Ok(Combine::Union),
            "confident" => Ok(Combine::Confident),
            m => {
                let Some(ws) = m.strip_prefix("mix:") else {
                    bail!("unknown --combine {s:?} (use union, confident or mix:W1,W2,...)");
                };
                let mut w = Vec::new();
                for p in ws.split(',') {
                    let v: f64 = p
                        .trim()
                        .parse()
                        .map_err(|_| anyhow::anyhow!("bad weight {p:?} in --combine {s:?}"))?;
                    if !v.is_finite() || v < 0.0 {
                        bail!("weight {v} in --combine {s:?} must be a non-negative number");
                    }
                    w.push(v);
                }
                if w.iter().sum::<f64>() <= 0.0 {
                    bail!("the weights in --combine {s:?} sum to zero");
                }
                Ok(Combine::Mix(w))
            }
        }
    }

    pub fn name(&self) -> String {
        match self {
            Combine::Union => "union".into(),
            Combine::Confident => "confident".into(),
            Combine::Mix(w) => format!(
                "mix:{}",
                w.iter().map(|v| format!("{v:.3}")).collect::<Vec<_>>().join(",")
            ),
        }
    }
}

/// A candidate continuation: some bytes of text, or the end of generation.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Key {
    Text(Vec<u8>),
    End,
}

impl Key {
    /// Bytes the candidate adds to the text; the end counts as one so per-byte scores stay finite.
    pub fn n_bytes(&self) -> usize {
        match self {
            Key::Text(b) => b.len().max(1),
            Key::End => 1,
        }
    }
}

/// One member's next-token distribution as the combination rules see it.
pub trait View {
    /// The member's top candidates, best first, merged by key (log-probabilities of the same text added).
    fn top(&self) -> &[(Key, f32)];
    /// The member's log-probability for `key`; the flag is false when it is only an upper bound (the member's k-th
    /// log-probability, for a key outside the top-k of a remote member).
    fn score(&self, key: &Key) -> (f32, bool);
}

/// What one step decided.
#[derive(Clone, Debug)]
pub struct Choice {
    pub key: Key,
    /// Log-probability of the choice under the combined distribution (confident: the winner's own).
    pub logprob: f32,
    /// Index of the member whose candidate won (the first member that proposed it).
    pub from: usize,
    /// The combined distribution's best entries, best first.
    pub top: Vec<(Key, f32)>,
    /// Scores that were bounds rather than exact values.
    pub bounded: usize,
}

/// Sampling settings of the combined distribution.
#[derive(Clone, Copy, Debug)]
pub struct Pick {
    /// 0 = argmax.
    pub temp: f32,
    pub top_p: f32,
    pub min_p: f32,
}

/// Normalised weights of the live members (`alive[i]` false: weight 0).
pub fn live_weights(weights: &[f64], alive: &[bool]) -> Vec<f64> {
    let w: Vec<f64> = weights
        .iter()
        .zip(alive)
        .map(|(&w, &a)| if a { w } else { 0.0 })
        .collect();
    let s: f64 = w.iter().sum();
    if s > 0.0 {
        w.iter().map(|v| v / s).collect()
    } else {
        let n = alive.iter().filter(|&&a| a).count().max(1) as f64;
        alive.iter().map(|&a| if a { 1.0 / n } else { 0.0 }).collect()
    }
}

/// UniTE-style union: candidates = union of every live member's top-k; each member scores every candidate, its
/// scores are renormalised over the union, and the weighted sum is the combined distribution.
pub fn union(views: &[Option<&dyn View>], weights: &[f64], pick: Pick, rng: &mut StdRng) -> Result<Choice> {
    let mut keys: Vec<(Key, usize)> = Vec::new();
    for (m, v) in views.iter().enumerate() {
        let Some(v) = v else { continue };
        for (k, _) in v.top() {
            if !keys.iter().any(|(x, _)| x == k) {
                keys.push((k.clone(), m));
            }
        }
    }
    if keys.is_empty() {
        bail!("no member proposed a candidate");
    }
    let mut mix = vec![0.0f64; keys.len()];
    let mut bounded = 0;
    for (m, v) in views.iter().enumerate() {
        let Some(v) = v else { continue };
        let scores: Vec<f64> = keys
            .iter()
            .map(|(k, _)| {
                let (lp, exact) = v.score(k);
                if !exact {
                    bounded += 1;
                }
                (lp as f64).exp()
            })
            .collect();
        let total: f64 = scores.iter().sum();
        if total <= 0.0 || !total.is_finite() {
            continue;
        }
        for (x, s) in mix.iter_mut().zip(&scores) {
            *x += weights[m] * s / total;
        }
    }
    let total: f64 = mix.iter().sum();
    if total <= 0.0 || !total.is_finite() {
        bail!("the members gave no probability to any candidate");
    }
    for x in &mut mix {
        *x /= total;
    }
    let i = pick_index(&mix, pick, rng);
    let mut order: Vec<usize> = (0..keys.len()).collect();
    order.sort_by(|&a, &b| mix[b].total_cmp(&mix[a]));
    Ok(Choice {
        key: keys[i].0.clone(),
        logprob: mix[i].ln() as f32,
        from: keys[i].1,
        top: order.iter().map(|&j| (keys[j].0.clone(), mix[j].ln() as f32)).collect(),
        bounded,
    })
}

/// Most confident wins: each live member proposes its own next token (argmax, or sampled from its top-k); the
/// proposal with the highest weighted log-probability per byte is taken.
pub fn confident(views: &[Option<&dyn View>], weights: &[f64], pick: Pick, rng: &mut StdRng) -> Result<Choice> {
    let n_live = views.iter().filter(|v| v.is_some()).count().max(1) as f64;
    let mut best: Option<(f64, Key, f32, usize)> = None;
    let mut props = Vec::new();
    for (m, v) in views.iter().enumerate() {
        let Some(v) = v else { continue };
        let top = v.top();
        if top.is_empty() {
            continue;
        }
        let probs: Vec<f64> = top.iter().map(|(_, lp)| (*lp as f64).exp()).collect();
        let i = pick_index(&probs, pick, rng);
        let (key, lp) = (&top[i].0, top[i].1);
        // Equal weights add nothing; unequal ones shift a member's per-byte score by ln(w * n).
        let score = lp as f64 / key.n_bytes() as f64 + (weights[m] * n_live).max(1e-30).ln();
        props.push((key.clone(), score as f32));
        if best.as_ref().is_none_or(|b| score > b.0) {
            best = Some((score, key.clone(), lp, m));
        }
    }
    let Some((_, key, logprob, from)) = best else {
        bail!("no member proposed a candidate");
    };
    props.sort_by(|a, b| b.1.total_cmp(&a.1));
    Ok(Choice {
        key,
        logprob,
        from,
        top: props,
        bounded: 0,
    })
}

/// Index into `probs` (not necessarily normalised): argmax (first maximum) when `temp` is 0, otherwise a draw from
/// `probs^(1/temp)` cut by min-p and top-p.
fn pick_index(probs: &[f64], pick: Pick, rng: &mut StdRng) -> usize {
    let argmax = probs
        .iter()
        .enumerate()
        .fold(0, |b, (i, &p)| if p > probs[b] { i } else { b });
    if pick.temp <= 0.0 || probs.len() == 1 {
        return argmax;
    }
    let pmax = probs[argmax];
    if pmax <= 0.0 {
        return argmax;
    }
    let mut cand: Vec<(usize, f64)> = probs
        .iter()
        .enumerate()
        .filter(|(_, p)| **p >= pick.min_p as f64 * pmax && **p > 0.0)
        .map(|(i, &p)| (i, (p / pmax).powf(1.0 / pick.temp as f64)))
        .collect();
    cand.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = cand.iter().map(|c| c.1).sum();
    if pick.top_p < 1.0 {
        let mut acc = 0.0;
        for k in 0..cand.len() {
            acc += cand[k].1 / total;
            if acc >= pick.top_p as f64 {
                cand.truncate(k + 1);
                break;
            }
        }
    }
    let kept: f64 = cand.iter().map(|c| c.1).sum();
    let mut r = rng.r#gen::<f64>() * kept;
    for &(i, w) in &cand {
        if r < w {
            return i;
        }
        r -= w;
    }
    cand.last().map_or(argmax, |c| c.0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    /// A view with an explicit table; keys outside it get `floor` (inexact).
    struct Table {
        top: Vec<(Key, f32)>,
        extra: Vec<(Key, f32)>,
        floor: f32,
    }

    impl View for Table {
        fn top(&self) -> &[(Key, f32)] {
            &self.top
        }
        fn score(&self, key: &Key) -> (f32, bool) {
            self.top
                .iter()
                .chain(&self.extra)
                .find(|(k, _)| k == key)
                .map_or((self.floor, false), |(_, lp)| (*lp, true))
        }
    }

    fn t(s: &str) -> Key {
        Key::Text(s.as_bytes().to_vec())
    }

    const GREEDY: Pick = Pick {
        temp: 0.0,
        top_p: 1.0,
        min_p: 0.0,
    };

    #[test]
    fn parse_combine() {
        assert_eq!(Combine::parse("union").unwrap(), Combine::Union);
        assert_eq!(Combine::parse("confident").unwrap(), Combine::Confident);
        assert_eq!(Combine::parse("mix:0.6,0.4").unwrap(), Combine::Mix(vec![0.6, 0.4]));
        assert!(Combine::parse("mix:").is_err());
        assert!(Combine::parse("mix:-1,2").is_err());
        assert!(Combine::parse("mix:0,0").is_err());
        assert!(Combine::parse("average").is_err());
    }

    #[test]
    fn union_of_identical_members_is_the_member() {
        let v = Table {
            top: vec![(t(" Paris"), -0.3), (t(" the"), -1.5), (t(" a"), -2.0)],
            extra: vec![],
            floor: -2.0,
        };
        let views: Vec<Option<&dyn View>> = vec![Some(&v), Some(&v)];
        let mut rng = StdRng::seed_from_u64(1);
        let c = union(&views, &[0.5, 0.5], GREEDY, &mut rng).unwrap();
        assert_eq!(c.key, t(" Paris"));
        assert_eq!(c.bounded, 0);
        // Renormalised over the union: p = e^-0.3 / (e^-0.3 + e^-1.5 + e^-2).
        let z = (-0.3f64).exp() + (-1.5f64).exp() + (-2.0f64).exp();
        assert!((c.logprob as f64 - ((-0.3f64).exp() / z).ln()).abs() < 1e-5);
    }

    #[test]
    fn union_lets_a_confident_member_outvote() {
        // A is unsure between two, B is sure of the second one (and scores A's first one low).
        let a = Table {
            top: vec![(t(" cat"), -0.6), (t(" dog"), -0.8)],
            extra: vec![],
            floor: -5.0,
        };
        let b = Table {
            top: vec![(t(" dog"), -0.05)],
            extra: vec![(t(" cat"), -4.0)],
            floor: -6.0,
        };
        let views: Vec<Option<&dyn View>> = vec![Some(&a), Some(&b)];
        let mut rng = StdRng::seed_from_u64(1);
        let c = union(&views, &[0.5, 0.5], GREEDY, &mut rng).unwrap();
        assert_eq!(c.key, t(" dog"));
        assert_eq!(c.from, 0, "A proposed it first");
        // With all weight on A, A's choice stands.
        let c = union(&views, &[1.0, 0.0], GREEDY, &mut rng).unwrap();
        assert_eq!(c.key, t(" cat"));
        // A dead member (None) is left out entirely.
        let views: Vec<Option<&dyn View>> = vec![Some(&a), None];
        let c = union(&views, &live_weights(&[0.5, 0.5], &[true, false]), GREEDY, &mut rng).unwrap();
        assert_eq!(c.key, t(" cat"));
    }

    #[test]
    fn confident_compares_per_byte() {
        // One short sure token against one long, less sure token: per byte the long one wins.
        let a = Table {
            top: vec![(t(","), -0.2)],
            extra: vec![],
            floor: -9.0,
        };
        let b = Table {
            top: vec![(t(" Parisian"), -0.9)],
            extra: vec![],
            floor: -9.0,
        };
        let views: Vec<Option<&dyn View>> = vec![Some(&a), Some(&b)];
        let mut rng = StdRng::seed_from_u64(1);
        let c = confident(&views, &[0.5, 0.5], GREEDY, &mut rng).unwrap();
        assert_eq!(c.key, t(" Parisian"));
        assert_eq!(c.from, 1);
        assert!((c.logprob - -0.9).abs() < 1e-6);
    }

    #[test]
    fn sampling_follows_the_mixture() {
        let a = Table {
            top: vec![(t("x"), (0.75f32).ln()), (t("y"), (0.25f32).ln())],
            extra: vec![],
            floor: -20.0,
        };
        let views: Vec<Option<&dyn View>> = vec![Some(&a)];
        let mut rng = StdRng::seed_from_u64(7);
        let pick = Pick {
            temp: 1.0,
            top_p: 1.0,
            min_p: 0.0,
        };
        let n = 4000;
        let xs = (0..n)
            .filter(|_| union(&views, &[1.0], pick, &mut rng).unwrap().key == t("x"))
            .count();
        let f = xs as f64 / n as f64;
        assert!((f - 0.75).abs() < 0.03, "frequency {f}");
    }
}
