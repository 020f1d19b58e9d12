//! Byte-level BPE merges for one pre-tokenized word, as llama.cpp's `llm_tokenizer_bpe_session`.
//!
//! The word arrives already byte-encoded (each byte is one GPT-2 mapped char). Symbols start as single
//! chars; the adjacent pair with the lowest merge rank (ties: leftmost) is merged until no pair has a rank.
//! Hand-written rather than with the `tokenizers` crate: that crate works from tokenizer.json, not from
//! GGUF metadata, and it does not reproduce llama.cpp's fallbacks (unknown symbols become their single-byte
//! tokens, or vanish).

use std::cmp::Reverse;
use std::collections::{BinaryHeap, HashMap};

/// Merge ranks. llama.cpp keys them by `"left right"` (the GGUF merge line, split at its first space from index 1);
/// symbols of a byte-encoded word never contain a raw space, so a lookup key names its two sides unambiguously.
/// Where both sides are vocabulary tokens (every merge of the usual vocabularies) the rank is keyed by the two
/// token ids instead, grouped by left id like a sparse matrix in CSR form: 8 bytes a merge plus 4 a token
/// (SmolLM2: 0.57 MiB, against 0.83 for a hash map of id pairs and several MiB for one of strings), and a lookup
/// is a binary search among the few merges of one left token. Since token texts and ids map one to one, a pair of
/// ids finds a rank exactly when its texts' line does.
pub struct Merges {
    /// The merges with left token `l` are `by_left[first[l]..first[l + 1]]`, as (right token, rank) sorted by
    /// right token.
    first: Vec<u32>,
    by_left: Vec<(u32, u32)>,
    /// Lines with a side that is not a token, or without a separator (llama.cpp's empty pair, `" "`), keyed by
    /// the line as llama.cpp does.
    lines: HashMap<String, u32, super::FastHash>,
}

impl Merges {
    /// `id` gives the token id of an exact vocabulary text.
    pub fn new<'a>(lines: impl Iterator<Item = &'a str>, id: impl Fn(&str) -> Option<u32>) -> Merges {
        let mut m = Merges {
            first: Vec::new(),
            by_left: Vec::new(),
            lines: HashMap::with_hasher(super::FastHash),
        };
        let lines = lines.enumerate();
        let mut pairs: Vec<(u32, u32, u32)> = Vec::with_capacity(lines.size_hint().0);
        for (i, line) in lines {
            let rank = i as u32;
            // llama.cpp splits at the first space at or after index 1, so "first second" is the line itself;
            // a line without such a space becomes the empty pair. `emplace` keeps the first rank of a repeat.
            let Some(sp) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                m.lines.entry(" ".to_string()).or_insert(rank);
                continue;
            };
            match (id(&line[..sp]), id(&line[sp + 1..])) {
                (Some(l), Some(r)) => pairs.push((l, r, rank)),
                _ => {
                    m.lines.entry(line.to_string()).or_insert(rank);
                }
            }
        }
        // Sorted by (left, right, rank), a repeated pair keeps its first (lowest) rank.
        pairs.sort_unstable();
        pairs.dedup_by_key(|p| (p.0, p.1));
        let n_left = pairs.last().map_or(0, |p| p.0 as usize + 1);
        m.first = Vec::with_capacity(n_left + 1);
        m.by_left = Vec::with_capacity(pairs.len());
        for (i, &(l, r, rank)) in pairs.iter().enumerate() {
            while m.first.len() <= l as usize {
                m.first.push(i as u32);
            }
            m.by_left.push((r, rank));
        }
        m.first.push(pairs.len() as u32);
        m
    }

    pub fn len(&self) -> usize {
        self.by_left.len() + self.lines.len()
    }

    /// The rank of merging `left` and `right` (with their token ids, where they are tokens).
    fn rank(&self, buf: &mut String, left: (&str, Option<u32>), right: (&str, Option<u32>)) -> Option<u32> {
        if let (Some(l), Some(r)) = (left.1, right.1) {
            let (a, b) = (*self.first.get(l as usize)?, *self.first.get(l as usize + 1)?);
            let row = &self.by_left[a as usize..b as usize];
            return row.binary_search_by_key(&r, |e| e.0).ok().map(|k| row[k].1);
        }
        if self.lines.is_empty() {
            return None;
        }
        buf.clear();
        buf.push_str(left.0);
        buf.push(' ');
        buf.push_str(right.0);
        self.lines.get(buf.as_str()).copied()
    }
}

#[derive(Clone, Copy)]
struct Sym {
    start: usize,
    len: usize,
    /// The token whose text the symbol is, if any.
    id: Option<u32>,
    prev: Option<usize>,
    next: Option<usize>,
}

/// Runs the merges on `word` and appends the byte ranges of the final symbols, in order, each with its token id
/// (`id` gives the id of an exact vocabulary text; `None` where the symbol is not a token).
pub fn merge_word(
    word: &str,
    merges: &Merges,
    id: impl Fn(&str) -> Option<u32>,
    out: &mut Vec<(usize, usize, Option<u32>)>,
) {
    let mut syms: Vec<Sym> = Vec::with_capacity(word.len());
    for (i, (start, c)) in word.char_indices().enumerate() {
        let len = c.len_utf8();
        syms.push(Sym {
            start,
            len,
            id: id(&word[start..start + len]),
            prev: i.checked_sub(1),
            next: None,
        });
        if i > 0 {
            syms[i - 1].next = Some(i);
        }
    }
    let side = |s: &Sym| (&word[s.start..s.start + s.len], s.id);
    let mut buf = String::new();
    // (rank, left, right, size): the min-heap pops the lowest rank, then the leftmost pair.
    let mut heap: BinaryHeap<Reverse<(u32, usize, usize, usize)>> = BinaryHeap::new();
    let mut add_bigram = |heap: &mut BinaryHeap<_>, syms: &[Sym], l: Option<usize>, r: Option<usize>| {
        let (Some(l), Some(r)) = (l, r) else { return };
        if let Some(rank) = merges.rank(&mut buf, side(&syms[l]), side(&syms[r])) {
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
        syms[l].id = id(&word[syms[l].start..syms[l].start + syms[l].len]);
        syms[r].len = 0;
        syms[l].next = syms[r].next;
        if let Some(n) = syms[r].next {
            syms[n].prev = Some(l);
        }
        let (prev, next) = (syms[l].prev, syms[l].next);
        add_bigram(&mut heap, &syms, prev, Some(l));
        add_bigram(&mut heap, &syms, Some(l), next);
    }
    out.extend(
        syms.iter()
            .filter(|s| s.len > 0)
            .map(|s| (s.start, s.start + s.len, s.id)),
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Merges `word` with `merges`; `tokens` are the vocabulary texts (ids by position), so the merges whose sides
    /// are both tokens are keyed by ids and the others by their line.
    fn run_with(word: &str, merges: &[&str], tokens: &[&str]) -> Vec<String> {
        let id = |s: &str| tokens.iter().position(|t| *t == s).map(|i| i as u32);
        let m = Merges::new(merges.iter().copied(), id);
        let mut out = Vec::new();
        merge_word(word, &m, id, &mut out);
        for &(a, b, tok) in &out {
            assert_eq!(tok, id(&word[a..b]));
        }
        out.into_iter().map(|(a, b, _)| word[a..b].to_string()).collect()
    }

    /// Runs `word` twice: with no vocabulary (every merge keyed by its line) and with every merge's sides and
    /// result as tokens (every merge keyed by ids); both must give the same symbols.
    fn run(word: &str, merges: &[&str]) -> Vec<String> {
        let by_line = run_with(word, merges, &[]);
        let mut tokens: Vec<String> = word.chars().map(String::from).collect();
        for m in merges {
            if let Some((l, r)) = m.split_once(' ') {
                tokens.extend([l.to_string(), r.to_string(), format!("{l}{r}")]);
            }
        }
        tokens.sort();
        tokens.dedup();
        let tokens: Vec<&str> = tokens.iter().map(String::as_str).collect();
        assert_eq!(run_with(word, merges, &tokens), by_line, "{word:?} {merges:?}");
        by_line
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
    fn merges_with_a_side_outside_the_vocabulary() {
        // "b c" has both sides as tokens (keyed by ids), "a bc" does not ("bc" is no token): merging "bc" gives a
        // symbol without an id, whose pairs are looked up by their line.
        assert_eq!(run_with("abc", &["b c", "a bc"], &["a", "b", "c"]), ["abc"]);
        assert_eq!(
            run_with("abcd", &["b c", "bc d", "a bcd"], &["a", "b", "c", "d", "bcd"]),
            ["abcd"]
        );
        // Repeated pairs keep their first rank, whichever way they are keyed.
        assert_eq!(run_with("abc", &["b c", "a b", "b c"], &["a", "b", "c"]), ["a", "bc"]);
    }

    #[test]
    fn merge_lines_split_at_first_space_after_index_one() {
        let tokens = ["Ġ", "t", "Ġt", "he", "i", "n"];
        let id = |s: &str| tokens.iter().position(|t| *t == s).map(|i| i as u32);
        let m = Merges::new(["Ġ t", "Ġt he", "i n", "nospace", "Ġt he"].into_iter(), id);
        // "nospace" is llama.cpp's empty pair; the repeated "Ġt he" is one key.
        assert_eq!(m.len(), 4);
        let mut buf = String::new();
        let side = |s: &'static str| (s, id(s));
        assert_eq!(m.rank(&mut buf, side("Ġt"), side("he")), Some(1));
        assert_eq!(m.rank(&mut buf, side("i"), side("n")), Some(2));
        assert_eq!(m.rank(&mut buf, side("n"), side("i")), None);
        let m = Merges::new(["Ġ t", "Ġt he", "i n"].into_iter(), |_| None);
        assert_eq!(m.len(), 3);
        assert_eq!(m.rank(&mut buf, ("Ġt", None), ("he", None)), Some(1));
        assert_eq!(m.rank(&mut buf, ("n", None), ("i", None)), None);
    }
}
