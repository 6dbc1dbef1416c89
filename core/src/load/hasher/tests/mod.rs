use super::*;

fn hash_u64(seed: u64, x: u64) -> u64 {
    SeededState(seed).hash_one(x)
}

#[test]
fn seed_changes_every_hash() {
    for x in [0u64, 1, 42, u64::MAX] {
        assert_eq!(hash_u64(7, x), hash_u64(7, x), "deterministic for {x}");
        assert_ne!(hash_u64(7, x), hash_u64(8, x), "seed must matter for {x}");
    }
}
