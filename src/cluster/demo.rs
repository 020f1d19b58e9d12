//! `baton demo`: a prefill node and a decode node on this machine (child processes on loopback, the decode node
//! with fewer threads, as a compute-poor machine next to a compute-rich one), the same greedy completion run locally
//! on the decode node's threads and disaggregated, with the time to first token of each and its breakdown.

use anyhow::{Context, Result, bail};
use std::io::{BufRead, BufReader, Read};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

#[derive(Clone, Debug)]
pub struct DemoOpts {
    pub model: PathBuf,
    pub prefill_threads: usize,
    pub decode_threads: usize,
    /// Prompt length in tokens (about; the built-in text is repeated to reach it).
    pub prompt_tokens: usize,
    pub n_predict: usize,
    pub kv_bits: String,
}

/// A child process killed and reaped on drop, and killed by the kernel if we die first.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn command(exe: &Path) -> Command {
    let mut c = Command::new(exe);
    unsafe {
        c.pre_exec(|| {
            libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL);
            Ok(())
        });
    }
    c
}

/// Starts `baton node` and waits (at most 120 s) for its listening address.
fn start_node(exe: &Path, o: &DemoOpts) -> Result<(ChildGuard, String)> {
    let mut child = command(exe)
        .args(["node", "--model"])
        .arg(&o.model)
        .args([
            "--listen",
            "127.0.0.1:0",
            "-t",
            &o.prefill_threads.to_string(),
            "-c",
            "8192",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start the prefill node")?;
    let stderr = child.stderr.take().unwrap();
    let guard = ChildGuard(child);
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines() {
            let Ok(line) = line else { break };
            if let Some(rest) = line.strip_prefix("baton node: listening on ") {
                let _ = tx.send(rest.split_whitespace().next().unwrap_or("").to_string());
            }
        }
    });
    let addr = rx
        .recv_timeout(Duration::from_secs(120))
        .context("the prefill node did not start listening within 120 s")?;
    Ok((guard, addr))
}

/// Runs `baton run` as a child (the decode node) and returns (stdout, stderr, wall time).
fn run_child(exe: &Path, o: &DemoOpts, prompt: &Path, extra: &[&str]) -> Result<(String, String, Duration)> {
    let t0 = Instant::now();
    let child = command(exe)
        .args(["run", "--model"])
        .arg(&o.model)
        .args([
            "-t",
            &o.decode_threads.to_string(),
            "-c",
            "8192",
            "--temp",
            "0",
            "-v",
            "-n",
        ])
        .arg(o.n_predict.to_string())
        .arg("-f")
        .arg(prompt)
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .context("cannot start the decode node")?;
    let mut guard = ChildGuard(child);
    let mut out = String::new();
    let mut err = String::new();
    let mut so = guard.0.stdout.take().unwrap();
    let mut se = guard.0.stderr.take().unwrap();
    let t = std::thread::spawn(move || {
        let mut e = String::new();
        let _ = se.read_to_string(&mut e);
        e
    });
    so.read_to_string(&mut out)?;
    err.push_str(&t.join().unwrap_or_default());
    let status = guard.0.wait()?;
    if !status.success() {
        bail!("baton run failed: {}", err.lines().last().unwrap_or(""));
    }
    Ok((out, err, t0.elapsed()))
}

const TEXT: &str = "The river ran north through the valley, past the mill and the old stone bridge, and in the spring \
the snow from the mountains made it wide and loud. The miller's daughter kept a notebook of the water's height, one \
line each morning, and by the end of her twelfth year she had filled three notebooks and could tell from the colour \
of the water how many days of rain had fallen upstream. ";

/// Runs the demo; prints to standard output.
pub fn run(o: &DemoOpts) -> Result<()> {
    let exe = std::env::current_exe().context("cannot find the baton executable")?;
    let dir = tempfile::tempdir()?;
    let prompt_path = dir.path().join("prompt.txt");
    // About 75 tokens per repetition of the text.
    let reps = o.prompt_tokens.div_ceil(75).max(1);
    let mut prompt = TEXT.repeat(reps);
    prompt.push_str("\nSummarise the story above in one sentence:");
    std::fs::write(&prompt_path, &prompt)?;

    println!(
        "baton demo: model {}, prefill node {} threads, decode node {} threads, ~{} prompt tokens, KV on the wire {} bits",
        o.model.display(),
        o.prefill_threads,
        o.decode_threads,
        o.prompt_tokens,
        o.kv_bits
    );
    let (_node, addr) = start_node(&exe, o)?;
    println!("prefill node listening on {addr}");

    let (local_out, local_err, _) = run_child(&exe, o, &prompt_path, &[])?;
    let (dis_out, dis_err, _) = run_child(
        &exe,
        o,
        &prompt_path,
        &["--prefill-node", &addr, "--offload", "always", "--kv-bits", &o.kv_bits],
    )?;
    let speed = |e: &str| e.lines().rfind(|l| l.starts_with("prompt:")).unwrap_or("").to_string();
    let detail = |e: &str| -> Vec<String> {
        e.lines()
            .filter(|l| {
                l.starts_with("plan:")
                    || l.starts_with("prefill:")
                    || l.starts_with("ttft:")
                    || l.starts_with("kv:")
                    || l.starts_with("warning:")
            })
            .map(str::to_string)
            .collect()
    };
    println!("\n== local ({} threads) ==", o.decode_threads);
    println!("{}", local_out.trim_end());
    println!("  {}", speed(&local_err));
    println!(
        "\n== disaggregated (prefill on {addr}, {} threads; decode here) ==",
        o.prefill_threads
    );
    println!("{}", dis_out.trim_end());
    println!("  {}", speed(&dis_err));
    for l in detail(&dis_err) {
        println!("  {l}");
    }
    println!(
        "\ncompletions {}",
        if local_out == dis_out {
            "identical"
        } else {
            "differ (expected only with a lossy --kv-bits)"
        }
    );
    Ok(())
}
