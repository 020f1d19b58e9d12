//! The one batcher of decode steps shared between sessions driven by different threads: the server's local slots
//! ([`Seat`]) and `baton node`'s sessions (`cluster::node`). Sampling stays with each caller.
//!
//! A caller queues its session's next step ([`Batcher::step`]). If no other caller is leading, it leads: it takes the
//! cores (a lock shared with whatever else runs forward passes there), takes every queued step, waits a little for
//! more, runs them as one [`Batch`] step, answers each, and ends its turn. A caller that finds a leader at work waits
//! for the end of that turn, then finds its step run or leads the next. The batcher has no thread of its own, so a
//! session decoding alone steps on its own thread with no hand-over; and a caller whose step was run never waits for
//! the cores, so a leader never waits its window for a session that is only waiting to hear back.
//!
//! The policies, here once:
//! - **Wait only for sessions that decode**: the leader waits while fewer steps are queued than sessions are decoding
//!   ([`Liveness`]), and at most the window; a session in prefill or gone quiet is never waited for.
//! - **Alone is exact**: a step without company runs as [`Session::forward`] of its one token, so a session decoding
//!   alone gets the same logits, bit for bit, as without batching.
//! - **A failed step changes no session**: [`Batch::step`] checks before it writes; the rows are then stepped one by
//!   one, so a bad session fails only itself.
//! - **One step of a session per forward**: a second step of a session already in a forward waits for the next one.
//! - **Counted**: [`BatchStats`] counts the steps run and the rows they carried (`/metrics`, the node's log).

use super::batch::Batch;
use super::session::{Input, Session, Want};
use crate::kernels::ThreadPool;
use crate::model::Model;
use anyhow::{Result, anyhow};
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, mpsc};
use std::time::{Duration, Instant};

/// Counters of the decode steps run through a batcher (`/metrics`): rows / steps is the mean batch size.
#[derive(Default)]
pub struct BatchStats {
    pub steps: AtomicU64,
    pub rows: AtomicU64,
}

/// How the batcher knows which sessions are decoding, i.e. worth waiting for.
#[derive(Clone, Copy, Debug)]
pub enum Liveness {
    /// Each holds a [`Decoding`] guard from its first decode step to its last (the server's slots).
    Marked,
    /// Each asked for a step within this long: a node cannot see when a remote session stops decoding.
    Recent(Duration),
}

/// When to stop gathering.
#[derive(Clone, Copy, Debug)]
pub struct Policy {
    /// Most sessions one step carries.
    pub max_rows: usize,
    /// Longest wait for the decoding sessions' next steps.
    pub window: Duration,
    pub liveness: Liveness,
}

/// A decode step of one session, queued by the thread that drives it.
pub trait Pending: Send + Sized {
    /// The session it steps (an address): two steps of one session never share a forward.
    fn session_key(&self) -> usize;
    /// Runs steps of distinct sessions on the leader's thread: turns each into a [`Row`] (or answers it at once)
    /// and hands the rows to [`Stepper::run`].
    fn run(steps: Vec<Self>, stepper: &mut Stepper);
}

/// One session's next token, ready for its forward pass.
pub trait Row {
    fn token(&self) -> u32;
    fn session(&mut self) -> &mut Session;
    /// The step is over: it ran in this long (the session now holds the token, and its logits in
    /// [`Session::last_logits`]), or it failed and the session is as it was.
    fn done(self, out: Result<Duration>);
}

/// Shared by the threads whose sessions it steps.
pub struct Batcher<P: Pending> {
    queue: Mutex<Queue<P>>,
    /// Signalled on each queued step, for a leader that is gathering.
    arrived: Condvar,
    /// Signalled at the end of each leader's turn, for the callers waiting on it.
    turn_over: Condvar,
    /// Held by the leader while it gathers and steps, and by anything else that must not share the cores with it.
    cores: Arc<Mutex<()>>,
    stepper: Mutex<Stepper>,
    policy: Policy,
    /// Sessions holding a [`Decoding`] guard ([`Liveness::Marked`]).
    marked: Arc<AtomicUsize>,
    /// When each session last asked for a step ([`Liveness::Recent`]).
    asked: Mutex<HashMap<usize, Instant>>,
}

struct Queue<P> {
    next_id: u64,
    steps: Vec<(u64, P)>,
    /// A caller is leading a turn: it has taken, or will take, the steps queued.
    leading: bool,
    /// The steps the turn on has taken: not run yet.
    taken: Vec<u64>,
}

/// Ends a leader's turn, also when its step panicked (the callers whose steps it held then find them lost).
struct Turn<'a, P: Pending>(&'a Batcher<P>);

impl<P: Pending> Drop for Turn<'_, P> {
    fn drop(&mut self) {
        let mut q = lock(&self.0.queue);
        q.leading = false;
        q.taken.clear();
        drop(q);
        self.0.turn_over.notify_all();
    }
}

/// Runs the gathered rows: the batch scratch, allocated once, and the counters.
pub struct Stepper {
    batch: Batch,
    stats: Arc<BatchStats>,
}

/// Marks a session as decoding while alive ([`Liveness::Marked`]).
pub struct Decoding(Arc<AtomicUsize>);

impl Drop for Decoding {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

impl<P: Pending> Batcher<P> {
    /// A batcher of sessions of `model` whose contexts are at most `n_ctx`; its leader holds `cores`.
    pub fn new(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        n_ctx: usize,
        policy: Policy,
        stats: Arc<BatchStats>,
        cores: Arc<Mutex<()>>,
    ) -> Result<Batcher<P>> {
        let batch = Batch::new(model, pool, policy.max_rows, n_ctx)?;
        Ok(Batcher {
            queue: Mutex::new(Queue {
                next_id: 0,
                steps: Vec::new(),
                leading: false,
                taken: Vec::new(),
            }),
            arrived: Condvar::new(),
            turn_over: Condvar::new(),
            cores,
            stepper: Mutex::new(Stepper { batch, stats }),
            policy,
            marked: Arc::new(AtomicUsize::new(0)),
            asked: Mutex::new(HashMap::new()),
        })
    }

    /// Counts the caller's session as decoding until the guard is dropped ([`Liveness::Marked`]).
    pub fn decoding(&self) -> Decoding {
        self.marked.fetch_add(1, Ordering::SeqCst);
        Decoding(self.marked.clone())
    }

    /// Queues `step` and returns once it has run (answered by its [`Row::done`] or [`Pending::run`]): in a turn led
    /// by this thread, or by another.
    pub fn step(&self, step: P) {
        if let Liveness::Recent(_) = self.policy.liveness {
            lock(&self.asked).insert(step.session_key(), Instant::now());
        }
        let mut q = lock(&self.queue);
        let id = q.next_id;
        q.next_id += 1;
        q.steps.push((id, step));
        self.arrived.notify_one();
        // A turn runs every step it took before it ends: a step neither queued nor taken by the turn on has run.
        loop {
            let queued = q.steps.iter().any(|(i, _)| *i == id);
            if !queued && !q.taken.contains(&id) {
                return;
            }
            if queued && !q.leading {
                break;
            }
            q = self.turn_over.wait(q).unwrap_or_else(|p| p.into_inner());
        }
        q.leading = true;
        drop(q);
        let _turn = Turn(self);
        let _cores = lock(&self.cores);
        let mut steps = self.gather();
        let mut stepper = lock(&self.stepper);
        while !steps.is_empty() {
            let (now, later) = split(steps, self.policy.max_rows);
            P::run(now, &mut stepper);
            steps = later;
        }
    }

    /// Takes the queued steps, and waits (up to the window) for more while fewer are here than sessions decode.
    fn gather(&self) -> Vec<P> {
        let deadline = Instant::now() + self.policy.window;
        let mut got = Vec::new();
        let mut q = lock(&self.queue);
        loop {
            let Queue { steps, taken, .. } = &mut *q;
            for (id, p) in steps.drain(..) {
                taken.push(id);
                got.push(p);
            }
            let now = Instant::now();
            if got.len() >= self.policy.max_rows.min(self.n_decoding()) || now >= deadline {
                return got;
            }
            q = self
                .arrived
                .wait_timeout(q, deadline - now)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        }
    }

    fn n_decoding(&self) -> usize {
        match self.policy.liveness {
            Liveness::Marked => self.marked.load(Ordering::SeqCst),
            Liveness::Recent(recent) => {
                let mut asked = lock(&self.asked);
                asked.retain(|_, t| t.elapsed() < recent);
                asked.len()
            }
        }
    }
}

/// The steps of this forward (distinct sessions, at most `max`) and those left for the next.
fn split<P: Pending>(steps: Vec<P>, max: usize) -> (Vec<P>, Vec<P>) {
    let (mut now, mut later, mut keys) = (Vec::new(), Vec::new(), Vec::new());
    for p in steps {
        let key = p.session_key();
        if now.len() < max.max(1) && !keys.contains(&key) {
            keys.push(key);
            now.push(p);
        } else {
            later.push(p);
        }
    }
    (now, later)
}

impl Stepper {
    /// Steps `rows` together (a lone row alone) and answers each.
    pub fn run<R: Row>(&mut self, mut rows: Vec<R>) {
        let n = rows.len();
        if n == 0 {
            return;
        }
        self.stats.steps.fetch_add(1, Ordering::Relaxed);
        self.stats.rows.fetch_add(n as u64, Ordering::Relaxed);
        if n == 1 {
            return rows.into_iter().for_each(alone);
        }
        let tokens: Vec<u32> = rows.iter().map(R::token).collect();
        let t0 = Instant::now();
        let stepped = {
            let mut sessions: Vec<&mut Session> = rows.iter_mut().map(R::session).collect();
            match self.batch.step(&mut sessions, &tokens) {
                Ok(logits) => {
                    for (s, row) in sessions.iter_mut().zip(logits.chunks_exact(logits.len() / n)) {
                        s.keep_logits(row);
                    }
                    true
                }
                Err(_) => false,
            }
        };
        if stepped {
            let t = t0.elapsed();
            rows.into_iter().for_each(|r| r.done(Ok(t)));
        } else {
            rows.into_iter().for_each(alone);
        }
    }
}

/// One session's step on its own: the forward pass it would run without batching.
fn alone<R: Row>(mut row: R) {
    let token = row.token();
    let t0 = Instant::now();
    let out = row
        .session()
        .forward(Input::Tokens(&[token]), Want::LastLogits)
        .map(|_| ());
    row.done(out.map(|()| t0.elapsed()));
}

/// A local slot's step. The session travels by value (a `Box`) to the leader and back, so no session is ever
/// shared between threads.
pub struct LocalStep {
    session: Box<Session>,
    token: u32,
    reply: mpsc::Sender<(Box<Session>, Result<()>)>,
}

impl Pending for LocalStep {
    fn session_key(&self) -> usize {
        &*self.session as *const Session as usize
    }

    fn run(steps: Vec<Self>, stepper: &mut Stepper) {
        stepper.run(steps);
    }
}

impl Row for LocalStep {
    fn token(&self) -> u32 {
        self.token
    }

    fn session(&mut self) -> &mut Session {
        &mut self.session
    }

    fn done(self, out: Result<Duration>) {
        let _ = self.reply.send((self.session, out.map(drop)));
    }
}

impl Batcher<LocalStep> {
    /// The batcher of the server's slots: up to `max_rows` sessions of `model`, contexts of at most `n_ctx`, waiting
    /// up to `window` for slots that hold a [`Decoding`] guard. Its cores are its own: prefills run beside it.
    pub fn local(
        model: Arc<Model>,
        pool: Arc<ThreadPool>,
        max_rows: usize,
        n_ctx: usize,
        window: Duration,
        stats: Arc<BatchStats>,
    ) -> Result<Arc<Batcher<LocalStep>>> {
        let policy = Policy {
            max_rows,
            window,
            liveness: Liveness::Marked,
        };
        let cores = Arc::new(Mutex::new(()));
        Ok(Arc::new(Batcher::new(model, pool, n_ctx, policy, stats, cores)?))
    }

    /// A seat for one slot's thread: its reply channel, made once.
    pub fn seat(self: &Arc<Self>) -> Seat {
        let (tx, rx) = mpsc::channel();
        Seat {
            batcher: self.clone(),
            tx,
            rx,
        }
    }
}

/// One slot thread's way to the batcher.
pub struct Seat {
    batcher: Arc<Batcher<LocalStep>>,
    tx: mpsc::Sender<(Box<Session>, Result<()>)>,
    rx: mpsc::Receiver<(Box<Session>, Result<()>)>,
}

impl Seat {
    pub fn batcher(&self) -> &Arc<Batcher<LocalStep>> {
        &self.batcher
    }

    /// Feeds `token` to the session in `slot` in a step shared with whatever other sessions are ready, and returns
    /// the next token's logits. The session is lent meanwhile; it is only lost (`slot` left empty) when the step
    /// that held it panicked.
    pub fn step<'a>(&mut self, slot: &'a mut Option<Box<Session>>, token: u32) -> Result<&'a [f32]> {
        let session = slot
            .take()
            .ok_or_else(|| anyhow!("the session was lost by the batcher"))?;
        self.batcher.step(LocalStep {
            session,
            token,
            reply: self.tx.clone(),
        });
        let (session, result) = self
            .rx
            .try_recv()
            .map_err(|_| anyhow!("the batched step was lost with the session"))?;
        let session = slot.insert(session);
        result?;
        Ok(session.last_logits())
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
        let batcher = Batcher::local(m.clone(), pool.clone(), 3, 64, Duration::from_millis(50), stats.clone()).unwrap();
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
                    // Every thread decoding before the first step, so the steps gather.
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

    /// A lone decoding session steps at once, with the bits of a forward alone; one that waits for a decoding
    /// session that is not ready waits the window and no longer.
    #[test]
    fn the_window_is_paid_only_for_sessions_that_decode() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny(Arch::Llama, dir.path());
        let pool = Arc::new(ThreadPool::new(1));
        let stats = Arc::new(BatchStats::default());
        let window = Duration::from_millis(400);
        let batcher = Batcher::local(m.clone(), pool.clone(), 2, 16, window, stats.clone()).unwrap();
        let mut slot = Some(Box::new(Session::new(m.clone(), pool.clone(), 16, 16).unwrap()));
        let mut reference = Session::new(m, pool, 16, 16).unwrap();
        let mut seat = batcher.seat();
        let time_step = |seat: &mut Seat, slot: &mut Option<Box<Session>>| {
            let t0 = Instant::now();
            let bits: Vec<u32> = seat.step(slot, 7).unwrap().iter().map(|v| v.to_bits()).collect();
            (t0.elapsed(), bits)
        };
        let (alone, bits) = {
            let _d = batcher.decoding();
            time_step(&mut seat, &mut slot)
        };
        assert!(alone < window / 2, "a lone session waited {alone:?}");
        let want: Vec<u32> = reference
            .forward(Input::Tokens(&[7]), Want::LastLogits)
            .unwrap()
            .iter()
            .map(|v| v.to_bits())
            .collect();
        assert!(bits == want, "a lone step's logits differ from a forward alone");
        assert_eq!(stats.steps.load(Ordering::Relaxed), 1);
        let _a = batcher.decoding();
        let _b = batcher.decoding();
        let (waited, _) = time_step(&mut seat, &mut slot);
        assert!(waited >= window, "waited {waited:?}, less than the window");
        assert!(waited < window * 10, "waited {waited:?}");
        assert_eq!(slot.unwrap().n_past(), 2);
    }

    /// Two sessions decoding in lockstep never wait the window: a session whose step has run
    /// hears back at the end of the turn, not after the next leader's gather.
    #[test]
    fn sessions_in_lockstep_never_wait_the_window() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny(Arch::Llama, dir.path());
        let pool = Arc::new(ThreadPool::new(1));
        let stats = Arc::new(BatchStats::default());
        let window = Duration::from_secs(1);
        let batcher = Batcher::local(m.clone(), pool.clone(), 2, 32, window, stats.clone()).unwrap();
        let all = Arc::new(std::sync::Barrier::new(2));
        let t0 = Instant::now();
        let threads: Vec<_> = (0..2)
            .map(|_| {
                let (m, pool, batcher, all) = (m.clone(), pool.clone(), batcher.clone(), all.clone());
                std::thread::spawn(move || {
                    let mut slot = Some(Box::new(Session::new(m, pool, 32, 32).unwrap()));
                    let mut seat = batcher.seat();
                    let d = batcher.decoding();
                    all.wait();
                    for t in 0..8 {
                        seat.step(&mut slot, 100 + t).unwrap();
                    }
                    drop(d);
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        // At most the last step waits: its partner stopped decoding after its own last step.
        let took = t0.elapsed();
        assert!(took < window * 2, "8 steps each took {took:?}");
        assert_eq!(stats.rows.load(Ordering::Relaxed), 16);
    }

    /// A step whose batch fails is retried row by row: the bad session fails alone, the good one steps.
    #[test]
    fn a_failed_batch_fails_only_the_bad_session() {
        let dir = tempfile::tempdir().unwrap();
        let m = tiny(Arch::Llama, dir.path());
        let pool = Arc::new(ThreadPool::new(1));
        let stats = Arc::new(BatchStats::default());
        let mut stepper = Stepper {
            batch: Batch::new(m.clone(), pool.clone(), 3, 8).unwrap(),
            stats: stats.clone(),
        };
        let (tx, rx) = mpsc::channel();
        let mut full = Box::new(Session::new(m.clone(), pool.clone(), 8, 8).unwrap());
        full.eval(&prompt(8, 0)).unwrap();
        let fine = Box::new(Session::new(m, pool, 8, 8).unwrap());
        let step = |session, token| LocalStep {
            session,
            token,
            reply: tx.clone(),
        };
        stepper.run(vec![step(full, 1), step(fine, 2)]);
        let (a, ra) = rx.try_recv().unwrap();
        let (b, rb) = rx.try_recv().unwrap();
        assert!(format!("{:#}", ra.unwrap_err()).contains("context full"));
        rb.unwrap();
        assert_eq!((a.n_past(), b.n_past()), (8, 1));
        assert_eq!(b.tokens(), &[2]);
        assert_eq!(
            (stats.steps.load(Ordering::Relaxed), stats.rows.load(Ordering::Relaxed)),
            (1, 2)
        );
    }

    struct Key(usize);

    impl Pending for Key {
        fn session_key(&self) -> usize {
            self.0
        }

        fn run(_: Vec<Self>, _: &mut Stepper) {}
    }

    /// Two steps of one session never share a forward, and a forward takes at most `max` rows.
    #[test]
    fn a_forward_takes_one_step_per_session_and_at_most_max() {
        let keys = |v: &[Key]| v.iter().map(|k| k.0).collect::<Vec<_>>();
        let (now, later) = split([1, 2, 1, 3, 4].map(Key).into(), 3);
        assert_eq!((keys(&now), keys(&later)), (vec![1, 2, 3], vec![1, 4]));
        let (now, later) = split(later, 3);
        assert_eq!((keys(&now), keys(&later)), (vec![1, 4], vec![]));
    }
}
