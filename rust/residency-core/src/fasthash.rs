//! A fast, non-cryptographic hasher for the core's internal maps.
//!
//! Every key hashed here is an integer the manager issued or measured (handle
//! indices, location codes, tokens, storage addresses), never data an attacker
//! chooses, so the standard library's flood-resistant `SipHash` buys nothing and costs
//! most of a lookup. This is the multiply-rotate scheme rustc uses for its own maps.

use std::collections::{HashMap, HashSet};
use std::hash::{BuildHasherDefault, Hasher};

/// A `HashMap` with the fast hasher.
pub type FastMap<K, V> = HashMap<K, V, BuildHasherDefault<FastHasher>>;
/// A `HashSet` with the fast hasher.
pub type FastSet<T> = HashSet<T, BuildHasherDefault<FastHasher>>;

const SEED: u64 = 0x51_7c_c1_b7_27_22_0a_95;

/// Multiply-rotate hashing, one word at a time.
#[derive(Debug, Default, Clone, Copy)]
pub struct FastHasher {
    hash: u64,
}

impl FastHasher {
    fn add(&mut self, word: u64) {
        self.hash = (self.hash.rotate_left(5) ^ word).wrapping_mul(SEED);
    }
}

impl Hasher for FastHasher {
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

    fn finish(&self) -> u64 {
        self.hash
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::hash::BuildHasher;

    #[test]
    fn equal_keys_hash_equal_and_nearby_keys_spread() {
        let build = BuildHasherDefault::<FastHasher>::default();
        assert_eq!(build.hash_one((3u32, 7u32)), build.hash_one((3u32, 7u32)));
        let hashes: FastSet<u64> = (0u64..1000).map(|key| build.hash_one(key)).collect();
        assert_eq!(hashes.len(), 1000);
        let mut map: FastMap<(u32, u32), u32> = FastMap::default();
        for index in 0..500 {
            map.insert((index, index % 3), index);
        }
        assert_eq!(map.get(&(42, 0)), Some(&42));
        assert_eq!(map.len(), 500);
    }
}
