//! Which pods are workers: the pure part of the Kubernetes watch. Watch events of the
//! selected pods become additions and removals of workers, following readiness,
//! addresses and deletion. A ready pod that starts terminating (it gains a deletion
//! timestamp) is drained first, as `POST /workers/{id}/drain` does in the proxy, and
//! removed when it is gone.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};

use k8s_openapi::api::core::v1::Pod;
use kube::runtime::watcher::Event;

/// A pod that can take requests.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Member {
    /// `metadata.uid`: a new pod under an old name is a new worker with an empty cache.
    pub uid: String,
    /// `metadata.name`.
    pub name: String,
    /// `status.podIP`.
    pub ip: IpAddr,
    /// `spec.nodeName`, if scheduled.
    pub node: Option<String>,
    /// `metadata.labels`.
    pub labels: BTreeMap<String, String>,
    /// `metadata.annotations`.
    pub annotations: BTreeMap<String, String>,
    /// The named ports of its containers, name to number.
    pub ports: BTreeMap<String, u16>,
}

impl Member {
    /// A pod that is a worker: it has a uid and an address, is not being deleted, and its
    /// `Ready` condition is `True`. Anything else is `None`.
    pub fn of(pod: &Pod) -> Option<Self> {
        let meta = &pod.metadata;
        if meta.deletion_timestamp.is_some() {
            return None;
        }
        let status = pod.status.as_ref()?;
        let ready = status.conditions.as_ref()?.iter().any(|c| c.type_ == "Ready" && c.status == "True");
        let ip = status.pod_ip.as_deref()?.parse().ok()?;
        ready
            .then(|| Member {
                uid: meta.uid.clone().unwrap_or_default(),
                name: meta.name.clone().unwrap_or_default(),
                ip,
                node: pod.spec.as_ref().and_then(|s| s.node_name.clone()),
                labels: meta.labels.clone().unwrap_or_default(),
                annotations: meta.annotations.clone().unwrap_or_default(),
                ports: named_ports(pod),
            })
            .filter(|m| !m.uid.is_empty())
    }

    /// `ip:port`, the address the gateway routes to.
    pub fn endpoint(&self, port: u16) -> SocketAddr {
        SocketAddr::new(self.ip, port)
    }

    /// The annotation `key`, or else the label `key`.
    pub fn tag(&self, key: &str) -> Option<&str> {
        self.annotations.get(key).or_else(|| self.labels.get(key)).map(String::as_str)
    }
}

/// Every named container port of `pod` that is a valid port number.
fn named_ports(pod: &Pod) -> BTreeMap<String, u16> {
    let containers = pod.spec.iter().flat_map(|s| &s.containers);
    let ports = containers.flat_map(|c| c.ports.iter().flatten());
    ports.filter_map(|p| Some((p.name.clone()?, u16::try_from(p.container_port).ok()?))).collect()
}

/// A change to apply to the worker registry.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Change {
    /// Add the pod, or update it (its address changed).
    Upsert(Member),
    /// Remove the pod with this uid.
    Remove(String),
    /// The pod with this uid is terminating: no new requests or sessions.
    Drain(String),
}

/// The ready pods, kept from watch events. A relist (`Init` .. `InitDone`) is buffered
/// and replaces the set at once, so pods deleted while the watch was down go away too.
#[derive(Debug, Default)]
pub struct PodSet {
    members: BTreeMap<String, Member>,
    /// Members that are terminating, drained and not yet gone.
    draining: std::collections::BTreeSet<String>,
    relist: Option<BTreeMap<String, Member>>,
}

impl PodSet {
    /// Applies one watch event; returns the changes in uid order. Work is linear in the
    /// pods at `InitDone`, constant otherwise.
    pub fn handle(&mut self, ev: Event<Pod>) -> Vec<Change> {
        match ev {
            Event::Init => {
                self.relist = Some(BTreeMap::new());
                Vec::new()
            }
            Event::InitApply(p) => {
                if let (Some(m), Some(buf)) = (Member::of(&p), self.relist.as_mut()) {
                    buf.insert(m.uid.clone(), m);
                }
                Vec::new()
            }
            Event::InitDone => {
                let next = self.relist.take().unwrap_or_default();
                // A terminating pod is not listed as a member: the relist removes it.
                self.draining.retain(|u| next.contains_key(u));
                let mut out: Vec<Change> =
                    self.members.keys().filter(|u| !next.contains_key(*u)).map(|u| Change::Remove(u.clone())).collect();
                out.extend(next.values().filter(|m| self.members.get(&m.uid) != Some(m)).cloned().map(Change::Upsert));
                self.members = next;
                out
            }
            Event::Apply(p) if p.metadata.deletion_timestamp.is_some() => self.drain(&p),
            Event::Apply(p) => match Member::of(&p) {
                Some(m) if self.members.get(&m.uid) == Some(&m) => Vec::new(),
                Some(m) => {
                    self.members.insert(m.uid.clone(), m.clone());
                    vec![Change::Upsert(m)]
                }
                None => self.forget(&p),
            },
            Event::Delete(p) => self.forget(&p),
        }
    }

    /// Every member, in uid order.
    pub fn members(&self) -> impl Iterator<Item = &Member> {
        self.members.values()
    }

    /// Empties the set; returns the removals.
    pub fn clear(&mut self) -> Vec<Change> {
        self.relist = None;
        std::mem::take(&mut self.members).into_keys().map(Change::Remove).collect()
    }

    /// A member started terminating: drain it once; it stays a member until deleted.
    fn drain(&mut self, p: &Pod) -> Vec<Change> {
        let uid = p.metadata.uid.as_deref().unwrap_or_default();
        if self.members.contains_key(uid) && self.draining.insert(uid.to_string()) {
            return vec![Change::Drain(uid.to_string())];
        }
        Vec::new()
    }

    fn forget(&mut self, p: &Pod) -> Vec<Change> {
        let uid = p.metadata.uid.as_deref().unwrap_or_default();
        self.draining.remove(uid);
        match self.members.remove(uid) {
            Some(_) => vec![Change::Remove(uid.to_string())],
            None => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(uid: &str, ip: Option<&str>, ready: &str, deleting: bool) -> Pod {
        let mut v = json!({
            "metadata": {"name": format!("p-{uid}"), "uid": uid},
            "spec": {"containers": [], "nodeName": "n1"},
            "status": {"conditions": [{"type": "Ready", "status": ready}]},
        });
        if let Some(ip) = ip {
            v["status"]["podIP"] = json!(ip);
        }
        if deleting {
            v["metadata"]["deletionTimestamp"] = json!("2025-01-01T00:00:00Z");
        }
        serde_json::from_value(v).unwrap()
    }

    #[track_caller]
    fn check(set: &mut PodSet, ev: Event<Pod>, want: &[&str]) {
        let _ = set.handle(ev);
        let got: Vec<&str> = set.members().map(|m| m.uid.as_str()).collect();
        assert_eq!(got, want);
    }

    #[test]
    fn members_follow_readiness_address_and_deletion() {
        let mut s = PodSet::default();
        check(&mut s, Event::Init, &[]);
        check(&mut s, Event::InitApply(pod("a", Some("10.0.0.1"), "True", false)), &[]);
        check(&mut s, Event::InitApply(pod("b", Some("10.0.0.2"), "False", false)), &[]);
        check(&mut s, Event::InitDone, &["a"]);
        check(&mut s, Event::Apply(pod("b", Some("10.0.0.2"), "True", false)), &["a", "b"]);
        check(&mut s, Event::Apply(pod("c", None, "True", false)), &["a", "b"]);
        check(&mut s, Event::Apply(pod("a", Some("10.0.0.1"), "True", true)), &["a", "b"]);
        check(&mut s, Event::Delete(pod("a", Some("10.0.0.1"), "True", true)), &["b"]);
        check(&mut s, Event::Apply(pod("b", Some("10.0.0.2"), "False", false)), &[]);
        check(&mut s, Event::Apply(pod("b", Some("10.0.0.2"), "True", false)), &["b"]);
        check(&mut s, Event::Delete(pod("b", Some("10.0.0.2"), "True", false)), &[]);
    }

    #[test]
    fn a_terminating_pod_is_drained_once_then_removed_when_deleted() {
        let mut s = PodSet::default();
        let ready = |deleting| pod("a", Some("10.0.0.1"), "True", deleting);
        let a = Member::of(&ready(false)).unwrap();
        assert_eq!(s.handle(Event::Apply(ready(false))), vec![Change::Upsert(a)]);
        assert_eq!(s.handle(Event::Apply(ready(true))), vec![Change::Drain("a".into())]);
        assert_eq!(s.handle(Event::Apply(ready(true))), vec![], "drained once");
        let not_ready = pod("a", Some("10.0.0.1"), "False", true);
        assert_eq!(s.handle(Event::Apply(not_ready.clone())), vec![], "still draining");
        assert_eq!(s.handle(Event::Delete(not_ready)), vec![Change::Remove("a".into())]);
        assert_eq!(s.handle(Event::Apply(pod("z", Some("10.0.0.9"), "True", true))), vec![], "never a member");
    }

    #[test]
    fn a_relist_replaces_the_set() {
        let mut s = PodSet::default();
        let _ = s.handle(Event::Apply(pod("a", Some("10.0.0.1"), "True", false)));
        let _ = s.handle(Event::Apply(pod("b", Some("10.0.0.2"), "True", false)));
        let _ = s.handle(Event::Init);
        let _ = s.handle(Event::InitApply(pod("b", Some("10.0.0.2"), "True", false)));
        let _ = s.handle(Event::InitApply(pod("c", Some("10.0.0.3"), "True", false)));
        let changes = s.handle(Event::InitDone);
        let c = Member::of(&pod("c", Some("10.0.0.3"), "True", false)).unwrap();
        assert_eq!(changes, vec![Change::Remove("a".into()), Change::Upsert(c)], "b is unchanged");
    }
}
