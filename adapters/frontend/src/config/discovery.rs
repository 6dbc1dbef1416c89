//! The `[discovery]` section: where workers come from besides `[[workers]]` and the
//! admin API. Only `kvroute serve` acts on it (the `kvroute-k8s` crate does the
//! watching); `kvroute epp` follows an `InferencePool` instead and refuses the section.
//!
//! With `[discovery.kubernetes]`, every pod of `namespace` that `label_selector` picks
//! becomes a worker while it is Ready, has an address and is not being deleted. What
//! the worker is comes from the pod's annotations, or its labels when the annotation
//! is absent (see [`annotations`]); what neither says comes from this section.

use serde::Deserialize;

/// The annotations (or labels) read on a discovered pod.
pub mod annotations {
    /// The `[[models]]` name the pod serves (default `discovery.kubernetes.model`).
    pub const MODEL: &str = "kvroute.io/model";
    /// `aggregated` (default), `prefill` or `decode`.
    pub const ROLE: &str = "kvroute.io/role";
    /// The HTTP port, overriding the named container port `port_name`.
    pub const PORT: &str = "kvroute.io/port";
    /// The port of the engine's KV-event publisher (ZeroMQ PUB) on the pod's address
    /// (default `discovery.kubernetes.kv_events_port`; neither: no subscription).
    pub const KV_EVENTS_PORT: &str = "kvroute.io/kv-events-port";
    /// The port of its replay (ROUTER) endpoint, to fill gaps (default none).
    pub const KV_EVENTS_REPLAY_PORT: &str = "kvroute.io/kv-events-replay-port";
    /// Data-parallel ranks (default 1).
    pub const DP_RANKS: &str = "kvroute.io/dp-ranks";
    /// A prefill worker's bootstrap port, for `sglang-bootstrap` models.
    pub const BOOTSTRAP_PORT: &str = "kvroute.io/bootstrap-port";
}

/// Sources of workers (`[discovery]`); none by default.
#[derive(Clone, Debug, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DiscoverySection {
    /// Follow pods through the Kubernetes API (default off).
    pub kubernetes: Option<KubernetesDiscovery>,
}

/// `[discovery.kubernetes]`: pods as workers. Static `[[workers]]` may sit beside it;
/// a discovered worker's id is 53 bits of a hash of its pod's uid.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct KubernetesDiscovery {
    /// The pods' namespace (default: the client's, i.e. the namespace this pod runs in,
    /// or the kubeconfig context's).
    pub namespace: Option<String>,
    /// Which pods, e.g. `app=vllm,tier=gpu` (required).
    pub label_selector: String,
    /// The named container port serving HTTP (default `http`); a pod's
    /// `kvroute.io/port` annotation overrides it.
    pub port_name: String,
    /// The model of pods without `kvroute.io/model` (default: the only `[[models]]`).
    pub model: Option<String>,
    /// The KV-event port of pods without `kvroute.io/kv-events-port` (default none).
    pub kv_events_port: Option<u16>,
    /// KV-cache capacity per rank, in blocks (default 16,384).
    pub kv_blocks: u32,
    /// Tokens per forward pass, per rank (default 8,192).
    pub max_batched_tokens: u32,
}

impl Default for KubernetesDiscovery {
    fn default() -> Self {
        KubernetesDiscovery {
            namespace: None,
            label_selector: String::new(),
            port_name: "http".into(),
            model: None,
            kv_events_port: None,
            kv_blocks: 16_384,
            max_batched_tokens: 8192,
        }
    }
}

impl DiscoverySection {
    /// The first field that is out of range, with why; `models` are the configured
    /// model names.
    pub fn check<'a>(&self, mut models: impl Iterator<Item = &'a str> + Clone) -> Result<(), (String, String)> {
        let Some(k) = &self.kubernetes else { return Ok(()) };
        let key = |f: &str| format!("discovery.kubernetes.{f}");
        if k.label_selector.trim().is_empty() {
            return Err((key("label_selector"), "required: which pods are workers, e.g. \"app=vllm\"".into()));
        }
        if k.port_name.is_empty() {
            return Err((key("port_name"), "must name a container port".into()));
        }
        if k.kv_blocks == 0 || k.max_batched_tokens == 0 {
            return Err((key("kv_blocks"), "kv_blocks and max_batched_tokens must be above 0".into()));
        }
        match &k.model {
            Some(m) if !models.clone().any(|n| n == m) => {
                Err((key("model"), format!("{m:?} is not a [[models]] name")))
            }
            Some(_) => Ok(()),
            None if models.clone().count() == 1 || models.next().is_none() => Ok(()),
            None => Err((key("model"), "required when several models are configured".into())),
        }
    }
}

impl KubernetesDiscovery {
    /// The model of a pod that names none: `model`, or the only one of `models`.
    pub fn default_model<'a>(&'a self, mut models: impl Iterator<Item = &'a str>) -> Option<&'a str> {
        if let Some(m) = &self.model {
            return Some(m);
        }
        let first = models.next()?;
        models.next().is_none().then_some(first)
    }
}

#[cfg(test)]
mod tests {
    use crate::config::ProxyConfig;

    /// Parses `[[models]]` named `models` and a `[discovery.kubernetes]` with `body`;
    /// `Err` holds the message.
    fn parse(models: &[&str], body: &str) -> Result<ProxyConfig, String> {
        let mut text: String = models.iter().map(|m| format!("[[models]]\nname = \"{m}\"\n")).collect();
        text.push_str(&format!("[discovery.kubernetes]\n{body}"));
        ProxyConfig::from_toml_str(&text).map_err(|e| e.to_string())
    }

    #[track_caller]
    fn check(models: &[&str], body: &str, want: Result<Option<&str>, &str>) {
        match (parse(models, body), want) {
            (Ok(cfg), Ok(model)) => {
                let k = cfg.discovery.kubernetes.expect("the section");
                assert_eq!(k.default_model(cfg.models.iter().map(|m| m.name.as_str())), model);
            }
            (Err(e), Err(part)) => assert!(e.contains(part), "{e:?} should mention {part:?}"),
            (got, want) => panic!("{body:?}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn the_kubernetes_section_is_checked() {
        let sel = "label_selector = \"app=vllm\"\n";
        check(&["m"], sel, Ok(Some("m")));
        check(&["a", "b"], &format!("{sel}model = \"b\"\n"), Ok(Some("b")));
        check(&["a", "b"], sel, Err("discovery.kubernetes.model"));
        check(&["a"], &format!("{sel}model = \"z\"\n"), Err("discovery.kubernetes.model"));
        check(&["m"], "", Err("discovery.kubernetes.label_selector"));
        check(&["m"], &format!("{sel}port_name = \"\"\n"), Err("discovery.kubernetes.port_name"));
        check(&["m"], &format!("{sel}kv_blocks = 0\n"), Err("discovery.kubernetes.kv_blocks"));
        check(&["m"], &format!("{sel}bogus = 1\n"), Err("bogus"));
        let cfg = parse(&["m"], &format!("{sel}kv_events_port = 5557\nnamespace = \"x\"\n")).unwrap();
        let k = cfg.discovery.kubernetes.unwrap();
        assert_eq!((k.kv_events_port, k.namespace.as_deref(), k.port_name.as_str()), (Some(5557), Some("x"), "http"));
        assert_eq!(ProxyConfig::from_toml_str("").unwrap().discovery.kubernetes, None, "off by default");
    }
}
