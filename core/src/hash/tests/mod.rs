//! Golden vectors. The salted ones were computed with the Python `xxhash` package, an
//! implementation independent of ours; the unsalted ones are the index workload's.

use super::*;
use alloc::vec::Vec;

/// Hashes `tokens` with `block_size` and the seed for (`lora`, `salt`), and compares the
/// seed, local hashes and sequence hashes with the expected ones.
#[track_caller]
fn check(tokens: &[u32], block_size: u32, lora: Option<&str>, salt: Option<&str>, want_seed: u64, want: &[(u64, u64)]) {
    let seed = HashSeed::salted(lora, salt);
    assert_eq!(seed.0, want_seed, "seed for lora={lora:?} salt={salt:?}");
    let mut out = Vec::new();
    hash_tokens(tokens, BlockSize::new(block_size).unwrap(), seed, &[], &mut out);
    let got: Vec<(u64, u64)> = out.iter().map(|b| (b.local.0, b.seq.0)).collect();
    assert_eq!(got, want, "lora={lora:?} salt={salt:?}");
}

const TWELVE: [u32; 12] = [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11];

#[test]
fn three_blocks_unsalted() {
    check(
        &TWELVE,
        4,
        None,
        None,
        1337,
        &[
            (0x7ee2cbedc694ab46, 0x7ee2cbedc694ab46),
            (0xa8416cfd935bdb13, 0x83fb702f20e2ad65),
            (0x0f1aa342314b9384, 0xebe58e326790467b),
        ],
    );
}

#[test]
fn three_blocks_with_lora() {
    check(
        &TWELVE,
        4,
        Some("my-lora"),
        None,
        0xb2041cc45cbcfedd,
        &[
            (0x9dc086fc4e1faa0b, 0x9dc086fc4e1faa0b),
            (0x95f9b4b231ae0d1f, 0x0f35a42d6142a7f6),
            (0xa3286ce1ab91a253, 0xf78a30754b3d5d99),
        ],
    );
}

#[test]
fn three_blocks_with_salt() {
    check(
        &TWELVE,
        4,
        None,
        Some("tenant-a"),
        0x1b095b6229544fb6,
        &[
            (0xec0e52f22b7e6f3e, 0xec0e52f22b7e6f3e),
            (0x8ac986527e2c2266, 0xfdaef86913237748),
            (0xc211c446d558b1d7, 0xcb97f28268884e3c),
        ],
    );
}

#[test]
fn three_blocks_with_lora_and_salt() {
    check(
        &TWELVE,
        4,
        Some("my-lora"),
        Some("tenant-a"),
        0xcd0d78268611495a,
        &[
            (0x949f543994b963d0, 0x949f543994b963d0),
            (0xdc2265037f570499, 0x60d271013c1f5d5f),
            (0xb777d13765d23201, 0xee7ff69319aa62e3),
        ],
    );
}

#[test]
fn empty_strings_count_as_absent() {
    check(&TWELVE[..4], 4, Some(""), Some(""), 1337, &[(0x7ee2cbedc694ab46, 0x7ee2cbedc694ab46)]);
}

#[test]
fn partial_block_is_not_hashed() {
    check(
        &TWELVE[..11],
        4,
        None,
        None,
        1337,
        &[(0x7ee2cbedc694ab46, 0x7ee2cbedc694ab46), (0xa8416cfd935bdb13, 0x83fb702f20e2ad65)],
    );
}

#[test]
fn workload_vectors() {
    let d = HashSeed::DEFAULT;
    assert_eq!(local_hash(&[0; 64], &[], d).0, 0xd6d50d0ca8478ea1);
    assert_eq!(local_hash(&[1; 64], &[], d).0, 0xeb3f05a0fab12018);
    let iota: Vec<u32> = (0..64).collect();
    assert_eq!(local_hash(&iota, &[], d).0, 0x304d910e689e42bf);
    assert_eq!(chain(SeqHash(0xd6d50d0ca8478ea1), LocalHash(0xeb3f05a0fab12018)).0, 0xeb8a7bda20ec48ee);
}

#[test]
fn workload_request_zero() {
    // Request 0 of the Mooncake trace: 6,758 tokens from 14 hash ids of 512 tokens.
    let ids = [0u32, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13];
    let tokens: Vec<u32> = ids.iter().flat_map(|&h| core::iter::repeat_n(h, 512)).take(6758).collect();
    let s = seq_hashes(&tokens, BlockSize::DEFAULT, HashSeed::DEFAULT);
    assert_eq!(s.len(), 105);
    let want = [
        (0, 0xd6d50d0ca8478ea1),
        (1, 0x527ef6137acbe067),
        (7, 0x23b042c4b5b3f6cc),
        (8, 0x821a8ebcd2efc8ac),
        (104, 0x7c827f491ad0101e),
    ];
    for (i, h) in want {
        assert_eq!(s[i].0, h, "seq[{i}]");
    }
}

#[test]
fn extra_keys_follow_the_tokens() {
    assert_eq!(local_hash(&[0, 1, 2, 3], &[7, 9], HashSeed::DEFAULT).0, 0x26eaecdd0b1c887f);
    let mut a = Vec::new();
    let mut b = Vec::new();
    let bs = BlockSize::new(4).unwrap();
    hash_tokens(&TWELVE, bs, HashSeed::DEFAULT, &[&[], &[5]], &mut a);
    hash_tokens(&TWELVE, bs, HashSeed::DEFAULT, &[], &mut b);
    assert_eq!(a[0], b[0], "block 0 has no extra keys");
    assert_ne!(a[1].local, b[1].local, "an extra key changes the local hash");
    assert_ne!(a[2].seq, b[2].seq, "and every sequence hash after it");
}

#[test]
fn block_sizes() {
    for ok in [1, 2, 64, 1024] {
        assert!(BlockSize::new(ok).is_ok(), "{ok}");
    }
    for bad in [0, 3, 63, 2048] {
        assert_eq!(BlockSize::new(bad), Err(BlockSizeError::Invalid { tokens: bad }));
    }
}

#[test]
fn chain_all_matches_hash_tokens() {
    let mut direct = Vec::new();
    hash_tokens(&TWELVE, BlockSize::new(4).unwrap(), HashSeed::DEFAULT, &[], &mut direct);
    let locals: Vec<LocalHash> = direct.iter().map(|b| b.local).collect();
    let mut chained = Vec::new();
    chain_all(None, &locals, &mut chained);
    assert_eq!(direct, chained);
    let mut tail = Vec::new();
    chain_all(Some(direct[0].seq), &locals[1..], &mut tail);
    assert_eq!(&direct[1..], &tail[..]);
}

mod media;
