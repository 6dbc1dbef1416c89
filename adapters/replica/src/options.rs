//! How a replica joins its peers: its name, the NATS server, the subject prefix, and
//! the pace of heartbeats; and the ids and subjects derived from them.

use std::fmt;

use router_core::ReplicaId;
use xxhash_rust::xxh3::xxh3_64;

use crate::wire::Kind;

/// How to run one replica. `Default` is a replica named `kvroute` on a local NATS server.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ReplicaOptions {
    /// This replica's name, unique among the replicas of a cluster; its [`ReplicaId`]
    /// is derived from it (see [`replica_id`]).
    pub name: String,
    /// The NATS server, e.g. `nats://127.0.0.1:4222` (default).
    pub nats_url: String,
    /// Replicas sharing state use the same cluster name; it prefixes every subject
    /// (`kvroute.<cluster>.load`, `.affinity`, `.heartbeat`). Letters, digits, `-` and
    /// `_` only. Default `default`.
    pub cluster: String,
    /// Time between heartbeats, in ms (default 1,000). Keep it well below the routers'
    /// `replica_silence_max_ms`.
    pub heartbeat_ms: u64,
    /// Updates waiting to be published, per model; beyond it updates are dropped and
    /// counted (default 4,096).
    pub outbox_max: usize,
    /// Most updates batched into one NATS message (default 256).
    pub batch_updates_max: usize,
}

impl Default for ReplicaOptions {
    fn default() -> Self {
        ReplicaOptions {
            name: "kvroute".into(),
            nats_url: "nats://127.0.0.1:4222".into(),
            cluster: "default".into(),
            heartbeat_ms: 1_000,
            outbox_max: 4096,
            batch_updates_max: 256,
        }
    }
}

/// Why a replica could not start. Losing or never reaching NATS is not one of these: a
/// replica then runs alone until NATS is back.
#[derive(Debug)]
#[non_exhaustive]
pub enum ReplicaStartError {
    /// An option is out of range; names the option.
    Invalid {
        /// The option, e.g. `cluster`.
        option: &'static str,
        /// What is wrong.
        message: String,
    },
    /// The NATS client refused the URL or options; the client's error is the source.
    Connect(Box<dyn std::error::Error + Send + Sync>),
    /// The subscription could not be made; the client's error is the source.
    Subscribe(Box<dyn std::error::Error + Send + Sync>),
}

impl fmt::Display for ReplicaStartError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ReplicaStartError::Invalid { option, message } => write!(f, "replica.{option}: {message}"),
            ReplicaStartError::Connect(e) => write!(f, "NATS client: {e}"),
            ReplicaStartError::Subscribe(e) => write!(f, "NATS subscription: {e}"),
        }
    }
}

impl std::error::Error for ReplicaStartError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            ReplicaStartError::Invalid { .. } => None,
            ReplicaStartError::Connect(e) | ReplicaStartError::Subscribe(e) => Some(&**e),
        }
    }
}

impl ReplicaOptions {
    /// Checks what types alone cannot.
    pub fn validate(&self) -> Result<(), ReplicaStartError> {
        let invalid = |option, message: &str| Err(ReplicaStartError::Invalid { option, message: message.into() });
        if self.name.is_empty() {
            return invalid("id", "must not be empty");
        }
        if self.cluster.is_empty() || !self.cluster.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_')
        {
            return invalid("cluster", "must be letters, digits, '-' or '_'");
        }
        if self.heartbeat_ms == 0 {
            return invalid("heartbeat_ms", "must be above 0");
        }
        if self.outbox_max == 0 || self.batch_updates_max == 0 {
            return invalid("outbox_max", "outbox_max and batch_updates_max must be above 0");
        }
        Ok(())
    }

    /// The subject messages of `kind` go to.
    pub fn subject(&self, kind: Kind) -> String {
        let leaf = match kind {
            Kind::Load => "load",
            Kind::Affinity => "affinity",
            Kind::Heartbeat => "heartbeat",
        };
        format!("kvroute.{}.{leaf}", self.cluster)
    }

    /// The subscription covering every subject of the cluster.
    pub fn subscription(&self) -> String {
        format!("kvroute.{}.*", self.cluster)
    }
}

/// The id of the replica named `name`: the same on every replica, so that session
/// binding conflicts are settled alike everywhere.
pub fn replica_id(name: &str) -> ReplicaId {
    ReplicaId(xxh3_64(name.as_bytes()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(tweak: fn(&mut ReplicaOptions), bad_option: Option<&str>) {
        let mut o = ReplicaOptions::default();
        tweak(&mut o);
        match (o.validate(), bad_option) {
            (Ok(()), None) => {}
            (Err(ReplicaStartError::Invalid { option, .. }), Some(want)) => assert_eq!(option, want),
            (got, want) => panic!("{o:?}: got {got:?}, wanted a complaint about {want:?}"),
        }
    }

    #[test]
    fn options_are_checked() {
        check(|_| {}, None);
        check(|o| o.cluster = "prod-eu_1".into(), None);
        check(|o| o.name.clear(), Some("id"));
        check(|o| o.cluster = "a.b".into(), Some("cluster"));
        check(|o| o.cluster = "a*".into(), Some("cluster"));
        check(|o| o.cluster.clear(), Some("cluster"));
        check(|o| o.heartbeat_ms = 0, Some("heartbeat_ms"));
        check(|o| o.outbox_max = 0, Some("outbox_max"));
    }

    #[test]
    fn ids_and_subjects_are_derived_alike_everywhere() {
        assert_eq!(replica_id("router-a"), replica_id("router-a"));
        assert_ne!(replica_id("router-a"), replica_id("router-b"));
        let o = ReplicaOptions { cluster: "c1".into(), ..ReplicaOptions::default() };
        assert_eq!(o.subject(Kind::Load), "kvroute.c1.load");
        assert_eq!(o.subject(Kind::Affinity), "kvroute.c1.affinity");
        assert_eq!(o.subject(Kind::Heartbeat), "kvroute.c1.heartbeat");
        assert_eq!(o.subscription(), "kvroute.c1.*");
    }
}
