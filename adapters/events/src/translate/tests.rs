use super::*;
use router_core::seq_hashes;

fn h(v: i128) -> EngineHash {
    EngineHash::from_int(v).unwrap()
}

fn bs4() -> TranslateConfig {
    TranslateConfig { block_size: BlockSize::new(4).unwrap(), ..TranslateConfig::default() }
}

fn stored<'a>(hashes: &'a [EngineHash], parent: Option<EngineHash>, tokens: &'a [u32], tier: Tier) -> EventRef<'a> {
    EventRef::Stored(StoredRef {
        block_hashes: hashes,
        parent,
        token_ids: tokens,
        block_size: 4,
        tier,
        lora_name: None,
        group_idx: 0,
        has_extra_keys: false,
    })
}

fn removed(hashes: &[EngineHash], tier: Tier) -> EventRef<'_> {
    EventRef::Removed(RemovedRef { block_hashes: hashes, tier, group_idx: 0 })
}

/// Feeds events in order; returns everything emitted, or the first error's index.
#[track_caller]
fn run(t: &mut Translator, evs: &[EventRef<'_>]) -> Vec<RouterEvent> {
    let mut out = Vec::new();
    for ev in evs {
        t.translate(*ev, &mut out).unwrap();
    }
    out
}

fn seqs(out: &[RouterEvent]) -> Vec<SeqHash> {
    out.iter()
        .flat_map(|e| match e {
            RouterEvent::Stored { blocks, .. } => blocks.iter().map(|b| b.seq).collect(),
            RouterEvent::Removed { blocks, .. } => blocks.clone(),
            RouterEvent::Cleared => Vec::new(),
        })
        .collect()
}

const TOKENS: [u32; 16] = [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16];

#[test]
fn stored_blocks_hash_like_the_router_whatever_the_split() {
    let bs = BlockSize::new(4).unwrap();
    let want = seq_hashes(&TOKENS, bs, HashSeed::DEFAULT);
    // One event of four blocks, and the same blocks as two events linked by parent.
    let hs = [h(1), h(2), h(3), h(4)];
    let whole = run(&mut Translator::new(bs4()), &[stored(&hs, None, &TOKENS, Tier::Device)]);
    assert_eq!(seqs(&whole), want);
    let split = run(
        &mut Translator::new(bs4()),
        &[stored(&hs[..1], None, &TOKENS[..4], Tier::Device), stored(&hs[1..], Some(h(1)), &TOKENS[4..], Tier::Device)],
    );
    assert_eq!(seqs(&split), want);
    assert!(matches!(&split[1], RouterEvent::Stored { parent: Some(p), .. } if *p == want[0]));
}

#[test]
fn lora_and_cache_salt_change_the_seed() {
    let bs = BlockSize::new(4).unwrap();
    let cfg = TranslateConfig { cache_salt: Some("tenant".into()), ..bs4() };
    let mut t = Translator::new(cfg);
    let one = [h(1)];
    let ev = EventRef::Stored(StoredRef {
        lora_name: Some("ad"),
        ..match stored(&one, None, &TOKENS[..4], Tier::Device) {
            EventRef::Stored(s) => s,
            _ => unreachable!(),
        }
    });
    let got = run(&mut t, &[ev]);
    assert_eq!(seqs(&got), seq_hashes(&TOKENS[..4], bs, HashSeed::salted(Some("ad"), Some("tenant"))));
    assert_ne!(seqs(&got), seq_hashes(&TOKENS[..4], bs, HashSeed::DEFAULT));
}

#[track_caller]
fn check_err(ev: EventRef<'_>, want: TranslateError) {
    let mut t = Translator::new(bs4());
    let mut out = Vec::new();
    assert_eq!(t.translate(ev, &mut out), Err(want));
    assert!(out.is_empty() && t.is_empty());
}

#[test]
fn bad_events_are_refused_whole() {
    check_err(stored(&[h(1)], Some(h(99)), &TOKENS[..4], Tier::Device), TranslateError::UnknownParent);
    check_err(
        stored(&[h(1), h(2)], None, &TOKENS[..6], Tier::Device),
        TranslateError::TokenCountMismatch { blocks: 2, tokens: 6 },
    );
    let one = [h(1)];
    let mut wrong_size = match stored(&one, None, &TOKENS[..8], Tier::Device) {
        EventRef::Stored(s) => s,
        _ => unreachable!(),
    };
    wrong_size.block_size = 8;
    check_err(EventRef::Stored(wrong_size), TranslateError::BlockSizeMismatch { configured: 4, got: 8 });
}

#[test]
fn removal_is_per_tier_and_maps_back() {
    let mut t = Translator::new(bs4());
    let stored_ev = run(
        &mut t,
        &[stored(&[h(1)], None, &TOKENS[..4], Tier::Device), stored(&[h(1)], None, &TOKENS[..4], Tier::Host)],
    );
    let s = seqs(&stored_ev)[0];
    let gone = run(&mut t, &[removed(&[h(1), h(7)], Tier::Device)]);
    assert_eq!(gone, vec![RouterEvent::Removed { blocks: vec![s], tier: Tier::Device }]);
    assert_eq!(t.stats().unknown_removed, 1);
    assert_eq!(t.len(), 1, "still held on the host");
    assert!(run(&mut t, &[removed(&[h(1)], Tier::Device)]).is_empty());
    assert_eq!(
        run(&mut t, &[removed(&[h(1)], Tier::Host)]),
        vec![RouterEvent::Removed { blocks: vec![s], tier: Tier::Host }]
    );
    assert!(t.is_empty());
}

#[test]
fn capacity_evicts_the_oldest_and_says_so() {
    let mut t = Translator::new(TranslateConfig { blocks_max: 2, ..bs4() });
    let out = run(
        &mut t,
        &[
            stored(&[h(1)], None, &TOKENS[..4], Tier::Device),
            stored(&[h(2)], None, &TOKENS[4..8], Tier::Host),
            stored(&[h(1)], None, &TOKENS[..4], Tier::Device),
            stored(&[h(3)], None, &TOKENS[8..12], Tier::Device),
        ],
    );
    let second = seq_hashes(&TOKENS[4..8], BlockSize::new(4).unwrap(), HashSeed::DEFAULT)[0];
    assert_eq!(out.last(), Some(&RouterEvent::Removed { blocks: vec![second], tier: Tier::Host }));
    assert_eq!((t.len(), t.stats().evicted), (2, 1));
}

#[test]
fn queue_stays_bounded_under_churn() {
    let mut t = Translator::new(TranslateConfig { blocks_max: 4, ..bs4() });
    for i in 0..10_000 {
        run(&mut t, &[stored(&[h(i % 3)], None, &TOKENS[..4], Tier::Device)]);
    }
    assert!(t.order.len() <= 2 * t.len() + 1024 + 1);
}

#[test]
fn cleared_and_other_groups() {
    let mut t = Translator::new(bs4());
    run(&mut t, &[stored(&[h(1)], None, &TOKENS[..4], Tier::Device)]);
    let other = EventRef::Removed(RemovedRef { block_hashes: &[h(1)], tier: Tier::Device, group_idx: 1 });
    assert!(run(&mut t, &[other]).is_empty());
    assert_eq!(t.stats().other_group, 1);
    assert_eq!(run(&mut t, &[EventRef::Cleared]), vec![RouterEvent::Cleared]);
    assert!(t.is_empty());
}

#[test]
fn local_hash_matches_the_core() {
    let mut buf = Vec::new();
    for seed in [HashSeed::DEFAULT, HashSeed::salted(Some("x"), Some("y"))] {
        for n in [0, 1, 4, 64, 1024] {
            let tokens: Vec<u32> = (0..n).map(|i: u32| i.wrapping_mul(2_654_435_761)).collect();
            let want = router_core::local_hash(&tokens, &[], seed);
            assert_eq!(local_hash_into(&mut buf, &tokens, seed), want, "{n} tokens");
        }
    }
}
