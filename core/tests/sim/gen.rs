//! The seeded simulation's choice of knobs and operations. Weights favour the common
//! path (requests, confirmations, finishes, engine events for dispatched prompts) and
//! keep the rare inputs (removals, clears, time jumps) rare but present.

use router_core::RouterMode;

use super::driver::Driver;
use super::ops::{Knobs, Op, ReqOp, CHAINS, SESSIONS, WORKERS};
use super::rng::SplitMix64;

/// Knobs drawn at random: each keeps its first value (mostly the default) half the time
/// and picks among all its values otherwise, so a run has a few extremes, not all.
pub fn knobs(rng: &mut SplitMix64) -> Knobs {
    let mode = rng.byte();
    let mut b = move || if rng.chance(50) { 0 } else { rng.byte() };
    Knobs {
        mode,
        approximate: b() % 2 == 1,
        soft_affinity: b() % 2 == 1,
        sessions_max: b(),
        leases_max: b(),
        lease_ttl: b(),
        waiters_max: b(),
        queued_max: b(),
        queue_timeout: b(),
        wspt: b() % 2 == 1,
        class_limit: b(),
        request_age: b(),
        load_requests_max: b(),
        requests_max: b(),
        prefill_tokens_max: b(),
        blocks_cap: b(),
        reject_unknown_parent: b() % 4 == 1,
        keys_max: b(),
        workers_max: b(),
        cpu_timing: b() % 2 == 1,
    }
}

/// The fleet a run starts with: four workers, mostly aggregated.
pub fn fleet(rng: &mut SplitMix64) -> Vec<Op> {
    (0..4)
        .map(|w| Op::Upsert {
            worker: w,
            role: if rng.chance(70) { 0 } else { rng.byte() },
            ranks: 1 + rng.below(2) as u8,
            weight: 1,
            small_kv: rng.chance(20),
            zone: rng.byte(),
            taint: 0,
        })
        .collect()
}

/// The next operation, drawn with fixed weights; some look at the driver's state (an
/// engine publishes events for prompts it was sent).
pub fn op(rng: &mut SplitMix64, d: &Driver) -> Op {
    const WEIGHTS: [u64; 25] = [4, 1, 2, 1, 6, 8, 5, 1, 1, 1, 22, 10, 3, 4, 4, 8, 3, 1, 8, 1, 1, 2, 1, 2, 3];
    fn w(rng: &mut SplitMix64) -> u8 {
        rng.below(u64::from(WORKERS) + 1) as u8
    }
    let pick = rng.next_u64() as u16;
    match rng.weighted(&WEIGHTS) {
        0 => Op::Upsert {
            worker: w(rng),
            role: rng.byte(),
            ranks: if rng.chance(90) { rng.below(5) as u8 } else { rng.byte() },
            weight: if rng.chance(95) { 1 + rng.below(3) as u8 } else { 0 },
            small_kv: rng.chance(30),
            zone: rng.byte(),
            taint: if rng.chance(80) { 0 } else { rng.byte() },
        },
        1 => Op::Remove { worker: w(rng) },
        2 => Op::Health { worker: w(rng), health: if rng.chance(50) { 0 } else { rng.byte() } },
        3 => Op::Taints { worker: w(rng), taints: rng.byte() },
        4 => Op::Stored {
            worker: w(rng),
            rank: rng.below(3) as u8,
            chain: rng.byte(),
            start: if rng.chance(50) { 0 } else { rng.below(20) as u8 },
            len: rng.byte(),
            parent: rng.chance(50),
            tier: if rng.chance(70) { 0 } else { rng.byte() },
        },
        5 => engine_store(rng, d),
        6 => Op::Removed {
            worker: w(rng),
            rank: rng.below(3) as u8,
            chain: rng.byte(),
            start: rng.below(24) as u8,
            len: rng.byte(),
            tier: if rng.chance(70) { 0 } else { rng.byte() },
        },
        7 => Op::Cleared { worker: w(rng), rank: rng.below(3) as u8 },
        8 => Op::KvClear { worker: w(rng), rank: rng.below(3) as u8 },
        9 => Op::Trust { worker: w(rng), rank: rng.below(3) as u8, trusted: rng.chance(50) },
        10 => Op::Request(request(rng, d.config().mode == RouterMode::Direct)),
        11 => Op::Dispatched { pick },
        12 => Op::DispatchFailed { pick, failure: rng.below(3) as u8 },
        13 => Op::PrefillDone { pick },
        14 => Op::Progress { pick, tokens: rng.below(400) as u16 },
        15 => Op::Finished { pick },
        16 => Op::Cancel { pick },
        17 => Op::Late { pick, kind: rng.byte() },
        18 => Op::Advance {
            ms: match rng.below(100) {
                0..70 => rng.below(20),
                70..95 => rng.below(1_000),
                _ => rng.below(120_000),
            } as u32,
        },
        19 => Op::Back { ms: rng.below(10_000) as u32 },
        20 => Op::Jump { hours: if rng.chance(1) { u16::MAX } else { 1 + rng.below(48) as u16 } },
        21 => Op::Timeout,
        22 => Op::Tokens { worker: w(rng), agrees: rng.chance(50) },
        23 => Op::Observe {
            worker: w(rng),
            rank: rng.below(3) as u8,
            // Mostly far slower than the timing, so the doubt is often on.
            slowdown: if rng.chance(70) { 8 + rng.below(240) as u8 } else { rng.byte() },
            tokens: rng.below(2_000) as u16,
        },
        _ => Op::Query { chain: rng.byte(), len: rng.byte(), twist: rng.byte() },
    }
}

/// A `Stored` event for a dispatched prompt, as its engine would publish it after
/// prefill; some never come (lost), some come in two parts.
fn engine_store(rng: &mut SplitMix64, d: &Driver) -> Op {
    let sent = d.dispatched();
    if sent.is_empty() || rng.chance(10) {
        return Op::Timeout;
    }
    let (key, chain, len) = sent[rng.below(sent.len() as u64) as usize];
    let start = if rng.chance(70) { 0 } else { rng.below(u64::from(len) + 1) as u8 };
    Op::Stored {
        worker: key.worker.0 as u8,
        rank: key.rank.0 as u8,
        chain,
        start,
        len: len.saturating_sub(start),
        parent: start > 0,
        tier: 0,
    }
}

fn request(rng: &mut SplitMix64, direct: bool) -> ReqOp {
    let some = |rng: &mut SplitMix64, percent, n: u64| if rng.chance(percent) { 1 + rng.below(n) as u8 } else { 0 };
    ReqOp {
        chain: rng.below(u64::from(CHAINS)) as u8,
        len: rng.below(20) as u8,
        tail: if rng.chance(70) { 0 } else { rng.byte() },
        phase: if rng.chance(80) { 0 } else { rng.byte() },
        session: match rng.below(100) {
            0..50 => 0,
            50..52 => 1,
            52..54 => 2,
            _ => 3 + rng.below(u64::from(SESSIONS)) as u8,
        },
        pin: some(rng, if direct { 80 } else { 8 }, u64::from(WORKERS) + 1),
        pin_rank: some(rng, 5, 5),
        allow: if rng.chance(5) { rng.byte() } else { 0 },
        tolerate: rng.chance(10),
        label: some(rng, 5, 2),
        planned: some(rng, 3, u64::from(WORKERS)),
        strict: rng.byte() as i8,
        jump_ms: rng.next_u64() as i16,
        class: rng.byte(),
        preview: rng.chance(8),
        expected_out: if rng.chance(50) { rng.below(300) as u16 } else { 0 },
        duplicate: rng.chance(2),
        draw: rng.next_u64(),
    }
}
