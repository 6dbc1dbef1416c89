//! Every public error of the core is a `core::error::Error`, and an error that wraps
//! another names it as its `source()`: a table of errors and the Display of each link
//! of their chains. A wrapper that forgets its `source()` ends its chain early and fails.

use core::error::Error;

use router_core::{
    AffinityError, BlockSizeError, EligibilityError, IndexError, InputError, InvariantViolation, LearnError,
    ParseError, Phase, PinError, RemoteLoadError, ReplicaError, RouteError, RouterModeParseError, SelectError, SeqHash,
    WorkerError, WorkerId,
};

/// The Display of `e` and of each of its sources, outermost first.
fn chain(e: &(dyn Error + 'static)) -> Vec<String> {
    std::iter::successors(Some(e), |&e| e.source()).map(ToString::to_string).collect()
}

#[track_caller]
fn check(e: &(dyn Error + 'static), links: &[&str]) {
    assert_eq!(chain(e), links, "{e:?}");
}

const W: WorkerId = WorkerId(3);

#[test]
fn wrapping_errors_name_their_cause_as_source() {
    let affinity = AffinityError::SessionIdEmpty;
    let pin = PinError::UnknownWorker { worker: W };
    let eligibility = EligibilityError::NoWorkers { phase: Phase::Decode };
    let select = SelectError::NoCandidates;
    let index = IndexError::UnknownParent { parent: SeqHash(9) };
    let worker = WorkerError::UnknownWorker { worker: W };
    let load = RemoteLoadError::TooManyReplicas { replicas_max: 2 };
    let cases: [(&dyn Error, &dyn Error); 8] = [
        (&RouteError::Affinity(affinity), &affinity),
        (&RouteError::Pin(pin.clone()), &pin),
        (&RouteError::Eligibility(eligibility), &eligibility),
        (&RouteError::Select(select), &select),
        (&InputError::Index(index), &index),
        (&InputError::Worker(worker), &worker),
        (&ReplicaError::Load(load), &load),
        (&ReplicaError::Affinity(affinity), &affinity),
    ];
    for (outer, inner) in cases {
        check(outer, &[&outer.to_string(), &inner.to_string()]);
    }
}

#[test]
fn leaf_errors_end_their_chain() {
    let leaves: [&dyn Error; 17] = [
        &AffinityError::TableFull { sessions_max: 4 },
        &BlockSizeError::Invalid { tokens: 0 },
        &EligibilityError::MigrationExhausted { failed: 2 },
        &IndexError::UnknownParent { parent: SeqHash(1) },
        &InvariantViolation("sums differ".into()),
        &LearnError::UnknownWorker { worker: W },
        &LearnError::BadValue,
        &ParseError { expected: "a, b" },
        &PinError::UnknownWorker { worker: W },
        &RemoteLoadError::TableFull { remote_requests_max: 8 },
        &RouterModeParseError::Unknown,
        &SelectError::NoCandidates,
        &WorkerError::ZeroRanks { worker: W },
        &RouteError::WorkerGone,
        &InputError::UnknownRequest { id: router_core::RequestId(1), phase: Phase::Prefill },
        &ReplicaError::Disabled,
        &ReplicaError::OwnReplica,
    ];
    for e in leaves {
        check(e, &[&e.to_string()]);
    }
}
