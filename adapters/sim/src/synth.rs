//! A seeded synthetic workload: shared-prefix groups, multi-turn sessions, Poisson or
//! bursty arrivals. It emits the same [`TraceRecord`]s as the trace parser (with token
//! ids and session ids), so everything downstream treats both alike.
//!
//! Sessions start as a Poisson process (or an on/off bursty one). A session belongs to
//! one of `groups` groups and its first prompt is the group's system prompt plus a fresh
//! question. Each later turn extends the previous prompt with the previous answer and a
//! new question, and is sent an exponential think time after the turn before finishes
//! (its `delay`, so replay waits for the answer as a chat client does); its timestamp,
//! which orders the trace, adds an estimated response time instead. Token ids are below
//! 2^31 and never reused across groups, questions or answers.

use std::sync::Arc;

use crate::rng::SplitMix64;
use crate::trace::{PromptContent, TraceRecord};

/// How sessions arrive.
#[derive(Clone, Debug, PartialEq)]
pub enum ArrivalPattern {
    /// A Poisson process at the configured rate.
    Poisson,
    /// On/off: all sessions arrive in the first `duty` fraction of every `period_ms`,
    /// at `rate / duty`, so the mean rate is unchanged.
    Bursty {
        /// Length of one on+off cycle, ms.
        period_ms: f64,
        /// Fraction of the cycle that is "on", in (0, 1].
        duty: f64,
    },
}

/// Synthetic workload parameters. The defaults give a ~50 s run that keeps 4–8 default
/// engines busy and rewards prefix-aware routing.
#[derive(Clone, Debug, PartialEq)]
pub struct SynthConfig {
    /// PRNG seed; 1.
    pub seed: u64,
    /// Sessions start within `[0, duration_ms)`; 30,000.
    pub duration_ms: f64,
    /// New sessions per second (mean); 12.
    pub session_rate_per_s: f64,
    /// Arrival process; Poisson.
    pub arrival: ArrivalPattern,
    /// Shared-prefix groups; 48.
    pub groups: u32,
    /// Zipf exponent of group popularity (0 = uniform); 0.6.
    pub group_zipf_s: f64,
    /// Tokens of each group's system prompt; 6,000.
    pub system_prompt_tokens: u32,
    /// Mean question length, tokens (uniform within ±50%); 800.
    pub question_tokens: u32,
    /// Mean answer length, tokens (uniform within ±50%); 256.
    pub output_tokens: u32,
    /// Most turns per session (each session draws 1..=this uniformly); 4.
    pub turns_per_session_max: u32,
    /// Mean think time between an answer and the next question, ms; 2,000.
    pub think_time_ms: f64,
    /// Assumed generation time per answer token, for the later turns' timestamps (which
    /// order the trace; they are sent on their `delay`), ms; 10.
    pub response_ms_per_token: f64,
    /// A session stops growing past this prompt length, tokens; 32,768.
    pub prompt_tokens_max: u32,
    /// Most requests generated; 100,000.
    pub requests_max: u32,
}

impl Default for SynthConfig {
    fn default() -> Self {
        SynthConfig {
            seed: 1,
            duration_ms: 30_000.0,
            session_rate_per_s: 12.0,
            arrival: ArrivalPattern::Poisson,
            groups: 48,
            group_zipf_s: 0.6,
            system_prompt_tokens: 6_000,
            question_tokens: 800,
            output_tokens: 256,
            turns_per_session_max: 4,
            think_time_ms: 2_000.0,
            response_ms_per_token: 10.0,
            prompt_tokens_max: 32_768,
            requests_max: 100_000,
        }
    }
}

struct Ids(u32);

impl Ids {
    /// `n` fresh token ids. The counter stays below 2^31 by wrapping into
    /// `1..2^31`; a wrap needs 2^31 generated tokens, far past `requests_max` limits.
    fn take(&mut self, n: u32, out: &mut Vec<u32>) {
        for _ in 0..n {
            out.push(self.0);
            self.0 = if self.0 >= (1 << 31) - 1 { 1 } else { self.0 + 1 };
        }
    }
}

/// Generates the workload, sorted by arrival (stable). Linear in the tokens produced.
pub fn generate(cfg: &SynthConfig) -> Vec<TraceRecord> {
    let mut rng = SplitMix64::new(cfg.seed);
    let mut ids = Ids(1);
    let groups = cfg.groups.max(1);
    let mut system: Vec<Vec<u32>> = Vec::with_capacity(groups as usize);
    for _ in 0..groups {
        let mut v = Vec::with_capacity(cfg.system_prompt_tokens as usize);
        ids.take(cfg.system_prompt_tokens, &mut v);
        system.push(v);
    }
    let cdf = zipf_cdf(groups, cfg.group_zipf_s);
    let mut out = Vec::new();
    let mut on_time_ms = 0.0;
    let mut session = 0u64;
    let mean_gap_ms = if cfg.session_rate_per_s > 0.0 { 1000.0 / cfg.session_rate_per_s } else { f64::INFINITY };
    'sessions: loop {
        on_time_ms += rng.exp(mean_gap_ms * duty(&cfg.arrival));
        let start = real_time(&cfg.arrival, on_time_ms);
        if start.is_nan() || start >= cfg.duration_ms {
            break;
        }
        let g = pick(&cdf, rng.unit());
        let turns = rng.range_u32(1, cfg.turns_per_session_max.max(1));
        let sid = format!("s{session}");
        session += 1;
        let mut prompt = system[g].clone();
        let mut t = start;
        let mut delay_ms = None;
        for turn in 0..turns {
            ids.take(around(&mut rng, cfg.question_tokens), &mut prompt);
            if prompt.len() as u64 > u64::from(cfg.prompt_tokens_max) || prompt.is_empty() {
                break;
            }
            if out.len() as u64 >= u64::from(cfg.requests_max) {
                break 'sessions;
            }
            let output = around(&mut rng, cfg.output_tokens).max(1);
            out.push(TraceRecord {
                timestamp_ms: t.floor(),
                input_length: prompt.len() as u32,
                output_length: output,
                content: PromptContent::Tokens(Arc::from(prompt.as_slice())),
                session_id: Some(sid.clone()),
                priority: None,
                delay_ms,
            });
            if turn + 1 < turns {
                // The answer becomes part of the next prompt.
                ids.take(output, &mut prompt);
                let think = rng.exp(cfg.think_time_ms);
                t += f64::from(output) * cfg.response_ms_per_token + think;
                delay_ms = Some(think);
            }
        }
    }
    out.sort_by(|a, b| a.timestamp_ms.total_cmp(&b.timestamp_ms));
    out
}

fn duty(a: &ArrivalPattern) -> f64 {
    match a {
        ArrivalPattern::Poisson => 1.0,
        ArrivalPattern::Bursty { duty, .. } => duty.clamp(1e-3, 1.0),
    }
}

/// Maps time counted only during "on" phases to wall (virtual) time.
fn real_time(a: &ArrivalPattern, on_ms: f64) -> f64 {
    match a {
        ArrivalPattern::Poisson => on_ms,
        ArrivalPattern::Bursty { period_ms, .. } => {
            let on_len = period_ms.max(1.0) * duty(a);
            let k = (on_ms / on_len).floor();
            k * period_ms.max(1.0) + (on_ms - k * on_len)
        }
    }
}

/// Uniform within ±50% of `mean`.
fn around(rng: &mut SplitMix64, mean: u32) -> u32 {
    rng.range_u32(mean / 2, mean.saturating_add(mean / 2))
}

fn zipf_cdf(n: u32, s: f64) -> Vec<f64> {
    let w: Vec<f64> = (1..=n).map(|k| 1.0 / f64::from(k).powf(s.max(0.0))).collect();
    let total: f64 = w.iter().sum();
    let mut acc = 0.0;
    w.iter()
        .map(|x| {
            acc += x / total;
            acc
        })
        .collect()
}

fn pick(cdf: &[f64], u: f64) -> usize {
    cdf.iter().position(|&c| u < c).unwrap_or(cdf.len().saturating_sub(1))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tokens(r: &TraceRecord) -> &[u32] {
        match &r.content {
            PromptContent::Tokens(t) => t,
            PromptContent::HashIds(_) => panic!("synth emits tokens"),
        }
    }

    #[test]
    fn deterministic_and_sorted() {
        let cfg = SynthConfig::default();
        let a = generate(&cfg);
        assert_eq!(a, generate(&cfg));
        assert!(a.len() > 200, "only {} requests", a.len());
        assert!(a.windows(2).all(|w| w[0].timestamp_ms <= w[1].timestamp_ms));
        assert_ne!(a, generate(&SynthConfig { seed: 2, ..cfg }));
    }

    #[test]
    fn turns_extend_the_previous_prompt() {
        let recs = generate(&SynthConfig::default());
        let mut checked = 0;
        for (i, r) in recs.iter().enumerate() {
            assert_eq!(tokens(r).len() as u32, r.input_length);
            assert!(tokens(r).iter().all(|&t| t < (1 << 31)));
            let later = recs[i + 1..].iter().find(|x| x.session_id == r.session_id);
            if let Some(next) = later {
                let prev = tokens(r);
                assert_eq!(&tokens(next)[..prev.len()], prev, "turn must extend its predecessor");
                assert!(next.input_length >= r.input_length + r.output_length);
                // Sent its think time after this turn ends; its timestamp adds a guess at
                // the answer's time on top.
                let think = next.delay_ms.expect("a later turn waits for the turn before");
                assert!(think >= 0.0 && next.timestamp_ms >= (r.timestamp_ms + think).floor());
                checked += 1;
            }
            let first = recs[..i].iter().all(|x| x.session_id != r.session_id);
            assert_eq!(r.delay_ms.is_none(), first, "only a session's first turn has no delay: {r:?}");
        }
        assert!(checked > 50);
    }

    #[test]
    fn groups_share_system_prompts() {
        let cfg = SynthConfig { groups: 2, turns_per_session_max: 1, ..SynthConfig::default() };
        let recs = generate(&cfg);
        let mut firsts: Vec<u32> = recs.iter().map(|r| tokens(r)[0]).collect();
        firsts.sort_unstable();
        firsts.dedup();
        assert_eq!(firsts.len(), 2);
    }

    #[test]
    fn bursty_arrivals_stay_in_on_phases() {
        let cfg = SynthConfig {
            arrival: ArrivalPattern::Bursty { period_ms: 10_000.0, duty: 0.2 },
            turns_per_session_max: 1,
            ..SynthConfig::default()
        };
        let recs = generate(&cfg);
        assert!(recs.len() > 100);
        assert!(recs.iter().all(|r| r.timestamp_ms % 10_000.0 < 2_000.0 + 1.0));
    }
}
