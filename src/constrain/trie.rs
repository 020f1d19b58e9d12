//! The vocabulary as a byte trie, and the per-step mask: one walk of the trie with a matcher per depth, so a
//! subtree the matcher rejects is skipped whole and the cost follows the live part of the trie, not |V| × length.

use super::matcher::Matcher;
use super::schema::Grammar;

/// One trie node in preorder: its byte, depth (1 for a first byte), the index after its subtree, the tokens whose
/// bytes end here (`toks[tok_lo..tok_hi]`) and in its whole subtree (`toks[tok_lo..sub_hi]`), and whether every
/// byte in the subtree is a plain string character ([`plain`]).
#[derive(Clone, Copy, Debug)]
struct TrieNode {
    byte: u8,
    depth: u16,
    end: u32,
    tok_lo: u32,
    tok_hi: u32,
    sub_hi: u32,
    plain: bool,
}

/// A byte a string without a length bound or pattern always takes as one character: printable ASCII but `"` and
/// `\`. A subtree of only such bytes is taken whole inside such a string, without walking it.
fn plain(b: u8) -> bool {
    (0x20..0x7F).contains(&b) && b != b'"' && b != b'\\'
}

/// The text tokens of a vocabulary (control tokens and empty pieces left out) and its end-of-generation ids.
#[derive(Debug)]
pub struct TokenTrie {
    nodes: Vec<TrieNode>,
    toks: Vec<u32>,
    eog: Vec<u32>,
    max_depth: usize,
}

impl TokenTrie {
    /// `tokens`: each text token's id and bytes; `eog`: the ids that end generation.
    pub fn new<'a>(tokens: impl Iterator<Item = (u32, &'a [u8])>, eog: &[u32]) -> TokenTrie {
        let mut list: Vec<(&[u8], u32)> = tokens.filter(|(_, b)| !b.is_empty()).map(|(i, b)| (b, i)).collect();
        list.sort_unstable();
        let mut nodes: Vec<TrieNode> = Vec::new();
        let mut toks = Vec::with_capacity(list.len());
        // The open path: node indices for each depth of the previous token's bytes.
        let mut path: Vec<usize> = Vec::new();
        let mut prev: &[u8] = &[];
        let mut max_depth = 0;
        for (bytes, id) in list {
            let common = prev.iter().zip(bytes).take_while(|(a, b)| a == b).count();
            while path.len() > common {
                let i = path.pop().unwrap();
                nodes[i].end = nodes.len() as u32;
            }
            for (d, &b) in bytes.iter().enumerate().skip(common) {
                path.push(nodes.len());
                nodes.push(TrieNode {
                    byte: b,
                    depth: (d + 1) as u16,
                    end: 0,
                    tok_lo: toks.len() as u32,
                    tok_hi: toks.len() as u32,
                    sub_hi: 0,
                    plain: false,
                });
            }
            let last = *path.last().unwrap();
            toks.push(id);
            nodes[last].tok_hi = toks.len() as u32;
            max_depth = max_depth.max(bytes.len());
            prev = bytes;
        }
        for i in path {
            nodes[i].end = nodes.len() as u32;
        }
        // Children come after their parent: fill the subtree facts from the last node back.
        for i in (0..nodes.len()).rev() {
            let (mut sub_hi, mut all_plain) = (nodes[i].tok_hi, plain(nodes[i].byte));
            let mut c = i + 1;
            while c < nodes[i].end as usize {
                sub_hi = sub_hi.max(nodes[c].sub_hi);
                all_plain &= nodes[c].plain;
                c = nodes[c].end as usize;
            }
            nodes[i].sub_hi = sub_hi;
            nodes[i].plain = all_plain;
        }
        let mut eog = eog.to_vec();
        eog.sort_unstable();
        TokenTrie {
            nodes,
            toks,
            eog,
            max_depth,
        }
    }

    pub fn n_nodes(&self) -> usize {
        self.nodes.len()
    }

    /// The tokens `m` can take next, into `out` (cleared first): text tokens whose every byte the matcher accepts,
    /// and the end-of-generation ids when the value is complete. `levels` is scratch reused between steps.
    pub fn allowed(&self, g: &Grammar, m: &Matcher, levels: &mut Vec<Matcher>, out: &mut Vec<u32>) {
        out.clear();
        if levels.len() < self.max_depth + 1 {
            levels.resize_with(self.max_depth + 1, Matcher::default);
        }
        levels[0].copy_from(m);
        let mut i = 0;
        while i < self.nodes.len() {
            let n = self.nodes[i];
            let d = n.depth as usize;
            // Inside a free string every token of a plain subtree is allowed: take them without the walk.
            if n.plain && levels[d - 1].in_free_string(g) {
                out.extend_from_slice(&self.toks[n.tok_lo as usize..n.sub_hi as usize]);
                i = n.end as usize;
                continue;
            }
            let (below, here) = levels.split_at_mut(d);
            let cur = &mut here[0];
            cur.copy_from(&below[d - 1]);
            if cur.advance(g, n.byte) {
                out.extend_from_slice(&self.toks[n.tok_lo as usize..n.tok_hi as usize]);
                i += 1;
            } else {
                i = n.end as usize;
            }
        }
        if m.is_complete(g) {
            out.extend_from_slice(&self.eog);
        }
    }
}

/// One request's constrained decoding: its matcher, and the buffers of the mask.
pub struct Guide<'a> {
    grammar: &'a Grammar,
    trie: &'a TokenTrie,
    matcher: Matcher,
    levels: Vec<Matcher>,
    allowed: Vec<u32>,
    masked: Vec<f32>,
}

impl<'a> Guide<'a> {
    pub fn new(grammar: &'a Grammar, trie: &'a TokenTrie) -> Guide<'a> {
        Guide {
            grammar,
            trie,
            matcher: Matcher::new(grammar),
            levels: Vec::new(),
            allowed: Vec::new(),
            masked: Vec::new(),
        }
    }

    /// `logits` with every token the matcher cannot take set to -inf. With nothing allowed (a dead end the
    /// grammar should never reach) the end-of-generation tokens stay, so generation stops rather than breaks out.
    pub fn mask(&mut self, logits: &[f32]) -> &[f32] {
        self.trie
            .allowed(self.grammar, &self.matcher, &mut self.levels, &mut self.allowed);
        if self.allowed.is_empty() {
            self.allowed.extend_from_slice(&self.trie.eog);
        }
        self.masked.clear();
        self.masked.resize(logits.len(), f32::NEG_INFINITY);
        for &t in &self.allowed {
            if let Some(&l) = logits.get(t as usize) {
                self.masked[t as usize] = l;
            }
        }
        &self.masked
    }

    /// Moves the matcher past a sampled token's bytes (end-of-generation tokens have none here).
    pub fn accept(&mut self, bytes: &[u8]) {
        self.matcher.advance_bytes(self.grammar, bytes);
    }

    pub fn is_complete(&self) -> bool {
        self.matcher.is_complete(self.grammar)
    }
}
