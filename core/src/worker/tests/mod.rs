use super::*;
use alloc::string::ToString;
use alloc::vec;
use proptest::prelude::*;

fn spec(id: u64, role: WorkerRole, ranks: Option<u32>) -> WorkerSpec {
    WorkerSpec { dp_ranks: ranks, ..WorkerSpec::new(WorkerId(id), role) }
}

fn taint(key: &str, value: &str, effect: TaintEffect) -> Taint {
    Taint { key: key.to_string(), value: value.to_string(), effect }
}

fn toleration(key: &str, value: Option<&str>, effect: Option<TaintEffect>) -> Toleration {
    Toleration { key: key.to_string(), value: value.map(|v| v.to_string()), effect }
}

// ---- roles ----

#[track_caller]
fn check_serves(role: WorkerRole, aggregated: bool, prefill: bool, decode: bool) {
    let got = [role.serves(Phase::Aggregated), role.serves(Phase::Prefill), role.serves(Phase::Decode)];
    assert_eq!(got, [aggregated, prefill, decode], "{role} serves [aggregated, prefill, decode]");
    assert_eq!(role.as_str().parse::<WorkerRole>(), Ok(role), "round trip of {role}");
}

#[test]
fn roles_serve_phases() {
    check_serves(WorkerRole::Aggregated, true, false, false);
    check_serves(WorkerRole::Prefill, false, true, false);
    check_serves(WorkerRole::Decode, true, false, true);
}

#[test]
fn unknown_names_are_parse_errors() {
    assert!("Prefill".parse::<WorkerRole>().is_err());
    assert!("".parse::<WorkerRole>().is_err());
    assert!("noschedule".parse::<TaintEffect>().is_err());
    assert_eq!("PreferNoSchedule".parse::<TaintEffect>(), Ok(TaintEffect::PreferNoSchedule));
    assert_eq!(WorkerRole::from_str("x").unwrap_err().to_string(), "expected one of: aggregated, prefill, decode");
}

// ---- tolerations (Kubernetes matching) ----

#[track_caller]
fn check_tolerates(t: Toleration, taint: Taint, want: bool) {
    assert_eq!(t.tolerates(&taint), want, "{t:?} vs {taint:?}");
}

#[test]
fn toleration_matching() {
    use TaintEffect::*;
    let gpu = taint("gpu", "a100", NoSchedule);
    // Equal: key and value must match.
    check_tolerates(toleration("gpu", Some("a100"), None), gpu.clone(), true);
    check_tolerates(toleration("gpu", Some("h100"), None), gpu.clone(), false);
    check_tolerates(toleration("tpu", Some("a100"), None), gpu.clone(), false);
    // Exists: any value of the key.
    check_tolerates(toleration("gpu", None, None), gpu.clone(), true);
    check_tolerates(toleration("tpu", None, None), gpu.clone(), false);
    // Empty key with Exists tolerates everything.
    check_tolerates(toleration("", None, None), gpu.clone(), true);
    // Empty key with a value only matches an empty-keyed taint.
    check_tolerates(toleration("", Some("a100"), None), gpu.clone(), false);
    // Effect: None means all, Some must equal.
    check_tolerates(toleration("gpu", None, Some(NoSchedule)), gpu.clone(), true);
    check_tolerates(toleration("gpu", None, Some(PreferNoSchedule)), gpu.clone(), false);
    check_tolerates(toleration("", None, Some(PreferNoSchedule)), taint("x", "", PreferNoSchedule), true);
    check_tolerates(toleration("gpu", Some(""), None), taint("gpu", "", NoSchedule), true);
}

// ---- table bounds ----

fn small() -> WorkerTableConfig {
    WorkerTableConfig { workers_max: 2, dp_ranks_max: 4, taints_max: 1, labels_max: 1 }
}

#[track_caller]
fn check_upsert(table: &mut WorkerTable, spec: WorkerSpec, want: Result<bool, WorkerError>) {
    let before: Vec<_> = table.iter().map(|(s, h)| (s.clone(), h)).collect();
    let got = table.upsert(spec.clone());
    assert_eq!(got, want, "upsert {spec:?}");
    if got.is_err() {
        let after: Vec<_> = table.iter().map(|(s, h)| (s.clone(), h)).collect();
        assert_eq!(before, after, "a refused upsert changes nothing");
    } else {
        assert_eq!(table.get(spec.id), Some(&spec));
    }
}

#[test]
fn upsert_enforces_bounds() {
    use WorkerRole::*;
    let mut t = WorkerTable::new(small());
    let w = WorkerId;
    check_upsert(&mut t, spec(1, Decode, Some(4)), Ok(true));
    check_upsert(&mut t, spec(1, Decode, Some(2)), Ok(false));
    check_upsert(
        &mut t,
        spec(2, Decode, Some(5)),
        Err(WorkerError::TooManyRanks { worker: w(2), ranks: 5, dp_ranks_max: 4 }),
    );
    check_upsert(&mut t, spec(2, Decode, Some(0)), Err(WorkerError::ZeroRanks { worker: w(2) }));
    check_upsert(
        &mut t,
        WorkerSpec { weight: 0, ..spec(2, Decode, None) },
        Err(WorkerError::ZeroWeight { worker: w(2) }),
    );
    let two_taints = vec![taint("a", "", TaintEffect::NoSchedule), taint("b", "", TaintEffect::NoSchedule)];
    check_upsert(
        &mut t,
        WorkerSpec { taints: two_taints, ..spec(2, Decode, None) },
        Err(WorkerError::TooManyTaints { worker: w(2), taints: 2, taints_max: 1 }),
    );
    let two_labels = vec![("node".to_string(), "n1".to_string()), ("rack".to_string(), "r1".to_string())];
    check_upsert(
        &mut t,
        WorkerSpec { labels: two_labels, ..spec(2, Decode, None) },
        Err(WorkerError::TooManyLabels { worker: w(2), labels: 2, labels_max: 1 }),
    );
    check_upsert(&mut t, spec(2, Prefill, None), Ok(true));
    check_upsert(&mut t, spec(3, Prefill, None), Err(WorkerError::TableFull { workers_max: 2 }));
    // Replacing a present worker is allowed when full.
    check_upsert(&mut t, spec(2, Prefill, Some(1)), Ok(false));
    assert_eq!(t.remove(w(1)).map(|s| s.id), Some(w(1)));
    assert_eq!(t.remove(w(1)), None);
    check_upsert(&mut t, spec(3, Prefill, None), Ok(true));
    assert_eq!(t.len(), 2);
}

#[test]
fn mutators_on_unknown_workers_fail() {
    let mut t = WorkerTable::new(small());
    let unknown = Err(WorkerError::UnknownWorker { worker: WorkerId(9) });
    assert_eq!(t.set_health(WorkerId(9), Health::Ejected), unknown);
    assert_eq!(t.set_taints(WorkerId(9), Vec::new()), unknown);
    assert_eq!(t.health(WorkerId(9)), None);
    assert!(t.is_empty());
}

#[test]
fn health_and_taints_survive_as_set() {
    let mut t = WorkerTable::new(small());
    t.upsert(spec(1, WorkerRole::Aggregated, Some(1))).unwrap();
    assert_eq!(t.health(WorkerId(1)), Some(Health::Healthy));
    t.set_health(WorkerId(1), Health::Draining).unwrap();
    // A spec refresh keeps health: it comes from a different source than the spec.
    t.upsert(spec(1, WorkerRole::Aggregated, Some(2))).unwrap();
    assert_eq!(t.health(WorkerId(1)), Some(Health::Draining));
    let two = vec![taint("a", "", TaintEffect::NoSchedule), taint("b", "", TaintEffect::NoSchedule)];
    assert_eq!(
        t.set_taints(WorkerId(1), two),
        Err(WorkerError::TooManyTaints { worker: WorkerId(1), taints: 2, taints_max: 1 })
    );
    assert!(t.get(WorkerId(1)).unwrap().taints.is_empty());
    t.set_taints(WorkerId(1), vec![taint("a", "", TaintEffect::NoSchedule)]).unwrap();
    assert_eq!(t.get(WorkerId(1)).unwrap().taints.len(), 1);
}

// ---- keys ----

#[track_caller]
fn check_keys(specs: &[WorkerSpec], phase: Option<Phase>, want: &[(u64, u32)]) {
    let mut t = WorkerTable::new(WorkerTableConfig::default());
    for s in specs {
        t.upsert(s.clone()).unwrap();
    }
    let got: Vec<WorkerKey> = match phase {
        None => t.keys().collect(),
        Some(p) => t.keys_for_phase(p).collect(),
    };
    let want: Vec<WorkerKey> = want.iter().map(|&(w, r)| WorkerKey::new(w, r)).collect();
    assert_eq!(got, want, "phase {phase:?}");
}

#[test]
fn keys_enumerate_ranks_in_order() {
    use WorkerRole::*;
    let fleet = [spec(7, Prefill, Some(2)), spec(3, Decode, None), spec(5, Aggregated, Some(3))];
    check_keys(&fleet, None, &[(3, 0), (5, 0), (5, 1), (5, 2), (7, 0), (7, 1)]);
    check_keys(&fleet, Some(Phase::Prefill), &[(7, 0), (7, 1)]);
    check_keys(&fleet, Some(Phase::Decode), &[(3, 0)]);
    check_keys(&fleet, Some(Phase::Aggregated), &[(3, 0), (5, 0), (5, 1), (5, 2)]);
    check_keys(&[], None, &[]);
}

#[test]
fn errors_display() {
    let e = WorkerError::TooManyRanks { worker: WorkerId(4), ranks: 9, dp_ranks_max: 8 };
    assert_eq!(e.to_string(), "worker 4 declares 9 dp ranks, above the limit 8");
    assert_eq!(WorkerError::TableFull { workers_max: 3 }.to_string(), "worker table full (3 workers)");
}

// ---- model: random operations against a plain BTreeMap ----

#[derive(Clone, Debug)]
enum Op {
    Upsert(u64, Option<u32>),
    Remove(u64),
    Health(u64, Health),
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        (0u64..6, proptest::option::of(0u32..6)).prop_map(|(w, r)| Op::Upsert(w, r)),
        (0u64..6).prop_map(Op::Remove),
        (0u64..6, prop_oneof![Just(Health::Healthy), Just(Health::Ejected), Just(Health::Draining)])
            .prop_map(|(w, h)| Op::Health(w, h)),
    ]
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    #[test]
    fn table_matches_model(ops in proptest::collection::vec(op(), 0..40)) {
        let cfg = WorkerTableConfig { workers_max: 3, dp_ranks_max: 4, ..WorkerTableConfig::default() };
        let mut t = WorkerTable::new(cfg);
        let mut model: BTreeMap<u64, (Option<u32>, Health)> = BTreeMap::new();
        for op in ops {
            match op {
                Op::Upsert(w, ranks) => {
                    let valid = ranks.is_none_or(|r| (1..=4).contains(&r));
                    let fits = model.contains_key(&w) || model.len() < 3;
                    let got = t.upsert(spec(w, WorkerRole::Decode, ranks));
                    prop_assert_eq!(got.is_ok(), valid && fits);
                    if valid && fits {
                        let health = model.get(&w).map_or(Health::Healthy, |e| e.1);
                        prop_assert_eq!(got, Ok(!model.contains_key(&w)));
                        model.insert(w, (ranks, health));
                    }
                }
                Op::Remove(w) => prop_assert_eq!(t.remove(WorkerId(w)).is_some(), model.remove(&w).is_some()),
                Op::Health(w, h) => {
                    let got = t.set_health(WorkerId(w), h);
                    prop_assert_eq!(got.is_ok(), model.contains_key(&w));
                    if let Some(e) = model.get_mut(&w) { e.1 = h; }
                }
            }
            let want: Vec<WorkerKey> = model
                .iter()
                .flat_map(|(&w, &(r, _))| (0..r.unwrap_or(1)).map(move |r| WorkerKey::new(w, r)))
                .collect();
            prop_assert_eq!(t.keys().collect::<Vec<_>>(), want);
            prop_assert_eq!(t.len(), model.len());
            for (&w, &(_, h)) in &model {
                prop_assert_eq!(t.health(WorkerId(w)), Some(h));
            }
        }
    }
}
