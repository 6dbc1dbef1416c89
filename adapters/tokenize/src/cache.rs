//! A bounded LRU map from prompt pieces (text between cut points, see `segment.rs`) to
//! their token ids, so turn N+1 of a conversation only tokenizes what turn N did not have.
//! It decides nothing about where to cut and holds no lock; `lib.rs` wraps it in one.
//!
//! Keys are a seeded 128-bit xxh3 of the piece; the entry keeps the piece's text and a hit
//! compares it, so a hash collision costs a miss, never wrong ids. Both limits are enforced
//! on every insert by evicting least recently used entries.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use xxhash_rust::xxh3::xxh3_128_with_seed;

/// Bookkeeping bytes charged per entry on top of its text and ids.
const ENTRY_OVERHEAD_BYTES: usize = 96;

/// Limits of the prefix cache. Every field has a default (see [`Default`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CacheConfig {
    /// Most pieces kept. Default 65 536. Zero turns the cache off.
    pub entries_max: usize,
    /// Most bytes kept, counting each piece's text, 4 bytes per id and a fixed overhead.
    /// Default 256 MiB.
    pub bytes_max: usize,
    /// Pieces shorter than this are merged with the next one before caching, which keeps
    /// short markers like `<|im_end|>\n` from becoming entries of their own. Default 256.
    pub piece_bytes_min: usize,
    /// For tokenizers where a space between ASCII letters or digits is a proven split
    /// point, text between added tokens is also cut at the first such gap at or after every
    /// this many bytes from the prompt's start, so a long plain-text prefix is tokenized
    /// once. Larger strides make fewer entries but re-tokenize more of the last piece each
    /// turn. Zero turns these cuts off. Default 1024.
    pub gap_stride_bytes: usize,
    /// Seed of the piece hash, so outside input cannot aim collisions. Default a fixed value;
    /// set a random one per process.
    pub hash_seed: u64,
    /// Most words (text between word gaps, up to 64 bytes each) whose ids are remembered,
    /// so text not in the cache is tokenized a word at a time from memory. Used only where
    /// word-gap cuts are. Default 131 072 (a few MiB of typical words, at most about
    /// 50 MiB). Below 2 turns it off.
    pub words_max: usize,
}

impl Default for CacheConfig {
    fn default() -> Self {
        Self {
            entries_max: 65_536,
            bytes_max: 256 << 20,
            piece_bytes_min: 256,
            gap_stride_bytes: 1024,
            hash_seed: 0x6b76_726f_7574_6521,
            words_max: 131_072,
        }
    }
}

/// Counters of the prefix cache, monotonic except `entries` and `bytes`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CacheStats {
    /// Pieces found in the cache.
    pub hits: u64,
    /// Pieces tokenized because they were not cached.
    pub misses: u64,
    /// Token ids copied from the cache instead of being computed.
    pub tokens_reused: u64,
    /// Token ids computed by the tokenizer.
    pub tokens_encoded: u64,
    /// Entries dropped to stay within the limits.
    pub evictions: u64,
    /// Entries held now.
    pub entries: usize,
    /// Bytes held now, as counted against `bytes_max`.
    pub bytes: usize,
    /// Words of uncached text found in the word memo.
    pub word_hits: u64,
    /// Words of uncached text the tokenizer ran on (too long, or not yet remembered).
    pub word_misses: u64,
    /// Words held in the word memo now.
    pub word_entries: usize,
}

struct Entry {
    text: Box<str>,
    ids: Arc<[u32]>,
    tick: u64,
}

impl Entry {
    fn cost(&self) -> usize {
        cost(&self.text, self.ids.len())
    }
}

fn cost(text: &str, ids: usize) -> usize {
    text.len() + ids * 4 + ENTRY_OVERHEAD_BYTES
}

pub(crate) struct PieceCache {
    config: CacheConfig,
    map: HashMap<u128, Entry>,
    /// Last-use tick to key: the first entry is the least recently used.
    lru: BTreeMap<u64, u128>,
    tick: u64,
    stats: CacheStats,
}

impl PieceCache {
    pub(crate) fn new(config: CacheConfig) -> Self {
        Self { config, map: HashMap::new(), lru: BTreeMap::new(), tick: 0, stats: CacheStats::default() }
    }

    pub(crate) fn config(&self) -> &CacheConfig {
        &self.config
    }

    pub(crate) fn stats(&self) -> CacheStats {
        self.stats
    }

    pub(crate) fn key(&self, text: &str) -> u128 {
        xxh3_128_with_seed(text.as_bytes(), self.config.hash_seed)
    }

    /// The ids of `text` if cached; a hit makes the entry most recently used.
    pub(crate) fn get(&mut self, key: u128, text: &str) -> Option<Arc<[u32]>> {
        self.tick += 1;
        let tick = self.tick;
        let found = match self.map.get_mut(&key) {
            Some(e) if &*e.text == text => {
                self.lru.remove(&e.tick);
                e.tick = tick;
                self.lru.insert(tick, key);
                Some(e.ids.clone())
            }
            _ => None,
        };
        match &found {
            Some(ids) => {
                self.stats.hits += 1;
                self.stats.tokens_reused += ids.len() as u64;
            }
            None => self.stats.misses += 1,
        }
        found
    }

    /// Stores `ids` for `text`, evicting least recently used entries to fit. A piece larger
    /// than `bytes_max` on its own is not stored.
    pub(crate) fn insert(&mut self, key: u128, text: &str, ids: Arc<[u32]>) {
        self.stats.tokens_encoded += ids.len() as u64;
        let need = cost(text, ids.len());
        if self.config.entries_max == 0 || need > self.config.bytes_max {
            return;
        }
        self.remove(key);
        while self.map.len() >= self.config.entries_max || self.stats.bytes + need > self.config.bytes_max {
            let Some((_, oldest)) = self.lru.pop_first() else {
                break;
            };
            if let Some(e) = self.map.remove(&oldest) {
                self.stats.bytes -= e.cost();
                self.stats.evictions += 1;
            }
        }
        self.tick += 1;
        let entry = Entry { text: text.into(), ids, tick: self.tick };
        self.stats.bytes += entry.cost();
        self.lru.insert(self.tick, key);
        self.map.insert(key, entry);
        self.stats.entries = self.map.len();
    }

    fn remove(&mut self, key: u128) {
        if let Some(e) = self.map.remove(&key) {
            self.lru.remove(&e.tick);
            self.stats.bytes -= e.cost();
        }
        self.stats.entries = self.map.len();
    }
}

#[cfg(test)]
mod tests;
