//! `x-kvroute-cost`: per-request replacements for the kv cost's weights, for trusted
//! clients only. The value is a JSON object or `key=value` pairs separated by `,` or `;`,
//! with keys `prefill_load_scale`, `overlap_credit`, `active_request_weight` and
//! `temperature`, each a finite number of at least 0. An untrusted client's header is
//! ignored and counted, as other trusted headers are; like every `x-kvroute-*` header it
//! never reaches a worker.

use http::HeaderMap;
use router_core::KvCostOverrides;
use serde_json::Value;

use crate::error::ApiError;

/// The header's name.
pub const COST_HEADER: &str = "x-kvroute-cost";

/// The overrides `h` asks for, and whether an untrusted client sent the header (to be
/// counted). A trusted client's malformed header is a 400.
pub fn overrides(h: &HeaderMap, trusted: bool) -> Result<(KvCostOverrides, bool), ApiError> {
    let Some(v) = h.get(COST_HEADER) else { return Ok((KvCostOverrides::default(), false)) };
    if !trusted {
        return Ok((KvCostOverrides::default(), true));
    }
    let bad = |why: String| ApiError::bad_request(format!("header {COST_HEADER}: {why}"));
    let text = v.to_str().map_err(|_| bad("not visible ASCII".into()))?.trim();
    let pairs: Vec<(String, Value)> = if text.starts_with('{') {
        match serde_json::from_str::<serde_json::Map<String, Value>>(text) {
            Ok(m) => m.into_iter().collect(),
            Err(e) => return Err(bad(format!("not a JSON object: {e}"))),
        }
    } else {
        let mut v = Vec::new();
        for pair in text.split([',', ';']).map(str::trim).filter(|p| !p.is_empty()) {
            let (k, x) = pair.split_once('=').ok_or_else(|| bad(format!("{pair:?} is not key=value")))?;
            let n: f64 = x.trim().parse().map_err(|_| bad(format!("{} is not a number", k.trim())))?;
            v.push((k.trim().to_string(), Value::from(n)));
        }
        v
    };
    let mut o = KvCostOverrides::default();
    for (k, x) in pairs {
        let n = x.as_f64().filter(|n| n.is_finite() && *n >= 0.0);
        let n = n.ok_or_else(|| bad(format!("{k} must be a finite number of at least 0")))?;
        let slot = match k.as_str() {
            "prefill_load_scale" => &mut o.prefill_load_scale,
            "overlap_credit" => &mut o.overlap_credit,
            "active_request_weight" => &mut o.active_request_weight,
            "temperature" => &mut o.temperature,
            other => return Err(bad(format!("unknown key {other:?}"))),
        };
        *slot = Some(n);
    }
    Ok((o, false))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(value: &str, trusted: bool, want: Result<(KvCostOverrides, bool), &str>) {
        let mut h = HeaderMap::new();
        h.insert(COST_HEADER, value.parse().unwrap());
        match (overrides(&h, trusted), want) {
            (Ok(got), Ok(want)) => assert_eq!(got, want, "{value}"),
            (Err(e), Err(w)) => {
                assert_eq!(e.status, 400);
                assert!(e.message.contains(w), "{} should mention {w}", e.message);
            }
            (got, want) => panic!("{value}: got {got:?}, want {want:?}"),
        }
    }

    fn o(credit: Option<f64>, temperature: Option<f64>) -> KvCostOverrides {
        KvCostOverrides { overlap_credit: credit, temperature, ..KvCostOverrides::default() }
    }

    #[test]
    fn cost_headers_of_every_shape() {
        check("overlap_credit=2, temperature=0.5", true, Ok((o(Some(2.0), Some(0.5)), false)));
        check("overlap_credit=2;temperature=0", true, Ok((o(Some(2.0), Some(0.0)), false)));
        check(r#"{"overlap_credit": 3}"#, true, Ok((o(Some(3.0), None), false)));
        check("", true, Ok((o(None, None), false)));
        // An untrusted client's header is ignored and reported for counting.
        check("overlap_credit=2", false, Ok((o(None, None), true)));
        check("overlap_credit=-1", true, Err("at least 0"));
        check("overlap_credit=NaN", true, Err("finite"));
        check("overlap_credit=inf", true, Err("finite"));
        check("overlap_credit", true, Err("key=value"));
        check("overlap_credit=x", true, Err("not a number"));
        check("speed=1", true, Err("unknown key"));
        check(r#"{"temperature": "hot"}"#, true, Err("finite"));
        check("{oops", true, Err("JSON"));
        assert_eq!(overrides(&HeaderMap::new(), false).unwrap(), (o(None, None), false));
    }
}
