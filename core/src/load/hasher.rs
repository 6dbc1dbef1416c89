//! A seeded hasher for the tracker's tables, so outside input cannot steer collisions.
//!
//! Keys here are already well mixed (sequence hashes, request ids), but an attacker who
//! knows the public block-hash seed can still craft prompts whose hashes pile into one
//! bucket of an unkeyed table. Folding every write through xxh3 keyed by a secret seed
//! from the config closes that door at the cost of one short xxh3 per key.

use core::hash::{BuildHasher, Hasher};
use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Builds [`SeededHasher`]s that all start from one seed.
#[derive(Clone, Copy, Debug)]
pub(crate) struct SeededState(pub(crate) u64);

impl BuildHasher for SeededState {
    type Hasher = SeededHasher;

    fn build_hasher(&self) -> SeededHasher {
        SeededHasher(self.0)
    }
}

/// Chains each write through xxh3, using the running state as the next seed.
pub(crate) struct SeededHasher(u64);

impl Hasher for SeededHasher {
    fn finish(&self) -> u64 {
        self.0
    }

    fn write(&mut self, bytes: &[u8]) {
        self.0 = xxh3_64_with_seed(bytes, self.0);
    }

    fn write_u64(&mut self, x: u64) {
        self.write(&x.to_le_bytes());
    }
}

#[cfg(test)]
mod tests;
