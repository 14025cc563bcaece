//! The id of the process the code runs in, read from the kernel once per process
//! rather than once per check: a manager refuses a forked child before anything else
//! (`Manager::check_process`), on every operation, and `getpid` is a system call.
//!
//! The cached id is forgotten in a forked child by `forget_after_fork`, which the
//! extension registers as an after-fork hook of the interpreter
//! (`os.register_at_fork(after_in_child=...)`), so the child reads its own id on its
//! first check. Every child that runs Python code after a fork passes through those
//! hooks (`os.fork`, `multiprocessing`'s fork start method, a `subprocess` with a
//! `preexec_fn`); a child that only calls `exec` runs none of this code
//! (docs/concepts/lifetimes.md#fork).

use std::sync::atomic::{AtomicU32, Ordering};

/// The cached process id; 0 until read (no process has id 0).
static PID: AtomicU32 = AtomicU32::new(0);

/// This process's id, read from the kernel on the first call after start-up or a fork.
pub fn current_pid() -> u32 {
    let cached = PID.load(Ordering::Relaxed);
    if cached != 0 {
        return cached;
    }
    let pid = std::process::id();
    PID.store(pid, Ordering::Relaxed);
    pid
}

/// Forgets the cached id: called in a forked child, before any other code of the
/// child's can check its process.
pub fn forget_after_fork() {
    PID.store(0, Ordering::Relaxed);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_cached_id_is_the_kernel_s_and_is_read_again_once_forgotten() {
        assert_eq!(current_pid(), std::process::id());
        // (Other tests' threads may read it meanwhile: the id read again is the same.)
        forget_after_fork();
        assert_eq!(current_pid(), std::process::id());
        assert_eq!(PID.load(Ordering::Relaxed), std::process::id());
    }
}
