//! Authentication: with any `[[tenants]]` configured, a request to `/v1/*` names its
//! tenant by `Authorization: Bearer KEY`, and an admin endpoint takes trust or an admin
//! tenant's key. It runs before the body is read, so a stranger costs a header's worth
//! of work.
//!
//! Without tenants the gateway is open: every request passes as today, and the
//! client's `Authorization` goes on to the worker (which may check its own key). With
//! tenants the header is the router's, and is never forwarded. A key appears in no
//! answer, log, metric or span: refusals name only what was wrong with the header.

use http::header::AUTHORIZATION;
use http::{HeaderMap, StatusCode};
use kvroute_frontend::tenants::Tenants;
use router_core::TenantId;

use crate::error::ApiError;

/// Longest `Authorization` header read, in bytes; a longer one is refused unread.
pub const AUTHORIZATION_BYTES_MAX: usize = 4096;

/// Who sent a request, as far as the tenants can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Caller {
    /// No tenants are configured: the gateway is open.
    Open,
    /// The tenant whose key the request carries.
    Tenant {
        /// Its id (see [`Tenants::get`]).
        id: TenantId,
        /// Whether it may use the trusted features.
        admin: bool,
    },
}

impl Caller {
    /// The tenant's id, if the gateway is closed.
    pub fn tenant(&self) -> Option<TenantId> {
        match self {
            Caller::Open => None,
            Caller::Tenant { id, .. } => Some(*id),
        }
    }

    /// Whether the caller holds an admin tenant's key.
    pub fn admin(&self) -> bool {
        matches!(self, Caller::Tenant { admin: true, .. })
    }
}

/// The caller of a request with `headers`: [`Caller::Open`] without tenants, else the
/// tenant whose key it carries, or 401. Work is linear in the configured keys.
pub fn authenticate(tenants: &Tenants, headers: &HeaderMap) -> Result<Caller, ApiError> {
    if tenants.is_empty() {
        return Ok(Caller::Open);
    }
    let key = bearer(headers).map_err(unauthorized)?;
    let t = tenants.authenticate(key).ok_or_else(|| unauthorized("the API key is not valid"))?;
    Ok(Caller::Tenant { id: t.id, admin: t.admin })
}

/// The key of a single `Authorization: Bearer KEY` header, or why there is none.
fn bearer(headers: &HeaderMap) -> Result<&[u8], &'static str> {
    let mut all = headers.get_all(AUTHORIZATION).iter();
    let Some(v) = all.next() else { return Err("no API key: send `Authorization: Bearer KEY`") };
    if all.next().is_some() {
        return Err("the Authorization header is repeated");
    }
    let b = v.as_bytes();
    if b.len() > AUTHORIZATION_BYTES_MAX {
        return Err("the Authorization header is too long");
    }
    let scheme = b"bearer ";
    if b.len() <= scheme.len() || !b[..scheme.len()].eq_ignore_ascii_case(scheme) {
        return Err("the Authorization header is not `Bearer KEY`");
    }
    let key = b[scheme.len()..].trim_ascii();
    if key.is_empty() {
        return Err("the Authorization header is not `Bearer KEY`");
    }
    Ok(key)
}

/// 401 `invalid_api_key`, saying `why` and never echoing the key.
pub fn unauthorized(why: &str) -> ApiError {
    ApiError {
        status: StatusCode::UNAUTHORIZED,
        kind: "invalid_request_error",
        code: "invalid_api_key",
        message: why.to_string(),
        retry_after_s: None,
        detail: None,
    }
}

/// Why `caller` may not use an admin endpoint, or `None` when it may: a trusted
/// client or an admin tenant may; a tenant's key that is not an admin's gets 403; with
/// tenants configured, a request with no valid key gets its 401; else 403 as always.
pub fn admin_refusal(trusted: bool, caller: &Result<Caller, ApiError>) -> Option<ApiError> {
    match caller {
        _ if trusted => None,
        Ok(Caller::Tenant { admin: true, .. }) => None,
        Ok(Caller::Tenant { admin: false, .. }) => Some(not_admin()),
        Ok(Caller::Open) => Some(ApiError::forbidden()),
        Err(e) => Some(e.clone()),
    }
}

/// 403: a tenant's key that is not an admin's, on an admin endpoint.
pub fn not_admin() -> ApiError {
    ApiError {
        status: StatusCode::FORBIDDEN,
        kind: "permission_error",
        code: "forbidden",
        message: "this endpoint is for admin tenants and trusted clients only".to_string(),
        retry_after_s: None,
        detail: None,
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;
    use kvroute_frontend::tenants::TenantConfig;
    use serde_json::json;

    use super::*;

    fn tenants() -> Tenants {
        let sha = |k: &str| hex(ring::digest::digest(&ring::digest::SHA256, k.as_bytes()).as_ref());
        let cfg: Vec<TenantConfig> = serde_json::from_value(json!([
            {"name": "a", "api_key_sha256": sha("key-a")},
            {"name": "ops", "api_key_sha256": sha("key-ops"), "admin": true},
        ]))
        .unwrap();
        Tenants::load(&cfg).unwrap()
    }

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    /// `values`: the Authorization headers sent; `want`: the tenant's name, or the
    /// refusal's status.
    #[track_caller]
    fn check(values: &[&[u8]], want: Result<&str, u16>) {
        let t = tenants();
        let mut h = HeaderMap::new();
        for v in values {
            h.append(AUTHORIZATION, HeaderValue::from_bytes(v).unwrap());
        }
        let got = authenticate(&t, &h).map(|c| t.get(c.tenant().unwrap()).unwrap().name.clone()).map_err(|e| {
            let text = e.body_json().to_string();
            assert!(!text.contains("key-"), "a key leaked into {text}");
            assert_eq!(e.code, "invalid_api_key");
            e.status.as_u16()
        });
        assert_eq!(got.as_deref().map_err(|s| *s), want, "{values:?}");
    }

    #[test]
    fn the_bearer_key_names_the_tenant_or_401() {
        check(&[b"Bearer key-a"], Ok("a"));
        check(&[b"bearer   key-ops "], Ok("ops"));
        check(&[], Err(401));
        check(&[b"Bearer key-b"], Err(401));
        check(&[b"Bearer "], Err(401));
        check(&[b"Bearer"], Err(401));
        check(&[b"Basic a2V5LWE="], Err(401));
        check(&[b"key-a"], Err(401));
        check(&[b"Bearer key-a", b"Bearer key-a"], Err(401));
        check(&[b"Bearer \xff\xfekey-a"], Err(401));
        let huge = [b"Bearer ".as_slice(), &[b'k'; AUTHORIZATION_BYTES_MAX]].concat();
        check(&[&huge], Err(401));
    }

    #[test]
    fn without_tenants_the_gateway_is_open() {
        let mut h = HeaderMap::new();
        h.insert(AUTHORIZATION, HeaderValue::from_static("Bearer anything"));
        assert_eq!(authenticate(&Tenants::default(), &h), Ok(Caller::Open));
        assert_eq!(authenticate(&Tenants::default(), &HeaderMap::new()), Ok(Caller::Open));
    }
}
