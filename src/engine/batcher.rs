//! Shares decode steps between sessions driven by different threads (the server's slots): each thread hands its
//! session and next token to the batcher's thread, which runs one [`Batch`] step over every session that is ready
//! and hands each back with its logits. Sampling stays on the caller's thread (its own sampler and seed).
//!
//! The batcher waits for more sessions only while fewer are ready than are decoding ([`Batcher::decoding`]), and at
//! most `window`: a session in prefill or between requests is never waited for. A session decoding alone steps on
//! its own thread (the same logits, bit for bit), so a lone client pays no hand-over to the batcher's thread.
//! Sessions move by value (a `Box`) to the batcher and back, so no session is ever shared between threads.

use super::batch::Batch;
use super::session::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Context, Result, anyhow};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, mpsc};
use std::time::{Duration, Instant};

/// Counters of the batched steps run (`/metrics`): rows / steps is the mean batch size.
#[derive(Default)]
pub struct BatchStats {
    pub steps: AtomicU64,
    pub rows: AtomicU64,
}

/// One session's step, on its way to the batcher.
struct Request {
    session: Box<Session>,
    token: u32,
    /// The caller's logits buffer, filled with its row.
    logits: Vec<f32>,
    reply: mpsc::Sender<Reply>,
}

/// The session back, with its logits or why the step failed.
struct Reply {
    session: Box<Session>,
    logits: Vec<f32>,
    result: Result<()>,
}

/// The handle the sessions' threads share; the batcher's thread ends when the last handle is dropped.
pub struct Batcher {
    tx: mpsc::Sender<Request>,
    /// Sessions between their first and last decode step.
    decoding: Arc<AtomicUsize>,
    n_vocab: usize,
    stats: Arc<BatchStats>,
}

/// Marks a session as decoding while alive.
pub struct Decoding(Arc<AtomicUsize>);

impl Drop for Decoding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

impl Batcher {
    /// Starts the batcher's thread for up to `max_rows` sessions of `model` with contexts of at most `n_ctx`.
    pub fn start(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        max_rows: usize,
        n_ctx: usize,
        window: Duration,
        stats: Arc<BatchStats>,
    ) -> Result<Arc<Batcher>> {
        let n_vocab = model.hp.n_vocab;
        let batch = Batch::new(model, pool, max_rows, n_ctx)?;
        let (tx, rx) = mpsc::channel();
        let decoding = Arc::new(AtomicUsize::new(0));
        let (d, st) = (decoding.clone(), stats.clone());
        std::thread::Builder::new()
            .name("batcher".into())
            .spawn(move || run(batch, rx, &d, window, &st))
            .context("cannot start the batcher thread")?;
        Ok(Arc::new(Batcher {
            tx,
            decoding,
            n_vocab,
            stats,
        }))
    }

    /// Counts the caller's session as decoding until the guard is dropped (the batcher waits for decoding
    /// sessions only).
    pub fn decoding(&self) -> Decoding {
        self.decoding.fetch_add(1, Ordering::SeqCst);
        Decoding(self.decoding.clone())
    }

    /// A seat at the batcher for one session's thread: its reply channel and logits buffer, made once.
    pub fn seat(self: &Arc<Self>) -> Seat {
        let (tx, rx) = mpsc::channel();
        Seat {
            batcher: self.clone(),
            tx,
            rx,
            logits: vec![0.0; self.n_vocab],
        }
    }
}

/// One thread's way to the batcher.
pub struct Seat {
    batcher: Arc<Batcher>,
    tx: mpsc::Sender<Reply>,
    rx: mpsc::Receiver<Reply>,
    logits: Vec<f32>,
}

impl Seat {
    pub fn batcher(&self) -> &Arc<Batcher> {
        &self.batcher
    }

    /// Feeds `token` to the session in `slot` in a step shared with whatever other sessions are ready (alone on
    /// this thread when no other session is decoding), and returns the next token's logits. The session is lent to
    /// the batcher meanwhile; it is only lost (`slot` left empty) when the batcher's thread is gone.
    pub fn step<'a>(&'a mut self, slot: &'a mut Option<Box<Session>>, token: u32) -> Result<&'a [f32]> {
        if self.batcher.decoding.load(Ordering::SeqCst) <= 1 {
            let session = slot
                .as_deref_mut()
                .ok_or_else(|| anyhow!("the session was lost by the batcher"))?;
            let stats = &self.batcher.stats;
            stats.steps.fetch_add(1, Ordering::Relaxed);
            stats.rows.fetch_add(1, Ordering::Relaxed);
            return session.forward(Input::Tokens(&[token]), Want::LastLogits);
        }
        let session = slot
            .take()
            .ok_or_else(|| anyhow!("the session was lost by the batcher"))?;
        let req = Request {
            session,
            token,
            logits: std::mem::take(&mut self.logits),
            reply: self.tx.clone(),
        };
        self.batcher
            .tx
            .send(req)
            .map_err(|_| anyhow!("the batcher has stopped"))?;
        let reply = self.rx.recv().map_err(|_| anyhow!("the batcher has stopped"))?;
        *slot = Some(reply.session);
        self.logits = reply.logits;
        reply.result?;
        Ok(&self.logits)
    }
}

/// The batcher's thread: gather ready sessions, step them together, hand them back.
fn run(mut batch: Batch, rx: mpsc::Receiver<Request>, decoding: &AtomicUsize, window: Duration, stats: &BatchStats) {
    let max = batch.max_rows();
    let mut sessions: Vec<Box<Session>> = Vec::with_capacity(max);
    let mut tokens: Vec<u32> = Vec::with_capacity(max);
    let mut waiting: Vec<(Vec<f32>, mpsc::Sender<Reply>)> = Vec::with_capacity(max);
    while let Ok(first) = rx.recv() {
        let mut next = Some(first);
        let deadline = Instant::now() + window;
        while let Some(r) = next.take() {
            sessions.push(r.session);
            tokens.push(r.token);
            waiting.push((r.logits, r.reply));
            if sessions.len() == max {
                break;
            }
            // Wait (up to the window) only for sessions that are decoding and not here yet.
            next = if sessions.len() < decoding.load(Ordering::SeqCst) {
                rx.recv_timeout(deadline.saturating_duration_since(Instant::now())).ok()
            } else {
                rx.try_recv().ok()
            };
        }
        stats.steps.fetch_add(1, Ordering::Relaxed);
        stats.rows.fetch_add(sessions.len() as u64, Ordering::Relaxed);

        let mut errors: Vec<Option<anyhow::Error>> = Vec::new();
        let fill = |buf: &mut Vec<f32>, row: &[f32]| {
            buf.clear();
            buf.extend_from_slice(row);
        };
        match batch.step(&mut sessions, &tokens) {
            Ok(logits) => {
                let nv = logits.len() / sessions.len();
                for (i, (buf, _)) in waiting.iter_mut().enumerate() {
                    fill(buf, &logits[i * nv..(i + 1) * nv]);
                }
            }
            Err(_) => {
                // A failed step changes nothing: step each session alone so one bad session fails only itself.
                for i in 0..sessions.len() {
                    match batch.step(&mut sessions[i..=i], &tokens[i..=i]) {
                        Ok(logits) => fill(&mut waiting[i].0, logits),
                        Err(e) => {
                            errors.resize_with(sessions.len(), || None);
                            errors[i] = Some(e);
                        }
                    }
                }
            }
        }
        for (i, (session, (logits, reply))) in sessions.drain(..).zip(waiting.drain(..)).enumerate() {
            let result = match errors.get_mut(i).and_then(Option::take) {
                Some(e) => Err(e),
                None => Ok(()),
            };
            let _ = reply.send(Reply {
                session,
                logits,
                result,
            });
        }
        tokens.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::batch::tests::{prompt, tiny};
    use crate::kernels::ops::argmax;
    use crate::model::Arch;

    fn greedy_alone(s: &mut Session, mut t: u32, n: usize) -> Vec<u32> {
        (0..n)
            .map(|_| {
                let cur = t;
                t = argmax(s.forward(Input::Tokens(&[cur]), Want::LastLogits).unwrap()) as u32;
                cur
            })
            .collect()
    }

    /// Three threads decoding through one batcher get the tokens each gets alone, in shared steps.
    #[test]
    fn threads_decoding_through_the_batcher_match_alone() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny(Arch::Gemma3, dir.path());
        let pool = Arc::new(ThreadPool::new(2));
        let stats = Arc::new(BatchStats::default());
        let batcher = Batcher::start(m.clone(), pool.clone(), 3, 64, Duration::from_millis(50), stats.clone()).unwrap();
        let all = Arc::new(std::sync::Barrier::new(3));
        let threads: Vec<_> = (0..3u32)
            .map(|i| {
                let (m, pool, batcher, all) = (m.clone(), pool.clone(), batcher.clone(), all.clone());
                std::thread::spawn(move || {
                    let toks = prompt(5 + 9 * i as usize, i);
                    let mut alone = Session::new(m.clone(), pool.clone(), 64, 64).unwrap();
                    let first = argmax(alone.eval(&toks).unwrap()) as u32;
                    let want = greedy_alone(&mut alone, first, 12);
                    let mut slot = Some(Box::new(Session::new(m, pool, 64, 64).unwrap()));
                    slot.as_mut().unwrap().eval(&toks).unwrap();
                    let mut seat = batcher.seat();
                    let _d = batcher.decoding();
                    // Every thread decoding before the first step, so every step goes through the batcher.
                    all.wait();
                    let mut t = first;
                    let got: Vec<u32> = (0..12)
                        .map(|_| {
                            let cur = t;
                            t = argmax(seat.step(&mut slot, cur).unwrap()) as u32;
                            cur
                        })
                        .collect();
                    assert_eq!(got, want, "thread {i}");
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        let (steps, rows) = (stats.steps.load(Ordering::Relaxed), stats.rows.load(Ordering::Relaxed));
        assert_eq!(rows, 36);
        assert!(steps < rows, "{steps} steps for {rows} rows: nothing was batched");
    }

    /// A lone decoding session steps on its own thread at once; one that waits for a decoding session that is not ready
    /// waits the window and no longer.
    #[test]
    fn the_window_is_paid_only_for_sessions_that_decode() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny(Arch::Llama, dir.path());
        let pool = Arc::new(ThreadPool::new(1));
        let stats = Arc::new(BatchStats::default());
        let window = Duration::from_millis(400);
        let batcher = Batcher::start(m.clone(), pool.clone(), 2, 16, window, stats.clone()).unwrap();
        let mut slot = Some(Box::new(Session::new(m, pool, 16, 16).unwrap()));
        let mut seat = batcher.seat();
        let time_step = |seat: &mut Seat, slot: &mut Option<Box<Session>>| {
            let t0 = Instant::now();
            seat.step(slot, 7).unwrap();
            t0.elapsed()
        };
        let alone = {
            let _d = batcher.decoding();
            time_step(&mut seat, &mut slot)
        };
        assert!(alone < window / 2, "a lone session waited {alone:?}");
        assert_eq!(stats.steps.load(Ordering::Relaxed), 1);
        let _a = batcher.decoding();
        let _b = batcher.decoding();
        let waited = time_step(&mut seat, &mut slot);
        assert!(waited >= window, "waited {waited:?}, less than the window");
        assert!(waited < window * 10, "waited {waited:?}");
        assert_eq!(slot.unwrap().n_past(), 2);
    }
}
