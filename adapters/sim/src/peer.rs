//! The text-tree routers' rule, replayed on block hashes: a reference to measure
//! kvroute's policy against offline, never a policy kvroute serves with.
//!
//! vllm-router's and SGLang's `cache_aware` (and SMG's) keep, per worker, a tree of every
//! prompt they sent there, never told what the engine evicted. For each request:
//! 1. if the fleet is imbalanced (`max − min > balance_abs_threshold` and
//!    `max > balance_rel_threshold × min`, counting requests in flight), the least
//!    loaded worker;
//! 2. else the worker whose tree matches the longest prefix, if it matches more than
//!    `cache_threshold` of the prompt (ties: the worker that matched it last);
//! 3. else the worker with the smallest tree.
//!
//! The trees here hold block hashes instead of characters, which is the same rule at
//! block granularity. They are unbounded: the peers' default tree bound (2^26 characters
//! per worker) is far above any replay workload.

use std::collections::HashMap;

use router_core::SeqHash;

use crate::replay::{Dispatch, Dispatcher, SimRequest};

/// The rule's knobs, defaulting to the peers' own defaults.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct TextTreeConfig {
    /// Share of the prompt a tree must match for its worker to be chosen; 0.3.
    pub cache_threshold: f64,
    /// Requests in flight between the busiest and the idlest worker past which the rule
    /// balances load instead; 64.
    pub balance_abs_threshold: u32,
    /// ...and the busiest over the idlest; 1.5.
    pub balance_rel_threshold: f64,
}

impl Default for TextTreeConfig {
    fn default() -> Self {
        TextTreeConfig { cache_threshold: 0.3, balance_abs_threshold: 64, balance_rel_threshold: 1.5 }
    }
}

/// A [`Dispatcher`] following the text-tree routers' rule (see the module docs).
#[derive(Debug)]
pub struct TextTreeRule {
    cfg: TextTreeConfig,
    /// Per worker: block → when it was last sent there (arrival count).
    trees: Vec<HashMap<SeqHash, u64>>,
    in_flight: Vec<u32>,
    /// Request id → its worker, until it finishes.
    placed: HashMap<u64, u32>,
    arrivals: u64,
}

impl TextTreeRule {
    /// The rule over `workers` workers (at least one).
    pub fn new(workers: u32, cfg: TextTreeConfig) -> Self {
        let n = workers.max(1) as usize;
        TextTreeRule { cfg, trees: vec![HashMap::new(); n], in_flight: vec![0; n], placed: HashMap::new(), arrivals: 0 }
    }

    fn imbalanced(&self) -> bool {
        let max = self.in_flight.iter().copied().max().unwrap_or(0);
        let min = self.in_flight.iter().copied().min().unwrap_or(0);
        max - min > self.cfg.balance_abs_threshold && f64::from(max) > self.cfg.balance_rel_threshold * f64::from(min)
    }

    /// The lowest-numbered worker minimising `key`.
    fn argmin<K: Ord>(&self, key: impl Fn(usize) -> K) -> u32 {
        (0..self.trees.len()).min_by_key(|&w| key(w)).unwrap_or(0) as u32
    }

    /// The worker with the longest matched prefix, its length in blocks.
    fn longest_match(&self, blocks: &[SeqHash]) -> (u32, usize) {
        let mut best = (0, 0, 0);
        for (w, tree) in self.trees.iter().enumerate() {
            let n = blocks.iter().take_while(|b| tree.contains_key(b)).count();
            let last = n.checked_sub(1).and_then(|i| tree.get(&blocks[i]).copied()).unwrap_or(0);
            if (n, last) > (best.1, best.2) {
                best = (w as u32, n, last);
            }
        }
        (best.0, best.1)
    }

    fn choose(&self, blocks: &[SeqHash]) -> u32 {
        if self.imbalanced() {
            return self.argmin(|w| self.in_flight[w]);
        }
        let (w, matched) = self.longest_match(blocks);
        if !blocks.is_empty() && matched as f64 / blocks.len() as f64 > self.cfg.cache_threshold {
            return w;
        }
        self.argmin(|w| self.trees[w].len())
    }
}

impl Dispatcher for TextTreeRule {
    fn on_arrival(&mut self, _now_ms: f64, req: &SimRequest) -> Dispatch {
        self.arrivals += 1;
        let blocks: Vec<SeqHash> = req.prompt.blocks().iter().map(|b| b.seq).collect();
        let w = self.choose(&blocks);
        let tree = &mut self.trees[w as usize];
        for b in blocks {
            tree.insert(b, self.arrivals);
        }
        self.in_flight[w as usize] += 1;
        self.placed.insert(req.id, w);
        Dispatch::To(w)
    }

    fn on_finished(&mut self, _now_ms: f64, worker: u32, req_id: u64) {
        if self.placed.remove(&req_id).is_some() {
            let n = &mut self.in_flight[worker as usize];
            *n = n.saturating_sub(1);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_requests::request;

    /// Routes `prompts` (lists of hash ids) in order, none finishing, and returns the
    /// workers chosen.
    #[track_caller]
    fn check(workers: u32, cfg: TextTreeConfig, prompts: &[&[u32]], want: &[u32]) {
        let mut rule = TextTreeRule::new(workers, cfg);
        let got: Vec<u32> = prompts
            .iter()
            .enumerate()
            .map(|(i, ids)| match rule.on_arrival(0.0, &request(i as u64, ids, 512 * ids.len() as u32, 512)) {
                Dispatch::To(w) => w,
                other => panic!("request {i}: {other:?}"),
            })
            .collect();
        assert_eq!(got, want);
    }

    #[test]
    fn a_matching_prefix_stays_and_a_new_one_goes_to_the_smallest_tree() {
        let cfg = TextTreeConfig::default();
        // 1 and 2 are new (smallest trees: 0, then 1); 3 extends 1's prefix; 4 is new and
        // worker 1's tree (2 blocks) is smaller than worker 0's (3 blocks).
        check(2, cfg, &[&[1, 2], &[7, 8], &[1, 2, 3], &[9]], &[0, 1, 0, 1]);
    }

    #[test]
    fn a_match_at_or_below_the_threshold_counts_as_none() {
        let cfg = TextTreeConfig { cache_threshold: 0.5, ..TextTreeConfig::default() };
        // Request 2 matches half of its blocks on worker 0: not more than 0.5.
        check(2, cfg, &[&[1, 2, 3], &[1, 9], &[1, 2, 5]], &[0, 1, 0]);
    }

    #[test]
    fn an_imbalanced_fleet_goes_to_the_least_loaded() {
        let cfg = TextTreeConfig { balance_abs_threshold: 1, balance_rel_threshold: 1.0, ..TextTreeConfig::default() };
        // After two requests on worker 0 (2 vs 0 in flight), the third goes to worker 1
        // despite its match.
        check(2, cfg, &[&[1, 2], &[1, 2, 3], &[1, 2, 3, 4]], &[0, 0, 1]);
    }
}
