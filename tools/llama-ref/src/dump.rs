//! `dump`: llama.cpp's intermediate tensors for op-by-op comparison with Baton.
//!
//! Evaluates a list of token ids as one batch from an empty cache (the perplexity settings: n_ctx = n_batch =
//! n_ubatch = 512 by default, F16 KV cache, flash attention "auto"), with an eval callback (`cb_eval`, not exposed by
//! llama-cpp-2, so this uses the raw C API of llama-cpp-sys-2) that copies every F32 tensor whose name matches a
//! filter into `OUT/<name>.f32` (little-endian, ggml's element order, `ne[0]` fastest), plus `OUT/index.txt` with
//! one line per file: `name ne0 ne1 ne2 ne3 op`.

use anyhow::{Context, Result, bail};
use clap::Args;
use llama_cpp_sys_2 as sys;
use std::collections::HashMap;
use std::ffi::{CStr, CString};
use std::io::Write;
use std::path::PathBuf;

#[derive(Args)]
pub struct DumpArgs {
    /// GGUF model file.
    #[arg(long, short)]
    model: PathBuf,
    /// Text file of whitespace-separated token ids, evaluated as given (no BOS added).
    #[arg(long)]
    tokens: PathBuf,
    /// Evaluate only the first N ids.
    #[arg(long)]
    n: Option<usize>,
    /// Output directory.
    #[arg(long, short)]
    out: PathBuf,
    /// Comma-separated tensor name prefixes to keep (e.g. "attn_norm-0,Qcur-0,result_output"); empty keeps all.
    #[arg(long, default_value = "")]
    filter: String,
    #[arg(long, default_value_t = 512)]
    n_ctx: u32,
    #[arg(long, short, default_value_t = 2)]
    threads: i32,
}

struct State {
    filters: Vec<String>,
    out: PathBuf,
    seen: HashMap<String, usize>,
    index: Vec<String>,
    error: Option<String>,
}

fn tensor_name(t: &sys::ggml_tensor) -> String {
    // SAFETY: ggml keeps the name NUL-terminated within its 64 bytes.
    unsafe { CStr::from_ptr(t.name.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

unsafe extern "C" fn callback(t: *mut sys::ggml_tensor, ask: bool, user: *mut std::ffi::c_void) -> bool {
    // SAFETY: llama.cpp passes back the State pointer we gave it, and a live tensor.
    let (st, t) = unsafe { (&mut *(user as *mut State), &*t) };
    let name = tensor_name(t);
    let wanted = t.type_ == sys::GGML_TYPE_F32
        && (st.filters.is_empty() || st.filters.iter().any(|f| name.starts_with(f.as_str())));
    if ask {
        return wanted;
    }
    if !wanted {
        return true;
    }
    let n = t.ne.iter().product::<i64>() as usize;
    let bytes = unsafe { sys::ggml_nbytes(t) };
    let mut raw = vec![0u8; bytes];
    // SAFETY: reads the tensor's bytes from its (CPU) buffer.
    unsafe { sys::ggml_backend_tensor_get(t, raw.as_mut_ptr() as *mut _, 0, bytes) };
    let mut vals = Vec::with_capacity(n * 4);
    let (ne, nb) = (t.ne, t.nb);
    for i3 in 0..ne[3] as usize {
        for i2 in 0..ne[2] as usize {
            for i1 in 0..ne[1] as usize {
                for i0 in 0..ne[0] as usize {
                    let off = i0 * nb[0] + i1 * nb[1] + i2 * nb[2] + i3 * nb[3];
                    vals.extend_from_slice(&raw[off..off + 4]);
                }
            }
        }
    }
    let k = st.seen.entry(name.clone()).or_insert(0);
    let file = if *k == 0 { name.clone() } else { format!("{name}#{k}") };
    *k += 1;
    if let Err(e) = std::fs::write(st.out.join(format!("{file}.f32")), &vals) {
        st.error = Some(format!("writing {file}: {e}"));
    }
    st.index
        .push(format!("{file} {} {} {} {} {}", ne[0], ne[1], ne[2], ne[3], t.op));
    true
}

pub fn dump_cmd(a: &DumpArgs) -> Result<()> {
    let text = std::fs::read_to_string(&a.tokens).with_context(|| format!("reading {}", a.tokens.display()))?;
    let mut ids: Vec<i32> = text
        .split_whitespace()
        .map(|s| s.parse::<i32>().context("token id"))
        .collect::<Result<_>>()?;
    if let Some(n) = a.n {
        ids.truncate(n);
    }
    if ids.is_empty() || ids.len() > a.n_ctx as usize {
        bail!("need 1..={} token ids, got {}", a.n_ctx, ids.len());
    }
    std::fs::create_dir_all(&a.out)?;
    let mut st = Box::new(State {
        filters: a
            .filter
            .split(',')
            .filter(|s| !s.is_empty())
            .map(String::from)
            .collect(),
        out: a.out.clone(),
        seen: HashMap::new(),
        index: Vec::new(),
        error: None,
    });
    let path = CString::new(a.model.to_string_lossy().as_bytes())?;
    // SAFETY: plain C API use; every pointer is checked before use and freed at the end.
    unsafe {
        let mut mp = sys::llama_model_default_params();
        mp.n_gpu_layers = 0;
        let model = sys::llama_model_load_from_file(path.as_ptr(), mp);
        if model.is_null() {
            bail!("llama.cpp could not load {}", a.model.display());
        }
        let mut cp = sys::llama_context_default_params();
        cp.n_ctx = a.n_ctx;
        cp.n_batch = a.n_ctx;
        cp.n_ubatch = a.n_ctx.min(512);
        cp.n_threads = a.threads;
        cp.n_threads_batch = a.threads;
        cp.cb_eval = Some(callback);
        cp.cb_eval_user_data = &mut *st as *mut State as *mut _;
        let ctx = sys::llama_init_from_model(model, cp);
        if ctx.is_null() {
            bail!("llama.cpp could not create a context");
        }
        let batch = sys::llama_batch_get_one(ids.as_mut_ptr(), ids.len() as i32);
        let rc = sys::llama_decode(ctx, batch);
        sys::llama_free(ctx);
        sys::llama_model_free(model);
        if rc != 0 {
            bail!("llama_decode returned {rc}");
        }
    }
    if let Some(e) = st.error.take() {
        bail!(e);
    }
    let mut f = std::fs::File::create(a.out.join("index.txt"))?;
    for l in &st.index {
        writeln!(f, "{l}")?;
    }
    println!(
        "{}: {} tensors from {} tokens",
        a.out.display(),
        st.index.len(),
        ids.len()
    );
    Ok(())
}
