//! Fetching an image the operator allowed: under a prefix of `[media] url_allow` (same
//! scheme, `http` or `https`, same host and port, path under the prefix's), one GET with
//! no redirect followed, bounded in bytes and time. Nothing else is ever fetched. An
//! `https` host is verified against `[media] ca_path`, else the system's roots.

use std::path::PathBuf;
use std::sync::OnceLock;
use std::time::Duration;

use bytes::Bytes;
use http::{StatusCode, Uri};
use http_body_util::{BodyExt, Empty, Limited};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use kvroute_media::MediaError;

use super::MediaSection;
use crate::error::ApiError;
use crate::tls::{client_config, https_connector, HttpsConnector};

/// One allowed prefix: a scheme, an authority and a path prefix ending in `/`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(super) struct Prefix {
    https: bool,
    authority: String,
    path: String,
}

impl Prefix {
    /// `http(s)://host[:port]/path/`; anything else says why not.
    pub(super) fn parse(s: &str) -> Result<Self, String> {
        let uri: Uri = s.parse().map_err(|e| format!("{s:?} is not a URL: {e}"))?;
        let https = match uri.scheme_str() {
            Some("http") => false,
            Some("https") => true,
            _ => return Err(format!("{s:?}: only http:// and https:// prefixes can be fetched")),
        };
        let authority = uri.authority().ok_or_else(|| format!("{s:?} names no host"))?;
        if authority.as_str().contains('@') {
            return Err(format!("{s:?}: user info is not allowed"));
        }
        let path = uri.path();
        if !path.ends_with('/') || uri.query().is_some() || !s.ends_with('/') {
            return Err(format!("{s:?} must end its path with '/' (and have no query)"));
        }
        Ok(Prefix { https, authority: authority.as_str().to_ascii_lowercase(), path: path.to_owned() })
    }

    fn allows(&self, uri: &Uri) -> bool {
        let authority = uri.authority().map(|a| a.as_str().to_ascii_lowercase());
        uri.scheme_str() == Some(if self.https { "https" } else { "http" })
            && authority.as_deref() == Some(self.authority.as_str())
            && uri.path().starts_with(&self.path)
            && !uri.path().split('/').any(|seg| seg == "..")
    }
}

/// Fetches allowed images.
#[derive(Clone, Debug)]
pub struct Fetcher {
    allow: Vec<Prefix>,
    bytes_max: usize,
    timeout: Duration,
    ca_path: Option<PathBuf>,
    /// The client, made at the first fetch (most routers never fetch), or why TLS could
    /// not be set up (the configuration check refuses that, so it never happens serving).
    client: OnceLock<Result<Client<HttpsConnector, Empty<Bytes>>, String>>,
}

impl Fetcher {
    /// A fetcher for `section`'s prefixes and limits; prefixes that do not parse (which
    /// the configuration check refuses) allow nothing.
    pub fn new(section: &MediaSection) -> Self {
        Fetcher {
            allow: section.url_allow.iter().filter_map(|p| Prefix::parse(p).ok()).collect(),
            bytes_max: section.fetch_bytes_max,
            timeout: Duration::from_millis(section.fetch_timeout_ms),
            ca_path: section.ca_path.clone(),
            client: OnceLock::new(),
        }
    }

    fn client(&self) -> Result<&Client<HttpsConnector, Empty<Bytes>>, ApiError> {
        let made = self.client.get_or_init(|| {
            let mut conn = HttpConnector::new();
            conn.set_connect_timeout(Some(self.timeout));
            let tls = client_config(self.ca_path.as_deref()).map_err(|e| e.to_string())?;
            Ok(Client::builder(hyper_util::rt::TokioExecutor::new()).build(https_connector(conn, &tls)))
        });
        made.as_ref().map_err(|e| ApiError::image_fetch(e.clone()))
    }

    /// Whether `url` may be fetched.
    pub fn allows(&self, url: &str) -> bool {
        url.parse::<Uri>().is_ok_and(|uri| self.allow.iter().any(|p| p.allows(&uri)))
    }

    /// The body of `url`: 400 when it is not allowed or the fetch fails, 413 when it is
    /// larger than `fetch_bytes_max`.
    pub async fn fetch(&self, url: &str) -> Result<Bytes, ApiError> {
        if !self.allows(url) {
            return Err(ApiError::image_url_not_allowed());
        }
        let uri: Uri = url.parse().map_err(|_| ApiError::image_url_not_allowed())?;
        match tokio::time::timeout(self.timeout, self.get(uri)).await {
            Ok(r) => r,
            Err(_) => Err(ApiError::image_fetch(format!("no answer within {} ms", self.timeout.as_millis()))),
        }
    }

    async fn get(&self, uri: Uri) -> Result<Bytes, ApiError> {
        let resp = self.client()?.get(uri).await.map_err(|e| ApiError::image_fetch(crate::error::error_chain(&e)))?;
        if resp.status() != StatusCode::OK {
            return Err(ApiError::image_fetch(format!("status {}", resp.status())));
        }
        let too_large = |bytes| ApiError::media(&MediaError::TooLarge { bytes, bytes_max: self.bytes_max });
        let declared = resp.headers().get(http::header::CONTENT_LENGTH).and_then(|v| v.to_str().ok()?.parse().ok());
        if let Some(n) = declared.filter(|&n| n > self.bytes_max) {
            return Err(too_large(n));
        }
        match Limited::new(resp.into_body(), self.bytes_max).collect().await {
            Ok(body) => Ok(body.to_bytes()),
            Err(e) if e.is::<http_body_util::LengthLimitError>() => Err(too_large(self.bytes_max + 1)),
            Err(e) => Err(ApiError::image_fetch(e.to_string())),
        }
    }
}
