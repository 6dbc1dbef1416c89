//! Engine behaviour through its public API: LRU leaf-first eviction, LIFO preemption
//! with the victim at the queue front, generated-block promotion, roles, refusals.

use kvroute_sim::engine::{decode_ms, prefill_ms, Engine, EngineTiming};
use kvroute_sim::engine::{EngineConfig, EngineOutput, EngineRequest, EngineRole, KvEvent, RejectReason};
use kvroute_sim::prompt::{Prompt, OUTPUT_TOKEN_ID_BASE};
use router_core::{chain, local_hash, BlockSize, HashSeed, SeqHash};

use crate::common::Drive;

fn small(blocks: u32, seqs: u32) -> EngineConfig {
    EngineConfig {
        blocks_per_worker: blocks,
        block_size: 4,
        max_batched_tokens: 64,
        max_num_seqs: seqs,
        ..EngineConfig::default()
    }
}

fn prompt(tokens: &[u32], bs: u32) -> Prompt {
    Prompt::from_tokens(tokens, BlockSize::new(bs).unwrap(), HashSeed::DEFAULT).unwrap()
}

fn req(id: u64, tokens: &[u32], output_len: u32) -> EngineRequest {
    EngineRequest { id, prompt: prompt(tokens, 4), output_len, generated_before: 0 }
}

fn seqs(p: &Prompt) -> Vec<SeqHash> {
    p.blocks().iter().map(|b| b.seq).collect()
}

fn removed(outs: &[EngineOutput]) -> Vec<Vec<SeqHash>> {
    outs.iter()
        .filter_map(|o| match o {
            EngineOutput::Kv { event: KvEvent::Removed { blocks }, .. } => Some(blocks.clone()),
            _ => None,
        })
        .collect()
}

fn range(a: u32, b: u32) -> Vec<u32> {
    (a..=b).collect()
}

#[test]
fn eviction_is_lru_and_leaf_first() {
    let a = range(1, 16);
    let b = range(101, 124);
    let c: Vec<u32> = range(1, 8).into_iter().chain(range(201, 208)).collect();
    let mut d = Drive::new(small(8, 4));
    d.run(vec![(0.0, req(0, &a, 1)), (1000.0, req(1, &b, 1)), (2000.0, req(2, &c, 1))], 10_000).unwrap();
    let (ha, hb) = (seqs(&prompt(&a, 4)), seqs(&prompt(&b, 4)));
    // B needs 6 blocks with 4 free: A's suffix goes first, leaf before parent.
    // C pins A's surviving prefix (a0, a1) and evicts B's leaves.
    assert_eq!(removed(&d.outs), vec![vec![ha[3], ha[2]], vec![hb[5], hb[4]]]);
    let hit = d.outs.iter().find_map(|o| match o {
        EngineOutput::Admitted { id: 2, cached_tokens, .. } => Some(*cached_tokens),
        _ => None,
    });
    assert_eq!(hit, Some(8));
}

#[test]
fn preemption_is_lifo_victim_goes_to_front_and_recomputes() {
    let mut d = Drive::new(small(8, 2));
    d.run(
        vec![(0.0, req(0, &range(1, 8), 20)), (0.0, req(1, &range(11, 18), 20)), (0.0, req(2, &range(21, 24), 2))],
        100_000,
    )
    .unwrap();
    let mut waiting = std::collections::BTreeSet::from([0u64, 1, 2]);
    let mut preempted = Vec::new();
    let mut readmissions = 0;
    let mut tokens = std::collections::BTreeMap::new();
    for o in &d.outs {
        match o {
            EngineOutput::Admitted { id, readmission, .. } => {
                if *id == 2 {
                    assert!(!waiting.contains(&1), "the preempted request must be ahead of later ones");
                }
                readmissions += u32::from(*readmission);
                waiting.remove(id);
            }
            EngineOutput::Preempted { id, .. } => {
                preempted.push(*id);
                waiting.insert(*id);
            }
            EngineOutput::Finished { id, tokens: n, .. } => {
                tokens.insert(*id, *n);
            }
            _ => {}
        }
    }
    assert!(!preempted.is_empty(), "the pool is too small for both; someone must be preempted");
    assert!(preempted.iter().all(|&id| id == 1), "LIFO: only the newer request is preempted: {preempted:?}");
    assert_eq!(readmissions as usize, preempted.len());
    assert_eq!(tokens, std::collections::BTreeMap::from([(0, 20), (1, 20), (2, 2)]));
    assert_eq!(d.engine.stats().preemptions as usize, preempted.len());
}

#[test]
fn decode_filled_blocks_are_promoted_with_fresh_token_ids() {
    let p = range(1, 6); // one full block and a 2-token tail
    let mut d = Drive::new(small(16, 4));
    d.run(vec![(0.0, req(0, &p, 10))], 10_000).unwrap();
    let stored: Vec<(Option<SeqHash>, Vec<SeqHash>)> = d
        .outs
        .iter()
        .filter_map(|o| match o {
            EngineOutput::Kv { event: KvEvent::Stored { parent, blocks }, .. } => {
                Some((*parent, blocks.iter().map(|b| b.seq).collect()))
            }
            _ => None,
        })
        .collect();
    // Tokens 0..15 get computed (the 10th sampled token never is): blocks 1 and 2 fill.
    let b0 = prompt(&p, 4).blocks()[0].seq;
    let out = |k: u32| OUTPUT_TOKEN_ID_BASE + k;
    let b1 = chain(b0, local_hash(&[5, 6, out(0), out(1)], &[], HashSeed::DEFAULT));
    let b2 = chain(b1, local_hash(&[out(2), out(3), out(4), out(5)], &[], HashSeed::DEFAULT));
    assert_eq!(stored, vec![(None, vec![b0]), (Some(b0), vec![b1]), (Some(b1), vec![b2])]);
}

#[test]
fn prefill_role_finishes_with_the_first_token_and_prices_the_handoff() {
    let cfg = EngineConfig { role: EngineRole::Prefill, ..EngineConfig::default() };
    let mut d = Drive::new(cfg);
    let tokens: Vec<u32> = (0..1024).map(|i| i / 512 + 1).collect();
    let r = EngineRequest { id: 7, prompt: prompt(&tokens, 64), output_len: 10, generated_before: 0 };
    d.run(vec![(0.0, r)], 1000).unwrap();
    let fin = d.outs.iter().find_map(|o| match o {
        EngineOutput::Finished { at_ms, tokens, kv_transfer_ms, .. } => Some((*at_ms, *tokens, *kv_transfer_ms)),
        _ => None,
    });
    let want_transfer = 1024.0 * 160.0 * 1024.0 / 64e9 * 1000.0;
    let (at, n, transfer) = fin.expect("finished");
    assert!((at - prefill_ms(1024)).abs() < 1e-9 && n == 1 && (transfer - want_transfer).abs() < 1e-9);
}

#[test]
fn decode_role_skips_prefill_time() {
    let cfg = EngineConfig { role: EngineRole::Decode, ..EngineConfig::default() };
    let mut d = Drive::new(cfg);
    let tokens: Vec<u32> = (0..1024).map(|i| i / 512 + 1).collect();
    let r = EngineRequest { id: 7, prompt: prompt(&tokens, 64), output_len: 3, generated_before: 1 };
    d.run(vec![(0.0, r)], 1000).unwrap();
    assert!(!d.outs.iter().any(|o| matches!(o, EngineOutput::FirstToken { .. })));
    let fin = d.outs.iter().find_map(|o| match o {
        EngineOutput::Finished { at_ms, first_token_ms, tokens, .. } => Some((*at_ms, *first_token_ms, *tokens)),
        _ => None,
    });
    // Token 2 after one decode step on an empty pool, token 3 with 16 blocks held.
    let t2 = decode_ms(0, 16_384);
    let t3 = t2 + decode_ms(16, 16_384);
    let (at, first, n) = fin.expect("finished");
    assert!((first - t2).abs() < 1e-9 && (at - t3).abs() < 1e-9 && n == 2, "{first} {at} {n}");
}

#[test]
fn refusals() {
    let mut e = Engine::new(small(8, 4), 0).unwrap();
    assert!(e.submit(0.0, req(0, &range(1, 30), 3)).is_ok(), "32 tokens fit 8 blocks of 4");
    assert_eq!(e.submit(0.0, req(1, &range(1, 30), 4)), Err(RejectReason::TooLong { blocks: 9, capacity: 8 }));
    let wrong = EngineRequest { id: 2, prompt: prompt(&range(1, 30), 64), output_len: 1, generated_before: 0 };
    assert_eq!(e.submit(0.0, wrong), Err(RejectReason::BlockSizeMismatch { prompt: 64, engine: 4 }));
    assert!(Engine::new(EngineConfig { block_size: 3, ..EngineConfig::default() }, 0).is_err());
    assert!(Engine::new(EngineConfig { speedup: 0.0, ..EngineConfig::default() }, 0).is_err());
    assert!(Engine::new(EngineConfig { blocks_per_worker: 0, ..EngineConfig::default() }, 0).is_err());
}

/// A fresh engine whose passes after `idle` take 20 ms longer per second idle, at most
/// 250: request 1 (16 tokens) arrives `gap_ms` after request 0's only token; its first
/// token comes `extra_ms` later than a warm pass would bring it.
#[track_caller]
fn check_cold(gap_ms: f64, extra_ms: f64) {
    let timing = EngineTiming { cold_ms_per_idle_s: 20.0, cold_ms_max: 250.0, ..EngineTiming::MOCKER };
    let mut d = Drive::new(EngineConfig { timing, ..small(64, 4) });
    let first_end = 250.0 + prefill_ms(16); // a fresh engine is cold
    let arrive = first_end + gap_ms;
    d.run(vec![(0.0, req(0, &range(1, 16), 1)), (arrive, req(1, &range(101, 116), 1))], 1000).unwrap();
    let first = |want: u64| {
        d.outs.iter().find_map(|o| match o {
            EngineOutput::FirstToken { id, at_ms } if *id == want => Some(*at_ms),
            _ => None,
        })
    };
    assert_eq!(first(0), Some(first_end), "a fresh engine's first pass");
    let got = first(1).expect("request 1's first token") - arrive - prefill_ms(16);
    assert!((got - extra_ms).abs() < 1e-9, "{gap_ms} ms idle: {got} ms more, want {extra_ms}");
}

#[test]
fn a_pass_after_an_idle_gap_pays_the_cold_term() {
    check_cold(0.0, 0.0);
    check_cold(1_000.0, 20.0);
    check_cold(5_000.0, 100.0);
    check_cold(60_000.0, 250.0);
}
