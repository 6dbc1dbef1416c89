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
