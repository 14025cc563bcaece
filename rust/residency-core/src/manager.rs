//! The manager core: records, books, protections, the alias index and versions.
//!
//! Every method that reads or changes mutable state expects the caller to hold the
//! gate (`enter`/`exit`); the inner mutex only guards against lock-free readers and
//! is never held across a call back into the glue. Each ensure or move is a ticket
//! (`ticket.rs`): `begin` validates, decides and charges, the glue does the device
//! work, and `commit` or `abort` ends it. The state is published for lock-free readers when the
//! outermost gate holder exits, so readers only ever see whole operations.

use crate::fasthash::FastMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use arc_swap::ArcSwap;

use crate::error::{CoreError, CoreResult};
use crate::gate::Gate;
use crate::location::Location;
use crate::plan::{Action, HandleRef, HandleSlot, Plan, Reservation};
use crate::search::{MatInfo, Planned, SearchOutcome, SearchValue, ValueTable};
use crate::simulate::{self, CompletedPending, CudaDevices, Simulation, SlotResolution};
use crate::state::{HandleId, Materialization, ReservationRecord, State, TokenKind, ValueRecord};
use crate::tokens::{ReleaseQueue, TokenBook};
use crate::value::{HandleName, Recoverability, ValueSpec, charge_of};

mod ticket;
pub use ticket::{Begun, Committed, InFlight, Landed, Ticket, Work};

mod decide;
pub use decide::{
    DecideFailure, Decision, EvictionRow, LoweredRequest, NativePolicy, Row, ScheduleIndex,
    kind_code,
};

mod admission;
mod driver;
mod finalizers;
mod lifetimes;

pub use admission::Admitted;
pub use driver::{LeaseRelease, LifetimeHost, Unborrowable};
pub use lifetimes::SettleWait;

mod plan_run;
pub use plan_run::{Device, Inputs, PlanDevice, PlanRun, Resolutions, RunError};

mod transition;
pub use transition::{Copied, Measured, TransitionDevice, Transitioned};

/// A backing storage identity: (device code, data pointer). Device code is -1 for
/// host memory and the CUDA index otherwise.
pub type StorageKey = (i64, u64);

/// What bringing one value to a location costs the host (see `Manager::host_costs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HostCost {
    /// Nothing to copy, or an asynchronous copy.
    Free,
    /// A copy that blocks the host.
    Blocks,
    /// A source's load into pageable memory on the way to a device: it blocks unless
    /// the source loads alone (the disk tier then runs it on its I/O thread).
    BlocksUnlessLoadsAlone,
}

/// Where a lease token stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LeaseState {
    /// Never issued, released, or dropped by a forced close.
    Unknown,
    /// Borrowing: its use tokens protect the materialisations.
    Active,
    /// Released on CUDA streams whose events have not all completed.
    Pending,
}

/// A lease's or a hold's handles: a single one kept inline (a step's group is often
/// one value), more in a vector.
#[derive(Debug, Clone)]
enum Handles {
    One(HandleId),
    Many(Vec<HandleId>),
}

impl Default for Handles {
    fn default() -> Self {
        Self::Many(Vec::new())
    }
}

impl From<&[HandleId]> for Handles {
    fn from(handles: &[HandleId]) -> Self {
        match *handles {
            [handle] => Self::One(handle),
            _ => Self::Many(handles.to_vec()),
        }
    }
}

impl std::ops::Deref for Handles {
    type Target = [HandleId];

    fn deref(&self) -> &[HandleId] {
        match self {
            Self::One(handle) => std::slice::from_ref(handle),
            Self::Many(handles) => handles,
        }
    }
}

#[derive(Debug, Clone)]
struct LeaseRecord {
    handles: Handles,
    location: Location,
    pending: bool,
}

#[derive(Debug, Clone)]
struct HoldRecord {
    handles: Handles,
    location: Location,
}

/// Everything the controller's search reads from the manager.
#[derive(Debug, Clone)]
pub struct SearchInputs {
    /// Every issued handle at its own index; a discarded one has no materialisation
    /// and no source, so it is never a candidate.
    pub values: StateValues,
    pub books: Vec<(Location, u64, u64)>,
    /// The budgets, fixed when the manager was made (shared, built once).
    pub budgets: Arc<std::collections::BTreeMap<Location, u64>>,
    pub version: u64,
}

/// How many lifetimes of each kind are still open (for `close`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OpenLifetimes {
    pub active_leases: u64,
    pub pending_leases: u64,
    pub holds: u64,
    pub reservations: u64,
}

impl OpenLifetimes {
    pub fn is_empty(&self) -> bool {
        *self == Self::default()
    }
}

/// The storage keys of one materialisation: nearly always one, kept inline (an
/// install then allocates nothing for them).
#[derive(Debug)]
enum StorageKeys {
    One(StorageKey),
    Many(Vec<StorageKey>),
}

impl StorageKeys {
    fn new(keys: &[StorageKey]) -> Self {
        match *keys {
            [key] => Self::One(key),
            _ => Self::Many(keys.to_vec()),
        }
    }

    fn as_slice(&self) -> &[StorageKey] {
        match self {
            Self::One(key) => std::slice::from_ref(key),
            Self::Many(keys) => keys,
        }
    }
}

/// How many handles' id strings [`SharedIds`] keeps.
const SHARED_IDS: usize = 64;

/// The id strings of the handles recent decided plans named, one slot per handle
/// index modulo [`SHARED_IDS`], each with the name it was written from: a decide that
/// names a handle again shares its string (no encoding, no allocation), and a slot
/// whose name differs (another handle, or an index issued again) is written anew.
#[derive(Debug)]
struct SharedIds([Option<(HandleName, Arc<str>)>; SHARED_IDS]);

impl Default for SharedIds {
    fn default() -> Self {
        Self(std::array::from_fn(|_| None))
    }
}

impl SharedIds {
    /// The id string of `name`, the handle at index `handle`.
    fn get(&mut self, handle: HandleId, name: HandleName) -> Arc<str> {
        let slot = &mut self.0[handle as usize % SHARED_IDS];
        match slot {
            Some((known, text)) if *known == name => Arc::clone(text),
            _ => {
                let text = name.to_shared_str();
                *slot = Some((name, Arc::clone(&text)));
                text
            }
        }
    }
}

#[derive(Debug, Default)]
struct Inner {
    state: State,
    storage_owners: FastMap<StorageKey, (HandleId, Location)>,
    materialization_keys: FastMap<(HandleId, Location), StorageKeys>,
    /// The shared id strings the decided plans' handles carried last (see
    /// [`SharedIds`]).
    shared_ids: SharedIds,
    leases: FastMap<u64, LeaseRecord>,
    holds: FastMap<u64, HoldRecord>,
    next_token: u64,
    /// Published state is stale once a mutation happened since the last publish.
    dirty: bool,
    /// How many values were discarded: a handle's resolution changes only then.
    discards: u64,
    /// The pending leases' events, the transfers in flight and the object ids.
    book: TokenBook,
    /// The object id of each lease tracked for its finalizer, by token.
    tracked: FastMap<u64, crate::tokens::ObjectId>,
}

#[derive(Debug)]
pub struct Manager {
    manager_id: Arc<str>,
    gate: Gate,
    published: ArcSwap<State>,
    /// Set when a whole operation changed the state since it was last published.
    /// Publishing costs a state clone and a swap, so it waits until a reader asks.
    stale: AtomicBool,
    /// What `published` holds while it is stale: an empty state that no reader takes
    /// (`try_published_snapshot` knows it by its address). Letting go of the stale
    /// state means the changes that follow copy none of the records it shared.
    unpublished: Arc<State>,
    /// The budgeted locations' budgets: set at construction, never changed after.
    budgets: Arc<std::collections::BTreeMap<Location, u64>>,
    /// Scrambles the index each issued id carries (see `HandleName::issue`).
    index_key: u32,
    /// The process that made the manager. A forked child inherits the manager's memory
    /// (and any lock another thread held at the fork) but not its files, devices or
    /// threads, so every entry refuses it before touching anything.
    owner_pid: u32,
    inner: Mutex<Inner>,
    /// Releases queued behind a source callback (docs/concepts/lifetimes.md#deferred-releases).
    releases: ReleaseQueue,
}

fn new_uuid() -> Arc<str> {
    Arc::from(uuid::Uuid::new_v4().to_string())
}

/// Type keys are a small counter of the value types a process uses.
fn narrow_type_key(type_key: u64) -> CoreResult<u32> {
    u32::try_from(type_key).map_err(|_| CoreError::invalid("more than 2**32 value types"))
}

fn handle_error(message: String) -> CoreError {
    CoreError::Handle { message }
}

fn in_use(
    handle_id: HandleName,
    location: Location,
    use_count: u32,
    holds: u32,
    pending: u32,
) -> CoreError {
    CoreError::InUse {
        message: format!(
            "materialization of value {handle_id:?} at {location} is protected \
             (active_reads={use_count}, holds={holds}, pending_events={pending}); release its \
             leases and holds (and let CUDA consumers finish) before removing it"
        ),
        location: Some(location),
        active_reads: u64::from(use_count),
        holds: u64::from(holds),
        pending_events: u64::from(pending),
    }
}

/// The broken invariant of an index this manager never issued.
#[cold]
pub fn not_issued(handle: HandleId) -> CoreError {
    CoreError::Internal {
        message: format!("handle index {handle} is not issued by this manager"),
    }
}

#[cold]
fn discarded(record: &ValueRecord) -> CoreError {
    handle_error(format!("Value {:?} is discarded", record.handle_id))
}

impl Inner {
    // Every operation looks its record up: inlined, with the errors out of line.
    #[inline]
    fn record(&self, handle: HandleId) -> CoreResult<&Arc<ValueRecord>> {
        match self.state.record(handle) {
            Some(record) => Ok(record),
            None => Err(not_issued(handle)),
        }
    }

    #[inline]
    fn live_record(&self, handle: HandleId) -> CoreResult<&Arc<ValueRecord>> {
        let record = self.record(handle)?;
        if record.discarded {
            return Err(discarded(record));
        }
        Ok(record)
    }

    fn check_removable(&self, handle: HandleId, location: Location) -> CoreResult<()> {
        let record = self.record(handle)?;
        if let Some(materialization) = record.materialization(location)
            && materialization.is_protected()
        {
            return Err(in_use(
                record.handle_id,
                location,
                materialization.use_count,
                materialization.hold_count,
                materialization.pending_count,
            ));
        }
        Ok(())
    }

    fn remove(&mut self, handle: HandleId, location: Location) {
        if self.state.remove(handle, location).is_some() {
            if let Some(keys) = self.materialization_keys.remove(&(handle, location)) {
                for &key in keys.as_slice() {
                    if self.storage_owners.get(&key) == Some(&(handle, location)) {
                        self.storage_owners.remove(&key);
                    }
                }
            }
            self.dirty = true;
        }
    }

    fn next_token(&mut self) -> u64 {
        self.next_token += 1;
        self.next_token
    }

    fn tokens(&mut self, handles: &[HandleId], location: Location, kind: TokenKind, add: bool) {
        for &handle in handles {
            self.state.adjust_tokens(handle, location, kind, add);
        }
    }

    fn release_lease(&mut self, token: u64) -> bool {
        let Some(lease) = self.leases.remove(&token) else {
            return false;
        };
        if lease.pending {
            self.leases.insert(token, lease);
            return false;
        }
        self.tokens(&lease.handles, lease.location, TokenKind::Use, false);
        self.state.bump();
        self.dirty = true;
        true
    }

    /// Use tokens on every materialisation, as one lease (one version step); the
    /// caller checked that each is resident.
    fn acquire_locked(&mut self, handles: &[HandleId], location: Location) -> u64 {
        self.tokens(handles, location, TokenKind::Use, true);
        let token = self.next_token();
        self.leases.insert(
            token,
            LeaseRecord {
                handles: Handles::from(handles),
                location,
                pending: false,
            },
        );
        self.state.bump();
        self.dirty = true;
        token
    }

    fn lease_to_pending(&mut self, token: u64) -> bool {
        let Some(lease) = self.leases.get_mut(&token).filter(|lease| !lease.pending) else {
            return false;
        };
        lease.pending = true;
        // Lent out of the lease while its tokens change, and put back.
        let (handles, location) = (std::mem::take(&mut lease.handles), lease.location);
        for &handle in handles.iter() {
            self.state.move_token(
                handle,
                location,
                Some(TokenKind::Use),
                Some(TokenKind::Pending),
            );
        }
        if let Some(lease) = self.leases.get_mut(&token) {
            lease.handles = handles;
        }
        self.state.pending_leases += 1;
        self.state.bump();
        self.dirty = true;
        true
    }

    fn release_pending(&mut self, token: u64) -> bool {
        let Some(lease) = self.leases.remove(&token) else {
            return false;
        };
        if !lease.pending {
            self.leases.insert(token, lease);
            return false;
        }
        self.tokens(&lease.handles, lease.location, TokenKind::Pending, false);
        self.state.pending_leases = self.state.pending_leases.saturating_sub(1);
        self.state.bump();
        self.dirty = true;
        true
    }

    fn release_hold(&mut self, token: u64) -> bool {
        let Some(hold) = self.holds.remove(&token) else {
            return false;
        };
        self.tokens(&hold.handles, hold.location, TokenKind::Hold, false);
        self.state.bump();
        self.dirty = true;
        true
    }

    fn release_reservation(&mut self, token: u64) -> bool {
        let Some(reservation) = self.state.reservations.remove(&token) else {
            return false;
        };
        self.state
            .remove_reserved(reservation.location, reservation.nbytes);
        if let Some(books) = self
            .state
            .locations
            .iter_mut()
            .find(|books| books.location == reservation.location)
        {
            books.reservation_count = books.reservation_count.saturating_sub(1);
        }
        self.state.bump();
        self.dirty = true;
        true
    }

    fn open_lifetimes(&self) -> OpenLifetimes {
        let pending = self.leases.values().filter(|lease| lease.pending).count() as u64;
        OpenLifetimes {
            active_leases: self.leases.len() as u64 - pending,
            pending_leases: pending,
            holds: self.holds.len() as u64,
            reservations: self.state.reservations.len() as u64,
        }
    }
}

impl Manager {
    /// A new open manager with strict budgets at the listed locations, registered in
    /// order without advancing the version.
    pub fn new(budgets: &[(Location, u64)]) -> Self {
        let mut state = State::default();
        for &(location, budget) in budgets {
            state.register_budget(location, budget);
        }
        Self {
            manager_id: new_uuid(),
            gate: Gate::new(),
            published: ArcSwap::from_pointee(state.clone()),
            stale: AtomicBool::new(false),
            unpublished: Arc::new(State::default()),
            budgets: Arc::new(
                state
                    .locations
                    .iter()
                    .filter_map(|books| books.budget_bytes.map(|budget| (books.location, budget)))
                    .collect(),
            ),
            // Truncation is the point: 32 random bits.
            #[allow(clippy::cast_possible_truncation)]
            index_key: uuid::Uuid::new_v4().as_u128() as u32,
            owner_pid: crate::process::current_pid(),
            inner: Mutex::new(Inner {
                state,
                ..Inner::default()
            }),
            releases: ReleaseQueue::new(),
        }
    }

    pub fn manager_id(&self) -> &Arc<str> {
        &self.manager_id
    }

    pub fn gate(&self) -> &Gate {
        &self.gate
    }

    /// The id of the process that made the manager.
    pub fn owner_pid(&self) -> u32 {
        self.owner_pid
    }

    /// Refuses a process other than the owner (a forked child) before any lock, file or
    /// device is touched: the child's copy of the state describes the parent's memory
    /// and files, and a lock held by another parent thread at the fork stays held.
    pub fn check_process(&self) -> CoreResult<()> {
        let pid = crate::process::current_pid();
        if pid == self.owner_pid {
            return Ok(());
        }
        Err(CoreError::Forked {
            message: format!(
                "residency manager {:?} belongs to process {}, and this is process {} (a fork \
                 of it): a manager is used only by the process that made it; make a new \
                 manager in this process",
                &*self.manager_id, self.owner_pid, pid
            ),
            owner_pid: self.owner_pid,
            pid,
        })
    }

    fn inner(&self) -> MutexGuard<'_, Inner> {
        // Inner is only mutated through methods that keep it consistent step by step.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    // ----- the gate -------------------------------------------------------------

    /// Passes the gate and the requested guards, in the documented order: callback,
    /// lock, closed, re-entrancy. On a guard failure the lock is released again.
    pub fn enter(
        &self,
        poll: Duration,
        check_closed: bool,
        check_reentrant: bool,
    ) -> CoreResult<()> {
        self.check_process()?;
        self.gate.enter(poll)?;
        self.guards(check_closed, check_reentrant)
    }

    /// Non-blocking variant of [`Manager::enter`]: `Ok(false)` if another thread holds
    /// the lock (nothing is held then).
    pub fn try_enter(&self, check_closed: bool, check_reentrant: bool) -> CoreResult<bool> {
        self.check_process()?;
        if !self.gate.try_enter()? {
            return Ok(false);
        }
        self.guards(check_closed, check_reentrant).map(|()| true)
    }

    fn guards(&self, check_closed: bool, check_reentrant: bool) -> CoreResult<()> {
        let result = if check_closed && self.inner().state.closed {
            Err(self.closed_error())
        } else if check_reentrant {
            self.gate.check_reentrant()
        } else {
            Ok(())
        };
        if result.is_err() {
            self.exit();
        }
        result
    }

    /// Releases one gate level. The outermost exit marks the published state stale
    /// when the operation changed anything: lock-free readers then take the gate and
    /// publish (`current`), so they never see the middle of an operation, nor miss a
    /// finished one.
    pub fn exit(&self) {
        // Lock order: gate, then inner. Nothing takes them the other way round.
        self.gate.exit_with(|| {
            if self.inner().dirty {
                self.mark_stale();
            }
        });
    }

    /// Marks the published state stale (inside the gate); the first time since it was
    /// published, lets go of it.
    fn mark_stale(&self) {
        if !self.stale.swap(true, Ordering::AcqRel) {
            self.published.store(Arc::clone(&self.unpublished));
        }
    }

    pub fn begin_transition(&self) {
        self.gate.begin_transition();
    }

    pub fn end_transition(&self) {
        self.gate.end_transition();
    }

    /// `enter(closed, reentrant)` and `begin_transition` in one step, for the one-call
    /// paths: `true` when the gate is free (or this thread's), the manager is open, no
    /// CUDA lease is pending and this thread is in no transition. `false` changes
    /// nothing; the caller then enters the general way, which waits or raises.
    pub fn try_begin_quiet_transition(&self) -> bool {
        if crate::process::current_pid() != self.owner_pid {
            return false; // the general way raises
        }
        // Lock order: gate, then inner.
        self.gate.try_begin_transition(|| {
            let inner = self.inner();
            !inner.state.closed && inner.state.pending_leases == 0
        })
    }

    /// `end_transition` then `exit`, in one step.
    pub fn end_transition_and_exit(&self) {
        self.gate.end_transition_and_exit(|| {
            if self.inner().dirty {
                self.mark_stale();
            }
        });
    }

    /// The rest of a transition the caller began (the gate entered for it): `operation`;
    /// when it fails, the transition ends and the gate is let go (its error returned);
    /// else the transition ends and `after` runs still under the same hold of the gate,
    /// which is let go after: what must act on exactly the state the operation left,
    /// with no other thread's operation in between.
    pub fn transition_then<T, U, E>(
        &self,
        operation: impl FnOnce() -> Result<T, E>,
        after: impl FnOnce(T) -> U,
    ) -> Result<U, E> {
        let done = match operation() {
            Ok(done) => done,
            Err(error) => {
                self.end_transition_and_exit();
                return Err(error);
            }
        };
        self.end_transition();
        let result = after(done);
        self.exit();
        Ok(result)
    }

    pub fn set_callback_active(&self, active: bool) {
        self.gate.set_callback_active(active);
    }

    // ----- observations -------------------------------------------------------

    pub fn version(&self) -> u64 {
        self.inner().state.version
    }

    /// How many values this manager discarded so far. A handle that resolves (or
    /// fails to) keeps doing so until this count changes: values are only ever added,
    /// and a discard is the one change that ends one.
    pub fn discards(&self) -> u64 {
        self.inner().discards
    }

    pub fn is_closed(&self) -> bool {
        self.inner().state.closed
    }

    pub fn locations(&self) -> Vec<Location> {
        self.inner()
            .state
            .locations
            .iter()
            .map(|books| books.location)
            .collect()
    }

    /// The lock-free snapshot path: applies the snapshot guards (callback, closed,
    /// same-thread transition) to the published state. `Ok(None)` means pending CUDA
    /// leases must be reaped first, which needs the lock.
    pub fn try_published_snapshot(&self) -> CoreResult<Option<Arc<State>>> {
        self.check_process()?;
        self.gate.check_callback()?;
        self.gate.check_reentrant()?;
        if self.stale.load(Ordering::Acquire) {
            return Ok(None);
        }
        let state = self.published.load_full();
        if Arc::ptr_eq(&state, &self.unpublished) {
            // Marked stale since the flag was read.
            return Ok(None);
        }
        if state.closed {
            return Err(self.closed_error());
        }
        if state.pending_leases > 0 {
            return Ok(None);
        }
        Ok(Some(state))
    }

    fn closed_error(&self) -> CoreError {
        CoreError::Closed {
            message: format!("residency manager {:?} is closed", &*self.manager_id),
        }
    }

    /// The working state (inside the gate), for snapshots taken under the lock.
    pub fn current(&self) -> Arc<State> {
        let mut inner = self.inner();
        let state = Arc::new(inner.state.clone());
        if inner.dirty {
            self.published.store(Arc::clone(&state));
            inner.dirty = false;
            self.stale.store(false, Ordering::Release);
        }
        state
    }

    /// The working state's version, books and reservations, without its value records
    /// ([`State::books_only`]), inside the gate. Unlike [`Manager::current`] it
    /// publishes nothing and shares no value record with the working state: a reader
    /// that keeps it across later changes makes them copy nothing.
    pub fn current_books(&self) -> Arc<State> {
        Arc::new(self.inner().state.books_only())
    }

    pub fn materialization_locations(&self, handle: HandleId) -> CoreResult<Vec<Location>> {
        let inner = self.inner();
        Ok(inner
            .record(handle)?
            .materializations
            .iter()
            .map(|materialization| materialization.location)
            .collect())
    }

    // ----- handles --------------------------------------------------------------

    /// The value's spec (its byte counts and modes).
    pub fn value_spec(&self, handle: HandleId) -> CoreResult<ValueSpec> {
        Ok(self.inner().record(handle)?.spec)
    }

    /// The index issued for `handle_id`, and whether that value is discarded.
    pub fn lookup(&self, handle_id: &str) -> Option<(HandleId, bool)> {
        Self::lookup_in(&self.inner(), self.index_key, handle_id)
    }

    /// `lookup` for many ids under one lock.
    pub fn lookup_many<'a>(
        &self,
        handle_ids: impl IntoIterator<Item = Option<&'a str>>,
    ) -> Vec<Option<(HandleId, bool)>> {
        let inner = self.inner();
        handle_ids
            .into_iter()
            .map(|id| id.and_then(|id| Self::lookup_in(&inner, self.index_key, id)))
            .collect()
    }

    fn lookup_in(inner: &Inner, index_key: u32, handle_id: &str) -> Option<(HandleId, bool)> {
        let handle = HandleName::index_in_text(handle_id, index_key)?;
        let record = inner.state.record(handle)?;
        record
            .handle_id
            .is_written_as(handle_id)
            .then_some((handle, record.discarded))
    }

    // ----- registration ---------------------------------------------------------

    /// Registers a reconstructible value with no materialisation.
    pub fn register_source(
        &self,
        type_key: u64,
        spec: ValueSpec,
        source_location: Location,
    ) -> CoreResult<(HandleId, HandleName)> {
        if spec.recoverability() != Recoverability::Reconstructible {
            return Err(CoreError::invalid(
                "register_source requires a RECONSTRUCTIBLE spec; adopt values that must be preserved",
            ));
        }
        let mut inner = self.inner();
        inner.state.register_location(source_location);
        let handle_id = HandleName::issue(
            HandleId::try_from(inner.state.values.len()).unwrap_or(HandleId::MAX),
            self.index_key,
        );
        let handle = inner.state.push_record(ValueRecord {
            handle_id,
            type_key: narrow_type_key(type_key)?,
            spec,
            source: Some(source_location),
            discarded: false,
            materializations: Vec::new(),
        });
        inner.state.bump();
        inner.dirty = true;
        Ok((handle, handle_id))
    }

    /// Adopts a measured value as a new `MUST_PRESERVE` record installed at `location`.
    /// A failed install leaves no record behind.
    pub fn adopt(
        &self,
        type_key: u64,
        spec: ValueSpec,
        location: Location,
        storage_nbytes: u64,
        keys: &[StorageKey],
    ) -> CoreResult<(HandleId, HandleName)> {
        let mut inner = self.inner();
        let handle_id = HandleName::issue(
            HandleId::try_from(inner.state.values.len()).unwrap_or(HandleId::MAX),
            self.index_key,
        );
        let handle = inner.state.push_record(ValueRecord {
            handle_id,
            type_key: narrow_type_key(type_key)?,
            spec,
            source: None,
            discarded: false,
            materializations: Vec::new(),
        });
        let logical = spec.logical_nbytes();
        if let Err(err) = Self::install_locked(
            &mut inner,
            handle,
            location,
            logical,
            storage_nbytes,
            keys,
            false,
        ) {
            inner.state.pop_record();
            return Err(err);
        }
        Ok((handle, handle_id))
    }

    // ----- transitions ------------------------------------------------------------

    /// Validates a measured value's byte counts against the value's spec: its logical
    /// bytes exactly, its charge (the charge rule) at most the spec's.
    fn check_bytes(
        record: &ValueRecord,
        logical_nbytes: u64,
        storage_nbytes: u64,
    ) -> CoreResult<()> {
        let spec = record.spec;
        if logical_nbytes != spec.logical_nbytes() {
            return Err(CoreError::Materialization {
                message: format!(
                    "value {:?} has logical_nbytes={logical_nbytes}, but its spec declares {}",
                    record.handle_id,
                    spec.logical_nbytes()
                ),
            });
        }
        let occupied = charge_of(logical_nbytes, storage_nbytes);
        if occupied > spec.storage_nbytes() {
            return Err(CoreError::Materialization {
                message: format!(
                    "value {:?} occupies {occupied} storage bytes, above its charge of {}",
                    record.handle_id,
                    spec.storage_nbytes()
                ),
            });
        }
        Ok(())
    }

    /// Where an ensure of `handle` at `at` would copy from, changing nothing: `None`
    /// when it is resident there already (or has nowhere to come from), else the
    /// materialisation it copies, or the location its source loads it into.
    pub fn ensure_source(&self, handle: HandleId, at: Location) -> CoreResult<Option<Location>> {
        let inner = self.inner();
        let record = inner.live_record(handle)?;
        if record.is_resident(at) {
            return Ok(None);
        }
        Ok(record.best_source(None).or(record.source))
    }

    /// What bringing each of `handles` to `at` would cost the host, changing nothing
    /// (docs/concepts/controller.md#staging): only a copy to a device from pinned or
    /// device memory is asynchronous, and with `disk_deferred` a read from disk to a
    /// device too (the disk tier reads it on its I/O thread), as is a source's load
    /// into pageable memory on the way to a device when the source loads alone.
    pub fn host_costs(
        &self,
        handles: &[HandleId],
        at: Location,
        disk_deferred: bool,
    ) -> CoreResult<Vec<HostCost>> {
        let to_device = matches!(at, Location::Cuda(_));
        let inner = self.inner();
        // Pushed into a vector of the known length (a collect through `?` would grow it).
        let mut costs = Vec::with_capacity(handles.len());
        for &handle in handles {
            let record = inner.live_record(handle)?;
            costs.push(if record.is_resident(at) {
                HostCost::Free
            } else {
                let copied = record.best_source(None);
                match copied.or(record.source) {
                    None => HostCost::Free,
                    // A source's `load()` into pageable memory (no copy there yet).
                    Some(Location::PageableHost)
                        if copied.is_none() && disk_deferred && to_device =>
                    {
                        HostCost::BlocksUnlessLoadsAlone
                    }
                    Some(Location::PinnedHost | Location::Cuda(_)) if to_device => HostCost::Free,
                    Some(Location::Disk(_)) if disk_deferred && to_device => HostCost::Free,
                    Some(_) => HostCost::Blocks,
                }
            });
        }
        Ok(costs)
    }

    fn unavailable(record: &ValueRecord) -> CoreError {
        CoreError::Unavailable {
            message: format!(
                "value {:?} has no materialization and no reconstruction source",
                record.handle_id
            ),
        }
    }

    /// Validates and installs a measured materialisation (docs/concepts/values.md#install).
    #[allow(clippy::too_many_arguments)] // The measured facts travel together.
    pub fn install(
        &self,
        handle: HandleId,
        location: Location,
        logical_nbytes: u64,
        storage_nbytes: u64,
        keys: &[StorageKey],
        exclusive_transition: bool,
    ) -> CoreResult<()> {
        let mut inner = self.inner();
        Self::install_locked(
            &mut inner,
            handle,
            location,
            logical_nbytes,
            storage_nbytes,
            keys,
            exclusive_transition,
        )
    }

    fn install_locked(
        inner: &mut Inner,
        handle: HandleId,
        location: Location,
        logical_nbytes: u64,
        storage_nbytes: u64,
        keys: &[StorageKey],
        exclusive_transition: bool,
    ) -> CoreResult<()> {
        let record = inner.record(handle)?;
        if record.is_resident(location) {
            return Err(CoreError::Internal {
                message: format!(
                    "value {:?} is already installed at {location}",
                    record.handle_id
                ),
            });
        }
        if record.spec.is_exclusive()
            && !record.materializations.is_empty()
            && !exclusive_transition
        {
            return Err(CoreError::Ownership {
                message: format!(
                    "value {:?} is EXCLUSIVE and already materialized; it cannot be replicated",
                    record.handle_id
                ),
            });
        }
        Self::check_bytes(record, logical_nbytes, storage_nbytes)?;
        inner.state.admit(location, record.spec.storage_nbytes())?;
        if let Some(&(owner, owner_location)) =
            keys.iter().find_map(|key| inner.storage_owners.get(key))
        {
            let owner_id = inner.record(owner)?.handle_id;
            return Err(CoreError::Ownership {
                message: format!(
                    "storage of the value being installed for {:?} at {location} aliases the \
                     managed materialization of {:?} at {owner_location}; pass an independent copy",
                    inner.record(handle)?.handle_id,
                    owner_id
                ),
            });
        }
        inner.state.install(handle, location, storage_nbytes);
        for &key in keys {
            inner.storage_owners.insert(key, (handle, location));
        }
        inner
            .materialization_keys
            .insert((handle, location), StorageKeys::new(keys));
        inner.dirty = true;
        Ok(())
    }

    /// Drops one materialisation. `Ok(false)` is the no-op (already absent).
    pub fn drop_materialization(&self, handle: HandleId, at: Location) -> CoreResult<bool> {
        let mut inner = self.inner();
        let record = inner.live_record(handle)?;
        if !record.is_resident(at) {
            return Ok(false);
        }
        let final_one = record.materializations.len() == 1 && record.source.is_none();
        let handle_id = record.handle_id;
        inner.check_removable(handle, at)?;
        if final_one {
            return Err(CoreError::Ownership {
                message: format!(
                    "cannot drop the final MUST_PRESERVE materialization of value {handle_id:?} at {at}; \
                     move it elsewhere or discard the value"
                ),
            });
        }
        // No other reference to the record is held here: the removal changes it in
        // place unless a snapshot shares it.
        inner.remove(handle, at);
        Ok(true)
    }

    /// Ends a value: every materialisation removed (all must be unprotected, else
    /// nothing changes), the source cleared, the record marked discarded.
    pub fn discard(&self, handle: HandleId) -> CoreResult<Vec<Location>> {
        let mut inner = self.inner();
        let removed: Vec<Location> = inner
            .live_record(handle)?
            .materializations
            .iter()
            .map(|materialization| materialization.location)
            .collect();
        for &location in &removed {
            inner.check_removable(handle, location)?;
        }
        for &location in &removed {
            inner.remove(handle, location);
        }
        inner.state.mark_discarded(handle);
        inner.discards += 1;
        inner.dirty = true;
        Ok(removed)
    }

    // ----- protections and lifetimes ----------------------------------------------

    /// Checks that every handle is live and resident at `location` (no side effect).
    pub fn check_resident(&self, handles: &[HandleId], location: Location) -> CoreResult<()> {
        let inner = self.inner();
        for &handle in handles {
            let record = inner.live_record(handle)?;
            if !record.is_resident(location) {
                return Err(CoreError::Unavailable {
                    message: format!(
                        "value {:?} is not resident at {location}; ensure or move it there first \
                         (acquire and hold never materialize)",
                        record.handle_id
                    ),
                });
            }
        }
        Ok(())
    }

    /// Installs use tokens on every materialisation atomically (one version step).
    pub fn acquire(&self, handles: &[HandleId], location: Location) -> CoreResult<u64> {
        self.check_resident(handles, location)?;
        Ok(self.inner().acquire_locked(handles, location))
    }

    /// Installs hold tokens atomically (one version step).
    pub fn hold(&self, handles: &[HandleId], location: Location) -> CoreResult<u64> {
        self.check_resident(handles, location)?;
        let mut inner = self.inner();
        inner.tokens(handles, location, TokenKind::Hold, true);
        let token = inner.next_token();
        inner.holds.insert(
            token,
            HoldRecord {
                handles: Handles::from(handles),
                location,
            },
        );
        inner.state.bump();
        inner.dirty = true;
        Ok(token)
    }

    /// Where a lease token stands.
    pub fn lease_state(&self, token: u64) -> LeaseState {
        match self.inner().leases.get(&token) {
            None => LeaseState::Unknown,
            Some(lease) if lease.pending => LeaseState::Pending,
            Some(_) => LeaseState::Active,
        }
    }

    /// The handles and location of a pending lease; `None` for any other token.
    pub fn pending_lease_values(&self, token: u64) -> Option<(Vec<HandleId>, Location)> {
        self.inner()
            .leases
            .get(&token)
            .filter(|lease| lease.pending)
            .map(|lease| (lease.handles.to_vec(), lease.location))
    }

    /// True while the lease record exists, is active and `handle` is one of its
    /// handles (borrowed lookups check this).
    pub fn lease_covers(&self, token: u64, handle: HandleId) -> bool {
        self.inner()
            .leases
            .get(&token)
            .is_some_and(|lease| !lease.pending && lease.handles.contains(&handle))
    }

    /// Releases an active lease's use tokens (one version step). `false` if the
    /// lease is unknown or not active.
    pub fn release_lease(&self, token: u64) -> bool {
        self.inner().release_lease(token)
    }

    /// Turns an active lease's use tokens into pending-event tokens (one step), with
    /// no events recorded: the records alone. A CUDA lease's release goes through
    /// [`Manager::apply`] or [`Manager::release`] with its events instead.
    pub fn lease_to_pending(&self, token: u64) -> bool {
        self.inner().lease_to_pending(token)
    }

    /// Releases a pending lease's records (one version step). A lease made pending
    /// with events is settled by [`Manager::settle_pending`], which also forgets its
    /// events and the transfer it protected, and gives back their ids.
    pub fn release_pending(&self, token: u64) -> bool {
        self.inner().release_pending(token)
    }

    /// Tokens of the leases currently pending on CUDA events, in token order.
    pub fn pending_lease_tokens(&self) -> Vec<u64> {
        let inner = self.inner();
        let mut tokens: Vec<u64> = inner
            .leases
            .iter()
            .filter(|(_, lease)| lease.pending)
            .map(|(&token, _)| token)
            .collect();
        tokens.sort_unstable();
        tokens
    }

    pub fn pending_leases(&self) -> u64 {
        self.inner().state.pending_leases
    }

    /// Releases a hold (one version step). `false` if unknown.
    pub fn release_hold(&self, token: u64) -> bool {
        self.inner().release_hold(token)
    }

    /// Admits and records a reservation (one version step, plus one for a new location).
    pub fn reserve(&self, location: Location, nbytes: u64, label: &str) -> CoreResult<u64> {
        let mut inner = self.inner();
        inner.state.admit(location, nbytes)?;
        let index = inner.state.register_location(location);
        inner.state.add_reserved(location, nbytes);
        inner.state.locations[index].reservation_count += 1;
        let token = inner.next_token();
        inner.state.reservations.insert(
            token,
            ReservationRecord {
                location,
                nbytes,
                label: Arc::from(label),
            },
        );
        inner.state.bump();
        inner.dirty = true;
        Ok(token)
    }

    /// Releases a reservation (one version step). `false` if unknown.
    pub fn release_reservation(&self, token: u64) -> bool {
        self.inner().release_reservation(token)
    }

    /// Closes the manager. Without `force`, open lifetimes refuse the close.
    pub fn close(&self, force: bool) -> CoreResult<()> {
        let mut inner = self.inner();
        if inner.state.closed {
            return Ok(());
        }
        let open = inner.open_lifetimes();
        if !force && !open.is_empty() {
            return Err(CoreError::InUse {
                message: format!(
                    "residency manager {:?} still has open lifetimes (active_leases={}, \
                     pending_leases={}, holds={}, reservations={}); release them or close(force=True)",
                    &*self.manager_id,
                    open.active_leases,
                    open.pending_leases,
                    open.holds,
                    open.reservations
                ),
                location: None,
                active_reads: open.active_leases,
                holds: open.holds,
                pending_events: open.pending_leases,
            });
        }
        inner.leases.clear();
        inner.holds.clear();
        inner.storage_owners.clear();
        inner.materialization_keys.clear();
        let state = &mut inner.state;
        state.clear_values();
        state.reservations = imbl::OrdMap::new();
        state.pending_leases = 0;
        for books in &mut state.locations {
            books.used_bytes = 0;
            books.reserved_bytes = 0;
            books.value_count = 0;
            books.reservation_count = 0;
            books.use_count = 0;
            books.hold_count = 0;
            books.pending_count = 0;
        }
        state.closed = true;
        state.bump();
        inner.dirty = true;
        Ok(())
    }

    /// Simulates a plan over the working state (preflight and `explain`). Leases in
    /// `completed_leases` are pending leases whose events all completed: they no
    /// longer protect (explain's rule; preflight reaps them first instead).
    pub fn simulate(
        &self,
        plan: &Plan,
        resolutions: &[SlotResolution],
        cuda: CudaDevices,
        completed_leases: &[u64],
        labels: &[String],
    ) -> Simulation {
        let inner = self.inner();
        let mut completed = CompletedPending::default();
        for token in completed_leases {
            if let Some(lease) = inner.leases.get(token).filter(|lease| lease.pending) {
                for &handle in lease.handles.iter() {
                    *completed.entry((handle, lease.location)).or_default() += 1;
                }
            }
        }
        simulate::simulate(&inner.state, plan, resolutions, cuda, &completed, labels)
    }

    /// The core IR of a plan the search decided on this manager's `search_inputs`
    /// (docs/concepts/controller.md#decide, step 6): no exit actions, handles interned
    /// in first appearance order over reclaim then enter, as lowering a plan record
    /// would; also each slot's handle index, for the glue's records and the simulation.
    pub fn decided_plan(
        &self,
        name: &Arc<str>,
        outcome: &SearchOutcome,
        reservations: Vec<Reservation>,
    ) -> CoreResult<(Plan, Vec<HandleId>)> {
        let mut guard = self.inner();
        let inner = &mut *guard;
        // At most one slot per action.
        let actions = outcome.reclaim.len() + outcome.enter.len();
        let mut slots: Vec<HandleId> = Vec::with_capacity(actions);
        let mut handles: Vec<HandleRef> = Vec::with_capacity(actions);
        let mut lower = |planned: &Planned| -> CoreResult<Action> {
            // Search positions are handle indices (see `search_inputs`).
            let value = match *planned {
                Planned::Ensure { value, .. }
                | Planned::Move { value, .. }
                | Planned::Drop { value, .. } => value,
            };
            let index = HandleId::try_from(value).unwrap_or(HandleId::MAX);
            let slot = if let Some(slot) = slots.iter().position(|&known| known == index) {
                slot
            } else {
                let record = inner
                    .state
                    .record(index)
                    .ok_or_else(|| CoreError::Internal {
                        message: format!("search value {value} has no record"),
                    })?;
                let handle_id = inner.shared_ids.get(index, record.handle_id);
                handles.push(HandleRef {
                    manager_id: Arc::clone(&self.manager_id),
                    handle_id,
                    type_key: u64::from(record.type_key),
                });
                slots.push(index);
                slots.len() - 1
            };
            let handle = HandleSlot(u32::try_from(slot).unwrap_or(u32::MAX));
            Ok(match *planned {
                Planned::Ensure { location, .. } => Action::Ensure { handle, location },
                Planned::Move { to, from, .. } => Action::Move { handle, to, from },
                Planned::Drop { location, .. } => Action::Drop { handle, location },
            })
        };
        // Lowered into vectors of the known lengths (a collect through `?` would grow them).
        let mut reclaim = Vec::with_capacity(outcome.reclaim.len());
        for planned in &outcome.reclaim {
            reclaim.push(lower(planned)?);
        }
        let mut enter = Vec::with_capacity(outcome.enter.len());
        for planned in &outcome.enter {
            enter.push(lower(planned)?);
        }
        let plan = Plan::new(
            Arc::clone(name),
            handles,
            reclaim,
            enter,
            Vec::new(),
            reservations,
        )?;
        Ok((plan, slots))
    }

    /// The controller's planning state, read from the working state: every issued
    /// handle at its own index (so in registration order), the books, and the budgets
    /// (docs/concepts/controller.md#decide). The values are a persistent copy of the
    /// state, taken in constant time and read only where the search looks.
    pub fn search_inputs(&self) -> SearchInputs {
        let inner = self.inner();
        let state = &inner.state;
        SearchInputs {
            values: StateValues {
                state: state.clone(),
            },
            books: state
                .locations
                .iter()
                .map(|books| (books.location, books.used_bytes, books.reserved_bytes))
                .collect(),
            budgets: Arc::clone(&self.budgets),
            version: state.version,
        }
    }

    /// Checks the balance invariants of the working state (tests, debug builds).
    pub fn check_books(&self) -> Result<(), String> {
        self.inner().state.books_balance()
    }
}

/// The search's view of a manager's state ([`ValueTable`]): each value is read from its
/// record when the search looks at it, the candidates at a location from the state's
/// per-location residents. A value's position is its handle index.
#[derive(Debug, Clone)]
pub struct StateValues {
    state: State,
}

impl StateValues {
    /// Whether the handle index names a value that is not discarded.
    pub fn is_live(&self, position: usize) -> bool {
        self.record(position)
            .is_some_and(|record| !record.discarded)
    }

    fn record(&self, position: usize) -> Option<&Arc<ValueRecord>> {
        self.state.values.get(position)
    }

    fn mat(materialization: &Materialization) -> MatInfo {
        MatInfo {
            location: materialization.location,
            charged: materialization.charged_nbytes,
            use_count: materialization.use_count,
            hold_count: materialization.hold_count,
            pending_count: materialization.pending_count,
        }
    }
}

impl ValueTable for StateValues {
    fn resident_set(&self, location: Location) -> Option<Option<&crate::victims::ResidentSet>> {
        Some(self.state.residents(location))
    }

    fn handle_name(&self, position: usize) -> Option<String> {
        Some(format!("{:?}", self.record(position)?.handle_id))
    }

    fn value(&self, position: usize) -> Option<SearchValue> {
        let record = self.record(position)?;
        let handle = HandleId::try_from(position).unwrap_or(HandleId::MAX);
        Some(if record.discarded {
            SearchValue::new(handle, handle, 0, false, None)
        } else {
            SearchValue::new(
                handle,
                handle,
                record.spec.storage_nbytes(),
                record.spec.is_exclusive(),
                record.source,
            )
        })
    }

    fn mat_at(&self, position: usize, location: Location) -> Option<MatInfo> {
        self.record(position)?
            .materialization(location)
            .map(Self::mat)
    }

    fn mats(&self, position: usize) -> Vec<MatInfo> {
        let mut mats: Vec<MatInfo> = self
            .record(position)
            .map(|record| record.materializations.iter().map(Self::mat).collect())
            .unwrap_or_default();
        mats.sort_by_key(|mat| mat.location);
        mats
    }

    fn extend_mats(&self, position: usize, out: &mut Vec<MatInfo>) {
        let start = out.len();
        if let Some(record) = self.record(position) {
            out.extend(record.materializations.iter().map(Self::mat));
        }
        if let Some(added) = out.get_mut(start..) {
            added.sort_by_key(|mat| mat.location);
        }
    }

    fn first_mat(&self, position: usize) -> Option<MatInfo> {
        // The first of the least location: what a stable sort puts first.
        self.record(position)?
            .materializations
            .iter()
            .min_by_key(|materialization| materialization.location)
            .map(Self::mat)
    }

    fn mats_at(&self, position: usize, locations: &[Location]) -> bool {
        let empty: &[Materialization] = &[];
        let mats = self
            .record(position)
            .map_or(empty, |record| &record.materializations[..]);
        // The sorted locations equal `locations` exactly when `locations` is sorted and
        // both hold each location as many times.
        let count_in = |location: Location| {
            mats.iter()
                .filter(|materialization| materialization.location == location)
                .count()
        };
        mats.len() == locations.len()
            && locations.is_sorted()
            && locations.iter().all(|&location| {
                locations.iter().filter(|&&known| known == location).count() == count_in(location)
            })
    }

    fn mat_count(&self, position: usize) -> usize {
        self.record(position)
            .map_or(0, |record| record.materializations.len())
    }

    fn residents(&self, location: Location) -> Vec<usize> {
        self.state
            .residents(location)
            .map(|handles| handles.iter().map(|&handle| handle as usize).collect())
            .unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{HandleName, SHARED_IDS, SharedIds, StorageKeys};

    #[test]
    fn a_shared_id_is_the_name_it_was_written_from() {
        let mut ids = SharedIds::default();
        let first = HandleName::issue(3, 7);
        let text = ids.get(3, first);
        assert_eq!(&*text, first.to_string());
        // The same handle again shares the string.
        assert!(Arc::ptr_eq(&text, &ids.get(3, first)));
        // Another handle on the same slot, and an index issued again with a new name,
        // each get their own text; the slot then knows the latest.
        let next = 3 + u32::try_from(SHARED_IDS).unwrap_or(u32::MAX);
        let other = HandleName::issue(next, 7);
        assert_eq!(&*ids.get(next, other), other.to_string());
        let again = HandleName::issue(3, 7);
        assert_ne!(again, first);
        assert_eq!(&*ids.get(3, again), again.to_string());
        assert_eq!(&*ids.get(3, first), first.to_string());
    }

    #[test]
    fn storage_keys_keep_every_key_in_order() {
        assert_eq!(StorageKeys::new(&[]).as_slice(), &[]);
        assert_eq!(StorageKeys::new(&[(-1, 8)]).as_slice(), &[(-1, 8)]);
        let keys = [(0, 16), (-1, 8), (0, 4)];
        assert_eq!(StorageKeys::new(&keys).as_slice(), &keys);
    }
}
