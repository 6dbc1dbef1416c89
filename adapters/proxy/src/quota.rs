//! The tenants' rate and concurrency quotas as plain data, for the limits layer
//! (`limits.rs`): token buckets holding a second's requests and a minute's tokens,
//! refilled continuously on tokio's clock (paused in tests), and a semaphore of
//! `concurrent_max` slots. Each tenant has its own, so one tenant's flood never refuses
//! another's. A refused request is charged nothing.
//!
//! An admitted request's token charge is a [`Charge`], settled when the response body
//! ends or is dropped ([`Hold`]): the tokens it reserved are given back and what it
//! used is taken instead (the true-up). What it used is the engine's `usage` when the
//! body carries one, else its stream's events, else the reservation stands.

use std::sync::{Arc, Mutex};

use http::StatusCode;
use kvroute_frontend::metrics::{Metrics, TenantSeries};
use kvroute_frontend::tenants::{Tenant, Tenants};
use prometheus_client::metrics::counter::Counter;
use router_core::TenantId;
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::error::ApiError;
use crate::usage::UsageScan;

/// Every tenant's limits, by tenant id.
pub(crate) struct TenantLimits {
    tenants: Vec<Limiter>,
}

/// One tenant's buckets and slots (`None` where it is unlimited), and its metrics.
struct Limiter {
    series: Option<TenantSeries>,
    requests: Option<Mutex<Bucket>>,
    tokens: Option<Arc<Mutex<Bucket>>>,
    slots: Option<Arc<Semaphore>>,
}

/// A token bucket of `capacity`, refilled at `per_s` a second.
struct Bucket {
    capacity: f64,
    per_s: f64,
    level: f64,
    at: Instant,
}

/// Which limit refused a request (its metrics label).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Over {
    /// `requests_per_second`.
    Requests,
    /// `tokens_per_minute`.
    Tokens,
    /// `concurrent_max`.
    Concurrent,
}

impl Over {
    /// The metrics label.
    pub(crate) fn label(self) -> &'static str {
        match self {
            Over::Requests => "requests_per_second",
            Over::Tokens => "tokens_per_minute",
            Over::Concurrent => "concurrent_max",
        }
    }
}

impl Bucket {
    fn new(capacity: f64, per_s: f64, now: Instant) -> Self {
        Bucket { capacity, per_s, level: capacity, at: now }
    }

    fn refill(&mut self, now: Instant) {
        let dt = now.saturating_duration_since(self.at).as_secs_f64();
        self.level = (self.level + dt * self.per_s).min(self.capacity);
        self.at = now;
    }

    /// Whole seconds until `n` is in the bucket (at least 1), or 0 when it is now.
    fn wait_s(&self, n: f64) -> u64 {
        let missing = n.min(self.capacity) - self.level;
        if missing <= 0.0 {
            0
        } else {
            ((missing / self.per_s).ceil() as u64).max(1)
        }
    }
}

impl TenantLimits {
    /// The limits of `tenants`, buckets full at `now`, counting into `metrics`.
    pub(crate) fn new(tenants: &Tenants, metrics: &Metrics, now: Instant) -> Self {
        TenantLimits { tenants: tenants.iter().map(|t| Limiter::new(t, metrics.tenant_series(&t.name), now)).collect() }
    }

    /// Tenant `id`'s series, made at start.
    pub(crate) fn series(&self, id: TenantId) -> Option<&TenantSeries> {
        self.tenants.get(usize::from(id.0)).and_then(|l| l.series.as_ref())
    }

    /// Admits a request of tenant `id` costing `tokens` at `now`, `prompt` of them its
    /// prompt's: what it holds (its slot when the tenant has a `concurrent_max`, its
    /// charge when a `tokens_per_minute`), or the limit it is over and the seconds to
    /// wait.
    pub(crate) fn admit(&self, id: usize, prompt: u64, tokens: u64, now: Instant) -> Result<Hold, (Over, u64)> {
        let Some(l) = self.tenants.get(id) else { return Ok(Hold::default()) };
        let slot = match &l.slots {
            Some(s) => Some(s.clone().try_acquire_owned().map_err(|_| (Over::Concurrent, 1))?),
            None => None,
        };
        let mut requests = l.requests.as_ref().map(|b| b.lock().unwrap_or_else(|p| p.into_inner()));
        let mut charge = l.tokens.as_ref().map(|b| b.lock().unwrap_or_else(|p| p.into_inner()));
        let tokens = tokens as f64;
        for (b, n, over) in [(&mut requests, 1.0, Over::Requests), (&mut charge, tokens, Over::Tokens)] {
            if let Some(b) = b.as_deref_mut() {
                b.refill(now);
                match b.wait_s(n) {
                    0 => {}
                    s => return Err((over, s)),
                }
            }
        }
        let charged = charge.as_ref().map_or(0.0, |b| tokens.min(b.capacity));
        for (b, n) in [(requests, 1.0), (charge, tokens)] {
            if let Some(mut b) = b {
                b.level -= n.min(b.capacity);
            }
        }
        let counted = l.series.as_ref().map(|s| s.charged_tokens.clone());
        let charge =
            l.tokens.clone().map(|bucket| Charge { bucket, charged, prompt, scan: UsageScan::default(), counted });
        Ok(Hold { slot, charge })
    }
}

/// What an admitted request holds until its response body ends or is dropped: its
/// concurrency slot and its token charge, trued up when dropped.
#[derive(Default)]
pub struct Hold {
    slot: Option<OwnedSemaphorePermit>,
    charge: Option<Charge>,
}

impl Hold {
    /// Whether it holds nothing (an unlimited tenant): the body needs no wrapper.
    pub(crate) fn is_empty(&self) -> bool {
        self.slot.is_none() && self.charge.is_none()
    }

    /// Reads a frame of the response body, for the true-up.
    pub(crate) fn observe(&mut self, data: &[u8]) {
        if let Some(c) = &mut self.charge {
            c.scan.observe(data);
        }
    }

    /// The request ended without a response body (an error answer): it used its
    /// prompt, no output.
    pub(crate) fn failed(mut self) {
        if let Some(c) = self.charge.take() {
            c.settle(c.prompt);
        }
    }
}

impl Drop for Hold {
    fn drop(&mut self) {
        if let Some(c) = self.charge.take() {
            let used = c.scan.used();
            let reserved_output = c.charged - c.prompt.min(c.charged as u64) as f64;
            let used = match used.output {
                Some(out) => used.prompt.unwrap_or(c.prompt).saturating_add(out),
                None => c.prompt.saturating_add(reserved_output as u64),
            };
            c.settle(used);
        }
    }
}

/// A request's token charge: the bucket it was taken from and how much.
struct Charge {
    bucket: Arc<Mutex<Bucket>>,
    charged: f64,
    prompt: u64,
    scan: UsageScan,
    /// `kvroute_tenant_charged_tokens_total`, counted once trued up.
    counted: Option<Counter>,
}

impl Charge {
    /// Gives back the charge and takes `used` tokens instead, at most a bucketful. A
    /// request that used more than it reserved may leave the bucket in debt, at most
    /// one bucketful.
    fn settle(&self, used: u64) {
        let mut b = self.bucket.lock().unwrap_or_else(|p| p.into_inner());
        let used = (used as f64).min(b.capacity);
        b.level = (b.level + self.charged - used).clamp(-b.capacity, b.capacity);
        if let Some(c) = &self.counted {
            c.inc_by(used as u64);
        }
    }
}

impl Limiter {
    fn new(t: &Tenant, series: TenantSeries, now: Instant) -> Self {
        Limiter {
            series: Some(series),
            requests: t.requests_per_second.map(|r| Mutex::new(Bucket::new(f64::from(r), f64::from(r), now))),
            tokens: t.tokens_per_minute.map(|n| Arc::new(Mutex::new(Bucket::new(n as f64, n as f64 / 60.0, now)))),
            slots: t.concurrent_max.map(|n| Arc::new(Semaphore::new(n as usize))),
        }
    }
}

/// 429 `rate_limit_exceeded`, naming the limit and never the key.
pub(crate) fn rate_limited(tenant: &str, over: Over, retry_after_s: u64) -> ApiError {
    ApiError {
        status: StatusCode::TOO_MANY_REQUESTS,
        kind: "rate_limit_error",
        code: "rate_limit_exceeded",
        message: format!("tenant {tenant} is over its {}", over.label()),
        retry_after_s: Some(retry_after_s),
        detail: None,
    }
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;

    /// A tenant limited to 2 requests a second, 600 tokens a minute and 3 at once, asked
    /// `asks` (seconds since start, tokens); `want` per ask: admitted, or the limit and
    /// `Retry-After`. Admitted requests hold what they took throughout.
    #[track_caller]
    fn check(asks: &[(f64, u64)], want: &[Result<(), (Over, u64)>]) {
        let (t0, limits) = limits();
        let mut held = Vec::new();
        let got: Vec<_> = asks
            .iter()
            .map(|&(at, n)| {
                let r = limits.admit(0, 0, n, t0 + Duration::from_secs_f64(at));
                r.map(|hold| held.push(hold))
            })
            .collect();
        assert_eq!(got, want);
    }

    fn limits() -> (Instant, TenantLimits) {
        let t0 = Instant::now();
        let limiter = Limiter {
            series: None,
            requests: Some(Mutex::new(Bucket::new(2.0, 2.0, t0))),
            tokens: Some(Arc::new(Mutex::new(Bucket::new(600.0, 10.0, t0)))),
            slots: Some(Arc::new(Semaphore::new(3))),
        };
        (t0, TenantLimits { tenants: vec![limiter] })
    }

    #[test]
    fn each_limit_refuses_with_the_wait_until_it_would_admit() {
        use Over::*;
        check(&[(0.0, 1), (0.0, 1), (0.0, 1)], &[Ok(()), Ok(()), Err((Requests, 1))]);
        check(&[(0.0, 1), (0.0, 1), (0.5, 1)], &[Ok(()), Ok(()), Ok(())]);
        check(&[(0.0, 500), (0.0, 200)], &[Ok(()), Err((Tokens, 10))]);
        check(&[(0.0, 500), (10.0, 200)], &[Ok(()), Ok(())]);
        check(&[(0.0, 10_000), (0.0, 1)], &[Ok(()), Err((Tokens, 1))]);
        check(&[(0.0, 1), (1.0, 1), (2.0, 1), (3.0, 1)], &[Ok(()), Ok(()), Ok(()), Err((Concurrent, 1))]);
        check(&[(0.0, 700), (0.0, 1)], &[Ok(()), Err((Tokens, 1))]);
    }

    #[test]
    fn a_refusal_charges_nothing() {
        use Over::*;
        check(&[(0.0, 600), (0.0, 1), (0.0, 1), (6.0, 60)], &[Ok(()), Err((Tokens, 1)), Err((Tokens, 1)), Ok(())]);
    }

    /// A request reserving 100 prompt + 400 output tokens of the 600-token minute, whose
    /// response is `frames` (`None`: it failed without one), leaves `left` tokens.
    #[track_caller]
    fn check_true_up(frames: Option<&[&[u8]]>, left: f64) {
        let (t0, limits) = limits();
        let mut hold = limits.admit(0, 100, 500, t0).expect("admitted");
        match frames {
            Some(frames) => {
                for f in frames {
                    hold.observe(f);
                }
                drop(hold);
            }
            None => hold.failed(),
        }
        let level = limits.tenants[0].tokens.as_ref().unwrap().lock().unwrap().level;
        assert_eq!(level, left, "{frames:?}");
    }

    #[test]
    fn the_token_charge_is_trued_up_to_what_was_used() {
        let usage = br#"{"choices":[],"usage":{"prompt_tokens":120,"completion_tokens":30,"total_tokens":150}}"#;
        check_true_up(Some(&[usage]), 450.0);
        let sse: &[&[u8]] = &[b"data: {\"c\":1}\n\n", b"data: {\"c\":2}\n\ndata: [DONE]\n\n"];
        check_true_up(Some(sse), 498.0);
        check_true_up(Some(&[b"{\"choices\":[]}"]), 100.0);
        check_true_up(None, 500.0);
        let over = br#"{"usage":{"prompt_tokens":100,"completion_tokens":5000}}"#;
        check_true_up(Some(&[over]), 0.0);
    }
}
