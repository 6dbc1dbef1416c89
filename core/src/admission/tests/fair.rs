//! Sharing the queue between tenants: scripted scenarios through the one `check`.

use super::*;

impl QueueEntry {
    fn tenant(mut self, t: u16) -> Self {
        self.tenant = TenantId(t);
        self
    }
}

/// A request `req` of tenant `t`.
fn t(tenant: u16, req: u64) -> QueueEntry {
    e(req).tenant(tenant)
}

/// FCFS with these tenant weights (tenant `i` weighs `weights[i]`).
fn weighted(weights: &[u32]) -> QueueConfig {
    QueueConfig { tenant_weights: weights.to_vec(), ..cfg(QueueOrder::Fcfs) }
}

#[test]
fn equal_tenants_take_turns_lower_id_first() {
    check(
        weighted(&[]),
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            Push(t(1, 3)),
            Push(t(1, 4)),
            Push(t(2, 101)),
            Push(t(2, 102)),
            Peek(Some(1)),
            Drain(&[1, 101, 2, 102, 3, 4]),
        ],
    );
}

#[test]
fn weights_share_the_pops() {
    // Tenant 1 weighs 3, tenant 2 weighs 1: three of 1's per one of 2's while both wait.
    check(
        weighted(&[1, 3, 1]),
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            Push(t(1, 3)),
            Push(t(1, 4)),
            Push(t(1, 5)),
            Push(t(1, 6)),
            Push(t(1, 7)),
            Push(t(2, 101)),
            Push(t(2, 102)),
            // Tags: tenant 1 at 0, 1/3, 2/3, 1, 4/3; tenant 2 at 0, 1. Ties go to the
            // lower id.
            Drain(&[1, 101, 2, 3, 4, 102, 5, 6, 7]),
        ],
    );
}

#[test]
fn a_flood_does_not_delay_another_tenant_past_its_share() {
    let mut steps = alloc::vec![At(0)];
    steps.extend((1..=50).map(|req| Push(t(1, req))));
    steps.extend([Pop(Some(1)), Pop(Some(2)), Pop(Some(3)), At(10), Push(t(2, 101)), Push(t(2, 102))]);
    // Tenant 2 arrives behind 47 queued requests of tenant 1 and still waits for one.
    steps.extend([Pop(Some(101)), Pop(Some(4)), Pop(Some(102)), Pop(Some(5)), Len(45)]);
    check(weighted(&[]), &steps);
}

#[test]
fn priorities_order_within_a_tenant_only() {
    check(
        weighted(&[]),
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            Push(t(2, 101)),
            // A higher priority goes first among tenant 1's, not before tenant 2's turn.
            Push(t(1, 3).prio(100)),
            Push(t(1, 4).jump(1_000_000)),
            Drain(&[3, 101, 4, 1, 2]),
        ],
    );
}

#[test]
fn leaving_and_coming_back_banks_nothing() {
    check(
        weighted(&[]),
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            Push(t(1, 3)),
            Push(t(2, 101)),
            Pop(Some(1)),
            Pop(Some(101)),
            // Tenant 2 was just served: back at once, it waits for its turn again.
            Push(t(2, 102)),
            Drain(&[2, 102, 3]),
        ],
    );
}

#[test]
fn an_idle_tenant_saves_no_credit() {
    check(
        weighted(&[]),
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            Push(t(1, 3)),
            Push(t(1, 4)),
            Push(t(1, 5)),
            Push(t(1, 6)),
            Drain(&[1, 2, 3, 4, 5, 6]),
            Push(t(1, 7)),
            Push(t(1, 8)),
            Pop(Some(7)),
            // Tenant 2 idled while tenant 1 was served: it gets turns, not a burst.
            Push(t(2, 101)),
            Push(t(2, 102)),
            Push(t(2, 103)),
            Drain(&[101, 8, 102, 103]),
        ],
    );
}

#[test]
fn cancels_and_timeouts_charge_nobody() {
    check(
        weighted(&[]),
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            At(500),
            Push(t(2, 101)),
            Push(t(2, 102)),
            Cancel(1, true),
            At(TIMEOUT_MS),
            Timeout(&[2]),
            At(TIMEOUT_MS + 1),
            Push(t(1, 3)),
            // Tenant 1 was served nothing: still first on a tie.
            Drain(&[3, 101, 102]),
            Len(0),
        ],
    );
}

#[test]
fn ids_past_tenants_max_share_tenant_0() {
    let c = QueueConfig { tenants_max: 2, ..weighted(&[]) };
    check(c, &[Push(t(0, 1)), Push(t(0, 2)), Push(t(5, 3)), Push(t(1, 101)), Drain(&[1, 101, 2, 3])]);
    // With room for id 5, it is a tenant of its own.
    check(weighted(&[]), &[Push(t(0, 1)), Push(t(0, 2)), Push(t(5, 3)), Push(t(1, 101)), Drain(&[1, 101, 3, 2])]);
}

#[test]
fn zero_and_huge_weights_are_clamped() {
    // 0 counts as 1: plain turns.
    check(weighted(&[0, 0]), &[Push(t(0, 1)), Push(t(0, 2)), Push(t(1, 101)), Drain(&[1, 101, 2])]);
    // u32::MAX counts as TENANT_WEIGHT_MAX: tenant 0 takes every pop but one per 2^16.
    let mut steps: Vec<Step> = (1..=5).map(|req| Push(t(0, req))).collect();
    steps.extend([Push(t(1, 101)), Drain(&[1, 101, 2, 3, 4, 5])]);
    check(weighted(&[u32::MAX, 1]), &steps);
}

#[test]
fn listed_tenants_keep_their_queue_slots() {
    // queued_max 10 with weights 2:1:1 keeps 5, 2 and 2 slots; one is free for anyone.
    let c = QueueConfig { queued_max: 10, ..weighted(&[2, 1, 1]) };
    check(
        c,
        &[
            Push(t(1, 1)),
            Push(t(1, 2)),
            // Past its own slots, tenant 1 takes the free one, then nothing more: the
            // rest is kept for tenants 0 and 2 (3 queued + 7 kept).
            Push(t(1, 3)),
            Refused(t(1, 4), "default", LimitKind::QueueFull, 10, 10),
            // An unlisted tenant keeps no slots and finds none free.
            Refused(t(3, 4), "default", LimitKind::QueueFull, 10, 10),
            Push(t(2, 101)),
            Push(t(2, 102)),
            Refused(t(2, 103), "default", LimitKind::QueueFull, 10, 10),
            Push(t(0, 201)),
            Push(t(0, 202)),
            Push(t(0, 203)),
            Push(t(0, 204)),
            Push(t(0, 205)),
            Len(10),
            Refused(t(0, 206), "default", LimitKind::QueueFull, 10, 10),
            // Tenant 1 was past its slots: its pop frees one for anyone; tenant 0's pop
            // frees one only it may fill.
            Pop(Some(201)),
            Pop(Some(1)),
            Push(t(2, 103)),
            Refused(t(1, 4), "default", LimitKind::QueueFull, 10, 10),
            Push(t(0, 206)),
            Len(10),
        ],
    );
}

#[test]
fn without_listed_tenants_queue_full_is_unchanged() {
    let c = QueueConfig { queued_max: 2, ..weighted(&[]) };
    check(c, &[Push(t(1, 1)), Push(t(1, 2)), Refused(t(2, 3), "default", LimitKind::QueueFull, 2, 2)]);
}
