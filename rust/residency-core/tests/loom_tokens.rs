//! Model-checked release queue (run with `RUSTFLAGS="--cfg loom" cargo test --release
//! --test loom_tokens`): a release from another thread while a source callback runs
//! is queued or applied, never lost, never applied twice, never applied while the
//! callback runs, and queued releases are applied oldest first
//! (docs/concepts/lifetimes.md#deferred-releases).
#![cfg(loom)]

use std::time::Duration;

use loom::sync::atomic::{AtomicUsize, Ordering};
use loom::sync::{Arc, Mutex};
use loom::thread;
use residency_core::gate::Gate;
use residency_core::tokens::{ReleaseQueue, release_or_queue};
use residency_core::{CoreError, CoreResult, LifetimeKind, Release};

const POLL: Duration = Duration::from_millis(10);

fn model(test: impl Fn() + Sync + Send + 'static) {
    let mut builder = loom::model::Builder::new();
    builder.preemption_bound = Some(2);
    builder.check(test);
}

/// A manager reduced to what the queue protocol touches: the gate, the queue, and
/// the releases applied, in order.
struct Model {
    gate: Gate,
    queue: ReleaseQueue,
    applied: Mutex<Vec<u64>>,
    /// Releases applied while a callback ran: must stay 0.
    during_callback: AtomicUsize,
}

impl Model {
    fn new() -> Self {
        Self {
            gate: Gate::new(),
            queue: ReleaseQueue::new(),
            applied: Mutex::new(Vec::new()),
            during_callback: AtomicUsize::new(0),
        }
    }

    fn enter(&self, check_reentrant: bool) -> CoreResult<()> {
        self.gate.enter(POLL)?;
        if check_reentrant && let Err(err) = self.gate.check_reentrant() {
            self.gate.exit();
            return Err(err);
        }
        Ok(())
    }

    fn apply(&self, release: Release) {
        if self.gate.callback_active() {
            self.during_callback.fetch_add(1, Ordering::SeqCst);
        }
        if let Release::Token { token, .. } = release {
            self.applied.lock().expect("no panic").push(token);
        }
    }

    fn release(&self, token: u64, finalizing: bool) -> CoreResult<()> {
        release_or_queue(
            &self.gate,
            &self.queue,
            Release::Token {
                kind: LifetimeKind::Hold,
                token,
            },
            finalizing,
            |check| self.enter(check),
            |release| self.apply(release),
            || self.gate.exit(),
        )
        .map_err(|refused| refused.error)
    }

    /// A transition whose source callback runs `during` on this thread, then the
    /// queue drained as a transition does when the callback returns.
    fn transition(&self, during: impl FnOnce()) {
        self.gate.enter(POLL).expect("no callback yet");
        self.gate.begin_transition();
        self.gate.set_callback_active(true);
        during();
        self.gate.set_callback_active(false);
        self.gate.end_transition();
        self.queue.drain(|release| self.apply(release));
        self.gate.exit();
    }

    fn applied(&self) -> Vec<u64> {
        self.applied.lock().expect("no panic").clone()
    }
}

#[test]
fn a_release_racing_a_callback_is_applied_exactly_once() {
    model(|| {
        let model = Arc::new(Model::new());
        let releaser = {
            let model = Arc::clone(&model);
            thread::spawn(move || model.release(1, false))
        };
        model.transition(|| {});
        assert_eq!(releaser.join().expect("joined"), Ok(()));
        // Whatever the interleaving, the release is applied by now, once.
        assert_eq!(model.applied(), vec![1]);
        assert!(model.queue.is_empty());
        assert_eq!(model.during_callback.load(Ordering::SeqCst), 0);
    });
}

#[test]
fn two_releases_and_a_finalizer_inside_the_callback_all_apply_once() {
    model(|| {
        let model = Arc::new(Model::new());
        let releaser = {
            let model = Arc::clone(&model);
            thread::spawn(move || model.release(2, false))
        };
        model.transition(|| {
            // A finaliser firing inside the callback, on its own thread: queued.
            assert_eq!(model.release(1, true), Ok(()));
        });
        assert_eq!(releaser.join().expect("joined"), Ok(()));
        let mut applied = model.applied();
        applied.sort_unstable();
        assert_eq!(applied, vec![1, 2]);
        assert!(model.queue.is_empty());
        assert_eq!(model.during_callback.load(Ordering::SeqCst), 0);
    });
}

#[test]
fn queued_releases_apply_oldest_first() {
    model(|| {
        let model = Arc::new(Model::new());
        model.transition(|| {
            let releaser = {
                let model = Arc::clone(&model);
                // Runs wholly inside the callback: both are queued, in order.
                thread::spawn(move || (model.release(1, false), model.release(2, false)))
            };
            assert_eq!(releaser.join().expect("joined"), (Ok(()), Ok(())));
            assert!(model.applied().is_empty());
        });
        assert_eq!(model.applied(), vec![1, 2]);
    });
}

#[test]
fn a_release_on_the_callbacks_own_thread_is_refused_not_queued() {
    model(|| {
        let model = Model::new();
        model.transition(|| {
            let refused = model.release(1, false);
            assert!(
                matches!(refused, Err(CoreError::Reentrancy { .. })),
                "{refused:?}"
            );
        });
        assert!(model.applied().is_empty());
        assert!(model.queue.is_empty());
    });
}
