//! The controller's bounded, deterministic depth-first search.
//!
//! The algorithm is the documented one (docs/concepts/controller.md, "Request
//! simulation" and "Search"), step for step: simulate the request; at the first
//! capacity failure, try the policy's victims in order, each through its reclaim
//! options, recursively. States share their unchanged parts: a state is the initial
//! planning state plus a persistent overlay of the values it changed ([`Overlay`]), so
//! cloning a state and computing its memo signature cost what the plan changed, not
//! what the manager holds.
//!
//! The search is bounded three ways (docs/concepts/controller.md#search-bounds): by
//! the caller's state limit, by [`MAX_SEARCH_DEPTH`] nested states on the depth-first
//! path and by [`MEMO_BUDGET_BYTES`] of remembered failures, so its memory does not
//! grow with the state limit. The recursion runs as a loop over an explicit stack of
//! small frames ([`Path`]), not on the native stack, and each level of the path costs
//! a bounded amount: a state adds one node to its ancestors' reclaim history
//! ([`Trail`]) and one path copy of its overlay, and the values blocked and reclaims
//! active in a branch are links in a shared arena ([`Links`]), truncated on backtrack.

use std::borrow::Cow;
use std::cell::Cell;
use std::collections::BTreeMap;
use std::fmt::Write as _;

use crate::fasthash::{FastMap, FastSet};
use std::sync::{Arc, LazyLock};

use crate::overlay::Overlay;

use crate::bytes;
use crate::error::CoreError;
use crate::location::{Location, LocationSet};
use crate::plan::ActionKind;
use crate::state::HandleId;
use crate::victims::{LruKeys, Ordered, PLAIN_KEYS, Positioned, ResidentSet, VictimOrder};

/// One materialisation snapshot in the planning state (docs/concepts/controller.md#decide,
/// step 4).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatInfo {
    pub location: Location,
    pub charged: u64,
    pub use_count: u32,
    pub hold_count: u32,
    pub pending_count: u32,
}

impl MatInfo {
    fn unprotected(&self) -> bool {
        self.use_count == 0 && self.hold_count == 0 && self.pending_count == 0
    }
}

/// A value as decide sees it; immutable during one search.
#[derive(Debug, Clone, Copy)]
pub struct SearchValue {
    pub handle: HandleId,
    /// Position in the snapshot's values, discarded entries counted.
    pub registration_index: u32,
    pub charge: u64,
    pub exclusive: bool,
    pub source: Option<Location>,
    /// This value's materialisations: a range of the table's `mats`, set by `push`.
    mats: (u32, u32),
}

impl SearchValue {
    pub fn new(
        handle: HandleId,
        registration_index: u32,
        charge: u64,
        exclusive: bool,
        source: Option<Location>,
    ) -> Self {
        Self {
            handle,
            registration_index,
            charge,
            exclusive,
            source,
            mats: (0, 0),
        }
    }
}

/// The planning state's values, in registration order, with their materialisations in
/// one table: reading a manager with many values costs two allocations, not one per
/// value. A value's position orders it like its registration index (the built-in
/// policy's last tie-break relies on that).
#[derive(Debug, Clone, Default)]
pub struct SearchValues {
    values: Vec<SearchValue>,
    mats: Vec<MatInfo>,
    /// Per location, the positions of the values materialised there, ascending: the
    /// candidates at a location are found without walking every value.
    residents: BTreeMap<Location, Vec<usize>>,
}

impl SearchValues {
    pub fn with_capacity(values: usize, mats: usize) -> Self {
        Self {
            values: Vec::with_capacity(values),
            mats: Vec::with_capacity(mats),
            residents: BTreeMap::new(),
        }
    }

    /// Appends `value` with `mats`, which are kept in canonical (location) order.
    pub fn push(&mut self, mut value: SearchValue, mats: impl IntoIterator<Item = MatInfo>) {
        let start = self.mats.len();
        self.mats.extend(mats);
        self.mats[start..].sort_by_key(|mat| mat.location);
        let index = |at: usize| u32::try_from(at).unwrap_or(u32::MAX);
        value.mats = (index(start), index(self.mats.len()));
        let position = self.values.len();
        for mat in &self.mats[start..] {
            self.residents
                .entry(mat.location)
                .or_default()
                .push(position);
        }
        self.values.push(value);
    }

    pub fn len(&self) -> usize {
        self.values.len()
    }

    pub fn is_empty(&self) -> bool {
        self.values.is_empty()
    }

    pub fn get(&self, position: usize) -> Option<&SearchValue> {
        self.values.get(position)
    }

    pub fn values(&self) -> &[SearchValue] {
        &self.values
    }

    /// The positions of the values materialised at `location`, ascending.
    pub fn residents(&self, location: Location) -> &[usize] {
        self.residents.get(&location).map_or(&[], Vec::as_slice)
    }

    /// The materialisations of the value at `position`, in canonical order.
    pub fn mats(&self, position: usize) -> &[MatInfo] {
        let (start, end) = self.values[position].mats;
        &self.mats[start as usize..end as usize]
    }
}

impl std::ops::Index<usize> for SearchValues {
    type Output = SearchValue;

    fn index(&self, position: usize) -> &SearchValue {
        &self.values[position]
    }
}

/// What the search reads of the planning state's values, by position: a table built
/// for the purpose ([`SearchValues`]) or the manager's own state, read only where the
/// search looks (`crate::StateValues`), so that a decide costs what it touches, not
/// what the manager holds.
pub trait ValueTable {
    /// The value at `position`, if there is one.
    fn value(&self, position: usize) -> Option<SearchValue>;
    /// Its materialisation at `location`, if any.
    fn mat_at(&self, position: usize, location: Location) -> Option<MatInfo>;
    /// Its materialisations, in canonical (location) order.
    fn mats(&self, position: usize) -> Vec<MatInfo>;
    /// Appends its materialisations, in canonical order, to `out` (the search reuses
    /// one buffer for them).
    fn extend_mats(&self, position: usize, out: &mut Vec<MatInfo>) {
        out.extend(self.mats(position));
    }
    /// Its first materialisation in canonical order, if any.
    fn first_mat(&self, position: usize) -> Option<MatInfo> {
        self.mats(position).first().copied()
    }
    /// Whether its materialisations are at exactly `locations` (in canonical order).
    fn mats_at(&self, position: usize, locations: &[Location]) -> bool {
        self.mats(position)
            .iter()
            .map(|mat| mat.location)
            .eq(locations.iter().copied())
    }
    /// How many materialisations it has.
    fn mat_count(&self, position: usize) -> usize;
    /// The positions of the values materialised at `location`, ascending.
    fn residents(&self, location: Location) -> Vec<usize>;
    /// The manager's persistent set of the values resident at `location` (`Some(None)`
    /// for none), if the table is a manager's state: a policy that keeps its order of
    /// them incrementally syncs with it ([`SearchPolicy::sync_residents`]).
    fn resident_set(&self, _location: Location) -> Option<Option<&ResidentSet>> {
        None
    }
    /// How messages name the value at `position` (its handle id, quoted), if the table
    /// knows it; messages fall back to `#<handle index>`.
    fn handle_name(&self, _position: usize) -> Option<String> {
        None
    }
}

impl ValueTable for SearchValues {
    fn value(&self, position: usize) -> Option<SearchValue> {
        self.values.get(position).copied()
    }

    fn mat_at(&self, position: usize, location: Location) -> Option<MatInfo> {
        if position >= self.values.len() {
            return None;
        }
        SearchValues::mats(self, position)
            .iter()
            .find(|mat| mat.location == location)
            .copied()
    }

    fn mats(&self, position: usize) -> Vec<MatInfo> {
        if position >= self.values.len() {
            return Vec::new();
        }
        SearchValues::mats(self, position).to_vec()
    }

    fn extend_mats(&self, position: usize, out: &mut Vec<MatInfo>) {
        if position < self.values.len() {
            out.extend_from_slice(SearchValues::mats(self, position));
        }
    }

    fn first_mat(&self, position: usize) -> Option<MatInfo> {
        if position >= self.values.len() {
            return None;
        }
        SearchValues::mats(self, position).first().copied()
    }

    fn mats_at(&self, position: usize, locations: &[Location]) -> bool {
        let mats: &[MatInfo] = if position < self.values.len() {
            SearchValues::mats(self, position)
        } else {
            &[]
        };
        mats.iter()
            .map(|mat| mat.location)
            .eq(locations.iter().copied())
    }

    fn mat_count(&self, position: usize) -> usize {
        self.values
            .get(position)
            .map_or(0, |value| (value.mats.1 - value.mats.0) as usize)
    }

    fn residents(&self, location: Location) -> Vec<usize> {
        SearchValues::residents(self, location).to_vec()
    }
}

/// A position the table does not hold: no materialisation, no source, no charge.
fn absent(position: usize) -> SearchValue {
    let index = u32::try_from(position).unwrap_or(u32::MAX);
    SearchValue::new(index, index, 0, false, None)
}

/// One requirement `(value position, destination)`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Requirement {
    pub value: usize,
    pub location: Location,
}

/// A planned action, by value position.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Planned {
    Ensure {
        value: usize,
        location: Location,
    },
    Move {
        value: usize,
        to: Location,
        from: Option<Location>,
    },
    Drop {
        value: usize,
        location: Location,
    },
}

impl Planned {
    pub fn kind(&self) -> ActionKind {
        match self {
            Self::Ensure { .. } => ActionKind::Ensure,
            Self::Move { .. } => ActionKind::Move,
            Self::Drop { .. } => ActionKind::Drop,
        }
    }
}

/// Why a victim was chosen: the three reason templates of
/// docs/concepts/controller.md#reclaim-options.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EvictionReason {
    OtherMaterialization,
    RegisteredSource,
    MovedTo(Location),
}

impl EvictionReason {
    pub fn text(&self) -> String {
        match self {
            Self::OtherMaterialization => {
                "another materialization preserves the logical value".to_owned()
            }
            Self::RegisteredSource => {
                "registered source can reconstruct the logical value".to_owned()
            }
            Self::MovedTo(location) => format!(
                "sole materialization moved to requested destination {location} instead of \
                 reconstructing it later"
            ),
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Eviction {
    pub action: Planned,
    pub rank: usize,
    pub released_location: Location,
    pub released_nbytes: u64,
    pub reason: EvictionReason,
}

/// A candidate as a policy sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Candidate {
    pub value: usize,
    pub location: Location,
    pub charged: u64,
}

/// The policy, as the search uses it. The built-in tiered LRU implements it natively;
/// the bindings implement it over a Python policy object.
pub trait SearchPolicy {
    /// A permutation of `candidates` (indices into it), first evicted first. Errors are
    /// reported as they are (the bindings carry Python exceptions through).
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError>;
    fn fallback_locations(&mut self, location: Location) -> Result<Vec<Location>, SearchError>;
    /// Whether this policy keeps its order of the values resident at `location`
    /// incrementally, brought up to `residents` (the initial state's, `None` for none)
    /// here: then how many residents it orders, and the search walks it
    /// ([`Self::next_resident`], at most that many steps) instead of asking
    /// [`Self::order`] over every resident. Such a policy's order is total and its
    /// [`Self::compare`] agrees with it.
    fn sync_residents(
        &mut self,
        _location: Location,
        _residents: Option<&ResidentSet>,
    ) -> Option<usize> {
        None
    }
    /// The initial resident of `location` after `after` (`None`: the first) in the
    /// policy's order, once [`Self::sync_residents`] said it keeps one.
    fn next_resident(&self, _location: Location, _after: Option<usize>) -> Option<usize> {
        None
    }
    /// The policy's order between two value positions, once
    /// [`Self::sync_residents`] said it keeps one.
    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        left.cmp(&right)
    }
    /// Called periodically so a long search can be interrupted.
    fn check_interrupt(&mut self) -> Result<(), SearchError> {
        Ok(())
    }
}

/// The deepest the depth-first search goes, in counted states open on its path (each
/// a request search or a search for capacity at a tier; every reclaim action of a
/// plan opens at least one). A level holds about 1.1 KB (its frames and what its state
/// changed, measured), so the path stays under about 150 MiB
/// (docs/concepts/controller.md#search-bounds). It is not below the default state limit
/// (100 000), so a search under that limit ends at the limit, as documented.
pub const MAX_SEARCH_DEPTH: u64 = 131_072;

/// The budget of the memo of exhausted states, in the bytes its keys' elements take
/// (see [`Search::memo_cost`]); the hash tables that hold them take up to about twice.
pub const MEMO_BUDGET_BYTES: u64 = 64 << 20;

/// A failure's detail is cut after this many bytes: the notes of a candidate's own
/// failure are nested in its parent's, and a large exhausted search would otherwise
/// build a message as long as the search.
pub const MAX_DETAIL_BYTES: usize = 1024;

/// The search polls the policy's interrupt check once per this many search steps
/// (entries of a request or capacity search, memo hits included).
const INTERRUPT_PERIOD: u64 = 32;

/// The fixed part of a remembered failure's cost against [`MEMO_BUDGET_BYTES`]: its
/// hash table slot and the headers of its key's lists.
const MEMO_ENTRY_BYTES: usize = 64;

/// The notes of a failed request search: its candidates' own failures, joined up to
/// [`MAX_DETAIL_BYTES`] and then counted.
#[derive(Debug, Default)]
struct Notes {
    text: String,
    omitted: u64,
}

impl Notes {
    fn add(&mut self, note: &str) {
        if self.text.len() >= MAX_DETAIL_BYTES {
            self.omitted += 1;
            return;
        }
        if !self.text.is_empty() {
            self.text.push_str("; ");
        }
        let room = MAX_DETAIL_BYTES.saturating_sub(self.text.len());
        if note.len() <= room {
            self.text.push_str(note);
        } else {
            let mut cut = room;
            while !note.is_char_boundary(cut) {
                cut -= 1;
            }
            self.text.push_str(&note[..cut]);
            self.text.push_str("...");
        }
    }

    /// The suffix of the failure's detail: empty without notes.
    fn finish(self) -> String {
        if self.text.is_empty() {
            return String::new();
        }
        if self.omitted == 0 {
            return format!("; candidates: {}", self.text);
        }
        format!(
            "; candidates: {}; {} more candidate(s) failed",
            self.text, self.omitted
        )
    }
}

/// Which of the search's bounds ended it (docs/concepts/controller.md#search-bounds).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SearchBound {
    /// The caller's state limit (`search_state_limit`).
    States,
    /// [`MAX_SEARCH_DEPTH`] nested states.
    Depth,
    /// [`MEMO_BUDGET_BYTES`] of remembered failures.
    Memory,
}

impl SearchBound {
    /// The bound's name, as `ResidencySearchLimitError.bound` reports it.
    pub fn name(self) -> &'static str {
        match self {
            Self::States => "states",
            Self::Depth => "depth",
            Self::Memory => "memory",
        }
    }
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SearchError {
    /// A bound was reached: inconclusive.
    Limit {
        explored: u64,
        bound: SearchBound,
        detail: String,
    },
    /// Exhausted: infeasible.
    Infeasible { detail: String },
    /// A required value has neither a materialisation nor a source.
    Unavailable { value: usize },
    /// The policy's ordering was not a permutation of its input.
    BadOrdering { detail: String },
    /// The policy failed (the bindings keep the Python exception aside).
    Policy,
    /// The search was interrupted.
    Interrupted,
}

impl SearchError {
    /// The failure as the core error the caller raises, for the request named
    /// `request_name` searched under `state_limit`; `handle_id` names the value at a
    /// search position. A failing policy normally keeps its own error aside and that
    /// one is raised instead; without one, the failure still reads as the policy's.
    pub fn into_core_error(
        self,
        request_name: &str,
        state_limit: u64,
        handle_id: impl FnOnce(usize) -> Option<String>,
    ) -> CoreError {
        match self {
            Self::Limit {
                explored,
                bound,
                detail,
            } => CoreError::SearchLimit {
                request_name: request_name.to_owned(),
                state_limit,
                explored_states: explored,
                bound: bound.name(),
                detail,
            },
            Self::Infeasible { detail } => CoreError::SearchInfeasible {
                request_name: request_name.to_owned(),
                detail,
            },
            Self::Unavailable { value } => match handle_id(value) {
                Some(handle_id) => CoreError::SearchUnavailable { handle_id },
                None => CoreError::Internal {
                    message: format!("search value {value} has no record"),
                },
            },
            Self::BadOrdering { detail } => CoreError::Policy { message: detail },
            Self::Policy | Self::Interrupted => CoreError::Policy {
                message: "the policy failed".to_owned(),
            },
        }
    }
}

#[derive(Debug, Clone)]
pub struct SearchOutcome {
    pub reclaim: Vec<Planned>,
    pub enter: Vec<Planned>,
    pub evictions: Vec<Eviction>,
    pub explored: u64,
}

pub use crate::victims::PolicyKeyMap;

/// The built-in `DeterministicTieredLRU`, natively: a stable sort by
/// `(priority, epoch or -1, keyed first, key text, registration index)`.
#[derive(Debug, Clone, Default)]
pub struct TieredLru {
    /// `(priority, epoch, stable key)` by value position, for values with metadata or
    /// an access epoch; every other value has `(0, -1, None)`. Shared, so a caller
    /// that keeps the keys as they change hands them to each decide without a copy.
    pub keys: Arc<PolicyKeyMap>,
    pub tiers: BTreeMap<Location, Vec<Location>>,
}

impl TieredLru {
    fn keys(&self, position: usize) -> &(i64, i64, Option<Arc<str>>) {
        self.keys.get(&position).unwrap_or(&PLAIN_KEYS)
    }

    /// The key order without the registration tie-break.
    fn compare_keys(
        left: &(i64, i64, Option<Arc<str>>),
        right: &(i64, i64, Option<Arc<str>>),
    ) -> std::cmp::Ordering {
        let (left_priority, left_epoch, left_key) = left;
        let (right_priority, right_epoch, right_key) = right;
        left_priority
            .cmp(right_priority)
            .then(left_epoch.cmp(right_epoch))
            .then(left_key.is_none().cmp(&right_key.is_none()))
            .then_with(|| {
                left_key
                    .as_deref()
                    .unwrap_or("")
                    .cmp(right_key.as_deref().unwrap_or(""))
            })
    }

    /// The tiered LRU's key order between two value positions
    /// (docs/concepts/controller.md#deterministictieredlru). Positions are in
    /// registration order, so comparing them compares registration indices.
    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        Self::compare_keys(self.keys(left), self.keys(right)).then(left.cmp(&right))
    }
}

impl SearchPolicy for TieredLru {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_by(|&a, &b| self.compare(candidates[a].value, candidates[b].value));
        Ok(order)
    }

    fn fallback_locations(&mut self, location: Location) -> Result<Vec<Location>, SearchError> {
        Ok(self.tiers.get(&location).cloned().unwrap_or_default())
    }
}

/// The built-in tiered LRU with its order of each location's residents kept
/// incrementally by the controller ([`VictimOrder`], with the same keys): the search
/// walks it from the first victim, so a decide reads the candidates it tries, not every
/// value resident where it makes room (docs/concepts/controller.md#candidates).
#[allow(missing_debug_implementations)]
pub struct IndexedLru<'a> {
    pub lru: TieredLru,
    pub order: &'a mut VictimOrder,
}

impl SearchPolicy for IndexedLru<'_> {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        self.lru.order(candidates)
    }

    fn fallback_locations(&mut self, location: Location) -> Result<Vec<Location>, SearchError> {
        self.lru.fallback_locations(location)
    }

    fn sync_residents(
        &mut self,
        location: Location,
        residents: Option<&ResidentSet>,
    ) -> Option<usize> {
        self.order.sync(&self.lru.keys, location, residents);
        Some(self.order.count(location))
    }

    fn next_resident(&self, location: Location, after: Option<usize>) -> Option<usize> {
        self.order.next(&self.lru.keys, location, after)
    }

    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        self.lru.compare(left, right)
    }
}

/// Schedule-aware eviction: for a known future sequence of requests, the candidate
/// whose value is used farthest ahead goes first, and a value never used again before
/// all others (Belady's MIN rule, which moves the fewest values for equal sizes).
///
/// Priorities and fallback tiers are the tiered LRU's: a lower priority is evicted
/// first whatever the schedule says, and values whose next uses tie (never used
/// again, or both first used at the same step) fall back to the tiered LRU's order
/// (docs/concepts/controller.md#schedule-aware-eviction).
#[derive(Debug, Clone, Default)]
pub struct ScheduleAware {
    /// Priorities, access epochs, stable keys and tiers, exactly as the tiered LRU.
    pub lru: TieredLru,
    /// The step at which each value position is next requested; a position without
    /// one is never requested again.
    pub next_use: NextUses,
}

/// Each value position's steps in a schedule, ascending, and the step the schedule
/// stands at: a position's next use is its first step at or after it, found by a
/// binary search, so standing at another step costs nothing and a lookup costs
/// `O(log uses)`, whatever the schedule's length. The steps are shared: a schedule
/// indexed once serves every decide.
///
/// A cyclic schedule (`NextUses::cyclic`) repeats forever: past its last step, a
/// position's next use is its first step of the next pass, counted on from the
/// schedule's length (step `i` of the next pass is `len + i`), so farther uses stay
/// larger across the wrap (docs/concepts/controller.md#schedule-aware-eviction).
#[derive(Debug, Clone, Default)]
pub struct NextUses {
    steps: Arc<FastMap<usize, Vec<u64>>>,
    /// The same schedule by step: the positions each step requests.
    by_step: Arc<Vec<Vec<usize>>>,
    /// Which schedule this is: another schedule, or this one changed, has another.
    id: Arc<()>,
    cursor: u64,
    /// The schedule's length when it repeats; `None` for one pass.
    period: Option<u64>,
}

impl NextUses {
    /// The steps of a schedule (each the value positions it requests), standing at
    /// its start.
    pub fn new(schedule: &[Vec<usize>]) -> Self {
        let mut steps: FastMap<usize, Vec<u64>> = FastMap::default();
        for (step, positions) in schedule.iter().enumerate() {
            let step = u64::try_from(step).unwrap_or(u64::MAX);
            for &position in positions {
                let uses = steps.entry(position).or_default();
                if uses.last() != Some(&step) {
                    uses.push(step);
                }
            }
        }
        Self {
            steps: Arc::new(steps),
            by_step: Arc::new(schedule.to_vec()),
            id: Arc::new(()),
            cursor: 0,
            period: None,
        }
    }

    /// The steps of a schedule that repeats forever, standing at its start.
    pub fn cyclic(schedule: &[Vec<usize>]) -> Self {
        Self {
            period: Some(u64::try_from(schedule.len()).unwrap_or(u64::MAX)),
            ..Self::new(schedule)
        }
    }

    /// Whether the schedule repeats.
    pub fn is_cyclic(&self) -> bool {
        self.period.is_some()
    }

    /// The same steps, standing at step `cursor`: the steps before it are done. A
    /// cyclic schedule's cursor wraps: `len` is step 0 of the next pass.
    #[must_use]
    pub fn at(&self, cursor: usize) -> Self {
        let cursor = u64::try_from(cursor).unwrap_or(u64::MAX);
        Self {
            steps: Arc::clone(&self.steps),
            by_step: Arc::clone(&self.by_step),
            id: Arc::clone(&self.id),
            cursor: self
                .period
                .and_then(|period| cursor.checked_rem(period))
                .unwrap_or(cursor),
            period: self.period,
        }
    }

    /// The step at which `position` is next requested, if it is: in a cyclic
    /// schedule, a step of the next pass counts from the schedule's length.
    pub fn get(&self, position: usize) -> Option<u64> {
        let uses = self.steps.get(&position)?;
        let next = uses.get(uses.partition_point(|&step| step < self.cursor));
        // Past its last step in this pass, a cyclic schedule's next use is its first
        // step of the next pass.
        next.copied().or_else(|| {
            let period = self.period?;
            uses.first().map(|&step| step.saturating_add(period))
        })
    }

    /// Records that `position` is requested at `step`.
    pub fn insert(&mut self, position: usize, step: u64) {
        let uses = Arc::make_mut(&mut self.steps).entry(position).or_default();
        if let Err(at) = uses.binary_search(&step) {
            uses.insert(at, step);
        }
        if let Ok(at) = usize::try_from(step) {
            let by_step = Arc::make_mut(&mut self.by_step);
            if by_step.len() <= at {
                by_step.resize_with(at + 1, Vec::new);
            }
            by_step[at].push(position);
        }
        self.id = Arc::new(());
    }

    /// Whether `other` is the same schedule (standing anywhere).
    pub fn same_schedule(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.id, &other.id) && self.period == other.period
    }

    /// The positions whose next use may differ between standing here and where
    /// `other` (the same schedule) stands: those requested at a step between the two.
    pub fn moved<'a>(&'a self, other: &Self) -> impl Iterator<Item = usize> + 'a {
        let low = usize::try_from(self.cursor.min(other.cursor)).unwrap_or(usize::MAX);
        let high = usize::try_from(self.cursor.max(other.cursor)).unwrap_or(usize::MAX);
        let steps = self
            .by_step
            .get(low.min(self.by_step.len())..high.min(self.by_step.len()))
            .unwrap_or_default();
        steps.iter().flatten().copied()
    }

    /// The positions requested at or after the current step (in a cyclic schedule,
    /// every position it requests), in no particular order.
    pub fn positions(&self) -> impl Iterator<Item = usize> + '_ {
        self.steps
            .keys()
            .copied()
            .filter(|&position| self.get(position).is_some())
    }
}

impl ScheduleAware {
    /// Next uses from a schedule of steps (each the value positions it requests),
    /// standing at step `cursor`: the steps before it are done.
    pub fn next_uses(schedule: &[Vec<usize>], cursor: usize) -> NextUses {
        NextUses::new(schedule).at(cursor)
    }

    /// A position's eviction key, smallest first: priority, then the schedule (never
    /// used again first, then the farthest next use), then the tiered LRU's epoch,
    /// keyed-first, key text and registration order.
    fn key(&self, position: usize) -> ScheduleKey<'_> {
        let (priority, epoch, key) = self.lru.keys(position);
        let next = self.next_use.get(position).unwrap_or(u64::MAX);
        (
            *priority,
            std::cmp::Reverse(next),
            *epoch,
            key.is_none(),
            key.as_deref().unwrap_or(""),
            position,
        )
    }
}

/// `ScheduleAware::key`'s tuple.
type ScheduleKey<'a> = (i64, std::cmp::Reverse<u64>, i64, bool, &'a str, usize);

impl SearchPolicy for ScheduleAware {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        let mut order: Vec<usize> = (0..candidates.len()).collect();
        order.sort_by_cached_key(|&index| self.key(candidates[index].value));
        Ok(order)
    }

    fn fallback_locations(&mut self, location: Location) -> Result<Vec<Location>, SearchError> {
        self.lru.fallback_locations(location)
    }
}

/// One resident in the schedule-aware order: [`ScheduleAware::key`], field for field.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct ScheduleEntry {
    priority: i64,
    next: std::cmp::Reverse<u64>,
    epoch: i64,
    unkeyed: bool,
    key: Option<Arc<str>>,
    position: usize,
}

impl ScheduleEntry {
    fn new(keys: &LruKeys, next: Option<u64>, position: usize) -> Self {
        let (priority, epoch, key) = keys;
        Self {
            priority: *priority,
            next: std::cmp::Reverse(next.unwrap_or(u64::MAX)),
            epoch: *epoch,
            unkeyed: key.is_none(),
            key: key.clone(),
            position,
        }
    }

    fn of(keys: &PolicyKeyMap, uses: &NextUses, position: usize) -> Self {
        Self::new(
            keys.get(&position).unwrap_or(&PLAIN_KEYS),
            uses.get(position),
            position,
        )
    }
}

impl Positioned for ScheduleEntry {
    fn position(&self) -> usize {
        self.position
    }
}

/// The schedule-aware policy's order of each location's residents, kept incrementally
/// by the controller with its keys: standing at another step moves only the values
/// requested between the two steps ([`ScheduleOrder::stand_at`]), a key change moves
/// the value ([`ScheduleOrder::rekey`]), and residents are synced as the tiered LRU's
/// are ([`VictimOrder`]).
#[derive(Debug, Clone, Default)]
pub struct ScheduleOrder {
    /// The schedule and step the order stands at.
    uses: Option<NextUses>,
    order: Ordered<ScheduleEntry>,
}

impl ScheduleOrder {
    /// Stands at `uses`' schedule and step, with `keys`: from the same schedule, the
    /// values requested between the two steps move; from another, the order starts
    /// again from nothing.
    pub fn stand_at(&mut self, keys: &PolicyKeyMap, uses: &NextUses) {
        match self.uses.take() {
            Some(current) if current.same_schedule(uses) => {
                for position in current.moved(uses) {
                    self.order.rekey(
                        position,
                        &ScheduleEntry::of(keys, &current, position),
                        &ScheduleEntry::of(keys, uses, position),
                    );
                }
            }
            _ => self.order.clear(),
        }
        self.uses = Some(uses.clone());
    }

    /// The value at `position` changed its keys from `old` to `new`.
    pub fn rekey(&mut self, position: usize, old: &LruKeys, new: &LruKeys) {
        if let Some(uses) = &self.uses {
            let next = uses.get(position);
            self.order.rekey(
                position,
                &ScheduleEntry::new(old, next, position),
                &ScheduleEntry::new(new, next, position),
            );
        }
    }

    /// Forgets everything: the next decide starts from nothing.
    pub fn clear(&mut self) {
        self.uses = None;
        self.order.clear();
    }

    /// The residents of `location` in order (tests compare it with a sort).
    pub fn ordered(&self, location: Location) -> Vec<usize> {
        self.order.ordered(location)
    }
}

/// The schedule-aware policy walking the order the controller keeps
/// ([`ScheduleOrder`], standing at this policy's step, with the same keys).
#[allow(missing_debug_implementations)]
pub struct IndexedSchedule<'a> {
    pub policy: ScheduleAware,
    pub order: &'a mut ScheduleOrder,
}

impl SearchPolicy for IndexedSchedule<'_> {
    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<usize>, SearchError> {
        self.policy.order(candidates)
    }

    fn fallback_locations(&mut self, location: Location) -> Result<Vec<Location>, SearchError> {
        self.policy.fallback_locations(location)
    }

    fn sync_residents(
        &mut self,
        location: Location,
        residents: Option<&ResidentSet>,
    ) -> Option<usize> {
        let keys = &self.policy.lru.keys;
        let uses = &self.policy.next_use;
        self.order.stand_at(keys, uses);
        self.order.order.sync(location, residents, |position| {
            ScheduleEntry::of(keys, uses, position)
        });
        Some(self.order.order.count(location))
    }

    fn next_resident(&self, location: Location, after: Option<usize>) -> Option<usize> {
        let after = after.map(|position| {
            ScheduleEntry::of(&self.policy.lru.keys, &self.policy.next_use, position)
        });
        self.order.order.next(location, after.as_ref())
    }

    fn compare(&self, left: usize, right: usize) -> std::cmp::Ordering {
        self.policy.key(left).cmp(&self.policy.key(right))
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
struct Books {
    location: Location,
    used: u64,
    reserved: u64,
}

/// A location's budget and books, for a failure's explanation.
#[derive(Debug, Clone, Copy)]
struct Figures {
    budget: u64,
    used: u64,
    reserved: u64,
}

/// Why values at a location could not make room, for the remedies a failure names.
#[allow(clippy::struct_excessive_bools)] // One flag per remedy.
#[derive(Debug, Default)]
struct Reasons {
    leased: bool,
    held: bool,
    in_flight: bool,
    required: bool,
    sole: bool,
}

/// An append-only persistent list: a state's reclaim history shares its ancestors' and
/// adds one node per step, so a path of `n` states holds `n` nodes (a chunked
/// persistent vector would copy its last chunk, dozens of entries, at every step).
#[derive(Debug)]
struct Trail<T> {
    last: Option<Arc<TrailNode<T>>>,
}

#[derive(Debug)]
struct TrailNode<T> {
    item: T,
    previous: Option<Arc<TrailNode<T>>>,
}

impl<T> Default for Trail<T> {
    fn default() -> Self {
        Self { last: None }
    }
}

impl<T> Clone for Trail<T> {
    fn clone(&self) -> Self {
        Self {
            last: self.last.clone(),
        }
    }
}

impl<T> Trail<T> {
    fn push(&mut self, item: T) {
        let previous = self.last.take();
        self.last = Some(Arc::new(TrailNode { item, previous }));
    }

    /// The items, last first.
    fn iter_back(&self) -> impl Iterator<Item = &T> {
        let mut node = self.last.as_deref();
        std::iter::from_fn(move || {
            let current = node?;
            node = current.previous.as_deref();
            Some(&current.item)
        })
    }

    /// The items, first first.
    fn to_vec(&self) -> Vec<T>
    where
        T: Clone,
    {
        let mut items: Vec<T> = self.iter_back().cloned().collect();
        items.reverse();
        items
    }
}

impl<T> Drop for Trail<T> {
    fn drop(&mut self) {
        // Unlinked one node at a time: dropping a long trail recursively would take one
        // stack frame per node.
        let mut next = self.last.take();
        while let Some(node) = next {
            match Arc::try_unwrap(node) {
                Ok(mut node) => next = node.previous.take(),
                Err(_) => break,
            }
        }
    }
}

/// A branch's list of blocked values or of active reclaims: the index of its last link
/// in the path's arena ([`Links`]), or `None` for the empty list.
type Link = Option<usize>;

/// The links of the lists of values blocked and reclaims active in the branches open on
/// the path. A reclaim frame appends its links when it starts its moves, and its removal
/// truncates them, so a branch's list costs one link per level and shares the rest.
#[derive(Debug, Default)]
struct Links {
    blocked: Vec<(usize, Link)>,
    active: Vec<((usize, Location), Link)>,
}

impl Links {
    fn blocked(&self, mut link: Link) -> impl Iterator<Item = usize> + '_ {
        std::iter::from_fn(move || {
            let &(item, rest) = self.blocked.get(link?)?;
            link = rest;
            Some(item)
        })
    }

    fn active(&self, mut link: Link) -> impl Iterator<Item = (usize, Location)> + '_ {
        std::iter::from_fn(move || {
            let &(item, rest) = self.active.get(link?)?;
            link = rest;
            Some(item)
        })
    }

    fn is_blocked(&self, link: Link, value: usize) -> bool {
        self.blocked(link).any(|known| known == value)
    }

    fn is_active(&self, link: Link, item: (usize, Location)) -> bool {
        self.active(link).any(|known| known == item)
    }
}

/// One planning state: the initial values plus an overlay of changed ones.
#[derive(Debug, Clone)]
struct State {
    changed: Overlay<Arc<[MatInfo]>>,
    /// Sorted by location (canonical order).
    books: Vec<Books>,
    /// The reclaim steps so far, each with its action (the plan's reclaim list).
    evictions: Trail<Eviction>,
    /// Where the last failed simulation of an ancestor stopped, so a descendant whose
    /// reclaims cannot have changed the simulated prefix resumes there (not part of
    /// the memo signature).
    resume: Option<Arc<Resume>>,
    /// The least first requirement index (`Search::first_required`) of the values whose
    /// materialisations changed since `resume` was recorded (`usize::MAX` for none).
    touched: usize,
}

/// A simulation prefix that succeeded before a capacity failure at `index`.
#[derive(Debug)]
struct Resume {
    /// The requirement that failed.
    index: usize,
    /// Books before that requirement, then (from `split`) the books of the simulated
    /// state, to carry a descendant's reclaims over: one allocation for both.
    books: Box<[Books]>,
    split: usize,
    /// What the prefix projected: shared with the descendants whose own resumed
    /// simulation fails at the same requirement, as a path of evictions does until
    /// enough is free.
    prefix: Arc<Prefix>,
    /// Locations whose capacity the prefix checked. A reclaim that raises the charge
    /// at such a location, or touches a value the prefix read (the values of the
    /// requirements before `index`, `Search::first_required`), could change the
    /// prefix, and then the request is simulated from the start.
    locations: LocationSet,
}

impl Resume {
    /// Books before the failed requirement.
    fn before(&self) -> &[Books] {
        self.books.get(..self.split).unwrap_or_default()
    }

    /// The books of the simulated state.
    fn base_books(&self) -> &[Books] {
        self.books.get(self.split..).unwrap_or_default()
    }
}

/// The materialisations and actions of a simulated prefix.
#[derive(Debug)]
struct Prefix {
    mats: Vec<(usize, Arc<[MatInfo]>)>,
    actions: Vec<Planned>,
}

/// A capacity failure in `simulate`.
#[derive(Debug, Clone, Copy)]
struct Capacity {
    location: Location,
    nbytes: u64,
    stage: &'static str,
}

enum SimError {
    Capacity(Capacity),
    Unavailable(usize),
}

/// Candidates at one location in the policy's order: listed when the search first
/// reclaims there, or walked in the policy's own order of the residents there.
#[derive(Debug)]
enum Candidates {
    Listed(std::vec::IntoIter<Candidate>),
    Walked(Box<Walk>),
}

/// A walk of the candidates at `location` in a policy's incremental order
/// ([`SearchPolicy::next_resident`]): the initial residents the state did not change,
/// merged with those it changed (`changed`, in the policy's order), then the
/// required endpoints (`required`), as [`Search::ordered_candidates`] would list them.
#[derive(Debug)]
struct Walk {
    location: Location,
    blocked: Link,
    /// The last initial resident walked past, and how many are left to walk (the walk
    /// of them ends there, whatever the policy's order says).
    cursor: Option<usize>,
    left: usize,
    /// The next initial resident that is a candidate, found and not yet yielded.
    peeked: Option<Candidate>,
    changed: std::iter::Peekable<std::vec::IntoIter<Candidate>>,
    required: std::vec::IntoIter<Candidate>,
}

/// A found plan: the state whose request simulation succeeded, and the actions it
/// projected.
type Found = (State, Vec<Planned>);

/// The depth-first path, as an explicit stack of frames (docs/concepts/controller.md#search):
/// each frame is one of the documented generators, suspended where it yielded or called
/// the next one, so a level of the path costs its frames and no native stack.
#[derive(Debug, Default)]
struct Path {
    frames: Vec<Frame>,
    links: Links,
}

#[derive(Debug)]
enum Frame {
    /// A counted request state (steps 3 to 5).
    Request(Box<RequestFrame>),
    /// The reclaim options of one candidate.
    Reclaim(ReclaimFrame),
    /// A counted search for capacity at a tier.
    Capacity(Box<CapacityFrame>),
}

impl Frame {
    fn state(&self) -> Option<&State> {
        match self {
            Self::Request(frame) => Some(&frame.state),
            Self::Capacity(frame) => Some(&frame.state),
            Self::Reclaim(_) => None,
        }
    }

    /// For the owner of a reclaim frame at `at` (this frame, just below it): its lists of
    /// blocked values and active reclaims, and where the reclaimed states go.
    fn branch(&self, at: usize) -> (Link, Link, Visit) {
        match self {
            Self::Capacity(frame) => (frame.blocked, frame.active, Visit::Capacity(at - 1)),
            Self::Request(_) | Self::Reclaim(_) => (None, None, Visit::Request(at - 1)),
        }
    }
}

/// Where a frame's yielded states go: the visitor the documented generator was given,
/// naming the frame (by its index on the path) that it belongs to.
#[derive(Debug, Clone, Copy)]
enum Visit {
    /// Search it as a request state; an exhausted one adds its failure to the notes of
    /// that request frame.
    Request(usize),
    /// Complete that reclaim frame's current move, then go on to its visitor.
    Move(usize),
    /// Search for capacity again from it, for that capacity frame.
    Capacity(usize),
    /// That capacity frame found room: mark it as having yielded, then go on to its
    /// visitor.
    Reached(usize),
}

#[derive(Debug)]
struct RequestFrame {
    /// The state, with where a descendant may resume its simulation.
    state: State,
    capacity: Capacity,
    candidates: Candidates,
    next_rank: usize,
    notes: Notes,
    /// The request frame whose notes get this one's failure (none at the root).
    parent: Option<usize>,
}

/// The reclaim options of a candidate of the frame just below (its owner), whose state,
/// lists of blocked values and active reclaims, and visitor it uses.
#[derive(Debug)]
struct ReclaimFrame {
    candidate: Candidate,
    rank: usize,
    phase: ReclaimPhase,
}

#[derive(Debug)]
enum ReclaimPhase {
    Start,
    /// The drop was yielded; with another materialisation no move is tried.
    Dropped {
        alternatives: bool,
    },
    /// Moving a sole copy: the destinations, the next one to try, and the lengths of
    /// the arenas of links before the candidate was linked into the branch's lists.
    Moves {
        destinations: Box<[Location]>,
        next: usize,
        marks: (usize, usize),
    },
}

#[derive(Debug)]
struct CapacityFrame {
    state: State,
    destination: Location,
    additional: u64,
    blocked: Link,
    active: Link,
    candidates: Candidates,
    next_rank: usize,
    yielded: bool,
    visit: Visit,
}

type Signature = (Vec<(usize, Vec<Location>)>, Vec<Books>);

/// A resumed simulation: trial state, actions so far, the index to continue at, and
/// the locations checked so far.
type Resumed = (State, Vec<Planned>, usize, LocationSet);

/// A failed simulation: why, and where a descendant may resume it.
type SimFailure = (SimError, Option<Arc<Resume>>);

/// `capacity_states` memo key: signature, destination, additional bytes, blocked
/// registration indices, active `(registration index, location)` pairs.
type CapacityKey = (Signature, Location, u64, Vec<u32>, Vec<(u32, Location)>);

#[allow(missing_debug_implementations)] // Borrows the policy, which need not be Debug.
pub struct Search<'a, P: SearchPolicy, V: ValueTable = SearchValues> {
    values: &'a V,
    budgets: &'a BTreeMap<Location, u64>,
    requirements: &'a [Requirement],
    /// The required `(value, location)` pairs, and each required value's first
    /// requirement index (a simulation that stopped at requirement `i` read exactly the
    /// values whose first index is below `i`): indexed only for a long list of
    /// requirements; a short one is scanned ([`Self::is_required`], [`Self::first_required`]).
    indexed: Option<Box<RequiredIndex>>,
    reservations: &'a [(Location, u64)],
    policy: &'a mut P,
    limit: u64,
    explored: u64,
    failed_requests: FastSet<Signature>,
    failed_capacities: FastSet<CapacityKey>,
    /// Counted states open on the depth-first path, and their bound.
    depth: u64,
    max_depth: u64,
    /// The memo's cost so far ([`Self::memo_cost`]), and its budget.
    memo_bytes: u64,
    memo_budget: u64,
    /// Search steps taken, for the interrupt polls.
    steps: u64,
}

thread_local! {
    /// A buffer for a value's materialisations while one is added or removed, reused
    /// by every search on this thread (a search would otherwise allocate one).
    static MATS_SCRATCH: Cell<Vec<MatInfo>> = const { Cell::new(Vec::new()) };
}

/// The prefix of a simulation that failed at its first requirement, shared by every
/// search.
static EMPTY_PREFIX: LazyLock<Arc<Prefix>> = LazyLock::new(|| {
    Arc::new(Prefix {
        mats: Vec::new(),
        actions: Vec::new(),
    })
});

/// Whether `order` names each of `0..order.len()` exactly once (up to 64 marked in a
/// word, more in a vector).
fn is_permutation(order: &[usize]) -> bool {
    let count = order.len();
    if count <= 64 {
        let mut seen = 0u64;
        order.iter().all(|&index| {
            let bit = 1u64.checked_shl(u32::try_from(index).unwrap_or(u32::MAX));
            match bit {
                Some(bit) if index < count && seen & bit == 0 => {
                    seen |= bit;
                    true
                }
                _ => false,
            }
        })
    } else {
        let mut seen = vec![false; count];
        order
            .iter()
            .all(|&index| index < count && !std::mem::replace(&mut seen[index], true))
    }
}

/// The books of a resumed simulation: per location any of the three lists names, in
/// canonical order, the books `before` the failed requirement plus the descendant's
/// `books` less the `base` books of the simulated state, clamped at zero. Each list is
/// sorted by location; a location `before` names twice counts its last entry, one the
/// others name twice counts every entry.
fn carried_books(before: &[Books], books: &[Books], base: &[Books]) -> Vec<Books> {
    let mut union = LocationSet::default();
    for entry in before.iter().chain(books).chain(base) {
        union.insert(entry.location);
    }
    let amounts = |books: &[Books], location: Location| {
        books
            .iter()
            .filter(|entry| entry.location == location)
            .fold((0i128, 0i128), |(used, reserved), entry| {
                (
                    used + i128::from(entry.used),
                    reserved + i128::from(entry.reserved),
                )
            })
    };
    let clamp = |amount: i128| u64::try_from(amount.max(0)).unwrap_or(u64::MAX);
    let mut carried = Vec::with_capacity(union.len() as usize);
    for location in union.iter() {
        let (prefix_used, prefix_reserved) = before
            .iter()
            .rfind(|entry| entry.location == location)
            .map_or((0, 0), |entry| {
                (i128::from(entry.used), i128::from(entry.reserved))
            });
        let (used, reserved) = amounts(books, location);
        let (base_used, base_reserved) = amounts(base, location);
        carried.push(Books {
            location,
            used: clamp(prefix_used + used - base_used),
            reserved: clamp(prefix_reserved + reserved - base_reserved),
        });
    }
    carried
}

/// Requirements at or below this many are scanned rather than indexed.
const SCANNED_REQUIREMENTS: usize = 16;

/// The index of a long list of requirements ([`Search::indexed`]).
#[derive(Debug)]
struct RequiredIndex {
    required: FastSet<(usize, Location)>,
    first_required: FastMap<usize, usize>,
}

impl<'a, P: SearchPolicy, V: ValueTable> Search<'a, P, V> {
    pub fn new(
        values: &'a V,
        budgets: &'a BTreeMap<Location, u64>,
        requirements: &'a [Requirement],
        reservations: &'a [(Location, u64)],
        policy: &'a mut P,
        limit: u64,
    ) -> Self {
        Self {
            values,
            budgets,
            requirements,
            indexed: (requirements.len() > SCANNED_REQUIREMENTS).then(|| {
                let mut first_required = FastMap::default();
                for (index, requirement) in requirements.iter().enumerate() {
                    first_required.entry(requirement.value).or_insert(index);
                }
                Box::new(RequiredIndex {
                    required: requirements
                        .iter()
                        .map(|requirement| (requirement.value, requirement.location))
                        .collect(),
                    first_required,
                })
            }),
            reservations,
            policy,
            limit,
            explored: 0,
            failed_requests: FastSet::default(),
            failed_capacities: FastSet::default(),
            depth: 0,
            max_depth: MAX_SEARCH_DEPTH,
            memo_bytes: 0,
            memo_budget: MEMO_BUDGET_BYTES,
            steps: 0,
        }
    }

    /// Whether `(value, location)` is required.
    fn is_required(&self, value: usize, location: Location) -> bool {
        match &self.indexed {
            Some(index) => index.required.contains(&(value, location)),
            None => self
                .requirements
                .iter()
                .any(|requirement| requirement.value == value && requirement.location == location),
        }
    }

    /// The index of a value's first requirement, if it is required.
    fn first_required(&self, value: usize) -> Option<usize> {
        match &self.indexed {
            Some(index) => index.first_required.get(&value).copied(),
            None => self
                .requirements
                .iter()
                .position(|requirement| requirement.value == value),
        }
    }

    /// The same search under other depth and memo bounds than [`MAX_SEARCH_DEPTH`] and
    /// [`MEMO_BUDGET_BYTES`] (tests reach them with small ones).
    #[must_use]
    pub fn with_bounds(mut self, max_depth: u64, memo_budget: u64) -> Self {
        self.max_depth = max_depth;
        self.memo_budget = memo_budget;
        self
    }

    /// Runs the search from the initial books.
    pub fn run(mut self, books: &[(Location, u64, u64)]) -> Result<SearchOutcome, SearchError> {
        let mut initial: Vec<Books> = books
            .iter()
            .map(|&(location, used, reserved)| Books {
                location,
                used,
                reserved,
            })
            .collect();
        initial.sort();
        let state = State {
            changed: Overlay::default(),
            books: initial,
            evictions: Trail::default(),
            resume: None,
            touched: usize::MAX,
        };
        let (state, enter) = self.search(state)?;
        let evictions = state.evictions.to_vec();
        Ok(SearchOutcome {
            reclaim: evictions.iter().map(|eviction| eviction.action).collect(),
            enter,
            evictions,
            explored: self.explored,
        })
    }

    // ----- state access -----------------------------------------------------------

    /// The value at `position` (one the table lacks reads as absent).
    fn value(&self, position: usize) -> SearchValue {
        self.values
            .value(position)
            .unwrap_or_else(|| absent(position))
    }

    /// Appends a value's materialisations in `state`, in canonical order, to `out`.
    fn extend_mats(&self, state: &State, value: usize, out: &mut Vec<MatInfo>) {
        match state.changed.get(value) {
            Some(mats) => out.extend_from_slice(mats),
            None => self.values.extend_mats(value, out),
        }
    }

    /// How many materialisations a value has in `state`.
    fn mat_count(&self, state: &State, value: usize) -> usize {
        match state.changed.get(value) {
            Some(mats) => mats.len(),
            None => self.values.mat_count(value),
        }
    }

    /// A value's first materialisation in canonical order in `state`.
    fn first_mat(&self, state: &State, value: usize) -> Option<MatInfo> {
        match state.changed.get(value) {
            Some(mats) => mats.first().copied(),
            None => self.values.first_mat(value),
        }
    }

    fn mat_at(&self, state: &State, value: usize, location: Location) -> Option<MatInfo> {
        match state.changed.get(value) {
            Some(mats) => mats.iter().find(|mat| mat.location == location).copied(),
            None => self.values.mat_at(value, location),
        }
    }

    /// The values materialised at `location` in `state`, ascending: those the initial
    /// state holds there and those the state changed, read only where they are.
    fn residents(&self, state: &State, location: Location) -> Vec<usize> {
        let mut positions = self.values.residents(location);
        let initial = positions.len();
        positions.extend(
            state
                .changed
                .iter()
                .filter(|(_, mats)| mats.iter().any(|mat| mat.location == location))
                .map(|(value, _)| value),
        );
        if positions.len() > initial {
            positions.sort_unstable();
            positions.dedup();
        }
        positions
    }

    fn set_mats(&self, state: &mut State, value: usize, mats: &[MatInfo]) {
        state.changed.insert(value, Arc::from(mats));
        if let Some(first) = self.first_required(value) {
            state.touched = state.touched.min(first);
        }
    }

    /// Edits a value's materialisations in `state` in the reused buffer, then sets them.
    fn edit_mats(&self, state: &mut State, value: usize, edit: impl FnOnce(&mut Vec<MatInfo>)) {
        let mut mats = MATS_SCRATCH.take();
        mats.clear();
        self.extend_mats(state, value, &mut mats);
        edit(&mut mats);
        self.set_mats(state, value, &mats);
        MATS_SCRATCH.set(mats);
    }

    fn add_mat(&self, state: &mut State, value: usize, mat: MatInfo) {
        self.edit_mats(state, value, |mats| {
            let position = mats.partition_point(|known| known.location < mat.location);
            mats.insert(position, mat);
        });
    }

    fn remove_mat(&self, state: &mut State, value: usize, location: Location) {
        self.edit_mats(state, value, |mats| {
            mats.retain(|mat| mat.location != location);
        });
    }

    fn books_mut(state: &mut State, location: Location) -> &mut Books {
        let position = match state
            .books
            .binary_search_by(|books| books.location.cmp(&location))
        {
            Ok(position) => position,
            Err(position) => {
                state.books.insert(
                    position,
                    Books {
                        location,
                        used: 0,
                        reserved: 0,
                    },
                );
                position
            }
        };
        &mut state.books[position]
    }

    fn books(state: &State, location: Location) -> (u64, u64) {
        state
            .books
            .iter()
            .find(|books| books.location == location)
            .map_or((0, 0), |books| (books.used, books.reserved))
    }

    fn fits(&self, state: &State, location: Location, additional: u64) -> bool {
        let (used, reserved) = Self::books(state, location);
        self.budgets.get(&location).is_none_or(|&budget| {
            u128::from(used) + u128::from(reserved) + u128::from(additional) <= u128::from(budget)
        })
    }

    #[inline(never)] // Kept out of the search loop.
    fn signature(&self, state: &State) -> Signature {
        let mut values: Vec<(usize, Vec<Location>)> = state
            .changed
            .iter()
            .filter_map(|(value, mats)| {
                let now: Vec<Location> = mats.iter().map(|mat| mat.location).collect();
                (!self.values.mats_at(value, &now)).then_some((value, now))
            })
            .collect();
        values.sort_unstable();
        (values, state.books.clone())
    }

    /// Takes the count of a state (docs/concepts/controller.md#state-counter), after
    /// checking the state limit and then the depth bound.
    fn count(&mut self) -> Result<(), SearchError> {
        if self.explored >= self.limit {
            return Err(SearchError::Limit {
                explored: self.explored,
                bound: SearchBound::States,
                detail: format!(
                    "the search explored {} states without a verdict",
                    self.explored
                ),
            });
        }
        if self.depth >= self.max_depth {
            return Err(SearchError::Limit {
                explored: self.explored,
                bound: SearchBound::Depth,
                detail: format!(
                    "the search path reached its depth bound of {} nested states",
                    self.max_depth
                ),
            });
        }
        self.explored += 1;
        Ok(())
    }

    /// One search step: every so many, the policy checks for an interrupt (Ctrl-C).
    fn step(&mut self) -> Result<(), SearchError> {
        self.steps += 1;
        if self.steps % INTERRUPT_PERIOD == 0 {
            self.policy.check_interrupt()?;
        }
        Ok(())
    }

    /// What remembering a failure costs against the memo's budget: a fixed
    /// [`MEMO_ENTRY_BYTES`] plus the sizes of its signature's elements (per changed
    /// value its position, list and locations; per location its books) and `extra`
    /// (a capacity key's blocked and active lists).
    fn memo_cost(signature: &Signature, extra: usize) -> u64 {
        let (values, books) = signature;
        let locations: usize = values.iter().map(|(_, locations)| locations.len()).sum();
        let bytes = MEMO_ENTRY_BYTES
            + values.len() * size_of::<(usize, Vec<Location>)>()
            + locations * size_of::<Location>()
            + books.len() * size_of::<Books>()
            + extra;
        u64::try_from(bytes).unwrap_or(u64::MAX)
    }

    /// Charges `cost` to the memo's budget, or ends the search at its memory bound.
    fn charge_memo(&mut self, cost: u64) -> Result<(), SearchError> {
        let total = self.memo_bytes.saturating_add(cost);
        if total > self.memo_budget {
            return Err(SearchError::Limit {
                explored: self.explored,
                bound: SearchBound::Memory,
                detail: format!(
                    "the search's memo of exhausted states reached its budget of {} bytes",
                    self.memo_budget
                ),
            });
        }
        self.memo_bytes = total;
        Ok(())
    }

    // ----- request simulation (docs/concepts/controller.md#request-simulation) -----

    /// Where a descendant of a failed simulation can resume it, if its reclaims left
    /// the simulated prefix unchanged: the trial state, emitted actions and index.
    fn resumed(state: &State) -> Option<Resumed> {
        let resume = state.resume.as_ref()?;
        if state.touched < resume.index {
            return None;
        }
        let total = |books: &[Books], location: Location| {
            books
                .iter()
                .find(|entry| entry.location == location)
                .map_or(0u128, |entry| {
                    u128::from(entry.used) + u128::from(entry.reserved)
                })
        };
        if resume
            .locations
            .iter()
            .any(|location| total(&state.books, location) > total(resume.base_books(), location))
        {
            return None;
        }
        // Carry the descendant's reclaims (differences from the simulated state) over
        // the books the prefix left.
        let books = carried_books(resume.before(), &state.books, resume.base_books());
        let mut trial = State {
            changed: state.changed.clone(),
            books,
            evictions: state.evictions.clone(),
            resume: state.resume.clone(),
            touched: state.touched,
        };
        for (value, mats) in &resume.prefix.mats {
            trial.changed.insert(*value, Arc::clone(mats));
        }
        Some((
            trial,
            resume.prefix.actions.clone(),
            resume.index,
            resume.locations,
        ))
    }

    #[allow(clippy::too_many_lines)] // The request simulation, step by step, in one place.
    #[inline(never)] // Kept out of the search loop.
    fn simulate(&self, state: &State) -> Result<Vec<Planned>, SimFailure> {
        let mut shared: Option<Arc<Prefix>> = None;
        let (mut trial, mut actions, start, mut locations) =
            if let Some(resumed) = Self::resumed(state) {
                shared = state
                    .resume
                    .as_ref()
                    .map(|resume| Arc::clone(&resume.prefix));
                let (trial, actions, start, locations) = resumed;
                (Cow::Owned(trial), actions, start, locations)
            } else {
                // Copied at its first change: a simulation that fails at its first
                // requirement, or fits it as its last, changes nothing.
                let mut trial = Cow::Borrowed(state);
                let mut locations = LocationSet::default();
                for &(location, nbytes) in self.reservations {
                    if !self.fits(&trial, location, nbytes) {
                        return Err((
                            SimError::Capacity(Capacity {
                                location,
                                nbytes,
                                stage: "reservation",
                            }),
                            None,
                        ));
                    }
                    locations.insert(location);
                    let books = Self::books_mut(trial.to_mut(), location);
                    books.reserved = books.reserved.saturating_add(nbytes);
                }
                (trial, Vec::new(), 0, locations)
            };
        for (index, requirement) in self.requirements.iter().enumerate().skip(start) {
            let (value, destination) = (requirement.value, requirement.location);
            // The books before this requirement: the trial's own until a temporary
            // source's reservation changes them (copied only then).
            let mut saved: Option<Vec<Books>> = None;
            let failed = |capacity: Capacity,
                          before: &[Books],
                          trial: &State,
                          actions: &Vec<Planned>,
                          locations: &LocationSet| {
                let prefix = match &shared {
                    // Resumed and stopped where it resumed: the same prefix.
                    Some(prefix) if index == start => Arc::clone(prefix),
                    _ => {
                        // The prefix's values, each once (at its first requirement).
                        let mats: Vec<(usize, Arc<[MatInfo]>)> = self.requirements[..index]
                            .iter()
                            .enumerate()
                            .filter(|&(at, read)| self.first_required(read.value) == Some(at))
                            .filter_map(|(_, read)| {
                                trial
                                    .changed
                                    .get(read.value)
                                    .map(|mats| (read.value, Arc::clone(mats)))
                            })
                            .collect();
                        if mats.is_empty() && actions.is_empty() {
                            Arc::clone(&EMPTY_PREFIX)
                        } else {
                            Arc::new(Prefix {
                                mats,
                                actions: actions.clone(),
                            })
                        }
                    }
                };
                (
                    SimError::Capacity(capacity),
                    Some(Arc::new(Resume {
                        index,
                        books: before.iter().chain(&state.books).copied().collect(),
                        split: before.len(),
                        prefix,
                        locations: *locations,
                    })),
                )
            };
            if self.mat_at(&trial, value, destination).is_some() {
                continue;
            }
            let info = self.value(value);
            let charge = info.charge;
            let source_mat = self.first_mat(&trial, value);
            let (source, temporary) = match source_mat {
                Some(mat) => (mat.location, false),
                None => match info.source {
                    Some(location) => (location, true),
                    None => return Err((SimError::Unavailable(value), None)),
                },
            };
            if temporary {
                if !self.fits(&trial, source, charge) {
                    return Err(failed(
                        Capacity {
                            location: source,
                            nbytes: charge,
                            stage: "source reconstruction",
                        },
                        &trial.books,
                        &trial,
                        &actions,
                        &locations,
                    ));
                }
                saved = Some(trial.books.clone());
                let books = Self::books_mut(trial.to_mut(), source);
                books.reserved = books.reserved.saturating_add(charge);
                if source == destination {
                    books.reserved = books.reserved.saturating_sub(charge);
                }
            }
            if !self.fits(&trial, destination, charge) {
                return Err(failed(
                    Capacity {
                        location: destination,
                        nbytes: charge,
                        stage: "materialization",
                    },
                    saved.as_deref().unwrap_or(&trial.books),
                    &trial,
                    &actions,
                    &locations,
                ));
            }
            let planned = if info.exclusive {
                Planned::Move {
                    value,
                    to: destination,
                    from: if temporary { None } else { Some(source) },
                }
            } else {
                Planned::Ensure {
                    value,
                    location: destination,
                }
            };
            if index + 1 == self.requirements.len() {
                // The last requirement fits: nothing reads the trial state after it.
                actions.push(planned);
                break;
            }
            locations.insert(destination);
            if temporary {
                locations.insert(source);
            }
            let books = Self::books_mut(trial.to_mut(), destination);
            books.used = books.used.saturating_add(charge);
            let projected = match source_mat {
                Some(mat) => MatInfo {
                    location: destination,
                    ..mat
                },
                None => MatInfo {
                    location: destination,
                    charged: charge,
                    use_count: 0,
                    hold_count: 0,
                    pending_count: 0,
                },
            };
            self.add_mat(trial.to_mut(), value, projected);
            if temporary && source != destination {
                let books = Self::books_mut(trial.to_mut(), source);
                books.reserved = books.reserved.saturating_sub(charge);
            }
            if info.exclusive && !temporary {
                self.remove_mat(trial.to_mut(), value, source);
                let books = Self::books_mut(trial.to_mut(), source);
                books.used = books.used.saturating_sub(charge);
            }
            actions.push(planned);
        }
        Ok(actions)
    }

    // ----- candidates and ordering (docs/concepts/controller.md#candidates) ---------

    fn candidates(
        &mut self,
        links: &Links,
        state: &State,
        location: Location,
        blocked: Link,
    ) -> Result<Candidates, SearchError> {
        let walked = match self.values.resident_set(location) {
            Some(residents) => self.policy.sync_residents(location, residents),
            None => None,
        };
        let Some(count) = walked else {
            return Ok(Candidates::Listed(
                self.ordered_candidates(links, state, location, blocked)?
                    .into_iter(),
            ));
        };
        // What the state changed, and the required endpoints, are few: listed and
        // ordered here; the initial residents are walked as the search asks.
        let candidate = |value: usize, mat: Option<MatInfo>| {
            mat.filter(MatInfo::unprotected).map(|mat| Candidate {
                value,
                location,
                charged: mat.charged,
            })
        };
        let changed: Vec<Candidate> = state
            .changed
            .iter()
            .filter(|&(value, _)| {
                !links.is_blocked(blocked, value) && !self.is_required(value, location)
            })
            .filter_map(|(value, mats)| {
                candidate(
                    value,
                    mats.iter().find(|mat| mat.location == location).copied(),
                )
            })
            .collect();
        // Each required value once, ascending (a value's candidate depends on it alone).
        let mut required: Vec<Candidate> = self
            .requirements
            .iter()
            .filter(|requirement| requirement.location == location)
            .map(|requirement| requirement.value)
            .filter(|&value| !links.is_blocked(blocked, value))
            .filter_map(|value| candidate(value, self.mat_at(state, value, location)))
            .collect();
        required.sort_unstable_by_key(|candidate| candidate.value);
        required.dedup_by_key(|candidate| candidate.value);
        let changed = self.order(&changed)?;
        let required = self.order(&required)?;
        Ok(Candidates::Walked(Box::new(Walk {
            location,
            blocked,
            cursor: None,
            left: count,
            peeked: None,
            changed: changed.into_iter().peekable(),
            required: required.into_iter(),
        })))
    }

    /// The next candidate of `stream`, a frame's, whose state is `state`.
    fn next_candidate(
        &self,
        links: &Links,
        state: &State,
        stream: &mut Candidates,
    ) -> Option<Candidate> {
        let walk = match stream {
            Candidates::Listed(listed) => return listed.next(),
            Candidates::Walked(walk) => walk,
        };
        let location = walk.location;
        while walk.peeked.is_none() && walk.left > 0 {
            walk.left -= 1;
            let Some(value) = self.policy.next_resident(location, walk.cursor) else {
                walk.left = 0;
                break;
            };
            walk.cursor = Some(value);
            // A value the state changed is among `changed` if it is a candidate.
            if state.changed.get(value).is_some()
                || links.is_blocked(walk.blocked, value)
                || self.is_required(value, location)
            {
                continue;
            }
            walk.peeked = self
                .values
                .mat_at(value, location)
                .filter(MatInfo::unprotected)
                .map(|mat| Candidate {
                    value,
                    location,
                    charged: mat.charged,
                });
        }
        let first_walked = match (walk.peeked, walk.changed.peek()) {
            (Some(walked), Some(changed)) => {
                self.policy.compare(walked.value, changed.value) == std::cmp::Ordering::Less
            }
            (Some(_), None) => true,
            (None, Some(_)) => false,
            (None, None) => return walk.required.next(),
        };
        if first_walked {
            walk.peeked.take()
        } else {
            walk.changed.next()
        }
    }

    /// The unprotected materialisations at `location`, ordinary ones then required
    /// endpoints, each group in the policy's order. Only the values resident there are
    /// read: those the initial state holds at `location` and those the state changed,
    /// in position order, which is the order the policy would see them in over all
    /// values (docs/concepts/controller.md#candidates).
    fn ordered_candidates(
        &mut self,
        links: &Links,
        state: &State,
        location: Location,
        blocked: Link,
    ) -> Result<Vec<Candidate>, SearchError> {
        let mut ordinary = Vec::new();
        let mut required = Vec::new();
        for value in self.residents(state, location) {
            if links.is_blocked(blocked, value) {
                continue;
            }
            if let Some(mat) = self.mat_at(state, value, location)
                && mat.unprotected()
            {
                let candidate = Candidate {
                    value,
                    location,
                    charged: mat.charged,
                };
                if self.is_required(value, location) {
                    required.push(candidate);
                } else {
                    ordinary.push(candidate);
                }
            }
        }
        let mut ordered = self.order(&ordinary)?;
        ordered.extend(self.order(&required)?);
        Ok(ordered)
    }

    fn order(&mut self, candidates: &[Candidate]) -> Result<Vec<Candidate>, SearchError> {
        if candidates.is_empty() {
            return Ok(Vec::new());
        }
        let order = self.policy.order(candidates)?;
        if order.len() != candidates.len() || !is_permutation(&order) {
            return Err(SearchError::BadOrdering {
                detail: format!(
                    "the policy's order_candidates must return each of its {} candidates exactly \
                     once",
                    candidates.len()
                ),
            });
        }
        Ok(order.into_iter().map(|index| candidates[index]).collect())
    }

    // ----- the search (docs/concepts/controller.md#search-steps) --------------------
    //
    // The documented generators (a request search, a candidate's reclaim options, a
    // search for capacity at a tier) run as frames on an explicit stack. The frame on
    // top runs: it calls the next generator by pushing its frame, and yields a state by
    // handing it to its visitor ([`Visit`]), which may push the frame that searches it.
    // Whatever that frame pushes is done when the yielding frame is on top again, and it
    // continues. Only a found plan or an error other than an exhausted request ends a
    // search early, and both end the whole search, so a frame never needs an answer from
    // the frames above it beyond the notes and marks they leave in it.

    /// The documented search from `initial`.
    fn search(&mut self, initial: State) -> Result<Found, SearchError> {
        let mut path = Path::default();
        if let Some(found) = self.enter_request(&mut path, initial, None)? {
            return Ok(found);
        }
        loop {
            let Some(top) = path.frames.len().checked_sub(1) else {
                // The root request frame is removed only when it is exhausted, which
                // returns; the path never empties otherwise.
                return Err(SearchError::Infeasible {
                    detail: "the search path emptied without a verdict".to_owned(),
                });
            };
            let found = match path.frames[top] {
                Frame::Request(_) => self.advance_request(&mut path, top)?,
                Frame::Reclaim(_) => self.advance_reclaim(&mut path, top)?,
                Frame::Capacity(_) => self.advance_capacity(&mut path, top)?,
            };
            if let Some(found) = found {
                return Ok(found);
            }
        }
    }

    /// Steps 1 to 3 for a request state yielded to a [`Visit::Request`] of `parent`
    /// (none at the root): a memo hit is noted there; a counted state that simulates
    /// is the plan; otherwise its frame is pushed.
    fn enter_request(
        &mut self,
        path: &mut Path,
        state: State,
        parent: Option<usize>,
    ) -> Result<Option<Found>, SearchError> {
        self.step()?;
        // No signature to take while no request state failed.
        if !self.failed_requests.is_empty()
            && self.failed_requests.contains(&self.signature(&state))
        {
            let detail = "the equivalent state is already exhausted";
            return match parent {
                Some(parent) => {
                    if let Some(Frame::Request(frame)) = path.frames.get_mut(parent) {
                        frame.notes.add(detail);
                    }
                    Ok(None)
                }
                None => Err(SearchError::Infeasible {
                    detail: detail.to_owned(),
                }),
            };
        }
        self.count()?;
        let (capacity, resume) = match self.simulate(&state) {
            Ok(actions) => return Ok(Some((state, actions))),
            Err((SimError::Unavailable(value), _)) => {
                return Err(SearchError::Unavailable { value });
            }
            Err((SimError::Capacity(capacity), resume)) => (capacity, resume),
        };
        self.depth += 1;
        // Descendants of this state resume the simulation where it failed when their
        // reclaims cannot have changed what came before.
        let state = match resume {
            Some(resume) => State {
                resume: Some(resume),
                touched: usize::MAX,
                ..state
            },
            None => state,
        };
        let candidates = self.candidates(&path.links, &state, capacity.location, None)?;
        path.frames.push(Frame::Request(Box::new(RequestFrame {
            state,
            capacity,
            candidates,
            next_rank: 0,
            notes: Notes::default(),
            parent,
        })));
        Ok(None)
    }

    /// Step 4 of a request frame: its next candidate's reclaim options; or step 5 when
    /// none is left.
    fn advance_request(
        &mut self,
        path: &mut Path,
        top: usize,
    ) -> Result<Option<Found>, SearchError> {
        let Path { frames, links } = path;
        let Some(Frame::Request(frame)) = frames.get_mut(top) else {
            return Ok(None);
        };
        if let Some(candidate) = self.next_candidate(links, &frame.state, &mut frame.candidates) {
            let rank = frame.next_rank;
            frame.next_rank += 1;
            frames.push(Frame::Reclaim(ReclaimFrame {
                candidate,
                rank,
                phase: ReclaimPhase::Start,
            }));
            return Ok(None);
        }
        let key = self.signature(&frame.state);
        self.charge_memo(Self::memo_cost(&key, 0))?;
        self.failed_requests.insert(key);
        let notes = std::mem::take(&mut frame.notes);
        let parent = frame.parent;
        // Only the failure the caller sees explains itself; nested ones stay short.
        let detail = self.exhausted(&frame.state, frame.capacity, notes, parent.is_none());
        frames.pop();
        self.depth -= 1;
        match parent {
            Some(parent) => {
                if let Some(Frame::Request(frame)) = frames.get_mut(parent) {
                    frame.notes.add(&detail);
                }
                Ok(None)
            }
            None => Err(SearchError::Infeasible { detail }),
        }
    }

    /// The detail of an exhausted request search (step 5): the figures as `key=value`
    /// and, with `explain`, in plain words what holds the room and what to do.
    #[inline(never)] // Kept out of the search loop.
    fn exhausted(&self, state: &State, capacity: Capacity, notes: Notes, explain: bool) -> String {
        let (used, reserved) = Self::books(state, capacity.location);
        let budget = self.budgets.get(&capacity.location).copied();
        let budget_text = budget.map_or_else(|| "None".to_owned(), |budget| budget.to_string());
        let (protected_count, protected_bytes) = self
            .residents(state, capacity.location)
            .into_iter()
            .filter_map(|value| self.mat_at(state, value, capacity.location))
            .filter(|mat| !mat.unprotected())
            .fold((0u64, 0u64), |(count, bytes), mat| {
                (count + 1, bytes.saturating_add(mat.charged))
            });
        let explanation = match budget {
            Some(budget) if explain => self.explanation(
                state,
                capacity,
                Figures {
                    budget,
                    used,
                    reserved,
                },
            ),
            _ => String::new(),
        };
        format!(
            "capacity failure at {} for {} bytes ({}): budget={budget_text}, used={used}, \
             reserved={reserved}, protected={protected_count} materialization(s) of \
             {protected_bytes} bytes{explanation}{}",
            capacity.location,
            capacity.nbytes,
            capacity.stage,
            notes.finish()
        )
    }

    /// In plain words, after an exhausted search: how much more room `capacity` needs,
    /// which values hold the room there and why, and what would make room.
    fn explanation(&self, state: &State, capacity: Capacity, figures: Figures) -> String {
        let location = capacity.location;
        let free = figures
            .budget
            .saturating_sub(figures.used)
            .saturating_sub(figures.reserved);
        let what = match capacity.stage {
            "reservation" => "a reservation of",
            "source reconstruction" => "rebuilding a value from its source takes",
            _ => "the value takes",
        };
        let mut text = format!(
            ". At {location}, {what} {}, and {} of its budget of {} is free: ",
            bytes::format_size_exact(capacity.nbytes),
            bytes::format_size_exact(free),
            bytes::format_size_exact(figures.budget),
        );
        if capacity.nbytes > figures.budget {
            text.push_str("more than the whole budget");
        } else {
            let short = capacity.nbytes.saturating_sub(free);
            let _ = write!(text, "{} more is needed", bytes::format_size_exact(short));
        }
        let (occupants, reasons) = self.occupants(state, location);
        text.push_str(&occupants);
        let mut remedies = Vec::new();
        if reasons.leased {
            remedies.push("release the leases (leave their `use` or `acquire` blocks)".to_owned());
        }
        if reasons.held {
            remedies.push("release the holds".to_owned());
        }
        if reasons.in_flight {
            remedies.push(
                "wait for the device work in flight (it is reaped by the next operation)"
                    .to_owned(),
            );
        }
        if figures.reserved > 0 {
            remedies.push(format!("release the reservations at {location}"));
        }
        if reasons.sole {
            remedies.push(format!(
                "give the policy a fallback tier for {location} (DeterministicTieredLRU's tiers)"
            ));
        }
        remedies.push(format!("raise {location}'s budget"));
        remedies.push(if reasons.required {
            format!("require less at once (this request's own values fill {location})")
        } else {
            "require less at once".to_owned()
        });
        let _ = write!(text, ". To make room: {}", remedies.join(", or "));
        text
    }

    /// The values at `location` that could not make room, the first few named with
    /// their sizes and why, and which reasons occurred.
    fn occupants(&self, state: &State, location: Location) -> (String, Reasons) {
        /// Values named at most; the rest are counted.
        const NAMED: usize = 3;
        let mut reasons = Reasons::default();
        let mut named = Vec::new();
        let mut last_why = String::new();
        let (mut others, mut other_bytes) = (0u64, 0u64);
        for value in self.residents(state, location) {
            let Some(mat) = self.mat_at(state, value, location) else {
                continue;
            };
            let mut why = Vec::new();
            if mat.use_count > 0 {
                reasons.leased = true;
                why.push(format!("in use by {} lease token(s)", mat.use_count));
            }
            if mat.hold_count > 0 {
                reasons.held = true;
                why.push(format!("held by {} hold(s)", mat.hold_count));
            }
            if mat.pending_count > 0 {
                reasons.in_flight = true;
                why.push(format!(
                    "still read or copied by {} device operation(s) in flight",
                    mat.pending_count
                ));
            }
            if why.is_empty() && self.is_required(value, location) {
                reasons.required = true;
                why.push("required here by this request".to_owned());
            }
            let info = self.value(value);
            if why.is_empty() && info.source.is_none() && self.mat_count(state, value) == 1 {
                reasons.sole = true;
                why.push(
                    "its only copy, with no source to rebuild it: it can only move, to a \
                     fallback tier with room"
                        .to_owned(),
                );
            }
            if why.is_empty() {
                continue;
            }
            if named.len() < NAMED {
                let name = self
                    .values
                    .handle_name(value)
                    .unwrap_or_else(|| format!("#{}", info.handle));
                let why = why.join(" and ");
                let shown = bytes::format_size(mat.charged);
                named.push(if why == last_why {
                    format!("value {name} ({shown}) likewise")
                } else {
                    format!("value {name} ({shown}) is {why}")
                });
                last_why = why;
            } else {
                others += 1;
                other_bytes = other_bytes.saturating_add(mat.charged);
            }
        }
        let mut text = String::new();
        if !named.is_empty() {
            let _ = write!(text, ". There, {}", named.join("; "));
            if others > 0 {
                let _ = write!(
                    text,
                    "; {others} more value(s) ({}) likewise",
                    bytes::format_size(other_bytes)
                );
            }
        }
        (text, reasons)
    }

    // ----- reclaim options and capacity at a tier (docs/concepts/controller.md#search) --

    /// The next reclaim option of a reclaim frame: the drop, then each move of a sole
    /// copy; the frame is removed when none is left.
    fn advance_reclaim(
        &mut self,
        path: &mut Path,
        top: usize,
    ) -> Result<Option<Found>, SearchError> {
        let Path { frames, links } = &mut *path;
        let (Some(Frame::Reclaim(frame)), Some(owner)) = (
            frames.get(top),
            top.checked_sub(1).and_then(|at| frames.get(at)),
        ) else {
            // A reclaim frame always has its owner below it.
            Self::pop_reclaim(path);
            return Ok(None);
        };
        let candidate = frame.candidate;
        let (value, location) = (candidate.value, candidate.location);
        let (_, active, visit) = owner.branch(top);
        match frame.phase {
            ReclaimPhase::Start => {
                let Some(state) = owner.state() else {
                    Self::pop_reclaim(path);
                    return Ok(None);
                };
                if links.is_active(active, (value, location)) {
                    Self::pop_reclaim(path);
                    return Ok(None);
                }
                let alternatives = self.mat_count(state, value) > 1;
                if !alternatives && self.value(value).source.is_none() {
                    return self.start_moves(path, top);
                }
                let mut trial = state.clone();
                let action = Planned::Drop { value, location };
                trial.evictions.push(Eviction {
                    action,
                    rank: frame.rank,
                    released_location: location,
                    released_nbytes: candidate.charged,
                    reason: if alternatives {
                        EvictionReason::OtherMaterialization
                    } else {
                        EvictionReason::RegisteredSource
                    },
                });
                self.remove_mat(&mut trial, value, location);
                let books = Self::books_mut(&mut trial, location);
                books.used = books.used.saturating_sub(candidate.charged);
                if let Some(Frame::Reclaim(frame)) = frames.get_mut(top) {
                    frame.phase = ReclaimPhase::Dropped { alternatives };
                }
                self.deliver(path, trial, visit)
            }
            ReclaimPhase::Dropped { alternatives: true } => {
                Self::pop_reclaim(path);
                Ok(None)
            }
            ReclaimPhase::Dropped {
                alternatives: false,
            } => self.start_moves(path, top),
            ReclaimPhase::Moves { .. } => self.next_move(path, top),
        }
    }

    /// Lists the move destinations of a sole copy (endpoint restoration, then the
    /// policy's tiers) and links the candidate into the branch's lists.
    fn start_moves(&mut self, path: &mut Path, top: usize) -> Result<Option<Found>, SearchError> {
        let Path { frames, links } = path;
        let Some((blocked, active, _)) = top
            .checked_sub(1)
            .and_then(|at| frames.get(at))
            .map(|owner| owner.branch(top))
        else {
            return Ok(None);
        };
        let Some(Frame::Reclaim(frame)) = frames.get_mut(top) else {
            return Ok(None);
        };
        let (value, location) = (frame.candidate.value, frame.candidate.location);
        let mut destinations: Vec<Location> = self
            .requirements
            .iter()
            .filter(|requirement| requirement.value == value && requirement.location != location)
            .map(|requirement| requirement.location)
            .collect();
        destinations.sort_unstable();
        for fallback in self.policy.fallback_locations(location)? {
            destinations.push(fallback);
        }
        let mut unique: Vec<Location> = Vec::with_capacity(destinations.len());
        for destination in destinations {
            if !unique.contains(&destination) {
                unique.push(destination);
            }
        }
        let marks = (links.blocked.len(), links.active.len());
        if !links.is_blocked(blocked, value) {
            links.blocked.push((value, blocked));
        }
        links.active.push(((value, location), active));
        frame.phase = ReclaimPhase::Moves {
            destinations: unique.into_boxed_slice(),
            next: 0,
            marks,
        };
        Ok(None)
    }

    /// The reclaim frame's next move destination: the states where it has room.
    fn next_move(&mut self, path: &mut Path, top: usize) -> Result<Option<Found>, SearchError> {
        let Some(Frame::Reclaim(frame)) = path.frames.get_mut(top) else {
            return Ok(None);
        };
        let value = frame.candidate.value;
        let ReclaimPhase::Moves {
            destinations,
            next,
            marks,
        } = &mut frame.phase
        else {
            return Ok(None);
        };
        let Some(&destination) = destinations.get(*next) else {
            Self::pop_reclaim(path);
            return Ok(None);
        };
        *next += 1;
        let marks = *marks;
        // The branch's lists with the candidate linked in (when it was not blocked
        // already, the owner's list goes on).
        let Some(owner) = top.checked_sub(1).and_then(|at| path.frames.get(at)) else {
            return Ok(None);
        };
        let blocked = if path.links.blocked.len() > marks.0 {
            Some(marks.0)
        } else {
            owner.branch(top).0
        };
        let active = Some(marks.1);
        let Some(state) = owner.state() else {
            return Ok(None);
        };
        let additional = if self.mat_at(state, value, destination).is_some() {
            0
        } else {
            self.value(value).charge
        };
        let state = state.clone();
        match self.enter_capacity(
            path,
            state,
            destination,
            additional,
            blocked,
            active,
            Visit::Move(top),
        )? {
            Some(fitting) => self.deliver(path, fitting, Visit::Move(top)),
            None => Ok(None),
        }
    }

    /// Removes the reclaim frame on top, and the links it added.
    fn pop_reclaim(path: &mut Path) {
        if let Some(Frame::Reclaim(frame)) = path.frames.pop()
            && let ReclaimPhase::Moves { marks, .. } = frame.phase
        {
            path.links.blocked.truncate(marks.0);
            path.links.active.truncate(marks.1);
        }
    }

    /// Hands `state` to `visit`, through the visitors that only change or mark it, to the
    /// one that searches it (pushing a frame, or noting a memo hit). Returns a found plan.
    fn deliver(
        &mut self,
        path: &mut Path,
        mut state: State,
        mut visit: Visit,
    ) -> Result<Option<Found>, SearchError> {
        loop {
            match visit {
                Visit::Request(parent) => return self.enter_request(path, state, Some(parent)),
                Visit::Move(at) => {
                    let Some(Frame::Reclaim(frame)) = path.frames.get(at) else {
                        return Ok(None);
                    };
                    let ReclaimPhase::Moves {
                        destinations, next, ..
                    } = &frame.phase
                    else {
                        return Ok(None);
                    };
                    let Some(&destination) =
                        next.checked_sub(1).and_then(|at| destinations.get(at))
                    else {
                        return Ok(None);
                    };
                    match self.moved(state, frame.candidate, frame.rank, destination) {
                        Some(trial) => state = trial,
                        None => return Ok(None),
                    }
                    let Some(owner) = at.checked_sub(1).and_then(|below| path.frames.get(below))
                    else {
                        return Ok(None);
                    };
                    visit = owner.branch(at).2;
                }
                Visit::Capacity(at) => {
                    let Some(Frame::Capacity(frame)) = path.frames.get(at) else {
                        return Ok(None);
                    };
                    let (destination, additional, blocked, active) = (
                        frame.destination,
                        frame.additional,
                        frame.blocked,
                        frame.active,
                    );
                    match self.enter_capacity(
                        path,
                        state,
                        destination,
                        additional,
                        blocked,
                        active,
                        Visit::Reached(at),
                    )? {
                        Some(fitting) => {
                            state = fitting;
                            visit = Visit::Reached(at);
                        }
                        None => return Ok(None),
                    }
                }
                Visit::Reached(at) => {
                    let Some(Frame::Capacity(frame)) = path.frames.get_mut(at) else {
                        return Ok(None);
                    };
                    frame.yielded = true;
                    visit = frame.visit;
                }
            }
        }
    }

    /// A move's state: the sole copy of the candidate's value moved from its location to
    /// `destination` in a state where that has room; none if the copy is gone there.
    fn moved(
        &self,
        reached: State,
        candidate: Candidate,
        rank: usize,
        destination: Location,
    ) -> Option<State> {
        let (value, location) = (candidate.value, candidate.location);
        let charge = self.value(value).charge;
        let mut trial = reached;
        let sole = self.mat_at(&trial, value, location)?;
        if self.mat_at(&trial, value, destination).is_none() {
            self.add_mat(
                &mut trial,
                value,
                MatInfo {
                    location: destination,
                    ..sole
                },
            );
            let books = Self::books_mut(&mut trial, destination);
            books.used = books.used.saturating_add(charge);
        }
        let action = Planned::Move {
            value,
            to: destination,
            from: Some(location),
        };
        trial.evictions.push(Eviction {
            action,
            rank,
            released_location: location,
            released_nbytes: candidate.charged,
            reason: EvictionReason::MovedTo(destination),
        });
        self.remove_mat(&mut trial, value, location);
        let books = Self::books_mut(&mut trial, location);
        books.used = books.used.saturating_sub(charge);
        Some(trial)
    }

    /// Steps 1 to 3 of a search for capacity at `destination`: the state itself when it
    /// has room (for the caller to yield), nothing on a memo hit, or else a pushed frame.
    #[allow(clippy::too_many_arguments)] // The documented generator's parameters.
    fn enter_capacity(
        &mut self,
        path: &mut Path,
        state: State,
        destination: Location,
        additional: u64,
        blocked: Link,
        active: Link,
        visit: Visit,
    ) -> Result<Option<State>, SearchError> {
        self.step()?;
        if self.fits(&state, destination, additional) {
            return Ok(Some(state));
        }
        let key = self.capacity_key(
            &path.links,
            &state,
            destination,
            additional,
            blocked,
            active,
        );
        if self.failed_capacities.contains(&key) {
            return Ok(None);
        }
        drop(key);
        self.count()?;
        self.depth += 1;
        let candidates = self.candidates(&path.links, &state, destination, blocked)?;
        path.frames.push(Frame::Capacity(Box::new(CapacityFrame {
            state,
            destination,
            additional,
            blocked,
            active,
            candidates,
            next_rank: 0,
            yielded: false,
            visit,
        })));
        Ok(None)
    }

    /// Step 4 of a capacity frame: its next candidate's reclaim options; or step 5 when
    /// none is left.
    fn advance_capacity(
        &mut self,
        path: &mut Path,
        top: usize,
    ) -> Result<Option<Found>, SearchError> {
        let Path { frames, links } = path;
        let Some(Frame::Capacity(frame)) = frames.get_mut(top) else {
            return Ok(None);
        };
        while let Some(candidate) = self.next_candidate(links, &frame.state, &mut frame.candidates)
        {
            let rank = frame.next_rank;
            frame.next_rank += 1;
            if links.is_active(frame.active, (candidate.value, candidate.location)) {
                continue;
            }
            frames.push(Frame::Reclaim(ReclaimFrame {
                candidate,
                rank,
                phase: ReclaimPhase::Start,
            }));
            return Ok(None);
        }
        let key = (!frame.yielded).then(|| {
            self.capacity_key(
                links,
                &frame.state,
                frame.destination,
                frame.additional,
                frame.blocked,
                frame.active,
            )
        });
        frames.pop();
        self.depth -= 1;
        if let Some(key) = key {
            let extra = key.3.len() * size_of::<u32>() + key.4.len() * size_of::<(u32, Location)>();
            self.charge_memo(Self::memo_cost(&key.0, extra))?;
            self.failed_capacities.insert(key);
        }
        Ok(None)
    }

    /// A capacity search's memo key (docs/concepts/controller.md#capacity-at-a-tier).
    fn capacity_key(
        &self,
        links: &Links,
        state: &State,
        destination: Location,
        additional: u64,
        blocked: Link,
        active: Link,
    ) -> CapacityKey {
        let mut blocked_indices: Vec<u32> = links
            .blocked(blocked)
            .map(|value| self.value(value).registration_index)
            .collect();
        blocked_indices.sort_unstable();
        let mut active_pairs: Vec<(u32, Location)> = links
            .active(active)
            .map(|(value, location)| (self.value(value).registration_index, location))
            .collect();
        active_pairs.sort_unstable();
        (
            self.signature(state),
            destination,
            additional,
            blocked_indices,
            active_pairs,
        )
    }
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use proptest::prelude::*;

    use super::{Books, Location, carried_books, is_permutation};

    /// The resumed books as a map keyed by location builds them: `before` inserted,
    /// then the descendant's books added and the simulated state's taken away.
    fn carried_by_map(before: &[Books], books: &[Books], base: &[Books]) -> Vec<Books> {
        let mut map: BTreeMap<Location, (i128, i128)> = BTreeMap::new();
        for entry in before {
            map.insert(
                entry.location,
                (i128::from(entry.used), i128::from(entry.reserved)),
            );
        }
        for entry in books {
            let slot = map.entry(entry.location).or_insert((0, 0));
            slot.0 += i128::from(entry.used);
            slot.1 += i128::from(entry.reserved);
        }
        for entry in base {
            let slot = map.entry(entry.location).or_insert((0, 0));
            slot.0 -= i128::from(entry.used);
            slot.1 -= i128::from(entry.reserved);
        }
        let clamp = |amount: i128| u64::try_from(amount.max(0)).unwrap_or(u64::MAX);
        map.into_iter()
            .map(|(location, (used, reserved))| Books {
                location,
                used: clamp(used),
                reserved: clamp(reserved),
            })
            .collect()
    }

    fn books() -> impl Strategy<Value = Vec<Books>> {
        let location = prop_oneof![
            Just(Location::PageableHost),
            Just(Location::PinnedHost),
            (0u8..3).prop_map(Location::Cuda),
            (0u8..2).prop_map(Location::Disk),
        ];
        let amount = prop_oneof![0u64..64, Just(u64::MAX), Just(u64::MAX - 1)];
        prop::collection::vec((location, amount.clone(), amount), 0..6).prop_map(|entries| {
            let mut books: Vec<Books> = entries
                .into_iter()
                .map(|(location, used, reserved)| Books {
                    location,
                    used,
                    reserved,
                })
                .collect();
            books.sort();
            books
        })
    }

    proptest! {
        /// The resumed books are the map's, location for location, whatever the lists
        /// hold (repeated locations included).
        #[test]
        fn carried_books_are_the_maps(before in books(), state in books(), base in books()) {
            prop_assert_eq!(
                carried_books(&before, &state, &base),
                carried_by_map(&before, &state, &base)
            );
        }
    }

    #[test]
    fn a_permutation_names_each_index_once() {
        for count in [0usize, 1, 2, 63, 64, 65, 130] {
            let forward: Vec<usize> = (0..count).collect();
            let backward: Vec<usize> = (0..count).rev().collect();
            assert!(is_permutation(&forward));
            assert!(is_permutation(&backward));
            if count >= 2 {
                let mut repeated = forward.clone();
                repeated[count - 1] = 0;
                assert!(!is_permutation(&repeated));
                let mut outside = forward.clone();
                outside[0] = count;
                assert!(!is_permutation(&outside));
                outside[0] = usize::MAX;
                assert!(!is_permutation(&outside));
            }
        }
    }
}
