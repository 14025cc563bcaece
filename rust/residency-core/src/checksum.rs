//! Checksums of stored bytes: XXH3 with 64-bit output, one-shot or streaming.
//!
//! The disk tier records one per storage of each file it writes and compares it with
//! the bytes it reads back (docs/concepts/locations-and-budgets.md#disk). XXH3 is not a
//! cryptographic hash: it detects damage (flipped bits, zeroed ranges, torn writes),
//! not tampering by someone who can also rewrite the record.

use std::fmt;

use xxhash_rust::xxh3::Xxh3;

/// The algorithm's name as files record it.
pub const ALGORITHM: &str = "xxh3-64";

/// The XXH3-64 checksum of `bytes` (seed 0).
pub fn checksum(bytes: &[u8]) -> u64 {
    xxhash_rust::xxh3::xxh3_64(bytes)
}

/// A streaming XXH3-64 checksum: feeding the bytes in any number of pieces gives the
/// same digest as `checksum` of them all at once.
#[derive(Clone, Default)]
pub struct Checksum {
    state: Xxh3,
}

impl Checksum {
    /// A checksum of no bytes yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds `bytes`, which follow everything added before.
    pub fn update(&mut self, bytes: &[u8]) {
        self.state.update(bytes);
    }

    /// The checksum of every byte added so far (more may be added after).
    pub fn digest(&self) -> u64 {
        self.state.digest()
    }

    /// Starts again from no bytes.
    pub fn reset(&mut self) {
        self.state.reset();
    }
}

impl fmt::Debug for Checksum {
    fn fmt(&self, formatter: &mut fmt::Formatter<'_>) -> fmt::Result {
        formatter
            .debug_struct("Checksum")
            .field("algorithm", &ALGORITHM)
            .field("digest", &format_args!("{:016x}", self.digest()))
            .finish()
    }
}
