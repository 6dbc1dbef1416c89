//! Why the tenants were refused, and where a refused key came from.

use std::fmt;

/// Where a key or key hash was written; an error names this, never the key.
#[derive(Clone, Debug, PartialEq, Eq)]
#[non_exhaustive]
pub enum KeySource {
    /// `tenants[tenant].api_key_sha256`.
    Hash {
        /// The tenant's position among `[[tenants]]`.
        tenant: usize,
    },
    /// `tenants[tenant].api_keys_sha256[index]`.
    Hashes {
        /// The tenant's position among `[[tenants]]`.
        tenant: usize,
        /// The hash's position in the list.
        index: usize,
    },
    /// A line of `tenants[tenant].api_key_file`.
    File {
        /// The tenant's position among `[[tenants]]`.
        tenant: usize,
        /// The file, as configured.
        path: String,
        /// 1-based line.
        line: usize,
    },
    /// A line of the variable `tenants[tenant].api_key_env` names.
    Env {
        /// The tenant's position among `[[tenants]]`.
        tenant: usize,
        /// The variable's name.
        var: String,
        /// 1-based line.
        line: usize,
    },
}

impl fmt::Display for KeySource {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            KeySource::Hash { tenant } => write!(f, "tenants[{tenant}].api_key_sha256"),
            KeySource::Hashes { tenant, index } => write!(f, "tenants[{tenant}].api_keys_sha256[{index}]"),
            KeySource::File { tenant, path, line } => write!(f, "tenants[{tenant}].api_key_file ({path} line {line})"),
            KeySource::Env { tenant, var, line } => write!(f, "tenants[{tenant}].api_key_env (${var} line {line})"),
        }
    }
}

/// Why [`Tenants::load`](super::Tenants::load) or [`check`](super::check) refused the
/// `[[tenants]]`. Each message starts with the key it is about.
#[derive(Debug)]
#[non_exhaustive]
pub enum TenantError {
    /// More `[[tenants]]` than [`TENANTS_MAX`](super::TENANTS_MAX).
    TooMany {
        /// How many were configured.
        count: usize,
        /// The most allowed.
        max: usize,
    },
    /// A name that is empty, longer than 64 bytes, or holds a control character.
    BadName {
        /// The tenant's position.
        tenant: usize,
    },
    /// Two tenants with one name.
    RepeatedName {
        /// The second tenant's position.
        tenant: usize,
        /// The first one's.
        first: usize,
        /// The name.
        name: String,
    },
    /// A weight outside `1..=TENANT_WEIGHT_MAX`.
    Weight {
        /// The tenant's position.
        tenant: usize,
        /// The weight given.
        weight: u32,
        /// The largest allowed.
        max: u32,
    },
    /// A limit of 0 (unset means unlimited).
    ZeroLimit {
        /// The tenant's position.
        tenant: usize,
        /// The key, e.g. `requests_per_second`.
        field: &'static str,
    },
    /// A tenant with no key at all.
    NoKey {
        /// The tenant's position.
        tenant: usize,
        /// Its name.
        name: String,
    },
    /// More keys for one tenant than [`KEYS_PER_TENANT_MAX`](super::KEYS_PER_TENANT_MAX).
    TooManyKeys {
        /// The tenant's position.
        tenant: usize,
        /// The most allowed.
        max: usize,
    },
    /// A key hash that is not 64 characters long.
    HashLength {
        /// Where it is written.
        at: KeySource,
        /// Its length, in characters.
        len: usize,
    },
    /// A key hash with a character that is not a hex digit.
    HashNotHex {
        /// Where it is written.
        at: KeySource,
        /// The 0-based position of the first such character.
        position: usize,
    },
    /// A plain key from a file or the environment that cannot be a bearer key.
    BadKey {
        /// Where it is written.
        at: KeySource,
        /// Why.
        reason: &'static str,
    },
    /// The same key twice, in one tenant or two.
    RepeatedKey {
        /// The second place.
        at: KeySource,
        /// The first.
        first: KeySource,
    },
    /// The key file could not be read.
    KeyFile {
        /// The tenant's position.
        tenant: usize,
        /// The file, as configured.
        path: String,
        /// The OS error.
        source: std::io::Error,
    },
    /// A variable name that is empty or holds `=` or NUL.
    BadEnvName {
        /// The tenant's position.
        tenant: usize,
    },
    /// The key variable is not set.
    KeyEnvUnset {
        /// The tenant's position.
        tenant: usize,
        /// The variable's name.
        var: String,
    },
    /// The key variable is not valid UTF-8.
    KeyEnvNotUnicode {
        /// The tenant's position.
        tenant: usize,
        /// The variable's name.
        var: String,
    },
}

impl fmt::Display for TenantError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TenantError::TooMany { count, max } => write!(f, "tenants: {count} entries, at most {max}"),
            TenantError::BadName { tenant } => {
                write!(f, "tenants[{tenant}].name: must be 1 to 64 bytes with no control characters")
            }
            TenantError::RepeatedName { tenant, first, name } => {
                write!(f, "tenants[{tenant}].name: {name:?} is also the name of tenants[{first}]")
            }
            TenantError::Weight { tenant, weight, max } => {
                write!(f, "tenants[{tenant}].weight: {weight} is not in 1..={max}")
            }
            TenantError::ZeroLimit { tenant, field } => {
                write!(f, "tenants[{tenant}].{field}: must be above 0 (leave it unset for no limit)")
            }
            TenantError::NoKey { tenant, name } => write!(
                f,
                "tenants[{tenant}]: tenant {name:?} has no key; set api_key_sha256, api_keys_sha256, \
                 api_key_file or api_key_env"
            ),
            TenantError::TooManyKeys { tenant, max } => write!(f, "tenants[{tenant}]: more than {max} keys"),
            TenantError::HashLength { at, len } => write!(
                f,
                "{at}: a key hash is the hex SHA-256 of the key, 64 characters, not {len} (the plain key \
                 never goes in the config: use `sha256sum` on it, or api_key_file / api_key_env)"
            ),
            TenantError::HashNotHex { at, position } => {
                write!(f, "{at}: character {position} is not a hex digit (0-9, a-f)")
            }
            TenantError::BadKey { at, reason } => write!(f, "{at}: the key {reason}"),
            TenantError::RepeatedKey { at, first } => write!(f, "{at}: the same key as {first}"),
            TenantError::KeyFile { tenant, path, source } => {
                write!(f, "tenants[{tenant}].api_key_file: cannot read {path}: {source}")
            }
            TenantError::BadEnvName { tenant } => {
                write!(f, "tenants[{tenant}].api_key_env: not a variable name (empty, or holds = or NUL)")
            }
            TenantError::KeyEnvUnset { tenant, var } => {
                write!(f, "tenants[{tenant}].api_key_env: the variable {var} is not set")
            }
            TenantError::KeyEnvNotUnicode { tenant, var } => {
                write!(f, "tenants[{tenant}].api_key_env: the variable {var} is not valid UTF-8")
            }
        }
    }
}

impl std::error::Error for TenantError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            TenantError::KeyFile { source, .. } => Some(source),
            _ => None,
        }
    }
}
