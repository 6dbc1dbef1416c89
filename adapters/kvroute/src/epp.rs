//! `kvroute epp`: the router as a Gateway API Inference Extension endpoint picker, with
//! endpoints from the configuration or from an `InferencePool`'s pods.

use std::net::SocketAddr;
use std::path::PathBuf;

use clap::Args;
use kvroute_epp::k8s::{PoolRef, WorkerTemplate};
use kvroute_epp::{BodyMode, EppConfig, EppHandle, TlsIdentity};
use kvroute_frontend::ProxyConfig;
use serde_json::json;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

use crate::serve::{load_tokenizers, shutdown_signal};

/// Where the namespace of the pod we run in is mounted.
const POD_NAMESPACE_FILE: &str = "/var/run/secrets/kubernetes.io/serviceaccount/namespace";

pub const EXAMPLES: &str = "\
Examples:
  # In Kubernetes: follow the InferencePool `llama` of this pod's namespace
  kvroute epp --model meta-llama/Llama-3.1-8B-Instruct --pool llama --metrics-listen 0.0.0.0:9090

  # With the full routing configuration (models, tokenizers, limits, trust) from a file
  kvroute epp --config /etc/kvroute/kvroute.toml --pool llama --kv-events-port 5557

  # Over TLS, for gateways that connect to the picker with TLS
  kvroute epp --config kvroute.toml --pool llama --tls-self-signed

  # Outside Kubernetes: the workers listed in the file, for any ext_proc gateway
  kvroute epp --config kvroute.toml --listen 127.0.0.1:9002

The gateway must send the request body (request_body_mode FULL_DUPLEX_STREAMED, as the
Inference Extension configures it, or BUFFERED) and, for load to be released when the
response ends rather than when it starts, the response body too. See docs/deploy.md.";

/// Flags of `kvroute epp`.
#[derive(Args, Debug, Clone)]
pub struct EppArgs {
    /// The TOML configuration, as for `kvroute serve` (models, routing, limits, trust,
    /// workers, replicas), without the keys only a forwarding proxy honours (`listen`,
    /// `[retry]`, `[ejection]`, `[health_check]`, disaggregation, upstream limits), which
    /// are refused. Without it, --model names the one model.
    #[arg(long, value_name = "FILE")]
    pub config: Option<PathBuf>,
    /// The model served, when there is no --config; with --pool, the pool's model (the
    /// only configured model by default). Requests naming other models go to it too.
    #[arg(long, value_name = "NAME")]
    pub model: Option<String>,
    /// Address of the ext_proc gRPC server (the gateway's `endpointPickerRef` port).
    #[arg(long, value_name = "ADDR", default_value = "0.0.0.0:9002")]
    pub listen: SocketAddr,
    /// Also serve the gRPC health service in plaintext here, for kubelet probes when the
    /// main port speaks TLS.
    #[arg(long, value_name = "ADDR")]
    pub health_listen: Option<SocketAddr>,
    /// Serve Prometheus metrics over HTTP at this address (GET /metrics).
    #[arg(long, value_name = "ADDR")]
    pub metrics_listen: Option<SocketAddr>,
    /// Routing mode, overriding `router.mode` (kv, round-robin, random, ...).
    #[arg(long)]
    pub mode: Option<String>,
    /// Any other key of the file, e.g. --set router.queue_timeout_ms=5000 (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub sets: Vec<String>,
    /// How the gateway delivers bodies when it does not say: full-duplex or buffered.
    #[arg(long, value_name = "MODE", default_value = "full-duplex")]
    pub assume_body_mode: BodyMode,
    /// Serve the gateway over TLS with this certificate chain (PEM); needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    pub tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert (PEM).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    pub tls_key: Option<PathBuf>,
    /// Serve the gateway over TLS with a certificate made at startup, for gateways that
    /// encrypt without verifying the picker (the Inference Extension's default).
    #[arg(long, conflicts_with = "tls_cert")]
    pub tls_self_signed: bool,
    /// Follow this InferencePool (inference.networking.k8s.io/v1): its ready pods are the
    /// workers. Uses the in-cluster service account (or KUBECONFIG).
    #[arg(long, value_name = "NAME")]
    pub pool: Option<String>,
    /// The pool's namespace (default: the namespace this pod runs in).
    #[arg(long, value_name = "NS")]
    pub pool_namespace: Option<String>,
    /// Port on each pod where the engine publishes KV events over ZeroMQ (vLLM
    /// --kv-events-config endpoint); without it the cache is predicted.
    #[arg(long, value_name = "PORT")]
    pub kv_events_port: Option<u16>,
    /// KV-cache capacity of each pod, in blocks per rank.
    #[arg(long, value_name = "BLOCKS", default_value_t = 16_384)]
    pub kv_blocks: u32,
    /// Tokens per forward pass of each pod, per rank.
    #[arg(long, value_name = "TOKENS", default_value_t = 8192)]
    pub max_batched_tokens: u32,
    /// Data-parallel ranks of each pod.
    #[arg(long, value_name = "N", default_value_t = 1)]
    pub dp_ranks: u32,
}

/// `kvroute epp`.
pub fn run(a: &EppArgs) -> Result<(), String> {
    let mut proxy = proxy_config(a)?;
    let pool_model = if a.pool.is_some() { Some(pool_model(a, &proxy)?) } else { None };
    if let (Some(m), None) = (&pool_model, &proxy.default_model) {
        // Every request reaching this picker belongs to its pool.
        proxy.default_model = Some(m.clone());
    }
    let tokenizers = load_tokenizers(&proxy)?;
    let cfg = EppConfig {
        proxy,
        listen: a.listen,
        assumed_body_mode: a.assume_body_mode,
        tls: tls(a)?,
        health_listen: a.health_listen,
    };
    let rt = tokio::runtime::Runtime::new().map_err(|e| format!("cannot start the async runtime: {e}"))?;
    rt.block_on(async move {
        let handle = kvroute_epp::serve(cfg.clone(), tokenizers).await.map_err(|e| e.to_string())?;
        let watch = match (&a.pool, pool_model) {
            (Some(name), Some(model)) => Some(tokio::spawn(watch_pool(a.clone(), name.clone(), model, &handle).await?)),
            _ => None,
        };
        if let Some(addr) = a.metrics_listen {
            let listener = TcpListener::bind(addr).await.map_err(|e| format!("cannot listen on {addr}: {e}"))?;
            tokio::spawn(serve_metrics(listener, handle.metrics_handle()));
        }
        eprintln!(
            "kvroute: endpoint picker for {} model(s) on grpc://{}{}",
            cfg.proxy.models.len(),
            handle.local_addr(),
            a.pool.as_ref().map_or_else(
                || format!(", {} configured worker(s)", cfg.proxy.workers.len()),
                |p| format!(", following InferencePool {p}")
            )
        );
        shutdown_signal().await;
        eprintln!("kvroute: shutting down; open streams get {} s", cfg.proxy.limits.shutdown_grace_s);
        if let Some(w) = watch {
            w.abort();
        }
        handle.shutdown().await;
        Ok(())
    })
}

/// The file and flags, or a one-model configuration from --model and the flags.
fn proxy_config(a: &EppArgs) -> Result<ProxyConfig, String> {
    let (text, origin) = match (&a.config, &a.model) {
        (Some(path), _) => {
            let text = std::fs::read_to_string(path).map_err(|e| format!("cannot read {}: {e}", path.display()))?;
            (text, path.display().to_string())
        }
        (None, Some(model)) => (format!("[[models]]\nname = {}\n", json!(model)), "--model".to_string()),
        (None, None) => return Err("give --config FILE, or --model NAME for a one-model picker".into()),
    };
    crate::serve::config_with_flags(EppConfig::proxy_from_toml, &text, &origin, Vec::new(), a.mode.as_ref(), &a.sets)
}

/// The certificate to serve the gateway with, if any.
fn tls(a: &EppArgs) -> Result<Option<TlsIdentity>, String> {
    let read = |p: &PathBuf| std::fs::read_to_string(p).map_err(|e| format!("cannot read {}: {e}", p.display()));
    match (&a.tls_cert, &a.tls_key) {
        (Some(cert), Some(key)) => Ok(Some(TlsIdentity { cert_pem: read(cert)?, key_pem: read(key)? })),
        _ if a.tls_self_signed => {
            let host = std::env::var("HOSTNAME").unwrap_or_else(|_| "kvroute-epp".into());
            TlsIdentity::self_signed(&[host, "kvroute-epp".into(), "localhost".into()]).map(Some)
        }
        _ => Ok(None),
    }
}

/// The model the pool's pods serve: --model, or the only configured one.
fn pool_model(a: &EppArgs, cfg: &ProxyConfig) -> Result<String, String> {
    match (&a.model, cfg.models.as_slice()) {
        (Some(m), models) if models.iter().any(|x| &x.name == m) => Ok(m.clone()),
        (Some(m), _) => Err(format!("--model {m:?} is not a configured model")),
        (None, [only]) => Ok(only.name.clone()),
        (None, _) => Err("--pool needs --model when the configuration has several models".into()),
    }
}

async fn watch_pool(
    a: EppArgs,
    name: String,
    model: String,
    handle: &EppHandle,
) -> Result<impl std::future::Future<Output = ()>, String> {
    let namespace = a
        .pool_namespace
        .clone()
        .or_else(|| std::fs::read_to_string(POD_NAMESPACE_FILE).ok().map(|s| s.trim().to_string()))
        .unwrap_or_else(|| "default".into());
    let client = kvroute_epp::k8s::client().await.map_err(|e| format!("cannot reach the Kubernetes API: {e}"))?;
    let worker = serde_json::from_value(json!({
        "id": 0, "url": "http://0.0.0.0:1", "model": model,
        "kv_blocks": a.kv_blocks, "max_batched_tokens": a.max_batched_tokens, "dp_ranks": a.dp_ranks,
    }))
    .map_err(|e| format!("bad worker template: {e}"))?;
    let template = WorkerTemplate { worker, kv_events_port: a.kv_events_port };
    Ok(kvroute_epp::k8s::watch(client, PoolRef { namespace, name }, template, handle.workers()))
}

/// A minimal HTTP/1.1 endpoint for Prometheus: every request gets the exposition.
async fn serve_metrics(listener: TcpListener, metrics: kvroute_epp::MetricsHandle) {
    while let Ok((mut conn, _)) = listener.accept().await {
        let metrics = metrics.clone();
        tokio::spawn(async move {
            let mut buf = [0u8; 4096];
            // The request head is read and ignored; scrapers send one small GET.
            if conn.read(&mut buf).await.unwrap_or(0) == 0 {
                return;
            }
            let body = metrics.encode();
            let head = format!(
                "HTTP/1.1 200 OK\r\ncontent-type: text/plain; version=0.0.4; charset=utf-8\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = conn.write_all(head.as_bytes()).await;
            let _ = conn.write_all(body.as_bytes()).await;
        });
    }
}
