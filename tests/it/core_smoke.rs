use router_core::{seq_hashes, BlockSize, HashSeed};

#[test]
fn core_hashes_a_prompt_from_outside_the_crate() {
    let tokens: Vec<u32> = (0..130).collect();
    let s = seq_hashes(&tokens, BlockSize::DEFAULT, HashSeed::DEFAULT);
    assert_eq!(s.len(), 2);
    assert_ne!(s[0], s[1]);
}
