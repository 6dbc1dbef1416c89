use super::*;

fn config(entries_max: usize, bytes_max: usize) -> CacheConfig {
    CacheConfig { entries_max, bytes_max, piece_bytes_min: 0, gap_stride_bytes: 0, hash_seed: 7, words_max: 0 }
}

fn ids(n: u32) -> Arc<[u32]> {
    (0..n).collect::<Vec<_>>().into()
}

fn put(cache: &mut PieceCache, text: &str, n: u32) {
    let key = cache.key(text);
    cache.insert(key, text, ids(n));
}

fn has(cache: &mut PieceCache, text: &str) -> bool {
    let key = cache.key(text);
    cache.get(key, text).is_some()
}

#[test]
fn evicts_least_recently_used_by_entry_count() {
    let mut c = PieceCache::new(config(2, usize::MAX));
    put(&mut c, "a", 1);
    put(&mut c, "b", 1);
    assert!(has(&mut c, "a")); // "b" is now the least recently used
    put(&mut c, "c", 1);
    assert!(!has(&mut c, "b"));
    assert!(has(&mut c, "a") && has(&mut c, "c"));
    let s = c.stats();
    assert_eq!((s.entries, s.evictions), (2, 1));
}

#[test]
fn stays_within_bytes() {
    let one = cost("aaaa", 4);
    let mut c = PieceCache::new(config(100, 2 * one));
    for text in ["aaaa", "bbbb", "cccc", "dddd"] {
        put(&mut c, text, 4);
        assert!(c.stats().bytes <= 2 * one);
    }
    assert!(!has(&mut c, "aaaa") && has(&mut c, "dddd") && has(&mut c, "cccc"));
    put(&mut c, &"x".repeat(3 * one), 1); // larger than the whole budget: not stored
    assert_eq!(c.stats().entries, 2);
}

#[test]
fn reinserting_replaces_and_counts_once() {
    let mut c = PieceCache::new(config(10, usize::MAX));
    put(&mut c, "a", 3);
    put(&mut c, "a", 5);
    let key = c.key("a");
    assert_eq!(c.get(key, "a").map(|ids| ids.len()), Some(5));
    assert_eq!(c.stats().entries, 1);
    assert_eq!(c.stats().bytes, cost("a", 5));
}

#[test]
fn a_key_collision_is_a_miss_not_wrong_ids() {
    let mut c = PieceCache::new(config(10, usize::MAX));
    let key = c.key("a");
    c.insert(key, "a", ids(1));
    assert!(c.get(key, "not a").is_none());
}

#[test]
fn zero_entries_turns_caching_off() {
    let mut c = PieceCache::new(config(0, usize::MAX));
    put(&mut c, "a", 1);
    assert!(!has(&mut c, "a"));
    assert_eq!(c.stats().entries, 0);
}
