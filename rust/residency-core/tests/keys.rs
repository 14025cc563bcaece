//! The controller's key store (`KeyStore`): the keys a decide reads, and the orders it
//! walks, which are handed back kept unless a key changed while they were out.

#![allow(clippy::panic)] // Test assertions.

use residency_core::Location;
use residency_core::keys::KeyStore;
use residency_core::victims::ResidentSet;

const CUDA: Location = Location::Cuda(0);

fn residents(values: &[u32]) -> ResidentSet {
    values.iter().copied().collect()
}

#[test]
fn keys_are_set_per_value_and_shared_with_a_decide() {
    let mut store = KeyStore::default();
    assert!(store.is_empty());
    store.set_epoch(3, 7);
    store.set_metadata(3, 2, Some("layer"));
    store.set_epoch(5, 9);
    assert_eq!(store.len(), 2);
    let keys = store.keys(3).cloned();
    assert_eq!(
        keys.map(|(priority, epoch, key)| (priority, epoch, key.map(|k| k.to_string()))),
        Some((2, 7, Some("layer".to_owned())))
    );
    let (map, order) = store.take_order();
    assert_eq!(map.get(&5).map(|keys| keys.1), Some(9));
    store.put_order(order);
}

#[test]
fn each_use_takes_the_next_epoch_for_all_its_values() {
    let mut store = KeyStore::default();
    assert_eq!(store.next_epoch(), 1);
    store.record_use([4, 6]);
    assert_eq!(store.next_epoch(), 3);
    let epochs = [4, 6].map(|index| store.keys(index).map(|keys| keys.1));
    assert_eq!(epochs, [Some(2), Some(2)]);
}

#[test]
fn an_order_handed_back_unchanged_is_kept_and_moves_with_its_keys() {
    let mut store = KeyStore::default();
    let (map, mut order) = store.take_order();
    order.sync(&map, CUDA, Some(&residents(&[1, 2, 3])));
    assert_eq!(order.ordered(CUDA), vec![1, 2, 3]);
    store.put_order(order);
    // Value 1 used now: it goes last, in the order kept.
    store.set_epoch(1, 1);
    let (_, order) = store.take_order();
    assert_eq!(order.ordered(CUDA), vec![2, 3, 1]);
    store.put_order(order);
}

#[test]
fn an_order_out_while_a_key_changes_is_forgotten() {
    let mut store = KeyStore::default();
    let (map, mut order) = store.take_order();
    order.sync(&map, CUDA, Some(&residents(&[1, 2, 3])));
    // A key changes while the decide walks the order: handed back stale, it is not
    // kept (the next decide syncs from nothing).
    store.set_epoch(2, 4);
    store.put_order(order);
    let (_, order) = store.take_order();
    assert_eq!(order.count(CUDA), 0);
    store.put_order(order);
    // A schedule order is kept the same way, separately.
    let (_, schedule) = store.take_schedule_order();
    store.put_schedule_order(schedule);
}
