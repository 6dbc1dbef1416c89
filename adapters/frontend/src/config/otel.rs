//! `[tracing]`: distributed tracing over OpenTelemetry, off unless the section is present.
//! The running side is [`crate::otel`].

use serde::Deserialize;

/// `[tracing]`: a span per proxied request, with children for its stages, exported over
/// OTLP/HTTP (protobuf) to a collector. W3C `traceparent`/`tracestate` are read from the
/// client and sent on to the worker.
#[derive(Clone, Debug, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TracingConfig {
    /// The collector's OTLP/HTTP base URL, e.g. `http://127.0.0.1:4318` (required); spans
    /// are posted to `<otlp_endpoint>/v1/traces`, or to the URL itself when it already
    /// ends in `/v1/traces`. An `https` collector is verified against `[upstream_tls]`.
    pub otlp_endpoint: String,
    /// Share of the traces this proxy starts that are recorded, 0 to 1 (default 1.0).
    /// A request carrying a `traceparent` follows its sampled flag instead.
    #[serde(default = "ratio_all")]
    pub sampling_ratio: f64,
    /// `service.name` of the exported spans (default `kvroute`).
    #[serde(default = "service_name")]
    pub service_name: String,
    /// Whether a request without a `traceparent` starts a trace of its own (default
    /// true); false traces only requests whose client is tracing.
    #[serde(default = "yes")]
    pub start_traces: bool,
    /// Time between exports of finished spans, in ms (default 5,000).
    #[serde(default = "export_interval_ms")]
    pub export_interval_ms: u64,
    /// Time one export may take, in ms (default 10,000); a late export is dropped.
    #[serde(default = "export_timeout_ms")]
    pub export_timeout_ms: u64,
    /// Finished spans held for export (default 2,048); more are dropped and counted.
    #[serde(default = "spans_queued_max")]
    pub spans_queued_max: usize,
}

fn ratio_all() -> f64 {
    1.0
}
fn service_name() -> String {
    "kvroute".into()
}
fn yes() -> bool {
    true
}
fn export_interval_ms() -> u64 {
    5_000
}
fn export_timeout_ms() -> u64 {
    10_000
}
fn spans_queued_max() -> usize {
    2_048
}

impl TracingConfig {
    /// A section exporting to `otlp_endpoint` with every other key at its default.
    pub fn new(otlp_endpoint: impl Into<String>) -> Self {
        TracingConfig {
            otlp_endpoint: otlp_endpoint.into(),
            sampling_ratio: ratio_all(),
            service_name: service_name(),
            start_traces: yes(),
            export_interval_ms: export_interval_ms(),
            export_timeout_ms: export_timeout_ms(),
            spans_queued_max: spans_queued_max(),
        }
    }

    /// Where spans are posted: the endpoint with `/v1/traces` appended unless it ends so.
    pub fn traces_url(&self) -> String {
        let base = self.otlp_endpoint.trim_end_matches('/');
        if base.ends_with("/v1/traces") {
            base.to_string()
        } else {
            format!("{base}/v1/traces")
        }
    }

    /// What types alone cannot check: the key (under `tracing.`) and what is wrong.
    pub fn check(&self) -> Result<(), (&'static str, String)> {
        if !(0.0..=1.0).contains(&self.sampling_ratio) {
            return Err(("tracing.sampling_ratio", format!("{} is not between 0 and 1", self.sampling_ratio)));
        }
        match self.traces_url().parse::<http::Uri>() {
            Ok(u) if matches!(u.scheme_str(), Some("http" | "https")) && u.authority().is_some() => {}
            _ => {
                let message = format!("{:?} is not an http:// or https://host:port URL", self.otlp_endpoint);
                return Err(("tracing.otlp_endpoint", message));
            }
        }
        if self.service_name.is_empty() {
            return Err(("tracing.service_name", "must not be empty".into()));
        }
        if self.export_interval_ms == 0 || self.export_timeout_ms == 0 || self.spans_queued_max == 0 {
            let message = "export_interval_ms, export_timeout_ms and spans_queued_max must be above 0".into();
            return Err(("tracing", message));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::TracingConfig;
    use crate::ProxyConfig;

    /// `[tracing]` with `body`: the loaded section, or the key the error names.
    #[track_caller]
    fn check(body: &str, want: Result<(&str, f64, &str, bool), &str>) {
        let got = ProxyConfig::from_toml_str(&format!("[tracing]\n{body}\n"));
        match (got, want) {
            (Ok(cfg), Ok((url, ratio, service, start))) => {
                let t = cfg.tracing.expect("the section is present");
                assert_eq!(
                    (t.traces_url().as_str(), t.sampling_ratio, t.service_name.as_str(), t.start_traces),
                    (url, ratio, service, start)
                );
            }
            (Err(e), Err(key)) => assert!(e.to_string().starts_with(key), "{body}: {e}"),
            (got, want) => panic!("{body}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn the_section_is_read_and_checked() {
        let url = "http://127.0.0.1:4318/v1/traces";
        check("otlp_endpoint = \"http://127.0.0.1:4318\"", Ok((url, 1.0, "kvroute", true)));
        check("otlp_endpoint = \"http://127.0.0.1:4318/\"", Ok((url, 1.0, "kvroute", true)));
        check("otlp_endpoint = \"http://127.0.0.1:4318/v1/traces\"", Ok((url, 1.0, "kvroute", true)));
        check(
            "otlp_endpoint = \"http://c:4318\"\nsampling_ratio = 0.1\nservice_name = \"gw\"\nstart_traces = false",
            Ok(("http://c:4318/v1/traces", 0.1, "gw", false)),
        );
        check("otlp_endpoint = \"http://c:4318\"\nsampling_ratio = 1.5", Err("tracing.sampling_ratio"));
        check("otlp_endpoint = \"http://c:4318\"\nsampling_ratio = -0.1", Err("tracing.sampling_ratio"));
        check("otlp_endpoint = \"http://c:4318\"\nsampling_ratio = nan", Err("tracing.sampling_ratio"));
        check("otlp_endpoint = \"https://c:4318\"", Ok(("https://c:4318/v1/traces", 1.0, "kvroute", true)));
        check("otlp_endpoint = \"grpc://c:4317\"", Err("tracing.otlp_endpoint"));
        check("otlp_endpoint = \"c 4318\"", Err("tracing.otlp_endpoint"));
        check("otlp_endpoint = \"http://c:4318\"\nservice_name = \"\"", Err("tracing.service_name"));
        check("otlp_endpoint = \"http://c:4318\"\nexport_interval_ms = 0", Err("tracing"));
        // Unknown keys and a missing endpoint are parse errors naming the line.
        check("otlp_endpoint = \"http://c:4318\"\nratio = 0.5", Err("line 3"));
        check("sampling_ratio = 0.5", Err("line 1"));
    }

    #[test]
    fn tracing_is_off_by_default() {
        assert_eq!(ProxyConfig::default().tracing, None);
        assert_eq!(TracingConfig::new("http://c:4318").check(), Ok(()));
    }
}
