//! The order a transition report record lists its fields in, and its times.

use residency_core::report::{AllocatorReadings, Field, REPORT_FIELDS, TransitionFacts, now_ns};

#[test]
fn report_fields_follow_the_record_declaration() {
    let facts = TransitionFacts::completed_now(
        "action",
        true,
        Some("source"),
        None,
        16,
        32,
        5,
        Some(Box::new(AllocatorReadings {
            device: "cuda:0",
            before: Some(("a0", "r0")),
            after: None,
        })),
        Some("reason"),
    );
    let fields = facts.fields();
    assert_eq!(fields.len(), REPORT_FIELDS);
    assert_eq!(fields[0], Field::Object(&"action"));
    assert_eq!(fields[1], Field::Flag(true));
    assert_eq!(fields[2], Field::Object(&"source"));
    assert_eq!(fields[3], Field::None);
    assert_eq!(fields[4], Field::Count(16));
    assert_eq!(fields[5], Field::Count(32));
    assert_eq!(fields[6], Field::Count(5));
    assert_eq!(fields[8], Field::Object(&"cuda:0"));
    assert_eq!(fields[9], Field::Object(&"a0"));
    assert_eq!(fields[10], Field::Object(&"r0"));
    assert_eq!(fields[11], Field::None);
    assert_eq!(fields[12], Field::None);
    assert_eq!(fields[13], Field::Object(&"reason"));
}

#[test]
fn a_transition_completes_no_earlier_than_it_started() {
    let later = now_ns() + 1_000_000_000_000;
    let facts = TransitionFacts::completed_now("a", false, None, None, 0, 0, later, None, None);
    assert_eq!(facts.completed, later);
    assert_eq!(facts.fields()[7], Field::Count(later));
    // Without an allocator reading, its device and figures are absent.
    assert!(
        facts.fields()[8..13]
            .iter()
            .all(|field| *field == Field::None)
    );
    let now = TransitionFacts::completed_now("a", false, None, None, 0, 0, 0, None, None);
    assert!(now.completed > 0);
}
