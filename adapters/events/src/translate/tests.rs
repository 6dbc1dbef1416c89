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
        extra_keys: None,
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
            for extra in [&[][..], &[7, u64::MAX][..]] {
                let want = router_core::local_hash(&tokens, extra, seed);
                assert_eq!(local_hash_into(&mut buf, &tokens, extra, seed), want, "{n} tokens, {extra:?}");
            }
        }
    }
}

// ---- extra_keys: cache salts, LoRA names, and keys the router cannot reproduce ----

/// One `extra_keys` item as a test writes it.
#[derive(Clone, Copy)]
enum K<'a> {
    /// A string key (LoRA name or cache salt).
    S(&'a str),
    /// A multimodal `(hash, offset)` pair, as current vLLM writes it.
    Mm(&'a str, i128),
    /// Bytes: a prompt-embeddings digest, which the router cannot reproduce.
    B(&'a [u8]),
}

/// A map-form `BlockStored` with int hashes, written as vLLM's msgspec would.
struct Ev<'a> {
    hashes: &'a [i128],
    parent: Option<i128>,
    tokens: &'a [u32],
    lora: Option<&'a str>,
    keys: Option<&'a [Option<&'a [K<'a>]>]>,
}

fn payload(ev: &Ev<'_>) -> Vec<u8> {
    use crate::encode::Writer;
    let mut w = Writer(Vec::new());
    w.array(2);
    w.f64(1.0);
    w.array(1);
    w.map(7);
    w.str("type");
    w.str("BlockStored");
    w.str("block_hashes");
    w.array(ev.hashes.len());
    ev.hashes.iter().for_each(|&v| w.int(v));
    w.str("parent_block_hash");
    match ev.parent {
        Some(v) => w.int(v),
        None => w.nil(),
    }
    w.str("token_ids");
    w.array(ev.tokens.len());
    ev.tokens.iter().for_each(|&t| w.int(t.into()));
    w.str("block_size");
    w.int(4);
    w.str("lora_name");
    match ev.lora {
        Some(l) => w.str(l),
        None => w.nil(),
    }
    w.str("extra_keys");
    match ev.keys {
        None => w.nil(),
        Some(blocks) => {
            w.array(blocks.len());
            for block in blocks {
                let Some(keys) = block else {
                    w.nil();
                    continue;
                };
                w.array(keys.len());
                for k in *keys {
                    match *k {
                        K::S(s) => w.str(s),
                        K::Mm(hash, offset) => {
                            w.array(2);
                            w.str(hash);
                            w.int(offset);
                        }
                        K::B(b) => w.bin(b),
                    }
                }
            }
        }
    }
    w.0
}

/// Decodes and translates `evs` in order; returns the sequence hashes indexed per event.
fn translate_all(t: &mut Translator, evs: &[Ev<'_>]) -> Result<Vec<Vec<SeqHash>>, TranslateError> {
    let mut per_event = Vec::new();
    for ev in evs {
        let mut batch = crate::decode::Batch::new();
        crate::decode::decode_batch(&payload(ev), &crate::decode::DecodeConfig::default(), &mut batch)
            .expect("a well-formed payload");
        let mut out = Vec::new();
        for e in batch.events() {
            t.translate(e, &mut out)?;
        }
        per_event.push(seqs(&out));
    }
    Ok(per_event)
}

fn salted(tokens: &[u32], lora: Option<&str>, salt: Option<&str>) -> Vec<SeqHash> {
    seq_hashes(tokens, BlockSize::new(4).unwrap(), HashSeed::salted(lora, salt))
}

/// Feeds `evs` to a fresh translator (worker salt `worker_salt`) and compares what each
/// event indexed with `want`.
#[track_caller]
fn check(worker_salt: Option<&str>, evs: &[Ev<'_>], want: &[Vec<SeqHash>]) -> Translator {
    let mut t = Translator::new(TranslateConfig { cache_salt: worker_salt.map(String::from), ..bs4() });
    assert_eq!(translate_all(&mut t, evs).as_deref(), Ok(want));
    t
}

const SALT_A: &[K<'static>] = &[K::S("tenant-a")];
const EMBEDS: &[K<'static>] = &[K::B(&[0xab; 32])];

fn ev<'a>(
    hashes: &'a [i128],
    parent: Option<i128>,
    tokens: &'a [u32],
    keys: Option<&'a [Option<&'a [K<'a>]>]>,
) -> Ev<'a> {
    Ev { hashes, parent, tokens, lora: None, keys }
}

#[test]
fn a_salt_on_the_first_block_salts_its_whole_chain() {
    let big = i128::from(u64::MAX) - 7; // above i64::MAX, as vLLM's u64 hashes often are
    let t8 = &TOKENS[..8];
    // vLLM: the salt in the first block's extra keys only, nil after.
    check(None, &[ev(&[big, 2], None, t8, Some(&[Some(SALT_A), None]))], &[salted(t8, None, Some("tenant-a"))]);
    // The same chain split over two events: the child inherits the salt from its parent.
    let want = salted(t8, None, Some("tenant-a"));
    check(
        None,
        &[ev(&[big], None, &t8[..4], Some(&[Some(SALT_A)])), ev(&[2], Some(big), &t8[4..], Some(&[None]))],
        &[want[..1].to_vec(), want[1..].to_vec()],
    );
    // Unsalted blocks stay unsalted, with or without an all-nil extra_keys.
    check(None, &[ev(&[1, 2], None, t8, Some(&[None, None]))], &[salted(t8, None, None)]);
    check(None, &[ev(&[1, 2], None, t8, None)], &[salted(t8, None, None)]);
    // A worker's configured salt applies where the event names none; the event's wins.
    check(Some("w"), &[ev(&[1, 2], None, t8, None)], &[salted(t8, None, Some("w"))]);
    check(Some("w"), &[ev(&[1, 2], None, t8, Some(&[Some(SALT_A), None]))], &[salted(t8, None, Some("tenant-a"))]);
}

#[test]
fn a_salted_chain_never_matches_an_unsalted_one() {
    let t8 = &TOKENS[..8];
    let got = check(None, &[ev(&[1, 2], None, t8, Some(&[Some(SALT_A), None]))], &[salted(t8, None, Some("tenant-a"))]);
    assert_eq!(got.stats().opaque_blocks, 0);
    let salted_a = salted(t8, None, Some("tenant-a"));
    for other in [salted(t8, None, None), salted(t8, None, Some("tenant-b"))] {
        assert!(salted_a.iter().all(|h| !other.contains(h)), "no block in common");
    }
}

#[test]
fn lora_names_in_extra_keys_are_the_adapters_salt() {
    let t8 = &TOKENS[..8];
    let ad: &[K<'_>] = &[K::S("ad")];
    let ad_salt: &[K<'_>] = &[K::S("ad"), K::S("t")];
    let lora = |keys| Ev { lora: Some("ad"), ..ev(&[1, 2], None, t8, keys) };
    let (every, first_salted) = ([Some(ad), Some(ad)], [Some(ad_salt), Some(ad)]);
    check(None, &[lora(Some(&every))], &[salted(t8, Some("ad"), None)]);
    check(None, &[lora(Some(&first_salted))], &[salted(t8, Some("ad"), Some("t"))]);
    // Older vLLM sends no extra keys: the lora_name field alone salts.
    check(None, &[lora(None)], &[salted(t8, Some("ad"), None)]);
}

#[test]
fn blocks_with_keys_the_router_cannot_reproduce_are_never_indexed() {
    let t12 = &TOKENS[..12];
    let plain = salted(t12, None, None);
    // A prompt-embeddings digest in the second block: the first is indexed, the rest are not.
    let mut t = check(None, &[ev(&[1, 2, 3], None, t12, Some(&[None, Some(EMBEDS), None]))], &[plain[..1].to_vec()]);
    assert_eq!(t.stats().opaque_blocks, 2);
    // A child of an opaque block is opaque; removing opaque blocks emits nothing, and
    // removing the indexed one still maps back.
    assert_eq!(translate_all(&mut t, &[ev(&[4], Some(3), &TOKENS[12..], Some(&[None]))]), Ok(vec![vec![]]));
    let mut out = Vec::new();
    t.translate(removed(&[h(2), h(3), h(4)], Tier::Device), &mut out).unwrap();
    assert_eq!((out.len(), t.stats().unknown_removed), (0, 0));
    t.translate(removed(&[h(1)], Tier::Device), &mut out).unwrap();
    assert_eq!(out, vec![RouterEvent::Removed { blocks: plain[..1].to_vec(), tier: Tier::Device }]);
    assert!(t.is_empty());
    // A string where no salt can be (a later block, or a second string) is opaque too.
    let two: &[K<'_>] = &[K::S("a"), K::S("b")];
    check(None, &[ev(&[1, 2], None, &TOKENS[..8], Some(&[None, Some(SALT_A)]))], &[plain[..1].to_vec()]);
    check(None, &[ev(&[1], None, &TOKENS[..4], Some(&[Some(two)]))], &[vec![]]);
    check(None, &[ev(&[1], None, &TOKENS[..4], Some(&[Some(EMBEDS)]))], &[vec![]]);
}

#[test]
fn extra_keys_of_the_wrong_length_refuse_the_event() {
    let mut t = Translator::new(bs4());
    let r = translate_all(&mut t, &[ev(&[1, 2], None, &TOKENS[..8], Some(&[None]))]);
    assert_eq!(r, Err(TranslateError::ExtraKeysMismatch { blocks: 2, entries: 1 }));
    assert!(t.is_empty());
    assert_eq!(t.stats().extra_keys_mismatch, 1);
}

mod media;
