//! Engine load for the picker: the front end's scraper ([`kvroute_frontend::scrape`])
//! over a plain HTTP/1.1 client, so `[learn]` scraping works as in `kvroute serve`.

use bytes::Bytes;
use http_body_util::Full;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use kvroute_frontend::scrape::{post_request, read_page, Fetch, ScrapeError};

/// A client for the workers' metrics pages; cheap to clone.
#[derive(Clone)]
pub(crate) struct MetricsClient(Client<HttpConnector, Full<Bytes>>);

impl MetricsClient {
    pub(crate) fn new() -> Self {
        MetricsClient(Client::builder(TokioExecutor::new()).build_http())
    }
}

impl Fetch for MetricsClient {
    async fn get(&self, uri: http::Uri, bytes_max: usize) -> Result<Bytes, ScrapeError> {
        let req = http::Request::get(uri).body(Full::new(Bytes::new())).map_err(|_| ScrapeError::Unreachable)?;
        let resp = self.0.request(req).await.map_err(|_| ScrapeError::Unreachable)?;
        read_page(resp, bytes_max).await
    }

    async fn post(&self, uri: http::Uri, body: Bytes, bytes_max: usize) -> Result<Bytes, ScrapeError> {
        let resp = self.0.request(post_request(uri, body)?).await.map_err(|_| ScrapeError::Unreachable)?;
        read_page(resp, bytes_max).await
    }
}
