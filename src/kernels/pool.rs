//! Persistent thread pool (stub, filled in by the kernels owner).

pub struct ThreadPool {
    n_threads: usize,
}

impl ThreadPool {
    pub fn new(n_threads: usize) -> Self {
        ThreadPool {
            n_threads: n_threads.max(1),
        }
    }

    pub fn n_threads(&self) -> usize {
        self.n_threads
    }

    /// Runs `f(thread_index, n_threads)` on every thread of the pool (the caller is thread 0) and returns when all
    /// are done.
    pub fn run<F: Fn(usize, usize) + Sync>(&self, f: F) {
        for i in 0..self.n_threads {
            f(i, self.n_threads);
        }
    }
}
