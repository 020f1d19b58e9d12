//! Bits per byte of members and of their mixture on held-out text, and mixture weights fitted to minimise it.
//!
//! Bits per byte is the one measure comparable across tokenizers. A member's figure is the usual one: the sum of its
//! token log-probabilities over its own canonical tokenization, divided by the bytes. The ensemble's figure is a
//! mixture at *segment* granularity: the text is cut at every byte offset that is a token boundary for all members
//! (in practice before most spaces and punctuation), and each segment's probability is `sum_m w_m p_m(segment |
//! context)`, where `p_m` is the product of member m's token probabilities over the segment. That is a proper
//! probability of the text under a model that picks a member per segment, so it is comparable with the members'
//! figures; each member's own figure is what the mixture gives with all weight on it.
//!
//! Fitting (PackLLM's idea of weights chosen by perplexity, done here as an exact optimisation): with the members'
//! segment probabilities fixed, the weights that minimise the mixture's bits are found by expectation-maximisation,
//! which cannot do worse than the best single member on the fitting text.

use super::member::Member;
use anyhow::{Result, bail};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::collections::BTreeSet;

/// One document, scored by every member.
#[derive(Clone, Debug)]
pub struct DocScore {
    /// Bytes scored (the same for every member and the ensemble).
    pub bytes: usize,
    /// `segs[s][m]`: natural log-probability of segment `s` under member `m`.
    pub segs: Vec<Vec<f64>>,
    /// Byte offset where each segment ends.
    pub ends: Vec<usize>,
}

impl DocScore {
    /// Bits member `m` needs for the document.
    pub fn member_bits(&self, m: usize) -> f64 {
        -self.segs.iter().map(|s| s[m]).sum::<f64>() / std::f64::consts::LN_2
    }

    /// Bits the segment mixture with weights `w` (normalised) needs.
    pub fn mix_bits(&self, w: &[f64]) -> f64 {
        let total: f64 = w.iter().sum();
        let mut bits = 0.0;
        for s in &self.segs {
            bits -= log_mix(s, w, total) / std::f64::consts::LN_2;
        }
        bits
    }
}

/// ln sum_m (w_m / total) e^{lp_m}, stable.
fn log_mix(lp: &[f64], w: &[f64], total: f64) -> f64 {
    let max = lp
        .iter()
        .zip(w)
        .filter(|(_, w)| **w > 0.0)
        .map(|(l, _)| *l)
        .fold(f64::NEG_INFINITY, f64::max);
    if max == f64::NEG_INFINITY {
        return max;
    }
    let s: f64 = lp.iter().zip(w).map(|(l, w)| w / total * (l - max).exp()).sum();
    max + s.ln()
}

/// Splits a text into documents at blank lines; documents longer than `max_bytes` are cut at the last newline or
/// space before the limit.
pub fn split_docs(text: &str, max_bytes: usize) -> Vec<String> {
    let mut out = Vec::new();
    for para in text.split("\n\n") {
        let mut rest = para.trim();
        while !rest.is_empty() {
            if rest.len() <= max_bytes {
                out.push(rest.to_string());
                break;
            }
            let mut cut = max_bytes;
            while !rest.is_char_boundary(cut) {
                cut -= 1;
            }
            let at = if rest[cut..].starts_with(['\n', ' ']) {
                cut
            } else {
                rest[..cut].rfind(['\n', ' ']).filter(|&i| i > 0).unwrap_or(cut)
            };
            out.push(rest[..at].trim_end().to_string());
            rest = rest[at..].trim_start();
        }
    }
    out.retain(|d| !d.is_empty());
    out
}

/// Scores one document with every member (in parallel) and cuts it into common segments.
pub fn score_doc(members: &mut [Member], doc: &str) -> Result<DocScore> {
    struct Side {
        ends: Vec<usize>,
        lps: Vec<f32>,
    }
    let sides: Vec<Result<Side>> = std::thread::scope(|sc| {
        let hs: Vec<_> = members
            .iter_mut()
            .map(|m| {
                sc.spawn(move || -> Result<Side> {
                    let vocab = &m.text.vocab;
                    let ids = vocab.tokenize(doc, true, false);
                    let mut ends = Vec::with_capacity(ids.len());
                    let mut at = 0;
                    for &t in &ids {
                        at += vocab.token_bytes_visible(t).len();
                        ends.push(at);
                    }
                    if at != doc.len() {
                        bail!(
                            "member {}: its tokens spell {at} bytes of a {}-byte document",
                            m.name(),
                            doc.len()
                        );
                    }
                    if ids.len() > m.n_ctx() {
                        bail!(
                            "member {}: a document of {} tokens exceeds its context of {}",
                            m.name(),
                            ids.len(),
                            m.n_ctx()
                        );
                    }
                    let lps = m.score_tokens(&ids)?;
                    Ok(Side { ends, lps })
                })
            })
            .collect();
        hs.into_iter()
            .map(|h| {
                h.join()
                    .unwrap_or_else(|_| Err(anyhow::anyhow!("scoring thread panicked")))
            })
            .collect()
    });
    let sides: Vec<Side> = sides.into_iter().collect::<Result<_>>()?;
    // Token 0 has no context unless it is BOS (no bytes): scoring starts after it.
    let start = sides.iter().map(|s| s.ends[0]).max().unwrap_or(0);
    let mut common: BTreeSet<usize> = sides[0].ends.iter().copied().collect();
    for s in &sides[1..] {
        let e: BTreeSet<usize> = s.ends.iter().copied().collect();
        common = common.intersection(&e).copied().collect();
    }
    let Some(&s0) = common.range(start..).next() else {
        return Ok(DocScore {
            bytes: 0,
            segs: Vec::new(),
            ends: Vec::new(),
        });
    };
    let bounds: Vec<usize> = common.range(s0 + 1..).copied().collect();
    let mut segs = vec![vec![0.0f64; sides.len()]; bounds.len()];
    for (m, side) in sides.iter().enumerate() {
        let mut seg = 0;
        for (i, &end) in side.ends.iter().enumerate().skip(1) {
            if end <= s0 {
                continue;
            }
            while bounds[seg] < end {
                seg += 1;
            }
            segs[seg][m] += side.lps[i - 1] as f64;
        }
    }
    Ok(DocScore {
        bytes: doc.len() - s0,
        segs,
        ends: bounds,
    })
}

/// Weights minimising the mixture's bits over `docs` (expectation-maximisation on the segment mixture).
pub fn fit_weights(docs: &[DocScore], n_members: usize) -> Vec<f64> {
    let mut w = vec![1.0 / n_members as f64; n_members];
    let n_segs: usize = docs.iter().map(|d| d.segs.len()).sum();
    if n_segs == 0 {
        return w;
    }
    for _ in 0..5000 {
        let mut acc = vec![0.0f64; n_members];
        for s in docs.iter().flat_map(|d| &d.segs) {
            let lm = log_mix(s, &w, 1.0);
            for m in 0..n_members {
                if w[m] > 0.0 {
                    acc[m] += (w[m].ln() + s[m] - lm).exp();
                }
            }
        }
        let new: Vec<f64> = acc.iter().map(|a| a / n_segs as f64).collect();
        let delta = new.iter().zip(&w).map(|(a, b)| (a - b).abs()).fold(0.0, f64::max);
        w = new;
        if delta < 1e-9 {
            break;
        }
    }
    w
}

/// Bits per byte of every member and of the mixture, with a paired bootstrap of (mixture - best member).
#[derive(Clone, Debug)]
pub struct Report {
    pub bytes: usize,
    pub docs: usize,
    pub member_bpb: Vec<f64>,
    pub ensemble_bpb: f64,
    /// Index of the member with the lowest bits per byte.
    pub best: usize,
    /// 95% interval of (ensemble - best member) bits per byte, resampling documents.
    pub ci: (f64, f64),
    /// Documents where the ensemble needs fewer bits than the best member.
    pub wins: usize,
}

pub fn report(docs: &[DocScore], w: &[f64], seed: u64) -> Report {
    let n_members = w.len();
    let bytes: usize = docs.iter().map(|d| d.bytes).sum();
    let per_doc: Vec<(Vec<f64>, f64, f64)> = docs
        .iter()
        .map(|d| {
            (
                (0..n_members).map(|m| d.member_bits(m)).collect(),
                d.mix_bits(w),
                d.bytes as f64,
            )
        })
        .collect();
    let member_bpb: Vec<f64> = (0..n_members)
        .map(|m| per_doc.iter().map(|p| p.0[m]).sum::<f64>() / bytes.max(1) as f64)
        .collect();
    let ensemble_bpb = per_doc.iter().map(|p| p.1).sum::<f64>() / bytes.max(1) as f64;
    let best = (0..n_members)
        .min_by(|&a, &b| member_bpb[a].total_cmp(&member_bpb[b]))
        .unwrap_or(0);
    let wins = per_doc.iter().filter(|p| p.2 > 0.0 && p.1 < p.0[best]).count();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut diffs = Vec::with_capacity(2000);
    if !per_doc.is_empty() {
        for _ in 0..2000 {
            let (mut e, mut b, mut n) = (0.0, 0.0, 0.0);
            for _ in 0..per_doc.len() {
                let p = &per_doc[rng.gen_range(0..per_doc.len())];
                e += p.1;
                b += p.0[best];
                n += p.2;
            }
            if n > 0.0 {
                diffs.push((e - b) / n);
            }
        }
    }
    diffs.sort_by(f64::total_cmp);
    let q = |f: f64| {
        diffs
            .get(((diffs.len() as f64 * f) as usize).min(diffs.len().saturating_sub(1)))
            .copied()
    };
    Report {
        bytes,
        docs: docs.len(),
        member_bpb,
        ensemble_bpb,
        best,
        ci: (q(0.025).unwrap_or(f64::NAN), q(0.975).unwrap_or(f64::NAN)),
        wins,
    }
}

/// A cloze item: a context and its possible endings, the first one right.
#[derive(Clone, Debug)]
pub struct ClozeItem {
    pub context: String,
    pub endings: Vec<String>,
}

/// Tab-separated lines `context<TAB>right<TAB>wrong...`; `#` starts a comment line.
pub fn parse_cloze(text: &str) -> Result<Vec<ClozeItem>> {
    let mut items = Vec::new();
    for (i, line) in text.lines().enumerate() {
        if line.trim().is_empty() || line.starts_with('#') {
            continue;
        }
        let mut f = line.split('\t');
        let context = f.next().unwrap_or("").to_string();
        let endings: Vec<String> = f.map(str::to_string).collect();
        if context.is_empty() || endings.len() < 2 {
            bail!(
                "cloze line {}: needs a context and at least two endings, tab-separated",
                i + 1
            );
        }
        items.push(ClozeItem { context, endings });
    }
    Ok(items)
}

/// Items answered right by each member and by the mixture (highest log-likelihood of the ending after the context).
#[derive(Clone, Debug)]
pub struct ClozeReport {
    pub items: usize,
    pub member_right: Vec<usize>,
    pub ensemble_right: usize,
}

/// One ending's log-likelihood under each member, and under the mixture.
type EndingScore = (Vec<f64>, f64);

pub fn cloze(members: &mut [Member], items: &[ClozeItem], w: &[f64]) -> Result<ClozeReport> {
    let total: f64 = w.iter().sum();
    let mut member_right = vec![0; members.len()];
    let mut ensemble_right = 0;
    for item in items {
        // Log-likelihood of each ending: the segments that end after the context.
        let mut scores: Vec<EndingScore> = Vec::new();
        for ending in &item.endings {
            let doc = format!("{}{}", item.context, ending);
            let d = score_doc(members, &doc)?;
            let mut per = vec![0.0; members.len()];
            let mut mix = 0.0;
            for (seg, &end) in d.segs.iter().zip(&d.ends) {
                if end > item.context.len() {
                    for (p, l) in per.iter_mut().zip(seg) {
                        *p += l;
                    }
                    mix += log_mix(seg, w, total);
                }
            }
            scores.push((per, mix));
        }
        let best = |f: &dyn Fn(&EndingScore) -> f64| {
            (0..scores.len()).fold(0, |b, i| if f(&scores[i]) > f(&scores[b]) { i } else { b })
        };
        for (m, right) in member_right.iter_mut().enumerate() {
            if best(&|s| s.0[m]) == 0 {
                *right += 1;
            }
        }
        if best(&|s| s.1) == 0 {
            ensemble_right += 1;
        }
    }
    Ok(ClozeReport {
        items: items.len(),
        member_right,
        ensemble_right,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn doc(segs: Vec<Vec<f64>>, bytes: usize) -> DocScore {
        DocScore {
            bytes,
            ends: (1..=segs.len()).collect(),
            segs,
        }
    }

    #[test]
    fn parse_cloze_lines() {
        let items = parse_cloze("# comment\nThe sky is\t blue\t green\n\n").unwrap();
        assert_eq!(items.len(), 1);
        assert_eq!(items[0].context, "The sky is");
        assert_eq!(items[0].endings, vec![" blue", " green"]);
        assert!(parse_cloze("no endings here").is_err());
        assert!(parse_cloze("one\tending").is_err());
    }

    #[test]
    fn split_docs_at_blank_lines_and_length() {
        let d = split_docs("a b c\n\n\n\nd e f g h i\n\n", 5);
        assert_eq!(d, vec!["a b c", "d e f", "g h i"]);
        assert!(split_docs("\n\n \n", 10).is_empty());
    }

    #[test]
    fn mixture_bits_lie_between_and_can_beat_both() {
        // Member 0 is good on the first segment, member 1 on the second.
        let l = |p: f64| p.ln();
        let d = doc(vec![vec![l(0.9), l(0.1)], vec![l(0.1), l(0.9)]], 4);
        let b0 = d.member_bits(0);
        let b1 = d.member_bits(1);
        let mix = d.mix_bits(&[0.5, 0.5]);
        assert!((b0 - b1).abs() < 1e-9);
        assert!(mix < b0, "mixture {mix} vs member {b0}");
        // All weight on one member gives that member.
        assert!((d.mix_bits(&[1.0, 0.0]) - b0).abs() < 1e-9);
    }

    #[test]
    fn fitted_weights_minimise_bits() {
        let l = |p: f64| p.ln();
        // Member 1 is better almost everywhere: the fit leans to it and beats the equal mixture.
        let docs = vec![doc(
            vec![
                vec![l(0.2), l(0.8)],
                vec![l(0.3), l(0.7)],
                vec![l(0.6), l(0.5)],
                vec![l(0.1), l(0.9)],
            ],
            8,
        )];
        let w = fit_weights(&docs, 2);
        assert!(w[1] > 0.8, "weights {w:?}");
        assert!((w.iter().sum::<f64>() - 1.0).abs() < 1e-9);
        let fitted = docs[0].mix_bits(&w);
        for alt in [[0.5, 0.5], [0.0, 1.0], [0.3, 0.7], [0.05, 0.95]] {
            // EM approaches an optimum on the boundary slowly: within a thousandth of a bit.
            assert!(fitted <= docs[0].mix_bits(&alt) + 1e-3, "{alt:?}");
        }
        let r = report(&docs, &w, 1);
        assert_eq!(r.best, 1);
        assert!(r.ensemble_bpb <= r.member_bpb[1] + 1e-3);
    }
}
