//! Property-based fuzzing (proptest) of every decoder that reads bytes Baton did not write: GGUF files (and the
//! model and tokenizer built from them), the tokenizers, wire frames, KV snapshots and HTTP request bodies.
//!
//! Each target starts from real inputs (the generated models of `tests/models`, encoded frames and snapshots, valid
//! requests) and mutates them, or builds structured ones that reach deep into the decoder. The property is the same
//! everywhere: a value or a clear error, never a panic, and no allocation far beyond the input's own size (counted
//! by this binary's allocator, per thread). Failures proptest finds are saved under `tests/fuzz.proptest-regressions`
//! and replayed first by every later run.
//!
//! `BATON_FUZZ_CASES` sets the cases per target (default 256, the CI run, a few seconds in all); `scripts/fuzz`
//! runs them for as long as asked, each case in a child process (`BATON_FUZZ_FORK`) so aborts and hangs (20 s) are
//! caught too.

#[path = "common/mod.rs"]
mod common;

use baton::cluster::wire::{self, Msg};
use baton::engine::kv_cache::KvBlock;
use baton::engine::snapshot::{self, RowDtype};
use baton::gguf::{GgmlType, GgufFile, GgufWriter, Value};
use baton::model::Model;
use baton::server::openai;
use baton::vocab::{StreamDecoder, Vocab};
use proptest::prelude::*;
use proptest::sample::Index;
use proptest::test_runner::{Config, FileFailurePersistence};
use std::alloc::{GlobalAlloc, Layout, System};
use std::cell::Cell;
use std::path::Path;

mod counting {
    use super::*;

    thread_local! {
        static LIVE: Cell<isize> = const { Cell::new(0) };
        static PEAK: Cell<isize> = const { Cell::new(0) };
    }

    fn note(delta: isize) {
        let _ = LIVE.try_with(|live| {
            let now = live.get() + delta;
            live.set(now);
            let _ = PEAK.try_with(|p| p.set(p.get().max(now)));
        });
    }

    pub struct Counting;
    // SAFETY: forwards to the system allocator unchanged; the thread-locals are const-initialised with no destructor,
    // so touching them never allocates or recurses.
    unsafe impl GlobalAlloc for Counting {
        unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
            let p = unsafe { System.alloc(layout) };
            if !p.is_null() {
                note(layout.size() as isize);
            }
            p
        }
        unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
            let p = unsafe { System.alloc_zeroed(layout) };
            if !p.is_null() {
                note(layout.size() as isize);
            }
            p
        }
        unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
            unsafe { System.dealloc(ptr, layout) };
            note(-(layout.size() as isize));
        }
        unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
            let p = unsafe { System.realloc(ptr, layout, new_size) };
            if !p.is_null() {
                note(new_size as isize - layout.size() as isize);
            }
            p
        }
    }

    #[global_allocator]
    static GLOBAL: Counting = Counting;

    /// Runs `f` and returns its result with the most bytes it held allocated at once on this thread.
    pub fn peak_during<R>(f: impl FnOnce() -> R) -> (R, usize) {
        let base = LIVE.with(Cell::get);
        PEAK.with(|p| p.set(base));
        let r = f();
        (r, (PEAK.with(Cell::get) - base).max(0) as usize)
    }
}
use counting::peak_during;

fn config() -> Config {
    let cases = std::env::var("BATON_FUZZ_CASES")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(256);
    // Long runs (scripts/fuzz) run each case in a child process with a time limit, so that an abort or a hang is
    // caught, shrunk and saved like a panic.
    let fork = std::env::var_os("BATON_FUZZ_FORK").is_some();
    Config {
        cases,
        fork,
        timeout: if fork { 20_000 } else { 0 },
        failure_persistence: Some(Box::new(FileFailurePersistence::SourceParallel("proptest-regressions"))),
        ..Config::default()
    }
}

const MIB: usize = 1 << 20;

/// Values that sit on the edges decoders get wrong: zero, one, sign and width boundaries, and the f32 NaN and
/// infinities as bit patterns.
const EDGES: [u64; 16] = [
    0,
    1,
    2,
    0x7f,
    0xff,
    0xffff,
    0x7fff_ffff,
    0xffff_ffff,
    1 << 32,
    1 << 40,
    i64::MAX as u64,
    u64::MAX,
    0x7fc0_0000,
    0x7f80_0000,
    0xff80_0000,
    0x4000,
];

/// One change to a byte string; offsets are taken modulo the region being mutated.
#[derive(Clone, Debug)]
enum Mutation {
    Flip(Index, u8),
    Edge32(Index, usize),
    Edge64(Index, usize),
    Truncate(Index),
    Insert(Index, Vec<u8>),
    Remove(Index, u8),
}

fn mutation() -> impl Strategy<Value = Mutation> {
    prop_oneof![
        4 => (any::<Index>(), 0u8..8).prop_map(|(i, b)| Mutation::Flip(i, b)),
        3 => (any::<Index>(), 0..EDGES.len()).prop_map(|(i, e)| Mutation::Edge32(i, e)),
        3 => (any::<Index>(), 0..EDGES.len()).prop_map(|(i, e)| Mutation::Edge64(i, e)),
        1 => any::<Index>().prop_map(Mutation::Truncate),
        1 => (any::<Index>(), prop::collection::vec(any::<u8>(), 1..16)).prop_map(|(i, b)| Mutation::Insert(i, b)),
        1 => (any::<Index>(), 1u8..32).prop_map(|(i, n)| Mutation::Remove(i, n)),
    ]
}

/// Applies `muts` to the first `region` bytes of `bytes` (the whole of it when `region` is larger).
fn mutate(bytes: &mut Vec<u8>, region: usize, muts: &[Mutation]) {
    for m in muts {
        let n = region.min(bytes.len());
        if n == 0 {
            return;
        }
        match m {
            Mutation::Flip(i, bit) => bytes[i.index(n)] ^= 1 << bit,
            Mutation::Edge32(i, e) => {
                let at = i.index(n).min(bytes.len().saturating_sub(4));
                let end = (at + 4).min(bytes.len());
                bytes[at..end].copy_from_slice(&(EDGES[*e] as u32).to_le_bytes()[..end - at]);
            }
            Mutation::Edge64(i, e) => {
                let at = i.index(n).min(bytes.len().saturating_sub(8));
                let end = (at + 8).min(bytes.len());
                bytes[at..end].copy_from_slice(&EDGES[*e].to_le_bytes()[..end - at]);
            }
            Mutation::Truncate(i) => bytes.truncate(i.index(n)),
            Mutation::Insert(i, b) => {
                let at = i.index(n);
                bytes.splice(at..at, b.iter().copied());
            }
            Mutation::Remove(i, k) => {
                let at = i.index(n);
                let end = (at + *k as usize).min(bytes.len());
                bytes.drain(at..end);
            }
        }
    }
}

fn model_path(name: &str) -> std::path::PathBuf {
    common::model(name)
}

/// The generated models' bytes and where their tensor data starts (what precedes it is header and metadata).
fn gguf_seeds() -> Vec<(Vec<u8>, usize)> {
    common::GENERATED
        .iter()
        .map(|name| {
            let p = model_path(name);
            let g = GgufFile::open(&p).unwrap();
            (std::fs::read(&p).unwrap(), g.data_offset)
        })
        .collect()
}

/// Opens `bytes` as a GGUF file and builds what Baton builds from one: the model, the tokenizer, and a few tokens
/// through it. Any error is fine; returns whether the model loaded.
fn load_everything(bytes: &[u8], dir: &Path) -> bool {
    let p = dir.join("m.gguf");
    std::fs::write(&p, bytes).unwrap();
    let Ok(g) = GgufFile::open(&p) else { return false };
    if let Ok(v) = Vocab::from_gguf(&g) {
        let ids = v.tokenize("Hello, world! <|im_start|> 12345", true, true);
        let _ = v.detokenize(&ids);
    }
    drop(g);
    Model::load(&p).is_ok()
}

/// The unmutated seeds load, within the same allocation bound the mutants are held to: the bound is not what
/// makes the fuzz target pass.
#[test]
fn gguf_seeds_load_within_the_bound() {
    let dir = tempfile::tempdir().unwrap();
    for (bytes, _) in gguf_seeds() {
        let (ok, peak) = peak_during(|| load_everything(&bytes, dir.path()));
        assert!(ok, "a generated model failed to load");
        assert!(
            peak <= gguf_bound(bytes.len()),
            "{peak} bytes for a {}-byte model",
            bytes.len()
        );
    }
}

/// Loading holds at most four times the file plus 16 MiB at once: a header that announces more elements than its
/// bytes could hold must be refused before anything is reserved for them.
fn gguf_bound(file_len: usize) -> usize {
    4 * file_len + 16 * MIB
}

proptest! {
    #![proptest_config(config())]

    /// Mutated headers and metadata of the generated models (flipped bits, edge values over counts, lengths, types
    /// and offsets, truncation, inserted and removed bytes): open, model load and tokenizer never panic, and never
    /// hold more than `gguf_bound` at once.
    #[test]
    fn gguf_reader_survives_mutations(
        seed in 0..common::GENERATED.len(),
        muts in prop::collection::vec(mutation(), 1..6),
    ) {
        thread_local! { static SEEDS: Vec<(Vec<u8>, usize)> = gguf_seeds(); }
        let (mut bytes, header) = SEEDS.with(|s| s[seed].clone());
        mutate(&mut bytes, header + 64, &muts);
        let dir = tempfile::tempdir().unwrap();
        let (_, peak) = peak_during(|| load_everything(&bytes, dir.path()));
        prop_assert!(peak <= gguf_bound(bytes.len()), "{peak} bytes held loading a {}-byte file", bytes.len());
    }
}

/// One change to a GGUF file's meaning rather than its bytes: a metadata value replaced by an edge of its type, by
/// another type or by nested arrays; a key removed; a tensor's shape or type changed, or the tensor dropped.
#[derive(Clone, Debug)]
enum Edit {
    Number(Index, usize),
    Float(Index, f32),
    Retype(Index),
    /// An array of one array of `n` u8s: one byte each in the file.
    NestedBytes(Index, usize),
    RemoveKey(Index),
    TensorDim(Index, Index, usize),
    TensorType(Index, u32),
    DropTensor(Index),
}

fn edit() -> impl Strategy<Value = Edit> {
    let floats = prop_oneof![
        Just(f32::NAN),
        Just(f32::INFINITY),
        Just(f32::NEG_INFINITY),
        Just(0.0f32),
        Just(-1.0f32),
        Just(1e30f32),
        Just(1e-30f32),
        any::<f32>()
    ];
    prop_oneof![
        4 => (any::<Index>(), 0..EDGES.len()).prop_map(|(i, e)| Edit::Number(i, e)),
        2 => (any::<Index>(), floats).prop_map(|(i, f)| Edit::Float(i, f)),
        1 => any::<Index>().prop_map(Edit::Retype),
        1 => (any::<Index>(), prop_oneof![Just(0usize), Just(1000), Just(2_000_000)])
            .prop_map(|(i, n)| Edit::NestedBytes(i, n)),
        1 => any::<Index>().prop_map(Edit::RemoveKey),
        2 => (any::<Index>(), any::<Index>(), 0..EDGES.len()).prop_map(|(t, d, e)| Edit::TensorDim(t, d, e)),
        1 => (any::<Index>(), 0u32..45).prop_map(|(t, ty)| Edit::TensorType(t, ty)),
        1 => any::<Index>().prop_map(Edit::DropTensor),
    ]
}

/// A seed model as a writer: its metadata (lazy arrays parsed) and tensors, to edit and write again.
fn gguf_writer(name: &str) -> GgufWriter {
    GgufWriter::from_file(&GgufFile::open(&model_path(name)).unwrap()).unwrap()
}

fn apply_edit(w: &mut GgufWriter, e: &Edit) {
    let n_meta = w.metadata.len();
    let n_tensors = w.tensors.len();
    match e {
        Edit::Number(i, edge) => {
            let v = &mut w.metadata[i.index(n_meta)].1;
            let x = EDGES[*edge];
            *v = match v {
                Value::U8(_) => Value::U8(x as u8),
                Value::I8(_) => Value::I8(x as i8),
                Value::U16(_) => Value::U16(x as u16),
                Value::I16(_) => Value::I16(x as i16),
                Value::U32(_) => Value::U32(x as u32),
                Value::I32(_) => Value::I32(x as i32),
                Value::I64(_) => Value::I64(x as i64),
                Value::Array(a) if !a.is_empty() => {
                    let mut a = a.clone();
                    let k = x as usize % a.len();
                    a[k] = Value::U64(x);
                    Value::Array(a)
                }
                _ => Value::U64(x),
            };
        }
        Edit::Float(i, f) => {
            let v = &mut w.metadata[i.index(n_meta)].1;
            *v = match v {
                Value::F64(_) => Value::F64(*f as f64),
                _ => Value::F32(*f),
            };
        }
        Edit::Retype(i) => {
            let v = &mut w.metadata[i.index(n_meta)].1;
            *v = match v {
                Value::Str(_) => Value::U32(7),
                _ => Value::Str("7".into()),
            };
        }
        Edit::NestedBytes(i, n) => {
            w.metadata[i.index(n_meta)].1 = Value::Array(vec![Value::Array(vec![Value::U8(1); *n])]);
        }
        Edit::RemoveKey(i) => {
            w.metadata.remove(i.index(n_meta));
        }
        Edit::TensorDim(t, d, edge) => {
            let dims = &mut w.tensors[t.index(n_tensors)].1;
            let k = d.index(dims.len());
            dims[k] = EDGES[*edge];
        }
        Edit::TensorType(t, ty) => {
            if let Some(ty) = GgmlType::from_u32(*ty) {
                w.tensors[t.index(n_tensors)].2 = ty;
            }
        }
        Edit::DropTensor(t) => {
            w.tensors.remove(t.index(n_tensors));
        }
    }
}

proptest! {
    #![proptest_config(config())]

    /// Well-formed files saying wrong things: edge values in every metadata key (layer and head counts, lengths,
    /// RoPE bases, token ids, token types), other types, nested arrays, missing keys, tensors of wrong shape or
    /// type or missing. Loading refuses them or loads them, never panics, and holds at most `gguf_bound`.
    #[test]
    fn gguf_loader_survives_edited_metadata(
        seed in 0..common::GENERATED.len(),
        edits in prop::collection::vec(edit(), 1..4),
    ) {
        thread_local! {
            static WRITERS: Vec<GgufWriter> = common::GENERATED.iter().map(|n| gguf_writer(n)).collect();
        }
        let bytes = WRITERS.with(|ws| {
            let src = &ws[seed];
            let mut w = GgufWriter::new();
            w.metadata = src.metadata.clone();
            w.tensors = src.tensors.clone();
            for e in &edits {
                if !w.metadata.is_empty() && !w.tensors.is_empty() {
                    apply_edit(&mut w, e);
                }
            }
            w.to_bytes()
        });
        let dir = tempfile::tempdir().unwrap();
        let (_, peak) = peak_during(|| load_everything(&bytes, dir.path()));
        prop_assert!(peak <= gguf_bound(bytes.len()), "{peak} bytes held loading a {}-byte file", bytes.len());
    }
}

/// What the fuzzers found, replayed as plain tests with the error each now gives.
#[test]
fn gguf_findings_are_clear_errors() {
    let dir = tempfile::tempdir().unwrap();
    let load = |edit: &dyn Fn(&mut GgufWriter)| -> String {
        let mut w = gguf_writer("llama3");
        edit(&mut w);
        let p = dir.path().join("found.gguf");
        w.write(&p).unwrap();
        let (r, peak) = peak_during(|| Model::load(&p));
        assert!(peak <= 64 * MIB, "{peak} bytes held");
        format!("{:#}", r.err().expect("the edited model loaded"))
    };
    let set = |w: &mut GgufWriter, key: &str, v: Value| {
        w.metadata.iter_mut().find(|(k, _)| k == key).unwrap().1 = v;
    };
    // A block count of 2^32 - 1: `Vec::with_capacity` of that many layers aborted the process.
    let e = load(&|w| set(w, "llama.block_count", Value::U32(u32::MAX)));
    assert!(
        e.contains("llama.block_count is 4294967295, but the file holds only"),
        "{e}"
    );
    // An array of a million one-byte arrays' elements: 32 bytes of memory per byte of file.
    let e = load(&|w| {
        set(
            w,
            "general.name",
            Value::Array(vec![Value::Array(vec![Value::U8(1); 1 << 20])]),
        )
    });
    assert!(e.contains("an array of arrays"), "{e}");
    // A row length of 2^63 - 1: its bytes overflowed (a panic with overflow checks, a wrapped size without).
    let e = load(&|w| {
        let vector = w
            .tensors
            .iter_mut()
            .find(|t| t.1.len() == 1 && t.2 == GgmlType::F32)
            .unwrap();
        vector.1[0] = i64::MAX as u64;
    });
    assert!(e.contains("or too large"), "{e}");
}

/// The tokenizers of the two default models and of the generated ones (SentencePiece, and byte-level BPE with the
/// llama-bpe, qwen2 and SmolLM2 pre-tokenizers).
fn vocabs() -> Vec<(String, Vocab)> {
    ["smollm2", "gemma3", "llama3", "qwen2"]
        .iter()
        .map(|name| {
            let g = GgufFile::open(&model_path(name)).unwrap();
            (name.to_string(), Vocab::from_gguf(&g).unwrap())
        })
        .collect()
}

/// Text that tokenizers find hard: any Unicode, runs of spaces and newlines, digits, contractions, CJK and emoji,
/// and the control-token texts of the vocabularies spliced in.
fn hard_text() -> impl Strategy<Value = String> {
    let piece = prop_oneof![
        3 => any::<String>(),
        2 => "[ \t\n]{1,6}",
        2 => "[0-9]{1,12}",
        1 => "('s|'t|'re|'ve|'m|'ll|'d|n't)",
        1 => "[\u{4e00}-\u{4e20}\u{3040}-\u{3060}]{1,4}",
        1 => "[\u{1F600}-\u{1F640}\u{200d}\u{fe0f}]{1,4}",
        1 => Just("<|im_start|>".to_string()),
        1 => Just("<start_of_turn>".to_string()),
        1 => Just("<|endoftext|>".to_string()),
        1 => Just("\u{fffd}".to_string()),
    ];
    prop::collection::vec(piece, 0..8).prop_map(|v| v.concat())
}

proptest! {
    #![proptest_config(config())]

    /// Any text: ids within the vocabulary, with and without special-token parsing, and the text back unchanged
    /// through `detokenize` and through the streaming decoder, piece by piece, when special tokens are not parsed.
    #[test]
    fn tokenizers_round_trip_any_text(text in hard_text()) {
        thread_local! { static VOCABS: Vec<(String, Vocab)> = vocabs(); }
        VOCABS.with(|vocabs| -> Result<(), TestCaseError> {
            for (name, v) in vocabs {
                let ids = v.tokenize(&text, false, false);
                prop_assert!(ids.iter().all(|&t| (t as usize) < v.n_tokens()), "{name}: id out of range");
                prop_assert_eq!(&v.detokenize(&ids), &text, "{}: detokenize(tokenize(text))", name);
                let mut stream = StreamDecoder::new();
                let streamed: String = ids.iter().map(|&t| stream.push(v, t)).collect();
                prop_assert_eq!(&streamed, &text, "{}: streamed pieces", name);
                let special = v.tokenize(&text, true, true);
                prop_assert!(special.iter().all(|&t| (t as usize) < v.n_tokens()), "{name}: special id out of range");
                let _ = v.detokenize(&special);
            }
            Ok(())
        })?;
    }
}

/// One field of a structured payload: the wire's fixed-width numbers and its length-prefixed runs, with small counts
/// more likely than arbitrary ones, so that generated payloads get past the first length checks.
#[derive(Clone, Debug)]
enum Field {
    U8(u8),
    U16(u16),
    U32(u32),
    U64(u64),
    F32(f32),
    /// A u32 count then that many bytes.
    Run(Vec<u8>),
    /// A u32 count then that many u32s.
    Words(Vec<u32>),
}

fn field() -> impl Strategy<Value = Field> {
    prop_oneof![
        any::<u8>().prop_map(Field::U8),
        prop_oneof![0u8..4, any::<u8>()].prop_map(Field::U8),
        any::<u16>().prop_map(Field::U16),
        prop_oneof![0u32..64, (0..EDGES.len()).prop_map(|e| EDGES[e] as u32), any::<u32>()].prop_map(Field::U32),
        prop_oneof![0u64..64, (0..EDGES.len()).prop_map(|e| EDGES[e])].prop_map(Field::U64),
        prop_oneof![
            Just(f32::NAN),
            Just(f32::INFINITY),
            Just(-1.0f32),
            Just(0.5f32),
            any::<f32>()
        ]
        .prop_map(Field::F32),
        prop::collection::vec(any::<u8>(), 0..48).prop_map(Field::Run),
        prop::collection::vec(0u32..70_000, 0..12).prop_map(Field::Words),
    ]
}

fn payload(fields: &[Field]) -> Vec<u8> {
    let mut b = Vec::new();
    for f in fields {
        match f {
            Field::U8(v) => b.push(*v),
            Field::U16(v) => b.extend(v.to_le_bytes()),
            Field::U32(v) => b.extend(v.to_le_bytes()),
            Field::U64(v) => b.extend(v.to_le_bytes()),
            Field::F32(v) => b.extend(v.to_le_bytes()),
            Field::Run(r) => {
                b.extend((r.len() as u32).to_le_bytes());
                b.extend(r);
            }
            Field::Words(w) => {
                b.extend((w.len() as u32).to_le_bytes());
                w.iter().for_each(|x| b.extend(x.to_le_bytes()));
            }
        }
    }
    b
}

/// Valid messages to mutate: the types whose bodies are built inline, and READY.
fn wire_seeds() -> Vec<Msg> {
    vec![
        Msg::Hello { nonce: [7; 32] },
        Msg::Challenge {
            nonce: [9; 32],
            auth_required: true,
        },
        Msg::Auth { mac: [1; 32] },
        Msg::Error {
            message: "layer 3 is not held here".into(),
        },
        Msg::Mismatch { req: 4, n_past: 17 },
        Msg::Lookup {
            req: 6,
            tokens: vec![1, 2, 3, 4096],
        },
        Msg::Cached { req: 6, n_past: 256 },
        Msg::Kv {
            req: 2,
            data: vec![5; 100],
        },
        Msg::PrefillDone {
            req: 1,
            n_past: 40,
            queue_us: 12,
            compute_us: 3400,
        },
        // READY ends with the node's backend and ISA (protocol 5), bounded labels a mutation may break.
        Msg::Ready(wire::Ready {
            model: wire::ModelInfo {
                fingerprint: "ab".repeat(32),
                n_layer: 30,
                ..Default::default()
            },
            layers: (0, 15),
            n_ctx: 512,
            n_past: 0,
            backend: "gpu: NVIDIA H100 80GB HBM3".into(),
            isa: "avx2".into(),
        }),
    ]
}

/// A decoded message encodes to bytes that decode to a message encoding to the same bytes (compared as bytes, so
/// NaN fields compare equal).
fn reencodes(m: &Msg) -> Result<(), TestCaseError> {
    let bytes = m.encode();
    let again = Msg::decode(m.type_code(), &bytes);
    prop_assert!(
        again.is_ok(),
        "{} re-encoded does not decode: {:?}",
        m.name(),
        again.err()
    );
    prop_assert_eq!(again.unwrap().encode(), bytes, "{} re-encodes differently", m.name());
    Ok(())
}

proptest! {
    #![proptest_config(config())]

    /// Structured payloads for every message type (and unknown ones): decoding never panics, holds at most 1 MiB
    /// beyond the payload, and whatever decodes re-encodes consistently.
    #[test]
    fn wire_decoder_takes_any_payload(code in any::<u8>(), fields in prop::collection::vec(field(), 0..24)) {
        let p = payload(&fields);
        let (r, peak) = peak_during(|| Msg::decode(code, &p));
        prop_assert!(peak <= 2 * p.len() + MIB, "{peak} bytes held decoding {} bytes", p.len());
        if let Ok(m) = r {
            reencodes(&m)?;
        }
    }

    /// Mutated valid messages, and arbitrary frame headers.
    #[test]
    fn wire_decoder_survives_mutations(
        seed in 0..wire_seeds().len(),
        muts in prop::collection::vec(mutation(), 1..5),
        head in any::<[u8; wire::HEADER_LEN]>(),
    ) {
        let m = &wire_seeds()[seed];
        let mut p = m.encode();
        mutate(&mut p, usize::MAX, &muts);
        if let Ok(d) = Msg::decode(m.type_code(), &p) {
            reencodes(&d)?;
        }
        if let Ok((code, len)) = wire::check_header(&head) {
            prop_assert!(len <= wire::max_payload(code), "a header passed with a length above its type's bound");
        }
    }
}

/// A KV block of the llama3 generated model's shape, with known values.
fn snapshot_seed(dt: RowDtype) -> (baton::model::Hparams, Vec<u8>) {
    let hp = Model::load(&model_path("llama3")).unwrap().hp;
    let n_pos = 5;
    let rows = |hd: usize, salt: f32| -> Vec<f32> {
        (0..hp.n_head_kv * n_pos * hd)
            .map(|i| ((i as f32) * 0.37 + salt).sin())
            .collect()
    };
    let b = KvBlock {
        layers: 0..2,
        pos: 3..3 + n_pos,
        k: (0..2).map(|l| rows(hp.head_dim_k, l as f32)).collect(),
        v: (0..2).map(|l| rows(hp.head_dim_v, 10.0 + l as f32)).collect(),
        tokens: Some(vec![10, 11, 12, 13, 14]),
    };
    let bytes = snapshot::encode_block(&hp, "fuzz-fingerprint", &b, dt).unwrap();
    (hp, bytes)
}

proptest! {
    #![proptest_config(config())]

    /// Mutated KV snapshots of every row type, header and data: decoding never panics and holds at most four times
    /// the snapshot plus 1 MiB; a snapshot that still decodes has the seed's shape.
    #[test]
    fn kv_snapshot_decoder_survives_mutations(
        dt in prop_oneof![Just(RowDtype::F32), Just(RowDtype::F16), Just(RowDtype::BF16), Just(RowDtype::Q8)],
        header_only in any::<bool>(),
        muts in prop::collection::vec(mutation(), 1..6),
    ) {
        let (hp, mut bytes) = snapshot_seed(dt);
        let header = 8 + u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        mutate(&mut bytes, if header_only { header } else { usize::MAX }, &muts);
        let (r, peak) = peak_during(|| snapshot::decode_block(&hp, "fuzz-fingerprint", 64, &bytes));
        prop_assert!(peak <= 4 * bytes.len() + MIB, "{peak} bytes held decoding {} bytes", bytes.len());
        if let Ok((b, _)) = r {
            prop_assert!(b.pos.end <= 64 && b.layers.end <= hp.n_layer);
            prop_assert_eq!(b.k.len(), b.layers.len());
            for (k, v) in b.k.iter().zip(&b.v) {
                prop_assert_eq!(k.len(), hp.n_head_kv * b.pos.len() * hp.head_dim_k);
                prop_assert_eq!(v.len(), hp.n_head_kv * b.pos.len() * hp.head_dim_v);
            }
        }
    }
}

/// JSON values over the fields the API reads, each with values of every JSON type, nested a few levels.
fn request_json() -> impl Strategy<Value = serde_json::Value> {
    use serde_json::{Value, json};
    let scalar = prop_oneof![
        Just(Value::Null),
        any::<bool>().prop_map(Value::Bool),
        any::<i64>().prop_map(|v| json!(v)),
        prop_oneof![
            Just(-1.0f64),
            Just(0.0),
            Just(1.5),
            Just(1e300),
            Just(-1e-300),
            any::<f64>()
        ]
        .prop_map(|v| json!(v)),
        prop_oneof![0u64..3, Just(u64::MAX), Just(1 << 40)].prop_map(|v| json!(v)),
        "[a-z<|>_ ]{0,12}".prop_map(Value::String),
    ];
    let keys = prop_oneof![
        Just("model"),
        Just("messages"),
        Just("role"),
        Just("content"),
        Just("type"),
        Just("text"),
        Just("prompt"),
        Just("max_tokens"),
        Just("max_completion_tokens"),
        Just("temperature"),
        Just("top_p"),
        Just("top_k"),
        Just("min_p"),
        Just("seed"),
        Just("stop"),
        Just("stream"),
        Just("stream_options"),
        Just("include_usage"),
        Just("logprobs"),
        Just("top_logprobs"),
        Just("repeat_penalty"),
        Just("n"),
    ];
    let roles = prop_oneof![
        Just("user"),
        Just("system"),
        Just("assistant"),
        Just("tool"),
        Just("developer")
    ];
    scalar
        .prop_recursive(4, 64, 6, move |inner| {
            prop_oneof![
                prop::collection::vec(inner.clone(), 0..4).prop_map(Value::Array),
                prop::collection::btree_map(keys.clone().prop_map(String::from), inner.clone(), 0..6)
                    .prop_map(|m| Value::Object(m.into_iter().collect())),
                (roles.clone(), inner).prop_map(|(r, c)| json!({"role": r, "content": c})),
            ]
        })
        .prop_map(|v| match v {
            // Mostly objects with messages or a prompt, so parsing reaches the field checks.
            Value::Object(mut m) => {
                m.entry("messages")
                    .or_insert_with(|| json!([{"role": "user", "content": "hi"}]));
                Value::Object(m)
            }
            other => other,
        })
}

proptest! {
    #![proptest_config(config())]

    /// Request bodies, chat and completion: a request or a 400 with a message, never a panic; an accepted request's
    /// sampling parameters make a sampler that samples a token in range.
    #[test]
    fn http_request_parsing_takes_any_body(v in request_json(), raw in prop::collection::vec(any::<u8>(), 0..64)) {
        let body = serde_json::to_vec(&v).unwrap();
        for bytes in [&body[..], &raw[..]] {
            for r in [openai::parse_chat(bytes), openai::parse_completion(bytes)] {
                match r {
                    Ok(req) => {
                        let mut s = baton::engine::sampler::Sampler::new(req.sampler, 50);
                        let logits: Vec<f32> = (0..50).map(|i| (i as f32 * 0.7).sin()).collect();
                        prop_assert!(s.sample(&logits) < 50);
                    }
                    Err(e) => prop_assert!(!e.body().to_string().is_empty()),
                }
            }
        }
    }
}
