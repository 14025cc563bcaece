//! A fast hasher for maps keyed by the core's own integers (handle indices,
//! location codes, tokens, storage addresses) or by addresses of objects.
//!
//! The keys are never chosen by an adversary, so the default hasher's protection
//! against crafted collisions buys nothing here, and these maps sit on the path of
//! every transition. One multiply per word, with the result's high bits rotated down
//! so the table's index bits depend on the whole key.

use std::collections::HashMap;
use std::hash::{BuildHasherDefault, Hasher};

/// The multiplier: odd, with well-spread bits.
const SEED: u64 = 0xF135_7AEA_2E62_A9C5;

/// Hashes a key word by word.
#[derive(Debug, Default, Clone, Copy)]
pub struct WordHasher(u64);

impl WordHasher {
    fn add(&mut self, word: u64) {
        self.0 = self.0.wrapping_add(word).wrapping_mul(SEED);
    }
}

impl Hasher for WordHasher {
    fn finish(&self) -> u64 {
        self.0.rotate_left(26)
    }

    fn write(&mut self, bytes: &[u8]) {
        for chunk in bytes.chunks(8) {
            let mut word = [0u8; 8];
            for (slot, byte) in word.iter_mut().zip(chunk) {
                *slot = *byte;
            }
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
        self.add(u64::from_ne_bytes((value as i64).to_ne_bytes()));
    }
}

/// A `HashMap` hashed by [`WordHasher`].
pub type WordMap<K, V> = HashMap<K, V, BuildHasherDefault<WordHasher>>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_that_differ_hash_apart_and_maps_work() {
        let mut map: WordMap<(u32, u32), u32> = WordMap::default();
        for handle in 0..1000u32 {
            for code in 0..3u32 {
                map.insert((handle, code), handle * 3 + code);
            }
        }
        assert_eq!(map.len(), 3000);
        assert_eq!(map.get(&(999, 2)), Some(&2999));
        let mut spread = std::collections::HashSet::new();
        for address in (0..4096usize).map(|index| index * 16) {
            let mut hasher = WordHasher::default();
            hasher.write_usize(address);
            spread.insert(hasher.finish() & 0xFFF);
        }
        // Aligned addresses still spread over the low bits a table indexes by.
        assert!(spread.len() > 2000, "{}", spread.len());
    }
}
