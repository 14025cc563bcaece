//! A fast hash for maps keyed by the manager's own integers.
//!
//! The standard hasher (`SipHash`) resists keys chosen to collide, which costs a few
//! hundred instructions per lookup. The maps that use this one are keyed by handle
//! indices, location codes, storage data pointers and type addresses: numbers the
//! manager or the allocator picks, never a caller's text, so a multiply-rotate hash
//! (the one the Rust compiler uses for its own tables) is enough.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// An odd constant with well-spread bits (2**64 divided by the golden ratio).
const SEED: u64 = 0x9E37_79B9_7F4A_7C15;

/// Multiply-rotate hashing of integer keys.
#[derive(Debug, Default, Clone, Copy)]
pub struct IntHasher {
    hash: u64,
}

impl IntHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for IntHasher {
    fn write(&mut self, bytes: &[u8]) {
        let mut chunks = bytes.chunks_exact(8);
        for chunk in &mut chunks {
            let mut word = [0u8; 8];
            word.copy_from_slice(chunk);
            self.add(u64::from_le_bytes(word));
        }
        let rest = chunks.remainder();
        if !rest.is_empty() {
            let mut word = [0u8; 8];
            word[..rest.len()].copy_from_slice(rest);
            self.add(u64::from_le_bytes(word));
        }
    }

    fn write_u8(&mut self, value: u8) {
        self.add(u64::from(value));
    }

    fn write_u16(&mut self, value: u16) {
        self.add(u64::from(value));
    }

    fn write_u32(&mut self, value: u32) {
        self.add(u64::from(value));
    }

    fn write_u64(&mut self, value: u64) {
        self.add(value);
    }

    fn write_usize(&mut self, value: usize) {
        self.add(value as u64);
    }

    fn write_i64(&mut self, value: i64) {
        self.add(u64::from_ne_bytes(value.to_ne_bytes()));
    }

    fn write_isize(&mut self, value: isize) {
        self.write_usize(usize::from_ne_bytes(value.to_ne_bytes()));
    }

    fn finish(&self) -> u64 {
        // The table picks buckets from the low bits and tags from the high ones; the
        // product's best-mixed bits are the high ones, so bring some of them down.
        self.hash.rotate_left(26)
    }
}

/// Builds [`IntHasher`]s.
pub type IntHash = BuildHasherDefault<IntHasher>;

/// A `HashMap` keyed by the manager's integers (see the module documentation).
pub type IntMap<K, V> = HashMap<K, V, IntHash>;

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn equal_keys_hash_equally_and_near_keys_spread() {
        let build = IntHash::default();
        assert_eq!(build.hash_one((3u32, 7u64)), build.hash_one((3u32, 7u64)));
        assert_ne!(build.hash_one((3u32, 7u64)), build.hash_one((7u32, 3u64)));
        // Aligned pointers differ only in their middle bits; their hashes must still
        // differ in the bits the table reads.
        let hashes: std::collections::HashSet<u64> = (0..4096u64)
            .map(|index| build.hash_one((-1i64, 0x7f00_0000_0000 + index * 64)) >> 57)
            .collect();
        assert!(hashes.len() > 100, "{} distinct tags", hashes.len());
        let mut map: IntMap<(i64, u64), u32> = IntMap::default();
        for index in 0..10_000u32 {
            map.insert((-1, u64::from(index) * 4096), index);
        }
        assert_eq!(map.len(), 10_000);
        assert_eq!(map.get(&(-1, 4096 * 17)), Some(&17));
        let mut bytes = IntHasher::default();
        bytes.write(b"twelve bytes");
        let mut other = IntHasher::default();
        other.write(b"twelve bytez");
        assert_ne!(bytes.finish(), other.finish());
    }
}
