//! How long an engine's passes take, in milliseconds at speedup 1: a polynomial in the
//! prompt tokens computed in a pass, plus a decode step that grows with the share of KV
//! blocks held and the requests running. The default is the mocker's "Polynomial"
//! model of a GPU; [`EngineTiming::VLLM_CPU`] is fitted to vLLM's CPU build.
//!
//! Scaling by the engine's speedup is left to the caller.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Coefficients of one engine's timing. A pass computing `T` prompt tokens for `R`
/// requests while `N` requests decode at KV share `p` (clamped to `[0, 1]`) takes
/// `prefill(T, R) + decode(p, N)`:
///
/// - `prefill(T, R) = prefill_ms_per_token_squared·T² + prefill_ms_per_token·T +
///   prefill_ms_per_pass + prefill_ms_per_request·R`, 0 when `T = 0`, floored at 0;
/// - `decode(p, N) = max(decode_ms_min, decode_ms_per_usage_squared·p² +
///   decode_ms_per_usage·p + decode_ms_per_step + decode_ms_per_running_request·N)`.
///
/// A JSON file of these fields (any subset; the rest are the mocker's) selects it in
/// `kvroute replay --engine-timing FILE`.
#[derive(Clone, Copy, Debug, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EngineTiming {
    /// Prefill: ms per computed token squared.
    pub prefill_ms_per_token_squared: f64,
    /// Prefill: ms per computed token.
    pub prefill_ms_per_token: f64,
    /// Prefill: fixed ms of a pass that computes any prompt tokens.
    pub prefill_ms_per_pass: f64,
    /// Prefill: ms per request whose prompt tokens the pass computes.
    pub prefill_ms_per_request: f64,
    /// Decode: ms of a step at an empty cache.
    pub decode_ms_per_step: f64,
    /// Decode: ms per unit of KV share held.
    pub decode_ms_per_usage: f64,
    /// Decode: ms per KV share squared.
    pub decode_ms_per_usage_squared: f64,
    /// Decode: ms per request decoding in the step.
    pub decode_ms_per_running_request: f64,
    /// Decode: the shortest step, ms.
    pub decode_ms_min: f64,
    /// A pass that starts after the engine has been idle takes this much longer per
    /// second idle, ms (caches and the host's core gone cold).
    pub cold_ms_per_idle_s: f64,
    /// Most a pass takes longer for it, ms.
    pub cold_ms_max: f64,
}

impl Default for EngineTiming {
    fn default() -> Self {
        EngineTiming::MOCKER
    }
}

/// Why a timing was refused.
#[derive(Clone, Debug, PartialEq)]
#[non_exhaustive]
pub enum TimingError {
    /// No preset has this name and no file is at this path.
    Unknown(String),
    /// The file could not be read.
    Read(String),
    /// The file is not a JSON object of timing fields.
    Parse(String),
    /// A coefficient is not finite, or a fixed cost is negative.
    Value(&'static str, f64),
}

impl fmt::Display for TimingError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TimingError::Unknown(s) => write!(
                f,
                "engine timing {s:?} is neither a preset ({}) nor a file",
                EngineTiming::PRESETS.map(|(n, _)| n).join(", ")
            ),
            TimingError::Read(e) => write!(f, "cannot read engine timing: {e}"),
            TimingError::Parse(e) => write!(f, "engine timing file: {e}"),
            TimingError::Value(name, v) => write!(f, "engine timing: {name} = {v} must be finite and not negative"),
        }
    }
}

impl std::error::Error for TimingError {}

impl EngineTiming {
    /// The mocker's GPU polynomial (MOCKER_MODEL section 7).
    pub const MOCKER: EngineTiming = EngineTiming {
        prefill_ms_per_token_squared: 4.209989e-07,
        prefill_ms_per_token: 1.518344e-02,
        prefill_ms_per_pass: 16.50142,
        prefill_ms_per_request: 0.0,
        decode_ms_per_step: 5.74,
        decode_ms_per_usage: 54.01,
        decode_ms_per_usage_squared: -25.74,
        decode_ms_per_running_request: 0.0,
        decode_ms_min: 1.0,
        cold_ms_per_idle_s: 0.0,
        cold_ms_max: 0.0,
    };

    /// vLLM's CPU build serving the generated benchmark model, one core per server
    /// (`OMP_NUM_THREADS=1`, bf16, `--enforce-eager`, 2,048-token passes). Fitted on one
    /// server with `benches/real_fleet/profile_engine.py` (its docstring has the
    /// command), three runs of 3–5 repeats on a host shared with other builds (load
    /// average 4–14), taking each length's fastest median. Time to the first token of
    /// a fresh prompt, ms:
    ///
    /// | tokens   |  16 |  64 | 128 | 256 | 512 | 768 | 1024 | 1536 | 2048 |
    /// |----------|----:|----:|----:|----:|----:|----:|-----:|-----:|-----:|
    /// | measured |  60 |  45 |  59 |  97 | 126 | 199 |  473 |  708 |  586 |
    /// | fitted   |  45 |  52 |  63 |  87 | 143 | 210 |  289 |  479 |  713 |
    ///
    /// (1,024 tokens measured 240 ms and 2,048 590–710 ms on a quieter host.) Decode:
    /// 32 ms a step with one request running (medians 31.5, 32.0, 42.3 ms), about
    /// 0.7 ms more per further request (2.1, 0.7, −6.1 between 1 and 4 running); the
    /// KV share makes no measurable difference at these sizes. A cached prefix costs
    /// the tokens after it little: 64 fresh tokens after 960 cached took 56–155 ms.
    ///
    /// An idle server answers slower (`benches/real_fleet/profile_engine.py --idle`
    /// measures it): a fresh prompt's first token after an idle gap, ms, medians of 3–4
    /// on one server:
    ///
    /// | gap, s        | 0.05 |   1 |   5 |  20 |  40 |
    /// |---------------|-----:|----:|----:|----:|----:|
    /// | 144 tokens    |   81 |  86 | 188 | 323 | 334 |
    ///
    /// and 480 tokens: 148 back to back, 236 after 5 s, 349 after 20 s. Hence
    /// 20 ms more per second idle, at most 250. A plain matrix product on one core of
    /// this host slowed by half after 10–20 s idle too, so the cause is the host as
    /// much as vLLM.
    pub const VLLM_CPU: EngineTiming = EngineTiming {
        prefill_ms_per_token_squared: 8.494e-05,
        prefill_ms_per_token: 0.1537,
        prefill_ms_per_pass: 42.1,
        prefill_ms_per_request: 0.0,
        decode_ms_per_step: 31.3,
        decode_ms_per_usage: 0.0,
        decode_ms_per_usage_squared: 0.0,
        decode_ms_per_running_request: 0.7,
        decode_ms_min: 1.0,
        cold_ms_per_idle_s: 20.0,
        cold_ms_max: 250.0,
    };

    /// The presets by name.
    pub const PRESETS: [(&'static str, EngineTiming); 2] =
        [("mocker", EngineTiming::MOCKER), ("vllm-cpu", EngineTiming::VLLM_CPU)];

    /// A preset by name, or else a JSON file at `spec` (see the type's docs).
    pub fn load(spec: &str) -> Result<EngineTiming, TimingError> {
        if let Some((_, t)) = EngineTiming::PRESETS.iter().find(|(n, _)| *n == spec) {
            return Ok(*t);
        }
        let path = std::path::Path::new(spec);
        if !path.exists() {
            return Err(TimingError::Unknown(spec.into()));
        }
        let text = std::fs::read_to_string(path).map_err(|e| TimingError::Read(format!("{spec}: {e}")))?;
        EngineTiming::from_json(&text).map_err(|e| match e {
            TimingError::Parse(m) => TimingError::Parse(format!("{spec}: {m}")),
            other => other,
        })
    }

    /// A timing from a JSON object of its fields, checked.
    pub fn from_json(text: &str) -> Result<EngineTiming, TimingError> {
        let t: EngineTiming = serde_json::from_str(text).map_err(|e| TimingError::Parse(e.to_string()))?;
        t.check()?;
        Ok(t)
    }

    /// Every coefficient finite; the fixed costs and the floor not negative.
    pub fn check(&self) -> Result<(), TimingError> {
        let all = [
            ("prefill_ms_per_token_squared", self.prefill_ms_per_token_squared),
            ("prefill_ms_per_token", self.prefill_ms_per_token),
            ("prefill_ms_per_pass", self.prefill_ms_per_pass),
            ("prefill_ms_per_request", self.prefill_ms_per_request),
            ("decode_ms_per_step", self.decode_ms_per_step),
            ("decode_ms_per_usage", self.decode_ms_per_usage),
            ("decode_ms_per_usage_squared", self.decode_ms_per_usage_squared),
            ("decode_ms_per_running_request", self.decode_ms_per_running_request),
            ("decode_ms_min", self.decode_ms_min),
            ("cold_ms_per_idle_s", self.cold_ms_per_idle_s),
            ("cold_ms_max", self.cold_ms_max),
        ];
        let fixed =
            ["prefill_ms_per_pass", "prefill_ms_per_request", "decode_ms_min", "cold_ms_per_idle_s", "cold_ms_max"];
        match all.iter().find(|(n, v)| !v.is_finite() || (fixed.contains(n) && *v < 0.0)) {
            Some(&(name, v)) => Err(TimingError::Value(name, v)),
            None => Ok(()),
        }
    }

    /// Prefill time of one pass computing `tokens` prompt tokens of `requests` requests.
    pub fn prefill_ms(&self, tokens: u64, requests: u64) -> f64 {
        if tokens == 0 {
            return 0.0;
        }
        let t = tokens as f64;
        let ms = (self.prefill_ms_per_token_squared * t + self.prefill_ms_per_token) * t
            + self.prefill_ms_per_pass
            + self.prefill_ms_per_request * requests as f64;
        ms.max(0.0)
    }

    /// What a pass starting `idle_ms` after the engine's last one ended adds:
    /// `min(cold_ms_max, cold_ms_per_idle_s × idle_ms / 1000)`.
    pub fn cold_ms(&self, idle_ms: f64) -> f64 {
        if idle_ms.is_nan() || idle_ms <= 0.0 {
            return 0.0;
        }
        (self.cold_ms_per_idle_s * idle_ms / 1000.0).min(self.cold_ms_max).max(0.0)
    }

    /// One decode step while `running` requests decode holding `active_blocks` of
    /// `capacity_blocks` KV blocks.
    pub fn decode_ms(&self, active_blocks: u64, capacity_blocks: u64, running: u64) -> f64 {
        let p = if capacity_blocks == 0 { 1.0 } else { (active_blocks as f64 / capacity_blocks as f64).min(1.0) };
        let ms = (self.decode_ms_per_usage_squared * p + self.decode_ms_per_usage) * p
            + self.decode_ms_per_step
            + self.decode_ms_per_running_request * running as f64;
        ms.max(self.decode_ms_min)
    }
}

/// The mocker's prefill time of one pass that computes `tokens` uncached prompt tokens
/// (0 if none).
pub fn prefill_ms(tokens: u64) -> f64 {
    EngineTiming::MOCKER.prefill_ms(tokens, 1)
}

/// The mocker's decode step when `active_blocks` of `capacity_blocks` KV blocks are held.
///
/// The share is clamped to `[0, 1]` and the result floored at 1 ms.
pub fn decode_ms(active_blocks: u64, capacity_blocks: u64) -> f64 {
    EngineTiming::MOCKER.decode_ms(active_blocks, capacity_blocks, 1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(got: f64, want: f64) {
        assert!((got - want).abs() < 0.05, "got {got}, want {want}");
    }

    #[test]
    fn published_points() {
        // MOCKER_MODEL section 7.
        for (t, want) in [(128, 18.5), (512, 24.4), (2048, 49.4), (8192, 169.1), (16384, 378.3), (32768, 966.1)] {
            check(prefill_ms(t), want);
        }
        for (blocks, want) in [(0, 5.74), (4096, 17.63), (8192, 26.31), (12288, 31.77), (16384, 34.01)] {
            check(decode_ms(blocks, 16384), want);
        }
        assert_eq!(prefill_ms(0), 0.0);
        check(decode_ms(40_000, 16384), 34.01);
    }

    #[test]
    fn the_cpu_preset_meets_the_engine_facts() {
        let c = EngineTiming::VLLM_CPU;
        // 1,024 uncached tokens in 240–480 ms, 2,048 in 590–710, a 64-token rest in 45–60.
        for (tokens, lo, hi) in [(1024, 240.0, 480.0), (2048, 590.0, 720.0), (64, 40.0, 60.0)] {
            let ms = c.prefill_ms(tokens, 1);
            assert!((lo..=hi).contains(&ms), "{tokens} tokens: {ms:.1} ms");
        }
        check(c.decode_ms(0, 256, 1), 32.0);
        check(c.decode_ms(256, 256, 4), 34.1);
    }

    #[test]
    fn the_routers_cpu_model_is_this_preset() {
        let (m, t) = (router_core::TtftModel::vllm_cpu(), EngineTiming::VLLM_CPU);
        assert_eq!(
            (m.prefill_ms_per_token_squared, m.prefill_ms_per_token, m.prefill_ms_per_pass),
            (t.prefill_ms_per_token_squared, t.prefill_ms_per_token, t.prefill_ms_per_pass)
        );
        assert_eq!((m.decode_ms_per_step, m.decode_ms_per_usage, m.decode_ms_min), (t.decode_ms_per_step, 0.0, 1.0));
        assert_eq!((m.cold_ms_per_idle_s, m.cold_ms_max), (t.cold_ms_per_idle_s, t.cold_ms_max));
        assert_eq!(m.cold_ms(5_000), t.cold_ms(5_000.0));
    }

    #[test]
    fn an_idle_engines_next_pass_is_slower_up_to_the_cap() {
        let c = EngineTiming::VLLM_CPU;
        for (idle_ms, want) in [
            (0.0, 0.0),
            (-5.0, 0.0),
            (f64::NAN, 0.0),
            (500.0, 10.0),
            (5_000.0, 100.0),
            (60_000.0, 250.0),
            (f64::INFINITY, 250.0),
        ] {
            assert_eq!(c.cold_ms(idle_ms), want, "idle {idle_ms} ms");
        }
        assert_eq!(EngineTiming::MOCKER.cold_ms(f64::INFINITY), 0.0, "a GPU's is none");
    }

    #[test]
    fn the_default_is_the_mocker_and_requests_cost_nothing_there() {
        let m = EngineTiming::default();
        assert_eq!(m, EngineTiming::MOCKER);
        check(m.prefill_ms(512, 7), prefill_ms(512));
        check(m.decode_ms(4096, 16384, 50), decode_ms(4096, 16384));
    }

    #[test]
    fn per_request_and_per_running_terms_add_up() {
        let t =
            EngineTiming { prefill_ms_per_request: 3.0, decode_ms_per_running_request: 2.0, ..EngineTiming::MOCKER };
        check(t.prefill_ms(512, 4), prefill_ms(512) + 12.0);
        check(t.decode_ms(0, 16384, 5), 5.74 + 10.0);
        assert_eq!(t.prefill_ms(0, 4), 0.0, "no tokens, no prefill");
    }

    #[track_caller]
    fn check_load(spec: &str, want: Result<EngineTiming, &str>) {
        match (EngineTiming::load(spec), want) {
            (Ok(got), Ok(w)) => assert_eq!(got, w, "{spec}"),
            (Err(e), Err(part)) => assert!(e.to_string().contains(part), "{spec}: {e} lacks {part:?}"),
            (got, want) => panic!("{spec}: got {got:?}, want {want:?}"),
        }
    }

    #[test]
    fn presets_files_and_bad_files() {
        let dir = std::env::temp_dir().join(format!("kvroute-timing-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let file = |name: &str, text: &str| {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            p.to_string_lossy().into_owned()
        };
        check_load("mocker", Ok(EngineTiming::MOCKER));
        check_load("vllm-cpu", Ok(EngineTiming::VLLM_CPU));
        check_load("gpu-fast", Err("neither a preset (mocker, vllm-cpu) nor a file"));
        let partial = file("partial.json", r#"{"prefill_ms_per_token": 0.25, "decode_ms_per_running_request": 1.5}"#);
        let want =
            EngineTiming { prefill_ms_per_token: 0.25, decode_ms_per_running_request: 1.5, ..EngineTiming::MOCKER };
        check_load(&partial, Ok(want));
        check_load(&file("typo.json", r#"{"prefil_ms_per_token": 1}"#), Err("unknown field `prefil_ms_per_token`"));
        check_load(&file("text.json", "prefill = 1"), Err("engine timing file:"));
        check_load(&file("neg.json", r#"{"prefill_ms_per_pass": -1}"#), Err("prefill_ms_per_pass = -1 must be"));
        check_load(&dir.to_string_lossy(), Err("cannot read engine timing"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
