//! `pattern` and `format`: a regular-expression subset compiled into a position (Glushkov) automaton over a
//! string's characters, its state a bit set that fits in a `Copy` matcher frame. The subset: literals, `.`,
//! classes (`[a-z_]`, `[^"]`, `\d \w \s` and their negations), groups, `|`, `? * + {m} {m,} {m,n}`, and `^`/`$` at
//! the ends of the whole pattern. Unanchored ends work as JSON Schema says (a match anywhere in the string).
//! Anything else (backreferences, lookaround, lazy quantifiers, `\b`, non-ASCII characters in the pattern) is
//! refused, never approximated.

use super::schema::SchemaError;

/// Most character positions a pattern may expand to (bits of the state; two more are START and DONE).
const MAX_POS: usize = 62;
/// Largest count in `{m,n}`.
const MAX_REPEAT: u32 = 32;
/// Nothing consumed since a match may begin here.
const START: u64 = 1 << 62;
/// A match was found and the end is not anchored: any further characters are fine.
const DONE: u64 = 1 << 63;
const POSITIONS: u64 = START - 1;
/// The symbol every character outside ASCII is fed as (the string frame checks its UTF-8).
pub(crate) const NON_ASCII: u8 = 128;

/// RFC 3339 `full-date` and `full-time`, the parts of the formats below.
macro_rules! date {
    () => {
        "[0-9]{4}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])"
    };
}
macro_rules! time {
    () => {
        "([01][0-9]|2[0-3]):[0-5][0-9]:[0-5][0-9](\\.[0-9]{1,6})?(Z|[+-]([01][0-9]|2[0-3]):[0-5][0-9])"
    };
}

/// The `format`s enforced, as patterns (date, time, date-time after RFC 3339; uuid; a plain email address).
const FORMATS: [(&str, &str); 5] = [
    ("date", concat!("^", date!(), "$")),
    ("time", concat!("^", time!(), "$")),
    ("date-time", concat!("^", date!(), "T", time!(), "$")),
    (
        "uuid",
        "^[0-9a-fA-F]{8}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{4}-[0-9a-fA-F]{12}$",
    ),
    (
        "email",
        "^[A-Za-z0-9_%+-]+(\\.[A-Za-z0-9_%+-]+)*@[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?(\\.[A-Za-z0-9]([A-Za-z0-9-]*[A-Za-z0-9])?)+$",
    ),
];

/// A set of symbols: ASCII bits and whether non-ASCII characters belong.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Class {
    ascii: u128,
    non_ascii: bool,
}

impl Class {
    fn has(&self, c: u8) -> bool {
        if c == NON_ASCII {
            self.non_ascii
        } else {
            self.ascii >> c & 1 == 1
        }
    }
    fn negated(self) -> Class {
        Class {
            ascii: !self.ascii,
            non_ascii: !self.non_ascii,
        }
    }
}

fn one(c: u8) -> Class {
    Class {
        ascii: 1 << c,
        non_ascii: false,
    }
}

fn range(lo: u8, hi: u8) -> Class {
    let mut ascii = 0u128;
    for c in lo..=hi {
        ascii |= 1 << c;
    }
    Class {
        ascii,
        non_ascii: false,
    }
}

fn union(a: Class, b: Class) -> Class {
    Class {
        ascii: a.ascii | b.ascii,
        non_ascii: a.non_ascii || b.non_ascii,
    }
}

/// A parsed pattern.
#[derive(Clone, Debug)]
enum Re {
    Class(Class),
    Cat(Vec<Re>),
    Alt(Vec<Re>),
    Repeat(Box<Re>, u32, Option<u32>),
}

/// A compiled pattern: each position's class, what may follow it, where a match starts and ends.
#[derive(Clone, Debug)]
pub(crate) struct Pattern {
    classes: Vec<Class>,
    follow: Vec<u64>,
    first: u64,
    last: u64,
    nullable: bool,
    anchored_start: bool,
    anchored_end: bool,
}

fn refuse<T>(keyword: &str, why: impl Into<String>) -> Result<T, SchemaError> {
    Err(SchemaError {
        keyword: keyword.into(),
        message: why.into(),
    })
}

impl Pattern {
    /// The pattern of `format` (the formats of [`FORMATS`]; any other is refused by name).
    pub(crate) fn format(name: &str) -> Result<Pattern, SchemaError> {
        match FORMATS.iter().find(|f| f.0 == name) {
            Some((_, re)) => Pattern::compile(re, "format"),
            None => refuse(
                "format",
                format!(
                    "format {name:?} is not supported by constrained sampling (supported: {})",
                    FORMATS.map(|f| f.0).join(", ")
                ),
            ),
        }
    }

    /// Compiles `src`; errors name `keyword` (`pattern`, or `format` for the built-in ones).
    pub(crate) fn compile(src: &str, keyword: &str) -> Result<Pattern, SchemaError> {
        if !src.is_ascii() {
            return refuse(keyword, "pattern: only ASCII characters are supported in a pattern");
        }
        let b = src.as_bytes();
        let anchored_start = b.first() == Some(&b'^');
        let anchored_end = b.last() == Some(&b'$') && dollar_is_anchor(b) && b.len() > anchored_start as usize;
        let body = &b[anchored_start as usize..b.len() - anchored_end as usize];
        let mut p = Parser { s: body, i: 0, keyword };
        let re = p.alt()?;
        if p.i < body.len() {
            return p.fail(format!("unexpected {:?}", body[p.i] as char));
        }
        let mut g = Glushkov::default();
        let (nullable, first, last) = g.build(&re, keyword)?;
        Ok(Pattern {
            classes: g.classes,
            follow: g.follow,
            first,
            last,
            nullable,
            anchored_start,
            anchored_end,
        })
    }

    /// The state before the string's first character.
    pub(crate) fn start(&self) -> u64 {
        if !self.anchored_end && self.nullable {
            DONE
        } else {
            START
        }
    }

    /// The state after symbol `c` (an ASCII byte or [`NON_ASCII`]); 0: no match is possible any more.
    pub(crate) fn step(&self, state: u64, c: u8) -> u64 {
        if state & DONE != 0 {
            return DONE;
        }
        let mut cand = if state & START != 0 { self.first } else { 0 };
        let mut s = state & POSITIONS;
        while s != 0 {
            cand |= self.follow[s.trailing_zeros() as usize];
            s &= s - 1;
        }
        let mut next = 0;
        while cand != 0 {
            let p = cand.trailing_zeros() as usize;
            if self.classes[p].has(c) {
                next |= 1 << p;
            }
            cand &= cand - 1;
        }
        if !self.anchored_end && next & self.last != 0 {
            return DONE;
        }
        if !self.anchored_start {
            next |= START;
        }
        next
    }

    /// Whether the string may end in `state`.
    pub(crate) fn accepts(&self, state: u64) -> bool {
        state & DONE != 0 || state & self.last != 0 || (state & START != 0 && self.nullable)
    }
}

/// Whether a final `$` is an anchor: preceded by an even number of `\` (`\$` is a literal dollar, `\\$` an
/// anchor after a literal backslash).
fn dollar_is_anchor(b: &[u8]) -> bool {
    let n = b[..b.len() - 1].iter().rev().take_while(|&&c| c == b'\\').count();
    n % 2 == 0
}

struct Parser<'a> {
    s: &'a [u8],
    i: usize,
    keyword: &'a str,
}

impl Parser<'_> {
    fn fail<T>(&self, why: String) -> Result<T, SchemaError> {
        refuse(
            self.keyword,
            format!(
                "{}: {why} at byte {} (supported: literals, ., classes, groups, |, ? * + {{m,n}}, ^ and $ at the ends)",
                self.keyword, self.i
            ),
        )
    }

    fn peek(&self) -> Option<u8> {
        self.s.get(self.i).copied()
    }

    fn alt(&mut self) -> Result<Re, SchemaError> {
        let mut alts = vec![self.cat()?];
        while self.peek() == Some(b'|') {
            self.i += 1;
            alts.push(self.cat()?);
        }
        Ok(if alts.len() == 1 {
            alts.pop().unwrap()
        } else {
            Re::Alt(alts)
        })
    }

    fn cat(&mut self) -> Result<Re, SchemaError> {
        let mut items = Vec::new();
        while let Some(c) = self.peek() {
            if c == b'|' || c == b')' {
                break;
            }
            let atom = self.atom()?;
            items.push(self.quantified(atom)?);
        }
        Ok(Re::Cat(items))
    }

    fn quantified(&mut self, atom: Re) -> Result<Re, SchemaError> {
        let (min, max) = match self.peek() {
            Some(b'?') => (0, Some(1)),
            Some(b'*') => (0, None),
            Some(b'+') => (1, None),
            Some(b'{') => {
                self.i += 1;
                let min = self.number()?;
                let max = match self.peek() {
                    Some(b'}') => Some(min),
                    Some(b',') => {
                        self.i += 1;
                        if self.peek() == Some(b'}') {
                            None
                        } else {
                            Some(self.number()?)
                        }
                    }
                    _ => return self.fail("a count {m}, {m,} or {m,n} must close with }".into()),
                };
                if self.peek() != Some(b'}') {
                    return self.fail("a count {m}, {m,} or {m,n} must close with }".into());
                }
                if max.is_some_and(|m| m < min) {
                    return self.fail(format!("{{{min},{}}} counts down", max.unwrap()));
                }
                (min, max)
            }
            _ => return Ok(atom),
        };
        self.i += 1;
        if matches!(self.peek(), Some(b'?' | b'+' | b'*' | b'{')) {
            return self.fail("lazy, possessive or doubled quantifiers are not supported".into());
        }
        Ok(Re::Repeat(Box::new(atom), min, max))
    }

    fn number(&mut self) -> Result<u32, SchemaError> {
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit()) {
            self.i += 1;
        }
        let n: u32 = std::str::from_utf8(&self.s[start..self.i])
            .ok()
            .and_then(|t| t.parse().ok())
            .map_or_else(|| self.fail("a count must be a number".into()), Ok)?;
        if n > MAX_REPEAT {
            return self.fail(format!("counts above {MAX_REPEAT} are not supported"));
        }
        Ok(n)
    }

    fn atom(&mut self) -> Result<Re, SchemaError> {
        let c = self.peek().unwrap();
        self.i += 1;
        Ok(match c {
            b'(' => {
                if self.peek() == Some(b'?') {
                    if self.s.get(self.i + 1) != Some(&b':') {
                        return self.fail("lookaround and named groups are not supported".into());
                    }
                    self.i += 2;
                }
                let inner = self.alt()?;
                if self.peek() != Some(b')') {
                    return self.fail("unclosed group".into());
                }
                self.i += 1;
                inner
            }
            b'[' => Re::Class(self.class()?),
            b'.' => Re::Class(union(one(b'\n'), one(b'\r')).negated()),
            b'\\' => Re::Class(self.escape(false)?),
            b'^' | b'$' => return self.fail("^ and $ are supported only at the ends of the pattern".into()),
            b'*' | b'+' | b'?' | b'{' | b'}' | b']' => {
                return self.fail(format!("{:?} has nothing to repeat or must be escaped", c as char));
            }
            _ => Re::Class(one(c)),
        })
    }

    /// After `\`: a class escape, or an escaped character.
    fn escape(&mut self, in_class: bool) -> Result<Class, SchemaError> {
        let Some(c) = self.peek() else {
            return self.fail("the pattern ends with \\".into());
        };
        self.i += 1;
        let digit = range(b'0', b'9');
        let word = union(union(digit, range(b'a', b'z')), union(range(b'A', b'Z'), one(b'_')));
        let space = union(
            union(one(b' '), one(b'\t')),
            union(union(one(b'\n'), one(b'\r')), union(one(0x0B), one(0x0C))),
        );
        Ok(match c {
            b'd' => digit,
            b'D' => digit.negated(),
            b'w' => word,
            b'W' => word.negated(),
            b's' => space,
            b'S' => space.negated(),
            b'n' => one(b'\n'),
            b't' => one(b'\t'),
            b'r' => one(b'\r'),
            b'b' if in_class => one(0x08),
            _ if c.is_ascii_punctuation() => one(c),
            _ => return self.fail(format!("the escape \\{} is not supported", c as char)),
        })
    }

    fn class(&mut self) -> Result<Class, SchemaError> {
        let negate = self.peek() == Some(b'^');
        if negate {
            self.i += 1;
        }
        let mut set = Class {
            ascii: 0,
            non_ascii: false,
        };
        let mut first = true;
        loop {
            let Some(c) = self.peek() else {
                return self.fail("unclosed [".into());
            };
            if c == b']' && !first {
                self.i += 1;
                break;
            }
            first = false;
            self.i += 1;
            let lo = if c == b'\\' {
                let e = self.escape(true)?;
                if e.ascii.count_ones() != 1 || e.non_ascii {
                    set = union(set, e);
                    continue;
                }
                e.ascii.trailing_zeros() as u8
            } else {
                c
            };
            if self.peek() == Some(b'-') && self.s.get(self.i + 1).is_some_and(|&n| n != b']') {
                self.i += 1;
                let h = self.peek().unwrap();
                self.i += 1;
                let hi = if h == b'\\' {
                    let e = self.escape(true)?;
                    if e.ascii.count_ones() != 1 || e.non_ascii {
                        return self.fail("a range must end in one character".into());
                    }
                    e.ascii.trailing_zeros() as u8
                } else {
                    h
                };
                if hi < lo {
                    return self.fail("a class range runs backwards".into());
                }
                set = union(set, range(lo, hi));
            } else {
                set = union(set, one(lo));
            }
        }
        Ok(if negate { set.negated() } else { set })
    }
}

/// Builds positions and follow sets (Glushkov's construction), counted repeats expanded into copies.
#[derive(Default)]
struct Glushkov {
    classes: Vec<Class>,
    follow: Vec<u64>,
}

impl Glushkov {
    /// (nullable, first, last) of `re`, adding its positions.
    fn build(&mut self, re: &Re, keyword: &str) -> Result<(bool, u64, u64), SchemaError> {
        Ok(match re {
            Re::Class(c) => {
                if self.classes.len() >= MAX_POS {
                    return refuse(
                        keyword,
                        format!("{keyword}: the pattern expands to more than {MAX_POS} character positions"),
                    );
                }
                self.classes.push(*c);
                self.follow.push(0);
                let p = 1u64 << (self.classes.len() - 1);
                (false, p, p)
            }
            Re::Cat(items) => {
                let (mut nullable, mut first, mut last) = (true, 0, 0);
                for it in items {
                    let (n, f, l) = self.build(it, keyword)?;
                    self.link(last, f);
                    if nullable {
                        first |= f;
                    }
                    last = if n { last | l } else { l };
                    nullable &= n;
                }
                (nullable, first, last)
            }
            Re::Alt(alts) => {
                let (mut nullable, mut first, mut last) = (false, 0, 0);
                for a in alts {
                    let (n, f, l) = self.build(a, keyword)?;
                    nullable |= n;
                    first |= f;
                    last |= l;
                }
                (nullable, first, last)
            }
            Re::Repeat(inner, min, max) => {
                // x{m,n} = x…x (m times) then (x(x(…)?)?)? (n - m times); x{m,} = x…x x*.
                let mut parts: Vec<Re> = (0..*min).map(|_| (**inner).clone()).collect();
                let (n, f, l) = match max {
                    None => {
                        let (n0, f0, l0) = self.build(&Re::Cat(parts), keyword)?;
                        let (_, fs, ls) = self.build(inner, keyword)?;
                        self.link(ls, fs);
                        self.link(l0, fs);
                        (n0, if n0 { f0 | fs } else { f0 }, l0 | ls)
                    }
                    Some(max) => {
                        let mut opt = Re::Cat(Vec::new());
                        for _ in *min..*max {
                            opt = Re::Alt(vec![Re::Cat(Vec::new()), Re::Cat(vec![(**inner).clone(), opt])]);
                        }
                        parts.push(opt);
                        self.build(&Re::Cat(parts), keyword)?
                    }
                };
                (n, f, l)
            }
        })
    }

    /// Every position of `from` may be followed by every position of `to`.
    fn link(&mut self, from: u64, to: u64) {
        let mut s = from;
        while s != 0 {
            self.follow[s.trailing_zeros() as usize] |= to;
            s &= s - 1;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn matches(p: &Pattern, s: &str) -> bool {
        let mut st = p.start();
        for c in s.chars() {
            st = p.step(st, if c.is_ascii() { c as u8 } else { NON_ASCII });
            if st == 0 {
                return false;
            }
        }
        p.accepts(st)
    }

    #[test]
    fn patterns_match_as_ecmascript_would() {
        let cases: [(&str, &[&str], &[&str]); 9] = [
            ("^[a-z]+$", &["abc", "z"], &["", "aB", "ab1"]),
            ("abc", &["abc", "xxabcxx"], &["ab", "acb"]),
            ("^a{2,3}b?$", &["aa", "aaa", "aab"], &["a", "aaaa", "b"]),
            ("^(ab|cd)*$", &["", "ab", "abcdab"], &["abc", "a"]),
            ("^\\d{3}-\\d{4}$", &["555-1234"], &["5551234", "555-123"]),
            ("^[^\"\\\\]{1,3}$", &["é", "abc"], &["\"", "abcd"]),
            ("x$", &["ax", "x"], &["xa"]),
            ("^.$", &["a", "é"], &["\n", "ab"]),
            (
                "^(?:[A-Z][a-z]*)(\\s[A-Z][a-z]*){0,2}$",
                &["Ada", "Ada Love Lace"],
                &["ada", "A B C D"],
            ),
        ];
        for (re, yes, no) in cases {
            let p = Pattern::compile(re, "pattern").unwrap();
            for s in yes {
                assert!(matches(&p, s), "{re} should match {s:?}");
            }
            for s in no {
                assert!(!matches(&p, s), "{re} should not match {s:?}");
            }
        }
    }

    #[test]
    fn formats_match_their_examples() {
        let cases = [
            ("date", "2024-02-29", "2024-13-01"),
            ("time", "23:59:08.123+02:00", "24:00:00Z"),
            ("date-time", "2026-11-26T12:00:00Z", "2026-11-26 12:00:00Z"),
            (
                "uuid",
                "123e4567-e89b-12d3-a456-426614174000",
                "123e4567e89b12d3a456426614174000",
            ),
            ("email", "ada.lovelace@example.org", "ada@@example.org"),
        ];
        for (f, good, bad) in cases {
            let p = Pattern::format(f).unwrap();
            assert!(matches(&p, good), "{f}: {good}");
            assert!(!matches(&p, bad), "{f}: {bad}");
        }
        let e = Pattern::format("ipv6").unwrap_err();
        assert!(e.keyword == "format" && e.message.contains("ipv6"), "{e:?}");
    }

    #[test]
    fn unsupported_syntax_is_refused_by_name() {
        for re in [
            "(?=a)", "a*?", "\\1", "a^b", "\\bword", "é", "[a", "(a", "a{2", "a{3,1}", "a{99}", "\\p{L}",
        ] {
            let e = Pattern::compile(re, "pattern").unwrap_err();
            assert_eq!(e.keyword, "pattern", "{re}: {e:?}");
        }
        assert!(
            Pattern::compile(&"[a-z]".repeat(63), "pattern").is_err(),
            "too many positions"
        );
    }
}
