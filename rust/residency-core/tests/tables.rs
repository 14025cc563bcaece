//! The bounded tables the bindings keep of callers' objects: what is remembered,
//! what is forgotten, and how the plan's handle table interns handles.

use std::cell::Cell;

use residency_core::ActionKind;
use residency_core::tables::{
    ByCode, CallTable, FirstSeen, Identity, Interner, KEPT_CALLS, Last, Memo, Recent,
};

#[test]
fn recent_forgets_the_oldest_past_its_bound() {
    let recent = Recent::new(2);
    for entry in [1, 2, 3] {
        recent.remember(entry);
    }
    assert_eq!(recent.find_map(|entry| (*entry == 1).then_some(())), None);
    assert_eq!(
        recent.find_map(|entry| (*entry == 3).then_some(*entry)),
        Some(3)
    );
    assert_eq!(
        recent.find_map(|entry| (*entry == 2).then_some(*entry)),
        Some(2)
    );
}

#[test]
fn recent_keeps_the_newest_entries_oldest_first() {
    let recent = Recent::new(2);
    for entry in [1, 2, 3] {
        recent.keep(|| entry);
    }
    assert_eq!(recent.to_vec(), [2, 3]);
    recent.clear();
    assert_eq!(recent.to_vec(), Vec::<i32>::new());
    // A capacity of 0 keeps nothing, and makes nothing.
    let none = Recent::new(0);
    none.keep(|| -> i32 { unreachable!("nothing is made") });
    assert!(none.to_vec().is_empty());
}

#[test]
fn first_seen_keeps_the_first_entries_only() {
    let mut seen = FirstSeen::new(2);
    for entry in [1, 2, 3] {
        seen.insert(entry);
    }
    assert_eq!(seen.find_map(|entry| (*entry == 3).then_some(())), None);
    assert_eq!(
        seen.find_map(|entry| (*entry == 1).then_some(*entry)),
        Some(1)
    );
}

#[test]
fn a_call_table_keeps_one_entry_per_call_until_replaced_or_cleared() {
    let table = CallTable::default();
    let ensure = (ActionKind::Ensure, [0x1000, 0x2000, 0]);
    let drop = (ActionKind::Drop, [0x1000, 0x2000, 0]);
    table.keep(ensure, 100);
    table.keep(drop, 200);
    assert_eq!(table.get(&ensure, |value| *value), Some(100));
    assert_eq!(table.get(&drop, |value| *value), Some(200));
    // A call that maps to a kept call's slot replaces it, and only its own key finds it.
    let colliding = (ActionKind::Ensure, [0x1000 + (KEPT_CALLS << 4), 0x2000, 0]);
    table.keep(colliding, 300);
    assert_eq!(table.get(&ensure, |value| *value), None);
    assert_eq!(table.get(&colliding, |value| *value), Some(300));
    table.clear();
    assert_eq!(table.get(&drop, |value| *value), None);
    // Calls that map to distinct slots are all kept, up to the table's size.
    let keys: Vec<_> = (0..KEPT_CALLS)
        .map(|index| (ActionKind::Ensure, [index << 4, 0, 0]))
        .collect();
    for (index, key) in keys.iter().enumerate() {
        table.keep(*key, index);
    }
    for (index, key) in keys.iter().enumerate() {
        assert_eq!(table.get(key, |value| *value), Some(index));
    }
}

#[test]
fn by_code_and_last_make_each_value_once() {
    let calls = Cell::new(0);
    let make = |value: u32| {
        calls.set(calls.get() + 1);
        Ok::<_, ()>(value * 10)
    };
    let mut by_code = ByCode::default();
    assert_eq!(by_code.get_or_try(5, || make(5)), Ok(50));
    assert_eq!(by_code.get_or_try(5, || make(6)), Ok(50));
    assert_eq!(by_code.get_or_try(0, || make(0)), Ok(0));
    assert_eq!(calls.get(), 2);
    assert_eq!(by_code.get_or_try(7, || Err(())), Err(()));
    assert_eq!(by_code.get_or_try(7, || make(7)), Ok(70));

    let mut last = Last::default();
    calls.set(0);
    for key in [1, 1, 2, 1] {
        assert_eq!(last.get_or_try(key, || make(key)), Ok(key * 10));
    }
    assert_eq!(calls.get(), 3);
}

/// Items as (address, hash, value): equal values are one key.
struct ByValue;

impl Identity<(usize, isize, &'static str)> for ByValue {
    type Error = String;

    fn address(&self, item: &(usize, isize, &'static str)) -> usize {
        item.0
    }

    fn hash(&self, item: &(usize, isize, &'static str)) -> Result<isize, String> {
        Ok(item.1)
    }

    fn same(
        &self,
        known: &(usize, isize, &'static str),
        item: &(usize, isize, &'static str),
    ) -> Result<bool, String> {
        Ok(known.2 == item.2)
    }

    fn too_many(&self) -> String {
        "too many".into()
    }
}

#[test]
fn the_interner_numbers_distinct_items_in_first_appearance_order() {
    let mut table = Interner::default();
    assert_eq!(table.slot((1, 7, "a"), &ByValue), Ok(0));
    // Same hash, different value: a collision gets its own slot.
    assert_eq!(table.slot((2, 7, "b"), &ByValue), Ok(1));
    // Another object equal to "b": its slot, not a new one.
    assert_eq!(table.slot((3, 7, "b"), &ByValue), Ok(1));
    assert_eq!(table.slot((4, 9, "c"), &ByValue), Ok(2));
    // An address seen before answers without being hashed again.
    assert_eq!(table.slot((1, 0, "z"), &ByValue), Ok(0));
    let values: Vec<&str> = table.items().iter().map(|item| item.2).collect();
    assert_eq!(values, ["a", "b", "c"]);
}

#[test]
fn a_memo_keeps_the_first_value_for_a_key() {
    let memo = Memo::default();
    memo.insert(1, "first");
    memo.insert(1, "second");
    memo.insert(2, "other");
    assert_eq!(memo.get(&1, |value| *value), Some("first"));
    assert_eq!(memo.get(&2, |value| *value), Some("other"));
    assert_eq!(memo.get(&3, |value| *value), None);
}
