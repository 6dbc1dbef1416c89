//! The endpoint picker's settings: the shared configuration file (models, routing,
//! limits, trust, workers, replicas) plus where to listen for the gateway and how it
//! delivers bodies. The file's keys that only a forwarding proxy acts on are refused
//! ([`REFUSED_KEYS`]).

use std::fmt;
use std::net::SocketAddr;
use std::str::FromStr;

use kvroute_frontend::config::RefusedKey;
use kvroute_frontend::{ConfigError, ProxyConfig};

use crate::pb::BodySendMode;

/// Everything `kvroute epp` is configured with. `Default` listens on `127.0.0.1:9002`
/// with the proxy's defaults and no models.
#[derive(Clone, Debug, PartialEq)]
pub struct EppConfig {
    /// Models, routing policy, limits, trust, configured workers and replicas: the same
    /// file as `kvroute serve`. Its `limits.body_bytes_max`, `concurrent_requests_max`,
    /// `session_id_bytes_max` and `shutdown_grace_s` apply to gateway streams. The keys
    /// in [`REFUSED_KEYS`] are not used; [`EppConfig::proxy_from_toml`] refuses a file
    /// that sets them.
    pub proxy: ProxyConfig,
    /// Where the gateway's ext_proc gRPC connects (default `127.0.0.1:9002`, the port the
    /// Inference Extension assumes).
    pub listen: SocketAddr,
    /// How the gateway delivers bodies when its first message does not say (default
    /// [`BodyMode::FullDuplex`], as Inference Extension gateways are configured).
    pub assumed_body_mode: BodyMode,
    /// The certificate the gateway's connections are served with; `None` (default) serves
    /// plaintext HTTP/2. Needs the `tls` feature.
    pub tls: Option<TlsIdentity>,
    /// A second, plaintext address serving only the gRPC health service (default none),
    /// for kubelet probes when the gateway's port speaks TLS.
    pub health_listen: Option<SocketAddr>,
}

/// The keys of the shared file that the picker does not act on: it forwards nothing
/// (the gateway does), so it neither retries, ejects, probes nor splits requests.
pub const REFUSED_KEYS: &[RefusedKey] = &[
    RefusedKey { key: "listen", reason: "the picker listens where --listen (EppConfig::listen) says" },
    RefusedKey { key: "retry", reason: "the gateway forwards requests; the picker retries nothing" },
    RefusedKey { key: "migration", reason: "the gateway streams responses; the picker continues no broken stream" },
    RefusedKey { key: "ejection", reason: "the picker ejects no workers" },
    RefusedKey { key: "health_check", reason: "the picker probes no workers" },
    RefusedKey { key: "limits.header_read_timeout_ms", reason: "the gateway reads client requests" },
    RefusedKey { key: "limits.request_timeout_ms", reason: "the gateway times requests" },
    RefusedKey { key: "limits.connect_timeout_ms", reason: "the gateway connects to workers" },
    RefusedKey { key: "limits.upstream_idle_timeout_ms", reason: "the gateway connects to workers" },
    RefusedKey { key: "limits.connections_max", reason: "the gateway holds client connections" },
    RefusedKey { key: "limits.connection_buffer_bytes_max", reason: "the gateway holds client connections" },
    RefusedKey { key: "models.disagg_protocol", reason: "the picker sends each request to one worker" },
    RefusedKey { key: "models.disagg_isl_min_tokens", reason: "the picker sends each request to one worker" },
    RefusedKey { key: "models.disagg_same_label", reason: "the picker sends each request to one worker" },
    RefusedKey { key: "tracing", reason: "the picker forwards nothing; trace the gateway and the workers" },
    RefusedKey { key: "discovery", reason: "the picker follows an InferencePool's pods (--pool)" },
    RefusedKey { key: "tenants", reason: "the picker sees no client's key, so it authenticates no tenant" },
    RefusedKey { key: "tls", reason: "the picker serves TLS as its --tls flags say" },
    RefusedKey { key: "upstream_tls", reason: "the gateway connects to workers" },
];

impl EppConfig {
    /// The shared configuration file as `kvroute epp` reads it: parsed and checked as for
    /// `kvroute serve`, with `overrides` applied (dotted keys, TOML values), and refused
    /// if the file or the overrides set a key of [`REFUSED_KEYS`].
    pub fn proxy_from_toml(text: &str, overrides: &[(&str, &str)]) -> Result<ProxyConfig, ConfigError> {
        ProxyConfig::from_toml_refusing(text, overrides, REFUSED_KEYS)
    }
}

/// A certificate chain and its private key, both PEM.
#[derive(Clone, PartialEq, Eq)]
pub struct TlsIdentity {
    /// The certificate chain.
    pub cert_pem: String,
    /// The private key.
    pub key_pem: String,
}

impl fmt::Debug for TlsIdentity {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        // Never the key.
        f.debug_struct("TlsIdentity").field("cert_pem_bytes", &self.cert_pem.len()).finish_non_exhaustive()
    }
}

impl TlsIdentity {
    /// A fresh self-signed certificate for `names` (DNS names or IP addresses), for
    /// gateways that encrypt without verifying the picker, as the Inference Extension's
    /// own picker is deployed by default.
    #[cfg(feature = "tls")]
    pub fn self_signed(names: &[String]) -> Result<Self, String> {
        let c = rcgen::generate_simple_self_signed(names.to_vec()).map_err(|e| e.to_string())?;
        Ok(TlsIdentity { cert_pem: c.cert.pem(), key_pem: c.signing_key.serialize_pem() })
    }
}

impl Default for EppConfig {
    fn default() -> Self {
        EppConfig {
            proxy: ProxyConfig::default(),
            listen: SocketAddr::from(([127, 0, 0, 1], 9002)),
            assumed_body_mode: BodyMode::FullDuplex,
            tls: None,
            health_listen: None,
        }
    }
}

/// How a body reaches the picker and what answers it expects.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum BodyMode {
    /// The body is not sent.
    None,
    /// Every message gets one answer before the next (`BUFFERED`, `BUFFERED_PARTIAL`,
    /// `STREAMED`, `GRPC`): the endpoint rides on the answer to the last request chunk.
    /// Only `BUFFERED` lets that answer still change the route.
    Answered,
    /// `FULL_DUPLEX_STREAMED`: the picker answers when it likes and passes every body
    /// chunk back itself; the endpoint rides on the answer to the request headers, sent
    /// once the whole body is in.
    FullDuplex,
}

impl BodyMode {
    /// The mode a gateway announces as Envoy's `BodySendMode` number; unknown numbers
    /// are treated as [`BodyMode::Answered`], the strict one-answer-per-message rule.
    pub fn from_envoy(mode: i32) -> Self {
        match BodySendMode::try_from(mode) {
            Ok(BodySendMode::None) => BodyMode::None,
            Ok(BodySendMode::FullDuplexStreamed) => BodyMode::FullDuplex,
            _ => BodyMode::Answered,
        }
    }
}

impl FromStr for BodyMode {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "full-duplex" => Ok(BodyMode::FullDuplex),
            "buffered" => Ok(BodyMode::Answered),
            _ => Err(format!("unknown body mode {s:?}; expected full-duplex or buffered")),
        }
    }
}

impl fmt::Display for BodyMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            BodyMode::None => "none",
            BodyMode::Answered => "buffered",
            BodyMode::FullDuplex => "full-duplex",
        })
    }
}
