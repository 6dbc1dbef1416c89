//! Endpoints from the Kubernetes API: follows one `InferencePool`
//! (`inference.networking.k8s.io/v1`) and the pods its selector picks, and keeps the
//! picker's workers equal to the pods that are ready, have an address and are not
//! being deleted, at the pool's target port.
//!
//! The pool and its pods are watched with kube-rs's watcher (list, then watch, relisting
//! after a gap, backing off on errors). A change of the pool's selector or port restarts
//! the pod watch. Readiness is `NOT_SERVING` until the pods have been listed once, and
//! again while the pool does not exist.
//!
//! The pod side (which pods are workers, the watch, applying changes) is the
//! `kvroute-k8s` crate's, shared with `kvroute serve`'s discovery; this module adds
//! the `InferencePool`.
//!
//! The service account needs `get`, `list` and `watch` on `pods` and on
//! `inferencepools.inference.networking.k8s.io` in the pool's namespace.

mod pool;

use std::collections::BTreeMap;
use std::net::SocketAddr;

use futures::stream::BoxStream;
use futures::StreamExt;
use k8s_openapi::api::core::v1::Pod;
use kube::api::{Api, ApiResource, DynamicObject};
use kube::runtime::watcher::{self, watcher, Event};
use kube::runtime::WatchStreamExt;
use kube::Client;
use kvroute_frontend::config::WorkerConfig;
use kvroute_frontend::FleetError;
use kvroute_k8s::{apply, pod_events, PodEvents, Registry, Trouble};

pub use kvroute_k8s::{client, worker_id, Change, Member, PodSet};
pub use pool::PoolSpec;

use crate::Workers;

/// The API group of `InferencePool`.
pub const GROUP: &str = "inference.networking.k8s.io";
/// Its version.
pub const VERSION: &str = "v1";

/// Which pool to follow.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolRef {
    /// Its namespace (also the pods').
    pub namespace: String,
    /// Its name.
    pub name: String,
}

/// What a discovered worker is besides its address: model, capacity, ranks and labels
/// come from `worker` (its `id` and `url` are replaced per pod).
#[derive(Clone, Debug, PartialEq)]
pub struct WorkerTemplate {
    /// The template.
    pub worker: WorkerConfig,
    /// The port on every pod where the engine publishes KV events (ZeroMQ), if it does.
    pub kv_events_port: Option<u16>,
}

impl WorkerTemplate {
    /// The worker for `m` at `port`: id from the pod's uid, `http://ip:port`, and the
    /// pod's node as the `node` topology label.
    pub fn worker(&self, m: &Member, port: u16) -> Result<WorkerConfig, String> {
        let mut labels: BTreeMap<String, String> = self.worker.labels.clone();
        if let Some(node) = &m.node {
            labels.insert("node".into(), node.clone());
        }
        Ok(WorkerConfig {
            id: worker_id(&m.uid),
            url: format!("http://{}", m.endpoint(port)).parse()?,
            labels,
            kv_events: self.kv_events_port.map(|p| format!("tcp://{}", SocketAddr::new(m.ip, p))),
            kv_events_replay: None,
            ..self.worker.clone()
        })
    }
}

/// The `InferencePool` resource, for a dynamic API.
pub fn inference_pool_resource() -> ApiResource {
    ApiResource {
        group: GROUP.into(),
        version: VERSION.into(),
        api_version: format!("{GROUP}/{VERSION}"),
        kind: "InferencePool".into(),
        plural: "inferencepools".into(),
    }
}

type Events<K> = BoxStream<'static, Result<Event<K>, watcher::Error>>;

/// Follows `pool` until the returned future is dropped, keeping `workers` equal to its
/// ready pods. Errors of the API are logged and retried with back-off.
pub async fn watch(client: Client, pool: PoolRef, template: WorkerTemplate, workers: Workers) {
    workers.set_ready(false).await;
    let pools: Api<DynamicObject> = Api::namespaced_with(client.clone(), &pool.namespace, &inference_pool_resource());
    let pod_api: Api<Pod> = Api::namespaced(client, &pool.namespace);
    let by_name = watcher::Config::default().fields(&format!("metadata.name={}", pool.name));
    let mut pool_events: Events<DynamicObject> = watcher(pools, by_name).default_backoff().boxed();
    let mut pods: Option<PodEvents> = None;
    let mut tracker = PoolTracker::default();
    let mut spec: Option<PoolSpec> = None;
    let mut set = PodSet::default();
    loop {
        tokio::select! {
            ev = pool_events.next() => match ev {
                None => return,
                Some(Err(e)) => {
                    tracing::warn!(pool = %pool.name, error = %e, "InferencePool watch failed; retrying");
                    workers.trouble(Trouble::Watch);
                }
                Some(Ok(ev)) => {
                    let Some(next) = tracker.handle(ev, &pool.name) else { continue };
                    if next == spec {
                        continue;
                    }
                    tracing::info!(pool = %pool.name, spec = ?next, "InferencePool changed; rewatching its pods");
                    apply(&workers, set.clear(), |m| template.worker(m, 0)).await;
                    workers.set_ready(false).await;
                    pods = next.as_ref().map(|s| pod_events(pod_api.clone(), &s.selector()));
                    spec = next;
                }
            },
            Some(ev) = next(&mut pods) => match (ev, &spec) {
                (Err(e), _) => {
                    tracing::warn!(pool = %pool.name, error = %e, "pod watch failed; retrying");
                    workers.trouble(Trouble::Watch);
                }
                (Ok(ev), Some(s)) => {
                    let listed = matches!(ev, Event::InitDone);
                    apply(&workers, set.handle(ev), |m| template.worker(m, s.port)).await;
                    if listed {
                        workers.set_ready(true).await;
                    }
                }
                (Ok(_), None) => {}
            },
        }
    }
}

/// The next event of the pod watch; pends forever while there is none.
async fn next(events: &mut Option<PodEvents>) -> Option<Result<Event<Pod>, watcher::Error>> {
    match events {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

impl Registry for Workers {
    async fn upsert(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        Workers::upsert(self, w).await
    }
    async fn remove(&self, id: u64) -> bool {
        Workers::remove(self, id).await
    }
    /// Draining only: the worker stays known until its pod is gone.
    async fn drain(&self, id: u64) -> bool {
        Workers::drain(self, id)
    }
    async fn set_ready(&self, ready: bool) {
        Workers::set_ready(self, ready).await
    }
    fn trouble(&self, trouble: Trouble) {
        self.metrics().discovery_trouble(trouble.as_str());
    }
}

/// The pool's spec from its watch events; a relist is buffered until it is complete.
#[derive(Default)]
struct PoolTracker {
    relist: Option<Option<PoolSpec>>,
}

impl PoolTracker {
    /// The pool's spec after `ev` (`Some(None)`: no valid pool), or `None` while a relist
    /// is still coming in.
    fn handle(&mut self, ev: Event<DynamicObject>, name: &str) -> Option<Option<PoolSpec>> {
        match ev {
            Event::Init => {
                self.relist = Some(None);
                None
            }
            Event::InitApply(o) => {
                self.relist = Some(spec_of(&o, name));
                None
            }
            Event::InitDone => Some(self.relist.take().flatten()),
            Event::Apply(o) => Some(spec_of(&o, name)),
            Event::Delete(_) => Some(None),
        }
    }
}

fn spec_of(o: &DynamicObject, name: &str) -> Option<PoolSpec> {
    let spec = o.data.get("spec")?;
    PoolSpec::from_json(spec).map_err(|e| tracing::warn!(pool = name, error = %e, "InferencePool ignored")).ok()
}
