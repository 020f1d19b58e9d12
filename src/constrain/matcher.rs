//! The byte-level matcher: a set of alternative stacks of frames (one per live `anyOf` branch), each a pushdown
//! automaton over JSON text. Frames are small and `Copy`, so cloning a matcher for each trie node is cheap.
//!
//! An object's keys outside `properties` are remembered (a hash each) in [`Frame::Seen`] frames kept just under
//! its frame, so no key repeats: JSON parsers disagree on `{"k":1,"k":2}`, and a schema's validator sees only one.

use super::pattern::NON_ASCII;
use super::schema::{Grammar, MAX_ALTS, Node, NodeId};

/// Most whitespace bytes in a row between tokens of JSON: enough for pretty printing, too few to loop in.
pub(crate) const MAX_WS: u8 = 10;
/// Deepest nesting of objects and arrays in the output.
const MAX_STACK: usize = 64;
/// Most digits in an integer part, a fraction or an exponent.
const MAX_DIGITS: u8 = 20;
/// Longest key not named in `properties` (bytes).
const MAX_FREE_KEY: u16 = 64;
/// Most keys outside `properties` in one object (each costs a frame while the object is open).
pub(crate) const MAX_FREE_KEYS: u8 = 64;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Obj {
    /// Expecting `{`.
    Fresh,
    /// After `{`.
    Open,
    /// Inside a key.
    Key,
    /// After a key, before `:`.
    Colon,
    /// After a value.
    After,
    /// After `,`.
    Comma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Arr {
    Fresh,
    Open,
    After,
    Comma,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Num {
    Start,
    Minus,
    Zero,
    Int,
    Dot,
    Frac,
    Exp,
    ExpSign,
    ExpDigits,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Frame {
    /// A value of `node` is next (after at most [`MAX_WS`] whitespace bytes).
    Value {
        node: NodeId,
        ws: u8,
    },
    Obj {
        node: NodeId,
        st: Obj,
        ws: u8,
        seen: u64,
        /// The key being read: bytes so far, the range of `keys` it is still a prefix of, and whether it may be
        /// a key outside `properties`.
        kpos: u16,
        klo: u8,
        khi: u8,
        kfree: bool,
        /// FNV-1a hash of the key's bytes so far, and keys outside `properties` given so far.
        khash: u64,
        nfree: u8,
    },
    /// A key outside `properties` that the object frame above already has (by hash).
    Seen {
        hash: u64,
    },
    Arr {
        node: NodeId,
        st: Arr,
        ws: u8,
        n: u32,
    },
    Str {
        node: NodeId,
        open: bool,
        /// Characters so far.
        n: u32,
        /// 0: plain; 1: after `\`; 2..=5: reading the hex digits of `\u`.
        esc: u8,
        /// UTF-8 continuation bytes still expected, and the allowed range of the next one.
        cont: u8,
        lo: u8,
        hi: u8,
        /// The state of the node's pattern over the characters so far (0 without one).
        re: u64,
    },
    Num {
        node: NodeId,
        integer: bool,
        st: Num,
        digits: u8,
        /// Sign and magnitude of the integer part so far (for the node's bounds).
        neg: bool,
        mag: u64,
    },
    /// The literals of `node` in `lo..hi` (sorted) all start with the `pos` bytes read so far.
    Lit {
        node: NodeId,
        pos: u32,
        lo: u32,
        hi: u32,
    },
}

enum Step {
    /// The byte was taken; the frame stays.
    Take,
    /// The byte was taken and closed the frame.
    Close,
    /// The frame is complete and the byte belongs to the frame below.
    Pass,
    /// Push this frame and feed it the same byte.
    Push(Frame),
    /// The byte was taken; push this frame for the bytes after it.
    TakePush(Frame),
    /// Replace this frame by the start shapes of `node` and feed them the byte.
    Expand(NodeId),
    /// The byte ended an object's key outside `properties` with this hash: taken unless the object has it already.
    FreeKey(u64),
    Reject,
}

fn is_ws(b: u8) -> bool {
    b == b' ' || b == b'\n'
}

/// A JSON matcher over one grammar. `advance` consumes a byte; [`Matcher::is_complete`] says whether the bytes so
/// far form a whole valid value.
#[derive(Clone, Debug, Default)]
pub struct Matcher {
    alts: Vec<Vec<Frame>>,
}

impl Matcher {
    pub fn new(g: &Grammar) -> Matcher {
        Matcher {
            alts: vec![vec![Frame::Value { node: g.root, ws: 0 }]],
        }
    }

    /// Copies `other` into `self`, reusing `self`'s allocations (the mask walk clones once per trie node).
    pub fn copy_from(&mut self, other: &Matcher) {
        self.alts.clone_from(&other.alts);
    }

    pub fn is_dead(&self) -> bool {
        self.alts.is_empty()
    }

    /// Feeds one byte; false (and the matcher dead) when no alternative accepts it.
    pub fn advance(&mut self, g: &Grammar, b: u8) -> bool {
        let n = self.alts.len();
        let mut i = 0;
        let mut kept = 0;
        while i < n {
            let mut st = std::mem::take(&mut self.alts[i]);
            if feed(g, &mut st, b, &mut self.alts) {
                self.alts[kept] = st;
                kept += 1;
            }
            i += 1;
        }
        // Alternatives made by expansion were appended after the first `n`; move them down.
        let extra = self.alts.len() - n;
        for j in 0..extra {
            self.alts.swap(kept + j, n + j);
        }
        self.alts.truncate(kept + extra);
        self.alts.truncate(MAX_ALTS);
        !self.alts.is_empty()
    }

    pub fn advance_bytes(&mut self, g: &Grammar, bytes: &[u8]) -> bool {
        bytes.iter().all(|&b| self.advance(g, b))
    }

    /// Whether the only alternative is inside a string without a length bound or pattern, past any escape or
    /// multi-byte character: then every plain character is taken as is ([`super::trie`]'s shortcut).
    pub fn in_free_string(&self, g: &Grammar) -> bool {
        match self.alts.as_slice() {
            [st] => matches!(
                st.last(),
                Some(&Frame::Str { node, open: true, esc: 0, cont: 0, .. })
                    if matches!(g.nodes[node as usize], Node::String { max: u32::MAX, pattern: None, .. })
            ),
            _ => false,
        }
    }

    /// Whether the bytes so far are a whole value (end of generation allowed here).
    pub fn is_complete(&self, g: &Grammar) -> bool {
        self.alts.iter().any(|s| match s.as_slice() {
            [] => true,
            [f] => implicitly_complete(g, f),
            _ => false,
        })
    }
}

/// A number or literal that may end without a closing byte of its own.
fn implicitly_complete(g: &Grammar, f: &Frame) -> bool {
    match *f {
        Frame::Num { node, st, neg, mag, .. } => {
            matches!(st, Num::Zero | Num::Int | Num::Frac | Num::ExpDigits) && in_bounds(g, node, neg, mag)
        }
        Frame::Lit { node, pos, lo, hi } => {
            lo < hi && matches!(&g.nodes[node as usize], Node::Literals(l) if l[lo as usize].len() == pos as usize)
        }
        _ => false,
    }
}

/// The frame a start shape begins with.
fn fresh(g: &Grammar, node: NodeId) -> Frame {
    match &g.nodes[node as usize] {
        Node::Object { .. } => Frame::Obj {
            node,
            st: Obj::Fresh,
            ws: 0,
            seen: 0,
            kpos: 0,
            klo: 0,
            khi: 0,
            kfree: false,
            khash: FNV_OFFSET,
            nfree: 0,
        },
        Node::Array { .. } => Frame::Arr {
            node,
            st: Arr::Fresh,
            ws: 0,
            n: 0,
        },
        Node::String { pattern, .. } => Frame::Str {
            node,
            open: false,
            n: 0,
            esc: 0,
            cont: 0,
            lo: 0,
            hi: 0,
            re: pattern.map_or(0, |p| g.patterns[p as usize].start()),
        },
        Node::Number { integer, .. } => Frame::Num {
            node,
            integer: *integer,
            st: Num::Start,
            digits: 0,
            neg: false,
            mag: 0,
        },
        Node::Literals(l) => Frame::Lit {
            node,
            pos: 0,
            lo: 0,
            hi: l.len() as u32,
        },
        Node::Union(_) | Node::Alias(_) => unreachable!("start shapes are concrete"),
    }
}

/// Feeds `b` to one stack; alternatives beyond the first made by an `anyOf` go to `extra`.
fn feed(g: &Grammar, st: &mut Vec<Frame>, b: u8, extra: &mut Vec<Vec<Frame>>) -> bool {
    loop {
        let Some(top) = st.last_mut() else {
            return false;
        };
        match step(g, top, b) {
            Step::Take => return true,
            Step::Close => {
                pop(st);
                return true;
            }
            Step::Pass => {
                pop(st);
            }
            Step::Push(f) => {
                if depth(st) >= MAX_STACK {
                    return false;
                }
                st.push(f);
            }
            Step::TakePush(f) => {
                if depth(st) >= MAX_STACK {
                    return false;
                }
                st.push(f);
                return true;
            }
            Step::FreeKey(hash) => {
                let top = st.len() - 1;
                let given = st[..top]
                    .iter()
                    .rev()
                    .map_while(|f| match f {
                        Frame::Seen { hash } => Some(*hash),
                        _ => None,
                    })
                    .any(|h| h == hash);
                if given {
                    return false;
                }
                st.insert(top, Frame::Seen { hash });
                return true;
            }
            Step::Expand(node) => {
                let starts = &g.starts[node as usize];
                let depth = st.len() - 1;
                for &s in &starts[1..] {
                    if extra.len() >= MAX_ALTS * 2 {
                        break;
                    }
                    let mut alt = st.clone();
                    alt[depth] = fresh(g, s);
                    if feed(g, &mut alt, b, extra) {
                        extra.push(alt);
                    }
                }
                st[depth] = fresh(g, starts[0]);
            }
            Step::Reject => return false,
        }
    }
}

/// Pops the top frame and the keys its object had (the [`Frame::Seen`] under it).
fn pop(st: &mut Vec<Frame>) {
    st.pop();
    while matches!(st.last(), Some(Frame::Seen { .. })) {
        st.pop();
    }
}

/// Nesting depth: the frames that are not remembered keys.
fn depth(st: &[Frame]) -> usize {
    st.iter().filter(|f| !matches!(f, Frame::Seen { .. })).count()
}

const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

fn fnv(h: u64, b: u8) -> u64 {
    (h ^ b as u64).wrapping_mul(0x0100_0000_01b3)
}

fn ws_step(ws: &mut u8) -> Step {
    if *ws >= MAX_WS {
        return Step::Reject;
    }
    *ws += 1;
    Step::Take
}

/// Bits `lo..hi` set.
fn range_bits(lo: u8, hi: u8) -> u64 {
    let upto = |n: u8| if n >= 64 { u64::MAX } else { (1u64 << n) - 1 };
    upto(hi) & !upto(lo)
}

fn step(g: &Grammar, f: &mut Frame, b: u8) -> Step {
    match f {
        // Never on top: [`pop`] removes them with their object.
        Frame::Seen { .. } => Step::Reject,
        Frame::Value { node, ws } => {
            if is_ws(b) {
                ws_step(ws)
            } else {
                Step::Expand(*node)
            }
        }
        Frame::Lit { node, pos, lo, hi } => {
            let Node::Literals(lits) = &g.nodes[*node as usize] else {
                return Step::Reject;
            };
            let p = *pos as usize;
            let range = &lits[*lo as usize..*hi as usize];
            let first = range.iter().position(|l| l.len() > p && l[p] == b);
            match first {
                Some(i) => {
                    let n = range[i..].iter().take_while(|l| l.len() > p && l[p] == b).count();
                    *lo += i as u32;
                    *hi = *lo + n as u32;
                    *pos += 1;
                    Step::Take
                }
                None if !range.is_empty() && range[0].len() == p => Step::Pass,
                None => Step::Reject,
            }
        }
        Frame::Num {
            node,
            integer,
            st,
            digits,
            neg,
            mag,
        } => {
            let step = num_step(*integer, st, digits, b);
            let Node::Number {
                bounds: Some((lo, hi)), ..
            } = g.nodes[*node as usize]
            else {
                return step;
            };
            match step {
                Step::Take => {
                    if b == b'-' {
                        *neg = true;
                    } else {
                        // Saturates far above any bound, so an overlong integer is simply out of reach.
                        *mag = mag.saturating_mul(10).saturating_add((b - b'0') as u64);
                    }
                    // Digits typed, and whether more may follow (not after a lone 0).
                    let (typed, more) = match *st {
                        Num::Minus => (0, true),
                        Num::Zero => (1, false),
                        _ => (*digits as u32, true),
                    };
                    if reachable(*neg, *mag, typed, more, lo, hi) {
                        Step::Take
                    } else {
                        Step::Reject
                    }
                }
                Step::Pass if !in_bounds(g, *node, *neg, *mag) => Step::Reject,
                s => s,
            }
        }
        Frame::Str {
            node,
            open,
            n,
            esc,
            cont,
            lo,
            hi,
            re,
        } => {
            let Node::String { min, max, pattern } = g.nodes[*node as usize] else {
                return Step::Reject;
            };
            let pattern = pattern.map(|p| &g.patterns[p as usize]);
            if !*open {
                if b == b'"' {
                    *open = true;
                    return Step::Take;
                }
                return Step::Reject;
            }
            if *cont > 0 {
                if !(*lo..=*hi).contains(&b) {
                    return Step::Reject;
                }
                *cont -= 1;
                (*lo, *hi) = (0x80, 0xBF);
                return Step::Take;
            }
            match *esc {
                1 => {
                    return match b {
                        b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {
                            *esc = 0;
                            Step::Take
                        }
                        b'u' => {
                            *esc = 2;
                            Step::Take
                        }
                        _ => Step::Reject,
                    };
                }
                2..=5 => {
                    if !b.is_ascii_hexdigit() {
                        return Step::Reject;
                    }
                    // No surrogates (\uD800-\uDFFF): a lone one is invalid JSON text for most parsers.
                    if *esc == 3 && lo_is_d(*lo) && !(b'0'..=b'7').contains(&b) {
                        return Step::Reject;
                    }
                    if *esc == 2 {
                        *lo = if b == b'd' || b == b'D' { 1 } else { 0 };
                    }
                    *esc = if *esc == 5 { 0 } else { *esc + 1 };
                    return Step::Take;
                }
                _ => {}
            }
            if b == b'"' {
                let matched = pattern.is_none_or(|p| p.accepts(*re));
                return if *n >= min && matched {
                    Step::Close
                } else {
                    Step::Reject
                };
            }
            if b < 0x20 || b == 0x7F {
                return Step::Reject;
            }
            // A new character.
            if *n >= max {
                return Step::Reject;
            }
            if let Some(p) = pattern {
                // A pattern sees characters; escapes are not written (the character would be matched unescaped).
                if b == b'\\' {
                    return Step::Reject;
                }
                *re = p.step(*re, if b < 0x80 { b } else { NON_ASCII });
                if *re == 0 {
                    return Step::Reject;
                }
            }
            match b {
                b'\\' => *esc = 1,
                0x00..=0x7F => {}
                0xC2..=0xDF => {
                    *cont = 1;
                    (*lo, *hi) = (0x80, 0xBF);
                }
                0xE0 => {
                    *cont = 2;
                    (*lo, *hi) = (0xA0, 0xBF);
                }
                0xED => {
                    *cont = 2;
                    (*lo, *hi) = (0x80, 0x9F);
                }
                0xE1..=0xEF => {
                    *cont = 2;
                    (*lo, *hi) = (0x80, 0xBF);
                }
                0xF0 => {
                    *cont = 3;
                    (*lo, *hi) = (0x90, 0xBF);
                }
                0xF1..=0xF3 => {
                    *cont = 3;
                    (*lo, *hi) = (0x80, 0xBF);
                }
                0xF4 => {
                    *cont = 3;
                    (*lo, *hi) = (0x80, 0x8F);
                }
                _ => return Step::Reject,
            }
            *n += 1;
            Step::Take
        }
        Frame::Arr { node, st, ws, n } => {
            let Node::Array { items, min, max } = g.nodes[*node as usize] else {
                return Step::Reject;
            };
            match st {
                Arr::Fresh => {
                    if b != b'[' {
                        return Step::Reject;
                    }
                    *st = Arr::Open;
                    Step::Take
                }
                Arr::Open | Arr::Comma => {
                    if is_ws(b) {
                        return ws_step(ws);
                    }
                    if b == b']' && *st == Arr::Open {
                        return if min == 0 { Step::Close } else { Step::Reject };
                    }
                    if *n >= max {
                        return Step::Reject;
                    }
                    *n += 1;
                    *st = Arr::After;
                    *ws = 0;
                    Step::Push(Frame::Value {
                        node: items,
                        ws: MAX_WS,
                    })
                }
                Arr::After => {
                    if is_ws(b) {
                        return ws_step(ws);
                    }
                    match b {
                        b',' if *n < max => {
                            *st = Arr::Comma;
                            *ws = 0;
                            Step::Take
                        }
                        b']' if *n >= min => Step::Close,
                        _ => Step::Reject,
                    }
                }
            }
        }
        Frame::Obj {
            node,
            st,
            ws,
            seen,
            kpos,
            klo,
            khi,
            kfree,
            khash,
            nfree,
        } => {
            let Node::Object {
                keys,
                values,
                required,
                additional,
            } = &g.nodes[*node as usize]
            else {
                return Step::Reject;
            };
            let all = range_bits(0, keys.len() as u8);
            let free_left = additional.is_some() && *nfree < MAX_FREE_KEYS;
            let more_keys = free_left || (all & !*seen) != 0;
            let can_close = *required & !*seen == 0;
            match st {
                Obj::Fresh => {
                    if b != b'{' {
                        return Step::Reject;
                    }
                    *st = Obj::Open;
                    Step::Take
                }
                Obj::Open | Obj::Comma | Obj::After => {
                    if is_ws(b) {
                        return ws_step(ws);
                    }
                    let key_ok = *st != Obj::After;
                    match b {
                        b'"' if key_ok && more_keys => {
                            *st = Obj::Key;
                            *kpos = 0;
                            *klo = 0;
                            *khi = keys.len() as u8;
                            *kfree = free_left;
                            *khash = FNV_OFFSET;
                            *ws = 0;
                            Step::Take
                        }
                        b'}' if *st != Obj::Comma && can_close => Step::Close,
                        b',' if *st == Obj::After && more_keys => {
                            *st = Obj::Comma;
                            *ws = 0;
                            Step::Take
                        }
                        _ => Step::Reject,
                    }
                }
                Obj::Key => {
                    let p = *kpos as usize;
                    let (lo, hi) = (*klo as usize, *khi as usize);
                    if b == b'"' {
                        // The key ends: a named property not yet given, or a free key.
                        let exact = lo < hi && keys[lo].len() == p;
                        if exact {
                            if *seen & (1 << lo) != 0 {
                                return Step::Reject;
                            }
                            // A free key may spell a named one: it is that property either way.
                            *seen |= 1 << lo;
                            *st = Obj::Colon;
                            *klo = lo as u8;
                            *kfree = false;
                            *ws = 0;
                            return Step::Take;
                        }
                        if *kfree && p > 0 {
                            *st = Obj::Colon;
                            *klo = u8::MAX;
                            *ws = 0;
                            *nfree += 1;
                            return Step::FreeKey(*khash);
                        }
                        return Step::Reject;
                    }
                    // Narrow the named keys still possible.
                    let mut nlo = hi;
                    let mut nhi = hi;
                    for (i, k) in keys.iter().enumerate().take(hi).skip(lo) {
                        if k.len() > p && k[p] == b {
                            if nlo == hi {
                                nlo = i;
                            }
                            nhi = i + 1;
                        }
                    }
                    let named = nlo < nhi && range_bits(nlo as u8, nhi as u8) & !*seen != 0;
                    let free = *kfree && b >= 0x20 && b != b'\\' && b != 0x7F && *kpos < MAX_FREE_KEY;
                    if !named && !free {
                        return Step::Reject;
                    }
                    if nlo < nhi {
                        *klo = nlo as u8;
                        *khi = nhi as u8;
                    } else {
                        *klo = 0;
                        *khi = 0;
                    }
                    *kfree = free;
                    *khash = fnv(*khash, b);
                    *kpos += 1;
                    Step::Take
                }
                Obj::Colon => {
                    if is_ws(b) {
                        return ws_step(ws);
                    }
                    if b != b':' {
                        return Step::Reject;
                    }
                    let value = if *klo == u8::MAX {
                        additional.unwrap_or(0)
                    } else {
                        values[*klo as usize]
                    };
                    *st = Obj::After;
                    *ws = 0;
                    Step::TakePush(Frame::Value { node: value, ws: 0 })
                }
            }
        }
    }
}

/// Whether a whole number's value lies in its node's bounds (always, without bounds).
fn in_bounds(g: &Grammar, node: NodeId, neg: bool, mag: u64) -> bool {
    match g.nodes[node as usize] {
        Node::Number {
            bounds: Some((lo, hi)), ..
        } => {
            let v = if neg { -(mag as i128) } else { mag as i128 };
            (lo as i128..=hi as i128).contains(&v)
        }
        _ => true,
    }
}

/// Whether an integer begun as `-`? and `typed` digits of value `mag` can still end within `lo..=hi` (adding up
/// to the digit limit when `more`), so a bounded integer never reaches a dead end.
fn reachable(neg: bool, mag: u64, typed: u32, more: bool, lo: i64, hi: i64) -> bool {
    let (lo, hi) = (lo as i128, hi as i128);
    let extra = if more {
        MAX_DIGITS as u32 - typed.min(MAX_DIGITS as u32)
    } else {
        0
    };
    (0..=extra).any(|j| {
        if typed == 0 && j == 0 {
            return false;
        }
        let p = 10i128.pow(j);
        let (a, b) = (mag as i128 * p, mag as i128 * p + p - 1);
        let (a, b) = if neg { (-b, -a) } else { (a, b) };
        a <= hi && b >= lo
    })
}

fn lo_is_d(lo: u8) -> bool {
    lo == 1
}

fn num_step(integer: bool, st: &mut Num, digits: &mut u8, b: u8) -> Step {
    let digit = b.is_ascii_digit();
    let mut count = |st: &mut Num, to: Num| {
        if *st != to {
            *digits = 0;
        }
        if *digits >= MAX_DIGITS {
            return Step::Reject;
        }
        *digits += 1;
        *st = to;
        Step::Take
    };
    match *st {
        Num::Start => match b {
            b'-' => {
                *st = Num::Minus;
                Step::Take
            }
            b'0' => {
                *st = Num::Zero;
                Step::Take
            }
            b'1'..=b'9' => count(st, Num::Int),
            _ => Step::Reject,
        },
        Num::Minus => match b {
            b'0' => {
                *st = Num::Zero;
                Step::Take
            }
            b'1'..=b'9' => count(st, Num::Int),
            _ => Step::Reject,
        },
        Num::Zero | Num::Int => match b {
            _ if digit && *st == Num::Int => count(st, Num::Int),
            b'.' if !integer => {
                *st = Num::Dot;
                Step::Take
            }
            b'e' | b'E' if !integer => {
                *st = Num::Exp;
                Step::Take
            }
            _ if digit => Step::Reject,
            _ => Step::Pass,
        },
        Num::Dot => {
            if digit {
                count(st, Num::Frac)
            } else {
                Step::Reject
            }
        }
        Num::Frac => match b {
            _ if digit => count(st, Num::Frac),
            b'e' | b'E' => {
                *st = Num::Exp;
                Step::Take
            }
            _ => Step::Pass,
        },
        Num::Exp => match b {
            b'+' | b'-' => {
                *st = Num::ExpSign;
                Step::Take
            }
            _ if digit => count(st, Num::ExpDigits),
            _ => Step::Reject,
        },
        Num::ExpSign => {
            if digit {
                count(st, Num::ExpDigits)
            } else {
                Step::Reject
            }
        }
        Num::ExpDigits => {
            if digit {
                count(st, Num::ExpDigits)
            } else {
                Step::Pass
            }
        }
    }
}
