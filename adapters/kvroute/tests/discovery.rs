//! `kvroute serve` with `[discovery.kubernetes]`, as a process: a recorded Kubernetes
//! API on loopback (reached through `KUBECONFIG`) lists and streams pods, and the
//! proxy's `GET /workers` must follow the ready ones; then a rolling update replaces
//! every pod while requests flow through the proxy to simulated workers, and none fails.

use std::collections::BTreeSet;
use std::io::{BufRead, BufReader};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::Duration;

use kvroute_k8s::testing::FakeApi;
use kvroute_sim_server::{EngineConfig, SimServerConfig, SimServerHandle};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const PODS: &str = "/api/v1/namespaces/inference/pods";

fn fixture(name: &str) -> String {
    std::fs::read_to_string(format!("{}/tests/fixtures/{name}", env!("CARGO_MANIFEST_DIR"))).expect("fixture")
}

/// A running `kvroute serve`; killed and its files removed when dropped.
struct Serve {
    child: Child,
    addr: SocketAddr,
    dir: PathBuf,
    log: Arc<Mutex<Vec<String>>>,
}

impl Serve {
    /// Starts `kvroute serve` with `config` (plus a loopback listener and trust for the
    /// admin API) against `api`, and waits up to 30 s for it to listen.
    fn start(api: &FakeApi, name: &str, config: &str) -> Serve {
        let dir = std::env::temp_dir().join(format!("kvroute-discovery-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("a temporary folder");
        std::fs::write(dir.join("kubeconfig"), api.kubeconfig("inference")).expect("kubeconfig written");
        let head = "listen = \"127.0.0.1:0\"\n[trust]\ncidrs = [\"127.0.0.1/32\"]\n[health_check]\ninterval_ms = 0\n";
        std::fs::write(dir.join("kvroute.toml"), format!("{head}{config}")).expect("config written");
        let mut child = Command::new(env!("CARGO_BIN_EXE_kvroute"))
            .args(["serve", "--config"])
            .arg(dir.join("kvroute.toml"))
            .env("KUBECONFIG", dir.join("kubeconfig"))
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stderr(Stdio::piped())
            .spawn()
            .expect("kvroute starts");
        let (tx, rx) = mpsc::channel();
        let log = Arc::new(Mutex::new(Vec::new()));
        let (stderr, lines) = (child.stderr.take().expect("stderr"), log.clone());
        std::thread::spawn(move || {
            for line in BufReader::new(stderr).lines().map_while(Result::ok) {
                if let Some((_, a)) = line.split_once(" on http://") {
                    let _ = tx.send(a.trim().to_string());
                }
                lines.lock().unwrap().push(line);
            }
        });
        let addr = match rx.recv_timeout(Duration::from_secs(30)) {
            Ok(a) => a.parse().expect("an address"),
            Err(_) => {
                let _ = child.kill();
                panic!("kvroute serve did not start: {:?}", log.lock().unwrap());
            }
        };
        Serve { child, addr, dir, log }
    }

    /// The workers `GET /workers` lists, as `url model role`.
    async fn fleet(&self) -> BTreeSet<String> {
        let (status, _, body) = http(self.addr, "GET", "/workers", "").await;
        assert_eq!(status, 200, "{body}");
        let v: Value = serde_json::from_str(&body).expect("JSON");
        let rows = v["workers"].as_array().expect("workers").iter();
        rows.map(|w| format!("{} {} {}", w["url"].as_str().unwrap().trim_end_matches('/'), w["model"], w["role"]))
            .map(|s| s.replace('"', ""))
            .collect()
    }

    /// Waits up to 10 s for the fleet to be `want`.
    async fn fleet_becomes(&self, want: &[&str], what: &str) {
        let want: BTreeSet<String> = want.iter().map(|s| s.to_string()).collect();
        let mut last = BTreeSet::new();
        for _ in 0..1000 {
            last = self.fleet().await;
            if last == want {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("{what}: the fleet is {last:?}, not {want:?}; log: {:?}", self.log.lock().unwrap());
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// One HTTP/1.1 exchange on a new connection: status, head, body.
async fn http(addr: SocketAddr, method: &str, path: &str, body: &str) -> (u16, String, String) {
    let exchange = async {
        let mut s = TcpStream::connect(addr).await?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nhost: kvroute\r\ncontent-type: application/json\r\ncontent-length: {}\r\n\
             connection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes()).await?;
        let mut out = Vec::new();
        s.read_to_end(&mut out).await?;
        Ok::<_, std::io::Error>(String::from_utf8_lossy(&out).into_owned())
    };
    let text = tokio::time::timeout(Duration::from_secs(10), exchange).await.expect("in time").expect("HTTP");
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head.split(' ').nth(1).and_then(|s| s.parse().ok()).unwrap_or(0);
    (status, head.to_string(), body.to_string())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_fleet_follows_the_ready_pods() {
    let list: Value = serde_json::from_str(&fixture("discovery-pods-list.json")).unwrap();
    let api = FakeApi::start(vec![(PODS.to_string(), list)]).await.expect("the fake API");
    let models = "[[models]]\nname = \"m\"\n[[models]]\nname = \"d\"\ndisagg_protocol = \"vllm-nixl\"\n";
    let discovery = "[discovery.kubernetes]\nlabel_selector = \"app=vllm\"\nmodel = \"m\"\n";
    let serve = Serve::start(&api, "fixtures", &format!("{models}{discovery}"));

    // The listing: a (two ranks, KV events), b, and the prefill pod c on its annotated
    // port are workers; e is not ready, x has a bad role, the embedder is not selected.
    let (a, b) = ("http://10.244.1.21:8000 m aggregated", "http://10.244.1.22:8000 m aggregated");
    let (c, e, f) = (
        "http://10.244.2.23:8100 d prefill",
        "http://10.244.2.25:8000 m aggregated",
        "http://10.244.1.26:8000 m aggregated",
    );
    serve.fleet_becomes(&[a, b, c], "after the listing").await;
    let (_, _, body) = http(serve.addr, "GET", "/workers", "").await;
    let v: Value = serde_json::from_str(&body).unwrap();
    let wa = v["workers"].as_array().unwrap().iter().find(|w| w["url"].as_str().unwrap().contains(".21:")).unwrap();
    let streams = wa["kv_events"]["streams"].as_array().expect("a's KV events are subscribed");
    let endpoints: Vec<&str> = streams.iter().map(|s| s["endpoint"].as_str().unwrap()).collect();
    assert_eq!(endpoints, ["tcp://10.244.1.21:5557", "tcp://10.244.1.21:5558"], "one stream per rank");
    // x, with its bad role, is counted as well as logged.
    let (_, _, metrics) = http(serve.addr, "GET", "/metrics", "").await;
    let refused = r#"kvroute_discovery_troubles_total{kind="pod_not_a_worker"} 1"#;
    assert!(metrics.lines().any(|l| l == refused), "{refused} in:\n{metrics}");

    // Each recorded watch event, and the fleet after it.
    let steps: [(&[&str], &str); 7] = [
        (&[a, b, c, e], "e turns ready"),
        (&[b, c, e], "a terminates: drained, and removed once idle"),
        (&[b, c, e], "a is deleted"),
        (&[b, c, e], "f is created, pending, without an address"),
        (&[b, c, e, f], "f runs and is ready"),
        (&[b, c, f], "e fails its readiness probe"),
        (&[b, f], "c is deleted"),
    ];
    for (line, (want, what)) in fixture("discovery-pods-watch.jsonl").lines().zip(steps) {
        api.event(PODS, line);
        serve.fleet_becomes(want, what).await;
    }
}

async fn sim_worker() -> SimServerHandle {
    let cfg = SimServerConfig {
        model: "m".into(),
        engine: EngineConfig { speedup: 1000.0, block_size: 16, ..EngineConfig::default() },
        ..SimServerConfig::default()
    };
    kvroute_sim_server::spawn(cfg).await.expect("sim worker starts")
}

/// A pod of the rollout at `127.0.0.1:port`, with the next resource version.
fn pod(name: &str, port: u16, ready: bool, deleting: bool) -> Value {
    static VERSION: AtomicU64 = AtomicU64::new(10);
    let version = VERSION.fetch_add(1, Ordering::Relaxed).to_string();
    let mut p = json!({
        "kind": "Pod", "apiVersion": "v1",
        "metadata": {"name": name, "namespace": "inference", "uid": format!("uid-{name}"), "labels": {"app": "sim"},
            "resourceVersion": version},
        "spec": {"containers": [{"name": "engine", "ports": [{"name": "http", "containerPort": port}]}]},
        "status": {"podIP": "127.0.0.1", "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}]},
    });
    if deleting {
        p["metadata"]["deletionTimestamp"] = json!("2025-10-01T10:00:00Z");
    }
    p
}

fn event(kind: &str, pod: Value) -> String {
    json!({"type": kind, "object": pod}).to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rolling_update_fails_no_request() {
    let mut old = vec![sim_worker().await, sim_worker().await];
    let new = [sim_worker().await, sim_worker().await];
    let port = |s: &SimServerHandle| s.http_addr().port();
    let url = |s: &SimServerHandle| format!("http://127.0.0.1:{} m aggregated", port(s));
    let items: Vec<Value> =
        old.iter().enumerate().map(|(i, s)| pod(&format!("old-{i}"), port(s), true, false)).collect();
    let list = json!({"kind": "PodList", "apiVersion": "v1", "metadata": {"resourceVersion": "1"}, "items": items});
    let api = FakeApi::start(vec![(PODS.to_string(), list)]).await.expect("the fake API");
    let config = "[[models]]\nname = \"m\"\nblock_size = 16\n[discovery.kubernetes]\nlabel_selector = \"app=sim\"\n";
    let serve = Serve::start(&api, "rollout", config);
    let olds: Vec<String> = old.iter().map(url).collect();
    serve.fleet_becomes(&olds.iter().map(String::as_str).collect::<Vec<_>>(), "the old pods").await;

    // Requests flow from two clients for the whole rollout.
    let stop = Arc::new(AtomicBool::new(false));
    let done = Arc::new(AtomicU64::new(0));
    let mut clients = Vec::new();
    for c in 0..2 {
        let (stop, done, addr) = (stop.clone(), done.clone(), serve.addr);
        clients.push(tokio::spawn(async move {
            let mut results = Vec::new();
            for i in 0.. {
                if stop.load(Ordering::Relaxed) && i > 0 {
                    break;
                }
                let body =
                    json!({"model": "m", "prompt": format!("client {c} request {i} of the rollout"), "max_tokens": 4});
                let (status, head, _) = http(addr, "POST", "/v1/completions", &body.to_string()).await;
                let worker = head.lines().find_map(|l| l.strip_prefix("x-kvroute-worker: ")).map(str::to_string);
                results.push((status, worker));
                done.fetch_add(1, Ordering::Relaxed);
            }
            results
        }));
    }

    // Waits until ten more requests have finished.
    let flowed = || async {
        let target = done.load(Ordering::Relaxed) + 10;
        for _ in 0..1000 {
            if done.load(Ordering::Relaxed) >= target {
                return;
            }
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        panic!("requests stopped flowing");
    };

    // One by one: the new pod comes up and is ready, then the old one terminates, is
    // drained and removed once idle, its engine stops, and it is deleted.
    let mut want: Vec<String> = olds.clone();
    for (i, n) in new.iter().enumerate() {
        let name = format!("new-{i}");
        api.event(PODS, &event("ADDED", pod(&name, port(n), false, false)));
        api.event(PODS, &event("MODIFIED", pod(&name, port(n), true, false)));
        want.push(url(n));
        serve.fleet_becomes(&want.iter().map(String::as_str).collect::<Vec<_>>(), "the new pod is added").await;
        flowed().await;
        let gone = old.remove(0);
        let (old_name, old_port, old_url) = (format!("old-{i}"), port(&gone), url(&gone));
        api.event(PODS, &event("MODIFIED", pod(&old_name, old_port, true, true)));
        want.retain(|w| *w != old_url);
        serve.fleet_becomes(&want.iter().map(String::as_str).collect::<Vec<_>>(), "the old pod is drained").await;
        flowed().await;
        gone.shutdown().await;
        api.event(PODS, &event("DELETED", pod(&old_name, old_port, false, true)));
        flowed().await;
    }
    stop.store(true, Ordering::Relaxed);
    let mut results = Vec::new();
    for c in clients {
        results.extend(c.await.expect("a client"));
    }
    let failed: Vec<_> = results.iter().filter(|(s, _)| *s != 200).collect();
    assert!(failed.is_empty(), "{} of {} requests failed: {failed:?}", failed.len(), results.len());
    let news: Vec<String> = new.iter().map(url).collect();
    serve.fleet_becomes(&news.iter().map(String::as_str).collect::<Vec<_>>(), "the new pods are the fleet").await;
    let served: BTreeSet<&str> = results.iter().filter_map(|(_, w)| w.as_deref()).collect();
    assert!(served.len() >= 3, "old and new workers served during the rollout: {served:?}");
    println!("rollout: {} requests, all 200, served by {} workers", results.len(), served.len());
    for n in new {
        n.shutdown().await;
    }
}
