//! An `InferencePool`'s spec as the pod watch needs it: whose pods, and on which port.

use std::collections::BTreeMap;

use serde::Deserialize;

/// What the watch needs of an `InferencePool`: whose pods, and on which port.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PoolSpec {
    /// `spec.selector.matchLabels`, every one required.
    pub match_labels: BTreeMap<String, String>,
    /// `spec.targetPorts[0].number`.
    pub port: u16,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SpecJson {
    selector: SelectorJson,
    #[serde(default)]
    target_ports: Vec<PortJson>,
}

#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct SelectorJson {
    #[serde(default)]
    match_labels: BTreeMap<String, String>,
}

#[derive(Deserialize)]
struct PortJson {
    number: u16,
}

impl PoolSpec {
    /// Reads `spec` of an `InferencePool` (`inference.networking.k8s.io/v1`). A pool
    /// without labels or ports selects nothing and is refused.
    pub fn from_json(spec: &serde_json::Value) -> Result<Self, String> {
        let s = SpecJson::deserialize(spec).map_err(|e| format!("bad InferencePool spec: {e}"))?;
        if s.selector.match_labels.is_empty() {
            return Err("the InferencePool selects no labels".into());
        }
        let port = s.target_ports.first().map(|p| p.number).ok_or("the InferencePool has no targetPorts")?;
        Ok(PoolSpec { match_labels: s.selector.match_labels, port })
    }

    /// The label selector of the pod watch, `k1=v1,k2=v2`.
    pub fn selector(&self) -> String {
        self.match_labels.iter().map(|(k, v)| format!("{k}={v}")).collect::<Vec<_>>().join(",")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pool_specs() {
        let ok = json!({"selector": {"matchLabels": {"app": "vllm", "tier": "a"}}, "targetPorts": [{"number": 8000}],
            "endpointPickerRef": {"name": "kvroute-epp"}});
        let spec = PoolSpec::from_json(&ok).unwrap();
        assert_eq!((spec.selector().as_str(), spec.port), ("app=vllm,tier=a", 8000));
        for bad in [
            json!({"selector": {"matchLabels": {}}, "targetPorts": [{"number": 8000}]}),
            json!({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": []}),
            json!({"selector": {"matchLabels": {"app": "x"}}, "targetPorts": [{"number": 70000}]}),
            json!({"targetPorts": [{"number": 1}]}),
        ] {
            assert!(PoolSpec::from_json(&bad).is_err(), "{bad}");
        }
    }
}
