//! Fleet and KV-event inputs: worker updates, and events checked against the index model.

use super::*;

impl Driver {
    // ---- workers ----

    #[allow(clippy::too_many_arguments)]
    pub(super) fn upsert(
        &mut self,
        worker: u8,
        role: u8,
        ranks: u8,
        weight: u8,
        small_kv: bool,
        zone: u8,
        taint: u8,
    ) -> Check {
        let id = worker_id(worker);
        let role = [WorkerRole::Aggregated, WorkerRole::Aggregated, WorkerRole::Prefill, WorkerRole::Decode]
            [role as usize % 4];
        let mut spec = WorkerSpec::new(id, role);
        spec.dp_ranks = match ranks % 7 {
            0 => None,
            5 => Some(0),
            6 => Some(self.cfg.workers.dp_ranks_max + 1),
            n => Some(u32::from(n)),
        };
        spec.weight = u32::from(weight % 4);
        if small_kv {
            spec.kv_blocks = 16;
            spec.max_batched_tokens = 128;
        }
        spec.labels = vec![("zone".into(), format!("z{}", zone % 2))];
        spec.taints = taints_of(taint);
        let valid = !matches!(spec.dp_ranks, Some(0))
            && spec.dp_ranks.unwrap_or(1) <= self.cfg.workers.dp_ranks_max
            && spec.weight > 0
            && (self.workers.contains_key(&id) || self.workers.len() < self.cfg.workers.workers_max);
        let res = self.router.handle_worker_update(self.now, WorkerUpdate::Upsert(spec.clone()));
        self.tally.worker_updates += 1;
        if res.is_ok() != valid {
            return Err(format!("upsert of {spec:?} answered {res:?}; the model expected ok = {valid}"));
        }
        if valid {
            let health = self.workers.get(&id).map_or(Health::Healthy, |w| w.1);
            self.workers.insert(id, (spec, health));
        }
        self.drain()
    }

    pub(super) fn remove(&mut self, worker: u8) -> Check {
        let id = worker_id(worker);
        let res = self.router.handle_worker_update(self.now, WorkerUpdate::Removed(id));
        self.tally.worker_updates += 1;
        if res.is_err() {
            return Err(format!("removing worker {} answered {res:?}", id.0));
        }
        self.workers.remove(&id);
        self.foreign.remove(&id);
        self.index.remove_worker(id);
        for r in self.reqs.values_mut() {
            if let MState::Booked(k) | MState::Dispatched(k) = r.state {
                if k.worker == id {
                    r.state = MState::Orphaned;
                    // Its deadline restarts: the router gives orphans `request_age_max_ms`.
                    r.since = self.now;
                    self.transitions += 1;
                    self.tally.orphaned += 1;
                }
            }
        }
        self.drain()?;
        self.check_index(&chain_blocks(worker, 0, CHAIN_BLOCKS))
    }

    pub(super) fn simple_update(&mut self, worker: u8, update: WorkerUpdate, health: Option<Health>) -> Check {
        let id = worker_id(worker);
        let res = self.router.handle_worker_update(self.now, update);
        self.tally.worker_updates += 1;
        let want = if self.workers.contains_key(&id) {
            Ok(())
        } else {
            Err(InputError::Worker(WorkerError::UnknownWorker { worker: id }))
        };
        if res != want {
            return Err(format!("worker update answered {res:?}, want {want:?}"));
        }
        if let (Some(h), Some(w)) = (health, self.workers.get_mut(&id)) {
            w.1 = h;
        }
        self.drain()
    }

    // ---- KV events ----

    pub(super) fn stored(&mut self, key: WorkerKey, chain: u8, start: u8, len: u8, parent: bool, tier: u8) -> Check {
        let start = u32::from(start) % CHAIN_BLOCKS;
        let seqs = chain_blocks(chain, start, u32::from(len) % 17);
        let blocks = with_local(&seqs);
        let parent = match (parent, start) {
            (false, _) => None,
            (true, 0) => Some(private_block(999, 0)), // a parent nobody stored
            (true, s) => Some(block(chain, s - 1)),
        };
        let tier = tier_of(tier);
        let got = self.router.handle_kv_event(self.now, key, IndexEvent::Stored { parent, blocks: &blocks, tier });
        let want = if self.workers.contains_key(&key.worker) {
            self.index.store(key, parent, &blocks, tier).map_err(InputError::Index)
        } else {
            Err(unknown_worker(key))
        };
        self.kv_result(got, want)?;
        let mut q = chain_blocks(chain, 0, CHAIN_BLOCKS);
        q.truncate(q.len().min(start as usize + seqs.len() + 1));
        self.check_index(&q)
    }

    pub(super) fn removed(&mut self, key: WorkerKey, chain: u8, start: u8, len: u8, tier: u8) -> Check {
        let seqs = chain_blocks(chain, u32::from(start) % CHAIN_BLOCKS, u32::from(len) % 17);
        let tier = tier_of(tier);
        let got = self.router.handle_kv_event(self.now, key, IndexEvent::Removed { blocks: &seqs, tier });
        let want = if self.workers.contains_key(&key.worker) {
            Ok(self.index.remove(key, &seqs, tier))
        } else {
            Err(unknown_worker(key))
        };
        self.kv_result(got, want)?;
        self.check_index(&chain_blocks(chain, 0, CHAIN_BLOCKS))
    }

    pub(super) fn cleared(&mut self, key: WorkerKey) -> Check {
        let got = self.router.handle_kv_event(self.now, key, IndexEvent::Cleared);
        let want = if self.workers.contains_key(&key.worker) {
            self.index.clear_key(key);
            Ok(Default::default())
        } else {
            Err(unknown_worker(key))
        };
        self.kv_result(got, want)?;
        self.check_index(&chain_blocks(key.rank.0 as u8, 0, CHAIN_BLOCKS))
    }

    pub(super) fn kv_result<T: PartialEq + std::fmt::Debug>(
        &mut self,
        got: Result<T, InputError>,
        want: Result<T, InputError>,
    ) -> Check {
        if got != want {
            return Err(format!("kv event answered {got:?}, the model says {want:?}"));
        }
        if got.is_ok() {
            self.tally.kv_applied += 1;
        } else {
            self.tally.kv_refused += 1;
        }
        Ok(())
    }
}
