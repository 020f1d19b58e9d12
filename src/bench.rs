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
        self.model.hp.n_vocab
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
    let Ok(s) = std::fs::read_to_string("/proc/self/status") else {
        return 0;
    };
    s.lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
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
    report: impl FnMut(&Figure),
) -> Result<Vec<Figure>> {
    let max_depth = cfg.depths.iter().copied().max().unwrap_or(0);
    let max_test = cfg.pp.iter().chain(&cfg.tg).copied().max().unwrap_or(0);
    let threads = pool.n_threads();
    let mut s = Session::new(model, pool, max_depth + max_test + 1, cfg.n_batch)?;
    run_on(&mut s, name, threads, cfg, report)
}

/// Runs every test of `cfg` on any target (`threads` is only reported).
pub fn run_on(
    s: &mut dyn Target,
    name: &str,
    threads: usize,
    cfg: &BenchConfig,
    mut report: impl FnMut(&Figure),
) -> Result<Vec<Figure>> {
    let mut out = Vec::new();
    for &depth in &cfg.depths {
        for &n in &cfg.pp {
            run_pp(s, depth, n.min(64))?; // warm-up
            let samples = (0..cfg.reps).map(|_| run_pp(s, depth, n)).collect::<Result<Vec<_>>>()?;
            let f = summarize(name, format!("pp{n}"), threads, depth, samples);
            report(&f);
            out.push(f);
        }
        for &n in &cfg.tg {
            run_tg(s, depth, 4)?; // warm-up
            let samples = (0..cfg.reps).map(|_| run_tg(s, depth, n)).collect::<Result<Vec<_>>>()?;
            let f = summarize(name, format!("tg{n}"), threads, depth, samples);
            report(&f);
            out.push(f);
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

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
        let bw = measure_bandwidth(&ThreadPool::new(2));
        assert!(bw > 1e8, "bandwidth {bw}");
    }
}
