//! Persistent thread pool: threads are created once and woken for each [`ThreadPool::run`], the caller taking part
//! as thread 0. A forward pass calls `run` a few hundred times per token, so waking is a generation counter the
//! workers spin on for a short while before they sleep on a condvar; the caller spins (then yields) for the join.

use std::cell::{Cell, UnsafeCell};
use std::panic::{AssertUnwindSafe, catch_unwind, resume_unwind};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, PoisonError};
use std::thread::JoinHandle;

/// Spin iterations (a `pause` each, ~30-50 ns) a worker waits for the next job before it sleeps: long enough to
/// cover the gaps between the matmuls of one token, short enough that an idle pool costs nothing.
const WORKER_SPINS: u32 = 4096;
/// Spins of the caller waiting for the workers before it starts yielding its core.
const JOIN_SPINS: u32 = 1 << 14;

thread_local! {
    /// Set while this thread runs a pool job: a nested `run` then executes serially instead of deadlocking.
    static IN_JOB: Cell<bool> = const { Cell::new(false) };
}

/// A pointer the threads of one [`ThreadPool::run`] share, each writing disjoint elements of the buffer behind it.
#[derive(Clone, Copy)]
pub struct SyncPtr<T>(*mut T);
// SAFETY: only used for disjoint writes within one pool job, which outlives no borrow.
unsafe impl<T> Send for SyncPtr<T> {}
unsafe impl<T> Sync for SyncPtr<T> {}

impl<T> SyncPtr<T> {
    pub fn new(p: *mut T) -> SyncPtr<T> {
        SyncPtr(p)
    }

    /// A method, not a field access, so closures capture the whole (Sync) wrapper.
    pub fn get(self) -> *mut T {
        self.0
    }
}

type Job = *const (dyn Fn(usize, usize) + Sync + 'static);

struct Shared {
    n_threads: usize,
    /// Bumped once per job (and once at shutdown); each worker runs every generation exactly once.
    generation: AtomicUsize,
    /// Workers still running the current job.
    pending: AtomicUsize,
    /// The current job; written by the caller before the generation bump, cleared after the join.
    job: UnsafeCell<Option<Job>>,
    panicked: AtomicBool,
    shutdown: AtomicBool,
    sleepers: AtomicUsize,
    lock: Mutex<()>,
    wake: Condvar,
}

// SAFETY: `job` is only written by the one caller holding `run_lock` while no worker reads it (before the
// generation bump and after all workers have decremented `pending`); the job itself is `Sync`.
unsafe impl Sync for Shared {}
unsafe impl Send for Shared {}

pub struct ThreadPool {
    n_threads: usize,
    shared: Arc<Shared>,
    handles: Vec<JoinHandle<()>>,
    /// One `run` at a time when several threads share the pool.
    run_lock: Mutex<()>,
}

impl ThreadPool {
    /// A pool of `n_threads` (at least 1) counting the caller: `n_threads - 1` workers are spawned now.
    pub fn new(n_threads: usize) -> Self {
        let n_threads = n_threads.max(1);
        let shared = Arc::new(Shared {
            n_threads,
            generation: AtomicUsize::new(0),
            pending: AtomicUsize::new(0),
            job: UnsafeCell::new(None),
            panicked: AtomicBool::new(false),
            shutdown: AtomicBool::new(false),
            sleepers: AtomicUsize::new(0),
            lock: Mutex::new(()),
            wake: Condvar::new(),
        });
        let handles = (1..n_threads)
            .map(|idx| {
                let s = shared.clone();
                std::thread::Builder::new()
                    .name(format!("baton-worker-{idx}"))
                    .spawn(move || worker(&s, idx))
                    .expect("spawning a pool thread")
            })
            .collect();
        ThreadPool {
            n_threads,
            shared,
            handles,
            run_lock: Mutex::new(()),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(thread_index, n_threads)` on every thread of the pool (the caller is thread 0) and returns when all
    /// are done. A panic in any of them is re-raised here once every thread has finished. Called from inside a
    /// job, it runs all indices serially on the calling thread.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        let n = self.n_threads;
        if n == 1 || IN_JOB.get() {
            for i in 0..n {
                f(i, n);
            }
            return;
        }
        let _serial = self.run_lock.lock().unwrap_or_else(PoisonError::into_inner);
        let s = &*self.shared;
        let job: &(dyn Fn(usize, usize) + Sync) = &f;
        // SAFETY: the lifetime is erased only while this function waits for every worker to finish with the job.
        let job: Job = unsafe { std::mem::transmute::<*const (dyn Fn(usize, usize) + Sync + '_), Job>(job) };
        // SAFETY: no worker reads `job` now (see `Shared`).
        unsafe { *s.job.get() = Some(job) };
        s.panicked.store(false, Ordering::Relaxed);
        s.pending.store(n - 1, Ordering::Relaxed);
        s.generation.fetch_add(1, Ordering::SeqCst);
        if s.sleepers.load(Ordering::SeqCst) > 0 {
            let _l = s.lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.wake.notify_all();
        }

        IN_JOB.set(true);
        let mine = catch_unwind(AssertUnwindSafe(|| f(0, n)));
        IN_JOB.set(false);

        let mut spins = 0u32;
        while s.pending.load(Ordering::Acquire) != 0 {
            if spins < JOIN_SPINS {
                spins += 1;
                std::hint::spin_loop();
            } else {
                std::thread::yield_now();
            }
        }
        // SAFETY: every worker is done with the job.
        unsafe { *s.job.get() = None };
        if let Err(p) = mine {
            resume_unwind(p);
        }
        if s.panicked.load(Ordering::Relaxed) {
            panic!("a thread pool worker panicked");
        }
    }
}

fn worker(s: &Shared, idx: usize) {
    let mut seen = 0usize;
    loop {
        let mut spins = 0u32;
        loop {
            let g = s.generation.load(Ordering::Acquire);
            if g != seen {
                seen = g;
                break;
            }
            if spins < WORKER_SPINS {
                spins += 1;
                std::hint::spin_loop();
                continue;
            }
            let mut guard = s.lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.sleepers.fetch_add(1, Ordering::SeqCst);
            while s.generation.load(Ordering::SeqCst) == seen {
                guard = s.wake.wait(guard).unwrap_or_else(PoisonError::into_inner);
            }
            s.sleepers.fetch_sub(1, Ordering::SeqCst);
            drop(guard);
            spins = 0;
        }
        if s.shutdown.load(Ordering::Acquire) {
            return;
        }
        // SAFETY: the caller wrote the job before bumping the generation we just acquired, and keeps it alive
        // until we decrement `pending`.
        let job = unsafe { (*s.job.get()).expect("a job for every generation") };
        IN_JOB.set(true);
        // SAFETY: see above.
        let r = catch_unwind(AssertUnwindSafe(|| unsafe { (*job)(idx, s.n_threads) }));
        IN_JOB.set(false);
        if r.is_err() {
            s.panicked.store(true, Ordering::Relaxed);
        }
        s.pending.fetch_sub(1, Ordering::Release);
    }
}

impl Drop for ThreadPool {
    fn drop(&mut self) {
        let s = &*self.shared;
        s.shutdown.store(true, Ordering::Release);
        s.generation.fetch_add(1, Ordering::SeqCst);
        {
            let _l = s.lock.lock().unwrap_or_else(PoisonError::into_inner);
            s.wake.notify_all();
        }
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}

/// The `part`-th of `parts` near-equal contiguous ranges of `0..n`.
pub fn split_range(n: usize, part: usize, parts: usize) -> std::ops::Range<usize> {
    let base = n / parts;
    let extra = n % parts;
    let start = part * base + part.min(extra);
    start..start + base + usize::from(part < extra)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    #[test]
    fn every_index_runs_once_per_call() {
        let pool = ThreadPool::new(4);
        let counts: Vec<AtomicUsize> = (0..4).map(|_| AtomicUsize::new(0)).collect();
        for _ in 0..1000 {
            pool.run(|i, n| {
                assert_eq!(n, 4);
                counts[i].fetch_add(1, Ordering::Relaxed);
            });
        }
        assert!(counts.iter().all(|c| c.load(Ordering::Relaxed) == 1000));
    }

    #[test]
    fn results_visible_after_run_and_borrows_work() {
        let pool = ThreadPool::new(3);
        let mut out = vec![0u64; 300];
        for round in 0..50u64 {
            let ptr = out.as_mut_ptr() as usize;
            pool.run(|i, n| {
                for k in split_range(300, i, n) {
                    // SAFETY: disjoint ranges per thread.
                    unsafe { *(ptr as *mut u64).add(k) = k as u64 * round };
                }
            });
            assert!(out.iter().enumerate().all(|(k, &v)| v == k as u64 * round));
        }
    }

    #[test]
    fn wakes_after_workers_sleep() {
        let pool = ThreadPool::new(2);
        let hits = AtomicUsize::new(0);
        for _ in 0..3 {
            std::thread::sleep(std::time::Duration::from_millis(20));
            pool.run(|_, _| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
        }
        assert_eq!(hits.load(Ordering::Relaxed), 6);
    }

    #[test]
    fn worker_panic_propagates_and_pool_survives() {
        let pool = ThreadPool::new(3);
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i, _| {
                if i == 2 {
                    panic!("boom in worker");
                }
            })
        }));
        assert!(r.is_err());
        let r = catch_unwind(AssertUnwindSafe(|| {
            pool.run(|i, _| {
                if i == 0 {
                    panic!("boom in caller");
                }
            })
        }));
        assert!(r.is_err());
        let hits = AtomicUsize::new(0);
        pool.run(|_, _| {
            hits.fetch_add(1, Ordering::Relaxed);
        });
        assert_eq!(hits.load(Ordering::Relaxed), 3);
    }

    #[test]
    fn nested_run_is_serial_not_deadlock() {
        let pool = ThreadPool::new(2);
        let hits = AtomicUsize::new(0);
        pool.run(|_, _| {
            pool.run(|_, _| {
                hits.fetch_add(1, Ordering::Relaxed);
            });
        });
        assert_eq!(hits.load(Ordering::Relaxed), 4);
    }

    #[test]
    fn shared_between_threads() {
        let pool = ThreadPool::new(2);
        let hits = AtomicUsize::new(0);
        std::thread::scope(|sc| {
            for _ in 0..3 {
                sc.spawn(|| {
                    for _ in 0..100 {
                        pool.run(|_, _| {
                            hits.fetch_add(1, Ordering::Relaxed);
                        });
                    }
                });
            }
        });
        assert_eq!(hits.load(Ordering::Relaxed), 600);
    }

    #[test]
    fn split_range_covers() {
        for n in [0, 1, 7, 100] {
            for parts in 1..6 {
                let mut next = 0;
                for p in 0..parts {
                    let r = split_range(n, p, parts);
                    assert_eq!(r.start, next);
                    next = r.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    /// Wake+join latency of an empty job (`cargo test --release -- --ignored --nocapture pool_latency`).
    #[test]
    #[ignore]
    fn pool_latency() {
        let pool = ThreadPool::new(2);
        for _ in 0..1000 {
            pool.run(|_, _| {});
        }
        let n = 100_000;
        let t = Instant::now();
        for _ in 0..n {
            pool.run(|_, _| {});
        }
        println!("empty run: {:.2} us", t.elapsed().as_secs_f64() * 1e6 / n as f64);
    }
}
