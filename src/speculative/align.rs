//! Moving text between two vocabularies. The source of truth is the byte string the target has committed; each side
//! holds token ids that must spell a prefix of it. Re-tokenising choices affect only speed, never the output: a
//! badly aligned candidate is simply rejected by the target.

use crate::vocab::Vocab;

/// Tokens looked back over when re-encoding new text, so a word split across the boundary is tokenized the way the
/// model would have tokenized it whole (Hugging Face's universal assisted generation uses 10).
pub const LOOKBEHIND: usize = 4;

/// The longest prefix of `bytes` that is valid UTF-8.
pub fn utf8_prefix(bytes: &[u8]) -> &str {
    match std::str::from_utf8(bytes) {
        Ok(s) => s,
        Err(e) => std::str::from_utf8(&bytes[..e.valid_up_to()]).expect("validated prefix"),
    }
}

/// The bytes a token sequence spells.
pub fn spell(vocab: &Vocab, tokens: &[u32]) -> Vec<u8> {
    tokens
        .iter()
        .flat_map(|&t| vocab.token_bytes(t).iter().copied())
        .collect()
}

/// The longest `j` such that `tokens[..j]` spells a prefix of `text`, and the length of that spelling.
pub fn consistent_prefix(vocab: &Vocab, tokens: &[u32], text: &[u8]) -> (usize, usize) {
    let mut at = 0;
    for (j, &t) in tokens.iter().enumerate() {
        let b = vocab.token_bytes(t);
        if vocab.is_control(t) || !text[at..].starts_with(b) {
            return (j, at);
        }
        at += b.len();
    }
    (tokens.len(), at)
}

/// Token ids for `new`, the text that follows `held` (tokens already in the sequence). The last few held tokens are
/// re-encoded together with `new`; when their own encoding comes back unchanged, what follows it is the
/// continuation, tokenized as the whole text would be. Otherwise fewer tokens are looked back over, down to encoding
/// `new` alone. Only the valid UTF-8 part is encoded (a character cut short waits for the next round).
pub fn continue_tokens(vocab: &Vocab, held: &[u32], new: &[u8]) -> Vec<u32> {
    for lb in (0..=LOOKBEHIND.min(held.len())).rev() {
        let tail = &held[held.len() - lb..];
        if tail.iter().any(|&t| vocab.is_control(t)) {
            continue;
        }
        let mut bytes = spell(vocab, tail);
        let n_tail = bytes.len();
        if std::str::from_utf8(&bytes).is_err() {
            continue; // the tail starts inside a character
        }
        bytes.extend_from_slice(new);
        let text = utf8_prefix(&bytes);
        if text.len() <= n_tail {
            return Vec::new();
        }
        let ids = vocab.tokenize(text, false, false);
        if ids.len() > lb && ids[..lb] == *tail {
            return ids[lb..].to_vec();
        }
    }
    Vec::new()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gguf::GgufFile;

    /// SmolLM2's vocabulary, fetched into the cache on first use (the tests fail rather than pass untested).
    fn vocab() -> Vocab {
        let p = crate::fetch::resolve("smollm2").unwrap_or_else(|e| panic!("model smollm2 unavailable: {e:#}"));
        Vocab::from_gguf(&GgufFile::open(&p).unwrap()).unwrap()
    }

    #[test]
    fn continuation_tokenizes_like_the_whole_text() {
        let v = vocab();
        let whole = v.tokenize("The cat sat on the mat, quietly.", false, false);
        let held = v.tokenize("The cat sat", false, false);
        assert_eq!(whole[..held.len()], held[..]);
        let more = continue_tokens(&v, &held, b" on the mat, quietly.");
        assert_eq!(more, whole[held.len()..]);
        // A character cut short waits: "é" is two bytes, only the first is given.
        let cut = continue_tokens(&v, &held, &" caf\u{e9}".as_bytes()[..4]);
        assert_eq!(spell(&v, &cut), b" caf");
    }

    #[test]
    fn consistent_prefix_stops_at_the_first_token_that_leaves_the_text() {
        let v = vocab();
        let toks = v.tokenize("Hello world again", false, false);
        let (j, n) = consistent_prefix(&v, &toks, b"Hello world");
        assert_eq!(spell(&v, &toks[..j]), b"Hello world");
        assert_eq!(n, 11);
        let (j, n) = consistent_prefix(&v, &toks, b"Hello wor");
        assert_eq!((j, n), (1, 5));
        assert_eq!(utf8_prefix(&[b'a', 0xc3]), "a");
    }
}
