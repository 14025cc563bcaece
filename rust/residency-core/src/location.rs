//! Where a materialisation lives: pageable host, pinned host, an indexed CUDA device,
//! or a directory on local storage.
//!
//! The derived ordering is the canonical source order (pageable, pinned, CUDA by
//! ascending index, then disk directories; docs/concepts/values.md#source-order), so
//! `min()` over candidate locations picks a source.

use std::fmt;
use std::sync::{PoisonError, RwLock};

/// A location index or code out of range; the manager's errors take it as an invalid
/// argument (`CoreError::InvalidArgument`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InvalidLocation(pub String);

impl fmt::Display for InvalidLocation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for InvalidLocation {}

/// The highest CUDA device index a location may name.
pub const MAX_CUDA_INDEX: u8 = 127;
/// The highest disk directory index (the glue numbers directories as first named).
pub const MAX_DISK_INDEX: u8 = 127;
/// The first disk location code: CUDA codes end just below it.
const DISK_BASE: u32 = 2 + MAX_CUDA_INDEX as u32 + 1;
/// How many location codes there are: every code is below this.
pub const LOCATION_CODES: u32 = DISK_BASE + MAX_DISK_INDEX as u32 + 1;

/// Why a CUDA location cannot be used on a machine without CUDA, and the remedy: the
/// simulated runtime (docs/concepts/simulation.md). `location` is how the caller
/// writes the location (`cuda:0`).
pub fn cuda_unavailable(location: impl fmt::Display) -> String {
    format!(
        "{location} is not usable: CUDA is not available. Without a GPU, run under the \
         simulated runtime: `with fhelium.residency.simulation.use_runtime(SimulatedRuntime(1)):` \
         around the manager's construction (see docs/concepts/simulation.md)"
    )
}

/// The names the glue gave disk directories, by index: process-wide, like the
/// numbering itself, so every message names a directory by its path.
static DISK_NAMES: RwLock<Vec<String>> = RwLock::new(Vec::new());

/// Records the name of disk location `index` (the glue's `disk:<path>`).
pub fn name_disk(index: u8, name: &str) {
    let mut names = DISK_NAMES.write().unwrap_or_else(PoisonError::into_inner);
    let slot = usize::from(index);
    if names.len() <= slot {
        names.resize(slot + 1, String::new());
    }
    if names[slot].is_empty() {
        name.clone_into(&mut names[slot]);
    }
}

/// A residency location. The variant order is the canonical order.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Location {
    PageableHost,
    PinnedHost,
    Cuda(u8),
    Disk(u8),
}

impl Location {
    /// Builds a CUDA location, rejecting indices above [`MAX_CUDA_INDEX`].
    pub fn cuda(index: u32) -> Result<Self, InvalidLocation> {
        match u8::try_from(index) {
            Ok(index) if index <= MAX_CUDA_INDEX => Ok(Self::Cuda(index)),
            _ => Err(InvalidLocation(format!(
                "CUDA device index {index} exceeds the maximum {MAX_CUDA_INDEX}"
            ))),
        }
    }

    /// Builds a disk location, rejecting indices above [`MAX_DISK_INDEX`].
    pub fn disk(index: u32) -> Result<Self, InvalidLocation> {
        match u8::try_from(index) {
            Ok(index) if index <= MAX_DISK_INDEX => Ok(Self::Disk(index)),
            _ => Err(InvalidLocation(format!(
                "disk index {index} exceeds the maximum {MAX_DISK_INDEX}"
            ))),
        }
    }

    /// The compact code used across the language boundary: 0 pageable, 1 pinned,
    /// 2 + index for CUDA, 130 + index for a disk directory.
    pub fn code(self) -> u32 {
        match self {
            Self::PageableHost => 0,
            Self::PinnedHost => 1,
            Self::Cuda(index) => 2 + u32::from(index),
            Self::Disk(index) => DISK_BASE + u32::from(index),
        }
    }

    /// Inverse of [`Location::code`].
    pub fn from_code(code: u32) -> Result<Self, InvalidLocation> {
        match code {
            0 => Ok(Self::PageableHost),
            1 => Ok(Self::PinnedHost),
            other if other >= DISK_BASE => Self::disk(other - DISK_BASE),
            other => Self::cuda(other - 2),
        }
    }

    /// A location code as the bindings pass it, signed: a negative one, or one past
    /// 2**32 - 1, is no code.
    pub fn from_signed_code(code: i64) -> Result<Self, InvalidLocation> {
        let code = u32::try_from(code)
            .map_err(|_| InvalidLocation(format!("invalid location code {code}")))?;
        Self::from_code(code)
    }

    pub fn is_disk(self) -> bool {
        matches!(self, Self::Disk(_))
    }

    pub fn is_cuda(self) -> bool {
        matches!(self, Self::Cuda(_))
    }

    pub fn cuda_index(self) -> Option<u8> {
        match self {
            Self::Cuda(index) => Some(index),
            _ => None,
        }
    }

    /// The placement rule: whether a value measured on `device_code` (-1 the host, the
    /// CUDA index, -2 any other device), `pinned` (`None`: a host value mixing pinned
    /// and pageable tensors) and holding `storage_nbytes` is in place here. A host value
    /// without storage bytes has no memory to pin, so it is in place at either host
    /// location (docs/concepts/locations-and-budgets.md#pinned-host); nothing measured
    /// in memory is in place on disk, where only the disk tier's files are installed.
    #[inline]
    pub fn holds(self, device_code: i64, pinned: Option<bool>, storage_nbytes: u64) -> bool {
        match self {
            Self::PageableHost | Self::PinnedHost
                if device_code == HOST_DEVICE && storage_nbytes == 0 =>
            {
                true
            }
            Self::PageableHost => (device_code, pinned) == (HOST_DEVICE, Some(false)),
            Self::PinnedHost => (device_code, pinned) == (HOST_DEVICE, Some(true)),
            Self::Cuda(index) => (device_code, pinned) == (i64::from(index), Some(false)),
            Self::Disk(_) => false,
        }
    }

    /// The location name: `pageable-host`, `pinned-host`, `cuda:N` or `disk:N` (the
    /// glue names a disk location by its directory).
    pub fn name(self) -> String {
        self.to_string()
    }
}

/// What a location record's `kind` names (docs/concepts/locations-and-budgets.md).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LocationKind {
    PageableHost,
    PinnedHost,
    Disk,
    /// A CUDA device, which the record names by its device's index.
    Cuda,
}

impl LocationKind {
    /// The kind `kind` names: every kind other than the host and disk kinds is a CUDA
    /// device's.
    #[inline]
    pub fn named(kind: &str) -> Self {
        match kind {
            "pageable-host" => Self::PageableHost,
            "pinned-host" => Self::PinnedHost,
            "disk" => Self::Disk,
            _ => Self::Cuda,
        }
    }
}

/// The device code a value's measurement gives on the host (`ValueFacts::device_code`;
/// on CUDA it is the index).
pub const HOST_DEVICE: i64 = -1;

/// The device code of a value on a device that is neither the host nor CUDA (meta,
/// mps, ...), or on none (a stored file): it never matches a location's.
pub const OTHER_DEVICE: i64 = -2;

/// How a copy between two locations is made (docs/concepts/transitions.md#copies-and-streams,
/// docs/concepts/locations-and-budgets.md#disk): the device seam's or the disk tier's
/// call that makes it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyRoute {
    /// A stored file read back into host memory, pinned or pageable.
    ReadToHost {
        pinned: bool,
    },
    /// A stored file read to a device through the disk tier's pinned staging ring.
    ReadToCuda,
    /// A value written to a disk location's file.
    Write,
    ToPinned,
    ToPageable,
    /// A copy to a device, enqueued on the transfer stream; only a pageable source
    /// is copied blocking.
    ToCuda {
        non_blocking: bool,
    },
}

impl CopyRoute {
    /// The route of a copy from `from` to `to`.
    #[inline]
    pub fn between(from: Location, to: Location) -> Self {
        match (from, to) {
            (Location::Disk(_), Location::Cuda(_)) => Self::ReadToCuda,
            (Location::Disk(_), to) => Self::ReadToHost {
                pinned: to == Location::PinnedHost,
            },
            (_, Location::Disk(_)) => Self::Write,
            (_, Location::PinnedHost) => Self::ToPinned,
            (_, Location::PageableHost) => Self::ToPageable,
            (from, Location::Cuda(_)) => Self::ToCuda {
                non_blocking: from != Location::PageableHost,
            },
        }
    }
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::PageableHost => f.write_str("pageable-host"),
            Self::PinnedHost => f.write_str("pinned-host"),
            Self::Cuda(index) => write!(f, "cuda:{index}"),
            Self::Disk(index) => {
                let names = DISK_NAMES.read().unwrap_or_else(PoisonError::into_inner);
                match names
                    .get(usize::from(*index))
                    .filter(|name| !name.is_empty())
                {
                    Some(name) => f.write_str(name),
                    None => write!(f, "disk:{index}"),
                }
            }
        }
    }
}

/// Words of a [`LocationSet`]: one bit for every location code, disks included.
const SET_WORDS: usize = LOCATION_CODES.div_ceil(64) as usize;

/// A set of locations as a bitset over their codes. Code order is the canonical
/// order, so the lowest set bit is the canonical first location; no allocation.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(crate) struct LocationSet([u64; SET_WORDS]);

impl LocationSet {
    fn bit(location: Location) -> (usize, u64) {
        let code = location.code() as usize;
        (code / 64, 1u64 << (code % 64))
    }

    pub(crate) fn contains(self, location: Location) -> bool {
        let (word, mask) = Self::bit(location);
        self.0[word] & mask != 0
    }

    pub(crate) fn insert(&mut self, location: Location) {
        let (word, mask) = Self::bit(location);
        self.0[word] |= mask;
    }

    pub(crate) fn remove(&mut self, location: Location) {
        let (word, mask) = Self::bit(location);
        self.0[word] &= !mask;
    }

    pub(crate) fn len(self) -> u32 {
        self.0.iter().map(|word| word.count_ones()).sum()
    }

    pub(crate) fn is_empty(self) -> bool {
        self.0 == [0; SET_WORDS]
    }

    /// Locations in canonical order.
    pub(crate) fn iter(self) -> impl Iterator<Item = Location> {
        (0u32..)
            .zip(self.0)
            .flat_map(|(word, mut bits)| {
                // The set bits of a word, lowest first.
                std::iter::from_fn(move || {
                    (bits != 0).then(|| {
                        let bit = bits.trailing_zeros();
                        bits &= bits - 1;
                        word * 64 + bit
                    })
                })
            })
            .filter_map(|code| Location::from_code(code).ok())
    }

    pub(crate) fn first(self) -> Option<Location> {
        (0u32..).zip(self.0).find_map(|(word, bits)| {
            (bits != 0).then(|| {
                Location::from_code(word * 64 + bits.trailing_zeros())
                    .unwrap_or(Location::PageableHost)
            })
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_location_set_walks_its_locations_in_canonical_order() {
        let inserted = [
            Location::Disk(MAX_DISK_INDEX),
            Location::Cuda(63),
            Location::PinnedHost,
            Location::Cuda(61),
            Location::Disk(0),
            Location::Cuda(MAX_CUDA_INDEX),
            Location::PageableHost,
            Location::Cuda(0),
        ];
        let mut set = LocationSet::default();
        assert!(set.is_empty());
        assert_eq!(set.first(), None);
        for location in inserted {
            set.insert(location);
            set.insert(location);
        }
        let mut sorted = inserted.to_vec();
        sorted.sort();
        assert_eq!(set.iter().collect::<Vec<_>>(), sorted);
        assert_eq!(set.len(), 8);
        assert_eq!(set.first(), Some(Location::PageableHost));
        set.remove(Location::PageableHost);
        set.remove(Location::Cuda(63));
        assert!(!set.contains(Location::Cuda(63)));
        assert!(set.contains(Location::Cuda(61)));
        assert_eq!(set.first(), Some(Location::PinnedHost));
        assert_eq!(set.iter().count(), 6);
    }

    #[test]
    fn canonical_order_is_pageable_pinned_then_cuda_by_index() {
        let mut locations = vec![
            Location::Cuda(3),
            Location::PinnedHost,
            Location::Cuda(0),
            Location::PageableHost,
            Location::Cuda(1),
        ];
        locations.sort();
        assert_eq!(
            locations,
            vec![
                Location::PageableHost,
                Location::PinnedHost,
                Location::Cuda(0),
                Location::Cuda(1),
                Location::Cuda(3),
            ]
        );
    }

    #[test]
    fn codes_round_trip_and_follow_canonical_order() {
        let all: Vec<Location> = [Location::PageableHost, Location::PinnedHost]
            .into_iter()
            .chain((0..=MAX_CUDA_INDEX).map(Location::Cuda))
            .chain((0..=MAX_DISK_INDEX).map(Location::Disk))
            .collect();
        for window in all.windows(2) {
            assert!(window[0] < window[1]);
            assert!(window[0].code() < window[1].code());
        }
        for location in all {
            assert_eq!(Location::from_code(location.code()), Ok(location));
        }
    }

    #[test]
    fn cuda_index_above_maximum_is_rejected() {
        assert_eq!(Location::cuda(127), Ok(Location::Cuda(127)));
        assert!(matches!(Location::cuda(128), Err(InvalidLocation(_))));
        // CUDA codes end where disk codes begin; past the last disk code nothing is.
        assert_eq!(Location::from_code(2 + 128), Ok(Location::Disk(0)));
        assert!(Location::disk(128).is_err());
        assert!(Location::from_code(130 + 128).is_err());
        assert!(Location::from_code(u32::MAX).is_err());
    }

    #[test]
    fn names_match_the_python_location_names() {
        assert_eq!(Location::PageableHost.name(), "pageable-host");
        assert_eq!(Location::PinnedHost.name(), "pinned-host");
        assert_eq!(Location::Cuda(12).name(), "cuda:12");
        assert!(Location::Cuda(0).is_cuda());
        assert_eq!(Location::PinnedHost.cuda_index(), None);
    }
}
