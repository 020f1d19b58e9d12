//! Unit tests on tiny synthetic vocabularies. The real-model comparisons against llama.cpp's ids live in
//! tests/tokenizer.rs.

use super::*;

const NORMAL: i64 = 1;
const CONTROL: i64 = 3;
const USER: i64 = 4;
const BYTE: i64 = 6;

fn no_meta() -> Metadata<'static> {
    Metadata {
        general_name: "",
        general_arch: "",
        get_u64: &|_| None,
        get_bool: &|_| None,
    }
}

/// A byte-level BPE vocab: every byte's mapped char, plus `extra` tokens, with `merges`.
fn bpe_vocab(pre: &str, extra: &[(&str, i64)], merges: &[&str], md: &Metadata) -> Vocab {
    let table = unicode::byte_to_char_table();
    let mut texts: Vec<Cow<str>> = table.iter().map(|c| Cow::Owned(c.to_string())).collect();
    let mut types = vec![NORMAL; 256];
    for (t, ty) in extra {
        texts.push(Cow::Owned(t.to_string()));
        types.push(*ty);
    }
    Vocab::build("gpt2", pre, texts, None, Some(types), Some(merges.to_vec()), md).expect("tiny BPE vocab builds")
}

fn texts_of(v: &Vocab, ids: &[u32]) -> Vec<String> {
    ids.iter().map(|&i| v.token_text(i).to_string()).collect()
}

#[test]
fn bpe_merges_words_after_the_smollm_split() {
    let v = bpe_vocab(
        "smollm",
        &[
            ("He", NORMAL),
            ("ll", NORMAL),
            ("llo", NORMAL),
            ("Hello", NORMAL),
            ("Ġw", NORMAL),
            ("Ġworld", NORMAL),
        ],
        &["H e", "l l", "ll o", "He llo", "Ġ w", "o r", "Ġw or", "Ġwor ld", "l d"],
        &no_meta(),
    );
    let ids = v.tokenize("Hello world", false, false);
    // "Ġworld" needs "Ġwor" and "ld", which are merge results but not tokens: rank order decides.
    let t = texts_of(&v, &ids);
    assert_eq!(t[0], "Hello");
    assert_eq!(t.concat(), "HelloĠworld");
    // Digits are always isolated by the smollm pre-tokenizer, even next to a space.
    let ids = v.tokenize("a 12", false, false);
    assert_eq!(texts_of(&v, &ids), ["a", "Ġ", "1", "2"]);
    // Decoding undoes the byte mapping.
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| v.token_bytes(i).to_vec()).collect();
    assert_eq!(bytes, b"a 12");
}

#[test]
fn bpe_non_ascii_bytes_round_trip() {
    let v = bpe_vocab("gpt-2", &[], &[], &no_meta());
    let ids = v.tokenize("é😀", false, false);
    let bytes: Vec<u8> = ids.iter().flat_map(|&i| v.token_bytes(i).to_vec()).collect();
    assert_eq!(bytes, "é😀".as_bytes());
    assert_eq!(ids.len(), 6); // one token per byte
    // A merge whose result is not a token: llama.cpp looks up the symbol's bytes one by one, and the
    // non-ASCII ones have no one-byte token, so the symbol is dropped. Reproduced as is.
    let v = bpe_vocab("gpt-2", &[], &["Ã ©"], &no_meta());
    assert_eq!(v.tokenize("aé", false, false), [b'a' as u32]);
}

#[test]
fn special_tokens_need_parse_special_but_user_defined_do_not() {
    let v = bpe_vocab("gpt-2", &[("<|im_start|>", CONTROL), ("<tag>", USER)], &[], &no_meta());
    let im = v.token_id("<|im_start|>").unwrap();
    let tag = v.token_id("<tag>").unwrap();
    let with = v.tokenize("<|im_start|>x<tag>", false, true);
    assert_eq!(with[0], im);
    assert_eq!(*with.last().unwrap(), tag);
    assert_eq!(with.len(), 3);
    let without = v.tokenize("<|im_start|>x<tag>", false, false);
    assert!(!without.contains(&im));
    assert_eq!(
        *without.last().unwrap(),
        tag,
        "user-defined tokens are matched even without parse_special"
    );
    assert_eq!(v.token_bytes(im), b"<|im_start|>");
    assert_eq!(v.token_bytes_visible(im), b"");
    assert_eq!(v.token_bytes_visible(tag), b"<tag>");
}

#[test]
fn partition_takes_longer_specials_first() {
    // "abc" (longer) is claimed before "xa", although "xa" starts earlier.
    let v = bpe_vocab("gpt-2", &[("abc", USER), ("xa", USER)], &[], &no_meta());
    let ids = v.tokenize("xabc", false, false);
    assert_eq!(texts_of(&v, &ids), ["x", "abc"]);
    // Same token repeated and overlapping itself: left to right, no overlap.
    let v = bpe_vocab("gpt-2", &[("aa", USER)], &[], &no_meta());
    let ids = v.tokenize("aaaaa", false, false);
    assert_eq!(texts_of(&v, &ids), ["aa", "aa", "a"]);
}

#[test]
fn bos_eos_and_eog_follow_metadata_and_names() {
    let md = Metadata {
        general_name: "",
        general_arch: "",
        get_u64: &|k| match k {
            "tokenizer.ggml.bos_token_id" => Some(257),
            "tokenizer.ggml.eos_token_id" => Some(258),
            _ => None,
        },
        get_bool: &|k| (k == "tokenizer.ggml.add_bos_token").then_some(true),
    };
    let v = bpe_vocab(
        "smollm",
        &[
            ("<|endoftext|>", CONTROL),
            ("<|im_start|>", CONTROL),
            ("<|im_end|>", CONTROL),
            ("<reponame>", CONTROL),
        ],
        &[],
        &md,
    );
    assert_eq!(v.bos(), Some(257));
    assert_eq!(v.eos(), Some(258));
    assert!(v.add_bos());
    // In the tiny vocab, token i is the mapped char of byte i.
    assert_eq!(v.tokenize("a", true, false), [257, b'a' as u32]);
    assert_eq!(v.tokenize("a", false, false), [b'a' as u32]);
    assert!(v.is_eog(256)); // <|endoftext|> by name
    assert!(v.is_eog(258)); // <|im_end|> by name and as EOS
    assert!(v.is_eog(259)); // <reponame> is taken as the FIM repo token, which llama.cpp counts as EOG
    assert!(!v.is_eog(257));
    assert_eq!(v.eog_ids(), [256, 258, 259]);
}

#[test]
fn spm_escapes_spaces_and_falls_back_to_bytes() {
    let mut texts: Vec<Cow<str>> = vec!["<pad>".into(), "<eos>".into(), "<bos>".into(), "<unk>".into()];
    let mut types = vec![CONTROL; 4];
    let mut scores = vec![0.0f32; 4];
    for b in 0..=255u8 {
        texts.push(format!("<0x{b:02X}>").into());
        types.push(BYTE);
        scores.push(0.0);
    }
    for (t, s, ty) in [
        ("▁", -2.0, NORMAL),
        ("H", -3.0, NORMAL),
        ("i", -3.0, NORMAL),
        ("Hi", -1.0, NORMAL),
        ("▁t", -1.5, NORMAL),
        ("h", -3.0, NORMAL),
        ("▁th", -1.2, NORMAL),
        ("e", -3.0, NORMAL),
        ("re", -1.4, NORMAL),
        ("  ", 0.0, USER),
        ("<start_of_turn>", 0.0, CONTROL),
    ] {
        texts.push(t.into());
        scores.push(s);
        types.push(ty);
    }
    let md = Metadata {
        general_name: "",
        general_arch: "",
        get_u64: &|k| match k {
            "tokenizer.ggml.bos_token_id" => Some(2),
            "tokenizer.ggml.eos_token_id" => Some(1),
            "tokenizer.ggml.unknown_token_id" => Some(3),
            _ => None,
        },
        get_bool: &|k| match k {
            "tokenizer.ggml.add_space_prefix" => Some(false),
            "tokenizer.ggml.add_bos_token" => Some(true),
            _ => None,
        },
    };
    let v = Vocab::build("llama", "default", texts, Some(scores), Some(types), None, &md).unwrap();
    assert_eq!(v.kind(), VocabKind::Spm);
    let id = |t: &str| v.token_id(t).unwrap();
    // "Hi" (-1.0) merges first, then "re" (-1.4), then "▁t" (-1.5), which makes "▁th" (-1.2) possible.
    let ids = v.tokenize("Hi there", false, false);
    assert_eq!(texts_of(&v, &ids), ["Hi", "▁th", "e", "re"]);
    assert_eq!(ids[0], id("Hi"));
    // Unknown characters become byte tokens.
    let ids = v.tokenize("é", false, false);
    assert_eq!(texts_of(&v, &ids), ["<0xC3>", "<0xA9>"]);
    assert_eq!(v.token_bytes(ids[0]), [0xC3]);
    // The user-defined double space is cut out before SPM runs; BOS is added with add_special.
    let ids = v.tokenize("Hi  Hi", true, false);
    assert_eq!(texts_of(&v, &ids), ["<bos>", "Hi", "  ", "Hi"]);
    // Control tokens only with parse_special.
    let ids = v.tokenize("<start_of_turn>Hi", false, true);
    assert_eq!(texts_of(&v, &ids), ["<start_of_turn>", "Hi"]);
    assert!(v.is_eog(1));
    assert_eq!(v.token_bytes(id("▁th")), b" th");
    assert_eq!(v.tokenize("", true, true), [2]);
    assert_eq!(v.tokenize("", false, true), Vec::<u32>::new());
}

#[test]
fn stream_decoder_holds_back_split_characters() {
    let mut d = StreamDecoder::new();
    let e = "é".as_bytes();
    assert_eq!(d.push_bytes(b"caf"), "caf");
    assert_eq!(d.push_bytes(&e[..1]), "");
    assert_eq!(d.pending(), &e[..1]);
    assert_eq!(d.push_bytes(&e[1..]), "é");
    // A four-byte emoji in three pieces.
    let emoji = "😀".as_bytes();
    assert_eq!(d.push_bytes(&emoji[..1]), "");
    assert_eq!(d.push_bytes(&emoji[1..3]), "");
    assert_eq!(d.push_bytes(&emoji[3..]), "😀");
    // Bytes that can never start a character are replaced at once.
    assert_eq!(d.push_bytes(&[0xFF, b'a']), "\u{FFFD}a");
    // An unfinished character at the end becomes U+FFFD on flush.
    assert_eq!(d.push_bytes(&e[..1]), "");
    assert_eq!(d.flush(), "\u{FFFD}");
    assert_eq!(d.flush(), "");
}

#[test]
fn chat_contents_are_plain_text_and_the_rest_is_unchanged() {
    let v = bpe_vocab("gpt-2", &[("<|im_start|>", CONTROL), ("<tag>", USER)], &[], &no_meta());
    let im = v.token_id("<|im_start|>").unwrap();
    let tag = v.token_id("<tag>").unwrap();
    let text = "<|im_start|>u\n<|im_start|>x<tag><|im_start|>";
    let content = 14..32; // "<|im_start|>x<tag>"
    assert_eq!(&text[content.clone()], "<|im_start|>x<tag>");
    let ids = v.tokenize_chat(text, false, std::slice::from_ref(&content));
    assert_eq!(
        ids.iter().filter(|&&i| i == im).count(),
        2,
        "only the template's two markers"
    );
    assert!(ids.contains(&tag), "user-defined tokens still match");
    // Without contents, exactly tokenize(.., true).
    assert_eq!(v.tokenize_chat(text, false, &[]), v.tokenize(text, false, true));
}

/// llama.cpp's name-based attributes: a model named Phi-3 drops the whitespace after its special tokens (but not
/// after `<|endoftext|>`); modern-bert drops the whitespace before `[MASK]`.
#[test]
fn name_based_strip_attributes() {
    let extra = [
        ("<|user|>", CONTROL),
        ("<|end|>", CONTROL),
        ("<|endoftext|>", CONTROL),
        ("[MASK]", USER),
    ];
    let named = |name: &'static str| Metadata {
        general_name: name,
        general_arch: "",
        get_u64: &|_| None,
        get_bool: &|_| None,
    };
    let phi3 = bpe_vocab("gpt-2", &extra, &[], &named("Phi-3 Mini 4k Instruct"));
    let text = "<|user|>\n Hi \n<|end|>\n<|endoftext|> x";
    assert_eq!(
        phi3.tokenize(text, false, true),
        phi3.tokenize("<|user|>Hi \n<|end|><|endoftext|> x", false, true)
    );
    // Without parse_special the markers are plain text and nothing is stripped.
    assert_eq!(phi3.tokenize(text, false, false).len(), text.len());
    let other = bpe_vocab("gpt-2", &extra, &[], &no_meta());
    // <|user|>, 6 bytes, <|end|>, "\n", <|endoftext|>, " x".
    assert_eq!(other.tokenize(text, false, true).len(), 12);
    let bert = bpe_vocab("gpt-2", &extra, &[], &named("modern-bert base"));
    assert_eq!(
        bert.tokenize("a \t[MASK] b", false, false),
        bert.tokenize("a[MASK] b", false, false)
    );
    assert_eq!(other.tokenize("a \t[MASK] b", false, false).len(), 6);
}

/// A `tokenizer.ggml.pre` Baton does not implement (Mistral's `tekken`, and any unknown name) is a load error
/// naming it, never a silently different split; the implemented families load.
#[test]
fn unimplemented_pre_tokenizer_is_refused() {
    let build = |pre: &str| {
        let table = unicode::byte_to_char_table();
        let texts: Vec<Cow<str>> = table.iter().map(|c| Cow::Owned(c.to_string())).collect();
        Vocab::build(
            "gpt2",
            pre,
            texts,
            None,
            Some(vec![NORMAL; 256]),
            Some(vec![]),
            &no_meta(),
        )
    };
    for pre in ["tekken", "deepseek-llm", "no-such-pre"] {
        let err = build(pre).err().expect("refused").to_string();
        assert!(err.contains(&format!("'{pre}'")), "{err}");
    }
    for pre in ["llama-bpe", "qwen2", "deepseek-r1-qwen", "gpt-2", "smollm"] {
        assert!(build(pre).is_ok(), "{pre}");
    }
    let err = Vocab::build("rwkv", "", vec!["a".into()], None, None, None, &no_meta())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("'rwkv'"), "{err}");
}
