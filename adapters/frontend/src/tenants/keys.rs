//! Key hashes: parsing the hex ones written in the config, hashing the plain ones read
//! from a file or the environment, and refusing a key named twice.

use std::ffi::OsString;

use super::{KeySource, TenantConfig, TenantError, KEYS_PER_TENANT_MAX, KEY_BYTES_MAX};

/// The SHA-256 of `bytes`.
pub(super) fn sha256(bytes: &[u8]) -> [u8; 32] {
    let d = ring::digest::digest(&ring::digest::SHA256, bytes);
    let mut out = [0; 32];
    out.copy_from_slice(d.as_ref());
    out
}

/// The hashes written in tenant `i`'s entry, each with where it is written.
pub(super) fn written_hashes(i: usize, t: &TenantConfig) -> Result<Vec<([u8; 32], KeySource)>, TenantError> {
    let one = t.api_key_sha256.iter().map(|h| (h, KeySource::Hash { tenant: i }));
    let many = t.api_keys_sha256.iter().enumerate().map(|(index, h)| (h, KeySource::Hashes { tenant: i, index }));
    let mut out = Vec::new();
    for (hex, at) in one.chain(many) {
        if out.len() == KEYS_PER_TENANT_MAX {
            return Err(TenantError::TooManyKeys { tenant: i, max: KEYS_PER_TENANT_MAX });
        }
        out.push((parse_hex(hex, &at)?, at));
    }
    Ok(out)
}

/// Every key of tenant `i`: the written hashes, then the hashed keys of its file and
/// its variable.
pub(super) fn tenant_keys(
    i: usize,
    t: &TenantConfig,
    env: &dyn Fn(&str) -> Option<OsString>,
) -> Result<Vec<([u8; 32], KeySource)>, TenantError> {
    let mut out = written_hashes(i, t)?;
    if let Some(path) = &t.api_key_file {
        let path_s = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| TenantError::KeyFile {
            tenant: i,
            path: path_s.clone(),
            source,
        })?;
        plain_keys(i, &text, |line| KeySource::File { tenant: i, path: path_s.clone(), line }, &mut out)?;
    }
    if let Some(var) = &t.api_key_env {
        let value = env(var).ok_or_else(|| TenantError::KeyEnvUnset { tenant: i, var: var.clone() })?;
        let text = value.into_string().map_err(|_| TenantError::KeyEnvNotUnicode { tenant: i, var: var.clone() })?;
        plain_keys(i, &text, |line| KeySource::Env { tenant: i, var: var.clone(), line }, &mut out)?;
    }
    Ok(out)
}

/// Hashes each key of `text`, one per line; blank lines and lines starting with `#`
/// are skipped. A key is what a client sends after `Bearer `: visible ASCII.
fn plain_keys(
    tenant: usize,
    text: &str,
    at: impl Fn(usize) -> KeySource,
    out: &mut Vec<([u8; 32], KeySource)>,
) -> Result<(), TenantError> {
    for (n, line) in text.lines().enumerate() {
        let key = line.trim();
        if key.is_empty() || key.starts_with('#') {
            continue;
        }
        if key.len() > KEY_BYTES_MAX {
            return Err(TenantError::BadKey { at: at(n + 1), reason: "is longer than 512 bytes" });
        }
        if !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err(TenantError::BadKey { at: at(n + 1), reason: "holds a space or a character outside ASCII" });
        }
        if out.len() == KEYS_PER_TENANT_MAX {
            return Err(TenantError::TooManyKeys { tenant, max: KEYS_PER_TENANT_MAX });
        }
        out.push((sha256(key.as_bytes()), at(n + 1)));
    }
    Ok(())
}

/// 64 hex digits, either case, as 32 bytes.
fn parse_hex(hex: &str, at: &KeySource) -> Result<[u8; 32], TenantError> {
    let len = hex.chars().count();
    if len != 64 {
        return Err(TenantError::HashLength { at: at.clone(), len });
    }
    if let Some(position) = hex.chars().position(|c| !c.is_ascii_hexdigit()) {
        return Err(TenantError::HashNotHex { at: at.clone(), position });
    }
    // 64 ASCII hex digits from here on: 32 pairs, each a byte.
    let nibble = |c: u8| char::from(c).to_digit(16).unwrap_or(0) as u8;
    let mut out = [0u8; 32];
    for (byte, pair) in out.iter_mut().zip(hex.as_bytes().chunks_exact(2)) {
        *byte = nibble(pair[0]) << 4 | nibble(pair[1]);
    }
    Ok(out)
}

/// Refuses the second place that names a key already named. `hashes` and `sources`
/// run in parallel. Work: a sort of the keys.
pub(super) fn refuse_repeats(hashes: &[[u8; 32]], sources: &[KeySource]) -> Result<(), TenantError> {
    let mut order: Vec<usize> = (0..hashes.len()).collect();
    order.sort_by(|&a, &b| hashes[a].cmp(&hashes[b]).then(a.cmp(&b)));
    // Of every key named again, the place written first in the config.
    let repeat = order.windows(2).filter(|w| hashes[w[0]] == hashes[w[1]]).min_by_key(|w| w[1]);
    match repeat {
        Some(w) => Err(TenantError::RepeatedKey { at: sources[w[1]].clone(), first: sources[w[0]].clone() }),
        None => Ok(()),
    }
}
