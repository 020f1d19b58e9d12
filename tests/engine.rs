//! Engine behaviour on real and random-weight models: layer-range splits are bit-exact, snapshots resume exactly,
//! prefixes are reused, bad snapshots are refused.

mod common;

use baton::engine::snapshot::{self, RowDtype};
use baton::engine::{Input, Session, Want};
use baton::gguf::GgufFile;
use baton::kernels::ThreadPool;
use baton::kernels::ops::argmax;
use baton::model::random::{RandomSpec, write_random_model};
use baton::model::{Arch, Model};
use std::path::{Path, PathBuf};
use std::sync::Arc;

fn pool() -> Arc<ThreadPool> {
    Arc::new(ThreadPool::new(2))
}

fn random_model(arch: Arch, dir: &Path) -> PathBuf {
    let base = GgufFile::open(&common::model("smollm2")).unwrap();
    let p = dir.join(format!("random-{}.gguf", arch.name()));
    write_random_model(&base, &RandomSpec::tiny(arch), &p).unwrap();
    p
}

/// Some token ids that exist in every vocabulary used here.
fn prompt(n: usize) -> Vec<u32> {
    (0..n).map(|i| 100 + (i as u32 * 37) % 900).collect()
}

/// Logits of every position, running the layers as one range or split at `k`.
fn logits_split(path: &Path, toks: &[u32], split: Option<usize>) -> Vec<f32> {
    match split {
        None => {
            let m = Arc::new(Model::load(path).unwrap());
            let mut s = Session::new(m, pool(), 256, 64).unwrap();
            s.forward(Input::Tokens(toks), Want::AllLogits).unwrap().to_vec()
        }
        Some(k) => {
            let a = Arc::new(Model::load_range(path, Some(0..k)).unwrap());
            let n = a.hp.n_layer;
            let b = Arc::new(Model::load_range(path, Some(k..n)).unwrap());
            assert!(
                a.output.is_none() && b.embeddings().is_none(),
                "a range loads only what it needs"
            );
            let mut sa = Session::new(a, pool(), 256, 64).unwrap();
            let mut sb = Session::new(b, pool(), 256, 64).unwrap();
            let h = sa.forward(Input::Tokens(toks), Want::Hidden).unwrap().to_vec();
            sb.forward(Input::Hidden(&h), Want::AllLogits).unwrap().to_vec()
        }
    }
}

fn check_split_bit_exact(path: &Path) {
    let toks = prompt(40);
    let whole = logits_split(path, &toks, None);
    let n = Model::load(path).unwrap().hp.n_layer;
    for k in [1, n / 2, n - 1] {
        let split = logits_split(path, &toks, Some(k));
        assert!(whole == split, "split at {k} changed the logits of {}", path.display());
    }
}

#[test]
fn split_is_bit_exact_random_models() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Gemma3, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe] {
        check_split_bit_exact(&random_model(arch, dir.path()));
    }
}

#[test]
fn split_is_bit_exact_real_models() {
    for name in ["smollm2", "gemma3"] {
        check_split_bit_exact(&common::model(name));
    }
}

/// Greedy tokens after `toks`, decoding one token at a time.
fn greedy(s: &mut Session, toks: &[u32], n: usize) -> Vec<u32> {
    let mut next = argmax(s.eval(toks).unwrap()) as u32;
    let mut out = vec![next];
    while out.len() < n {
        next = argmax(s.forward(Input::Tokens(&[next]), Want::LastLogits).unwrap()) as u32;
        out.push(next);
    }
    out
}

#[test]
fn batched_prefill_matches_token_by_token_and_window_holds_at_decode() {
    // The random gemma3 has a window of 16, so 40 positions cross it at prefill and decode alike.
    let dir = tempfile::tempdir().unwrap();
    for arch in [Arch::Llama, Arch::Gemma3, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe] {
        let path = random_model(arch, dir.path());
        let m = Arc::new(Model::load(&path).unwrap());
        let toks = prompt(40);
        let mut a = Session::new(m.clone(), pool(), 128, 64).unwrap();
        let batched = a.forward(Input::Tokens(&toks), Want::AllLogits).unwrap().to_vec();
        let mut b = Session::new(m.clone(), pool(), 128, 64).unwrap();
        let nv = m.hp.n_vocab;
        for (i, t) in toks.iter().enumerate() {
            let l = b.forward(Input::Tokens(&[*t]), Want::LastLogits).unwrap();
            let max_err = l
                .iter()
                .zip(&batched[i * nv..(i + 1) * nv])
                .map(|(x, y)| (x - y).abs())
                .fold(0.0, f32::max);
            assert!(
                max_err < 2e-3,
                "{arch:?} position {i}: one-by-one differs from batched by {max_err}"
            );
        }
    }
}

#[test]
fn layer_slices_give_the_bits_of_separate_batches() {
    // A batch longer than a layer slice goes through each layer a slice at a time; each slice must see the KV the
    // slices before it stored, exactly as separate forward passes of the same rows do.
    let dir = tempfile::tempdir().unwrap();
    let slice = baton::model::blocks::LAYER_SLICE;
    let toks = prompt(2 * slice + 44);
    for arch in [Arch::Llama, Arch::Gemma3, Arch::Qwen2, Arch::Qwen3, Arch::Qwen3Moe] {
        let m = Arc::new(Model::load(&random_model(arch, dir.path())).unwrap());
        let mut whole = Session::new(m.clone(), pool(), 512, toks.len()).unwrap();
        let one_pass = whole.forward(Input::Tokens(&toks), Want::AllLogits).unwrap().to_vec();
        let mut parts = Session::new(m.clone(), pool(), 512, slice).unwrap();
        let mut chunked = Vec::new();
        for c in toks.chunks(slice) {
            chunked.extend_from_slice(parts.forward(Input::Tokens(c), Want::AllLogits).unwrap());
        }
        assert!(one_pass == chunked, "{arch:?}: layer slices changed the logits");
    }
}

/// How many pages of `bytes` (a mapping of this process) are mapped in memory now, from `/proc/self/pagemap`.
#[cfg(target_os = "linux")]
fn mapped_pages(bytes: &[u8]) -> Vec<usize> {
    use std::io::{Read, Seek, SeekFrom};
    let (first, n) = (bytes.as_ptr() as usize / 4096, bytes.len().div_ceil(4096));
    let mut pm = std::fs::File::open("/proc/self/pagemap").unwrap();
    pm.seek(SeekFrom::Start(first as u64 * 8)).unwrap();
    let mut entries = vec![0u8; n * 8];
    pm.read_exact(&mut entries).unwrap();
    let present = |p: usize| u64::from_le_bytes(entries[p * 8..p * 8 + 8].try_into().unwrap()) >> 63 == 1;
    (0..n).filter(|&p| present(p)).collect()
}

#[test]
#[cfg(target_os = "linux")]
fn repacked_models_leave_the_model_file_unmapped() {
    // Where the kernels repack weights, every multiplied matrix is owned and the file's pages are dropped after
    // loading; a file page mapped later counts twice towards the memory (see `Matrix::repack_for_kernels`).
    if !baton::kernels::interleaved::available() {
        eprintln!("SKIPPED: this CPU's kernels use the weights in place");
        return;
    }
    for name in ["smollm2", "gemma3"] {
        let m = Arc::new(Model::load(&common::model(name)).unwrap());
        baton::vocab::Vocab::from_gguf(&m.file).unwrap();
        let mut s = Session::new(m.clone(), pool(), 64, 16).unwrap();
        s.forward(Input::Tokens(&prompt(16)), Want::LastLogits).unwrap();
        let pages = mapped_pages(m.file.bytes());
        assert!(pages.is_empty(), "{name}: file pages {pages:?} are mapped");
    }
}

#[test]
fn snapshot_restore_continues_exactly() {
    let dir = tempfile::tempdir().unwrap();
    for name in ["smollm2", "gemma3"] {
        let path = common::model(name);
        let m = Arc::new(Model::load(&path).unwrap());
        let toks = prompt(30);
        let mut a = Session::new(m.clone(), pool(), 128, 32).unwrap();
        let straight = greedy(&mut a, &toks, 12);

        let mut b = Session::new(m.clone(), pool(), 128, 32).unwrap();
        let first = greedy(&mut b, &toks, 5);
        let file = dir.path().join(format!("{name}.kv"));
        let n = b.n_past();
        snapshot::save(&b, &file, m.range.clone(), 0..n, RowDtype::F32).unwrap();
        drop(b);
        let mut c = Session::new(m.clone(), pool(), 128, 32).unwrap();
        let info = snapshot::restore(&mut c, &file).unwrap();
        assert_eq!(info.pos, 0..n);
        assert_eq!(c.n_past(), n);
        // Continue from the last generated token, which was sampled but not yet fed.
        let mut next = *first.last().unwrap();
        let mut out = first.clone();
        while out.len() < 12 {
            next = argmax(c.forward(Input::Tokens(&[next]), Want::LastLogits).unwrap()) as u32;
            out.push(next);
        }
        assert_eq!(out, straight, "{name}: restoring a snapshot changed the continuation");
    }
}

#[test]
fn snapshot_refuses_other_model_range_and_corruption() {
    let dir = tempfile::tempdir().unwrap();
    let real = common::model("smollm2");
    let rand_path = random_model(Arch::Llama, dir.path());
    let m = Arc::new(Model::load(&real).unwrap());
    let mut s = Session::new(m.clone(), pool(), 64, 32).unwrap();
    s.eval(&prompt(10)).unwrap();
    let bytes = snapshot::save_bytes(&s, 0..30, 0..10, RowDtype::F16).unwrap();

    // Another model.
    let other = Arc::new(Model::load(&rand_path).unwrap());
    let mut o = Session::new(other, pool(), 64, 32).unwrap();
    let e = format!("{:#}", snapshot::restore_bytes(&mut o, &bytes).unwrap_err());
    assert!(e.contains("another model") && e.contains("fingerprint"), "{e}");

    // Another layer range of the same model.
    let part = Arc::new(Model::load_range(&real, Some(0..10)).unwrap());
    let mut p = Session::new(part, pool(), 64, 32).unwrap();
    let e = format!("{:#}", snapshot::restore_bytes(&mut p, &bytes).unwrap_err());
    assert!(e.contains("layers 0..30") && e.contains("0..10"), "{e}");

    // A flipped byte in the tensor data (the end of the file is data).
    let mut bad = bytes.clone();
    let at = bad.len() - 5;
    bad[at] ^= 0x55;
    let mut f = Session::new(m.clone(), pool(), 64, 32).unwrap();
    let e = format!("{:#}", snapshot::restore_bytes(&mut f, &bad).unwrap_err());
    assert!(e.contains("checksum"), "{e}");
    assert_eq!(f.n_past(), 0, "a refused snapshot leaves the session untouched");

    // A newer format version.
    let needle = b"\"version\":\"1\"";
    let at = bytes
        .windows(needle.len())
        .position(|w| w == needle)
        .expect("the header holds the version");
    let mut newer = bytes.clone();
    newer[at + needle.len() - 2] = b'9';
    let e = format!("{:#}", snapshot::restore_bytes(&mut f, &newer).unwrap_err());
    assert!(e.contains("version 9"), "{e}");
}

#[test]
fn prefix_reuse_gives_the_same_logits() {
    let m = Arc::new(Model::load(&common::model("smollm2")).unwrap());
    let toks = prompt(24);
    let mut fresh = Session::new(m.clone(), pool(), 64, 32).unwrap();
    let want = fresh.eval(&toks).unwrap().to_vec();
    let mut s = Session::new(m.clone(), pool(), 64, 32).unwrap();
    s.eval(&toks[..16]).unwrap();
    let mut other = toks[..10].to_vec();
    other.extend_from_slice(&[5, 6, 7]);
    s.rewind(10);
    s.eval(&other[10..]).unwrap(); // the cache now diverges from `toks` at 10
    let kept = s.reuse_prefix(&toks);
    assert_eq!(kept, 10);
    let got = s.eval(&toks[kept..]).unwrap().to_vec();
    let max_err = want.iter().zip(&got).map(|(a, b)| (a - b).abs()).fold(0.0, f32::max);
    assert!(max_err < 2e-3, "prefix reuse changed logits by {max_err}");
}

#[test]
fn context_overflow_is_an_error() {
    let m = Arc::new(Model::load(&common::model("smollm2")).unwrap());
    let mut s = Session::new(m, pool(), 16, 16).unwrap();
    s.eval(&prompt(10)).unwrap();
    let e = s.eval(&prompt(10)).unwrap_err().to_string();
    assert!(e.contains("context"), "{e}");
}

/// The GPU backend implements every architecture the CPU's does (llama with RoPE factors and scaling, gemma3,
/// qwen2, qwen3, phi3, the mixtures of experts qwen3moe, dots1 and glm4moe, and deepseek2's latent attention) in
/// every weight type: each generated model uploads whole, every matrix of its layers and its embeddings and head
/// once (a tied head is the embedding matrix), and nothing of glm4moe's NextN layer, which Baton does not run.
/// Their numbers are checked in `backend::gpu::layers`. The one exception, deepseek2's absorbed MLA layout
/// (deepseek2-mla), is refused by name before anything is uploaded.
#[test]
fn gpu_backend_uploads_every_generated_family() {
    use baton::backend::gpu::layers::GpuWeights;
    use baton::backend::gpu::{AdapterChoice, Gpu, NoAdapter};
    let choice = AdapterChoice::from_env_or(AdapterChoice::Software).expect("BATON_GPU_ADAPTER");
    let gpu = match Gpu::open(choice) {
        Ok(g) => Arc::new(g),
        Err(e) if e.downcast_ref::<NoAdapter>().is_some() => {
            println!("SKIPPED: no GPU adapter (install mesa-vulkan-drivers)");
            return;
        }
        Err(e) => panic!("opening the GPU adapter: {e:#}"),
    };
    for name in common::GENERATED {
        let model = Model::load(&common::model(name)).unwrap();
        let up = GpuWeights::upload(gpu.clone(), &model, model.range.clone());
        assert_eq!(
            GpuWeights::unsupported(&model.hp).is_some(),
            name == "deepseek2-mla",
            "{name}"
        );
        if name == "deepseek2-mla" {
            let e = format!("{:#}", up.err().expect("the absorbed layout is refused on the GPU"));
            assert!(e.contains("absorbed MLA layout") && e.contains("--backend cpu"), "{e}");
            continue;
        }
        let w = up.unwrap_or_else(|e| panic!("{name}: {e:#}"));
        let trunk = |t: &str| {
            t.strip_prefix("blk.")
                .and_then(|r| r.split_once('.'))
                .is_none_or(|(il, _)| il.parse::<usize>().is_ok_and(|il| il < model.hp.n_layer))
        };
        let matrices: u64 = model
            .file
            .tensors
            .values()
            .filter(|t| t.dims.len() >= 2 && trunk(&t.name))
            .map(|t| t.size as u64)
            .sum();
        assert!(w.embeds() && w.has_head(), "{name}");
        assert_eq!(w.bytes(), matrices, "{name}: bytes of the matrices uploaded");
    }
}
