//! What forwarding needs from a request body beyond the routing question: whether it
//! streams and the output limit it names. Read from the body parsed once for routing, so
//! that no layer below (retries, tenant limits, migration) parses the body again.

use serde_json::Value;

/// Whether a request streams, and its output limit.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BodyShape {
    /// It asks for a stream (`"stream": true`).
    pub stream: bool,
    /// The output limit it names (`max_completion_tokens` or the Responses API's
    /// `max_output_tokens`, else `max_tokens`); `None` when it names none, or one it
    /// names is not a whole number.
    pub max_output_tokens: Option<u64>,
}

impl BodyShape {
    /// The shape of a parsed request body.
    pub fn of(body: &Value) -> Self {
        let field = |k: &str| body.get(k).filter(|v| !v.is_null());
        // A limit that is there but not a whole number voids both: the engine refuses it.
        let limit = |v: Option<&Value>| v.map_or(Ok(None), |v| v.as_u64().map(Some).ok_or(()));
        let completion = field("max_completion_tokens").or_else(|| field("max_output_tokens"));
        let max_output_tokens = match (limit(completion), limit(field("max_tokens"))) {
            (Ok(completion), Ok(tokens)) => completion.or(tokens),
            _ => None,
        };
        BodyShape { stream: body.get("stream") == Some(&Value::Bool(true)), max_output_tokens }
    }
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    /// The shape of `body` is `want` (stream, output limit).
    #[track_caller]
    fn check(body: Value, want: (bool, Option<u64>)) {
        let s = BodyShape::of(&body);
        assert_eq!((s.stream, s.max_output_tokens), want, "{body}");
    }

    #[test]
    fn only_streams_are_streams() {
        check(json!({"stream": true, "prompt": "x"}), (true, None));
        check(json!({"stream": false}), (false, None));
        check(json!({"stream": "true"}), (false, None));
        check(json!({"prompt": "x"}), (false, None));
        check(json!([1]), (false, None));
    }

    #[test]
    fn the_output_limit_is_max_completion_tokens_else_max_tokens() {
        check(json!({"max_tokens": 7}), (false, Some(7)));
        check(json!({"max_tokens": 7, "max_completion_tokens": 9}), (false, Some(9)));
        check(json!({"max_tokens": 7, "max_output_tokens": 5}), (false, Some(5)));
        check(json!({"max_tokens": null}), (false, None));
        check(json!({"max_tokens": 4, "max_completion_tokens": null}), (false, Some(4)));
        check(json!({"max_tokens": -1}), (false, None));
        check(json!({"max_tokens": 7, "max_completion_tokens": "x"}), (false, None));
        check(json!({"stream": true, "max_tokens": 3}), (true, Some(3)));
    }
}
