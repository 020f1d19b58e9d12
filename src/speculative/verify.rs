//! The acceptance rules. Both are lossless: the emitted tokens are distributed exactly as if the target had sampled
//! them one by one; the draft only decides how many positions the target scores in one forward pass.
//!
//! - [`speculative_sample`] (same vocabulary): the standard rule of Leviathan et al. / Chen et al. A drafted token
//!   `x ~ q` is accepted with probability `min(1, p(x)/q(x))`; on rejection the emitted token is drawn from
//!   `norm(max(0, p - q))`. For any `q` that `x` was really drawn from, the emitted token is distributed as `p`:
//!   P(emit y) = min(p(y), q(y)) + (1 - Σ min(p, q)) · max(0, p(y) - q(y)) / Σ max(0, p - q) = p(y), because
//!   Σ max(0, p - q) = 1 - Σ min(p, q). `p` and `q` are the distributions after the sampler chain (penalty, top-k,
//!   top-p, min-p, temperature), so the output follows the target's chain, not its raw softmax. Greedy is the
//!   special case of point masses: accept while the target's argmax equals the drafted token.
//! - [`exact_match`] (any vocabulary): at each verified position the target draws its own token with its own
//!   sampler and the candidate is accepted only if it is that token. Every emitted token is the target's own draw,
//!   in order, from the same RNG stream, so the output is not only distributed like the target's: with the same
//!   seed it is the same text the target alone would write.

use rand::Rng;

/// A sparse distribution: (token, probability) pairs with probability > 0.
pub type Dist = Vec<(u32, f32)>;

pub fn prob_of(d: &[(u32, f32)], t: u32) -> f32 {
    d.iter().find(|e| e.0 == t).map_or(0.0, |e| e.1)
}

/// What one verification decided: how many candidates were accepted and the token the target emits after them
/// (the correction at the first rejection, or the bonus token when every candidate was accepted).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Verdict {
    pub accepted: usize,
    pub next: u32,
}

/// Draws from a sparse distribution (the last entry if rounding leaves `u` at the top).
pub fn draw(d: &[(u32, f32)], rng: &mut impl Rng) -> u32 {
    let total: f64 = d.iter().map(|e| e.1 as f64).sum();
    let u = rng.r#gen::<f64>() * total;
    let mut cum = 0.0;
    for &(t, p) in d {
        cum += p as f64;
        if u < cum {
            return t;
        }
    }
    d.last().map_or(0, |e| e.0)
}

/// One step of the standard rule at one position: `Ok(())` accepts `x`, `Err(y)` rejects it and emits `y`.
pub fn accept_or_resample(p: &[(u32, f32)], q: &[(u32, f32)], x: u32, rng: &mut impl Rng) -> Result<(), u32> {
    let (px, qx) = (prob_of(p, x), prob_of(q, x));
    // qx > 0 always holds for a token drawn from q; a zero means the caller broke the contract, reject it then.
    if qx > 0.0 && (px >= qx || rng.r#gen::<f32>() < px / qx) {
        return Ok(());
    }
    // q sorted by token for the lookups (a full-vocabulary q has ~10^5 entries).
    let mut qs = q.to_vec();
    qs.sort_unstable_by_key(|e| e.0);
    let q_of = |t: u32| qs.binary_search_by_key(&t, |e| e.0).map_or(0.0, |i| qs[i].1);
    let residual: Dist = p
        .iter()
        .map(|&(t, pt)| (t, pt - q_of(t)))
        .filter(|e| e.1 > 0.0)
        .collect();
    // An empty residual happens only when p == q up to rounding, where rejection has probability ~0: draw from p.
    Err(if residual.is_empty() {
        draw(p, rng)
    } else {
        draw(&residual, rng)
    })
}

/// The standard rule over a drafted run: `draft[i]` was drawn from `q[i]`; `p(i)` is the target's distribution at
/// position `i` (after `draft[..i]`), called lazily and in order so the caller can advance its sampler state;
/// `p(draft.len())` gives the bonus distribution.
pub fn speculative_sample(draft: &[u32], q: &[Dist], mut p: impl FnMut(usize) -> Dist, rng: &mut impl Rng) -> Verdict {
    for (i, &x) in draft.iter().enumerate() {
        if let Err(y) = accept_or_resample(&p(i), &q[i], x, rng) {
            return Verdict { accepted: i, next: y };
        }
    }
    let bonus = p(draft.len());
    Verdict {
        accepted: draft.len(),
        next: draw(&bonus, rng),
    }
}

/// Exact-match verification: `sample(i)` is the target's own draw at position `i` (after `cands[..i]`).
pub fn exact_match(cands: &[u32], mut sample: impl FnMut(usize) -> u32) -> Verdict {
    for (i, &c) in cands.iter().enumerate() {
        let t = sample(i);
        if t != c {
            return Verdict { accepted: i, next: t };
        }
    }
    Verdict {
        accepted: cands.len(),
        next: sample(cands.len()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;
    use rand::rngs::StdRng;

    /// Pearson's chi-square of `counts` against `probs` (categories with expected count >= 5).
    pub fn chi_square(counts: &[usize], probs: &[f64]) -> (f64, usize) {
        let n: usize = counts.iter().sum();
        let (mut x2, mut dof) = (0.0, 0);
        for (c, p) in counts.iter().zip(probs) {
            let e = p * n as f64;
            if e >= 5.0 {
                x2 += (*c as f64 - e).powi(2) / e;
                dof += 1;
            }
        }
        (x2, dof.max(1) - 1)
    }

    fn dist(v: &[f32]) -> Dist {
        let s: f32 = v.iter().sum();
        v.iter()
            .enumerate()
            .filter(|e| *e.1 > 0.0)
            .map(|(i, &x)| (i as u32, x / s))
            .collect()
    }

    #[test]
    fn greedy_point_masses_accept_while_argmax_matches() {
        let mut rng = StdRng::seed_from_u64(0);
        let q = vec![vec![(5, 1.0)], vec![(6, 1.0)], vec![(7, 1.0)]];
        let targets = [5u32, 6, 9, 1];
        let v = speculative_sample(&[5, 6, 7], &q, |i| vec![(targets[i], 1.0)], &mut rng);
        assert_eq!(v, Verdict { accepted: 2, next: 9 });
        let targets = [5u32, 6, 7, 1];
        let v = speculative_sample(&[5, 6, 7], &q, |i| vec![(targets[i], 1.0)], &mut rng);
        assert_eq!(v, Verdict { accepted: 3, next: 1 });
    }

    /// Two positions, a draft whose q differs a lot from p: the emitted pair must follow p's joint law.
    #[test]
    fn speculative_sampling_keeps_the_target_distribution() {
        let p1 = dist(&[0.5, 0.3, 0.15, 0.05]);
        let q1 = dist(&[0.1, 0.2, 0.3, 0.4]);
        // Second position depends on the first token.
        let p2 = |a: u32| {
            dist(
                &[
                    [0.7, 0.1, 0.1, 0.1],
                    [0.1, 0.7, 0.1, 0.1],
                    [0.25; 4],
                    [0.1, 0.1, 0.1, 0.7],
                ][a as usize],
            )
        };
        let q2 = dist(&[0.4, 0.4, 0.1, 0.1]);
        let mut rng = StdRng::seed_from_u64(42);
        let n = 40000;
        let mut counts = vec![0usize; 16];
        let mut bad = vec![0usize; 16];
        for _ in 0..n {
            let x1 = draw(&q1, &mut rng);
            let x2 = draw(&q2, &mut rng);
            let v = speculative_sample(
                &[x1, x2],
                &[q1.clone(), q2.clone()],
                |i| if i == 0 { p1.clone() } else { p2(x1) },
                &mut rng,
            );
            let (a, b) = match v.accepted {
                0 => (v.next, draw(&p2(v.next), &mut rng)),
                _ => (x1, if v.accepted == 1 { v.next } else { x2 }),
            };
            counts[(a * 4 + b) as usize] += 1;
            // A negative control: always accepting the draft gives q's law.
            bad[(x1 * 4 + x2) as usize] += 1;
        }
        let probs: Vec<f64> = (0..16)
            .map(|c| (prob_of(&p1, c / 4) * prob_of(&p2(c / 4), c % 4)) as f64)
            .collect();
        let (x2, dof) = chi_square(&counts, &probs);
        // 15 degrees of freedom: the 0.999 quantile is 37.7.
        assert!(x2 < 37.7, "chi-square {x2} with {dof} dof");
        let (x2_bad, _) = chi_square(&bad, &probs);
        assert!(x2_bad > 1000.0, "the test must be able to fail: {x2_bad}");
    }

    #[test]
    fn exact_match_emits_the_targets_own_draws() {
        let draws = [3u32, 4, 8, 2];
        let v = exact_match(&[3, 4, 5], |i| draws[i]);
        assert_eq!(v, Verdict { accepted: 2, next: 8 });
        let v = exact_match(&[3, 4, 8], |i| draws[i]);
        assert_eq!(v, Verdict { accepted: 3, next: 2 });
        let v = exact_match(&[], |i| draws[i]);
        assert_eq!(v, Verdict { accepted: 0, next: 3 });
    }
}
