use super::*;
use crate::encode::{encode_batch, WireEvent, WireForm, WireHash};

fn decode(payload: &[u8]) -> Result<Batch, DecodeError> {
    let mut b = Batch::new();
    decode_batch(payload, &DecodeConfig::default(), &mut b).map(|()| b)
}

#[test]
fn both_forms_decode_alike() {
    let hashes = [WireHash::Int(-5), WireHash::Bytes(b"abc")];
    let tokens = [1u32, 2, 3, 4, 5, 6, 7, 8];
    let events = [
        WireEvent::Stored {
            block_hashes: &hashes,
            parent: Some(WireHash::Int(u64::MAX.into())),
            token_ids: &tokens,
            block_size: 4,
            medium: Some("cpu"),
            lora_name: Some("l"),
        },
        WireEvent::Removed { block_hashes: &hashes[..1], medium: None },
        WireEvent::Cleared,
    ];
    let seed = DecodeConfig::default().engine_hash_seed;
    let want_hashes = [EngineHash::from_int(-5).unwrap(), EngineHash::from_bytes(b"abc", seed)];
    for form in [WireForm::Map, WireForm::Array] {
        let b = decode(&encode_batch(2.5, &events, Some(1), form)).unwrap();
        assert_eq!((b.ts, b.dp_rank, b.stats), (2.5, Some(1), BatchStats::default()));
        let got: Vec<_> = b.events().collect();
        assert_eq!(
            got,
            vec![
                EventRef::Stored(StoredRef {
                    block_hashes: &want_hashes,
                    parent: EngineHash::from_int(u64::MAX.into()),
                    token_ids: &tokens,
                    block_size: 4,
                    tier: Tier::Host,
                    lora_name: Some("l"),
                    group_idx: 0,
                    extra_keys: None,
                }),
                EventRef::Removed(RemovedRef { block_hashes: &want_hashes[..1], tier: Tier::Device, group_idx: 0 }),
                EventRef::Cleared,
            ],
            "{form:?}"
        );
    }
}

#[test]
fn int_hashes_keep_sign_apart_from_bytes() {
    let minus_one = EngineHash::from_int(-1).unwrap();
    assert_ne!(minus_one, EngineHash::from_int(u64::MAX.into()).unwrap());
    assert_eq!(EngineHash::from_int(i128::from(u64::MAX) + 1), None);
    assert_eq!(EngineHash::from_int(i128::from(i64::MIN) - 1), None);
    assert_ne!(EngineHash::from_bytes(b"x", 1), EngineHash::from_bytes(b"x", 2));
    assert_eq!(EngineHash::from_bytes(b"x", 1).0 >> 127, 0);
}

#[test]
fn oversized_payloads_are_not_read() {
    let cfg = DecodeConfig { event_bytes_max: 4, ..DecodeConfig::default() };
    let mut b = Batch::new();
    assert_eq!(decode_batch(&[0x92, 0, 0x90, 0, 0], &cfg, &mut b), Err(DecodeError::TooLarge { bytes: 5, max: 4 }));
}

#[test]
fn a_small_payload_claiming_huge_counts_allocates_nothing_much() {
    // [ts, [ {type: BlockStored, token_ids: array32(2^32-1)} ]] in a few bytes.
    let mut p = vec![0x92, 0x00, 0x91, 0x82, 0xa4];
    p.extend_from_slice(b"type");
    p.push(0xab);
    p.extend_from_slice(b"BlockStored");
    p.push(0xa9);
    p.extend_from_slice(b"token_ids");
    p.extend_from_slice(&[0xdd, 0xff, 0xff, 0xff, 0xff]);
    let e = decode(&p).unwrap_err();
    assert!(matches!(e, DecodeError::Msgpack(crate::msgpack::MsgpackError::LengthExceedsInput { .. })), "{e:?}");
}

#[test]
fn peek_ts_reads_both_envelopes() {
    assert_eq!(peek_ts(&encode_batch(9.5, &[], None, WireForm::Map)), Some(9.5));
    assert_eq!(peek_ts(&[0x82, 0xa6, b'e', b'v', b'e', b'n', b't', b's', 0x90, 0xa2, b't', b's', 0x03]), Some(3.0));
    assert_eq!(peek_ts(b"\xc1"), None);
}

/// `[1.0, [BlockStored{extra_keys: <raw>}, AllBlocksCleared]]`, map form.
fn stored_with_extra_keys(raw: &dyn Fn(&mut crate::encode::Writer)) -> Vec<u8> {
    let mut w = crate::encode::Writer(Vec::new());
    w.array(2);
    w.f64(1.0);
    w.array(2);
    w.map(6);
    for (k, v) in [("type", "BlockStored"), ("medium", "GPU")] {
        w.str(k);
        w.str(v);
    }
    w.str("block_hashes");
    w.array(2);
    w.int(u64::MAX.into());
    w.int(1 << 63);
    w.str("token_ids");
    w.array(8);
    (0..8).for_each(|t| w.int(t));
    w.str("block_size");
    w.int(4);
    w.str("extra_keys");
    raw(&mut w);
    w.map(1);
    w.str("type");
    w.str("AllBlocksCleared");
    w.0
}

#[test]
fn extra_keys_keep_strings_and_media_pairs_and_mark_the_rest_opaque() {
    let b = decode(&stored_with_extra_keys(&|w| {
        w.array(2);
        // Block 0: a salt, a media pair, an int, bytes, a string that is not UTF-8, and
        // pairs of other shapes: a non-UTF-8 id, an offset past i64, [int, int], a triple.
        w.array(9);
        w.str("tenant-a");
        w.array(2);
        w.str("img");
        w.int(-3);
        w.int(7);
        w.bin(b"\x00\x01");
        w.0.extend_from_slice(&[0xa2, 0xff, 0xfe]);
        w.array(2);
        w.0.extend_from_slice(&[0xa2, 0xff, 0xfe]);
        w.int(1);
        w.array(2);
        w.str("img");
        w.int(u64::MAX.into());
        w.array(2);
        w.int(1);
        w.int(2);
        w.array(3);
        w.str("img");
        w.int(1);
        w.int(2);
        // Block 1: nil.
        w.nil();
    }))
    .unwrap();
    let EventRef::Stored(s) = b.events().next().unwrap() else { panic!("a stored event") };
    assert_eq!(s.block_hashes[0], EngineHash::from_int(u64::MAX.into()).unwrap(), "u64 hashes above i64::MAX");
    let x = s.extra_keys.expect("extra keys");
    assert_eq!(x.len(), 2);
    let block0: Vec<_> = x.block(0).collect();
    assert_eq!(
        block0,
        [
            ExtraKey::Str("tenant-a"),
            ExtraKey::Media { identifier: "img", offset_tokens: -3 },
            ExtraKey::Opaque,
            ExtraKey::Opaque,
            ExtraKey::Opaque,
            ExtraKey::Opaque,
            ExtraKey::Opaque,
            ExtraKey::Opaque,
            ExtraKey::Opaque,
        ]
    );
    assert_eq!(x.block(1).count(), 0);
    assert_eq!(x.block(2).count(), 0, "past the end: no keys");
}

#[test]
fn extra_keys_that_are_not_a_list_drop_only_their_event() {
    let b = decode(&stored_with_extra_keys(&|w| w.str("tenant-a"))).unwrap();
    assert_eq!(b.events().collect::<Vec<_>>(), [EventRef::Cleared]);
    assert_eq!(b.stats.malformed_events, 1);
    assert_eq!(b.stats.first_event_error, Some(DecodeError::ExtraKeysMalformed));
    let nil = decode(&stored_with_extra_keys(&|w| w.nil())).unwrap();
    let EventRef::Stored(s) = nil.events().next().unwrap() else { panic!("a stored event") };
    assert_eq!(s.extra_keys, None);
}
