//! Taking lifetimes end to end over a [`LifetimeHost`]: the gate, handles resolved in
//! order, a lease's admission in its order, holds per group, and the hand-out rule
//! (the tokens of a lifetime whose object could not be built go back). The caller
//! converts arguments and builds the lifetime objects; the order is decided here
//! (docs/concepts/lifetimes.md).

use std::sync::Arc;

use crate::location::Location;
use crate::state::{HandleId, State};
use crate::tokens::{LifetimeKind, Release};

use super::{LeaseState, LifetimeHost, Manager};

/// What a lease's admission took, before any lifetime object is built for it.
#[derive(Debug)]
pub struct Admitted<S> {
    /// The lease's token.
    pub token: u64,
    /// The location.
    pub at: Location,
    /// The handles' indices, in the order of the handles.
    pub indices: Vec<HandleId>,
    /// The consumer stream as the manager keeps it for the location, if any.
    pub stream: Option<S>,
    /// The tokens of the transfers still in flight into the values (CUDA only): a
    /// consumer reading them is protected until these settle too.
    pub transfers: Vec<u64>,
}

impl Manager {
    /// Runs `operation` holding the gate, taken with `host.enter` and its checks
    /// (`check_closed`, `check_reentrant`), and let go after.
    pub fn gated<H: LifetimeHost, T>(
        &self,
        host: &H,
        check_closed: bool,
        check_reentrant: bool,
        operation: impl FnOnce() -> Result<T, H::Error>,
    ) -> Result<T, H::Error> {
        host.enter(check_closed, check_reentrant)
            .map_err(|error| host.lift(error))?;
        let result = operation();
        self.exit();
        result
    }

    /// Per handle in order, the lookup and then residency at `at`: a handle that is
    /// no live handle of this manager fails with `host.unknown`, unless a handle
    /// before it is not resident at `at` (that unavailability is reported first).
    pub fn resolve_with<H: LifetimeHost>(
        &self,
        host: &H,
        handles: impl IntoIterator<Item = H::Handle>,
        at: Location,
    ) -> Result<Vec<HandleId>, H::Error> {
        let handles = handles.into_iter();
        let mut indices = Vec::with_capacity(handles.size_hint().0);
        for handle in handles {
            let Some(index) = host.lookup(&handle)? else {
                if !indices.is_empty() {
                    self.check_resident(&indices, at)
                        .map_err(|error| host.lift(error))?;
                }
                return Err(host.unknown(&handle));
            };
            indices.push(index);
        }
        Ok(indices)
    }

    /// Runs `operation` under the gate (with both checks) on `handles` resolved in
    /// order at `place`: the location first, then the reap (with `reap`), then the
    /// lookups.
    pub fn with_resolved<H: LifetimeHost, T>(
        &self,
        host: &H,
        handles: impl IntoIterator<Item = H::Handle>,
        place: &H::Place,
        reap: bool,
        operation: impl FnOnce(&[HandleId], Location) -> Result<T, H::Error>,
    ) -> Result<T, H::Error> {
        self.gated(host, true, true, || {
            let at = host.place(place)?;
            if reap {
                self.reap_with(host)?;
            }
            let indices = self.resolve_with(host, handles, at)?;
            operation(&indices, at)
        })
    }

    /// The lifetime object `build` makes for the new `token` of kind `kind`; when
    /// building fails the token goes back at once (nothing may keep the tokens of a
    /// lifetime that was never handed out) and the error propagates. The caller holds
    /// the gate.
    pub fn hand_out<H: LifetimeHost, T>(
        &self,
        host: &H,
        kind: LifetimeKind,
        token: u64,
        build: impl FnOnce() -> Result<T, H::Error>,
    ) -> Result<T, H::Error> {
        build().inspect_err(|_| {
            let freed = self.apply(Release::Token { kind, token });
            host.free(&freed);
        })
    }

    /// A lease's admission under the gate the caller holds
    /// (docs/concepts/lifetimes.md#leases), in this order: the location, whether a
    /// lease may be taken there (disk never; CUDA only with a consumer stream), the
    /// reap (with `reap`), the consumer stream's check, the handles resolved in
    /// order, the lease, the stream's device wait for the transfers still in flight
    /// into the values (the lease goes if that fails), and on CUDA the tokens of those
    /// transfers.
    pub fn admit_with<H: LifetimeHost>(
        &self,
        host: &H,
        handles: impl IntoIterator<Item = H::Handle>,
        place: &H::Place,
        stream: Option<&H::Stream>,
        reap: bool,
    ) -> Result<Admitted<H::Stream>, H::Error> {
        let at = host.place(place)?;
        if let Err(refusal) = Self::borrowable(at, stream.is_some()) {
            return Err(host.lift(refusal.error(&host.name(place)?)));
        }
        if reap {
            self.reap_with(host)?;
        }
        let stream = stream
            .map(|stream| host.check_stream(stream, place, at))
            .transpose()?;
        let indices = self.resolve_with(host, handles, at)?;
        let token = self.acquire_with(host, &indices, at, stream.as_ref())?;
        let transfers = if at.is_cuda() && self.transfer_count() > 0 {
            self.transfer_tokens_into(&indices, at)
        } else {
            Vec::new()
        };
        Ok(Admitted {
            token,
            at,
            indices,
            stream,
            transfers,
        })
    }

    /// `acquire` end to end: under the gate, the lease's admission (after a reap),
    /// then its object from `build`, handed out (the lease goes if building fails).
    pub fn lease_with<H: LifetimeHost, T>(
        &self,
        host: &H,
        handles: impl IntoIterator<Item = H::Handle>,
        place: &H::Place,
        stream: Option<&H::Stream>,
        build: impl FnOnce(Admitted<H::Stream>) -> Result<T, H::Error>,
    ) -> Result<T, H::Error> {
        self.gated(host, true, true, || {
            let admitted = self.admit_with(host, handles, place, stream, true)?;
            let token = admitted.token;
            self.hand_out(host, LifetimeKind::Lease, token, || build(admitted))
        })
    }

    /// `hold` end to end: under the gate, the location, a reap, the handles resolved
    /// in order, the hold, then its object from `build`, handed out.
    pub fn hold_with<H: LifetimeHost, T>(
        &self,
        host: &H,
        handles: impl IntoIterator<Item = H::Handle>,
        place: &H::Place,
        build: impl FnOnce(u64) -> Result<T, H::Error>,
    ) -> Result<T, H::Error> {
        self.with_resolved(host, handles, place, true, |indices, at| {
            let token = self.hold(indices, at).map_err(|error| host.lift(error))?;
            self.hand_out(host, LifetimeKind::Hold, token, || build(token))
        })
    }

    /// Holds each group `(handles, place)` of `groups` in order under the gate the
    /// caller holds, right after a plan ran there: the group's location, its handles
    /// resolved in order, the hold, then `keep(token)`. Nothing is reaped first: the
    /// plan's run reaped before each action, and what its copies left in flight is
    /// protected until a later operation finds it complete
    /// (docs/concepts/lifetimes.md#reaping). When one fails, the error propagates;
    /// the tokens kept until then stay the caller's, and a token `keep` refused goes.
    pub fn hold_groups_with<H: LifetimeHost, I: IntoIterator<Item = H::Handle>>(
        &self,
        host: &H,
        groups: impl IntoIterator<Item = Result<(I, H::Place), H::Error>>,
        mut keep: impl FnMut(u64) -> Result<(), H::Error>,
    ) -> Result<(), H::Error> {
        for group in groups {
            let (handles, place) = group?;
            let at = host.place(&place)?;
            let indices = self.resolve_with(host, handles, at)?;
            let token = self.hold(&indices, at).map_err(|error| host.lift(error))?;
            if let Err(error) = keep(token) {
                self.release_hold(token);
                return Err(error);
            }
        }
        Ok(())
    }

    /// Whether bringing the values of any group `(handles, place)` of `groups` there
    /// would block the host on a copy (`blocks_host_with`, group by group in order,
    /// until one does), under the gate the caller holds. Changes nothing.
    pub fn blocks_host_groups_with<H: LifetimeHost, I: IntoIterator<Item = H::Handle>>(
        &self,
        host: &H,
        groups: impl IntoIterator<Item = Result<(I, H::Place), H::Error>>,
        disk_deferred: bool,
    ) -> Result<bool, H::Error> {
        for group in groups {
            let (handles, place) = group?;
            let at = host.place(&place)?;
            let indices = self.resolve_with(host, handles, at)?;
            if self.blocks_host_with(host, &indices, at, disk_deferred)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// `hold_groups_with` for groups already resolved, `(location, indices)` each (a
    /// staging's lowered request): `Ok(false)` where the core refuses a group's hold,
    /// the tokens kept until then staying the caller's (who raises the refusal as the
    /// handles' path words it); a token `keep` refused goes.
    pub fn hold_indices<E>(
        &self,
        groups: &[(Location, Vec<HandleId>)],
        mut keep: impl FnMut(u64) -> Result<(), E>,
    ) -> Result<bool, E> {
        for (at, indices) in groups {
            let Ok(token) = self.hold(indices, *at) else {
                return Ok(false);
            };
            if let Err(error) = keep(token) {
                self.release_hold(token);
                return Err(error);
            }
        }
        Ok(true)
    }

    /// `blocks_host_groups_with` for groups already resolved, `(location, indices)`
    /// each. Changes nothing.
    pub fn blocks_host_indices<H: LifetimeHost>(
        &self,
        host: &H,
        groups: &[(Location, Vec<HandleId>)],
        disk_deferred: bool,
    ) -> Result<bool, H::Error> {
        for (at, indices) in groups {
            if self.blocks_host_with(host, indices, *at, disk_deferred)? {
                return Ok(true);
            }
        }
        Ok(false)
    }

    /// What lease `token` borrows of `handle` at `place`, under the gate (without the
    /// closed check: a forced close ends what a lease borrows, and this says so): the
    /// handle's index (`known`, else looked up), then, only while the lease covers it,
    /// the location (`known`, else read) and `value` there. `None` when the lease no
    /// longer covers the value (or `value` has none).
    pub fn borrowed_with<H: LifetimeHost, T>(
        &self,
        host: &H,
        token: u64,
        handle: &H::Handle,
        place: &H::Place,
        known: Option<(HandleId, Location)>,
        value: impl FnOnce(HandleId, Location) -> Option<T>,
    ) -> Result<Option<T>, H::Error> {
        self.gated(host, false, true, || {
            let index = match known {
                Some((index, _)) => Some(index),
                None => host.lookup(handle)?,
            };
            let Some(index) = self.borrowed(token, index) else {
                return Ok(None);
            };
            let at = match known {
                Some((_, at)) => at,
                None => host.place(place)?,
            };
            Ok(value(index, at))
        })
    }

    /// `observe` given a consistent state: the published one, without the gate, when
    /// nothing waits to be reaped (no release queued, no lease pending, nothing
    /// changed since it was published); else the working one, under the gate after a
    /// reap (and `observe` runs there). A forked child, a callback running, this
    /// thread's own transition and a closed manager are refused either way.
    pub fn snapshot_with<H: LifetimeHost, T>(
        &self,
        host: &H,
        observe: impl FnOnce(Arc<State>) -> T,
    ) -> Result<T, H::Error> {
        self.check_process().map_err(|error| host.lift(error))?;
        if !self.releases_queued()
            && let Some(state) = self
                .try_published_snapshot()
                .map_err(|error| host.lift(error))?
        {
            return Ok(observe(state));
        }
        self.gated(host, true, true, || {
            self.reap_with(host)?;
            Ok(observe(self.current()))
        })
    }

    /// The state version after a reap, under the gate.
    pub fn reaped_version_with<H: LifetimeHost>(&self, host: &H) -> Result<u64, H::Error> {
        self.gated(host, true, true, || {
            self.reap_with(host)?;
            Ok(self.version())
        })
    }

    /// The tokens among `tokens` of leases still pending on their events, after
    /// reaping those whose events completed. The caller holds the gate.
    pub fn pending_among_with<H: LifetimeHost>(
        &self,
        host: &H,
        tokens: impl IntoIterator<Item = u64>,
    ) -> Result<Vec<u64>, H::Error> {
        self.reap_with(host)?;
        Ok(tokens
            .into_iter()
            .filter(|&token| self.lease_state(token) == LeaseState::Pending)
            .collect())
    }
}
