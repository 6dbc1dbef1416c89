//! Bookings and waiters: every way a request can end releases what it held.

use kvroute_driver::{DispatchFailure, DriveError};
use router_core::Phase;

use crate::{check_released, driver, req, settle, tiny_fleet};

/// A dispatched request that makes the tiny fleet busy, and a route queued behind it.
async fn queued_behind_busy(
    d: &kvroute_driver::Driver,
) -> (kvroute_driver::Booking, tokio::task::JoinHandle<Result<kvroute_driver::Booking, DriveError>>) {
    let mut a = d.route(req(d, 3, None), d.draw()).await.unwrap();
    a.dispatched().unwrap();
    let (d2, r) = (d.clone(), req(d, 1, None));
    let queued = tokio::spawn(async move { d2.route(r, d2.draw()).await });
    settle("request queued", || d.snapshot().queue_depth == 1).await;
    (a, queued)
}

#[tokio::test(start_paused = true)]
async fn finish_releases_load_and_lease() {
    let d = driver(2, |_| {});
    let mut b = d.route(req(&d, 3, Some("s")), d.draw()).await.unwrap();
    assert_eq!(d.snapshot().load_total.active_requests, 1);
    b.dispatched().unwrap();
    assert_eq!(d.snapshot().affinity_live_leases, 1);
    b.prefill_done().unwrap();
    b.finish().unwrap();
    check_released(&d);
    assert_eq!(d.snapshot().affinity_sessions, 1, "the session binding outlives its stream");
}

#[tokio::test(start_paused = true)]
async fn dropping_a_booking_releases_it_in_every_state() {
    for confirm in [false, true] {
        let d = driver(2, |_| {});
        let mut b = d.route(req(&d, 2, Some("s")), d.draw()).await.unwrap();
        if confirm {
            b.dispatched().unwrap();
        }
        drop(b);
        check_released(&d);
        let bound = d.with_router(|r| r.session_binding(b"s", Phase::Aggregated).is_some());
        assert_eq!(bound, confirm, "a cancelled client keeps a committed binding, and only that");
    }
}

#[tokio::test(start_paused = true)]
async fn worker_failure_drops_the_session_binding() {
    let d = driver(2, |_| {});
    let mut b = d.route(req(&d, 1, Some("s")), d.draw()).await.unwrap();
    b.dispatched().unwrap();
    let first = b.target();
    b.fail(DispatchFailure::Worker).unwrap();
    check_released(&d);
    assert!(d.with_router(|r| r.session_binding(b"s", Phase::Aggregated).is_none()));
    let again = d.route(req(&d, 1, Some("s")), d.draw()).await.unwrap();
    assert_ne!(again.target(), first, "round-robin moves on once the binding is gone");
}

#[tokio::test(start_paused = true)]
async fn dropping_a_queued_route_frees_its_slot() {
    let d = tiny_fleet(|_| {});
    let (a, queued) = queued_behind_busy(&d).await;
    queued.abort();
    assert!(queued.await.unwrap_err().is_cancelled());
    let s = d.snapshot();
    assert_eq!((s.queue_depth, s.requests_in_flight, s.driver.waiters), (0, 1, 0));
    a.finish().unwrap();
    check_released(&d);
}

#[tokio::test(start_paused = true)]
async fn a_queued_request_is_routed_when_load_drops() {
    let d = tiny_fleet(|_| {});
    let (a, queued) = queued_behind_busy(&d).await;
    a.prefill_done().unwrap();
    assert_eq!(queued.await.unwrap().map(|b| b.target()), Ok(a.target()));
    a.finish().unwrap();
    check_released(&d);
}

#[tokio::test(start_paused = true)]
async fn session_waiters_wake_on_commit_and_on_abort() {
    for commit in [true, false] {
        let d = driver(3, |_| {});
        let mut first = Some(d.route(req(&d, 1, Some("chat")), d.draw()).await.unwrap());
        let (d2, r) = (d.clone(), req(&d, 1, Some("chat")));
        let second = tokio::spawn(async move { d2.route(r, d2.draw()).await });
        settle("second request waits", || d.snapshot().driver.waiters == 1).await;
        let target = first.as_ref().map(|b| b.target());
        if commit {
            if let Some(b) = first.as_mut() {
                b.dispatched().unwrap();
            }
        } else {
            first = None;
        }
        let second = second.await.unwrap().expect("the waiter is routed");
        if commit {
            assert_eq!(Some(second.target()), target, "the waiter follows the committed binding");
        }
        drop((first, second));
        check_released(&d);
    }
}

#[tokio::test(start_paused = true)]
async fn dropping_a_session_waiter_frees_its_wait() {
    let d = driver(2, |_| {});
    let mut first = d.route(req(&d, 1, Some("chat")), d.draw()).await.unwrap();
    let (d2, r) = (d.clone(), req(&d, 1, Some("chat")));
    let second = tokio::spawn(async move { d2.route(r, d2.draw()).await });
    settle("second request waits", || d.snapshot().driver.waiters == 1).await;
    second.abort();
    let _ = second.await;
    first.dispatched().unwrap();
    first.finish().unwrap();
    check_released(&d);
}

#[tokio::test(start_paused = true)]
async fn rejection_and_route_errors_are_typed() {
    let d = tiny_fleet(|c| c.queue.queued_max = 0);
    let mut a = d.route(req(&d, 3, None), d.draw()).await.unwrap();
    a.dispatched().unwrap();
    assert!(matches!(d.route(req(&d, 1, None), d.draw()).await, Err(DriveError::Rejected(_))));
    let empty = driver(0, |_| {});
    assert!(matches!(empty.route(req(&empty, 1, None), empty.draw()).await, Err(DriveError::Route(_))));
    drop(a);
    check_released(&d);
}

#[tokio::test(start_paused = true)]
async fn removing_the_worker_orphans_its_bookings_harmlessly() {
    let d = driver(2, |_| {});
    let mut b = d.route(req(&d, 2, Some("s")), d.draw()).await.unwrap();
    b.dispatched().unwrap();
    d.remove_worker(b.target().worker).unwrap();
    d.check_invariants().unwrap();
    b.finish().unwrap();
    check_released(&d);
    let again = d.route(req(&d, 1, Some("s")), d.draw()).await.unwrap();
    assert_eq!(d.snapshot().workers.len(), 1);
    assert_eq!(again.target().worker, d.snapshot().workers[0].spec.id, "the session re-binds to a live worker");
}

#[tokio::test(start_paused = true)]
async fn preview_books_nothing() {
    let d = driver(3, |_| {});
    let p = d.preview(req(&d, 4, Some("s")), d.draw()).unwrap();
    assert!(p.preview);
    assert_eq!(p.explanation.len(), 3);
    check_released(&d);
    assert_eq!(d.snapshot().affinity_sessions, 0);
}

#[tokio::test(start_paused = true)]
async fn a_routed_output_nobody_reads_is_rolled_back() {
    // The queued request is routed while its task is not running (one thread, no yield),
    // then the task is dropped before it reads the booking.
    let d = tiny_fleet(|_| {});
    let (a, queued) = queued_behind_busy(&d).await;
    a.prefill_done().unwrap();
    assert_eq!(d.snapshot().load_total.active_requests, 2, "the queued request now holds a booking");
    queued.abort();
    assert!(queued.await.unwrap_err().is_cancelled());
    assert_eq!(d.snapshot().load_total.active_requests, 1, "its booking was rolled back");
    a.finish().unwrap();
    check_released(&d);
}
