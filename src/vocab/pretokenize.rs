//! BPE pre-tokenizers: split a text fragment into words before merges run, exactly as llama.cpp's
//! `unicode_regex_split` does for the regex lists of the supported `tokenizer.ggml.pre` types.
//!
//! Written by hand rather than with a regex crate: llama.cpp itself does not run these patterns as regexes.
//! It runs hand-written matchers for the GPT-2 and Llama-3 patterns (whose `\s+(?!\S)` handling, bounds at
//! segment edges and treatment of unassigned codepoints differ in small ways from a real regex engine), and
//! it runs `\p{N}` through std::regex on a "collapsed" one-byte-per-codepoint text. Matching those rules
//! token for token is easier and safer with a direct port of the rules than with `fancy-regex`.

use super::unicode::Flags;

/// Which split llama.cpp applies for a pre-tokenizer type.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PreSplit {
    /// `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)` (gpt-2, phi-2, mpt, olmo, ...).
    Gpt2,
    /// `\p{N}` isolated first, then the GPT-2 pattern (smollm, starcoder, refact, command-r, codeshell, ...).
    DigitsThenGpt2,
    /// The Llama-3 pattern with `\p{N}{1,3}` (llama3, dbrx, smaug, chatglm4, ...).
    Llama3,
    /// The same pattern with single digits, `\p{N}` (qwen2, stablelm2, hunyuan, megrez, ...).
    Qwen2,
}

/// A text's codepoints with their byte offsets and flags, shared by the splitters.
struct Cpts {
    chars: Vec<char>,
    /// Byte offset of each codepoint, plus the text length at the end.
    offs: Vec<usize>,
    flags: Vec<Flags>,
}

impl Cpts {
    fn new(text: &str) -> Cpts {
        let n = text.len();
        let mut chars = Vec::with_capacity(n);
        let mut offs = Vec::with_capacity(n + 1);
        let mut flags = Vec::with_capacity(n);
        for (i, c) in text.char_indices() {
            chars.push(c);
            offs.push(i);
            flags.push(Flags::of(c));
        }
        offs.push(n);
        Cpts { chars, offs, flags }
    }
}

/// Split `text` into words; returns byte ranges covering the whole text, in order.
pub fn split(text: &str, how: PreSplit) -> Vec<(usize, usize)> {
    if text.is_empty() {
        return Vec::new();
    }
    let cp = Cpts::new(text);
    let n = cp.chars.len();
    // Segments in codepoint indices: each later pattern only splits inside the segments of the earlier ones.
    let mut segments: Vec<(usize, usize)> = vec![(0, n)];
    if how == PreSplit::DigitsThenGpt2 {
        segments = isolate_numbers(&cp, &segments);
    }
    let mut words = Vec::with_capacity(n / 3 + 1);
    for &(ini, end) in &segments {
        match how {
            PreSplit::Gpt2 | PreSplit::DigitsThenGpt2 => gpt2_segment(&cp, ini, end, &mut words),
            PreSplit::Llama3 => llama3_segment(&cp, ini, end, 3, &mut words),
            // llama.cpp's qwen2 matcher is the llama3 one taking one digit at a time.
            PreSplit::Qwen2 => llama3_segment(&cp, ini, end, 1, &mut words),
        }
    }
    words.into_iter().map(|(a, b)| (cp.offs[a], cp.offs[b])).collect()
}

/// The `\p{N}` pass: llama.cpp runs it with std::regex over the collapsed text, where ASCII stays itself and
/// any other number codepoint becomes the byte 0xD1, and the pattern becomes `[\xD1\x30-\x39]`. Every
/// number codepoint thus becomes its own segment; the text between matches stays as one segment.
fn isolate_numbers(cp: &Cpts, segments: &[(usize, usize)]) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(segments.len() * 2);
    for &(ini, end) in segments {
        let mut start = ini;
        for pos in ini..end {
            if cp.flags[pos].is_number() {
                if pos > start {
                    out.push((start, pos));
                }
                out.push((pos, pos + 1));
                start = pos + 1;
            }
        }
        if start < end {
            out.push((start, end));
        }
    }
    out
}

/// Emits words in one segment, tracking where the previous word ended (llama.cpp's `_add_token`).
struct Emitter<'a> {
    out: &'a mut Vec<(usize, usize)>,
    prev_end: usize,
}

impl Emitter<'_> {
    fn add(&mut self, end: usize) -> usize {
        let len = end - self.prev_end;
        if len > 0 {
            self.out.push((self.prev_end, end));
        }
        self.prev_end = end;
        len
    }
}

/// llama.cpp's `unicode_regex_split_custom_gpt2` for one segment `[ini, end)`.
fn gpt2_segment(cp: &Cpts, ini: usize, end: usize, out: &mut Vec<(usize, usize)>) {
    let get_cpt = |pos: usize| {
        if pos >= ini && pos < end {
            Some(cp.chars[pos])
        } else {
            None
        }
    };
    let get_flags = |pos: usize| {
        if pos >= ini && pos < end {
            cp.flags[pos]
        } else {
            Flags::OUT_OF_RANGE
        }
    };
    let mut em = Emitter { out, prev_end: ini };
    let mut pos = ini;
    while pos < end {
        let cpt = cp.chars[pos];
        let flags = cp.flags[pos];

        // 's|'t|'re|'ve|'m|'ll|'d (lowercase only)
        if cpt == '\'' && pos + 1 < end {
            let next = cp.chars[pos + 1];
            if matches!(next, 's' | 't' | 'm' | 'd') {
                pos += em.add(pos + 2);
                continue;
            }
            if pos + 2 < end {
                let nn = cp.chars[pos + 2];
                if matches!((next, nn), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    pos += em.add(pos + 3);
                    continue;
                }
            }
        }

        let space = cpt == ' ';
        let mut flags2 = if space { get_flags(pos + 1) } else { flags };
        // <space>?\p{L}+
        if flags2.is_letter() {
            pos += space as usize;
            while flags2.is_letter() {
                pos += 1;
                flags2 = get_flags(pos);
            }
            em.add(pos);
            continue;
        }
        // <space>?\p{N}+
        if flags2.is_number() {
            pos += space as usize;
            while flags2.is_number() {
                pos += 1;
                flags2 = get_flags(pos);
            }
            em.add(pos);
            continue;
        }
        // <space>?[^\s\p{L}\p{N}]+ ; out-of-range positions (no flags at all) never match
        let other = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number()) && f.any();
        if other(flags2) {
            pos += space as usize;
            while other(flags2) {
                pos += 1;
                flags2 = get_flags(pos);
            }
            em.add(pos);
            continue;
        }

        let mut num_ws = 0;
        while get_flags(pos + num_ws).is_whitespace() {
            num_ws += 1;
        }
        // \s+(?!\S): leave the last whitespace for the next word unless the run ends the segment
        if num_ws > 1 && get_cpt(pos + num_ws).is_some() {
            pos += num_ws - 1;
            em.add(pos);
            continue;
        }
        // \s+
        if num_ws > 0 {
            pos += num_ws;
            em.add(pos);
            continue;
        }
        // no match: one codepoint alone
        pos += 1;
        em.add(pos);
    }
}

/// Lowercase for the contraction check of the Llama-3 pattern; only ASCII letters can matter there.
fn lower(c: Option<char>) -> Option<char> {
    c.map(|c| c.to_lowercase().next().unwrap_or(c))
}

/// llama.cpp's `unicode_regex_split_custom_llama3` (`max_digits` 3) and `..._qwen2` (`max_digits` 1) for
/// one segment `[ini, end)`.
fn llama3_segment(
    cp: &Cpts,
    ini: usize,
    end: usize,
    max_digits: usize,
    out: &mut Vec<(usize, usize)>,
) {
    let get_cpt = |pos: usize| {
        if pos >= ini && pos < end {
            Some(cp.chars[pos])
        } else {
            None
        }
    };
    let get_flags = |pos: usize| {
        if pos >= ini && pos < end {
            cp.flags[pos]
        } else {
            Flags::OUT_OF_RANGE
        }
    };
    let mut em = Emitter { out, prev_end: ini };
    let mut pos = ini;
    while pos < end {
        let cpt = cp.chars[pos];
        let flags = cp.flags[pos];

        // (?i:'s|'t|'re|'ve|'m|'ll|'d)
        if cpt == '\'' && pos + 1 < end {
            let next = lower(get_cpt(pos + 1));
            if matches!(next, Some('s' | 't' | 'm' | 'd')) {
                pos += em.add(pos + 2);
                continue;
            }
            if pos + 2 < end {
                let nn = lower(get_cpt(pos + 2));
                if matches!(
                    (next, nn),
                    (Some('r'), Some('e')) | (Some('v'), Some('e')) | (Some('l'), Some('l'))
                ) {
                    pos += em.add(pos + 3);
                    continue;
                }
            }
        }

        // [^\r\n\p{L}\p{N}]?\p{L}+
        if !(cpt == '\r' || cpt == '\n' || flags.is_number()) && (flags.is_letter() || get_flags(pos + 1).is_letter()) {
            pos += 1;
            while get_flags(pos).is_letter() {
                pos += 1;
            }
            em.add(pos);
            continue;
        }

        // \p{N}{1,3} (or \p{N})
        if flags.is_number() {
            let mut ini_n = pos;
            while get_flags(pos).is_number() {
                pos += 1;
                if pos - ini_n >= max_digits {
                    em.add(pos);
                    ini_n = pos;
                }
            }
            em.add(pos);
            continue;
        }

        // <space>?[^\s\p{L}\p{N}]+[\r\n]*  (llama.cpp tests `flags`, not `flags2`, for "any flag" here)
        let space = cpt == ' ';
        let mut flags2 = if space { get_flags(pos + 1) } else { flags };
        let other = |f: Flags| !(f.is_whitespace() || f.is_letter() || f.is_number());
        if other(flags2) && flags.any() {
            pos += space as usize;
            while other(flags2) && flags2.any() {
                pos += 1;
                flags2 = get_flags(pos);
            }
            while matches!(get_cpt(pos), Some('\r' | '\n')) {
                pos += 1;
            }
            em.add(pos);
            continue;
        }

        let mut num_ws = 0;
        let mut last_end_rn = 0;
        while get_flags(pos + num_ws).is_whitespace() {
            if matches!(get_cpt(pos + num_ws), Some('\r' | '\n')) {
                last_end_rn = pos + num_ws + 1;
            }
            num_ws += 1;
        }
        // \s*[\r\n]+
        if last_end_rn > 0 {
            pos = last_end_rn;
            em.add(pos);
            continue;
        }
        // \s+(?!\S)
        if num_ws > 1 && get_cpt(pos + num_ws).is_some() {
            pos += num_ws - 1;
            em.add(pos);
            continue;
        }
        // \s+
        if num_ws > 0 {
            pos += num_ws;
            em.add(pos);
            continue;
        }
        pos += 1;
        em.add(pos);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn words(text: &str, how: PreSplit) -> Vec<&str> {
        split(text, how).into_iter().map(|(a, b)| &text[a..b]).collect()
    }

    #[test]
    fn gpt2_basic_words_and_spaces() {
        assert_eq!(words("Hello world", PreSplit::Gpt2), ["Hello", " world"]);
        assert_eq!(words("Hello  world", PreSplit::Gpt2), ["Hello", " ", " world"]);
        assert_eq!(words("a   ", PreSplit::Gpt2), ["a", "   "]);
        assert_eq!(words("I'm he'll", PreSplit::Gpt2), ["I", "'m", " he", "'ll"]);
        // uppercase contractions are not special in the GPT-2 pattern
        assert_eq!(words("I'M", PreSplit::Gpt2), ["I", "'", "M"]);
        assert_eq!(words("x!!! ?", PreSplit::Gpt2), ["x", "!!!", " ?"]);
        assert_eq!(words("\n\n", PreSplit::Gpt2), ["\n\n"]);
        assert_eq!(words("a\n\nb", PreSplit::Gpt2), ["a", "\n", "\n", "b"]);
        assert_eq!(words(" 123", PreSplit::Gpt2), [" 123"]);
    }

    #[test]
    fn smollm_isolates_every_digit() {
        assert_eq!(words("a 123", PreSplit::DigitsThenGpt2), ["a", " ", "1", "2", "3"]);
        assert_eq!(words("x²+½", PreSplit::DigitsThenGpt2), ["x", "²", "+", "½"]);
        assert_eq!(words("v1.2", PreSplit::DigitsThenGpt2), ["v", "1", ".", "2"]);
    }

    #[test]
    fn llama3_groups_digits_by_three_and_newlines() {
        assert_eq!(words("1234567", PreSplit::Llama3), ["123", "456", "7"]);
        assert_eq!(words("Hello\n\n world", PreSplit::Llama3), ["Hello", "\n\n", " world"]);
        assert_eq!(words("I'M", PreSplit::Llama3), ["I", "'M"]);
        assert_eq!(
            words("x 1234", PreSplit::Qwen2),
            ["x", " ", "1", "2", "3", "4"]
        );
        // one non-letter may lead a letter run; punctuation takes trailing newlines
        assert_eq!(words("\"hi\"\n\n", PreSplit::Qwen2), ["\"hi", "\"\n\n"]);
    }

    #[test]
    fn split_covers_the_whole_text() {
        let text = "Emoji: 😀🎉👍🏽 zero\u{200b}width  tabs\t\tend \u{3000}x";
        for how in [
            PreSplit::Gpt2,
            PreSplit::DigitsThenGpt2,
            PreSplit::Llama3,
            PreSplit::Qwen2,
        ] {
            let joined: String = words(text, how).concat();
            assert_eq!(joined, text);
        }
    }
}
