//! What bringing a value to a location costs the host (docs/concepts/controller.md#staging).

#![allow(clippy::panic)] // Test assertions.

use residency_core::HostCost::{Blocks, BlocksUnlessLoadsAlone, Free};
use residency_core::{Location, Manager, Recoverability, ReplicaMode, ValueSpec};

const CUDA: Location = Location::Cuda(0);

fn spec(recoverability: Recoverability) -> ValueSpec {
    ValueSpec::new(8, 8, ReplicaMode::Replicable, recoverability).expect("a valid spec")
}

#[test]
fn only_copies_to_a_device_from_pinned_device_or_deferred_disk_are_free() {
    let manager = Manager::new(&[]);
    let adopt = |at: Location| {
        manager
            .adopt(1, spec(Recoverability::MustPreserve), at, 8, &[])
            .expect("adopted")
            .0
    };
    let pageable = adopt(Location::PageableHost);
    let pinned = adopt(Location::PinnedHost);
    let on_device = adopt(CUDA);
    let on_disk = adopt(Location::Disk(0));
    let loaded = manager
        .register_source(
            1,
            spec(Recoverability::Reconstructible),
            Location::PageableHost,
        )
        .expect("registered")
        .0;
    let handles = [pageable, pinned, on_device, on_disk, loaded];
    let costs = |at, deferred| manager.host_costs(&handles, at, deferred).expect("live");
    assert_eq!(costs(CUDA, false), [Blocks, Free, Free, Blocks, Blocks]);
    assert_eq!(
        costs(CUDA, true),
        [Blocks, Free, Free, Free, BlocksUnlessLoadsAlone]
    );
    // Any copy to the host blocks it; a value already there costs nothing.
    assert_eq!(
        costs(Location::PinnedHost, true),
        [Blocks, Free, Blocks, Blocks, Blocks]
    );
    manager.discard(pageable).expect("discarded");
    assert!(manager.host_costs(&[pageable], CUDA, true).is_err());
}
