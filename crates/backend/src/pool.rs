//! The blocking side: a small pool of threads running [`FileHandle::execute`]. It is the whole
//! engine when io_uring is unavailable, and the io_uring engine's helper for the composite
//! operations. Completions are posted to a list and signalled on the engine's eventfd, the same
//! one the ring signals, so the reactor watches one descriptor either way.

use std::collections::VecDeque;
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;

use scsi_core::{BackendError, Op, Output};

use crate::file::FileHandle;

/// A job: run `op` on `len` bytes at `ptr`, which the engine keeps alive and untouched until
/// the completion for `request` comes back.
pub(crate) struct Job {
    pub request: usize,
    pub file: Arc<FileHandle>,
    pub op: Op,
    pub ptr: *mut u8,
    pub len: usize,
}

// Safety: the pointer refers to a buffer the engine holds in its request table until this
// job's completion is reaped; nothing else reads or writes it meanwhile (see Engine::start).
unsafe impl Send for Job {}

pub(crate) type Done = (usize, Result<Output, BackendError>);

struct Shared {
    jobs: Mutex<(VecDeque<Job>, bool)>,
    ready: Condvar,
    done: Mutex<Vec<Done>>,
    eventfd: i32,
}

pub(crate) struct Pool {
    shared: Arc<Shared>,
    threads: Vec<JoinHandle<()>>,
}

impl Pool {
    /// Starts `threads` workers named `name-N` that signal `eventfd` (which must outlive the
    /// pool).
    pub fn new(threads: usize, eventfd: i32, name: &str) -> std::io::Result<Pool> {
        let shared = Arc::new(Shared {
            jobs: Mutex::new((VecDeque::new(), false)),
            ready: Condvar::new(),
            done: Mutex::new(Vec::new()),
            eventfd,
        });
        let threads = (0..threads.max(1))
            .map(|i| {
                let shared = shared.clone();
                std::thread::Builder::new()
                    .name(format!("{name}-{i}"))
                    .spawn(move || work(&shared))
            })
            .collect::<std::io::Result<_>>()?;
        Ok(Pool { shared, threads })
    }

    pub fn push(&self, job: Job) {
        let mut jobs = self.shared.jobs.lock().unwrap_or_else(|e| e.into_inner());
        jobs.0.push_back(job);
        drop(jobs);
        self.shared.ready.notify_one();
    }

    /// Appends finished jobs to `out` (which may hold another pool's already: the engine takes
    /// its helpers' and its writer's into one list). Both keep their capacity, so neither side
    /// allocates once warm.
    pub fn take_done(&self, out: &mut Vec<Done>) {
        let mut done = self.shared.done.lock().unwrap_or_else(|e| e.into_inner());
        out.append(&mut done);
    }
}

fn work(shared: &Shared) {
    loop {
        let job = {
            let mut jobs = shared.jobs.lock().unwrap_or_else(|e| e.into_inner());
            loop {
                if let Some(job) = jobs.0.pop_front() {
                    break job;
                }
                if jobs.1 {
                    return;
                }
                jobs = shared.ready.wait(jobs).unwrap_or_else(|e| e.into_inner());
            }
        };
        // Safety: see Job: the engine owns the buffer behind ptr/len exclusively for this job
        // until the completion below is reaped.
        let buf = unsafe { std::slice::from_raw_parts_mut(job.ptr, job.len) };
        let result = job.file.execute(&job.op, buf);
        let mut done = shared.done.lock().unwrap_or_else(|e| e.into_inner());
        done.push((job.request, result));
        // Signal only the first of a batch: the reactor takes the whole list after the signal
        // it wakes for, so a completion added to a list not yet taken rides along with the one
        // that signalled (a write system call and a wake-up saved per I/O at depth).
        let first = done.len() == 1;
        drop(done);
        if first {
            crate::engine::signal(shared.eventfd);
        }
    }
}

impl Drop for Pool {
    /// Finishes every queued job, then joins the workers: no buffer is touched after this.
    fn drop(&mut self) {
        self.shared.jobs.lock().unwrap_or_else(|e| e.into_inner()).1 = true;
        self.shared.ready.notify_all();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}
