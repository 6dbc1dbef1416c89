use super::*;
use crate::eligible::{check_pinned, Eligibility, Verdict};
use crate::worker::{WorkerRole, WorkerSpec, WorkerTableConfig};
use alloc::string::ToString;
use alloc::vec;

const DP_RANKS_MAX: u32 = 16;

/// The fleet every case resolves against: (id, role, dp ranks).
fn fleet() -> WorkerTable {
    use WorkerRole::*;
    let mut t = WorkerTable::new(WorkerTableConfig { dp_ranks_max: DP_RANKS_MAX, ..WorkerTableConfig::default() });
    for (id, role, ranks) in [
        (1, Aggregated, Some(1)),
        (2, Aggregated, Some(4)),
        (3, Aggregated, None),
        (4, Prefill, Some(2)),
        (5, Prefill, Some(1)),
        (6, Decode, Some(2)),
        (7, Decode, Some(1)),
    ] {
        t.upsert(WorkerSpec { dp_ranks: ranks, ..WorkerSpec::new(WorkerId(id), role) }).unwrap();
    }
    t
}

/// Builds hints fluently: `hints().backend(2).rank(0)`.
trait Build {
    fn backend(self, w: u64) -> Self;
    fn prefill(self, w: u64) -> Self;
    fn decode(self, w: u64) -> Self;
    fn rank(self, r: u32) -> Self;
    fn prefill_rank(self, r: u32) -> Self;
}

impl Build for RoutingHints {
    fn backend(mut self, w: u64) -> Self {
        self.backend_instance_id = Some(WorkerId(w));
        self
    }
    fn prefill(mut self, w: u64) -> Self {
        self.prefill_worker_id = Some(WorkerId(w));
        self
    }
    fn decode(mut self, w: u64) -> Self {
        self.decode_worker_id = Some(WorkerId(w));
        self
    }
    fn rank(mut self, r: u32) -> Self {
        self.dp_rank = Some(DpRank(r));
        self
    }
    fn prefill_rank(mut self, r: u32) -> Self {
        self.prefill_dp_rank = Some(DpRank(r));
        self
    }
}

fn hints() -> RoutingHints {
    RoutingHints::default()
}

fn aff(w: u64, rank: Option<u32>) -> Option<AffinityPin> {
    Some(AffinityPin { worker: WorkerId(w), rank: rank.map(DpRank) })
}

fn key(w: u64, r: u32) -> WorkerKey {
    WorkerKey::new(w, r)
}

fn exact(w: u64, r: u32) -> Result<PinResolution, PinError> {
    Ok(PinResolution::Exact(key(w, r)))
}

// ---- which hint pins which phase ----

#[track_caller]
fn check_explicit(phase: Phase, h: RoutingHints, want: Option<(u64, Option<u32>)>) {
    let want = want.map(|(w, r)| ExplicitPin { worker: WorkerId(w), rank: r.map(DpRank) });
    assert_eq!(explicit_pin(phase, &h), want, "{phase} with {h:?}");
}

#[test]
fn explicit_pin_per_phase() {
    use Phase::*;
    let all = hints().backend(1).prefill(2).decode(3).rank(4).prefill_rank(5);
    check_explicit(Prefill, all.clone(), Some((2, Some(5))));
    check_explicit(Decode, all.clone(), Some((3, Some(4))));
    check_explicit(Aggregated, all, Some((3, Some(4))));
    // Fallbacks to the shared fields.
    check_explicit(Prefill, hints().backend(1).rank(4), Some((1, Some(4))));
    check_explicit(Decode, hints().backend(1).prefill_rank(5), Some((1, None)));
    check_explicit(Aggregated, hints().backend(1).prefill(2), Some((1, None)));
    // A phase-specific id does not leak into the other phases.
    check_explicit(Prefill, hints().decode(3), None);
    check_explicit(Decode, hints().prefill(2), None);
    // Rank 0 is a rank, and a rank alone pins nothing.
    check_explicit(Decode, hints().decode(3).rank(0), Some((3, Some(0))));
    check_explicit(Aggregated, hints().rank(0), None);
    check_explicit(Prefill, hints(), None);
}

// ---- resolution ----

#[track_caller]
fn check(
    phase: Phase,
    h: RoutingHints,
    affinity: Option<AffinityPin>,
    planned: Option<WorkerKey>,
    want: Result<PinResolution, PinError>,
) {
    check_mode(phase, h, affinity, planned, false, want);
}

#[track_caller]
fn check_mode(
    phase: Phase,
    h: RoutingHints,
    affinity: Option<AffinityPin>,
    planned: Option<WorkerKey>,
    direct: bool,
    want: Result<PinResolution, PinError>,
) {
    let got = resolve(phase, &h, affinity, planned, &fleet(), direct);
    assert_eq!(got, want, "{phase} hints={h:?} affinity={affinity:?} planned={planned:?} direct={direct}");
}

#[test]
fn no_pin_means_any() {
    check(Phase::Aggregated, hints(), None, None, Ok(PinResolution::Any));
    check(Phase::Prefill, hints().decode(6), None, None, Ok(PinResolution::Any));
}

#[test]
fn rank_resolution() {
    use Phase::*;
    // The only rank is implied.
    check(Aggregated, hints().backend(1), None, None, exact(1, 0));
    check(Prefill, hints().prefill(5), None, None, exact(5, 0));
    // Rank 0 is a real rank, not "unset".
    check(Aggregated, hints().backend(2).rank(0), None, None, exact(2, 0));
    check(Aggregated, hints().backend(2).rank(3), None, None, exact(2, 3));
    // Several ranks or unknown ranks need an explicit one.
    check(
        Aggregated,
        hints().backend(2),
        None,
        None,
        Err(PinError::RankRequired { worker: WorkerId(2), ranks: Some(4) }),
    );
    check(Aggregated, hints().backend(3), None, None, Err(PinError::RankRequired { worker: WorkerId(3), ranks: None }));
    check(Prefill, hints().prefill(4), None, None, Err(PinError::RankRequired { worker: WorkerId(4), ranks: Some(2) }));
    // An explicit rank on a worker with unknown ranks is taken at its word, up to the bound.
    check(Aggregated, hints().backend(3).rank(2), None, None, exact(3, 2));
    let out = |w, r, ranks| Err(PinError::RankOutOfRange { worker: WorkerId(w), rank: DpRank(r), ranks });
    check(Aggregated, hints().backend(3).rank(DP_RANKS_MAX), None, None, out(3, DP_RANKS_MAX, DP_RANKS_MAX));
    check(Aggregated, hints().backend(2).rank(4), None, None, out(2, 4, 4));
    check(Aggregated, hints().backend(1).rank(1), None, None, out(1, 1, 1));
    // The prefill rank comes from prefill_dp_rank first.
    check(Prefill, hints().prefill(4).rank(0).prefill_rank(1), None, None, exact(4, 1));
    check(Prefill, hints().backend(4).rank(1), None, None, exact(4, 1));
}

#[test]
fn unknown_worker_and_wrong_role() {
    use Phase::*;
    let unknown = |w| Err(PinError::UnknownWorker { worker: WorkerId(w) });
    let wrong = |w, phase| Err(PinError::WrongRole { worker: WorkerId(w), phase });
    check(Aggregated, hints().backend(99), None, None, unknown(99));
    check(Aggregated, hints().backend(4).rank(0), None, None, wrong(4, Aggregated));
    check(Prefill, hints().backend(1), None, None, wrong(1, Prefill));
    check(Prefill, hints().prefill(6).rank(0), None, None, wrong(6, Prefill));
    check(Decode, hints().decode(2).rank(0), None, None, wrong(2, Decode));
    // The disaggregated bypass: an aggregated request may pin a decode worker.
    check(Aggregated, hints().decode(7), None, None, exact(7, 0));
    // Role is checked before rank: the worker is wrong whatever the rank.
    check(Decode, hints().decode(2), None, None, wrong(2, Decode));
}

#[test]
fn explicit_pin_merges_with_affinity() {
    use Phase::*;
    // Same worker, no explicit rank: the binding supplies it.
    check(Aggregated, hints().backend(2), aff(2, Some(3)), None, exact(2, 3));
    // An explicit rank wins over the binding's.
    check(Aggregated, hints().backend(2).rank(1), aff(2, Some(3)), None, exact(2, 1));
    check(Aggregated, hints().backend(2).rank(0), aff(2, Some(3)), None, exact(2, 0));
    // An explicit pin to another worker wins, and the binding's rank does not carry over.
    check(Aggregated, hints().backend(1), aff(2, Some(3)), None, exact(1, 0));
    check(
        Aggregated,
        hints().backend(2),
        aff(1, Some(0)),
        None,
        Err(PinError::RankRequired { worker: WorkerId(2), ranks: Some(4) }),
    );
    // A binding without a rank supplies none.
    check(
        Aggregated,
        hints().backend(2),
        aff(2, None),
        None,
        Err(PinError::RankRequired { worker: WorkerId(2), ranks: Some(4) }),
    );
    // The binding's rank is checked like any other.
    check(
        Aggregated,
        hints().backend(2),
        aff(2, Some(9)),
        None,
        Err(PinError::RankOutOfRange { worker: WorkerId(2), rank: DpRank(9), ranks: 4 }),
    );
    // The prefill binding merges with the prefill pin.
    check(Prefill, hints().prefill(4), aff(4, Some(1)), None, exact(4, 1));
}

#[test]
fn affinity_alone() {
    use Phase::*;
    check(Aggregated, hints(), aff(2, Some(3)), None, exact(2, 3));
    check(Aggregated, hints(), aff(2, Some(0)), None, exact(2, 0));
    // Without a rank the binding narrows to the worker; several or unknown ranks are fine.
    check(Aggregated, hints(), aff(2, None), None, Ok(PinResolution::Worker(WorkerId(2))));
    check(Aggregated, hints(), aff(3, None), None, Ok(PinResolution::Worker(WorkerId(3))));
    check(Aggregated, hints(), aff(1, None), None, Ok(PinResolution::Worker(WorkerId(1))));
    // A stale binding is reported, so the façade can drop it.
    check(Aggregated, hints(), aff(99, None), None, Err(PinError::UnknownWorker { worker: WorkerId(99) }));
    check(Prefill, hints(), aff(6, None), None, Err(PinError::WrongRole { worker: WorkerId(6), phase: Prefill }));
    check(
        Aggregated,
        hints(),
        aff(1, Some(1)),
        None,
        Err(PinError::RankOutOfRange { worker: WorkerId(1), rank: DpRank(1), ranks: 1 }),
    );
}

#[test]
fn planned_worker_narrows_or_conflicts() {
    use Phase::*;
    let conflict = |requested, planned| Err(PinError::Conflict { requested, planned });
    let w = |id| PinResolution::Worker(WorkerId(id));
    let e = |id, r| PinResolution::Exact(key(id, r));
    check(Aggregated, hints(), None, Some(key(2, 1)), exact(2, 1));
    check(Aggregated, hints().backend(2).rank(1), None, Some(key(2, 1)), exact(2, 1));
    // A worker pin without rank takes the planned rank instead of asking for one.
    check(Aggregated, hints().backend(2), None, Some(key(2, 2)), exact(2, 2));
    check(Aggregated, hints(), aff(2, None), Some(key(2, 2)), exact(2, 2));
    // Disagreements name both sides.
    check(Aggregated, hints().backend(2).rank(1), None, Some(key(2, 2)), conflict(e(2, 1), key(2, 2)));
    check(Aggregated, hints().backend(1), None, Some(key(2, 0)), conflict(w(1), key(2, 0)));
    check(Aggregated, hints(), aff(2, None), Some(key(1, 0)), conflict(w(2), key(1, 0)));
    check(Aggregated, hints(), aff(2, Some(3)), Some(key(2, 0)), conflict(e(2, 3), key(2, 0)));
    check(Decode, hints().decode(6).rank(0), None, Some(key(7, 0)), conflict(e(6, 0), key(7, 0)));
    // The planned key is validated like a pin.
    check(Aggregated, hints(), None, Some(key(99, 0)), Err(PinError::UnknownWorker { worker: WorkerId(99) }));
    check(
        Aggregated,
        hints(),
        None,
        Some(key(2, 4)),
        Err(PinError::RankOutOfRange { worker: WorkerId(2), rank: DpRank(4), ranks: 4 }),
    );
    check(Prefill, hints(), None, Some(key(1, 0)), Err(PinError::WrongRole { worker: WorkerId(1), phase: Prefill }));
}

#[test]
fn direct_mode_requires_a_target() {
    use Phase::*;
    let required = |phase| Err(PinError::DirectTargetRequired { phase });
    check_mode(Aggregated, hints(), None, None, true, required(Aggregated));
    // Neither a binding nor a plan counts: the request itself must name the worker.
    check_mode(Decode, hints(), aff(7, Some(0)), Some(key(7, 0)), true, required(Decode));
    // A target for another phase does not count.
    check_mode(Prefill, hints().decode(6).rank(0), None, None, true, required(Prefill));
    check_mode(Decode, hints().prefill(4).rank(0), None, None, true, required(Decode));
    check_mode(Prefill, hints().backend(5), None, None, true, exact(5, 0));
    check_mode(Decode, hints().decode(6).rank(1), None, None, true, exact(6, 1));
    // Direct mode keeps every other rule.
    check_mode(
        Decode,
        hints().decode(6),
        None,
        None,
        true,
        Err(PinError::RankRequired { worker: WorkerId(6), ranks: Some(2) }),
    );
}

#[track_caller]
fn check_message(e: PinError, want: &str) {
    assert_eq!(e.to_string(), want);
}

#[test]
fn error_messages() {
    use Phase::*;
    check_message(
        PinError::DirectTargetRequired { phase: Prefill },
        "worker ID required for prefill request in Direct routing mode",
    );
    check_message(
        PinError::DirectTargetRequired { phase: Decode },
        "worker ID required for decode request in Direct routing mode",
    );
    check_message(
        PinError::DirectTargetRequired { phase: Aggregated },
        "worker ID required for aggregated request in Direct routing mode",
    );
    check_message(
        PinError::Conflict { requested: PinResolution::Exact(key(2, 1)), planned: key(3, 0) },
        "request pins worker 2 rank 1 but worker 3 rank 0 was planned",
    );
    check_message(
        PinError::Conflict { requested: PinResolution::Worker(WorkerId(2)), planned: key(3, 0) },
        "request pins worker 2 but worker 3 rank 0 was planned",
    );
    check_message(
        PinError::RankRequired { worker: WorkerId(2), ranks: Some(4) },
        "worker 2 has 4 dp ranks; the pin must name one",
    );
    check_message(
        PinError::Ineligible { worker: key(2, 0), reason: ExclusionReason::Draining },
        "pinned worker 2 rank 0 is not eligible: draining",
    );
}

// ---- pinned worker vs eligibility verdicts ----

fn ok(w: u64, r: u32) -> Eligibility {
    Eligibility { key: key(w, r), verdict: Verdict::Eligible { cost_factor: 1.0 } }
}

fn no(w: u64, r: u32, reason: ExclusionReason) -> Eligibility {
    Eligibility { key: key(w, r), verdict: Verdict::Excluded(reason) }
}

#[track_caller]
fn check_pinned_case(pin: PinResolution, verdicts: &[Eligibility], want: Result<(), PinError>) {
    assert_eq!(check_pinned(&pin, verdicts), want, "{pin}");
}

#[test]
fn pinned_worker_must_be_eligible() {
    use ExclusionReason::*;
    use PinResolution::{Any, Exact, Worker};
    let over = || Overloaded { prefill_tokens: 1, decode_blocks: 2 };
    let verdicts = vec![no(1, 0, NotPinned), ok(2, 0), no(2, 1, Draining), no(3, 0, over()), no(3, 1, Ejected)];
    check_pinned_case(Any, &[], Ok(()));
    check_pinned_case(Any, &verdicts, Ok(()));
    check_pinned_case(Exact(key(2, 0)), &verdicts, Ok(()));
    check_pinned_case(Exact(key(2, 1)), &verdicts, Err(PinError::Ineligible { worker: key(2, 1), reason: Draining }));
    check_pinned_case(Worker(WorkerId(2)), &verdicts, Ok(()));
    // A worker pin with no eligible rank names its lowest rank's reason.
    check_pinned_case(Worker(WorkerId(3)), &verdicts, Err(PinError::Ineligible { worker: key(3, 0), reason: over() }));
    check_pinned_case(Exact(key(3, 1)), &verdicts, Err(PinError::Ineligible { worker: key(3, 1), reason: Ejected }));
    // A key the filter never judged is unknown.
    check_pinned_case(Exact(key(9, 0)), &verdicts, Err(PinError::UnknownWorker { worker: WorkerId(9) }));
    check_pinned_case(Worker(WorkerId(9)), &verdicts, Err(PinError::UnknownWorker { worker: WorkerId(9) }));
}
