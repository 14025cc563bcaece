//! The measurement fold and the placement diagnosis the bindings run for every
//! adopted or installed value (docs/concepts/locations-and-budgets.md).

use residency_core::placement::{Inconsistent, PlacementError};
use residency_core::{CoreError, Location, Measurement, Misplaced, Misplacement, ValueFacts};

fn facts(device_code: i64, pinned: Option<bool>, storage: u64) -> ValueFacts {
    ValueFacts {
        device_code,
        pinned,
        logical: storage,
        storage,
        keys: Vec::new(),
    }
}

#[test]
fn a_measurement_counts_each_storage_once_and_every_tensor_logically() {
    let mut measurement = Measurement::new(0, true, 3);
    for (nbytes, pointer, size) in [(8, 100, 64), (8, 100, 64), (4, 200, 16)] {
        measurement.add_tensor(nbytes);
        assert_eq!(measurement.add_storage(pointer, size), Ok(()));
        assert!(!measurement.asks_pinned(), "a CUDA tensor is never asked");
    }
    let facts = measurement.finish();
    assert_eq!(facts.logical, 20);
    assert_eq!(facts.storage, 80);
    assert_eq!(facts.keys, vec![(0, 100), (0, 200)]);
    assert_eq!(facts.pinned, Some(false));
}

#[test]
fn one_storage_with_two_sizes_is_inconsistent() {
    let mut measurement = Measurement::new(-1, true, 2);
    assert_eq!(measurement.add_storage(100, 64), Ok(()));
    assert_eq!(measurement.add_storage(100, 32), Err(Inconsistent));
}

#[test]
fn host_pinning_is_all_none_or_mixed() {
    let fold = |answers: &[bool], possible: bool| {
        let mut measurement = Measurement::new(-1, possible, answers.len());
        for (position, pinned) in answers.iter().enumerate() {
            measurement.add_tensor(1);
            assert_eq!(measurement.add_storage(position as u64, 1), Ok(()));
            if measurement.asks_pinned() {
                measurement.add_pinned(*pinned);
            }
        }
        measurement.finish().pinned
    };
    assert_eq!(fold(&[true, true], true), Some(true));
    assert_eq!(fold(&[false, false], true), Some(false));
    assert_eq!(fold(&[true, false], true), None);
    // Without pinning nothing is asked, and everything is pageable.
    assert_eq!(fold(&[true, true], false), Some(false));
    // No storage bytes: nothing to pin, so pageable.
    assert_eq!(Measurement::new(-1, true, 0).finish().pinned, Some(false));
}

#[test]
fn misplacements_are_diagnosed_in_order() {
    let host = facts(-1, Some(false), 8);
    assert_eq!(host.misplaced(Location::PageableHost), None);
    assert_eq!(
        host.misplaced(Location::Disk(0)),
        Some(Misplaced::InMemoryForDisk)
    );
    assert_eq!(
        host.misplaced(Location::Cuda(0)),
        Some(Misplaced::OtherDevice)
    );
    assert_eq!(
        host.misplaced(Location::PinnedHost),
        Some(Misplaced::NotPinned)
    );
    assert_eq!(
        facts(-1, Some(true), 8).misplaced(Location::PageableHost),
        Some(Misplaced::Pinned)
    );
    assert_eq!(
        facts(-1, None, 8).misplaced(Location::PinnedHost),
        Some(Misplaced::MixedPinning)
    );
    assert_eq!(
        facts(1, Some(false), 8).misplaced(Location::Cuda(0)),
        Some(Misplaced::OtherDevice)
    );
    assert_eq!(
        facts(-2, Some(false), 8).misplaced(Location::PageableHost),
        Some(Misplaced::OtherDevice)
    );
    assert_eq!(facts(1, Some(false), 8).misplaced(Location::Cuda(1)), None);
    // Without storage bytes a host value is in place at either host location.
    assert_eq!(
        facts(-1, Some(false), 0).misplaced(Location::PinnedHost),
        None
    );
}

#[test]
fn a_value_adopted_without_a_location_is_placed_by_its_facts() {
    assert_eq!(facts(3, Some(false), 8).placement(), Ok(Location::Cuda(3)));
    assert_eq!(
        facts(-1, Some(true), 8).placement(),
        Ok(Location::PinnedHost)
    );
    assert_eq!(
        facts(-1, Some(false), 8).placement(),
        Ok(Location::PageableHost)
    );
    assert_eq!(
        facts(-2, Some(false), 8).placement(),
        Ok(Location::PageableHost)
    );
    assert_eq!(
        facts(-1, None, 8).placement(),
        Err(PlacementError::Misplaced(Misplaced::MixedPinning))
    );
    assert!(matches!(
        facts(500, Some(false), 8).placement(),
        Err(PlacementError::Core(CoreError::InvalidArgument { .. }))
    ));
}

#[test]
fn misplacement_messages_name_the_value_device_and_location() {
    let text = |why| {
        Misplacement {
            why,
            value: "Pair",
            location: "cuda:0",
            device: "cpu",
        }
        .error()
        .to_string()
    };
    assert_eq!(
        text(Misplaced::OtherDevice),
        "Pair is on cpu, but the location is cuda:0"
    );
    assert_eq!(
        text(Misplaced::InMemoryForDisk),
        "Pair is in memory, but the location is cuda:0: values reach a disk location only \
         by ensure or move"
    );
    assert_eq!(
        text(Misplaced::MixedPinning),
        "Pair mixes pinned and pageable host tensors"
    );
    assert_eq!(
        text(Misplaced::NotPinned),
        "Pair is not in pinned memory, but the location is cuda:0"
    );
    assert_eq!(
        text(Misplaced::Pinned),
        "Pair is in pinned memory, but the location is cuda:0"
    );
}

#[test]
fn a_stored_file_is_in_place_nowhere_in_memory() {
    let stored = ValueFacts::stored(8, 16);
    assert_eq!((stored.logical, stored.storage), (8, 16));
    for at in [
        Location::PageableHost,
        Location::PinnedHost,
        Location::Cuda(0),
    ] {
        assert_eq!(stored.misplaced(at), Some(Misplaced::OtherDevice));
    }
}

#[test]
fn a_device_copy_is_in_place_on_its_device_only_with_a_key_per_storage() {
    let copy = ValueFacts::device_copy(1, 64, [100, 200]);
    assert_eq!(copy.keys, vec![(1, 100), (1, 200)]);
    assert_eq!((copy.logical, copy.storage), (64, 64));
    assert_eq!(copy.misplaced(Location::Cuda(1)), None);
    assert_eq!(
        copy.misplaced(Location::Cuda(0)),
        Some(Misplaced::OtherDevice)
    );
    assert_eq!(copy.placement(), Ok(Location::Cuda(1)));
}
