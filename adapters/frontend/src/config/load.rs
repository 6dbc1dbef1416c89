//! Loading and checking a [`ProxyConfig`], and turning it into router configs.

use std::collections::BTreeSet;

use router_core::{AffinityConfig, BlockSize, ClassLimits, RequestTokens, RouterConfig};

use super::*;

impl ProxyConfig {
    /// Parses and checks a TOML document.
    pub fn from_toml_str(text: &str) -> Result<Self, ConfigError> {
        let cfg: ProxyConfig = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Parses a TOML document, applies `overrides` (dotted keys such as
    /// `limits.body_bytes_max` with TOML values, bare words taken as strings), and checks
    /// the result. This is how command-line flags override a file.
    pub fn from_toml_with_overrides(text: &str, overrides: &[(&str, &str)]) -> Result<Self, ConfigError> {
        if overrides.is_empty() {
            return Self::from_toml_str(text);
        }
        let mut table: toml::Table = toml::from_str(text).map_err(|e| parse_error(text, &e))?;
        for (key, raw) in overrides {
            set_dotted(&mut table, key, override_value(raw))
                .map_err(|message| ConfigError::Invalid { key: (*key).to_string(), message })?;
        }
        let cfg: ProxyConfig = toml::Table::try_into(table).map_err(|e| ConfigError::Invalid {
            key: overrides.iter().map(|(k, _)| *k).collect::<Vec<_>>().join(", "),
            message: e.message().trim().to_string(),
        })?;
        cfg.validate()?;
        Ok(cfg)
    }

    /// Reads, parses and checks a TOML file.
    pub fn from_file(path: &Path) -> Result<Self, ConfigError> {
        let text = std::fs::read_to_string(path)
            .map_err(|source| ConfigError::Read { path: path.display().to_string(), source })?;
        Self::from_toml_str(&text)
    }

    /// Checks what types alone cannot: names unique, references resolved, sizes sane.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let invalid = |key: String, message: String| Err(ConfigError::Invalid { key, message });
        for (key, name) in [("session_header", &self.session_header), ("dp_rank_header", &self.dp_rank_header)] {
            if http::HeaderName::from_bytes(name.as_bytes()).is_err() {
                return invalid(key.into(), format!("{name:?} is not a valid header name"));
            }
        }
        if let Some(h) = &self.trust.token_header {
            if http::HeaderName::from_bytes(h.as_bytes()).is_err() {
                return invalid("trust.token_header".into(), format!("{h:?} is not a valid header name"));
            }
        }
        if self.trust.token.as_deref() == Some("") {
            return invalid("trust.token".into(), "must not be empty".into());
        }
        if self.limits.body_bytes_max == 0 || self.limits.concurrent_requests_max == 0 {
            return invalid("limits".into(), "body_bytes_max and concurrent_requests_max must be above 0".into());
        }
        if self.limits.connections_max == 0 || self.limits.session_id_bytes_max == 0 {
            return invalid("limits".into(), "connections_max and session_id_bytes_max must be above 0".into());
        }
        if self.limits.connection_buffer_bytes_max < 8192 {
            return invalid("limits.connection_buffer_bytes_max".into(), "must be at least 8192".into());
        }
        if let Err((key, message)) = self.learn.check() {
            return invalid(key.into(), message);
        }
        if let Err((key, message)) = self.media.check() {
            return invalid(key, message);
        }
        if let Err((key, message)) = self.discovery.check(self.models.iter().map(|m| m.name.as_str())) {
            return invalid(key, message);
        }
        if let Some(Err((key, message))) = self.tracing.as_ref().map(super::TracingConfig::check) {
            return invalid(key.into(), message);
        }
        for checked in [self.tls.as_ref().map_or(Ok(()), TlsConfig::check), self.upstream_tls.check()] {
            if let Err((key, message)) = checked {
                return invalid(key.into(), message);
            }
        }
        if !self.health_check.path.starts_with('/') {
            return invalid("health_check.path".into(), "must start with /".into());
        }
        if BlockSize::new(self.router.block_size).is_err() {
            return invalid(
                "router.block_size".into(),
                format!("{} is not a valid block size", self.router.block_size),
            );
        }
        for (key, v) in
            [("cold_ms_per_idle_s", self.router.cold_ms_per_idle_s), ("cold_ms_max", self.router.cold_ms_max)]
        {
            if let Some(v) = v.filter(|v| !(v.is_finite() && *v >= 0.0)) {
                return invalid(format!("router.{key}"), format!("{v} must be finite and not negative"));
            }
        }
        let share = self.router.overdue_pass_share;
        if !(0.0..=1.0).contains(&share) {
            return invalid("router.overdue_pass_share".into(), format!("{share} must be from 0 to 1"));
        }
        let mut names = BTreeSet::new();
        for (i, m) in self.models.iter().enumerate() {
            if let Some(bs) = m.block_size {
                if BlockSize::new(bs).is_err() {
                    return invalid(format!("models[{i}].block_size"), format!("{bs} is not a valid block size"));
                }
            }
            if m.disagg_protocol.is_none() && m.disagg_isl_min_tokens.is_some() {
                return invalid(format!("models[{i}].disagg_isl_min_tokens"), "needs disagg_protocol".into());
            }
            if m.forward_token_ids && m.tokenizer.is_none() {
                return invalid(format!("models[{i}].forward_token_ids"), "needs tokenizer".into());
            }
            if m.tokenizer_words_max.is_some() && m.tokenizer.is_none() {
                return invalid(format!("models[{i}].tokenizer_words_max"), "needs tokenizer".into());
            }
            if m.disagg_protocol.is_none() && m.disagg_same_label.is_some() {
                return invalid(format!("models[{i}].disagg_same_label"), "needs disagg_protocol".into());
            }
            for name in std::iter::once(&m.name).chain(&m.lora_adapters) {
                if name.is_empty() || !names.insert(name.as_str()) {
                    return invalid(
                        format!("models[{i}]"),
                        format!("model or adapter name {name:?} is empty or repeated"),
                    );
                }
            }
        }
        if let Some(d) = &self.default_model {
            if !self.models.iter().any(|m| &m.name == d) {
                return invalid("default_model".into(), format!("{d:?} is not a configured model"));
            }
        }
        for (i, t) in self.tenants.iter().enumerate() {
            if let Some(m) = t.models.iter().find(|m| !self.models.iter().any(|c| &c.name == *m)) {
                return invalid(format!("tenants[{i}].models"), format!("{m:?} is not a configured model"));
            }
        }
        let mut ids = BTreeSet::new();
        for (i, w) in self.workers.iter().enumerate() {
            if !ids.insert(w.id) {
                return invalid(format!("workers[{i}].id"), format!("worker id {} is repeated", w.id));
            }
            self.check_worker(w)
                .map_err(|(k, m)| ConfigError::Invalid { key: format!("workers[{i}].{k}"), message: m })?;
        }
        crate::tenants::check(&self.tenants).map_err(ConfigError::Tenant)?;
        if let Some(r) = &self.replica {
            if let Err(kvroute_replica::ReplicaStartError::Invalid { option, message }) = r.options().validate() {
                return invalid(format!("replica.{option}"), message);
            }
            if r.replica_silence_max_ms <= r.heartbeat_ms {
                return invalid("replica.replica_silence_max_ms".into(), "must be longer than heartbeat_ms".into());
            }
        }
        Ok(())
    }

    /// Checks one worker against the models (also used by `POST /workers`).
    pub fn check_worker(&self, w: &WorkerConfig) -> Result<(), (&'static str, String)> {
        let Some(model) = self.models.iter().find(|m| m.name == w.model) else {
            return Err(("model", format!("{:?} is not a configured model", w.model)));
        };
        if w.dp_ranks == 0 || w.weight == 0 {
            return Err(("dp_ranks", "dp_ranks and weight must be at least 1".into()));
        }
        check_disagg(model.disagg_protocol, w)
    }
}

/// A prefill worker needs a protocol that drives it, and SGLang's its bootstrap port.
fn check_disagg(protocol: Option<DisaggProtocol>, w: &WorkerConfig) -> Result<(), (&'static str, String)> {
    let prefill = w.role == WorkerRole::Prefill;
    if prefill && protocol.is_none() {
        return Err(("role", format!("prefill workers need models.disagg_protocol for model {:?}", w.model)));
    }
    match w.bootstrap_port {
        Some(_) if !prefill => Err(("bootstrap_port", "only prefill workers have a bootstrap port".into())),
        Some(0) => Err(("bootstrap_port", "must be a port above 0".into())),
        None if prefill && protocol == Some(DisaggProtocol::SglangBootstrap) => {
            Err(("bootstrap_port", "prefill workers of a sglang-bootstrap model need one".into()))
        }
        _ => Ok(()),
    }
}

pub(super) fn parse_error(text: &str, e: &toml::de::Error) -> ConfigError {
    let line = e.span().map(|s| text[..s.start.min(text.len())].matches('\n').count() + 1);
    let source_line = line.and_then(|l| text.lines().nth(l - 1)).unwrap_or("").trim().to_string();
    ConfigError::Parse { line, source_line, message: e.message().trim().to_string() }
}

/// A flag's value as TOML (`1024`, `true`, `["a"]`), or a plain string.
pub(super) fn override_value(raw: &str) -> toml::Value {
    toml::from_str::<toml::Table>(&format!("v = {raw}"))
        .ok()
        .and_then(|mut t| t.remove("v"))
        .unwrap_or_else(|| toml::Value::String(raw.to_string()))
}

pub(super) fn set_dotted(table: &mut toml::Table, key: &str, value: toml::Value) -> Result<(), String> {
    let mut parts: Vec<&str> = key.split('.').collect();
    let last = parts.pop().filter(|l| !l.is_empty()).ok_or("empty key")?;
    let mut t = table;
    for p in parts {
        let entry = t.entry(p.to_string()).or_insert_with(|| toml::Value::Table(toml::Table::new()));
        t = entry.as_table_mut().ok_or_else(|| format!("{p} is not a table"))?;
    }
    t.insert(last.to_string(), value);
    Ok(())
}

/// The router configuration of one model. `seed` salts the hash tables so clients
/// cannot aim session ids or blocks at one bucket.
pub fn router_config(cfg: &ProxyConfig, model: &ModelConfig, seed: u64) -> RouterConfig {
    let r = &cfg.router;
    let mut rc = RouterConfig {
        mode: model.mode.unwrap_or(r.mode),
        block_size: BlockSize::new(model.block_size.unwrap_or(r.block_size)).unwrap_or(BlockSize::DEFAULT),
        approximate: r.approximate,
        // Without a tokenizer the request tokens are the byte fallback's, which a real
        // engine's KV events never match.
        request_tokens: if model.tokenizer.is_some() { RequestTokens::Engine } else { RequestTokens::Estimated },
        requests_max: r.requests_max,
        prompt_ends_max: r.prompt_ends_max,
        ..RouterConfig::default()
    };
    rc.cost.overlap_credit = r.overlap_credit;
    rc.cost.prefill_load_scale = r.prefill_load_scale;
    rc.cost.active_request_weight = r.active_request_weight;
    rc.cost.ttft.overdue_pass_share = r.overdue_pass_share;
    rc.cost.ttft.excess_ms_per_request = r.excess_ms_per_request;
    rc.cost.ttft.excess_over_mean = r.excess_over_mean;
    rc.cost.ttft.excess_requests_min = r.excess_requests_min;
    rc.cost.ttft.excess_floor_mean_requests = r.excess_floor_mean_requests;
    rc.cost.ttft.memory_ms_per_block = r.memory_ms_per_block;
    rc.cost.temperature = r.temperature;
    rc.cost.timing = r.engine_timing.model();
    rc.cost.timing.cold_ms_per_idle_s = r.cold_ms_per_idle_s.unwrap_or(rc.cost.timing.cold_ms_per_idle_s);
    rc.cost.timing.cold_ms_max = r.cold_ms_max.unwrap_or(rc.cost.timing.cold_ms_max);
    rc.learn = cfg.learn.core();
    rc.queue.order = r.queue_order.0;
    rc.queue.queued_max = r.queued_max;
    rc.queue.queue_timeout_ms = r.queue_timeout_ms;
    rc.queue.classes = r
        .classes
        .iter()
        .map(|c| ClassLimits {
            queued_requests_max: c.queued_requests_max,
            queued_prompt_tokens_max: c.queued_prompt_tokens_max,
            ..ClassLimits::unlimited(&c.name)
        })
        .collect();
    rc.affinity = AffinityConfig {
        sessions_max: r.sessions_max,
        lease_ttl_ms: r.lease_ttl_ms,
        mode: r.affinity_mode.0,
        hash_seed: seed,
        session_id_bytes_max: cfg.limits.session_id_bytes_max,
        ..AffinityConfig::default()
    };
    rc.load.request_age_max_ms = r.request_age_max_ms;
    rc.load.hash_seed = seed.rotate_left(17);
    rc.index.hash_seed = seed.rotate_left(31);
    rc.approx.hash_seed = seed.rotate_left(47);
    rc.eligibility.prefill_tokens_max = (r.prefill_tokens_max > 0).then_some(r.prefill_tokens_max);
    rc.eligibility.prefill_tokens_frac_of_batch =
        (r.prefill_tokens_frac_of_batch > 0.0).then_some(r.prefill_tokens_frac_of_batch);
    rc.eligibility.decode_blocks_frac_of_kv = (r.decode_blocks_frac_of_kv > 0.0).then_some(r.decode_blocks_frac_of_kv);
    if let Some(n) = model.disagg_isl_min_tokens {
        rc.disagg.isl_min_tokens = n;
    }
    if let Some(rep) = &cfg.replica {
        rc.replica.id = Some(kvroute_replica::replica_id(&rep.id));
        rc.replica.remote.replica_silence_max_ms = rep.replica_silence_max_ms;
        rc.replica.remote.remote_requests_max = rep.remote_requests_max;
        rc.replica.remote.request_age_max_ms = r.request_age_max_ms;
        rc.replica.remote.hash_seed = seed.rotate_left(53);
    }
    rc
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check_err(text: &str, want_line: Option<usize>, want_in_message: &str) {
        let e = ProxyConfig::from_toml_str(text).unwrap_err();
        let shown = e.to_string();
        assert!(shown.contains(want_in_message), "{shown:?} should mention {want_in_message:?}");
        if let ConfigError::Parse { line, .. } = e {
            assert_eq!(line, want_line, "{shown}");
        }
    }

    #[test]
    fn errors_name_the_key_and_line() {
        let m = "[[models]]\nname = \"m\"\n";
        check_err("listen = \"127.0.0.1:1\"\nbogus = 1\n", Some(2), "bogus");
        check_err("[limits]\nbody_bytes_max = \"big\"\n", Some(2), "body_bytes_max");
        check_err("[router]\nmode = \"fastest\"\n", Some(2), "mode");
        check_err("[trust]\ncidrs = [\"10.0.0.0/33\"]\n", Some(2), "cidrs");
        check_err(&format!("{m}[[workers]]\nid = 1\nurl = \"ftp://x:1\"\nmodel = \"m\"\n"), Some(5), "https://");
        check_err(
            &format!("{m}[[workers]]\nid = 1\nurl = \"http://x:1\"\nmodel = \"other\"\n"),
            None,
            "workers[0].model",
        );
        check_err(
            &format!("{m}[[workers]]\nid = 1\nurl = \"http://x:1\"\nmodel = \"m\"\n[[workers]]\nid = 1\nurl = \"http://y:1\"\nmodel = \"m\"\n"),
            None,
            "workers[1].id",
        );
        check_err("[router]\nblock_size = 0\n", None, "router.block_size");
        check_err("[limits]\nconnection_buffer_bytes_max = 100\n", None, "connection_buffer_bytes_max");
        check_err("[limits]\nconnections_max = 0\n", None, "connections_max");
        check_err("[[models]]\nname = \"m\"\nforward_token_ids = true\n", None, "models[0].forward_token_ids");
        check_err("[[models]]\nname = \"m\"\ntokenizer_words_max = 0\n", None, "models[0].tokenizer_words_max");
    }

    #[test]
    fn engine_timing_picks_the_cost_models_coefficients() {
        let m = ModelConfig { name: "m".into(), ..ModelConfig::default() };
        let timing = |text: &str| router_config(&ProxyConfig::from_toml_str(text).unwrap(), &m, 0).cost.timing;
        assert_eq!(timing(""), router_core::TtftModel::default());
        assert_eq!(timing("[router]\nengine_timing = \"vllm-cpu\"\n"), router_core::TtftModel::vllm_cpu());
        check_err("[router]\nengine_timing = \"tpu\"\n", Some(2), "expected gpu or vllm-cpu");
        let cold = |text: &str| {
            let t = timing(text);
            (t.cold_ms_per_idle_s, t.cold_ms_max)
        };
        assert_eq!(cold(""), (0.0, 0.0));
        assert_eq!(cold("[router]\nengine_timing = \"vllm-cpu\"\n"), (20.0, 250.0));
        assert_eq!(cold("[router]\nengine_timing = \"vllm-cpu\"\ncold_ms_max = 100.0\n"), (20.0, 100.0));
        assert_eq!(cold("[router]\ncold_ms_per_idle_s = 5.0\ncold_ms_max = 50.0\n"), (5.0, 50.0));
        check_err("[router]\ncold_ms_max = -1.0\n", None, "router.cold_ms_max");
        check_err("[router]\ncold_ms_per_idle_s = nan\n", None, "router.cold_ms_per_idle_s");
    }

    #[test]
    fn the_overdue_share_is_the_cores_unless_set_and_is_a_share() {
        let m = ModelConfig { name: "m".into(), ..ModelConfig::default() };
        let share =
            |text: &str| router_config(&ProxyConfig::from_toml_str(text).unwrap(), &m, 0).cost.ttft.overdue_pass_share;
        assert_eq!(share(""), router_core::TtftWeights::default().overdue_pass_share);
        assert_eq!(share("[router]\noverdue_pass_share = 1.0\n"), 1.0);
        assert_eq!(share("[router]\noverdue_pass_share = 0.0\n"), 0.0);
        for bad in ["1.5", "-0.1", "nan", "inf"] {
            check_err(&format!("[router]\noverdue_pass_share = {bad}\n"), None, "router.overdue_pass_share");
        }
    }

    #[test]
    fn the_memory_charge_is_the_cores_unless_set() {
        let m = ModelConfig { name: "m".into(), ..ModelConfig::default() };
        let ms = |text: &str| router_config(&ProxyConfig::from_toml_str(text).unwrap(), &m, 0).cost.ttft;
        assert_eq!(ms("").memory_ms_per_block, router_core::TtftWeights::default().memory_ms_per_block);
        assert_eq!(ms("[router]\nmemory_ms_per_block = 10.0\n").memory_ms_per_block, 10.0);
        check_err("[router]\nmemory_ms_per_block = \"x\"\n", Some(2), "memory_ms_per_block");
    }

    #[test]
    fn disaggregation_keys_are_checked() {
        let model = |protocol: &str| format!("[[models]]\nname = \"m\"\n{protocol}");
        let worker = |extra: &str| format!("[[workers]]\nid = 1\nurl = \"http://x:1\"\nmodel = \"m\"\n{extra}");
        let nixl = model("disagg_protocol = \"vllm-nixl\"\n");
        let sglang = model("disagg_protocol = \"sglang-bootstrap\"\n");
        let ok = |text: String| ProxyConfig::from_toml_str(&text).map(|_| ()).map_err(|e| e.to_string());
        check_err(&model("disagg_protocol = \"nccl\"\n"), Some(3), "disagg_protocol");
        check_err(&model("disagg_isl_min_tokens = 10\n"), None, "models[0].disagg_isl_min_tokens");
        check_err(&model("disagg_same_label = \"node\"\n"), None, "models[0].disagg_same_label");
        check_err(&model("disagg_bogus = 1\n"), Some(3), "disagg_bogus");
        check_err(&format!("{}{}", model(""), worker("role = \"prefill\"\n")), None, "workers[0].role");
        check_err(&format!("{sglang}{}", worker("role = \"prefill\"\n")), None, "workers[0].bootstrap_port");
        check_err(&format!("{nixl}{}", worker("bootstrap_port = 9\n")), None, "workers[0].bootstrap_port");
        check_err(&format!("{sglang}{}", worker("role = \"prefill\"\nbootstrap_port = 0\n")), None, "bootstrap_port");
        assert_eq!(ok(format!("{nixl}{}", worker("role = \"prefill\"\n"))), Ok(()));
        assert_eq!(ok(format!("{sglang}{}", worker("role = \"prefill\"\nbootstrap_port = 9\n"))), Ok(()));
        assert_eq!(ok(format!("{sglang}{}", worker("role = \"decode\"\n"))), Ok(()));
        let cfg =
            ProxyConfig::from_toml_str(&model("disagg_protocol = \"vllm-nixl\"\ndisagg_isl_min_tokens = 7\n")).unwrap();
        assert_eq!(cfg.models[0].disagg_protocol, Some(DisaggProtocol::VllmNixl));
        assert_eq!(router_config(&cfg, &cfg.models[0], 0).disagg.isl_min_tokens, 7);
    }

    #[test]
    fn the_example_file_loads() {
        let cfg = ProxyConfig::from_toml_str(include_str!("../../kvroute.example.toml")).unwrap();
        assert!(!cfg.models.is_empty() && !cfg.workers.is_empty());
        assert_eq!(cfg.limits.body_bytes_max, 8 << 20);
        assert_eq!(cfg.learn, crate::learn::LearnSection::default(), "the example lists the defaults");
    }

    #[test]
    fn learn_settings_reach_the_router_and_are_checked() {
        let cfg = ProxyConfig::from_toml_str(&format!(
            "{}[learn]\ncosts = true\nsamples_min = 3\nhalf_life_ms = 5\ndoubt_scale_min = 4.0\n",
            "[[models]]\nname = \"m\"\n"
        ))
        .unwrap();
        let learn = router_config(&cfg, &cfg.models[0], 0).learn;
        assert_eq!((learn.costs, learn.engine_load, learn.samples_min, learn.half_life_ms), (true, false, 3, 5));
        assert_eq!(learn.doubt_scale_min, 4.0);
        for bad in [
            "engine_load = true",
            "outlier_ratio_max = 0.5",
            "metrics_path = \"metrics\"",
            "tokenize_path = \"tokenize\"",
            "scrape_timeout_ms = 0",
            "doubt_scale_min = 0.5",
            "doubt_scale_min = -1.0",
            "doubt_scale_min = inf",
        ] {
            let e = ProxyConfig::from_toml_str(&format!("[learn]\n{bad}\n")).unwrap_err();
            assert!(e.to_string().contains("learn."), "{bad}: {e}");
        }
    }

    #[test]
    fn flags_override_the_file() {
        let file = "listen = \"127.0.0.1:1\"\n[limits]\nbody_bytes_max = 10\n";
        let overrides =
            [("limits.body_bytes_max", "2048"), ("router.mode", "round-robin"), ("trust.cidrs", "[\"10.0.0.0/8\"]")];
        let cfg = ProxyConfig::from_toml_with_overrides(file, &overrides).unwrap();
        assert_eq!(cfg.limits.body_bytes_max, 2048);
        assert_eq!(cfg.router.mode, RouterMode::RoundRobin);
        assert_eq!(cfg.trust.cidrs.len(), 1);
        assert_eq!(cfg.listen.port(), 1, "keys not overridden keep the file's values");
        let e = ProxyConfig::from_toml_with_overrides(file, &[("limits.bogus", "1")]).unwrap_err();
        assert!(e.to_string().contains("bogus"), "{e}");
        let e = ProxyConfig::from_toml_with_overrides(file, &[("listen.port", "1")]).unwrap_err();
        assert!(e.to_string().contains("listen"), "{e}");
    }

    #[test]
    fn the_replica_section_is_optional_and_checked() {
        let cfg = ProxyConfig::from_toml_str("[replica]\nid = \"a\"\n").unwrap();
        let r = cfg.replica.expect("a replica section");
        assert_eq!(
            (r.nats_url.as_str(), r.cluster.as_str(), r.heartbeat_ms),
            ("nats://127.0.0.1:4222", "default", 1_000)
        );
        check_err("[replica]\nnats_url = \"nats://x:1\"\n", Some(1), "id");
        check_err("[replica]\nid = \"a\"\ncluster = \"a.b\"\n", None, "replica.cluster");
        check_err("[replica]\nid = \"a\"\nheartbeat_ms = 5000\n", None, "replica.replica_silence_max_ms");
        check_err("[replica]\nid = \"a\"\nbogus = 1\n", Some(3), "bogus");
    }

    #[test]
    fn an_empty_file_is_the_default() {
        assert_eq!(ProxyConfig::from_toml_str("").unwrap(), ProxyConfig::default());
    }
}
