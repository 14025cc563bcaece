//! The disk tier's checksum: known XXH3-64 vectors, and streaming equals one-shot.

use residency_core::checksum::{ALGORITHM, Checksum, checksum};

/// Bytes 0, 1, 2, ... wrapping at 251 (a prime, so no power-of-two period).
fn pattern(length: usize) -> Vec<u8> {
    (0..length)
        .map(|i| u8::try_from(i % 251).unwrap_or(0))
        .collect()
}

#[test]
fn known_vectors() {
    assert_eq!(ALGORITHM, "xxh3-64");
    // The reference implementation's values (xxhsum -H3, seed 0).
    assert_eq!(checksum(b""), 0x2d06_8005_38d3_94c2);
    assert_eq!(checksum(b"a"), 0xe6c6_32b6_1e96_4e1f);
    assert_eq!(checksum(b"abc"), 0x78af_5f94_892f_3950);
    assert_eq!(Checksum::new().digest(), checksum(b""));
}

#[test]
fn streaming_equals_one_shot() {
    // Lengths around the algorithm's internal block and stripe boundaries.
    for length in [
        0,
        1,
        3,
        16,
        17,
        128,
        129,
        240,
        241,
        1024,
        1025,
        4096,
        65_537,
        1 << 20,
    ] {
        let bytes = pattern(length);
        let whole = checksum(&bytes);
        for piece in [1, 7, 64, 4096, 1 << 16] {
            let mut streaming = Checksum::new();
            for chunk in bytes.chunks(piece) {
                streaming.update(chunk);
            }
            assert_eq!(
                streaming.digest(),
                whole,
                "length {length}, pieces of {piece}"
            );
        }
        let mut once = Checksum::new();
        once.update(&bytes);
        assert_eq!(once.digest(), whole);
    }
}

#[test]
fn damage_changes_the_digest_and_reset_starts_over() {
    let mut bytes = pattern(1 << 16);
    let clean = checksum(&bytes);
    bytes[12_345] ^= 0x10;
    assert_ne!(checksum(&bytes), clean);
    bytes[12_345] ^= 0x10;
    bytes[100..4196].fill(0);
    assert_ne!(checksum(&bytes), clean);

    let mut streaming = Checksum::new();
    streaming.update(b"something else");
    streaming.reset();
    streaming.update(&pattern(1 << 16));
    assert_eq!(streaming.digest(), clean);
    assert!(format!("{streaming:?}").contains(&format!("{clean:016x}")));
}
