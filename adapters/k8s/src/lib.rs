//! `kvroute-k8s` turns Kubernetes pods into kvroute workers. It watches the pods a label
//! selector picks with kube-rs's watcher (list, then watch, relisting after a gap,
//! backing off on errors), keeps the ready ones as a [`PodSet`], and applies each change
//! to a worker [`Registry`]: a pod that is Ready, has an address and is not being
//! deleted is added; one that starts terminating is drained; one that is gone or no
//! longer Ready is removed. Worker ids are 53 bits of a hash of the pod's uid
//! ([`worker_id`]), so a pod keeps its id and a new pod under an old name is a new
//! worker with an empty cache.
//!
//! Two servers use it: `kvroute serve` follows `[discovery.kubernetes]` with
//! [`watch_pods`] and [`PodWorkers`], and `kvroute epp` follows an `InferencePool`,
//! whose selector and port it reads itself, with [`pod_events`] and [`apply`].
//!
//! What it leaves to others: what adding, draining and removing a worker means (the
//! [`Registry`]: the proxy's or the picker's fleet, with its KV-event subscriptions),
//! and any custom resource (the picker's `InferencePool`). The `testing` feature adds
//! [`testing::FakeApi`], a recorded API server on loopback.
//!
//! The service account needs `get`, `list` and `watch` on `pods` in the namespace.
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

mod pods;
#[cfg(feature = "testing")]
pub mod testing;
mod worker;

use std::future::Future;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::Api;
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use kvroute_frontend::config::WorkerConfig;
use kvroute_frontend::FleetError;

pub use pods::{Change, Member, PodSet};
pub use worker::{PodError, PodWorkers};

/// A worker id from a pod uid: 53 bits of its hash, so ids stay exact in JSON.
pub fn worker_id(uid: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(uid.as_bytes()) & ((1 << 53) - 1)
}

/// A client from the environment: the in-cluster service account, or `KUBECONFIG`.
/// Reaching a real API server over HTTPS needs this crate's `tls` feature.
pub async fn client() -> Result<Client, kube::Error> {
    Client::try_default().await
}

/// A discovery step that failed, for a [`Registry`] to count. Each is also logged.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum Trouble {
    /// A selected pod is not a worker: a bad annotation, no port or no model.
    NotAWorker,
    /// The registry refused a pod's worker.
    CannotAdd,
    /// A watch of the API failed; it is retried with back-off.
    Watch,
}

impl Trouble {
    /// The name metrics use: `pod_not_a_worker`, `pod_cannot_add` or `watch`.
    pub const fn as_str(self) -> &'static str {
        match self {
            Trouble::NotAWorker => "pod_not_a_worker",
            Trouble::CannotAdd => "pod_cannot_add",
            Trouble::Watch => "watch",
        }
    }
}

/// Where discovered workers go. Each call is one change, applied in the watch's order.
pub trait Registry: Send + Sync + 'static {
    /// Adds the worker, or replaces the one with its id, and subscribes to its KV events.
    /// Returns whether it is new.
    fn upsert(&self, w: WorkerConfig) -> impl Future<Output = Result<bool, FleetError>> + Send;
    /// Removes the worker and its KV-event subscription. Returns whether it existed.
    fn remove(&self, id: u64) -> impl Future<Output = bool> + Send;
    /// Stops new requests and sessions from reaching the worker (its pod is
    /// terminating); what happens next is the registry's. Returns whether it existed.
    fn drain(&self, id: u64) -> impl Future<Output = bool> + Send;
    /// Whether the pods have been listed: `false` until the first listing.
    fn set_ready(&self, ready: bool) -> impl Future<Output = ()> + Send;
    /// A discovery step failed (already logged); a registry with metrics counts it.
    fn trouble(&self, _trouble: Trouble) {}
}

/// A stream of pod watch events.
pub type PodEvents = BoxStream<'static, Result<Event<Pod>, watcher::Error>>;

/// Watches the pods of `api` that `label_selector` picks, with back-off on errors.
pub fn pod_events(api: Api<Pod>, label_selector: &str) -> PodEvents {
    watcher(api, watcher::Config::default().labels(label_selector)).default_backoff().boxed()
}

/// Applies `changes` to `registry`, making each upserted member a worker with `worker`.
/// A member that is not a worker is logged and left out.
pub async fn apply<R, E>(registry: &R, changes: Vec<Change>, worker: impl Fn(&Member) -> Result<WorkerConfig, E>)
where
    R: Registry,
    E: std::fmt::Display,
{
    for c in changes {
        match c {
            Change::Upsert(m) => match worker(&m) {
                Ok(w) => {
                    let (id, url) = (w.id, w.url.to_string());
                    match registry.upsert(w).await {
                        Ok(_) => tracing::info!(pod = %m.name, worker = id, %url, "worker ready"),
                        Err(e) => {
                            tracing::warn!(pod = %m.name, error = %e, "cannot add the worker");
                            registry.trouble(Trouble::CannotAdd);
                        }
                    }
                }
                Err(e) => {
                    tracing::warn!(pod = %m.name, error = %e, "the pod is not a worker");
                    registry.trouble(Trouble::NotAWorker);
                }
            },
            Change::Remove(uid) => {
                if registry.remove(worker_id(&uid)).await {
                    tracing::info!(worker = worker_id(&uid), "worker gone");
                }
            }
            Change::Drain(uid) => {
                if registry.drain(worker_id(&uid)).await {
                    tracing::info!(worker = worker_id(&uid), "worker draining: its pod is terminating");
                }
            }
        }
    }
}

/// Follows the pods of `namespace` that `label_selector` picks until the future is
/// dropped, keeping `registry` equal to the ready ones, each made a worker by
/// `workers`. Errors of the API are logged and retried with back-off.
pub async fn watch_pods<R: Registry>(
    client: Client,
    namespace: &str,
    label_selector: &str,
    workers: PodWorkers,
    registry: R,
) {
    registry.set_ready(false).await;
    let mut events = pod_events(Api::namespaced(client, namespace), label_selector);
    let mut set = PodSet::default();
    while let Some(ev) = events.next().await {
        match ev {
            Err(e) => {
                tracing::warn!(namespace, error = %e, "pod watch failed; retrying");
                registry.trouble(Trouble::Watch);
            }
            Ok(ev) => {
                let listed = matches!(ev, Event::InitDone);
                apply(&registry, set.handle(ev), |m| workers.worker(m)).await;
                if listed {
                    registry.set_ready(true).await;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Mutex;

    use kvroute_frontend::config::KubernetesDiscovery;
    use serde_json::json;

    use super::*;

    /// The calls a registry received, as text.
    #[derive(Default)]
    struct Calls(Mutex<Vec<String>>);

    impl Registry for Calls {
        async fn upsert(&self, w: WorkerConfig) -> Result<bool, FleetError> {
            self.0.lock().unwrap().push(format!("upsert {} {}", w.url, w.model));
            Ok(true)
        }
        async fn remove(&self, id: u64) -> bool {
            self.0.lock().unwrap().push(format!("remove {}", id == worker_id("a")));
            true
        }
        async fn drain(&self, id: u64) -> bool {
            self.0.lock().unwrap().push(format!("drain {}", id == worker_id("a")));
            true
        }
        async fn set_ready(&self, _: bool) {}
        fn trouble(&self, t: Trouble) {
            self.0.lock().unwrap().push(format!("trouble {}", t.as_str()));
        }
    }

    fn pod(uid: &str, role: &str, deleting: bool) -> Pod {
        let mut v = json!({
            "metadata": {"name": uid, "uid": uid, "annotations": {"kvroute.io/role": role}},
            "spec": {"containers": [{"name": "e", "ports": [{"name": "http", "containerPort": 8000}]}]},
            "status": {"podIP": "10.0.0.1", "conditions": [{"type": "Ready", "status": "True"}]},
        });
        if deleting {
            v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
        }
        serde_json::from_value(v).unwrap()
    }

    #[tokio::test]
    async fn changes_reach_the_registry_and_bad_pods_do_not() {
        let cfg = KubernetesDiscovery { label_selector: "app=x".into(), ..KubernetesDiscovery::default() };
        let workers = PodWorkers { cfg, default_model: Some("m".into()) };
        let (calls, mut set) = (Calls::default(), PodSet::default());
        for ev in [
            Event::Apply(pod("a", "aggregated", false)),
            Event::Apply(pod("b", "both", false)),
            Event::Apply(pod("a", "aggregated", true)),
            Event::Delete(pod("a", "aggregated", true)),
        ] {
            apply(&calls, set.handle(ev), |m| workers.worker(m)).await;
        }
        let got = calls.0.into_inner().unwrap();
        let want = ["upsert http://10.0.0.1:8000 m", "trouble pod_not_a_worker", "drain true", "remove true"];
        assert_eq!(got, want, "b's role does not parse: counted, not added");
    }
}
