//! Tenants: the `[[tenants]]` of the configuration, their API keys, and the lookup that
//! authenticates a request's bearer key.
//!
//! The configuration never holds a plain key: `api_key_sha256` (or the list
//! `api_keys_sha256`, for rotation) holds the hex SHA-256 of each key, and
//! `api_key_file` / `api_key_env` name a file or an environment variable holding plain
//! keys, read and hashed by [`Tenants::load`] and then dropped. [`Tenants::authenticate`]
//! hashes the presented key and compares it in constant time with every configured
//! hash, so neither the time taken nor the path through the code depends on which key
//! matched or how much of it did.
//!
//! No type here prints a key or a key hash in its `Debug` output.
//!
//! What it leaves to the servers: reading the `Authorization` header, answering 401 and
//! 403, enforcing the limits, and salting an isolated tenant's cache.

use std::fmt;
use std::path::PathBuf;

use router_core::{QueueConfig, TenantId, TENANT_WEIGHT_MAX};
use serde::Deserialize;
use subtle::{ConditionallySelectable, ConstantTimeEq};

mod error;
mod keys;

pub use error::{KeySource, TenantError};

/// Most `[[tenants]]` entries.
pub const TENANTS_MAX: usize = 1024;
/// Most keys (hashes, file lines and environment keys together) of one tenant.
pub const KEYS_PER_TENANT_MAX: usize = 64;
/// Longest plain key accepted from a file or the environment, in bytes.
pub const KEY_BYTES_MAX: usize = 512;

/// One `[[tenants]]` entry, as written in the file.
#[derive(Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TenantConfig {
    /// The tenant's name, unique; used in logs and metrics labels.
    pub name: String,
    /// Hex SHA-256 of the tenant's API key (64 hex digits).
    #[serde(default)]
    pub api_key_sha256: Option<String>,
    /// More hex SHA-256 key hashes, for rotation: every one is accepted.
    #[serde(default)]
    pub api_keys_sha256: Vec<String>,
    /// A file of plain keys, one per line (blank lines and `#` comments skipped),
    /// hashed when the tenants are loaded.
    #[serde(default)]
    pub api_key_file: Option<PathBuf>,
    /// An environment variable holding plain keys, one per line, hashed when loaded.
    #[serde(default)]
    pub api_key_env: Option<String>,
    /// Request rate, a token bucket refilled at this many requests per second (default
    /// unset: unlimited).
    #[serde(default)]
    pub requests_per_second: Option<u32>,
    /// Tokens per minute: prompt tokens plus `max_tokens`, charged on admission and
    /// trued up at the end (default unset: unlimited).
    #[serde(default)]
    pub tokens_per_minute: Option<u64>,
    /// Requests in progress at once (default unset: unlimited).
    #[serde(default)]
    pub concurrent_max: Option<u32>,
    /// Share of the admission queue when the fleet is saturated (default 1, at most
    /// `TENANT_WEIGHT_MAX`).
    #[serde(default = "one")]
    pub weight: u32,
    /// Whether the tenant's prompts share the prefix cache with other tenants' (default
    /// `isolated`).
    #[serde(default)]
    pub cache: CacheMode,
    /// May use the trusted features: `/workers`, `/route/preview`, pins (default false).
    #[serde(default)]
    pub admin: bool,
    /// The models (`[[models]]` names) the tenant may use (default empty: every
    /// model). A model allows its LoRA adapters, and the names that fall back to it.
    #[serde(default)]
    pub models: Vec<String>,
}

fn one() -> u32 {
    1
}

/// Key hashes are not keys, but a weak key's hash can be guessed: neither is printed.
impl fmt::Debug for TenantConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("TenantConfig")
            .field("name", &self.name)
            .field("api_key_sha256", &self.api_key_sha256.as_ref().map(|_| "<redacted>"))
            .field("api_keys_sha256", &format_args!("<{} redacted>", self.api_keys_sha256.len()))
            .field("api_key_file", &self.api_key_file)
            .field("api_key_env", &self.api_key_env)
            .field("requests_per_second", &self.requests_per_second)
            .field("tokens_per_minute", &self.tokens_per_minute)
            .field("concurrent_max", &self.concurrent_max)
            .field("weight", &self.weight)
            .field("cache", &self.cache)
            .field("admin", &self.admin)
            .field("models", &self.models)
            .finish()
    }
}

/// Whether a tenant's prompts share cached KV blocks with other tenants'.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CacheMode {
    /// Salted per tenant: no KV block is shared with another tenant (the default).
    #[default]
    Isolated,
    /// Unsalted: shares blocks with every other `shared` tenant.
    Shared,
}

/// A loaded tenant: its name, id and limits. Holds no key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub struct Tenant {
    /// The configured name.
    pub name: String,
    /// Its id in the admission queue: its position among `[[tenants]]`.
    pub id: TenantId,
    /// Requests per second, if limited.
    pub requests_per_second: Option<u32>,
    /// Tokens per minute, if limited.
    pub tokens_per_minute: Option<u64>,
    /// Requests in progress at once, if limited.
    pub concurrent_max: Option<u32>,
    /// Its weight in the admission queue.
    pub weight: u32,
    /// Its cache isolation.
    pub cache: CacheMode,
    /// Whether it may use the trusted features.
    pub admin: bool,
    /// The salt of its prompts' cache, when `cache = "isolated"`.
    pub cache_salt: Option<CacheSalt>,
    /// The models it may use; empty: every model.
    pub models: Vec<String>,
}

impl Tenant {
    /// Whether the tenant may use the model whose pool is `pool` (an adapter's or a
    /// fallback name's pool is its model's). Linear in its `models`.
    pub fn may_use(&self, pool: &str) -> bool {
        self.models.is_empty() || self.models.iter().any(|m| m == pool)
    }
}

/// An isolated tenant's cache salt: 32 hex digits of HMAC-SHA256, keyed by the lowest
/// of the tenant's key hashes, of its name. Other tenants cannot compute it without that
/// hash, so none can name it as their own `cache_salt`. Rotating the tenant's lowest key
/// changes it, which starts the tenant's cache afresh.
#[derive(Clone, PartialEq, Eq)]
pub struct CacheSalt(String);

impl CacheSalt {
    fn derive(key_hashes: &[[u8; 32]], name: &str) -> Option<Self> {
        let lowest = key_hashes.iter().min()?;
        let key = ring::hmac::Key::new(ring::hmac::HMAC_SHA256, lowest);
        let tag = ring::hmac::sign(&key, [b"kvroute cache salt v1\0".as_slice(), name.as_bytes()].concat().as_slice());
        Some(CacheSalt(tag.as_ref()[..16].iter().map(|b| format!("{b:02x}")).collect()))
    }

    /// The salt joined with a client's own `cache_salt`: the tenant's always leads, so
    /// a client can add to it and never replace it.
    pub fn combine(&self, client: Option<&str>) -> String {
        match client.filter(|c| !c.is_empty()) {
            Some(c) => format!("{}:{c}", self.0),
            None => self.0.clone(),
        }
    }

    /// `body`, a JSON object with no `cache_salt` member (the caller checked), with the
    /// salt added as its first member: the bytes the client sent, not a re-encoding of
    /// them, so the rest of the body is copied once and never re-serialized. `None` when
    /// `body` does not start with `{` (after blanks). Work: one copy of the body.
    pub fn prepend_to(&self, body: &[u8]) -> Option<bytes::Bytes> {
        // The salt is hex digits: nothing in it needs escaping.
        crate::request::with_first_member(body, &format!("\"cache_salt\":\"{}\"", self.0))
    }
}

/// The salt is not a key, but one tenant's salt would let another share its cache.
impl fmt::Debug for CacheSalt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("CacheSalt(<redacted>)")
    }
}

/// One accepted key: its SHA-256 and the tenant it names.
#[derive(Clone)]
struct KeyHash {
    sha256: [u8; 32],
    tenant: u32,
}

/// The configured tenants and every key hash they accept.
#[derive(Clone, Default)]
pub struct Tenants {
    tenants: Vec<Tenant>,
    keys: Vec<KeyHash>,
}

/// Names the tenants and counts their keys; never prints a hash.
impl fmt::Debug for Tenants {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Tenants")
            .field("tenants", &self.tenants.iter().map(|t| &t.name).collect::<Vec<_>>())
            .field("keys", &self.keys.len())
            .finish()
    }
}

impl Tenants {
    /// Builds the tenants from the configuration, reading and hashing the keys of
    /// `api_key_file` and `api_key_env`. Work is linear in the keys, plus a sort.
    pub fn load(cfg: &[TenantConfig]) -> Result<Self, TenantError> {
        Self::load_with(cfg, &|var| std::env::var_os(var))
    }

    /// As [`load`](Self::load), reading environment variables through `env`.
    pub fn load_with(
        cfg: &[TenantConfig],
        env: &dyn Fn(&str) -> Option<std::ffi::OsString>,
    ) -> Result<Self, TenantError> {
        check_entries(cfg)?;
        let mut out = Tenants::default();
        let mut sources = Vec::new();
        for (i, t) in cfg.iter().enumerate() {
            let hashes = keys::tenant_keys(i, t, env)?;
            if hashes.is_empty() {
                return Err(TenantError::NoKey { tenant: i, name: t.name.clone() });
            }
            let salt = match t.cache {
                CacheMode::Isolated => CacheSalt::derive(&hashes.iter().map(|h| h.0).collect::<Vec<_>>(), &t.name),
                CacheMode::Shared => None,
            };
            for (sha256, source) in hashes {
                out.keys.push(KeyHash { sha256, tenant: i as u32 });
                sources.push(source);
            }
            out.tenants.push(Tenant { cache_salt: salt, ..tenant(i, t) });
        }
        keys::refuse_repeats(&out.keys.iter().map(|k| k.sha256).collect::<Vec<_>>(), &sources)?;
        Ok(out)
    }

    /// The tenant whose key `bearer` is (the bytes after `Bearer `), or `None`.
    ///
    /// Hashes `bearer` and compares the hash with every configured one in constant
    /// time: the work is the same whichever key matches, or none. Work is linear in the
    /// configured keys.
    pub fn authenticate(&self, bearer: &[u8]) -> Option<&Tenant> {
        let presented = keys::sha256(bearer);
        let mut found = subtle::Choice::from(0);
        let mut tenant = 0u32;
        for k in &self.keys {
            let eq = k.sha256.ct_eq(&presented);
            tenant.conditional_assign(&k.tenant, eq);
            found |= eq;
        }
        if bool::from(found) {
            self.tenants.get(tenant as usize)
        } else {
            None
        }
    }

    /// True when no tenant is configured: the gateway is open.
    pub fn is_empty(&self) -> bool {
        self.tenants.is_empty()
    }

    /// The tenants, in configuration order (their ids).
    pub fn iter(&self) -> impl Iterator<Item = &Tenant> {
        self.tenants.iter()
    }

    /// The tenant with id `id`.
    pub fn get(&self, id: TenantId) -> Option<&Tenant> {
        self.tenants.get(usize::from(id.0))
    }

    /// Gives each tenant its weight in an admission queue whose requests carry the
    /// tenants' ids. Only for a server that sets `Request::tenant`: listed tenants keep
    /// queue slots, which requests of no tenant cannot use.
    pub fn apply_to_queue(&self, queue: &mut QueueConfig) {
        queue.tenant_weights = self.tenants.iter().map(|t| t.weight).collect();
        queue.tenants_max = u16::try_from(self.tenants.len().max(1)).unwrap_or(u16::MAX);
    }
}

/// Checks what the file alone can show: count, names, weights, limits, a place for
/// every tenant's keys, and the hashes written in it (length, hex, repeats). [`Tenants::load`] checks the same and more.
pub fn check(cfg: &[TenantConfig]) -> Result<(), TenantError> {
    check_entries(cfg)?;
    let mut hashes = Vec::new();
    let mut sources = Vec::new();
    for (i, t) in cfg.iter().enumerate() {
        let written = t.api_key_sha256.is_some() || !t.api_keys_sha256.is_empty();
        if !written && t.api_key_file.is_none() && t.api_key_env.is_none() {
            return Err(TenantError::NoKey { tenant: i, name: t.name.clone() });
        }
        for (sha256, source) in keys::written_hashes(i, t)? {
            hashes.push(sha256);
            sources.push(source);
        }
    }
    keys::refuse_repeats(&hashes, &sources)
}

fn check_entries(cfg: &[TenantConfig]) -> Result<(), TenantError> {
    if cfg.len() > TENANTS_MAX {
        return Err(TenantError::TooMany { count: cfg.len(), max: TENANTS_MAX });
    }
    for (i, t) in cfg.iter().enumerate() {
        if t.name.is_empty() || t.name.len() > 64 || t.name.chars().any(|c| c.is_control()) {
            return Err(TenantError::BadName { tenant: i });
        }
        if let Some(first) = cfg[..i].iter().position(|o| o.name == t.name) {
            return Err(TenantError::RepeatedName { tenant: i, first, name: t.name.clone() });
        }
        if t.api_key_env.as_ref().is_some_and(|v| v.is_empty() || v.contains(['=', '\0'])) {
            return Err(TenantError::BadEnvName { tenant: i });
        }
        if !(1..=TENANT_WEIGHT_MAX).contains(&t.weight) {
            return Err(TenantError::Weight { tenant: i, weight: t.weight, max: TENANT_WEIGHT_MAX });
        }
        let zero = [
            ("requests_per_second", t.requests_per_second == Some(0)),
            ("tokens_per_minute", t.tokens_per_minute == Some(0)),
            ("concurrent_max", t.concurrent_max == Some(0)),
        ];
        if let Some(&(field, _)) = zero.iter().find(|(_, z)| *z) {
            return Err(TenantError::ZeroLimit { tenant: i, field });
        }
    }
    Ok(())
}

fn tenant(i: usize, t: &TenantConfig) -> Tenant {
    Tenant {
        name: t.name.clone(),
        id: TenantId(i as u16),
        requests_per_second: t.requests_per_second,
        tokens_per_minute: t.tokens_per_minute,
        concurrent_max: t.concurrent_max,
        weight: t.weight,
        cache: t.cache,
        admin: t.admin,
        cache_salt: None,
        models: t.models.clone(),
    }
}

#[cfg(test)]
mod tests;
