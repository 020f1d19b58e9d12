//! Which slot takes a request: a pure function over a snapshot of slots and nodes, so the policy is tested
//! without models or sockets.
//!
//! Policy: among free slots on healthy nodes the request has not failed on, take the one whose cached text shares
//! the longest prefix with the prompt (at least [`MIN_PREFIX`] bytes), unless its node is overloaded: busier than the
//! least-loaded candidate node by more than [`OVERLOAD_MARGIN`] of its capacity. Otherwise take the least-loaded
//! node, and on it the free slot with the longest prefix, then the least recently used one (its cache is the
//! coldest to lose).
//!
//! A node with a prefix cache on disk (`--kv-cache-dir`) also holds, for every slot of it, the prefixes of the
//! prompts the router sent it ([`DiskKeys`]): a slot's prefix is the longer of what its KV holds and what its node's
//! disk holds, so a request goes where its prefix is cached, resident or not. Resident wins a tie (no disk read).

use std::collections::VecDeque;

/// A slot as the router sees it.
pub struct SlotView<'a> {
    pub node: usize,
    pub busy: bool,
    /// The text (affinity key) whose KV the slot holds.
    pub key: &'a str,
    /// Larger = used more recently.
    pub last_used: u64,
}

pub struct NodeView {
    pub up: bool,
    pub busy: usize,
    pub slots: usize,
    /// Bytes of the request's key whose KV the node's disk cache holds ([`DiskKeys::prefix`]; 0 without one).
    pub disk_prefix: usize,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Reason {
    Prefix,
    /// The prefix is on the node's disk, not in the slot's KV.
    DiskPrefix,
    LeastLoaded,
}

impl Reason {
    pub fn name(self) -> &'static str {
        match self {
            Reason::Prefix => "prefix",
            Reason::DiskPrefix => "disk_prefix",
            Reason::LeastLoaded => "least_loaded",
        }
    }
}

/// Keys (prompt texts) a node with a disk cache was sent, most recent last, at most [`DiskKeys::MAX`]: the router's
/// own record of what that node's `--kv-cache-dir` holds, with no question to the node. The disk keeps only whole
/// blocks of [`BLOCK`](crate::engine::disk_cache::BLOCK) tokens, and a token takes at least one byte of text, so
/// a shared prefix shorter than a block's worth of bytes counts as nothing; entries the node has evicted since
/// are a wrong guess that costs a prefill, as a miss does.
#[derive(Default)]
pub struct DiskKeys(VecDeque<String>);

impl DiskKeys {
    pub const MAX: usize = 64;

    pub fn add(&mut self, key: &str) {
        if let Some(i) = self.0.iter().position(|k| k == key) {
            self.0.remove(i);
        }
        if self.0.len() >= Self::MAX {
            self.0.pop_front();
        }
        self.0.push_back(key.to_string());
    }

    /// Bytes of `key` the node's disk is taken to hold.
    pub fn prefix(&self, key: &str) -> usize {
        let p = self.0.iter().map(|k| common_prefix(key, k)).max().unwrap_or(0);
        if p >= crate::engine::disk_cache::BLOCK { p } else { 0 }
    }
}

/// Shorter shared prefixes are not worth steering for.
pub const MIN_PREFIX: usize = 8;
/// A node this much busier (fraction of its slots) than the least-loaded one is overloaded.
pub const OVERLOAD_MARGIN: f64 = 0.5;

/// Common prefix of two strings in bytes.
pub fn common_prefix(a: &str, b: &str) -> usize {
    a.bytes().zip(b.bytes()).take_while(|(x, y)| x == y).count()
}

fn load(n: &NodeView) -> f64 {
    n.busy as f64 / n.slots.max(1) as f64
}

/// The slot to run `key` on, why, and how many bytes of its cache match; `None` when no slot is free now.
pub fn pick(slots: &[SlotView], nodes: &[NodeView], key: &str, excluded: &[usize]) -> Option<(usize, Reason, usize)> {
    let ok = |s: &SlotView| !s.busy && nodes[s.node].up && !excluded.contains(&s.node);
    let resident = |i: usize| common_prefix(key, slots[i].key);
    let cands: Vec<(usize, usize)> = slots
        .iter()
        .enumerate()
        .filter(|(_, s)| ok(s))
        .map(|(i, s)| (i, resident(i).max(nodes[s.node].disk_prefix)))
        .collect();
    if cands.is_empty() {
        return None;
    }
    let min_load = cands
        .iter()
        .map(|&(i, _)| load(&nodes[slots[i].node]))
        .fold(f64::INFINITY, f64::min);
    // Longest prefix first; among equals the one resident in the slot, the less loaded node, then the most
    // recently used slot.
    let best = cands
        .iter()
        .copied()
        .max_by(|&(a, pa), &(b, pb)| {
            pa.cmp(&pb)
                .then(resident(a).cmp(&resident(b)))
                .then(load(&nodes[slots[b].node]).total_cmp(&load(&nodes[slots[a].node])))
                .then(slots[a].last_used.cmp(&slots[b].last_used))
        })
        .unwrap();
    if best.1 >= MIN_PREFIX && load(&nodes[slots[best.0].node]) <= min_load + OVERLOAD_MARGIN {
        let why = if resident(best.0) >= best.1 {
            Reason::Prefix
        } else {
            Reason::DiskPrefix
        };
        return Some((best.0, why, best.1));
    }
    // Least-loaded node; on it the longest prefix worth having, then the least recently used slot.
    let worth = |p: usize| if p >= MIN_PREFIX { p } else { 0 };
    let (i, p) = cands
        .iter()
        .copied()
        .filter(|&(i, _)| load(&nodes[slots[i].node]) <= min_load)
        .max_by(|&(a, pa), &(b, pb)| {
            worth(pa)
                .cmp(&worth(pb))
                .then(slots[b].last_used.cmp(&slots[a].last_used))
        })
        .unwrap();
    Some((i, Reason::LeastLoaded, p))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn s(node: usize, busy: bool, key: &str, last_used: u64) -> SlotView<'_> {
        SlotView {
            node,
            busy,
            key,
            last_used,
        }
    }
    fn n(up: bool, busy: usize, slots: usize) -> NodeView {
        NodeView {
            up,
            busy,
            slots,
            disk_prefix: 0,
        }
    }

    #[test]
    fn longest_cached_prefix_wins() {
        let slots = [
            s(0, false, "hello world, how", 5),
            s(1, false, "hello world, how are you", 1),
        ];
        let nodes = [n(true, 0, 1), n(true, 0, 1)];
        assert_eq!(
            pick(&slots, &nodes, "hello world, how are you today", &[]),
            Some((1, Reason::Prefix, 24))
        );
    }

    #[test]
    fn overloaded_node_loses_its_prefix_advantage() {
        let slots = [
            s(0, false, "the long shared prefix", 1),
            s(0, true, "", 0),
            s(0, true, "", 0),
            s(1, false, "", 0),
        ];
        let nodes = [n(true, 2, 3), n(true, 0, 3)];
        let (i, why, _) = pick(&slots, &nodes, "the long shared prefix!", &[]).unwrap();
        assert_eq!((i, why), (3, Reason::LeastLoaded));
    }

    #[test]
    fn no_prefix_goes_to_least_loaded_node_and_lru_slot() {
        let slots = [
            s(0, false, "aaaaaaaaaa", 9),
            s(1, false, "bbbbbbbbbb", 7),
            s(1, false, "cccccccccc", 3),
            s(0, true, "", 0),
        ];
        let nodes = [n(true, 1, 2), n(true, 0, 2)];
        assert_eq!(pick(&slots, &nodes, "zzz", &[]), Some((2, Reason::LeastLoaded, 0)));
    }

    #[test]
    fn a_few_shared_bytes_do_not_beat_the_colder_slot() {
        let slots = [s(0, false, "\u{1}user\u{1f}Once upon", 2), s(1, false, "", 1)];
        let nodes = [n(true, 0, 1), n(true, 0, 1)];
        assert_eq!(
            pick(&slots, &nodes, "\u{1}user\u{1f}List", &[]),
            Some((1, Reason::LeastLoaded, 0))
        );
    }

    #[test]
    fn down_excluded_and_busy_are_skipped() {
        let slots = [
            s(0, false, "prefix prefix", 1),
            s(1, false, "prefix prefix", 1),
            s(2, true, "", 0),
        ];
        let nodes = [n(false, 0, 1), n(true, 0, 1), n(true, 1, 1)];
        assert_eq!(pick(&slots, &nodes, "prefix prefix", &[1]), None);
        assert_eq!(pick(&slots, &nodes, "prefix prefix", &[]).unwrap().0, 1);
    }

    #[test]
    fn a_prefix_on_a_nodes_disk_beats_a_shorter_resident_one_and_loses_a_tie() {
        let doc = "x".repeat(3000);
        let (prompt, other) = (format!("{doc} Question one?"), format!("{doc} Question two?"));
        let mut disk = DiskKeys::default();
        disk.add(&other);
        disk.add("unrelated");
        assert_eq!(disk.prefix(&prompt), doc.len() + " Question ".len());
        assert_eq!(disk.prefix("xxxx short"), 0, "less than a block's worth of bytes");
        let with_disk = |p| NodeView {
            disk_prefix: p,
            ..n(true, 0, 1)
        };
        // Node 0's slot holds a little of the prompt; node 1's disk holds the document.
        let slots = [s(0, false, &prompt[..20], 9), s(1, false, "something else", 1)];
        let nodes = [n(true, 0, 1), with_disk(disk.prefix(&prompt))];
        assert_eq!(
            pick(&slots, &nodes, &prompt, &[]),
            Some((1, Reason::DiskPrefix, doc.len() + " Question ".len()))
        );
        // The same prefix resident in a slot is preferred to the disk copy.
        let slots = [s(0, false, &other, 1), s(1, false, "something else", 9)];
        let (i, why, _) = pick(&slots, &nodes, &prompt, &[]).unwrap();
        assert_eq!((i, why), (0, Reason::Prefix));
        // An overloaded node loses its disk advantage as it would a resident one.
        let slots = [
            s(0, false, "", 1),
            s(1, false, "", 1),
            s(1, true, "", 0),
            s(1, true, "", 0),
        ];
        let nodes = [
            n(true, 0, 3),
            NodeView {
                busy: 2,
                slots: 3,
                ..with_disk(3010)
            },
        ];
        assert_eq!(pick(&slots, &nodes, &prompt, &[]).unwrap().1, Reason::LeastLoaded);
    }

    #[test]
    fn disk_keys_stay_bounded_and_recent() {
        let mut d = DiskKeys::default();
        let key = |i: usize| format!("{i:04}{}", "y".repeat(300));
        for i in 0..DiskKeys::MAX + 5 {
            d.add(&key(i));
        }
        assert_eq!(d.0.len(), DiskKeys::MAX);
        assert_eq!(d.prefix(&key(0)), 0, "the oldest keys were dropped");
        assert_eq!(d.prefix(&key(DiskKeys::MAX + 4)), key(0).len());
        d.add(&key(10));
        assert_eq!(
            d.0.len(),
            DiskKeys::MAX,
            "a key sent again moves, it is not added twice"
        );
    }
}
