//! The tenants' rate and concurrency quotas as plain data, for the limits layer
//! (`limits.rs`): token buckets holding a second's requests and a minute's tokens,
//! refilled continuously on tokio's clock (paused in tests), and a semaphore of
//! `concurrent_max` slots. Each tenant has its own, so one tenant's flood never refuses
//! another's. A refused request is charged nothing.

use std::sync::{Arc, Mutex};

use http::StatusCode;
use kvroute_frontend::tenants::{Tenant, Tenants};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio::time::Instant;

use crate::error::ApiError;

/// Every tenant's limits, by tenant id.
pub(crate) struct TenantLimits {
    tenants: Vec<Limiter>,
}

/// One tenant's buckets and slots; `None` where it is unlimited.
struct Limiter {
    requests: Option<Mutex<Bucket>>,
    tokens: Option<Mutex<Bucket>>,
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
    /// The limits of `tenants`, buckets full at `now`.
    pub(crate) fn new(tenants: &Tenants, now: Instant) -> Self {
        TenantLimits { tenants: tenants.iter().map(|t| Limiter::new(t, now)).collect() }
    }

    /// Admits a request of tenant `id` costing `tokens` at `now`: its slot (when the
    /// tenant has a `concurrent_max`), or the limit it is over and the seconds to wait.
    pub(crate) fn admit(
        &self,
        id: usize,
        tokens: u64,
        now: Instant,
    ) -> Result<Option<OwnedSemaphorePermit>, (Over, u64)> {
        let Some(l) = self.tenants.get(id) else { return Ok(None) };
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
        for (b, n) in [(requests, 1.0), (charge, tokens)] {
            if let Some(mut b) = b {
                b.level -= n.min(b.capacity);
            }
        }
        Ok(slot)
    }
}

impl Limiter {
    fn new(t: &Tenant, now: Instant) -> Self {
        Limiter {
            requests: t.requests_per_second.map(|r| Mutex::new(Bucket::new(f64::from(r), f64::from(r), now))),
            tokens: t.tokens_per_minute.map(|n| Mutex::new(Bucket::new(n as f64, n as f64 / 60.0, now))),
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

    /// A tenant limited to 2 requests a second, 600 tokens a minute and 2 at once, asked
    /// `asks` (seconds since start, tokens); `want` per ask: admitted, or the limit and
    /// `Retry-After`. Admitted slots are held throughout.
    #[track_caller]
    fn check(asks: &[(f64, u64)], want: &[Result<(), (Over, u64)>]) {
        let t0 = Instant::now();
        let limiter = Limiter {
            requests: Some(Mutex::new(Bucket::new(2.0, 2.0, t0))),
            tokens: Some(Mutex::new(Bucket::new(600.0, 10.0, t0))),
            slots: Some(Arc::new(Semaphore::new(3))),
        };
        let limits = TenantLimits { tenants: vec![limiter] };
        let mut held = Vec::new();
        let got: Vec<_> = asks
            .iter()
            .map(|&(at, n)| {
                let r = limits.admit(0, n, t0 + Duration::from_secs_f64(at));
                r.map(|slot| held.push(slot))
            })
            .collect();
        assert_eq!(got, want);
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
}
