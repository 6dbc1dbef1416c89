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
//! The service account needs `get`, `list` and `watch` on `pods` and on
//! `inferencepools.inference.networking.k8s.io` in the pool's namespace.

mod pods;

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

pub use pods::{Change, Member, PodSet, PoolSpec};

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

/// A worker id from a pod uid: 53 bits of its hash, so ids stay exact in JSON.
pub fn worker_id(uid: &str) -> u64 {
    xxhash_rust::xxh3::xxh3_64(uid.as_bytes()) & ((1 << 53) - 1)
}

/// A client from the environment: the in-cluster service account, or `KUBECONFIG`.
/// Reaching a real API server over HTTPS needs this crate's `tls` feature.
pub async fn client() -> Result<Client, kube::Error> {
    Client::try_default().await
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
    let mut pod_events: Option<Events<Pod>> = None;
    let mut tracker = PoolTracker::default();
    let mut spec: Option<PoolSpec> = None;
    let mut set = PodSet::default();
    loop {
        tokio::select! {
            ev = pool_events.next() => match ev {
                None => return,
                Some(Err(e)) => tracing::warn!(pool = %pool.name, error = %e, "InferencePool watch failed; retrying"),
                Some(Ok(ev)) => {
                    let Some(next) = tracker.handle(ev, &pool.name) else { continue };
                    if next == spec {
                        continue;
                    }
                    tracing::info!(pool = %pool.name, spec = ?next, "InferencePool changed; rewatching its pods");
                    apply(&workers, &template, 0, set.clear()).await;
                    workers.set_ready(false).await;
                    pod_events = next.as_ref().map(|s| {
                        let cfg = watcher::Config::default().labels(&s.selector());
                        watcher(pod_api.clone(), cfg).default_backoff().boxed()
                    });
                    spec = next;
                }
            },
            Some(ev) = next(&mut pod_events) => match (ev, &spec) {
                (Err(e), _) => tracing::warn!(pool = %pool.name, error = %e, "pod watch failed; retrying"),
                (Ok(ev), Some(s)) => {
                    let listed = matches!(ev, Event::InitDone);
                    apply(&workers, &template, s.port, set.handle(ev)).await;
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
async fn next(events: &mut Option<Events<Pod>>) -> Option<Result<Event<Pod>, watcher::Error>> {
    match events {
        Some(s) => s.next().await,
        None => std::future::pending().await,
    }
}

async fn apply(workers: &Workers, template: &WorkerTemplate, port: u16, changes: Vec<Change>) {
    for c in changes {
        match c {
            Change::Upsert(m) => match template.worker(&m, port) {
                Ok(w) => {
                    let (id, url) = (w.id, w.url.to_string());
                    match workers.upsert(w).await {
                        Ok(_) => tracing::info!(pod = %m.name, worker = id, %url, "worker ready"),
                        Err(e) => tracing::warn!(pod = %m.name, error = %e, "cannot add the worker"),
                    }
                }
                Err(e) => tracing::warn!(pod = %m.name, error = %e, "cannot add the worker"),
            },
            Change::Remove(uid) => {
                if workers.remove(worker_id(&uid)).await {
                    tracing::info!(worker = worker_id(&uid), "worker gone");
                }
            }
            Change::Drain(uid) => {
                if workers.drain(worker_id(&uid)) {
                    tracing::info!(worker = worker_id(&uid), "worker draining: its pod is terminating");
                }
            }
        }
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
