use super::*;
use crate::pin::{resolve, AffinityPin, PinError};
use crate::worker::{Taint, WorkerRole, WorkerTableConfig};
use alloc::string::ToString;
use alloc::vec;
use core::cell::RefCell;

use ExclusionReason::*;
use WorkerRole::{Aggregated as Agg, Decode as Dec, Prefill as Pre};

// ---- fixtures ----

fn spec(id: u64, role: WorkerRole, ranks: Option<u32>) -> WorkerSpec {
    WorkerSpec { dp_ranks: ranks, ..WorkerSpec::new(WorkerId(id), role) }
}

fn tainted(s: WorkerSpec, taints: &[(&str, &str, TaintEffect)]) -> WorkerSpec {
    let taints =
        taints.iter().map(|&(k, v, effect)| Taint { key: k.to_string(), value: v.to_string(), effect }).collect();
    WorkerSpec { taints, ..s }
}

fn labelled(s: WorkerSpec, labels: &[(&str, &str)]) -> WorkerSpec {
    WorkerSpec { labels: labels.iter().map(|&(k, v)| (k.to_string(), v.to_string())).collect(), ..s }
}

fn table(specs: &[WorkerSpec], health: &[(u64, Health)]) -> WorkerTable {
    let mut t = WorkerTable::new(WorkerTableConfig::default());
    for s in specs {
        t.upsert(s.clone()).unwrap();
    }
    for &(id, h) in health {
        t.set_health(WorkerId(id), h).unwrap();
    }
    t
}

/// Aggregated 1 (one rank) and 2 (two ranks), decode 3, prefill 4.
fn base() -> Vec<WorkerSpec> {
    vec![spec(1, Agg, Some(1)), spec(2, Agg, Some(2)), spec(3, Dec, Some(1)), spec(4, Pre, Some(1))]
}

fn tol(key: &str, value: Option<&str>, effect: Option<TaintEffect>) -> Toleration {
    Toleration { key: key.to_string(), value: value.map(|v| v.to_string()), effect }
}

fn ok(w: u64, r: u32) -> Eligibility {
    cost(w, r, 1.0)
}

fn cost(w: u64, r: u32, cost_factor: f64) -> Eligibility {
    Eligibility { key: WorkerKey::new(w, r), verdict: Verdict::Eligible { cost_factor } }
}

fn no(w: u64, r: u32, reason: ExclusionReason) -> Eligibility {
    Eligibility { key: WorkerKey::new(w, r), verdict: Verdict::Excluded(reason) }
}

fn over(prefill_tokens: u64, decode_blocks: u64) -> ExclusionReason {
    Overloaded { prefill_tokens, decode_blocks }
}

fn load(prefill: u64, blocks: u64) -> WorkerLoad {
    WorkerLoad { active_prefill_tokens: prefill, active_decode_blocks: blocks, active_requests: 1 }
}

/// One filter call: the query's owned parts, with defaults that exclude nothing.
struct Q {
    phase: Phase,
    hints: RoutingHints,
    pin: PinResolution,
    failed: Vec<u64>,
    ignore_overload: bool,
    same_label_as: Option<(&'static str, &'static str)>,
    loads: Vec<(WorkerKey, WorkerLoad)>,
    cfg: EligibilityConfig,
}

fn q(phase: Phase) -> Q {
    Q {
        phase,
        hints: RoutingHints::default(),
        pin: PinResolution::Any,
        failed: Vec::new(),
        ignore_overload: false,
        same_label_as: None,
        loads: Vec::new(),
        cfg: EligibilityConfig::default(),
    }
}

fn run(t: &WorkerTable, c: &Q, out: &mut Vec<Eligibility>) -> Result<(), EligibilityError> {
    let failed: Vec<WorkerId> = c.failed.iter().map(|&w| WorkerId(w)).collect();
    let query = EligibilityQuery {
        phase: c.phase,
        hints: &c.hints,
        pin: &c.pin,
        failed: &failed,
        ignore_overload: c.ignore_overload,
        same_label_as: c.same_label_as,
    };
    let load = |k: WorkerKey| c.loads.iter().find(|(key, _)| *key == k).map_or(WorkerLoad::default(), |l| l.1);
    filter(&query, t, &load, &c.cfg, out)
}

#[track_caller]
fn check(t: &WorkerTable, c: Q, want: Result<(), EligibilityError>, verdicts: &[Eligibility]) {
    let mut out = vec![ok(99, 99)]; // stale content must be cleared
    let got = run(t, &c, &mut out);
    assert_eq!(got, want, "result for {:?}", c.phase);
    assert_eq!(out, verdicts, "verdicts for {:?}", c.phase);
}

// ---- role, pin, allow-list, health ----

#[test]
fn role_must_serve_the_phase() {
    let t = table(&base(), &[]);
    let prefill = [no(1, 0, WrongRole), no(2, 0, WrongRole), no(2, 1, WrongRole), no(3, 0, WrongRole), ok(4, 0)];
    check(&t, q(Phase::Prefill), Ok(()), &prefill);
    // The decode worker also serves the aggregated phase (disaggregated bypass).
    check(&t, q(Phase::Aggregated), Ok(()), &[ok(1, 0), ok(2, 0), ok(2, 1), ok(3, 0), no(4, 0, WrongRole)]);
    let decode = [no(1, 0, WrongRole), no(2, 0, WrongRole), no(2, 1, WrongRole), ok(3, 0), no(4, 0, WrongRole)];
    check(&t, q(Phase::Decode), Ok(()), &decode);
}

#[test]
fn no_worker_for_the_phase() {
    let aggregated_only = table(&[spec(1, Agg, Some(1))], &[]);
    check(
        &aggregated_only,
        q(Phase::Prefill),
        Err(EligibilityError::NoWorkers { phase: Phase::Prefill }),
        &[no(1, 0, WrongRole)],
    );
    check(&table(&[], &[]), q(Phase::Decode), Err(EligibilityError::NoWorkers { phase: Phase::Decode }), &[]);
    // Serving workers that are all excluded are not "no workers": the caller sees why.
    check(
        &table(&[spec(1, Agg, Some(1))], &[(1, Health::Ejected)]),
        q(Phase::Aggregated),
        Ok(()),
        &[no(1, 0, Ejected)],
    );
}

#[test]
fn pin_narrows() {
    let t = table(&base(), &[]);
    let exact = Q { pin: PinResolution::Exact(WorkerKey::new(2, 1)), ..q(Phase::Aggregated) };
    let want = [no(1, 0, NotPinned), no(2, 0, NotPinned), ok(2, 1), no(3, 0, NotPinned), no(4, 0, WrongRole)];
    check(&t, exact, Ok(()), &want);
    let worker = Q { pin: PinResolution::Worker(WorkerId(2)), ..q(Phase::Aggregated) };
    check(&t, worker, Ok(()), &[no(1, 0, NotPinned), ok(2, 0), ok(2, 1), no(3, 0, NotPinned), no(4, 0, WrongRole)]);
}

#[test]
fn exact_pin_on_unknown_ranks_lists_that_rank() {
    let t = table(&[spec(1, Agg, None), spec(2, Agg, None)], &[]);
    let c = Q { pin: PinResolution::Exact(WorkerKey::new(1, 3)), ..q(Phase::Aggregated) };
    check(&t, c, Ok(()), &[ok(1, 3), no(2, 0, NotPinned)]);
    check(&t, q(Phase::Aggregated), Ok(()), &[ok(1, 0), ok(2, 0)]);
}

#[test]
fn allow_list() {
    let t = table(&base(), &[]);
    let allow = |ids: Vec<u64>| Q {
        hints: RoutingHints {
            allowed_worker_ids: Some(ids.into_iter().map(WorkerId).collect()),
            ..RoutingHints::default()
        },
        ..q(Phase::Aggregated)
    };
    // Unsorted and duplicated ids are fine.
    check(
        &t,
        allow(vec![3, 1, 3]),
        Ok(()),
        &[ok(1, 0), no(2, 0, NotAllowed), no(2, 1, NotAllowed), ok(3, 0), no(4, 0, WrongRole)],
    );
    // An empty list allows nothing.
    let none =
        [no(1, 0, NotAllowed), no(2, 0, NotAllowed), no(2, 1, NotAllowed), no(3, 0, NotAllowed), no(4, 0, WrongRole)];
    check(&t, allow(vec![]), Ok(()), &none);
}

#[test]
fn health_excludes() {
    let t = table(&base(), &[(1, Health::Ejected), (2, Health::Draining), (3, Health::Healthy)]);
    let want = [no(1, 0, Ejected), no(2, 0, Draining), no(2, 1, Draining), ok(3, 0), no(4, 0, WrongRole)];
    check(&t, q(Phase::Aggregated), Ok(()), &want);
}

#[test]
fn first_reason_in_documented_order_wins() {
    // Worker 1 is draining, tainted and not allowed: the allow-list comes first.
    let specs = [tainted(spec(1, Agg, Some(1)), &[("k", "", TaintEffect::NoSchedule)]), spec(2, Agg, Some(1))];
    let t = table(&specs, &[(1, Health::Draining)]);
    let hints = RoutingHints { allowed_worker_ids: Some(vec![WorkerId(2)]), ..RoutingHints::default() };
    check(&t, Q { hints, ..q(Phase::Aggregated) }, Ok(()), &[no(1, 0, NotAllowed), ok(2, 0)]);
    // Without the allow-list, health comes before taints.
    check(&t, q(Phase::Aggregated), Ok(()), &[no(1, 0, Draining), ok(2, 0)]);
    // A wrong-role worker is WrongRole even when the pin names it.
    let pinned = Q { pin: PinResolution::Worker(WorkerId(1)), ..q(Phase::Prefill) };
    check(
        &t,
        pinned,
        Err(EligibilityError::NoWorkers { phase: Phase::Prefill }),
        &[no(1, 0, WrongRole), no(2, 0, WrongRole)],
    );
}

// ---- taints and tolerations ----

#[test]
fn taints_and_tolerations() {
    use TaintEffect::*;
    let specs = [
        tainted(spec(1, Agg, Some(1)), &[("gpu", "a100", NoSchedule)]),
        tainted(spec(2, Agg, Some(1)), &[("spot", "", PreferNoSchedule)]),
        tainted(spec(3, Agg, Some(1)), &[("spot", "", PreferNoSchedule), ("old", "v1", PreferNoSchedule)]),
        tainted(spec(5, Agg, Some(1)), &[("spot", "", PreferNoSchedule), ("gpu", "h100", NoSchedule)]),
    ];
    let t = table(&specs, &[]);
    let with = |tolerations: Vec<Toleration>| Q {
        hints: RoutingHints { tolerations, ..RoutingHints::default() },
        ..q(Phase::Aggregated)
    };
    let gpu = || Tainted { key: "gpu".to_string() };
    // Untolerated: NoSchedule excludes, each PreferNoSchedule doubles the cost.
    check(&t, with(vec![]), Ok(()), &[no(1, 0, gpu()), cost(2, 0, 2.0), cost(3, 0, 4.0), no(5, 0, gpu())]);
    // Tolerating gpu=a100 only (Equal) admits worker 1 but not worker 5's gpu=h100.
    let a100 = vec![tol("gpu", Some("a100"), None)];
    check(&t, with(a100), Ok(()), &[ok(1, 0), cost(2, 0, 2.0), cost(3, 0, 4.0), no(5, 0, gpu())]);
    // Exists on gpu and on spot.
    let both = vec![tol("gpu", None, None), tol("spot", None, Some(PreferNoSchedule))];
    check(&t, with(both), Ok(()), &[ok(1, 0), ok(2, 0), cost(3, 0, 2.0), ok(5, 0)]);
    // A toleration for the wrong effect does not help.
    check(
        &t,
        with(vec![tol("gpu", None, Some(PreferNoSchedule))]),
        Ok(()),
        &[no(1, 0, gpu()), cost(2, 0, 2.0), cost(3, 0, 4.0), no(5, 0, gpu())],
    );
    // Empty key + Exists tolerates everything.
    check(&t, with(vec![tol("", None, None)]), Ok(()), &[ok(1, 0), ok(2, 0), ok(3, 0), ok(5, 0)]);
    // The factor is configurable.
    let c =
        Q { cfg: EligibilityConfig { prefer_no_schedule_factor: 3.0, ..EligibilityConfig::default() }, ..with(vec![]) };
    check(&t, c, Ok(()), &[no(1, 0, gpu()), cost(2, 0, 3.0), cost(3, 0, 9.0), no(5, 0, gpu())]);
    // A factor below 1 would reward taints; it counts as 1.
    let cfg = EligibilityConfig { prefer_no_schedule_factor: 0.5, ..EligibilityConfig::default() };
    let c = Q { cfg, ..with(vec![]) };
    check(&t, c, Ok(()), &[no(1, 0, gpu()), ok(2, 0), ok(3, 0), no(5, 0, gpu())]);
}

#[test]
fn too_many_tolerations_is_refused() {
    let t = table(&base(), &[]);
    let hints = RoutingHints { tolerations: vec![tol("a", None, None); 3], ..RoutingHints::default() };
    let cfg = EligibilityConfig { tolerations_max: 2, ..EligibilityConfig::default() };
    let err = EligibilityError::TooManyTolerations { tolerations: 3, tolerations_max: 2 };
    check(&t, Q { hints, cfg, ..q(Phase::Aggregated) }, Err(err), &[]);
}

// ---- overload ----

#[test]
fn overload_thresholds() {
    // Worker 1: batch 1000 tokens, 100 KV blocks. Defaults: 4 batches, 95% of KV.
    let s = WorkerSpec { max_batched_tokens: 1000, kv_blocks: 100, ..spec(1, Agg, Some(1)) };
    let t = table(&[s], &[]);
    let at = |prefill, blocks, cfg| Q {
        loads: vec![(WorkerKey::new(1, 0), load(prefill, blocks))],
        cfg,
        ..q(Phase::Aggregated)
    };
    let d = EligibilityConfig::default;
    check(&t, at(4000, 95, d()), Ok(()), &[ok(1, 0)]); // at the thresholds: not above
    check(&t, at(4001, 0, d()), Ok(()), &[no(1, 0, over(4001, 0))]);
    check(&t, at(0, 96, d()), Ok(()), &[no(1, 0, over(0, 96))]);
    let absolute = EligibilityConfig { prefill_tokens_max: Some(500), ..d() };
    check(&t, at(500, 0, absolute), Ok(()), &[ok(1, 0)]);
    check(&t, at(501, 0, absolute), Ok(()), &[no(1, 0, over(501, 0))]);
    let off = EligibilityConfig { prefill_tokens_frac_of_batch: None, decode_blocks_frac_of_kv: None, ..d() };
    check(&t, at(u64::MAX, u64::MAX, off), Ok(()), &[ok(1, 0)]);
    // Affinity validation ignores transient overload.
    check(&t, Q { ignore_overload: true, ..at(9999, 999, d()) }, Ok(()), &[ok(1, 0)]);
}

#[test]
fn overload_is_per_rank() {
    let t = table(&[spec(2, Agg, Some(2))], &[]);
    let c = Q { loads: vec![(WorkerKey::new(2, 1), load(0, 16_000))], ..q(Phase::Aggregated) };
    check(&t, c, Ok(()), &[ok(2, 0), no(2, 1, over(0, 16_000))]);
}

#[test]
fn load_is_read_only_for_keys_that_reach_the_overload_check() {
    let t = table(&base(), &[(2, Health::Draining)]);
    let asked = RefCell::new(Vec::new());
    let load = |k: WorkerKey| {
        asked.borrow_mut().push(k);
        WorkerLoad::default()
    };
    let hints = RoutingHints::default();
    let query = EligibilityQuery {
        phase: Phase::Aggregated,
        hints: &hints,
        pin: &PinResolution::Any,
        failed: &[],
        ignore_overload: false,
        same_label_as: None,
    };
    filter(&query, &t, &load, &EligibilityConfig::default(), &mut Vec::new()).unwrap();
    assert_eq!(*asked.borrow(), vec![WorkerKey::new(1, 0), WorkerKey::new(3, 0)]);
}

#[track_caller]
fn check_all_overloaded(verdicts: &[Eligibility], want: bool) {
    assert_eq!(all_overloaded(verdicts), want, "{verdicts:?}");
}

#[test]
fn all_overloaded_means_queue() {
    check_all_overloaded(&[], false);
    check_all_overloaded(&[no(1, 0, over(1, 1))], true);
    check_all_overloaded(&[no(1, 0, over(1, 1)), no(2, 0, Draining)], true);
    check_all_overloaded(&[no(1, 0, over(1, 1)), ok(2, 0)], false);
    check_all_overloaded(&[no(1, 0, Draining), no(2, 0, WrongRole)], false);
}

// ---- migration ----

#[test]
fn failed_workers_are_excluded() {
    let t = table(&[spec(1, Agg, Some(1)), spec(2, Agg, Some(2))], &[]);
    let failed = |ids: Vec<u64>| Q { failed: ids, ..q(Phase::Aggregated) };
    check(&t, failed(vec![1]), Ok(()), &[no(1, 0, FailedBefore), ok(2, 0), ok(2, 1)]);
    // Every candidate failed: migration is exhausted, and the verdicts still say why.
    let exhausted = Err(EligibilityError::MigrationExhausted { failed: 2 });
    check(&t, failed(vec![2, 1]), exhausted, &[no(1, 0, FailedBefore), no(2, 0, FailedBefore), no(2, 1, FailedBefore)]);
    // An explicit pin overrides the failure record for the worker it names.
    let pinned = Q {
        hints: RoutingHints { backend_instance_id: Some(WorkerId(1)), ..RoutingHints::default() },
        pin: PinResolution::Exact(WorkerKey::new(1, 0)),
        ..failed(vec![1, 2])
    };
    check(&t, pinned, Ok(()), &[ok(1, 0), no(2, 0, NotPinned), no(2, 1, NotPinned)]);
    // An affinity pin does not: the session's worker failed, so the request must move.
    let bound = Q { pin: PinResolution::Worker(WorkerId(1)), ..failed(vec![1]) };
    let exhausted = Err(EligibilityError::MigrationExhausted { failed: 1 });
    check(&t, bound, exhausted, &[no(1, 0, FailedBefore), no(2, 0, NotPinned), no(2, 1, NotPinned)]);
}

#[test]
fn migration_waits_for_overloaded_survivors() {
    let t = table(&[spec(1, Agg, Some(1)), spec(2, Agg, Some(1)), spec(3, Agg, Some(1))], &[(3, Health::Ejected)]);
    let c = Q { failed: vec![1], loads: vec![(WorkerKey::new(2, 0), load(1 << 20, 0))], ..q(Phase::Aggregated) };
    let want = [no(1, 0, FailedBefore), no(2, 0, over(1 << 20, 0)), no(3, 0, Ejected)];
    check(&t, c, Ok(()), &want);
    // Without the overloaded survivor, nothing is left.
    let c = Q { failed: vec![1, 2], ..q(Phase::Aggregated) };
    let want = [no(1, 0, FailedBefore), no(2, 0, FailedBefore), no(3, 0, Ejected)];
    check(&t, c, Err(EligibilityError::MigrationExhausted { failed: 2 }), &want);
}

// ---- topology ----

#[test]
fn same_label_restricts() {
    let specs = [
        labelled(spec(1, Dec, Some(1)), &[("node", "n1"), ("rack", "r1")]),
        labelled(spec(2, Dec, Some(1)), &[("node", "n2"), ("rack", "r1")]),
        spec(3, Dec, Some(1)),
    ];
    let t = table(&specs, &[]);
    let near = |label, value| Q { same_label_as: Some((label, value)), ..q(Phase::Decode) };
    let mismatch = |label: &str| TopologyMismatch { label: label.to_string() };
    check(&t, near("node", "n1"), Ok(()), &[ok(1, 0), no(2, 0, mismatch("node")), no(3, 0, mismatch("node"))]);
    check(&t, near("rack", "r1"), Ok(()), &[ok(1, 0), ok(2, 0), no(3, 0, mismatch("rack"))]);
    let none = [no(1, 0, mismatch("zone")), no(2, 0, mismatch("zone")), no(3, 0, mismatch("zone"))];
    check(&t, near("zone", "z"), Ok(()), &none);
}

// ---- messages ----

#[test]
fn reasons_have_codes_and_messages() {
    let all = [
        (NotAllowed, "not_allowed"),
        (Tainted { key: "gpu".to_string() }, "tainted"),
        (over(5, 6), "overloaded"),
        (FailedBefore, "failed_before"),
        (Ejected, "ejected"),
        (Draining, "draining"),
        (WrongRole, "wrong_role"),
        (NotPinned, "not_pinned"),
        (TopologyMismatch { label: "node".to_string() }, "topology_mismatch"),
    ];
    for (reason, code) in all {
        assert_eq!(reason.as_str(), code);
        assert!(!reason.to_string().is_empty());
    }
    assert_eq!(over(5, 6).to_string(), "overloaded (5 active prefill tokens, 6 active decode blocks)");
    assert_eq!(Tainted { key: "gpu".to_string() }.to_string(), "has untolerated NoSchedule taint gpu");
    assert_eq!(EligibilityError::NoWorkers { phase: Phase::Prefill }.to_string(), "no worker serves prefill requests");
}

// ---- resolve, filter, check_pinned together ----

#[track_caller]
fn check_pipeline(t: &WorkerTable, c: Q, affinity: Option<AffinityPin>, want: Result<(), PinError>) {
    let pin = resolve(c.phase, &c.hints, affinity, None, t, false).unwrap();
    let c = Q { pin, ..c };
    let mut out = Vec::new();
    // Filter errors are not under test here.
    let _ = run(t, &c, &mut out);
    assert_eq!(check_pinned(&pin, &out), want, "{pin}");
}

#[test]
fn pinned_worker_that_fails_eligibility_is_an_error() {
    let t = table(&base(), &[(2, Health::Draining)]);
    let explicit = |w| Q {
        hints: RoutingHints { backend_instance_id: Some(WorkerId(w)), ..RoutingHints::default() },
        ..q(Phase::Aggregated)
    };
    check_pipeline(&t, explicit(1), None, Ok(()));
    let draining = Err(PinError::Ineligible { worker: WorkerKey::new(2, 0), reason: Draining });
    check_pipeline(&t, q(Phase::Aggregated), Some(AffinityPin { worker: WorkerId(2), rank: None }), draining);
    let busy = Q { loads: vec![(WorkerKey::new(1, 0), load(1 << 30, 0))], ..explicit(1) };
    check_pipeline(
        &t,
        busy,
        None,
        Err(PinError::Ineligible { worker: WorkerKey::new(1, 0), reason: over(1 << 30, 0) }),
    );
    // Affinity validation ignores overload, so the same load passes.
    let busy =
        Q { loads: vec![(WorkerKey::new(1, 0), load(1 << 30, 0))], ignore_overload: true, ..q(Phase::Aggregated) };
    check_pipeline(&t, busy, Some(AffinityPin { worker: WorkerId(1), rank: None }), Ok(()));
}
