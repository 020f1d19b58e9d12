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
