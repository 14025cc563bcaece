//! The manager's state-access gate: one re-entrant lock, the transition owner and the
//! manager-wide "source callback running" flag.
//!
//! While a callback runs, every gated operation from any thread fails fast with a
//! re-entrancy error; threads already waiting for the lock poll the flag, so they
//! fail too instead of blocking behind the callback. The lock never waits forever
//! on a single condition: waiters wake at least every `poll` interval.

use std::sync::PoisonError;
use std::time::Duration;

// Under `--cfg loom` the gate is built on loom's primitives, so its lock, flag and
// wake-ups are model-checked (tests/loom_gate.rs); otherwise on std's.
#[cfg(loom)]
use loom::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(loom)]
use loom::sync::{Condvar, Mutex, MutexGuard};
#[cfg(loom)]
use loom::thread::{self, ThreadId};
#[cfg(not(loom))]
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
#[cfg(not(loom))]
use std::sync::{Condvar, Mutex, MutexGuard};
#[cfg(not(loom))]
use std::thread::{self, ThreadId};

use crate::error::{CoreError, CoreResult};

/// How often a waiting thread rechecks the callback flag.
pub const DEFAULT_POLL: Duration = Duration::from_millis(10);

#[derive(Debug, Default)]
struct GateState {
    owner: Option<ThreadId>,
    depth: u32,
    transition_owner: Option<ThreadId>,
}

#[derive(Debug, Default)]
pub struct Gate {
    state: Mutex<GateState>,
    released: Condvar,
    callback_active: AtomicBool,
    /// Threads blocked in `enter`; wake-ups (a syscall) are skipped when none wait.
    waiters: AtomicUsize,
}

fn callback_error() -> CoreError {
    CoreError::Reentrancy {
        message: "a residency source callback is running on this manager; public operations \
                  cannot observe or change its state until load() returns"
            .to_owned(),
    }
}

impl Gate {
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> MutexGuard<'_, GateState> {
        // The guarded data is plain bookkeeping that stays consistent across a panic.
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub fn callback_active(&self) -> bool {
        self.callback_active.load(Ordering::Acquire)
    }

    /// Fails fast with a re-entrancy error while a source callback runs.
    pub fn check_callback(&self) -> CoreResult<()> {
        if self.callback_active() {
            Err(callback_error())
        } else {
            Ok(())
        }
    }

    /// Takes the lock if it is free or already held by this thread; never waits.
    /// Returns `Ok(false)` when another thread holds it.
    pub fn try_enter(&self) -> CoreResult<bool> {
        self.check_callback()?;
        let me = thread::current().id();
        let mut state = self.lock();
        match state.owner {
            None => {
                state.owner = Some(me);
                state.depth = 1;
                Ok(true)
            }
            Some(owner) if owner == me => {
                state.depth += 1;
                Ok(true)
            }
            Some(_) => Ok(false),
        }
    }

    /// Takes the lock, waiting for another owner while rechecking the callback flag
    /// every `poll`. Callers attached to an interpreter must release it first.
    pub fn enter(&self, poll: Duration) -> CoreResult<()> {
        let me = thread::current().id();
        let mut state = self.lock();
        loop {
            self.check_callback()?;
            match state.owner {
                None => {
                    state.owner = Some(me);
                    state.depth = 1;
                    return Ok(());
                }
                Some(owner) if owner == me => {
                    state.depth += 1;
                    return Ok(());
                }
                Some(_) => {
                    // Registered under the state mutex, so an exit that releases the
                    // lock after this point sees the waiter and wakes it.
                    self.waiters.fetch_add(1, Ordering::SeqCst);
                    state = self
                        .released
                        .wait_timeout(state, poll)
                        .unwrap_or_else(PoisonError::into_inner)
                        .0;
                    self.waiters.fetch_sub(1, Ordering::SeqCst);
                }
            }
        }
    }

    /// Releases one level of the lock held by this thread.
    pub fn exit(&self) {
        self.exit_with(|| {});
    }

    /// Releases one level of the lock; when that releases it entirely, runs
    /// `on_release` first, while no other thread can enter.
    pub fn exit_with(&self, on_release: impl FnOnce()) {
        let me = thread::current().id();
        self.release_level(self.lock(), me, on_release);
    }

    fn release_level(
        &self,
        mut state: MutexGuard<'_, GateState>,
        me: ThreadId,
        on_release: impl FnOnce(),
    ) {
        if state.owner != Some(me) {
            return;
        }
        state.depth = state.depth.saturating_sub(1);
        if state.depth == 0 {
            on_release();
            state.owner = None;
            let wake = self.waiters.load(Ordering::SeqCst) > 0;
            drop(state);
            if wake {
                self.released.notify_all();
            }
        }
    }

    /// True when this thread holds the lock.
    pub fn held_by_me(&self) -> bool {
        self.lock().owner == Some(thread::current().id())
    }

    /// Fails when this thread is already executing a transition on this manager.
    pub fn check_reentrant(&self) -> CoreResult<()> {
        if self.lock().transition_owner == Some(thread::current().id()) {
            return Err(CoreError::Reentrancy {
                message: "this thread is already executing a residency transition on this \
                          manager; finish it before starting another public operation"
                    .to_owned(),
            });
        }
        Ok(())
    }

    /// True while a source callback runs on a thread other than this one (the
    /// callback always runs on the transition owner's thread).
    pub fn callback_running_elsewhere(&self) -> bool {
        self.callback_active() && self.lock().transition_owner != Some(thread::current().id())
    }

    /// Marks this thread as the transition owner (after `check_reentrant`).
    pub fn begin_transition(&self) {
        self.lock().transition_owner = Some(thread::current().id());
    }

    pub fn end_transition(&self) {
        let mut state = self.lock();
        if state.transition_owner == Some(thread::current().id()) {
            state.transition_owner = None;
        }
    }

    /// `try_enter`, `check_reentrant` and `begin_transition` in one step, for the
    /// one-call paths. `true`: this thread holds the lock (one more level) and owns
    /// the transition. `false` changes nothing: a callback is running, another thread
    /// holds the lock, this thread is already in a transition, or `admit` (called
    /// with the lock's bookkeeping held, so it must not touch the gate) refused. The
    /// caller then takes the general path, which waits or raises the precise error.
    pub fn try_begin_transition(&self, admit: impl FnOnce() -> bool) -> bool {
        if self.callback_active() {
            return false;
        }
        let me = thread::current().id();
        let mut state = self.lock();
        if state.transition_owner == Some(me)
            || state.owner.is_some_and(|owner| owner != me)
            || !admit()
        {
            return false;
        }
        if state.owner.is_some() {
            state.depth += 1;
        } else {
            state.owner = Some(me);
            state.depth = 1;
        }
        state.transition_owner = Some(me);
        true
    }

    /// `end_transition` then `exit_with(on_release)`, in one step.
    pub fn end_transition_and_exit(&self, on_release: impl FnOnce()) {
        let me = thread::current().id();
        let mut state = self.lock();
        if state.transition_owner == Some(me) {
            state.transition_owner = None;
        }
        self.release_level(state, me, on_release);
    }

    /// Sets or clears the manager-wide callback flag and wakes every waiter, so
    /// waiters fail immediately instead of after their next poll.
    pub fn set_callback_active(&self, active: bool) {
        self.callback_active.store(active, Ordering::Release);
        if active {
            // Read the waiter count under the state mutex: a waiter checks the flag and
            // registers itself under that mutex, so it either sees the flag or is
            // counted here and woken (no lost wake-up, even without the poll).
            let _state = self.lock();
            if self.waiters.load(Ordering::SeqCst) > 0 {
                self.released.notify_all();
            }
        }
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::mpsc;
    use std::time::Instant;

    #[test]
    fn lock_is_reentrant_for_its_owner_only() {
        let gate = Arc::new(Gate::new());
        gate.enter(DEFAULT_POLL).expect("free gate");
        assert_eq!(gate.try_enter(), Ok(true));
        gate.exit();
        assert!(gate.held_by_me());
        let other = Arc::clone(&gate);
        let blocked = thread::spawn(move || other.try_enter())
            .join()
            .expect("no panic");
        assert_eq!(blocked, Ok(false));
        gate.exit();
        assert!(!gate.held_by_me());
        let other = Arc::clone(&gate);
        let entered = thread::spawn(move || {
            let result = other.try_enter();
            other.exit();
            result
        })
        .join()
        .expect("no panic");
        assert_eq!(entered, Ok(true));
    }

    #[test]
    fn callback_flag_fails_every_thread_fast_including_waiters() {
        let gate = Arc::new(Gate::new());
        gate.enter(DEFAULT_POLL).expect("free gate");
        let (ready_tx, ready_rx) = mpsc::channel();
        let waiting_gate = Arc::clone(&gate);
        let waiter = thread::spawn(move || {
            ready_tx.send(()).expect("main thread listens");
            let started = Instant::now();
            (
                waiting_gate.enter(Duration::from_secs(5)),
                started.elapsed(),
            )
        });
        ready_rx.recv().expect("waiter started");
        thread::sleep(Duration::from_millis(20));
        gate.set_callback_active(true);
        let (result, blocked_for) = waiter.join().expect("no panic");
        assert!(matches!(result, Err(CoreError::Reentrancy { .. })));
        assert!(
            blocked_for < Duration::from_secs(2),
            "waiter blocked {blocked_for:?}"
        );
        assert!(matches!(
            gate.try_enter(),
            Err(CoreError::Reentrancy { .. })
        ));
        gate.set_callback_active(false);
        assert_eq!(gate.try_enter(), Ok(true));
        gate.exit();
        gate.exit();
    }

    #[test]
    fn transition_owner_is_rejected_on_reentry() {
        let gate = Gate::new();
        assert!(gate.check_reentrant().is_ok());
        gate.begin_transition();
        assert!(matches!(
            gate.check_reentrant(),
            Err(CoreError::Reentrancy { .. })
        ));
        let gate = Arc::new(gate);
        let other = Arc::clone(&gate);
        assert!(
            thread::spawn(move || other.check_reentrant().is_ok())
                .join()
                .expect("no panic")
        );
        gate.end_transition();
        assert!(gate.check_reentrant().is_ok());
    }

    #[test]
    fn one_step_transition_takes_nothing_unless_everything_admits() {
        let gate = Arc::new(Gate::new());
        assert!(!gate.try_begin_transition(|| false));
        assert!(!gate.held_by_me());
        assert!(gate.try_begin_transition(|| true));
        assert!(gate.held_by_me());
        assert!(gate.check_reentrant().is_err());
        // Already in a transition: declined, and the depth is unchanged.
        assert!(!gate.try_begin_transition(|| true));
        let other = Arc::clone(&gate);
        assert!(
            !thread::spawn(move || other.try_begin_transition(|| true))
                .join()
                .expect("no panic")
        );
        let mut released = false;
        gate.end_transition_and_exit(|| released = true);
        assert!(released);
        assert!(!gate.held_by_me());
        assert!(gate.check_reentrant().is_ok());
        // Nested inside a plain hold of the lock: one more level, released in turn.
        assert_eq!(gate.try_enter(), Ok(true));
        assert!(gate.try_begin_transition(|| true));
        let mut released = false;
        gate.end_transition_and_exit(|| released = true);
        assert!(!released);
        assert!(gate.held_by_me());
        assert!(gate.check_reentrant().is_ok());
        gate.exit();
        assert!(!gate.held_by_me());
        gate.set_callback_active(true);
        assert!(!gate.try_begin_transition(|| true));
        gate.set_callback_active(false);
        assert!(!gate.held_by_me());
    }
}
