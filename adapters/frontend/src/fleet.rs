//! The fleet: one pool (a driver over its own router) per configured model, the names
//! clients may use for each, and the worker registry with each worker's URL.
//!
//! The set of pools is fixed at startup; workers come and go through the admin API.
//! The registry and the pools' routers agree because both change under the registry's
//! write lock.

use std::collections::BTreeMap;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, PoisonError, RwLock};

use kvroute_driver::{DriveError, Driver, DriverConfig};
use router_core::{BlockSize, WorkerId};

use crate::agree::Verdicts;
use crate::config::{router_config, ConfigError, DisaggProtocol, ProxyConfig, WorkerConfig};
use crate::tenants::Tenants;

/// One model's workers and router.
pub struct Pool {
    /// The model name (also its metrics label).
    pub name: String,
    /// The model's router.
    pub driver: Driver,
    /// Tokens per KV block for this model.
    pub block_size: BlockSize,
    /// How requests split across prefill and decode workers; `None` serves every
    /// request aggregated.
    pub disagg: Option<DisaggProtocol>,
    /// The topology label a split request's decode worker shares with its prefill worker.
    pub disagg_same_label: Option<String>,
    /// Whether the model has a `tokenizer`: without one, prompts hash on the byte
    /// fallback, which a real engine's KV events never match.
    pub tokenizer: bool,
    /// Whether a completion's text prompt is sent on as its token ids
    /// (`ModelConfig::forward_token_ids`); never for a split model.
    pub forward_token_ids: bool,
    /// Set once the missing-tokenizer warning was logged for this model.
    tokenizer_warned: AtomicBool,
}

/// Pools, model names and workers.
pub struct Fleet {
    pools: BTreeMap<String, Arc<Pool>>,
    /// Name a client may send → (pool, LoRA adapter it names).
    names: BTreeMap<String, (String, Option<String>)>,
    default_model: Option<String>,
    workers: RwLock<BTreeMap<u64, Arc<WorkerConfig>>>,
    /// Whether each worker tokenizes as the router does (see [`crate::agree`]).
    verdicts: Verdicts,
    /// The process's seed, from which every seeded table derives its own.
    seed: u64,
}

/// Why a worker could not be added.
#[derive(Debug)]
#[non_exhaustive]
pub enum FleetError {
    /// The worker names a model that is not configured.
    UnknownModel {
        /// The model it names.
        model: String,
    },
    /// The worker does not fit its model's configuration (roles, ranks, bootstrap port).
    Invalid(ConfigError),
    /// The model's router refused the worker.
    Router(DriveError),
}

impl fmt::Display for FleetError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            FleetError::UnknownModel { model } => write!(f, "{model:?} is not a configured model"),
            FleetError::Invalid(e) => write!(f, "{e}"),
            FleetError::Router(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for FleetError {
    fn source(&self) -> Option<&(dyn std::error::Error + 'static)> {
        match self {
            FleetError::UnknownModel { .. } => None,
            FleetError::Invalid(e) => Some(e),
            FleetError::Router(e) => Some(e),
        }
    }
}

impl Fleet {
    /// A seed for `purpose`'s hash tables, derived from the process's seed.
    pub fn seed_for(&self, purpose: u32) -> u64 {
        self.seed.rotate_left(purpose % 64) ^ u64::from(purpose).wrapping_mul(0x9E37_79B9_7F4A_7C15)
    }

    /// Pools for every model, without workers. Needs a tokio runtime (drivers spawn their
    /// timers).
    pub fn new(cfg: &ProxyConfig, seed: u64) -> Self {
        Self::with_tenants(cfg, seed, &Tenants::default())
    }

    /// [`Fleet::new`], with each pool's admission queue weighing `tenants`' requests.
    pub fn with_tenants(cfg: &ProxyConfig, seed: u64, tenants: &Tenants) -> Self {
        let mut pools = BTreeMap::new();
        let mut names = BTreeMap::new();
        for (i, m) in cfg.models.iter().enumerate() {
            let pool_seed = seed.wrapping_add((i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
            let mut router = router_config(cfg, m, pool_seed);
            if !tenants.is_empty() {
                tenants.apply_to_queue(&mut router.queue);
            }
            let block_size = router.block_size;
            let driver = Driver::new(DriverConfig { router, draw_seed: pool_seed });
            pools.insert(
                m.name.clone(),
                Arc::new(Pool {
                    name: m.name.clone(),
                    driver,
                    block_size,
                    disagg: m.disagg_protocol,
                    disagg_same_label: m.disagg_same_label.clone(),
                    tokenizer: m.tokenizer.is_some(),
                    forward_token_ids: m.forward_token_ids && m.disagg_protocol.is_none(),
                    tokenizer_warned: AtomicBool::new(false),
                }),
            );
            names.insert(m.name.clone(), (m.name.clone(), None));
            for a in &m.lora_adapters {
                names.insert(a.clone(), (m.name.clone(), Some(a.clone())));
            }
        }
        Fleet {
            pools,
            names,
            default_model: cfg.default_model.clone(),
            workers: RwLock::new(BTreeMap::new()),
            verdicts: Verdicts::default(),
            seed,
        }
    }

    /// The pool serving `model` and the LoRA adapter it names, falling back to the
    /// default model for unknown names.
    pub fn resolve(&self, model: &str) -> Option<(&Arc<Pool>, Option<&str>)> {
        let (pool, lora) = match self.names.get(model) {
            Some((p, l)) => (p.as_str(), l.as_deref()),
            None => (self.default_model.as_deref()?, None),
        };
        Some((self.pools.get(pool)?, lora))
    }

    /// A pool by model name.
    pub fn pool(&self, name: &str) -> Option<&Arc<Pool>> {
        self.pools.get(name)
    }

    /// Every pool, in name order.
    pub fn pools(&self) -> impl Iterator<Item = &Arc<Pool>> {
        self.pools.values()
    }

    /// Every name clients may use: models and adapters.
    pub fn model_names(&self) -> impl Iterator<Item = &str> {
        self.names.keys().map(String::as_str)
    }

    /// A worker's configuration.
    pub fn worker(&self, id: u64) -> Option<Arc<WorkerConfig>> {
        self.read().get(&id).cloned()
    }

    /// Every worker, in id order.
    pub fn workers(&self) -> Vec<Arc<WorkerConfig>> {
        self.read().values().cloned().collect()
    }

    /// Ids of `model`'s workers, in id order.
    pub fn worker_ids(&self, model: &str) -> Vec<WorkerId> {
        self.read().values().filter(|w| w.model == model).map(|w| WorkerId(w.id)).collect()
    }

    /// Adds a worker, or replaces one with the same id (moving it between pools if its
    /// model changed). Returns whether it is new.
    pub fn add_worker(&self, w: WorkerConfig) -> Result<bool, FleetError> {
        let Some(pool) = self.pools.get(&w.model) else {
            return Err(FleetError::UnknownModel { model: w.model.clone() });
        };
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        let (id, spec) = (w.id, w.spec());
        let (model, publishes) = (w.model.clone(), w.kv_events.is_some());
        // The configuration goes in before the router sees the worker, and leaves after
        // it stops seeing it: a snapshot taken between the two never lists a worker
        // without its configuration.
        let old = workers.insert(id, Arc::new(w));
        if let Err(e) = pool.driver.upsert_worker(spec) {
            match old {
                Some(o) => workers.insert(id, o),
                None => workers.remove(&id),
            };
            return Err(FleetError::Router(e));
        }
        // A worker replaced at another address or model is checked afresh.
        if old.as_ref().is_some_and(|o| o.url != workers[&id].url || o.model != model) {
            self.verdicts.forget(id);
            pool.driver.set_worker_tokens(WorkerId(id), true);
        }
        if let Some(old) = old.as_ref().filter(|o| o.model != model) {
            if let Some(p) = self.pools.get(&old.model) {
                let _ = p.driver.remove_worker(WorkerId(id));
            }
        }
        // Workers join from the config, the admin API and discovery alike: warn on the
        // first one whose events cannot match, whichever way it came.
        if publishes && !pool.tokenizer && !pool.tokenizer_warned.swap(true, Ordering::Relaxed) {
            tracing::warn!("{}", crate::tokenize::tokenizer_missing_warning(&model));
        }
        Ok(old.is_none())
    }

    /// Whether `model` has no tokenizer while one of its workers publishes KV events:
    /// those events match the router's fallback tokens only for workers that tokenize
    /// the same way (`kvroute sim-worker` does; a real engine never does), so the model
    /// routes on predictions from the router's own decisions.
    pub fn tokenizer_missing(&self, model: &str) -> bool {
        let has_tokenizer = self.pools.get(model).is_none_or(|p| p.tokenizer);
        !has_tokenizer && self.read().values().any(|w| w.model == model && w.kv_events.is_some())
    }

    /// Removes a worker from its pool; its sessions re-bind elsewhere. Returns whether it
    /// existed.
    pub fn remove_worker(&self, id: u64) -> bool {
        let mut workers = self.workers.write().unwrap_or_else(PoisonError::into_inner);
        let Some(old) = workers.get(&id) else {
            return false;
        };
        if let Some(p) = self.pools.get(&old.model) {
            let _ = p.driver.remove_worker(WorkerId(id));
        }
        workers.remove(&id);
        self.verdicts.forget(id);
        true
    }

    /// Whether each worker tokenizes as the router does.
    pub fn verdicts(&self) -> &Verdicts {
        &self.verdicts
    }

    /// Whether `worker` may be sent a prompt as the router's token ids: its pool sends
    /// them and its last tokenizer check agreed.
    pub fn sends_ids_to(&self, pool: &Pool, worker: u64) -> bool {
        pool.forward_token_ids && self.verdicts.agrees(worker)
    }

    fn read(&self) -> std::sync::RwLockReadGuard<'_, BTreeMap<u64, Arc<WorkerConfig>>> {
        self.workers.read().unwrap_or_else(PoisonError::into_inner)
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use crate::config::{ModelConfig, ProxyConfig, WorkerConfig};
    use crate::fleet::Fleet;
    use crate::metrics::Metrics;

    fn worker(id: u64, events: bool) -> WorkerConfig {
        let mut w = serde_json::json!({"id": id, "url": "http://127.0.0.1:9", "model": "m"});
        if events {
            w["kv_events"] = "tcp://127.0.0.1:5557".into();
        }
        serde_json::from_value(w).expect("a worker")
    }

    /// A step: add (`Some(events)`) or remove (`None`) worker `id`; then whether model
    /// `m` is missing its tokenizer, in the fleet and in `/metrics`.
    type Step = (u64, Option<bool>, bool);

    #[track_caller]
    fn check(tokenizer: bool, steps: &[Step]) {
        let tokenizer = tokenizer.then(|| "a-folder".into());
        let model = ModelConfig { name: "m".into(), tokenizer, ..ModelConfig::default() };
        let cfg = ProxyConfig { models: vec![model], ..Default::default() };
        let fleet = Arc::new(Fleet::new(&cfg, 1));
        let metrics = Metrics::new(fleet.clone());
        for &(id, add, want) in steps {
            match add {
                Some(events) => _ = fleet.add_worker(worker(id, events)).expect("added"),
                None => assert!(fleet.remove_worker(id)),
            }
            assert_eq!(fleet.tokenizer_missing("m"), want, "after {id} {add:?}");
            let line = format!("kvroute_tokenizer_missing{{model=\"m\"}} {}", u8::from(want));
            assert!(metrics.encode().lines().any(|l| l == line), "after {id} {add:?}: no {line:?}");
        }
    }

    #[tokio::test]
    async fn a_model_misses_its_tokenizer_while_a_worker_publishes_events() {
        // Whichever way they join (config, admin API, discovery), workers count as they
        // come and go.
        check(false, &[(1, Some(false), false), (2, Some(true), true), (3, Some(true), true)]);
        check(false, &[(2, Some(true), true), (2, None, false), (2, Some(false), false)]);
        check(false, &[(2, Some(true), true), (2, Some(false), false)]);
        check(true, &[(1, Some(true), false), (2, Some(true), false)]);
    }
}
