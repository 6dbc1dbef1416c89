//! A pod as a worker of `kvroute serve`: its address and port, and what its
//! `kvroute.io/*` annotations (or labels) say, over the defaults of
//! `[discovery.kubernetes]`. A pod whose tags cannot be read is refused with a
//! [`PodError`] and left out, never half-added.

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use kvroute_frontend::config::{annotations, KubernetesDiscovery, WorkerConfig};
use router_core::WorkerRole;

use crate::{worker_id, Member};

/// Why a ready pod is not a worker.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum PodError {
    /// The pod has neither the `kvroute.io/port` annotation nor a container port of
    /// this name.
    NoPort {
        /// The container port name looked for.
        port_name: String,
    },
    /// An annotation (or label) holds a value that does not parse.
    BadTag {
        /// The annotation's key.
        key: &'static str,
        /// Its value.
        value: String,
        /// What it should be.
        expected: &'static str,
    },
    /// The pod names no model, and the configuration gives no default.
    NoModel,
}

impl fmt::Display for PodError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PodError::NoPort { port_name } => {
                write!(f, "no {} annotation and no container port named {port_name:?}", annotations::PORT)
            }
            PodError::BadTag { key, value, expected } => write!(f, "{key} = {value:?}: expected {expected}"),
            PodError::NoModel => write!(f, "no {} and no discovery.kubernetes.model", annotations::MODEL),
        }
    }
}

impl std::error::Error for PodError {}

/// Turns pods into workers per `[discovery.kubernetes]`.
#[derive(Clone, Debug, PartialEq)]
pub struct PodWorkers {
    /// The section.
    pub cfg: KubernetesDiscovery,
    /// The model of pods that name none.
    pub default_model: Option<String>,
}

impl PodWorkers {
    /// The worker for `m`: id from its uid, `http://ip:port`, its node as the `node`
    /// topology label, KV events at `tcp://ip:kv-events-port` (rank `i` at the port
    /// plus `i`, as vLLM publishes).
    pub fn worker(&self, m: &Member) -> Result<WorkerConfig, PodError> {
        let port = match m.tag(annotations::PORT) {
            Some(_) => tag::<u16>(m, annotations::PORT, "a port number")?,
            None => m.ports.get(&self.cfg.port_name).copied(),
        }
        .ok_or_else(|| PodError::NoPort { port_name: self.cfg.port_name.clone() })?;
        let model = m.tag(annotations::MODEL).or(self.default_model.as_deref()).ok_or(PodError::NoModel)?;
        let role = tag::<WorkerRole>(m, annotations::ROLE, "aggregated, prefill or decode")?;
        let dp_ranks = tag::<u32>(m, annotations::DP_RANKS, "a count above 0")?.unwrap_or(1);
        if dp_ranks == 0 {
            return Err(PodError::BadTag {
                key: annotations::DP_RANKS,
                value: "0".into(),
                expected: "a count above 0",
            });
        }
        let events = tag::<u16>(m, annotations::KV_EVENTS_PORT, "a port number")?.or(self.cfg.kv_events_port);
        let replay = tag::<u16>(m, annotations::KV_EVENTS_REPLAY_PORT, "a port number")?;
        let zmq = |p: u16| format!("tcp://{}", SocketAddr::new(m.ip, p));
        let url = format!("http://{}", m.endpoint(port))
            .parse()
            .map_err(|_| PodError::NoPort { port_name: self.cfg.port_name.clone() })?;
        Ok(WorkerConfig {
            id: worker_id(&m.uid),
            url,
            model: model.to_string(),
            role: role.unwrap_or(WorkerRole::Aggregated),
            dp_ranks,
            weight: 1,
            max_batched_tokens: self.cfg.max_batched_tokens,
            kv_blocks: self.cfg.kv_blocks,
            labels: m.node.iter().map(|n| ("node".to_string(), n.clone())).collect(),
            taints: Vec::new(),
            kv_events: events.map(zmq),
            kv_events_replay: replay.map(zmq),
            bootstrap_port: tag::<u16>(m, annotations::BOOTSTRAP_PORT, "a port number")?,
        })
    }
}

/// The tag `key` of `m` parsed, `None` if absent.
fn tag<T: FromStr>(m: &Member, key: &'static str, expected: &'static str) -> Result<Option<T>, PodError> {
    let Some(value) = m.tag(key) else { return Ok(None) };
    value.trim().parse().map(Some).map_err(|_| PodError::BadTag { key, value: value.to_string(), expected })
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;

    fn member(tags: &[(&str, &str)], ports: &[(&str, u16)]) -> Member {
        let annotations: BTreeMap<String, String> = tags.iter().map(|(k, v)| (k.to_string(), v.to_string())).collect();
        Member {
            uid: "u1".into(),
            name: "p1".into(),
            ip: "10.0.0.7".parse().unwrap(),
            node: Some("n1".into()),
            labels: BTreeMap::from([(annotations::ROLE.to_string(), "decode".to_string())]),
            annotations,
            ports: ports.iter().map(|(k, v)| (k.to_string(), *v)).collect(),
        }
    }

    fn workers(model: Option<&str>) -> PodWorkers {
        let cfg = KubernetesDiscovery { label_selector: "app=x".into(), ..KubernetesDiscovery::default() };
        PodWorkers { cfg, default_model: model.map(str::to_string) }
    }

    /// `tags` on a pod with container port `http` 8000 give a worker whose
    /// (url, model, role, ranks, kv_events) are `want`, or the error.
    #[track_caller]
    fn check(tags: &[(&str, &str)], want: Result<(&str, &str, &str, u32, Option<&str>), PodError>) {
        let got = workers(Some("m")).worker(&member(tags, &[("http", 8000), ("metrics", 9000)]));
        let got = got.map(|w| (w.url.to_string(), w.model, w.role.as_str(), w.dp_ranks, w.kv_events));
        let want = want.map(|(u, m, r, d, e)| (u.to_string(), m.to_string(), r, d, e.map(str::to_string)));
        assert_eq!(got, want, "{tags:?}");
    }

    #[test]
    fn pods_tags_make_the_worker() {
        let bad = |key, value: &str, expected| Err(PodError::BadTag { key, value: value.into(), expected });
        check(&[], Ok(("http://10.0.0.7:8000", "m", "decode", 1, None)));
        check(
            &[("kvroute.io/model", "n"), ("kvroute.io/role", "prefill"), ("kvroute.io/dp-ranks", "2")],
            Ok(("http://10.0.0.7:8000", "n", "prefill", 2, None)),
        );
        check(
            &[("kvroute.io/port", "8001"), ("kvroute.io/kv-events-port", "5557")],
            Ok(("http://10.0.0.7:8001", "m", "decode", 1, Some("tcp://10.0.0.7:5557"))),
        );
        check(&[("kvroute.io/role", "both")], bad(annotations::ROLE, "both", "aggregated, prefill or decode"));
        check(&[("kvroute.io/port", "70000")], bad(annotations::PORT, "70000", "a port number"));
        check(&[("kvroute.io/dp-ranks", "0")], bad(annotations::DP_RANKS, "0", "a count above 0"));
        check(&[("kvroute.io/kv-events-port", "x")], bad(annotations::KV_EVENTS_PORT, "x", "a port number"));
    }

    #[test]
    fn a_pod_without_port_or_model_is_refused() {
        let no_port = workers(Some("m")).worker(&member(&[], &[("grpc", 1)]));
        assert_eq!(no_port, Err(PodError::NoPort { port_name: "http".into() }));
        assert_eq!(workers(None).worker(&member(&[], &[("http", 1)])), Err(PodError::NoModel));
        let w = workers(None).worker(&member(&[("kvroute.io/model", "z")], &[("http", 1)])).unwrap();
        assert_eq!((w.model.as_str(), w.labels.get("node").map(String::as_str)), ("z", Some("n1")));
        assert_eq!(w.id, worker_id("u1"), "ids follow the pod's uid");
    }
}
