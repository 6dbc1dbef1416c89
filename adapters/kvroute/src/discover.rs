//! `[discovery.kubernetes]` for `kvroute serve`: the pods a label selector picks are the
//! proxy's workers while they are Ready (the watch is `kvroute-k8s`'s). A pod that
//! starts terminating is drained and removed once idle; a pod that is gone or no
//! longer Ready is removed. Either way its KV-event subscription stops with it.

use kvroute_frontend::config::WorkerConfig;
use kvroute_k8s::{PodWorkers, Registry};
use kvroute_proxy::{FleetError, ProxyConfig, ServeHandle};

/// The proxy's workers as the pod watch changes them; each change is also printed.
struct ServeRegistry(kvroute_proxy::Workers);

impl Registry for ServeRegistry {
    async fn upsert(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        let (id, url) = (w.id, w.url.to_string());
        let r = self.0.upsert(w).await;
        match &r {
            Ok(_) => eprintln!("kvroute: discovery: worker {id} at {url} is ready"),
            Err(e) => eprintln!("kvroute: discovery: cannot add worker {id} at {url}: {e}"),
        }
        r
    }

    async fn remove(&self, id: u64) -> bool {
        let existed = self.0.remove(id).await;
        if existed {
            eprintln!("kvroute: discovery: worker {id} removed");
        }
        existed
    }

    /// Drains, then removes once nothing is in flight.
    async fn drain(&self, id: u64) -> bool {
        let existed = self.0.drain(id, true);
        if existed {
            eprintln!("kvroute: discovery: worker {id} draining (its pod is terminating)");
        }
        existed
    }

    async fn set_ready(&self, ready: bool) {
        if ready {
            eprintln!("kvroute: discovery: pods listed; {} worker(s)", self.0.list().len());
        }
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
