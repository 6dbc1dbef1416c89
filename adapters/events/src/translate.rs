//! Translation of decoded engine events into the router's own block hashes.
//!
//! Engine block hashes are opaque to the router, so for every `BlockStored` the
//! translator recomputes the router's local and sequence hashes from `token_ids` and
//! `block_size` (salted by the adapter and the cache salt, as below), and
//! remembers engine hash → router sequence hash so `BlockRemoved` and later
//! `parent_block_hash` links can be mapped back. One translator serves one
//! (worker, dp rank). It does no I/O; applying the resulting [`RouterEvent`]s to an
//! index is left to an [`EventSink`].
//!
//! Policies, each counted in [`TranslateStats`]:
//! * A stored event whose parent is unknown (never seen, or forgotten) is dropped:
//!   guessing "root" would file the blocks under the wrong prefix and attract requests
//!   the worker cannot serve from cache, while dropping only under-reports.
//! * A block size other than the configured one is a configuration error: the event is
//!   dropped and [`TranslateError::BlockSizeMismatch`] returned, so the index never
//!   holds hashes computed with the wrong block size.
//! * The map holds at most `blocks_max` engine hashes. Past that the engine must have
//!   evicted blocks whose removal we missed, so the entry stored (or re-stored) longest
//!   ago is forgotten and a `Removed` for it is emitted, keeping index and map in step.
//! * Events of a KV-cache group other than `kv_group` are ignored (hybrid models emit
//!   one stream per group; the router tracks one).
//! * Per-block `extra_keys` are read the way vLLM writes them (see
//!   `vllm/v1/core/kv_cache_utils.py`, `generate_block_hash_extra_keys`): the LoRA name
//!   on every block of an adapter's request, then multimodal keys, then the request's
//!   `cache_salt` on the prompt's first block only (later blocks inherit it through the
//!   chain). The router salts every block of a request with one [`HashSeed`] built from
//!   the adapter and the salt, so a root block's salt sets the seed of its whole chain:
//!   each remembered block keeps its seed, and its children reuse it. A worker's
//!   configured `cache_salt` applies to root blocks that carry none.
//! * Media keys, `[identifier, offset]` pairs after the LoRA name, are folded into the
//!   block's local hash as the core's [`router_core::MediaKey`] words, exactly as a
//!   request's media items are ([`router_core::hash_tokens_with_media`]), so an image
//!   request matches the blocks vLLM holds for its image and no other request does.
//! * A block with any other extra key (a prompt-embedding digest, audio or video keys
//!   of another shape, a string where no salt can be) cannot be reproduced from a
//!   request: it and every block chained after it are remembered (so removals and
//!   children resolve) but never indexed, and counted in
//!   [`TranslateStats::opaque_blocks`].
//! * The deprecated `lora_id` is not hashed.

use std::collections::VecDeque;
use std::hash::BuildHasher;

use core::fmt;
use hashbrown::HashMap;
use router_core::{chain, BlockHash, BlockSize, HashSeed, LocalHash, MediaKey, SeqHash, Tier, WorkerKey};
use xxhash_rust::xxh3::xxh3_64_with_seed;

use crate::decode::{EngineHash, EventRef, ExtraKey, RemovedRef, StoredRef};

/// An index update in router terms, owned.
#[derive(Clone, PartialEq, Eq, Debug)]
pub enum RouterEvent {
    /// Blocks now held in `tier`, chained after `parent` (`None`: from the root).
    Stored {
        /// Sequence hash of the block before the first one.
        parent: Option<SeqHash>,
        /// The blocks, in prefix order.
        blocks: Vec<BlockHash>,
        /// Where they are held.
        tier: Tier,
    },
    /// Blocks no longer held in `tier`.
    Removed {
        /// Their sequence hashes.
        blocks: Vec<SeqHash>,
        /// The tier they left.
        tier: Tier,
    },
    /// The worker dropped every block.
    Cleared,
}

impl RouterEvent {
    /// The borrowed form the core's index and `Router::handle_kv_event` take.
    pub fn as_index_event(&self) -> router_core::IndexEvent<'_> {
        use router_core::IndexEvent;
        match self {
            RouterEvent::Stored { parent, blocks, tier } => IndexEvent::Stored { parent: *parent, blocks, tier: *tier },
            RouterEvent::Removed { blocks, tier } => IndexEvent::Removed { blocks, tier: *tier },
            RouterEvent::Cleared => IndexEvent::Cleared,
        }
    }
}

/// The core's exact index is a sink as it stands (tests compare it with a lossless run).
/// It has no notion of trust; the `Router` façade does.
impl EventSink for router_core::PrefixIndex {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        // Counted inside the index; a refused event changes nothing.
        let _ = router_core::PrefixIndex::apply(self, key, ev.as_index_event());
    }
    fn clear_worker(&mut self, key: WorkerKey) {
        self.clear_key(key);
    }
    fn set_trusted(&mut self, _key: WorkerKey, _trusted: bool) {}
}

/// The router façade is a sink too: events for unregistered workers are counted and
/// dropped there, and a gap's distrust reaches its cost model.
impl EventSink for router_core::Router {
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent) {
        // The router counts what it refuses (unknown worker, bad event).
        let _ = self.handle_kv_event(router_core::Instant::ZERO, key, ev.as_index_event());
    }
    fn clear_worker(&mut self, key: WorkerKey) {
        self.handle_kv_clear(key);
    }
    fn set_trusted(&mut self, key: WorkerKey, trusted: bool) {
        self.handle_overlap_trust(key, trusted);
    }
}

/// Where index updates go (the router's prefix index, or a test model).
pub trait EventSink {
    /// Applies one update for `key`.
    fn apply(&mut self, key: WorkerKey, ev: &RouterEvent);
    /// Forgets everything known about `key` (restart, lost events, removal).
    fn clear_worker(&mut self, key: WorkerKey);
    /// Marks `key`'s entries as (un)reliable, for example while a gap is open.
    fn set_trusted(&mut self, key: WorkerKey, trusted: bool);
}

/// Per-(worker, rank) translation settings.
#[derive(Clone, Debug)]
pub struct TranslateConfig {
    /// The block size the router hashes with; events must match it. Default 64.
    pub block_size: BlockSize,
    /// The worker's cache salt, for root blocks whose `extra_keys` carry none.
    pub cache_salt: Option<String>,
    /// Most engine hashes remembered. Default 1,048,576.
    pub blocks_max: usize,
    /// The KV-cache group tracked. Default 0.
    pub kv_group: u32,
    /// Seed of the engine-hash map's hasher. Default 0; set per process.
    pub map_seed: u64,
}

impl Default for TranslateConfig {
    fn default() -> Self {
        TranslateConfig {
            block_size: BlockSize::DEFAULT,
            cache_salt: None,
            blocks_max: 1 << 20,
            kv_group: 0,
            map_seed: 0,
        }
    }
}

/// Why one event was not translated.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
#[non_exhaustive]
pub enum TranslateError {
    /// The event's block size differs from the configured one (a deployment error).
    BlockSizeMismatch {
        /// Configured tokens per block.
        configured: u32,
        /// The event's tokens per block.
        got: u32,
    },
    /// `token_ids` does not hold exactly `block_hashes × block_size` tokens.
    TokenCountMismatch {
        /// Blocks in the event.
        blocks: usize,
        /// Tokens in the event.
        tokens: usize,
    },
    /// `parent_block_hash` names a block this translator does not know.
    UnknownParent,
    /// `extra_keys` does not hold one entry per block.
    ExtraKeysMismatch {
        /// Blocks in the event.
        blocks: usize,
        /// Entries in `extra_keys`.
        entries: usize,
    },
}

impl fmt::Display for TranslateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TranslateError::BlockSizeMismatch { configured, got } => {
                write!(f, "engine block size {got} differs from the configured {configured} tokens")
            }
            TranslateError::TokenCountMismatch { blocks, tokens } => {
                write!(f, "{tokens} tokens do not fill {blocks} blocks exactly")
            }
            TranslateError::UnknownParent => f.write_str("parent block hash is unknown"),
            TranslateError::ExtraKeysMismatch { blocks, entries } => {
                write!(f, "{entries} extra_keys entries for {blocks} blocks")
            }
        }
    }
}

impl std::error::Error for TranslateError {}

/// Counters of one translator.
#[derive(Clone, Copy, PartialEq, Eq, Debug, Default)]
pub struct TranslateStats {
    /// Blocks passed on as stored.
    pub stored_blocks: u64,
    /// Blocks passed on as removed.
    pub removed_blocks: u64,
    /// Stored events dropped for an unknown parent.
    pub unknown_parent: u64,
    /// Removed hashes not known in that tier (ignored).
    pub unknown_removed: u64,
    /// Entries forgotten to stay within `blocks_max`.
    pub evicted: u64,
    /// Events of another KV-cache group, ignored.
    pub other_group: u64,
    /// Events dropped for a block size mismatch.
    pub block_size_mismatch: u64,
    /// Events dropped for a token count mismatch.
    pub token_count_mismatch: u64,
    /// Events dropped for an `extra_keys` list of the wrong length.
    pub extra_keys_mismatch: u64,
    /// Blocks remembered but not indexed: their extra keys (or a parent's) cannot be
    /// reproduced from a request.
    pub opaque_blocks: u64,
    /// Blocks indexed with media keys folded in.
    pub media_blocks: u64,
}

#[derive(Clone, Copy, Debug)]
struct Slot {
    /// The router's sequence hash; meaningless when `opaque`.
    seq: SeqHash,
    /// The seed of the block's chain, reused by its children.
    seed: HashSeed,
    /// Matches the live entry in the insertion queue.
    stamp: u64,
    /// Bit per [`Tier`] holding the block.
    tiers: u8,
    /// The block is not in the index: the router cannot reproduce its hash.
    opaque: bool,
}

/// Where a block attaches, as the translator walks an event's blocks.
#[derive(Clone, Copy, Debug)]
enum Link {
    /// The first block of a prompt.
    Root,
    /// After an indexed block with this sequence hash and chain seed.
    After(SeqHash, HashSeed),
    /// After an opaque block: opaque too.
    Opaque,
}

/// What a block's extra keys add to the router's hash: `Ok(salt)` when reproducible,
/// with the block's media words left in `media`.
///
/// vLLM's order is the LoRA name, media pairs, then the cache salt: a leading string
/// equal to the event's `lora_name` is the adapter's key (the seed already carries it),
/// and one string left on a root block is the request's cache salt.
fn block_keys<'b>(
    lora: Option<&str>,
    keys: impl Iterator<Item = ExtraKey<'b>>,
    root: bool,
    media: &mut Vec<u64>,
) -> Result<Option<&'b str>, ()> {
    media.clear();
    let mut keys = keys.peekable();
    if let (Some(l), Some(&ExtraKey::Str(k))) = (lora, keys.peek()) {
        if k == l {
            keys.next();
        }
    }
    while let Some(&ExtraKey::Media { identifier, offset_tokens }) = keys.peek() {
        media.extend_from_slice(&MediaKey::of(identifier.as_bytes()).extra_keys(offset_tokens));
        keys.next();
    }
    match (keys.next(), keys.next()) {
        (None, _) => Ok(None),
        (Some(ExtraKey::Str(salt)), None) if root => Ok(Some(salt)),
        _ => Err(()),
    }
}

#[derive(Clone, Copy, Debug)]
struct SeededState(u64);

struct SeededHasher {
    seed: u64,
    acc: u64,
}

impl BuildHasher for SeededState {
    type Hasher = SeededHasher;
    fn build_hasher(&self) -> SeededHasher {
        SeededHasher { seed: self.0, acc: 0 }
    }
}

impl std::hash::Hasher for SeededHasher {
    fn write(&mut self, bytes: &[u8]) {
        self.acc = xxh3_64_with_seed(bytes, self.seed ^ self.acc);
    }
    fn finish(&self) -> u64 {
        self.acc
    }
}

const fn tier_bit(t: Tier) -> u8 {
    match t {
        Tier::Device => 1,
        Tier::Host => 2,
        Tier::Disk => 4,
    }
}

/// `router_core::local_hash(tokens, extra, seed)`, into a reused buffer: the
/// core's version zeroes a 4 KiB stack buffer per block, which dominated decoding
/// of 64-token blocks. Equality with the core is tested.
fn local_hash_into(buf: &mut Vec<u8>, tokens: &[u32], extra: &[u64], seed: HashSeed) -> LocalHash {
    buf.resize(tokens.len() * 4 + extra.len() * 8, 0);
    let (tok_bytes, extra_bytes) = buf.split_at_mut(tokens.len() * 4);
    for (dst, t) in tok_bytes.chunks_exact_mut(4).zip(tokens) {
        dst.copy_from_slice(&t.to_le_bytes());
    }
    for (dst, k) in extra_bytes.chunks_exact_mut(8).zip(extra) {
        dst.copy_from_slice(&k.to_le_bytes());
    }
    LocalHash(xxh3_64_with_seed(buf, seed.0))
}

const TIERS: [Tier; 3] = [Tier::Device, Tier::Host, Tier::Disk];

/// Engine-hash bookkeeping and hash recomputation for one (worker, rank).
pub struct Translator {
    cfg: TranslateConfig,
    map: HashMap<EngineHash, Slot, SeededState>,
    /// Insertion order for eviction; entries whose stamp no longer matches are stale.
    order: VecDeque<(EngineHash, u64)>,
    stamp: u64,
    stats: TranslateStats,
    /// Reused buffer for one block's token bytes.
    bytes: Vec<u8>,
    /// Reused buffer for one block's media words.
    media: Vec<u64>,
}

impl Translator {
    /// An empty translator.
    pub fn new(cfg: TranslateConfig) -> Self {
        let map = HashMap::with_hasher(SeededState(cfg.map_seed));
        Translator {
            cfg,
            map,
            order: VecDeque::new(),
            stamp: 0,
            stats: TranslateStats::default(),
            bytes: Vec::new(),
            media: Vec::new(),
        }
    }

    /// Engine hashes currently remembered.
    pub fn len(&self) -> usize {
        self.map.len()
    }

    /// True when nothing is remembered.
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }

    /// The counters.
    pub fn stats(&self) -> &TranslateStats {
        &self.stats
    }

    /// Forgets every mapping (the sink is cleared separately).
    pub fn clear(&mut self) {
        self.map.clear();
        self.order.clear();
    }

    /// Translates one event, appending zero or more updates to `out`.
    ///
    /// Work is linear in the event's tokens and blocks (plus amortised O(1) eviction).
    pub fn translate(&mut self, ev: EventRef<'_>, out: &mut Vec<RouterEvent>) -> Result<(), TranslateError> {
        match ev {
            EventRef::Stored(s) => self.stored(s, out),
            EventRef::Removed(r) => {
                self.removed(r, out);
                Ok(())
            }
            EventRef::Cleared => {
                self.clear();
                out.push(RouterEvent::Cleared);
                Ok(())
            }
        }
    }

    fn stored(&mut self, s: StoredRef<'_>, out: &mut Vec<RouterEvent>) -> Result<(), TranslateError> {
        if s.group_idx != self.cfg.kv_group {
            self.stats.other_group += 1;
            return Ok(());
        }
        let bs = self.cfg.block_size.tokens();
        if s.block_size != bs {
            self.stats.block_size_mismatch += 1;
            return Err(TranslateError::BlockSizeMismatch { configured: bs, got: s.block_size });
        }
        let n = s.block_hashes.len();
        if s.token_ids.len() != n * bs as usize {
            self.stats.token_count_mismatch += 1;
            return Err(TranslateError::TokenCountMismatch { blocks: n, tokens: s.token_ids.len() });
        }
        if let Some(x) = s.extra_keys.filter(|x| x.len() != n) {
            self.stats.extra_keys_mismatch += 1;
            return Err(TranslateError::ExtraKeysMismatch { blocks: n, entries: x.len() });
        }
        let mut link = match s.parent {
            None => Link::Root,
            Some(h) => match self.map.get(&h) {
                Some(slot) if slot.opaque => Link::Opaque,
                Some(slot) => Link::After(slot.seq, slot.seed),
                None => {
                    self.stats.unknown_parent += 1;
                    return Err(TranslateError::UnknownParent);
                }
            },
        };
        let parent = match link {
            Link::After(seq, _) => Some(seq),
            Link::Root | Link::Opaque => None,
        };
        let bit = tier_bit(s.tier);
        let mut blocks = Vec::with_capacity(n);
        for (i, (tokens, &h)) in s.token_ids.chunks_exact(bs as usize).zip(s.block_hashes).enumerate() {
            let keys = s.extra_keys.into_iter().flat_map(|x| x.block(i));
            let salt = block_keys(s.lora_name, keys, matches!(link, Link::Root), &mut self.media);
            let (prev, seed) = match (link, salt) {
                (Link::Root, Ok(salt)) => {
                    (None, HashSeed::salted(s.lora_name, salt.or(self.cfg.cache_salt.as_deref())))
                }
                (Link::After(p, seed), Ok(None)) => (Some(p), seed),
                _ => {
                    link = Link::Opaque;
                    self.stats.opaque_blocks += 1;
                    self.remember(
                        h,
                        Slot { seq: SeqHash(0), seed: HashSeed::DEFAULT, stamp: 0, tiers: bit, opaque: true },
                    );
                    continue;
                }
            };
            let local = local_hash_into(&mut self.bytes, tokens, &self.media, seed);
            self.stats.media_blocks += u64::from(!self.media.is_empty());
            let seq = match prev {
                None => SeqHash(local.0),
                Some(p) => chain(p, local),
            };
            blocks.push(BlockHash { seq, local });
            link = Link::After(seq, seed);
            self.remember(h, Slot { seq, seed, stamp: 0, tiers: bit, opaque: false });
        }
        self.stats.stored_blocks += blocks.len() as u64;
        if !blocks.is_empty() {
            out.push(RouterEvent::Stored { parent, blocks, tier: s.tier });
        }
        while self.map.len() > self.cfg.blocks_max {
            self.evict_oldest(out);
        }
        self.compact();
        Ok(())
    }

    /// Records `h` as `new` (its `stamp` is assigned here) in one more tier.
    fn remember(&mut self, h: EngineHash, new: Slot) {
        self.stamp += 1;
        let stamp = self.stamp;
        let slot = self.map.entry(h).or_insert(Slot { tiers: 0, ..new });
        if (slot.seq, slot.seed, slot.opaque) != (new.seq, new.seed, new.opaque) {
            // The engine reused a hash for other content: the new content wins.
            *slot = Slot { tiers: 0, ..new };
        }
        slot.tiers |= new.tiers;
        slot.stamp = stamp;
        self.order.push_back((h, stamp));
    }

    fn removed(&mut self, r: RemovedRef<'_>, out: &mut Vec<RouterEvent>) {
        if r.group_idx != self.cfg.kv_group {
            self.stats.other_group += 1;
            return;
        }
        let bit = tier_bit(r.tier);
        let mut blocks = Vec::with_capacity(r.block_hashes.len());
        for h in r.block_hashes {
            match self.map.get_mut(h) {
                Some(slot) if slot.tiers & bit != 0 => {
                    slot.tiers &= !bit;
                    if !slot.opaque {
                        blocks.push(slot.seq);
                    }
                    if slot.tiers == 0 {
                        self.map.remove(h);
                    }
                }
                _ => self.stats.unknown_removed += 1,
            }
        }
        if !blocks.is_empty() {
            self.stats.removed_blocks += blocks.len() as u64;
            out.push(RouterEvent::Removed { blocks, tier: r.tier });
        }
    }

    fn evict_oldest(&mut self, out: &mut Vec<RouterEvent>) {
        while let Some((h, stamp)) = self.order.pop_front() {
            let live = self.map.get(&h).is_some_and(|s| s.stamp == stamp);
            if !live {
                continue;
            }
            if let Some(slot) = self.map.remove(&h) {
                self.stats.evicted += 1;
                for t in TIERS {
                    if !slot.opaque && slot.tiers & tier_bit(t) != 0 {
                        out.push(RouterEvent::Removed { blocks: vec![slot.seq], tier: t });
                    }
                }
            }
            return;
        }
    }

    /// Drops stale queue entries once they outnumber live ones, keeping the queue
    /// within twice the map (plus slack) at amortised O(1) per insertion.
    fn compact(&mut self) {
        if self.order.len() > 2 * self.map.len() + 1024 {
            let map = &self.map;
            self.order.retain(|(h, s)| map.get(h).is_some_and(|slot| slot.stamp == *s));
        }
    }
}

#[cfg(test)]
mod tests;
