//! `GET /v1/models`, cached: the configured models and adapters merged with what each
//! worker's own `/v1/models` lists. The workers are asked once per [`REFRESH_MS`], or
//! at the first listing after the fleet's workers change (one added, removed or moved
//! to another URL), never on every call: a burst of listings costs one fan-out, and
//! callers that arrive during it wait for it instead of starting their own.
//!
//! Each caller sees only what its tenant may use ([`Tenant::may_use`]): a configured
//! name counts as its pool's model (an adapter as its model), and a name only a worker
//! lists (an adapter loaded at run time) as the model its entry names as `parent`
//! (vLLM's field), else as itself.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full, Limited};
use kvroute_frontend::tenants::Tenant;
use serde_json::{json, Value};
use tokio::sync::Mutex;
use tokio::time::Instant;

use crate::config::WorkerConfig;
use crate::fleet::Fleet;
use crate::upstream::UpstreamClient;

/// How long a listing is served before the workers are asked again, in milliseconds.
pub const REFRESH_MS: u64 = 30_000;
/// How long one worker's `/v1/models` may take, in milliseconds; a worker that misses
/// it adds nothing to this listing.
const WORKER_ASK_MS: u64 = 1_000;
/// Largest worker answer read, in bytes.
const WORKER_ANSWER_BYTES_MAX: usize = 1 << 20;

/// The workers a listing was asked of: id and URL, in id order.
type Asked = Vec<(u64, String)>;

/// One listing and when it was made.
struct Listing {
    made: Instant,
    asked: Asked,
    /// Entries by id.
    data: Arc<BTreeMap<String, Value>>,
}

/// The cached listing; empty until first asked.
pub struct ModelsCache {
    listing: Mutex<Option<Listing>>,
    refresh: Duration,
}

impl Default for ModelsCache {
    fn default() -> Self {
        ModelsCache { listing: Mutex::new(None), refresh: Duration::from_millis(REFRESH_MS) }
    }
}

impl ModelsCache {
    /// Every model, by id: the cached listing, or a fresh one when it is stale.
    pub(crate) async fn all(&self, fleet: &Fleet, client: &UpstreamClient) -> Arc<BTreeMap<String, Value>> {
        let asked: Asked = fleet.workers().iter().map(|w| (w.id, w.url.to_string())).collect();
        let mut listing = self.listing.lock().await;
        let now = Instant::now();
        if let Some(l) = listing.as_ref().filter(|l| !stale(l.made, &l.asked, now, &asked, self.refresh)) {
            return l.data.clone();
        }
        let data = Arc::new(ask_all(fleet, client).await);
        *listing = Some(Listing { made: now, asked, data: data.clone() });
        data
    }
}

/// Whether a listing made at `made` of the workers `then` must be made again at `now`,
/// when the workers are `current`.
fn stale(made: Instant, then: &Asked, now: Instant, current: &Asked, refresh: Duration) -> bool {
    now.saturating_duration_since(made) >= refresh || then != current
}

/// The entries `tenant` may use (all of them without tenants), as a list body.
pub(crate) fn visible(all: &BTreeMap<String, Value>, fleet: &Fleet, tenant: Option<&Tenant>) -> Value {
    let data: Vec<&Value> = all.iter().filter(|(id, v)| may_see(fleet, tenant, id, v)).map(|(_, v)| v).collect();
    json!({"object": "list", "data": data})
}

/// Whether `tenant` may see entry `id`.
pub(crate) fn may_see(fleet: &Fleet, tenant: Option<&Tenant>, id: &str, entry: &Value) -> bool {
    let Some(t) = tenant else { return true };
    let configured = fleet.model_names().any(|n| n == id);
    let pool = match configured.then(|| fleet.resolve(id)).flatten() {
        Some((p, _)) => p.name.as_str(),
        None => entry.get("parent").and_then(Value::as_str).unwrap_or(id),
    };
    t.may_use(pool)
}

/// The configured names, then every worker's entries (asked concurrently) for names
/// the configuration lacks.
async fn ask_all(fleet: &Fleet, client: &UpstreamClient) -> BTreeMap<String, Value> {
    let mut seen: BTreeMap<String, Value> = fleet
        .model_names()
        .map(|m| (m.to_string(), json!({"id": m, "object": "model", "owned_by": "kvroute"})))
        .collect();
    let mut asks = tokio::task::JoinSet::new();
    for w in fleet.workers() {
        let client = client.clone();
        asks.spawn(async move { worker_models(&client, &w).await });
    }
    while let Some(r) = asks.join_next().await {
        for m in r.unwrap_or_default() {
            if let Some(id) = m.get("id").and_then(Value::as_str) {
                seen.entry(id.to_string()).or_insert(m);
            }
        }
    }
    seen
}

async fn worker_models(client: &UpstreamClient, w: &WorkerConfig) -> Vec<Value> {
    let Ok(uri) = w.url.join("/v1/models") else { return Vec::new() };
    let Ok(req) = http::Request::get(uri).body(Full::new(Bytes::new())) else { return Vec::new() };
    let fetch = async {
        let resp = client.request(req).await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let body = Limited::new(resp.into_body(), WORKER_ANSWER_BYTES_MAX).collect().await.ok()?.to_bytes();
        let v: Value = serde_json::from_slice(&body).ok()?;
        v.get("data")?.as_array().cloned()
    };
    tokio::time::timeout(Duration::from_millis(WORKER_ASK_MS), fetch).await.ok().flatten().unwrap_or_default()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `age_ms` since the listing, workers then and now: whether it is asked again.
    #[track_caller]
    fn check(age_ms: u64, then: &[u64], now: &[u64], want: bool) {
        let asked = |ids: &[u64]| ids.iter().map(|&i| (i, format!("http://w{i}"))).collect::<Asked>();
        let made = Instant::now();
        let at = made + Duration::from_millis(age_ms);
        assert_eq!(stale(made, &asked(then), at, &asked(now), Duration::from_millis(REFRESH_MS)), want);
    }

    #[test]
    fn a_listing_is_made_again_past_its_age_or_when_the_workers_change() {
        check(0, &[1, 2], &[1, 2], false);
        check(REFRESH_MS - 1, &[1, 2], &[1, 2], false);
        check(REFRESH_MS, &[1, 2], &[1, 2], true);
        check(0, &[1, 2], &[1, 2, 3], true);
        check(0, &[1, 2], &[2], true);
        check(0, &[], &[], false);
    }

    #[test]
    fn a_moved_worker_is_a_change() {
        let made = Instant::now();
        let then = vec![(1, "http://a".to_string())];
        let now = vec![(1, "http://b".to_string())];
        assert!(stale(made, &then, made, &now, Duration::from_millis(REFRESH_MS)));
    }
}
