//! The bookkeeping of the objects a binding keeps beside the core's records
//! (`objects::ObjectStore`): which objects each change forgets and gives back, and
//! which it keeps.

use residency_core::Freed;
use residency_core::objects::ObjectStore;

type Store = ObjectStore<String>;

fn text(object: &str) -> String {
    object.to_owned()
}

/// A store with value 0 (source, pageable object at code 0) and value 1 (no source).
fn store() -> Store {
    let store = Store::default();
    store.push(
        0,
        text("h0"),
        text("s0"),
        Some(text("src0")),
        Some((0, text("v0@0"))),
    );
    store.push(1, text("h1"), text("s1"), None, None);
    store
}

#[test]
fn issued_objects_are_read_by_index() {
    let store = store();
    assert_eq!(store.handle(1, String::clone), Some(text("h1")));
    assert_eq!(store.spec(0, String::clone), Some(text("s0")));
    assert_eq!(store.source(0, String::clone), Some(text("src0")));
    assert_eq!(store.source(1, String::clone), None);
    assert_eq!(store.handle(2, String::clone), None);
    assert_eq!(store.value(0, 0, String::clone), Some(text("v0@0")));
    assert_eq!(
        store.handles_at([Some(1), None, Some(0), Some(9)], String::clone),
        vec![Some(text("h1")), None, Some(text("h0")), None]
    );
    assert_eq!(
        store.handles_and_specs(1, String::clone),
        vec![(text("h0"), text("s0"))]
    );
}

#[test]
fn a_new_value_object_forgets_the_stream_of_the_one_it_replaces() {
    let store = store();
    assert_eq!(store.set_stream(0, 0, text("stream")), None);
    assert_eq!(store.stream(0, 0, String::clone), Some(text("stream")));
    assert_eq!(store.set_value(0, 0, text("v0@0'")), Some(text("v0@0")));
    assert_eq!(store.stream(0, 0, String::clone), None);
    assert_eq!(store.value(0, 0, String::clone), Some(text("v0@0'")));
}

#[test]
fn a_stream_is_kept_only_for_a_materialisation_with_an_object() {
    let store = store();
    assert_eq!(store.set_stream(1, 2, text("stream")), Some(text("stream")));
    assert_eq!(store.stream(1, 2, String::clone), None);
    assert_eq!(store.set_value(1, 2, text("v1@2")), None);
    assert_eq!(store.set_stream(1, 2, text("first")), None);
    assert_eq!(store.set_stream(1, 2, text("second")), Some(text("first")));
    // Taking the value forgets its stream.
    assert_eq!(store.take_value(1, 2), Some(text("v1@2")));
    assert_eq!(store.stream(1, 2, String::clone), None);
    assert_eq!(store.take_value(1, 2), None);
}

#[test]
fn a_discard_forgets_the_values_streams_and_source_but_not_the_handle() {
    let store = store();
    assert_eq!(store.set_value(0, 3, text("v0@3")), None);
    assert_eq!(store.set_stream(0, 3, text("stream")), None);
    let mut released = store.discard(0, &[0, 3]);
    released.sort();
    assert_eq!(
        released,
        vec![text("src0"), text("stream"), text("v0@0"), text("v0@3")]
    );
    assert_eq!(store.value(0, 0, String::clone), None);
    assert_eq!(store.source(0, String::clone), None);
    assert_eq!(store.handle(0, String::clone), Some(text("h0")));
    assert_eq!(store.spec(0, String::clone), Some(text("s0")));
}

#[test]
fn freed_ids_and_released_reservations_give_their_objects_back() {
    let store = store();
    assert_eq!(store.put(3, text("event3")), None);
    assert_eq!(store.put(1, text("event1")), None);
    assert_eq!(store.put(1, text("event1'")), Some(text("event1")));
    store.set_label(7, text("label7"));
    assert_eq!(store.label(7, String::clone), Some(text("label7")));
    assert_eq!(
        store.objects(&[3, 0, 1, 99], String::clone),
        vec![text("event3"), text("event1'")]
    );
    let released = store.free(&Freed {
        objects: vec![1, 2, 99],
        reservations: vec![7, 8],
    });
    assert_eq!(released, vec![text("event1'"), text("label7")]);
    assert_eq!(store.object(1, String::clone), None);
    assert_eq!(store.object(3, String::clone), Some(text("event3")));
    assert_eq!(store.take(3), Some(text("event3")));
    assert_eq!(store.take(3), None);
    assert_eq!(store.label(7, String::clone), None);
    assert!(store.free(&Freed::default()).is_empty());
    assert_eq!(store.take_label(7), None);
}

#[test]
fn close_drops_values_streams_sources_and_labels_only() {
    let store = store();
    assert_eq!(store.set_stream(0, 0, text("stream")), None);
    store.set_label(1, text("label"));
    assert_eq!(store.put(0, text("event")), None);
    let mut released = store.clear();
    released.sort();
    assert_eq!(
        released,
        vec![text("label"), text("src0"), text("stream"), text("v0@0")]
    );
    assert_eq!(store.handle(0, String::clone), Some(text("h0")));
    assert_eq!(store.object(0, String::clone), Some(text("event")));
}
