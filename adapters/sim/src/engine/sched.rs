//! The forward-pass scheduler (MOCKER_MODEL section 6): running requests first, then
//! FCFS admission if nothing was preempted, one batched prefill time plus one decode
//! step time per pass, tokens stamped at the pass end.

use super::seq::{grow, release, Req};
use super::{Engine, EngineOutput, EngineRole};

/// What one request does in a pass.
struct Plan {
    /// `computed` after the pass.
    to: u32,
    /// Budget tokens it consumes.
    cost: u32,
    /// Prompt tokens it computes (these cost prefill time).
    prompt_tokens: u32,
    /// Its prompt was complete before the pass: it takes a decode step.
    decoding: bool,
}

fn plan(r: &Req, budget: u32) -> Plan {
    let seq_len = r.seq_len();
    let from = r.computed;
    if r.kv_arrived {
        // The prompt's KV arrived computed: catching up is free, then one decode token.
        return Plan { to: seq_len, cost: 1, prompt_tokens: 0, decoding: true };
    }
    let n = (seq_len - from).min(budget);
    let to = from + n;
    let p = r.prompt_len;
    Plan { to, cost: n, prompt_tokens: to.min(p) - from.min(p), decoding: from >= p }
}

#[derive(Default)]
struct Tally {
    budget: u32,
    prompt_tokens: u64,
    /// Requests whose prompt tokens the pass computes.
    prefilling: u64,
    /// Requests taking a decode step.
    decoding: u64,
    scheduled: bool,
    preempted: bool,
}

impl Tally {
    /// Puts `r` in this pass as `p` planned it.
    fn take(&mut self, r: &mut Req, p: &Plan) {
        r.computed = p.to;
        r.scheduled = true;
        self.budget -= p.cost;
        self.prompt_tokens += u64::from(p.prompt_tokens);
        self.prefilling += u64::from(p.prompt_tokens > 0);
        self.decoding += u64::from(p.decoding);
        self.scheduled = true;
    }
}

impl Engine {
    /// Starts a pass at `t`; leaves the engine idle if nothing could be scheduled.
    pub(super) fn start_pass(&mut self, t: f64, out: &mut Vec<EngineOutput>) {
        self.clock_ms = self.clock_ms.max(t);
        // A pass that only preempted (the last running request preempting itself) is
        // retried once: the next try admits from the queue with the whole pool free.
        for _ in 0..2 {
            let active_full_at_start = self.pool.active();
            let mut tally = Tally { budget: self.cfg.max_batched_tokens, ..Tally::default() };
            self.schedule_running(t, &mut tally, out);
            if !tally.preempted {
                self.admit_waiting(t, &mut tally, out);
            }
            if !tally.scheduled {
                if tally.preempted {
                    continue;
                }
                break;
            }
            let timing = &self.cfg.timing;
            let t_prefill = timing.prefill_ms(tally.prompt_tokens, tally.prefilling);
            let t_decode = if tally.decoding > 0 && self.cfg.role != EngineRole::Prefill {
                timing.decode_ms(u64::from(active_full_at_start), u64::from(self.pool.capacity()), tally.decoding)
            } else {
                0.0
            };
            let idle_ms = self.last_pass_end_ms.map_or(f64::INFINITY, |end| (t - end) * self.cfg.speedup);
            let dur = (t_prefill + t_decode + timing.cold_ms(idle_ms)) / self.cfg.speedup;
            self.stats.passes += 1;
            self.stats.busy_ms += dur;
            self.pass_end_ms = Some(t + dur);
            return;
        }
        self.stats.stalls += 1;
    }

    fn schedule_running(&mut self, t: f64, tally: &mut Tally, out: &mut Vec<EngineOutput>) {
        let mut i = 0;
        while i < self.running.len() && tally.budget > 0 {
            let p = plan(&self.running[i], tally.budget);
            let fits = loop {
                let mut ev = Engine::events(out, &mut self.next_event_id, &mut self.stats, t);
                if grow(&mut self.pool, &mut self.scratch, &mut self.running[i], p.to, self.bs, &mut ev) {
                    break true;
                }
                // LIFO: the newest running request is last, so it is never one already
                // scheduled in this pass; it may be the current one.
                let victim = self.running.len() - 1;
                self.preempt_last(t, out);
                tally.preempted = true;
                if victim == i {
                    break false;
                }
            };
            if !fits {
                continue;
            }
            tally.take(&mut self.running[i], &p);
            i += 1;
        }
    }

    fn admit_waiting(&mut self, t: f64, tally: &mut Tally, out: &mut Vec<EngineOutput>) {
        while self.running.len() < self.cfg.max_num_seqs as usize && tally.budget > 0 {
            let Some(r) = self.waiting.front_mut() else {
                break;
            };
            let hit = r.prefix_hit(&self.pool, self.bs);
            r.computed = hit * self.bs;
            let p = plan(r, tally.budget);
            let mut ev = Engine::events(out, &mut self.next_event_id, &mut self.stats, t);
            if !grow(&mut self.pool, &mut self.scratch, r, p.to, self.bs, &mut ev) {
                // No preemption for admissions: the queue head waits for room.
                r.computed = 0;
                break;
            }
            let Some(mut r) = self.waiting.pop_front() else {
                break;
            };
            let cached_tokens = (hit * self.bs).min(r.seq_len());
            out.push(EngineOutput::Admitted { id: r.id, at_ms: t, cached_tokens, readmission: r.admitted });
            r.admitted = true;
            tally.take(&mut r, &p);
            self.running.push(r);
        }
    }

    /// Preempts the newest running request: it frees everything and goes to the front
    /// of the queue to recompute from scratch.
    fn preempt_last(&mut self, t: f64, out: &mut Vec<EngineOutput>) {
        let Some(mut r) = self.running.pop() else {
            return;
        };
        release(&mut self.pool, &mut r);
        r.computed = 0;
        r.scheduled = false;
        r.preemptions += 1;
        self.stats.preemptions += 1;
        out.push(EngineOutput::Preempted { id: r.id, at_ms: t });
        self.waiting.push_front(r);
    }

    /// Ends the pass at `end`: scheduled requests whose tokens are all computed sample
    /// one token; finished ones release their blocks.
    pub(super) fn finish_pass(&mut self, end: f64, out: &mut Vec<EngineOutput>) {
        self.clock_ms = self.clock_ms.max(end);
        self.last_pass_end_ms = Some(end);
        let role = self.cfg.role;
        let transfer_ms_per_token = self.kv_transfer_ms(1);
        let mut keep = 0;
        for i in 0..self.running.len() {
            let r = &mut self.running[i];
            let mut finished = false;
            if r.scheduled && r.computed == r.seq_len() {
                r.generated += 1;
                r.emitted += 1;
                if r.first_token_ms.is_nan() {
                    r.first_token_ms = end;
                }
                if r.generated == 1 && !r.kv_arrived {
                    out.push(EngineOutput::FirstToken { id: r.id, at_ms: end });
                }
                finished = r.generated >= r.target_tokens;
            }
            r.scheduled = false;
            if finished {
                release(&mut self.pool, r);
                let kv_transfer_ms =
                    if role == EngineRole::Prefill { transfer_ms_per_token * f64::from(r.prompt_len) } else { 0.0 };
                out.push(EngineOutput::Finished {
                    id: r.id,
                    at_ms: end,
                    first_token_ms: r.first_token_ms,
                    tokens: r.emitted,
                    preemptions: r.preemptions,
                    kv_transfer_ms,
                });
            } else {
                if keep != i {
                    self.running.swap(keep, i);
                }
                keep += 1;
            }
        }
        self.running.truncate(keep);
    }

    fn kv_transfer_ms(&self, tokens: u32) -> f64 {
        let kv = &self.cfg.kv_transfer;
        if kv.bandwidth_bytes_per_s > 0.0 {
            f64::from(tokens) * kv.kv_bytes_per_token as f64 / kv.bandwidth_bytes_per_s * 1000.0 / self.cfg.speedup
        } else {
            0.0
        }
    }
}
