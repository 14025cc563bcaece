//! The published manager state: value records, per-location books and reservations.
//!
//! A `State` is an immutable value built from persistent collections, so cloning it
//! is O(1) and a published copy can be read by any number of threads without a lock.
//! Every mutation goes through the accounting helpers here, which keep the books
//! balanced: a location's `used_bytes` is always the sum of its materialisations'
//! charges, and a budgeted location never exceeds `used + reserved <= budget`.

use std::sync::Arc;

use imbl::{OrdMap, OrdSet};

use crate::error::{CoreError, CoreResult};
use crate::location::Location;
use crate::pvec::{PVec, own};
use crate::value::{HandleName, ValueSpec};

/// A value's position in issue order; stable until the manager closes.
pub type HandleId = u32;

/// One installed materialisation of a value.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Materialization {
    pub location: Location,
    /// The actual unique storage measured at install time.
    pub storage_nbytes: u64,
    /// The fixed admission charge: the spec's `storage_nbytes`.
    pub charged_nbytes: u64,
    pub use_count: u32,
    pub hold_count: u32,
    pub pending_count: u32,
}

impl Materialization {
    pub fn is_protected(&self) -> bool {
        self.use_count > 0 || self.hold_count > 0 || self.pending_count > 0
    }
}

/// Everything the core knows about one issued handle.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueRecord {
    pub handle_id: HandleName,
    /// The glue's key of the value type (small, so it is kept as 32 bits).
    pub type_key: u32,
    pub spec: ValueSpec,
    /// The reconstruction source's location, while a source is registered.
    pub source: Option<Location>,
    pub discarded: bool,
    /// Materialisations in install order.
    pub materializations: Vec<Materialization>,
}

impl ValueRecord {
    pub fn materialization(&self, location: Location) -> Option<&Materialization> {
        self.materializations
            .iter()
            .find(|materialization| materialization.location == location)
    }

    pub fn is_resident(&self, location: Location) -> bool {
        self.materialization(location).is_some()
    }

    /// The canonical-order first materialisation, optionally excluding one location.
    pub fn best_source(&self, excluding: Option<Location>) -> Option<Location> {
        self.materializations
            .iter()
            .map(|materialization| materialization.location)
            .filter(|location| Some(*location) != excluding)
            .min()
    }

    fn materialization_mut(&mut self, location: Location) -> Option<&mut Materialization> {
        self.materializations
            .iter_mut()
            .find(|materialization| materialization.location == location)
    }
}

/// The books of one registered location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocationState {
    pub location: Location,
    pub budget_bytes: Option<u64>,
    pub used_bytes: u64,
    pub reserved_bytes: u64,
    pub peak_used_bytes: u64,
    pub peak_charged_bytes: u64,
    pub value_count: u64,
    pub reservation_count: u64,
    pub use_count: u64,
    pub hold_count: u64,
    pub pending_count: u64,
}

impl LocationState {
    pub fn new(location: Location, budget_bytes: Option<u64>) -> Self {
        Self {
            location,
            budget_bytes,
            used_bytes: 0,
            reserved_bytes: 0,
            peak_used_bytes: 0,
            peak_charged_bytes: 0,
            value_count: 0,
            reservation_count: 0,
            use_count: 0,
            hold_count: 0,
            pending_count: 0,
        }
    }

    /// `budget - used - reserved`, or `None` when unbudgeted.
    pub fn remaining_budget_bytes(&self) -> Option<u64> {
        self.budget_bytes
            .map(|budget| budget.saturating_sub(self.charged_bytes()))
    }

    pub fn charged_bytes(&self) -> u64 {
        self.used_bytes.saturating_add(self.reserved_bytes)
    }

    /// The strict admission rule: `used + reserved + incoming <= budget`. Unbudgeted
    /// locations admit anything the books can still count exactly (2**64 - 1 bytes).
    pub fn admit(&self, incoming: u64) -> CoreResult<()> {
        if u128::from(self.charged_bytes()) + u128::from(incoming) > u128::from(u64::MAX) {
            return Err(CoreError::InvalidArgument {
                message: format!(
                    "admitting {incoming} more bytes at {} would exceed the 2**64 - 1 bytes \
                     the books can count exactly (used {}, reserved {})",
                    self.location, self.used_bytes, self.reserved_bytes
                ),
            });
        }
        match self.budget_bytes {
            Some(budget)
                if u128::from(self.charged_bytes()) + u128::from(incoming) > u128::from(budget) =>
            {
                Err(CoreError::Budget {
                    location: self.location,
                    budget_bytes: budget,
                    used_bytes: self.used_bytes,
                    reserved_bytes: self.reserved_bytes,
                    requested_bytes: incoming,
                })
            }
            _ => Ok(()),
        }
    }

    fn note_peaks(&mut self) {
        self.peak_used_bytes = self.peak_used_bytes.max(self.used_bytes);
        self.peak_charged_bytes = self.peak_charged_bytes.max(self.charged_bytes());
    }
}

/// An active reservation, in creation (token) order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReservationRecord {
    pub location: Location,
    pub nbytes: u64,
    pub label: Arc<str>,
}

/// Which protection token a count refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenKind {
    Use,
    Hold,
    Pending,
}

/// The registered locations' books, in registration order: a handful of entries, kept
/// as one shared vector. A snapshot shares it; the first change after one copies it
/// (a few entries, one allocation), and reading it is a slice scan.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct LocationBooks(Arc<Vec<LocationState>>);

impl LocationBooks {
    fn push_back(&mut self, books: LocationState) {
        Arc::make_mut(&mut self.0).push(books);
    }

    /// The books of `location`, made this state's own, if it is registered.
    fn location_mut(&mut self, location: Location) -> Option<&mut LocationState> {
        let index = self.0.iter().position(|books| books.location == location)?;
        own(&mut self.0)?.get_mut(index)
    }
}

impl std::ops::Deref for LocationBooks {
    type Target = [LocationState];

    fn deref(&self) -> &[LocationState] {
        &self.0
    }
}

impl std::ops::DerefMut for LocationBooks {
    fn deref_mut(&mut self) -> &mut [LocationState] {
        Arc::make_mut(&mut self.0).as_mut_slice()
    }
}

impl<'a> IntoIterator for &'a LocationBooks {
    type Item = &'a LocationState;
    type IntoIter = std::slice::Iter<'a, LocationState>;

    fn into_iter(self) -> Self::IntoIter {
        self.0.iter()
    }
}

impl<'a> IntoIterator for &'a mut LocationBooks {
    type Item = &'a mut LocationState;
    type IntoIter = std::slice::IterMut<'a, LocationState>;

    fn into_iter(self) -> Self::IntoIter {
        Arc::make_mut(&mut self.0).iter_mut()
    }
}

/// One immutable, self-consistent observation of a manager.
#[derive(Debug, Clone, Default)]
pub struct State {
    pub version: u64,
    pub closed: bool,
    pub values: PVec<Arc<ValueRecord>>,
    /// Registered locations in registration order.
    pub locations: LocationBooks,
    /// Active reservations keyed by their token (creation order).
    pub reservations: OrdMap<u64, ReservationRecord>,
    /// Released CUDA leases whose completion events have not been reaped yet.
    pub pending_leases: u64,
    /// Per location, the handles materialised there: kept by `install` and `remove`,
    /// so the controller's search finds the candidates at a location without reading
    /// every value (docs/concepts/controller.md#candidates).
    residents: OrdMap<Location, OrdSet<HandleId>>,
}

impl State {
    pub fn location(&self, location: Location) -> Option<&LocationState> {
        self.locations
            .iter()
            .find(|state| state.location == location)
    }

    fn location_index(&self, location: Location) -> Option<usize> {
        self.locations
            .iter()
            .position(|state| state.location == location)
    }

    /// The handles materialised at `location`, ascending.
    pub fn residents(&self, location: Location) -> Option<&OrdSet<HandleId>> {
        self.residents.get(&location)
    }

    /// This state's version, books and reservations without its value records: what a
    /// reader of the books alone keeps (a staged step's decision reads the version and
    /// the books). It shares no value node with this state, so keeping it makes the
    /// changes that follow copy no record.
    #[must_use]
    pub fn books_only(&self) -> Self {
        Self {
            version: self.version,
            closed: self.closed,
            values: PVec::new(),
            locations: self.locations.clone(),
            reservations: self.reservations.clone(),
            pending_leases: self.pending_leases,
            residents: OrdMap::new(),
        }
    }

    /// Forgets every value record (a closed manager).
    pub fn clear_values(&mut self) {
        self.values = PVec::new();
        self.residents = OrdMap::new();
    }

    pub fn record(&self, handle: HandleId) -> Option<&Arc<ValueRecord>> {
        self.values.get(handle as usize)
    }

    /// The books of `location`, or those of a fresh unbudgeted location.
    pub fn books(&self, location: Location) -> LocationState {
        self.location(location)
            .cloned()
            .unwrap_or_else(|| LocationState::new(location, None))
    }

    /// Checks admission of `incoming` bytes at `location` without charging.
    pub fn admit(&self, location: Location, incoming: u64) -> CoreResult<()> {
        match self.location(location) {
            Some(books) => books.admit(incoming),
            None => Ok(()),
        }
    }

    pub fn bump(&mut self) {
        self.version += 1;
    }

    /// Registers `location` if it is new (one version step); returns its index.
    pub fn register_location(&mut self, location: Location) -> usize {
        if let Some(index) = self.location_index(location) {
            return index;
        }
        self.locations.push_back(LocationState::new(location, None));
        self.bump();
        self.locations.len() - 1
    }

    /// Registers a budgeted location at construction (no version step).
    pub fn register_budget(&mut self, location: Location, budget: u64) {
        match self.location_index(location) {
            Some(index) => self.locations[index].budget_bytes = Some(budget),
            None => self
                .locations
                .push_back(LocationState::new(location, Some(budget))),
        }
    }

    fn books_mut(&mut self, location: Location) -> &mut LocationState {
        let index = self.register_location(location);
        &mut self.locations[index]
    }

    fn record_mut(&mut self, handle: HandleId) -> &mut ValueRecord {
        Arc::make_mut(&mut self.values[handle as usize])
    }

    /// [`Self::record_mut`] with room for one more materialisation: a shared record is
    /// copied with that room, so the push that follows does not grow the copy again.
    fn record_mut_for_install(&mut self, handle: HandleId) -> &mut ValueRecord {
        let slot = &mut self.values[handle as usize];
        if Arc::get_mut(slot).is_none() {
            let shared: &ValueRecord = slot;
            let mut materializations = Vec::with_capacity(shared.materializations.len() + 1);
            materializations.extend_from_slice(&shared.materializations);
            *slot = Arc::new(ValueRecord {
                handle_id: shared.handle_id,
                type_key: shared.type_key,
                spec: shared.spec,
                source: shared.source,
                discarded: shared.discarded,
                materializations,
            });
        }
        Arc::make_mut(slot)
    }

    /// Adds a charge that is not a materialisation (reservation or temporary load).
    /// Admission must have been checked; the caller decides about version steps.
    pub fn add_reserved(&mut self, location: Location, nbytes: u64) {
        let books = self.books_mut(location);
        books.reserved_bytes = books.reserved_bytes.saturating_add(nbytes);
        books.note_peaks();
    }

    pub fn remove_reserved(&mut self, location: Location, nbytes: u64) {
        if let Some(index) = self.location_index(location) {
            let books = &mut self.locations[index];
            books.reserved_bytes = books.reserved_bytes.saturating_sub(nbytes);
        }
    }

    /// Appends a new value record; returns its handle.
    pub fn push_record(&mut self, record: ValueRecord) -> HandleId {
        let handle = HandleId::try_from(self.values.len()).unwrap_or(HandleId::MAX);
        self.values.push_back(Arc::new(record));
        handle
    }

    /// Removes the most recently pushed record (a failed adopt); no version step.
    pub fn pop_record(&mut self) {
        if let Some(record) = self.values.pop_back() {
            let handle = HandleId::try_from(self.values.len()).unwrap_or(HandleId::MAX);
            for materialization in &record.materializations {
                self.forget_resident(materialization.location, handle);
            }
        }
    }

    fn forget_resident(&mut self, location: Location, handle: HandleId) {
        if let Some(handles) = self.residents.get_mut(&location) {
            handles.remove(&handle);
            if handles.is_empty() {
                self.residents.remove(&location);
            }
        }
    }

    /// Records an installed materialisation and charges it (one version step, plus
    /// one if the location is new). Every validation has happened before.
    pub fn install(&mut self, handle: HandleId, location: Location, storage_nbytes: u64) {
        let charged_nbytes = self.values[handle as usize].spec.storage_nbytes();
        let books = self.books_mut(location);
        books.used_bytes = books.used_bytes.saturating_add(charged_nbytes);
        books.value_count += 1;
        books.note_peaks();
        self.record_mut_for_install(handle)
            .materializations
            .push(Materialization {
                location,
                storage_nbytes,
                charged_nbytes,
                use_count: 0,
                hold_count: 0,
                pending_count: 0,
            });
        self.residents.entry(location).or_default().insert(handle);
        self.bump();
    }

    /// Removes a materialisation and its charge (one version step). Peaks stay.
    pub fn remove(&mut self, handle: HandleId, location: Location) -> Option<Materialization> {
        let record = self.record_mut(handle);
        let position = record
            .materializations
            .iter()
            .position(|materialization| materialization.location == location)?;
        let removed = record.materializations.remove(position);
        self.forget_resident(location, handle);
        if let Some(index) = self.location_index(location) {
            let books = &mut self.locations[index];
            books.used_bytes = books.used_bytes.saturating_sub(removed.charged_nbytes);
            books.value_count = books.value_count.saturating_sub(1);
            books.use_count = books.use_count.saturating_sub(u64::from(removed.use_count));
            books.hold_count = books
                .hold_count
                .saturating_sub(u64::from(removed.hold_count));
            books.pending_count = books
                .pending_count
                .saturating_sub(u64::from(removed.pending_count));
        }
        self.bump();
        Some(removed)
    }

    /// Ends a value's identity: clears its source and marks it discarded (one step).
    pub fn mark_discarded(&mut self, handle: HandleId) {
        let record = self.record_mut(handle);
        record.source = None;
        record.discarded = true;
        self.bump();
    }

    /// Adds (`add`) or removes one protection token; no version step here. Removing
    /// a token the materialisation does not have changes nothing.
    pub fn adjust_tokens(
        &mut self,
        handle: HandleId,
        location: Location,
        kind: TokenKind,
        add: bool,
    ) {
        if add {
            self.move_token(handle, location, None, Some(kind));
        } else {
            self.move_token(handle, location, Some(kind), None);
        }
    }

    /// Removes one token of kind `from` (when the materialisation has one) and adds one
    /// of kind `to`, in one visit of the record and the books; no version step here.
    pub fn move_token(
        &mut self,
        handle: HandleId,
        location: Location,
        from: Option<TokenKind>,
        to: Option<TokenKind>,
    ) {
        fn count(materialization: &mut Materialization, kind: TokenKind) -> &mut u32 {
            match kind {
                TokenKind::Use => &mut materialization.use_count,
                TokenKind::Hold => &mut materialization.hold_count,
                TokenKind::Pending => &mut materialization.pending_count,
            }
        }
        fn total(books: &mut LocationState, kind: TokenKind) -> &mut u64 {
            match kind {
                TokenKind::Use => &mut books.use_count,
                TokenKind::Hold => &mut books.hold_count,
                TokenKind::Pending => &mut books.pending_count,
            }
        }
        let Some(materialization) = self
            .values
            .get_mut(handle as usize)
            .and_then(own)
            .and_then(|record| record.materialization_mut(location))
        else {
            return;
        };
        let removes = from.is_some_and(|kind| *count(materialization, kind) > 0);
        if !removes && to.is_none() {
            return;
        }
        if let Some(kind) = from.filter(|_| removes) {
            let counted = count(materialization, kind);
            *counted = counted.saturating_sub(1);
        }
        if let Some(kind) = to {
            *count(materialization, kind) += 1;
        }
        if let Some(books) = self.locations.location_mut(location) {
            if let Some(kind) = from.filter(|_| removes) {
                let counted = total(books, kind);
                *counted = counted.saturating_sub(1);
            }
            if let Some(kind) = to {
                *total(books, kind) += 1;
            }
        }
    }

    /// Checks the books: every location's charges equal its materialisations'.
    /// Used by tests and debug assertions; O(values).
    pub fn books_balance(&self) -> Result<(), String> {
        for books in &self.locations {
            let mut used = 0u64;
            let mut count = 0u64;
            for record in self.values.iter() {
                if let Some(materialization) = record.materialization(books.location) {
                    used = used.saturating_add(materialization.charged_nbytes);
                    count += 1;
                }
            }
            if used != books.used_bytes || count != books.value_count {
                return Err(format!(
                    "{}: used_bytes={} value_count={} but materialisations sum to {used} over {count}",
                    books.location, books.used_bytes, books.value_count
                ));
            }
            if let Some(budget) = books.budget_bytes
                && books.charged_bytes() > budget
            {
                return Err(format!(
                    "{}: used {} + reserved {} exceeds budget {budget}",
                    books.location, books.used_bytes, books.reserved_bytes
                ));
            }
            if books.peak_used_bytes < books.used_bytes
                || books.peak_charged_bytes < books.charged_bytes()
            {
                return Err(format!(
                    "{}: a peak is below its current value",
                    books.location
                ));
            }
        }
        let mut residents: OrdMap<Location, OrdSet<HandleId>> = OrdMap::new();
        for (index, record) in self.values.iter().enumerate() {
            let handle = HandleId::try_from(index).unwrap_or(HandleId::MAX);
            for materialization in &record.materializations {
                residents
                    .entry(materialization.location)
                    .or_default()
                    .insert(handle);
            }
        }
        if residents != self.residents {
            return Err("the per-location residents differ from the materialisations".to_owned());
        }
        Ok(())
    }
}
