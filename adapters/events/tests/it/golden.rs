//! Golden frames: payloads encoded by msgspec with vLLM's struct declarations
//! (tests/py/golden.py), byte-for-byte equal to the committed corpus, and decoded
//! to the events stated here independently.

use std::fs;

use kvroute_events::decode::{
    decode_batch, Batch, BatchStats, DecodeConfig, DecodeError, EngineHash, EventRef, ExtraKey, ExtraKeys,
};
use router_core::Tier;

use crate::support::{crate_dir, python};

/// An owned extra key.
#[derive(Clone, PartialEq, Debug)]
enum Key {
    S(&'static str),
    M(&'static str, i64),
    Opaque,
}

fn own_keys(x: ExtraKeys<'_>) -> Vec<Vec<Key>> {
    (0..x.len())
        .map(|i| {
            x.block(i)
                .map(|k| match k {
                    ExtraKey::Str(s) => Key::S(Box::leak(s.to_string().into_boxed_str())),
                    ExtraKey::Media { identifier, offset_tokens } => {
                        Key::M(Box::leak(identifier.to_string().into_boxed_str()), offset_tokens)
                    }
                    _ => Key::Opaque,
                })
                .collect()
        })
        .collect()
}

/// An owned, comparable event.
#[derive(Clone, PartialEq, Debug)]
enum Want {
    Stored {
        hashes: Vec<EngineHash>,
        parent: Option<EngineHash>,
        tokens: Vec<u32>,
        tier: Tier,
        lora: Option<&'static str>,
        group: u32,
        /// Per-block extra keys; `None` when the event has none.
        extra: Option<Vec<Vec<Key>>>,
    },
    Removed {
        hashes: Vec<EngineHash>,
        tier: Tier,
        group: u32,
    },
    Cleared,
}

fn own(ev: EventRef<'_>) -> Want {
    match ev {
        EventRef::Stored(s) => {
            assert_eq!(s.block_size, 4);
            Want::Stored {
                hashes: s.block_hashes.to_vec(),
                parent: s.parent,
                tokens: s.token_ids.to_vec(),
                tier: s.tier,
                lora: s.lora_name.map(|l| Box::leak(l.to_string().into_boxed_str()) as &'static str),
                group: s.group_idx,
                extra: s.extra_keys.map(own_keys),
            }
        }
        EventRef::Removed(r) => Want::Removed { hashes: r.block_hashes.to_vec(), tier: r.tier, group: r.group_idx },
        EventRef::Cleared => Want::Cleared,
    }
}

fn i(v: i128) -> EngineHash {
    EngineHash::from_int(v).expect("64-bit")
}

fn b(byte: u8) -> EngineHash {
    EngineHash::from_bytes(&[byte; 32], DecodeConfig::default().engine_hash_seed)
}

fn stored_int() -> Want {
    Want::Stored {
        hashes: vec![i(11), i(-12), i(u64::MAX.into())],
        parent: None,
        tokens: (0..12).collect(),
        tier: Tier::Device,
        lora: None,
        group: 0,
        extra: None,
    }
}

#[track_caller]
fn check(name: &str, ts: f64, rank: Option<u32>, want: &[Want], stats: BatchStats) {
    let payload = fs::read(crate_dir().join("tests/corpus").join(format!("{name}.msgpack"))).expect(name);
    let mut batch = Batch::new();
    decode_batch(&payload, &DecodeConfig::default(), &mut batch).unwrap_or_else(|e| panic!("{name}: {e}"));
    let got: Vec<Want> = batch.events().map(own).collect();
    assert_eq!((batch.ts, batch.dp_rank, got.as_slice(), batch.stats), (ts, rank, want, stats), "{name}");
}

#[test]
fn golden_frames_decode_to_the_stated_events() {
    let none = BatchStats::default();
    for form in ["map", "array"] {
        let n = |case: &str| format!("golden_{case}_{form}");
        check(&n("stored_int"), 1.5, None, &[stored_int()], none);
        let bytes = Want::Stored {
            hashes: vec![b(1), b(2)],
            parent: Some(b(0)),
            tokens: vec![100, 101, 102, 103, 70000, u32::MAX, 0, 5],
            tier: Tier::Host,
            lora: Some("adapter-a"),
            group: 0,
            extra: Some(vec![vec![], vec![Key::S("mm-hash"), Key::Opaque]]),
        };
        check(&n("stored_bytes"), 2.25, Some(0), &[bytes], none);
        check(
            &n("removed_int"),
            3.0,
            None,
            &[Want::Removed { hashes: vec![i(11), i(-12)], tier: Tier::Device, group: 0 }],
            none,
        );
        check(
            &n("removed_bytes"),
            4.0,
            None,
            &[Want::Removed { hashes: vec![b(1)], tier: Tier::Disk, group: 1 }],
            none,
        );
        check(&n("cleared"), 5.0, None, &[Want::Cleared], none);
        let multi = [stored_int(), Want::Removed { hashes: vec![i(11)], tier: Tier::Device, group: 0 }, Want::Cleared];
        check(&n("multi_rank"), 6.0, Some(3), &multi, none);
        let newer = Want::Stored {
            hashes: vec![i(21)],
            parent: Some(i(11)),
            tokens: vec![1, 2, 3, 4],
            tier: Tier::Disk,
            lora: None,
            group: 0,
            extra: None,
        };
        check(&n("newer_fields"), 7.0, None, &[newer], none);
        let salted = Want::Stored {
            hashes: vec![i(14722417665957728748), i(2887188193437737155)],
            parent: None,
            tokens: (300..308).collect(),
            tier: Tier::Device,
            lora: None,
            group: 0,
            extra: Some(vec![vec![Key::S("tenant-a")], vec![]]),
        };
        let lora_mm = Want::Stored {
            hashes: vec![i(1 << 63), i(i128::from(u64::MAX) - 1)],
            parent: Some(i((1 << 63) + 5)),
            tokens: (0..8).collect(),
            tier: Tier::Device,
            lora: Some("sql-lora"),
            group: 0,
            extra: Some(vec![
                vec![Key::S("sql-lora"), Key::S("tenant-b")],
                vec![Key::S("sql-lora"), Key::M("img-hash", 2)],
            ]),
        };
        check(&n("extra_keys"), 9.0, Some(0), &[salted, lora_mm], none);
    }
    check("golden_batch_as_map", 8.0, Some(2), &[Want::Cleared], none);
}

#[test]
fn hand_made_seeds_decode_as_stated() {
    let legacy = Want::Stored {
        hashes: vec![i(5), i(6)],
        parent: None,
        tokens: vec![9, 9, 9, 9, 8, 8, 8, 8],
        tier: Tier::Device,
        lora: None,
        group: 0,
        extra: None,
    };
    check("ok_legacy_positional", 1.0, None, &[legacy], BatchStats::default());
    check(
        "ok_unknown_event_and_field",
        1.0,
        None,
        &[Want::Cleared],
        BatchStats { unknown_fields: 2, unknown_events: 2, ..BatchStats::default() },
    );
    let bad = BatchStats {
        malformed_events: 2,
        first_event_error: Some(DecodeError::TokenOutOfRange),
        ..BatchStats::default()
    };
    check("ok_one_bad_event_kept_rest", 1.0, None, &[Want::Cleared], bad);
    check("ok_int_timestamp", 3.0, None, &[], BatchStats::default());
}

/// Regenerates the payloads with msgspec and compares them with the committed corpus
/// (set KVROUTE_BLESS=1 to rewrite the corpus instead).
#[test]
fn committed_corpus_is_what_msgspec_writes() {
    let out = std::env::temp_dir().join(format!("kvroute-golden-{}", std::process::id()));
    let status = python().arg("golden.py").arg(&out).status().expect("run golden.py");
    assert!(status.success(), "golden.py failed");
    let corpus = crate_dir().join("tests/corpus");
    let bless = std::env::var_os("KVROUTE_BLESS").is_some();
    let mut names: Vec<_> = fs::read_dir(&out).expect("output dir").map(|e| e.expect("entry").file_name()).collect();
    names.sort();
    assert!(names.len() >= 20, "golden.py wrote {} files", names.len());
    for name in names {
        let fresh = fs::read(out.join(&name)).expect("fresh");
        if bless {
            fs::write(corpus.join(&name), &fresh).expect("bless");
            continue;
        }
        let committed = fs::read(corpus.join(&name)).unwrap_or_else(|_| panic!("{name:?} missing from the corpus"));
        assert_eq!(fresh, committed, "{name:?} differs from what msgspec writes now");
    }
    let _ = fs::remove_dir_all(&out);
}
