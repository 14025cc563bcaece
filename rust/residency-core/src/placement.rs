//! What a value's measurement says, and whether it is in place: the facts the glue
//! gathers from a value's tensors, folded here, and the diagnosis of a value measured
//! somewhere other than its location (docs/concepts/locations-and-budgets.md).

use std::fmt;

use crate::error::CoreError;
use crate::location::{HOST_DEVICE, Location, OTHER_DEVICE};

/// What one pass over a value's tensors found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ValueFacts {
    /// -1 on the host, the CUDA index on CUDA, -2 elsewhere.
    pub device_code: i64,
    /// `Some(all pinned)`, or `None` for a host value mixing pinned and pageable.
    pub pinned: Option<bool>,
    pub logical: u64,
    pub storage: u64,
    /// (device code, data pointer) per unique non-empty storage.
    pub keys: Vec<(i64, u64)>,
}

impl ValueFacts {
    /// The device code of a value on the host (`location::HOST_DEVICE`).
    pub const HOST: i64 = HOST_DEVICE;
    /// The device code of a value elsewhere (`location::OTHER_DEVICE`).
    pub const ELSEWHERE: i64 = OTHER_DEVICE;
}

/// A value whose tensors disagree: one storage reporting two sizes (the glue also
/// refuses no tensors and mixed devices); the runtime then raises the documented error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Inconsistent;

/// The facts of a value, folded one tensor at a time in the value's order.
#[derive(Debug, Clone)]
pub struct Measurement {
    device_code: i64,
    pinning_possible: bool,
    all_pinned: bool,
    any_pinned: bool,
    logical: u64,
    /// (data pointer, size) per unique non-empty storage, in first-seen order.
    storages: Vec<(u64, u64)>,
}

impl Measurement {
    /// A value whose first tensor is on `device_code`; `pinning_possible` is false
    /// where no tensor can be pinned (no accelerator in this process).
    #[inline]
    pub fn new(device_code: i64, pinning_possible: bool, tensors: usize) -> Self {
        Self {
            device_code,
            pinning_possible,
            all_pinned: device_code == ValueFacts::HOST,
            any_pinned: false,
            logical: 0,
            storages: Vec::with_capacity(tensors),
        }
    }

    /// Adds a tensor of `nbytes` logical bytes.
    #[inline]
    pub fn add_tensor(&mut self, nbytes: u64) {
        self.logical = self.logical.saturating_add(nbytes);
    }

    /// Adds a tensor's storage of `size` bytes at `pointer` (only non-empty storages
    /// are added); a storage seen before with another size is inconsistent.
    #[inline]
    pub fn add_storage(&mut self, pointer: u64, size: u64) -> Result<(), Inconsistent> {
        match self.storages.iter().find(|(known, _)| *known == pointer) {
            Some(&(_, known_size)) if known_size != size => Err(Inconsistent),
            Some(_) => Ok(()),
            None => {
                self.storages.push((pointer, size));
                Ok(())
            }
        }
    }

    /// Whether a tensor with storage bytes must be asked whether it is pinned: only a
    /// host tensor can be, and only where pinning is possible.
    #[inline]
    pub fn asks_pinned(&self) -> bool {
        self.device_code == ValueFacts::HOST && self.pinning_possible
    }

    /// Adds the answer of a tensor with storage bytes to `asks_pinned`. Only memory
    /// can be pinned: a tensor without storage bytes is neither pinned nor pageable
    /// (docs/concepts/locations-and-budgets.md#pinned-host).
    #[inline]
    pub fn add_pinned(&mut self, pinned: bool) {
        self.all_pinned &= pinned;
        self.any_pinned |= pinned;
    }

    /// The value's facts. A host value without storage bytes reads as pageable;
    /// `Location::holds` accepts it at either host location.
    #[inline]
    pub fn finish(self) -> ValueFacts {
        let all_pinned = self.all_pinned && self.pinning_possible && !self.storages.is_empty();
        let storage = self
            .storages
            .iter()
            .fold(0u64, |total, (_, size)| total.saturating_add(*size));
        ValueFacts {
            device_code: self.device_code,
            pinned: (all_pinned || !self.any_pinned).then_some(all_pinned),
            logical: self.logical,
            storage,
            keys: self
                .storages
                .iter()
                .map(|(pointer, _)| (self.device_code, *pointer))
                .collect(),
        }
    }
}

/// Why a measured value is not in place at a location.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Misplaced {
    /// Something in memory, for a disk location: only the disk tier's files go there.
    InMemoryForDisk,
    /// The value is on another device than the location's.
    OtherDevice,
    /// A host value mixing pinned and pageable tensors.
    MixedPinning,
    /// Pageable memory for the pinned location.
    NotPinned,
    /// Pinned memory for the pageable location.
    Pinned,
}

impl Misplaced {
    /// Whether the refusal's message names the device the value was measured on (only
    /// a value on another device): the bindings ask for the device's name only then.
    #[inline]
    pub fn names_device(self) -> bool {
        matches!(self, Self::OtherDevice)
    }
}

impl ValueFacts {
    /// The facts of a file a disk location stores: the byte counts of the value
    /// written, on no device and in no memory, so in place on no location in memory
    /// (only the disk tier installs files, docs/concepts/locations-and-budgets.md#disk).
    pub fn stored(logical: u64, storage: u64) -> Self {
        Self {
            device_code: Self::ELSEWHERE,
            pinned: None,
            logical,
            storage,
            keys: Vec::new(),
        }
    }

    /// The facts of a copy on CUDA device `index` (pageable, as device memory is) of
    /// `nbytes`, logical and stored, its storages at `pointers`: what measuring a
    /// simulated runtime's native copy says.
    pub fn device_copy(index: usize, nbytes: u64, pointers: impl IntoIterator<Item = u64>) -> Self {
        let code = i64::try_from(index).unwrap_or(Self::ELSEWHERE);
        Self {
            device_code: code,
            pinned: Some(false),
            logical: nbytes,
            storage: nbytes,
            keys: pointers
                .into_iter()
                .map(|pointer| (code, pointer))
                .collect(),
        }
    }

    /// Whether the value's device is `at`'s: the host for the host locations, the
    /// same index for a CUDA one.
    fn on_device_of(&self, at: Location) -> bool {
        match at {
            Location::PageableHost | Location::PinnedHost => self.device_code == Self::HOST,
            Location::Cuda(index) => self.device_code == i64::from(index),
            Location::Disk(_) => false,
        }
    }

    /// Why the value is not in place at `at` (the placement rule, `Location::holds`),
    /// or `None` where it is.
    #[inline]
    pub fn misplaced(&self, at: Location) -> Option<Misplaced> {
        if at.holds(self.device_code, self.pinned, self.storage) {
            return None;
        }
        if at.is_disk() {
            return Some(Misplaced::InMemoryForDisk);
        }
        if !self.on_device_of(at) {
            return Some(Misplaced::OtherDevice);
        }
        match (self.pinned, at) {
            (None, Location::PageableHost | Location::PinnedHost) => Some(Misplaced::MixedPinning),
            (Some(false), Location::PinnedHost) => Some(Misplaced::NotPinned),
            (Some(true), Location::PageableHost) => Some(Misplaced::Pinned),
            _ => None,
        }
    }

    /// Where a value adopted without a location lives: its CUDA device, else pinned or
    /// pageable host memory as its tensors are. A value on another device is taken as
    /// pageable, which its placement check then refuses by name.
    #[inline]
    pub fn placement(&self) -> Result<Location, PlacementError> {
        if let Ok(index) = u32::try_from(self.device_code) {
            return Location::cuda(index).map_err(|err| PlacementError::Core(err.into()));
        }
        match self.pinned {
            Some(true) if self.device_code == Self::HOST => Ok(Location::PinnedHost),
            None => Err(PlacementError::Misplaced(Misplaced::MixedPinning)),
            _ => Ok(Location::PageableHost),
        }
    }
}

/// Why `ValueFacts::placement` found no location.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PlacementError {
    Misplaced(Misplaced),
    Core(CoreError),
}

/// A misplacement as its error names it: the value's type, the location and the
/// device the value was measured on, as the caller writes them.
#[derive(Debug, Clone, Copy)]
pub struct Misplacement<'a> {
    pub why: Misplaced,
    pub value: &'a str,
    pub location: &'a str,
    pub device: &'a str,
}

impl fmt::Display for Misplacement<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let Self {
            value,
            location,
            device,
            ..
        } = *self;
        match self.why {
            Misplaced::InMemoryForDisk => write!(
                f,
                "{value} is in memory, but the location is {location}: values reach a disk \
                 location only by ensure or move"
            ),
            Misplaced::OtherDevice => {
                write!(f, "{value} is on {device}, but the location is {location}")
            }
            Misplaced::MixedPinning => write!(f, "{value} mixes pinned and pageable host tensors"),
            Misplaced::NotPinned => write!(
                f,
                "{value} is not in pinned memory, but the location is {location}"
            ),
            Misplaced::Pinned => write!(
                f,
                "{value} is in pinned memory, but the location is {location}"
            ),
        }
    }
}

impl Misplacement<'_> {
    /// The documented error: `ResidencyMaterializationError`.
    pub fn error(&self) -> CoreError {
        CoreError::Materialization {
            message: self.to_string(),
        }
    }
}
