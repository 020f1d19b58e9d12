//! SentencePiece-style tokenization as llama.cpp's `llm_tokenizer_spm_session` does it.
//!
//! The text (spaces already escaped to "▁") starts as one symbol per UTF-8 char. Every adjacent pair whose
//! concatenation is a vocabulary entry (of any token type) is queued with that entry's score; the best score
//! merges first (ties: leftmost). Final symbols that are not tokens (only single chars can be) fall back to
//! byte tokens `<0xAB>`. This is not SentencePiece's own unigram/BPE search, and the `tokenizers` crate does
//! not reproduce it, so it is written by hand.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

/// What the SPM merge loop needs from a vocabulary.
pub trait SpmVocab {
    fn lookup(&self, text: &str) -> Option<u32>;
    fn score(&self, id: u32) -> f32;
    /// The token for a raw byte (`<0xAB>`, else the one-byte text), if any.
    fn byte_token(&self, b: u8) -> Option<u32>;
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, o: &Self) -> bool {
        self.cmp(o) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, o: &Self) -> Option<Ordering> {
        Some(self.cmp(o))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the lower left index.
    fn cmp(&self, o: &Self) -> Ordering {
        self.score.total_cmp(&o.score).then_with(|| o.left.cmp(&self.left))
    }
}

/// Tokenizes one escaped text fragment, appending ids to `out`.
pub fn tokenize<V: SpmVocab>(text: &str, vocab: &V, out: &mut Vec<u32>) {
    let mut syms: Vec<Sym> = Vec::with_capacity(text.len());
    for (i, (start, c)) in text.char_indices().enumerate() {
        syms.push(Sym {
            start,
            len: c.len_utf8(),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            syms[i - 1].next = Some(i);
        }
    }
    if syms.is_empty() {
        return;
    }
    let mut heap = BinaryHeap::new();
    let try_add = |heap: &mut BinaryHeap<Bigram>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
        let (Some(l), Some(r)) = (l, r) else { return };
        // Left and right are adjacent in the text, so their concatenation is a slice of it.
        let size = syms[l].len + syms[r].len;
        let piece = &text[syms[l].start..syms[l].start + size];
        if let Some(id) = vocab.lookup(piece) {
            heap.push(Bigram {
                left: l,
                right: r,
                score: vocab.score(id),
                size,
            });
        }
    };
    for i in 1..syms.len() {
        try_add(&mut heap, &syms, Some(i - 1), Some(i));
    }
    while let Some(b) = heap.pop() {
        let (l, r) = (b.left, b.right);
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != b.size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if let Some(n) = syms[r].next {
            syms[n].prev = Some(l);
        }
        let (prev, next) = (syms[l].prev, syms[l].next);
        try_add(&mut heap, &syms, prev, Some(l));
        try_add(&mut heap, &syms, Some(l), next);
    }
    // Walk the chain from the first symbol (which is never merged away: merges go into the left side).
    let mut i = Some(0);
    while let Some(k) = i {
        let s = syms[k];
        let piece = &text[s.start..s.start + s.len];
        match vocab.lookup(piece) {
            Some(id) => out.push(id),
            // Merged symbols are always tokens, so only a single char can get here (llama.cpp's `rev_merge`
            // path can never apply to it): emit its bytes.
            None => out.extend(piece.bytes().filter_map(|b| vocab.byte_token(b))),
        }
        i = s.next;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    struct Tiny {
        ids: HashMap<String, u32>,
        scores: Vec<f32>,
    }

    impl Tiny {
        fn new(entries: &[(&str, f32)]) -> Tiny {
            let mut ids = HashMap::new();
            let mut scores = Vec::new();
            for b in 0..=255u8 {
                ids.insert(format!("<0x{b:02X}>"), scores.len() as u32);
                scores.push(0.0);
            }
            for (t, s) in entries {
                ids.insert(t.to_string(), scores.len() as u32);
                scores.push(*s);
            }
            Tiny { ids, scores }
        }
        fn pieces(&self, text: &str) -> Vec<String> {
            let mut out = Vec::new();
            tokenize(text, self, &mut out);
            let rev: HashMap<u32, &String> = self.ids.iter().map(|(k, v)| (*v, k)).collect();
            out.into_iter().map(|id| rev[&id].clone()).collect()
        }
    }

    impl SpmVocab for Tiny {
        fn lookup(&self, text: &str) -> Option<u32> {
            self.ids.get(text).copied()
        }
        fn score(&self, id: u32) -> f32 {
            self.scores[id as usize]
        }
        fn byte_token(&self, b: u8) -> Option<u32> {
            Some(b as u32)
        }
    }

    #[test]
    fn best_score_merges_first() {
        let v = Tiny::new(&[("a", -1.0), ("b", -1.0), ("c", -1.0), ("ab", -5.0), ("bc", -2.0)]);
        // "bc" scores higher than "ab"; afterwards "a"+"bc" is not a token, so the result is a, bc.
        assert_eq!(v.pieces("abc"), ["a", "bc"]);
        let v = Tiny::new(&[
            ("a", -1.0),
            ("b", -1.0),
            ("c", -1.0),
            ("ab", -2.0),
            ("bc", -5.0),
            ("abc", -9.0),
        ]);
        assert_eq!(v.pieces("abc"), ["abc"]);
    }

    #[test]
    fn ties_go_to_the_leftmost_pair() {
        let v = Tiny::new(&[("a", -1.0), ("aa", -2.0)]);
        assert_eq!(v.pieces("aaa"), ["aa", "a"]);
    }

    #[test]
    fn unknown_chars_fall_back_to_bytes() {
        let v = Tiny::new(&[("▁", -1.0), ("▁a", -1.5)]);
        assert_eq!(v.pieces("▁aé"), ["▁a", "<0xC3>", "<0xA9>"]);
    }
}
