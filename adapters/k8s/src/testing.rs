//! A recorded Kubernetes API on loopback, for tests: each resource path answers a list
//! from a given JSON document (filtered by `labelSelector` equalities), and its first
//! watch streams the events the test sends with [`FakeApi::event`], one line at a time;
//! a later watch of the same path waits quietly. Plain HTTP, no authentication.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex, PoisonError};

use bytes::Bytes;
use http_body_util::{BodyExt, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use tokio::net::TcpListener;
use tokio::sync::mpsc;

type Body = http_body_util::combinators::BoxBody<Bytes, Infallible>;

/// The running server; it stops when its runtime does.
pub struct FakeApi {
    addr: SocketAddr,
    watches: BTreeMap<String, mpsc::UnboundedSender<String>>,
}

struct Paths {
    lists: BTreeMap<String, Value>,
    watches: Mutex<BTreeMap<String, mpsc::UnboundedReceiver<String>>>,
}

impl FakeApi {
    /// Serves `lists`, resource path (e.g. `/api/v1/namespaces/ns/pods`) to its list
    /// document, on a free loopback port.
    pub async fn start(lists: Vec<(String, Value)>) -> std::io::Result<Self> {
        let (mut txs, mut rxs) = (BTreeMap::new(), BTreeMap::new());
        for (p, _) in &lists {
            let (tx, rx) = mpsc::unbounded_channel();
            txs.insert(p.clone(), tx);
            rxs.insert(p.clone(), rx);
        }
        let paths = Arc::new(Paths { lists: lists.into_iter().collect(), watches: Mutex::new(rxs) });
        let listener = TcpListener::bind("127.0.0.1:0").await?;
        let addr = listener.local_addr()?;
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let paths = paths.clone();
                let svc = service_fn(move |req| {
                    let paths = paths.clone();
                    async move { Ok::<_, Infallible>(answer(&paths, req)) }
                });
                tokio::spawn(hyper::server::conn::http1::Builder::new().serve_connection(TokioIo::new(stream), svc));
            }
        });
        Ok(FakeApi { addr, watches: txs })
    }

    /// Its address.
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// A client of this server.
    pub fn client(&self) -> kube::Client {
        let url = format!("http://{}", self.addr).parse().expect("a loopback URL");
        kube::Client::try_from(kube::Config::new(url)).expect("a plain HTTP client")
    }

    /// A kubeconfig document pointing at this server, with `namespace` as the
    /// context's namespace, for a process started with `KUBECONFIG`.
    pub fn kubeconfig(&self, namespace: &str) -> String {
        format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: http://{}\n\
             users:\n- name: fake\n  user: {{}}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    \
             user: fake\n    namespace: {namespace}\ncurrent-context: fake\n",
            self.addr
        )
    }

    /// Streams `line` (one watch event as JSON) on the watch of `path`. Panics if the
    /// path is not served or its watch stream is gone.
    pub fn event(&self, path: &str, line: &str) {
        self.watches[path].send(format!("{line}\n")).expect("the watch is open");
    }
}

fn answer(paths: &Paths, req: http::Request<Incoming>) -> http::Response<Body> {
    let path = req.uri().path().to_string();
    let query: BTreeMap<String, String> = req
        .uri()
        .query()
        .unwrap_or("")
        .split('&')
        .filter_map(|kv| kv.split_once('='))
        .map(|(k, v)| (k.to_string(), v.replace("%3D", "=").replace("%2C", ",")))
        .collect();
    let Some((key, list)) = paths.lists.iter().find(|(p, _)| **p == path) else {
        return http::Response::builder().status(404).body(Full::new(Bytes::new()).boxed()).expect("a response");
    };
    if query.get("watch").map(String::as_str) == Some("true") {
        // The first watch gets the test's events; a rewatch waits quietly.
        let rx = paths.watches.lock().unwrap_or_else(PoisonError::into_inner).remove(key);
        let lines = futures::stream::unfold(rx, |rx| async move {
            let mut rx = rx?;
            let line = rx.recv().await?;
            Some((Ok::<_, Infallible>(Frame::data(Bytes::from(line))), Some(rx)))
        });
        return http::Response::new(StreamBody::new(lines).boxed());
    }
    let mut list = list.clone();
    if let Some(selector) = query.get("labelSelector") {
        let want: BTreeMap<&str, &str> = selector.split(',').filter_map(|kv| kv.split_once('=')).collect();
        let items = list["items"].as_array().cloned().unwrap_or_default();
        list["items"] = items
            .into_iter()
            .filter(|i| want.iter().all(|(k, v)| i["metadata"]["labels"][*k].as_str() == Some(*v)))
            .collect();
    }
    http::Response::new(Full::new(Bytes::from(list.to_string())).boxed())
}
