//! Byte-level BPE merges for one pre-tokenized word, as llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! The word arrives already byte-encoded (each byte is one GPT-2 mapped char). Symbols start as single
//! chars; the adjacent pair with the lowest merge rank (ties: leftmost) is merged until no pair has a rank.
//! Hand-written rather than with the `tokenizers` crate: that crate works from tokenizer.json, not from
//! GGUF metadata, and it does not reproduce llama.cpp's fallbacks (unknown symbols become their single-byte
//! tokens, or vanish).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Merge ranks keyed by `"left right"` (the GGUF merge line with its first space from index 1 as the
/// separator). Symbols of a byte-encoded word never contain a raw space, so the key is unambiguous, which is
/// also what llama.cpp's `find_bpe_rank` asserts.
pub struct Merges {
    ranks: HashMap<String, u32, super::FastHash>,
}

impl Merges {
    pub fn new(lines: impl Iterator<Item = String>) -> Merges {
        let mut ranks = HashMap::with_hasher(super::FastHash);
        for (i, line) in lines.enumerate() {
            // llama.cpp splits at the first space at or after index 1, so "first second" is the line itself;
            // a line without such a space becomes the empty pair.
            let has_sep = line.as_bytes().iter().skip(1).any(|&b| b == b' ');
            let key = if has_sep { line } else { " ".to_string() };
            // `emplace` keeps the first rank when a pair repeats.
            ranks.entry(key).or_insert(i as u32);
        }
        Merges { ranks }
    }

    pub fn len(&self) -> usize {
        self.ranks.len()
    }

    fn rank(&self, buf: &mut String, left: &str, right: &str) -> Option<u32> {
        buf.clear();
        buf.push_str(left);
        buf.push(' ');
        buf.push_str(right);
        self.ranks.get(buf.as_str()).copied()
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Runs the merges on `word` and returns the byte ranges of the final symbols, in order.
pub fn merge_word(word: &str, merges: &Merges, out: &mut Vec<(usize, usize)>) {
    let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
    for (i, (start, c)) in word.char_indices().enumerate() {
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
    let text = |s: &Sym| &word[s.start..s.start + s.len];
    let mut buf = String::new();
    // (rank, left, right, size): the min-heap pops the lowest rank, then the leftmost pair.
    let mut heap: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
    let mut add_bigram = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
        let (Some(l), Some(r)) = (l, r) else { return };
        if let Some(rank) = merges.rank(&mut buf, text(&syms[l]), text(&syms[r])) {
            heap.push(Reverse((rank, l, r, syms[l].len + syms[r].len)));
        }
    };
    for i in 1..syms.len() {
        add_bigram(&mut heap, &syms, Some(i - 1), Some(i));
    }
    while let Some(Reverse((_, l, r, size))) = heap.pop() {
        // Outdated pair: one side was merged away or grew since (llama.cpp compares the texts; lengths only
        // ever grow, so equal total length means both sides are unchanged).
        if syms[l].len == 0 || syms[r].len == 0 || syms[l].len + syms[r].len != size {
            continue;
        }
        syms[l].len += syms[r].len;
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if let Some(n) = syms[r].next {
            syms[n].prev = Some(l);
        }
        let (prev, next) = (syms[l].prev, syms[l].next);
        add_bigram(&mut heap, &syms, prev, Some(l));
        add_bigram(&mut heap, &syms, Some(l), next);
    }
    out.extend(syms.iter().filter(|s| s.len > 0).map(|s| (s.start, s.start + s.len)));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(word: &str, merges: &[&str]) -> Vec<String> {
        let m = Merges::new(merges.iter().map(|s| s.to_string()));
        let mut out = Vec::new();
        merge_word(word, &m, &mut out);
        out.into_iter().map(|(a, b)| word[a..b].to_string()).collect()
    }

    #[test]
    fn merges_follow_rank_order() {
        // "a b" ranks before "b c", so "abc" -> "ab" + "c" even though "bc" exists.
        assert_eq!(run("abc", &["a b", "b c", "ab c"]), ["abc"]);
        assert_eq!(run("abc", &["a b", "b c"]), ["ab", "c"]);
        assert_eq!(run("abc", &["b c", "a b"]), ["a", "bc"]);
    }

    #[test]
    fn equal_ranks_merge_leftmost_first() {
        assert_eq!(run("aaa", &["a a"]), ["aa", "a"]);
        assert_eq!(run("aaaa", &["a a", "aa aa"]), ["aaaa"]);
        assert_eq!(run("aaaaa", &["a a", "aa aa"]), ["aaaa", "a"]);
    }

    #[test]
    fn multibyte_symbols_and_no_merges() {
        assert_eq!(run("ĠhÃ©", &["Ġ h", "Ã ©"]), ["Ġh", "Ã©"]);
        assert_eq!(run("xyz", &[]), ["x", "y", "z"]);
        assert_eq!(run("", &["a b"]), Vec::<String>::new());
    }

    #[test]
    fn merge_lines_split_at_first_space_after_index_one() {
        let m = Merges::new(["Ġ t", "Ġt he", "i n"].iter().map(|s| s.to_string()));
        assert_eq!(m.len(), 3);
        let mut buf = String::new();
        assert_eq!(m.rank(&mut buf, "Ġt", "he"), Some(1));
        assert_eq!(m.rank(&mut buf, "i", "n"), Some(2));
        assert_eq!(m.rank(&mut buf, "n", "i"), None);
    }
}
