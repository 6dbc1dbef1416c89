//! The driver's timer: deadlines fire on their own, on paused time, with no test sleeps.

use std::time::Duration;

use kvroute_driver::DriveError;

use crate::{check_released, driver, req, tiny_fleet};

#[tokio::test(start_paused = true)]
async fn queue_timeout_fires_via_the_timer() {
    let d = tiny_fleet(|c| c.queue.queue_timeout_ms = 500);
    let mut a = d.route(req(&d, 3, None), d.draw()).await.unwrap();
    a.dispatched().unwrap();
    let t0 = tokio::time::Instant::now();
    let out = d.route(req(&d, 1, None), d.draw()).await;
    assert_eq!(out.unwrap_err(), DriveError::QueueTimeout);
    let waited = t0.elapsed();
    assert!(waited >= Duration::from_millis(500) && waited < Duration::from_millis(600), "waited {waited:?}");
    assert_eq!(d.snapshot().router.timed_out, 1);
    a.finish().unwrap();
    check_released(&d);
}

#[tokio::test(start_paused = true)]
async fn an_earlier_deadline_wakes_the_sleeping_timer() {
    // A finished session arms a 60 s lease deadline; a queued request's 500 ms time-out
    // must not wait behind it.
    let d = tiny_fleet(|c| {
        c.queue.queue_timeout_ms = 500;
        c.affinity.lease_ttl_ms = 60_000;
    });
    let mut s = d.route(req(&d, 1, Some("s")), d.draw()).await.unwrap();
    s.dispatched().unwrap();
    s.finish().unwrap();
    tokio::time::sleep(Duration::from_millis(10)).await;
    let mut a = d.route(req(&d, 3, None), d.draw()).await.unwrap();
    a.dispatched().unwrap();
    let t0 = tokio::time::Instant::now();
    assert_eq!(d.route(req(&d, 1, None), d.draw()).await.unwrap_err(), DriveError::QueueTimeout);
    assert!(t0.elapsed() < Duration::from_millis(600), "fired after {:?}", t0.elapsed());
    drop(a);
    check_released(&d);
}

#[tokio::test(start_paused = true)]
async fn idle_session_bindings_expire_on_their_own() {
    let d = driver(2, |c| c.affinity.lease_ttl_ms = 1_000);
    let mut b = d.route(req(&d, 1, Some("s")), d.draw()).await.unwrap();
    b.dispatched().unwrap();
    b.finish().unwrap();
    assert_eq!(d.snapshot().affinity_sessions, 1);
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    let s = d.snapshot();
    assert_eq!((s.affinity_sessions, s.driver.leases_expired), (0, 1));
}

#[tokio::test(start_paused = true)]
async fn old_bookings_expire_and_finishing_them_is_harmless() {
    let d = driver(1, |c| c.load.request_age_max_ms = 2_000);
    let mut b = d.route(req(&d, 1, None), d.draw()).await.unwrap();
    b.dispatched().unwrap();
    tokio::time::sleep(Duration::from_millis(2_500)).await;
    assert_eq!(d.snapshot().driver.bookings_expired, 1);
    check_released(&d);
    assert!(matches!(b.finish(), Err(DriveError::Input(_))));
    check_released(&d);
}
