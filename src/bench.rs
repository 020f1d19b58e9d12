//! `baton bench`: prompt-processing and generation speed like llama-bench, at several context depths, with the
//! memory-bandwidth bound measured on the spot. Speed goals live here, never in timed tests.

use crate::engine::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::Result;
use std::sync::Arc;
use std::time::Instant;

/// One figure: a test (`pp512`, `tg128`) at one depth, over the repetitions.
#[derive(Clone, Debug, serde::Serialize)]
pub struct Figure {
    pub model: String,
    pub test: String,
    pub threads: usize,
    pub depth: usize,
    pub tps_median: f64,
    pub tps_min: f64,
    pub tps_max: f64,
    pub samples: Vec<f64>,
}

pub fn summarize(model: &str, test: String, threads: usize, depth: usize, mut samples: Vec<f64>) -> Figure {
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let n = samples.len();
    let median = if n % 2 == 1 {
        samples[n / 2]
    } else {
        (samples[n / 2 - 1] + samples[n / 2]) / 2.0
    };
    Figure {
        model: model.to_string(),
        test,
        threads,
        depth,
        tps_median: median,
        tps_min: samples[0],
        tps_max: samples[n - 1],
        samples,
    }
}

/// Deterministic filler tokens (the speed of a forward pass does not depend on which tokens).
pub fn filler_tokens(n: usize, n_vocab: usize) -> Vec<u32> {
    (0..n).map(|i| ((i * 7919 + 13) % n_vocab.min(20000)) as u32).collect()
}

/// What a benchmark drives: a local session, or a pipeline over nodes (which chunks its prefill itself).
pub trait Target {
    /// Forgets every position.
    fn reset(&mut self);
    /// Largest batch one `prefill` call takes.
    fn n_batch(&self) -> usize;
    fn n_vocab(&self) -> usize;
    /// Appends a batch; the last batch of a prompt also computes the next token's logits.
    fn prefill(&mut self, tokens: &[u32], last: bool) -> Result<()>;
    /// Appends one token and returns the greedy next one.
    fn decode(&mut self, token: u32) -> Result<u32>;
}

impl Target for Session {
    fn reset(&mut self) {
        self.rewind(0);
    }
    fn n_batch(&self) -> usize {
        Session::n_batch(self)
    }
    fn n_vocab(&self) -> usize {
        self.model().hp.n_vocab
    }
    fn prefill(&mut self, tokens: &[u32], last: bool) -> Result<()> {
        let want = if last { Want::LastLogits } else { Want::Hidden };
        self.forward(Input::Tokens(tokens), want)?;
        Ok(())
    }
    fn decode(&mut self, token: u32) -> Result<u32> {
        let l = self.forward(Input::Tokens(&[token]), Want::LastLogits)?;
        Ok(crate::kernels::ops::argmax(l) as u32)
    }
}

impl Target for crate::cluster::PipelineSession {
    fn reset(&mut self) {
        self.rewind(0);
    }
    fn n_batch(&self) -> usize {
        usize::MAX
    }
    fn n_vocab(&self) -> usize {
        self.hparams().n_vocab
    }
    fn prefill(&mut self, tokens: &[u32], _last: bool) -> Result<()> {
        // The pipeline cuts the prompt into chunks and overlaps the stages itself; the last stage samples.
        self.eval(tokens)?;
        Ok(())
    }
    fn decode(&mut self, token: u32) -> Result<u32> {
        Ok(self.decode_step(token)?.token)
    }
}

/// Feeds `depth` filler tokens (untimed) so the test runs at that context depth.
fn fill_to(s: &mut dyn Target, depth: usize) -> Result<()> {
    s.reset();
    let toks = filler_tokens(depth, s.n_vocab());
    let chunks: Vec<&[u32]> = toks.chunks(s.n_batch()).collect();
    for (i, chunk) in chunks.iter().enumerate() {
        s.prefill(chunk, i + 1 == chunks.len())?;
    }
    Ok(())
}

/// Tokens per second of one prompt-processing run of `n` tokens at `depth`.
pub fn run_pp(s: &mut dyn Target, depth: usize, n: usize) -> Result<f64> {
    fill_to(s, depth)?;
    let toks = filler_tokens(n, s.n_vocab());
    let t0 = Instant::now();
    let chunks: Vec<&[u32]> = toks.chunks(s.n_batch()).collect();
    for (i, c) in chunks.iter().enumerate() {
        s.prefill(c, i + 1 == chunks.len())?;
    }
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}

/// Tokens per second of one generation run of `n` tokens at `depth` (one token per forward, as decode).
pub fn run_tg(s: &mut dyn Target, depth: usize, n: usize) -> Result<f64> {
    fill_to(s, depth)?;
    let mut tok = 1u32;
    let t0 = Instant::now();
    for _ in 0..n {
        tok = s.decode(tok)?;
    }
    Ok(n as f64 / t0.elapsed().as_secs_f64())
}

/// Memory read bandwidth in bytes/s with the pool's threads: the best of a few passes summing a buffer much larger
/// than the caches.
pub fn measure_bandwidth(pool: &ThreadPool) -> f64 {
    let n = 64 << 20; // 256 MiB of f32, far beyond the caches
    let buf: Vec<f32> = vec![1.0; n / 4 * 4];
    let sums = std::sync::Mutex::new(vec![0.0f32; pool.n_threads()]);
    let mut best = 0.0f64;
    for _ in 0..4 {
        let t0 = Instant::now();
        pool.run(|ith, nth| {
            let per = buf.len().div_ceil(nth);
            let part = &buf[(ith * per).min(buf.len())..((ith + 1) * per).min(buf.len())];
            let mut acc = [0.0f32; 16];
            for c in part.chunks_exact(16) {
                for l in 0..16 {
                    acc[l] += c[l];
                }
            }
            sums.lock().unwrap()[ith] = acc.iter().sum();
        });
        let dt = t0.elapsed().as_secs_f64();
        best = best.max((buf.len() * 4) as f64 / dt);
    }
    std::hint::black_box(sums.into_inner().unwrap());
    best
}

/// Peak resident set size of this process in bytes (Linux; 0 elsewhere).
pub fn peak_rss() -> u64 {
    status_kb("VmHWM:")
}

/// Resets the peak RSS to the current RSS (Linux: `/proc/self/clear_refs`); false where that is not possible.
pub fn reset_peak_rss() -> bool {
    std::fs::write("/proc/self/clear_refs", "5").is_ok()
}

/// Resident set size now, in bytes. `baton bench` samples it after each figure where it cannot reset the peak
/// ([`reset_peak_rss`]), which would then include the bandwidth probe's 256 MiB buffer.
pub fn current_rss() -> u64 {
    status_kb("VmRSS:")
}

fn status_kb(field: &str) -> u64 {
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}

pub struct BenchConfig {
    pub pp: Vec<usize>,
    pub tg: Vec<usize>,
    pub depths: Vec<usize>,
    pub reps: usize,
    pub n_batch: usize,
}

/// Runs every test of `cfg` on `model`, calling `report` as each figure completes.
pub fn run(
    model: Arc<Model>,
    pool: Arc<ThreadPool>,
    name: &str,
    cfg: &BenchConfig,
    compare: Option<Compare>,
    warmed: impl FnMut(),
    report: impl FnMut(&Figure, Option<&Figure>),
) -> Result<Vec<Figure>> {
    let threads = pool.n_threads();
    let mut s = Session::new(model, pool, cfg.n_ctx()?, cfg.n_batch)?;
    run_on(&mut s, name, threads, cfg, compare, warmed, report)
}

impl BenchConfig {
    /// The context the bench session holds: the deepest test, refused beyond the largest context
    /// ([`crate::util::limits::MAX_CTX`]) with the figures, before anything is allocated.
    pub fn n_ctx(&self) -> Result<usize> {
        let max_depth = self.depths.iter().copied().max().unwrap_or(0) as u64;
        let max_test = self.pp.iter().chain(&self.tg).copied().max().unwrap_or(0) as u64;
        let n = max_depth.saturating_add(max_test).saturating_add(1);
        crate::util::count_in(
            &format!("the deepest test (depth {max_depth} + {max_test} tokens + 1)"),
            n,
            1..=crate::util::limits::MAX_CTX,
        )
    }
}

/// A second engine measured in the same run, one repetition after each of Baton's (`--compare-llama-cpp`):
/// given a test name (`pp512`, `tg128`) and depth, returns its tokens/s, or `None` where it cannot run that test.
pub type Compare<'a> = &'a mut dyn FnMut(&str, usize) -> Result<Option<f64>>;

/// Runs every test of `cfg` on any target (`threads` is only reported). With `compare`, the other engine's
/// repetitions are interleaved with Baton's, so both see the same machine load; `report` gets both figures.
/// `warmed` is called after each test's warm-up (the GPU profile starts over there).
pub fn run_on(
    s: &mut dyn Target,
    name: &str,
    threads: usize,
    cfg: &BenchConfig,
    mut compare: Option<Compare>,
    mut warmed: impl FnMut(),
    mut report: impl FnMut(&Figure, Option<&Figure>),
) -> Result<Vec<Figure>> {
    let mut out = Vec::new();
    for &depth in &cfg.depths {
        let tests = cfg
            .pp
            .iter()
            .map(|&n| (true, n))
            .chain(cfg.tg.iter().map(|&n| (false, n)));
        for (is_pp, n) in tests {
            let test = format!("{}{n}", if is_pp { "pp" } else { "tg" });
            let run = |s: &mut dyn Target, n| {
                if is_pp {
                    run_pp(s, depth, n)
                } else {
                    run_tg(s, depth, n)
                }
            };
            run(s, n.min(if is_pp { 64 } else { 4 }))?; // warm-up
            warmed();
            let (mut ours, mut theirs) = (Vec::new(), Vec::new());
            for _ in 0..cfg.reps {
                ours.push(run(s, n)?);
                if let Some(c) = compare.as_mut()
                    && let Some(v) = c(&test, depth)?
                {
                    theirs.push(v);
                }
            }
            let f = summarize(name, test.clone(), threads, depth, ours);
            let other = (!theirs.is_empty()).then(|| summarize("llama.cpp", test, threads, depth, theirs));
            report(&f, other.as_ref());
            out.push(f);
        }
    }
    Ok(out)
}

/// One repetition of llama.cpp's speed on `model`, from the `tools/llama-ref` binary (llama.cpp built from the
/// crates.io package `llama-cpp-sys-2`; never part of the default build). It runs one warm-up and one timed run and
/// prints a JSON line; `depth` filler tokens are decoded untimed first, as [`run_pp`]/[`run_tg`] do.
pub fn llama_cpp_once(
    bin: &std::path::Path,
    model: &std::path::Path,
    test: &str,
    depth: usize,
    threads: usize,
    n_batch: usize,
) -> Result<Option<LlamaFigure>> {
    use anyhow::Context;
    let (pp, tg) = match (test.strip_prefix("pp"), test.strip_prefix("tg")) {
        (Some(n), _) => (n, "0"),
        (_, Some(n)) => ("0", n),
        _ => return Ok(None),
    };
    let out = std::process::Command::new(bin)
        .arg("bench")
        .arg("-m")
        .arg(model)
        .args([
            "-p",
            pp,
            "-n",
            tg,
            "-r",
            "1",
            "-t",
            &threads.to_string(),
            "-b",
            &n_batch.to_string(),
            "-d",
            &depth.to_string(),
        ])
        .output()
        .with_context(|| format!("cannot run {}", bin.display()))?;
    if !out.status.success() {
        anyhow::bail!(
            "{} failed: {}",
            bin.display(),
            String::from_utf8_lossy(&out.stderr).lines().last().unwrap_or("")
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text
        .lines()
        .find(|l| l.starts_with('{'))
        .context("llama-ref printed no figure")?;
    let v: serde_json::Value = serde_json::from_str(line).context("llama-ref printed malformed JSON")?;
    Ok(v["median_tokens_per_s"].as_f64().map(|tps| LlamaFigure {
        tps,
        cpu: v["cpu"].as_str().map(str::to_string),
    }))
}

/// One figure of [`llama_cpp_once`]: tokens/s, and the CPU features that llama.cpp build uses (older builds of the
/// tool do not say).
pub struct LlamaFigure {
    pub tps: f64,
    pub cpu: Option<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_test_deeper_than_the_largest_context_is_refused() {
        let cfg = |depth| BenchConfig {
            pp: vec![512],
            tg: vec![128],
            depths: vec![0, depth],
            reps: 1,
            n_batch: 256,
        };
        assert_eq!(cfg(1024).n_ctx().unwrap(), 1024 + 512 + 1);
        let e = cfg(usize::MAX).n_ctx().unwrap_err().to_string();
        assert!(e.contains("deepest test") && e.contains("1..=1048576"), "{e}");
    }

    #[test]
    fn summary_statistics() {
        let f = summarize("m", "pp8".into(), 2, 0, vec![3.0, 1.0, 2.0, 10.0]);
        assert_eq!((f.tps_median, f.tps_min, f.tps_max), (2.5, 1.0, 10.0));
        let f = summarize("m", "tg8".into(), 2, 0, vec![5.0, 1.0, 2.0]);
        assert_eq!(f.tps_median, 2.0);
    }

    #[test]
    fn rss_and_bandwidth_are_measured() {
        assert!(peak_rss() > 0);
        assert!(current_rss() > 0 && current_rss() <= peak_rss());
        // A 64 MiB buffer raises the peak; once it is freed, a reset brings the peak back below it. (The peak is the
        // process's: nextest runs this test alone in its own.)
        let buf = vec![1u8; 64 << 20];
        std::hint::black_box(&buf);
        let high = peak_rss();
        drop(buf);
        if reset_peak_rss() {
            assert!(
                peak_rss() + (32 << 20) < high,
                "peak {} after the reset, {high} before",
                peak_rss()
            );
        }
        let bw = measure_bandwidth(&ThreadPool::new(2));
        assert!(bw > 1e8, "bandwidth {bw}");
    }
}
