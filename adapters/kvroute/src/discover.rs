//! `[discovery.kubernetes]` for `kvroute serve`: the pods a label selector picks are the
//! proxy's workers while they are Ready (the watch is `kvroute-k8s`'s). A pod that
//! starts terminating is drained and removed once idle; a pod that is gone or no
//! longer Ready is removed. Either way its KV-event subscription stops with it.

use kvroute_frontend::config::WorkerConfig;
use kvroute_k8s::{PodWorkers, Registry, Trouble};
use kvroute_proxy::{FleetError, ProxyConfig, ServeHandle};

/// The proxy's workers as the pod watch changes them (`kvroute-k8s` logs each change).
struct ServeRegistry(kvroute_proxy::Workers);

impl Registry for ServeRegistry {
    async fn upsert(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        self.0.upsert(w).await
    }

    async fn remove(&self, id: u64) -> bool {
        self.0.remove(id).await
    }

    /// Drains, then removes once nothing is in flight.
    async fn drain(&self, id: u64) -> bool {
        self.0.drain(id, true)
    }

    async fn set_ready(&self, ready: bool) {
        if ready {
            eprintln!("kvroute: discovery: pods listed; {} worker(s)", self.0.list().len());
        }
    }

    fn trouble(&self, trouble: Trouble) {
        self.0.metrics().discovery_trouble(trouble.as_str());
    }
}

/// Starts following the pods of `[discovery.kubernetes]`, if configured, until the
/// returned task is aborted. Fails if the Kubernetes API's client cannot be built
/// from the environment (service account or `KUBECONFIG`).
pub async fn start(cfg: &ProxyConfig, handle: &ServeHandle) -> Result<Option<tokio::task::JoinHandle<()>>, String> {
    let Some(k) = cfg.discovery.kubernetes.clone() else { return Ok(None) };
    let client = kvroute_k8s::client().await.map_err(|e| format!("discovery: cannot reach the Kubernetes API: {e}"))?;
    let namespace = k.namespace.clone().unwrap_or_else(|| client.default_namespace().to_string());
    let default_model = k.default_model(cfg.models.iter().map(|m| m.name.as_str())).map(str::to_string);
    eprintln!("kvroute: discovery: following pods {:?} in namespace {namespace:?}", k.label_selector);
    let selector = k.label_selector.clone();
    let workers = PodWorkers { cfg: k, default_model };
    let registry = ServeRegistry(handle.workers());
    Ok(Some(tokio::spawn(
        async move { kvroute_k8s::watch_pods(client, &namespace, &selector, workers, registry).await },
    )))
}
