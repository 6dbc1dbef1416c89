//! The OpenAI-compatible surface: shapes of responses and streams, token counts,
//! prefix-cache reporting, refusals, metrics, h2c and shutdown.

use hyper::StatusCode;
use serde_json::{json, Value};

use crate::support::{
    bounded, fast_config, get, open_stream, post, request, request_h2, start, stream_arrivals, Reply,
};

/// Checks a non-streaming generation and returns its text.
#[track_caller]
fn check_full(r: &Reply, chat: bool, prompt_tokens: u64, completion_tokens: u64) -> String {
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.content_type, "application/json");
    let v = r.json();
    assert_eq!(v["object"], if chat { "chat.completion" } else { "text_completion" });
    assert_eq!(v["model"], "sim-test");
    assert_eq!(v["usage"]["prompt_tokens"], prompt_tokens, "{v}");
    assert_eq!(v["usage"]["completion_tokens"], completion_tokens, "{v}");
    assert_eq!(v["usage"]["total_tokens"], prompt_tokens + completion_tokens);
    let choice = &v["choices"][0];
    assert_eq!(choice["finish_reason"], "length");
    let text = if chat {
        assert_eq!(choice["message"]["role"], "assistant");
        choice["message"]["content"].as_str()
    } else {
        choice["text"].as_str()
    }
    .expect("text is a string")
    .to_string();
    assert_eq!(text.split_whitespace().count() as u64, completion_tokens, "one filler word per token: {text:?}");
    text
}

/// Checks a streamed generation (`tokens` content chunks, a final chunk, an optional
/// usage chunk, `[DONE]`) and returns the concatenated text.
#[track_caller]
fn check_stream(r: &Reply, chat: bool, tokens: usize, usage: Option<(u64, u64)>) -> String {
    assert_eq!(r.status, StatusCode::OK, "{:?}", r.body);
    assert_eq!(r.content_type, "text/event-stream");
    let events = r.sse();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> =
        events[..events.len() - 1].iter().map(|e| serde_json::from_str(e).expect("chunk is JSON")).collect();
    let want_chunks = tokens + 1 + usize::from(usage.is_some());
    assert_eq!(chunks.len(), want_chunks, "{events:?}");
    let object = if chat { "chat.completion.chunk" } else { "text_completion" };
    assert!(chunks.iter().all(|c| c["object"] == object && c["id"] == chunks[0]["id"]));
    let mut text = String::new();
    for (i, c) in chunks[..tokens].iter().enumerate() {
        let choice = &c["choices"][0];
        assert!(choice["finish_reason"].is_null());
        if chat {
            assert_eq!(choice["delta"].get("role").is_some(), i == 0, "role only in the first delta");
            text.push_str(choice["delta"]["content"].as_str().expect("content"));
        } else {
            text.push_str(choice["text"].as_str().expect("text"));
        }
    }
    assert_eq!(chunks[tokens]["choices"][0]["finish_reason"], "length");
    if let Some((prompt, completion)) = usage {
        let u = &chunks[tokens + 1];
        assert_eq!(u["choices"], json!([]));
        assert_eq!(
            (u["usage"]["prompt_tokens"].as_u64(), u["usage"]["completion_tokens"].as_u64()),
            (Some(prompt), Some(completion))
        );
    }
    text
}

#[track_caller]
fn check_error(r: &Reply, status: StatusCode, param: Option<&str>) {
    assert_eq!(r.status, status, "{:?}", r.body);
    let v = r.json();
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string() && e.get("code").is_some(), "{v}");
    assert_eq!(e["param"].as_str(), param, "{v}");
}

#[tokio::test]
async fn completions_full_and_streamed_agree() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let full = check_full(&post(a, "/v1/completions", r#"{"prompt":"hello world","max_tokens":5}"#).await, false, 3, 5);
    let body = r#"{"prompt":"hello world","max_tokens":5,"stream":true,"stream_options":{"include_usage":true}}"#;
    let streamed = check_stream(&post(a, "/v1/completions", body).await, false, 5, Some((3, 5)));
    assert_eq!(full, streamed, "the same prompt gives the same filler");
    let streamed = check_stream(
        &post(a, "/v1/completions", r#"{"prompt":"hello world","max_tokens":5,"stream":true}"#).await,
        false,
        5,
        None,
    );
    assert_eq!(full, streamed);
    // Default output length, and a one-token answer.
    check_full(&post(a, "/v1/completions", r#"{"prompt":"x"}"#).await, false, 1, 16);
    check_stream(&post(a, "/v1/completions", r#"{"prompt":"x","max_tokens":1,"stream":true}"#).await, false, 1, None);
    w.shutdown().await;
}

#[tokio::test]
async fn chat_full_and_streamed_agree() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let msgs = r#""messages":[{"role":"system","content":"be brief"},{"role":"user","content":"hi"}]"#;
    let prompt_tokens =
        kvroute_sim_server::fallback_chat(&serde_json::from_str(&format!("{{{msgs}}}")).expect("json")).len() as u64;
    let full = check_full(
        &post(a, "/v1/chat/completions", &format!(r#"{{{msgs},"max_completion_tokens":7}}"#)).await,
        true,
        prompt_tokens,
        7,
    );
    let body = format!(r#"{{{msgs},"max_tokens":7,"stream":true,"stream_options":{{"include_usage":true}}}}"#);
    let streamed = check_stream(&post(a, "/v1/chat/completions", &body).await, true, 7, Some((prompt_tokens, 7)));
    assert_eq!(full, streamed);
    w.shutdown().await;
}

#[tokio::test]
async fn token_id_prompts_count_their_ids() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let ids: Vec<u32> = (100..140).collect();
    let flat = json!({"prompt": ids, "max_tokens": 3}).to_string();
    let nested = json!({"prompt": [ids], "max_tokens": 3}).to_string();
    let t1 = check_full(&post(a, "/v1/completions", &flat).await, false, 40, 3);
    let t2 = check_full(&post(a, "/v1/completions", &nested).await, false, 40, 3);
    assert_eq!(t1, t2);
    // Reserved ids (generated-token range) are refused, not hashed.
    check_error(
        &post(a, "/v1/completions", r#"{"prompt":[1,2147483648]}"#).await,
        StatusCode::BAD_REQUEST,
        Some("prompt"),
    );
    w.shutdown().await;
}

#[tokio::test]
async fn a_repeated_prompt_hits_the_prefix_cache() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let body = json!({"prompt": "a prompt long enough to fill several four-token blocks", "max_tokens": 2}).to_string();
    let first = post(a, "/v1/completions", &body).await.json();
    let second = post(a, "/v1/completions", &body).await.json();
    let cached = |v: &Value| v["usage"]["prompt_tokens_details"]["cached_tokens"].as_u64().expect("cached_tokens");
    assert_eq!(cached(&first), 0);
    // 54 bytes, 14 prompt tokens: 3 full blocks are reusable (the last token is always
    // computed).
    assert_eq!(cached(&second), 12);
    let m = metrics(&get(a, "/metrics").await);
    assert_eq!(m["vllm:prefix_cache_hits_total"], 12.0);
    assert_eq!(m["vllm:prefix_cache_queries_total"], 28.0);
    w.shutdown().await;
}

fn metrics(r: &Reply) -> std::collections::BTreeMap<String, f64> {
    assert_eq!(r.status, StatusCode::OK);
    assert!(r.content_type.starts_with("application/openmetrics-text"));
    let text = std::str::from_utf8(&r.body).expect("utf-8");
    assert!(text.ends_with("# EOF\n"), "{text}");
    text.lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .map(|l| {
            let (name, value) = l.rsplit_once(' ').unwrap_or_else(|| panic!("bad metric line {l:?}"));
            (name.to_string(), value.parse::<f64>().unwrap_or_else(|_| panic!("bad value in {l:?}")))
        })
        .collect()
}

#[tokio::test]
async fn models_health_and_metrics() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let models = get(a, "/v1/models").await;
    assert_eq!(models.status, StatusCode::OK);
    let v = models.json();
    assert_eq!((v["object"].as_str(), v["data"][0]["id"].as_str()), (Some("list"), Some("sim-test")));
    assert_eq!(v["data"][0]["max_model_len"], 4096 * 4);
    assert_eq!(get(a, "/health").await.status, StatusCode::OK);
    for _ in 0..3 {
        // 32 bytes: 8 prompt tokens.
        let body = r#"{"prompt":"abcdefghabcdefghabcdefghabcdefgh","max_tokens":2}"#;
        check_full(&post(a, "/v1/completions", body).await, false, 8, 2);
    }
    let _ = post(a, "/v1/completions", "{").await;
    let m = metrics(&get(a, "/metrics").await);
    for (name, want) in [
        ("vllm:num_requests_running", 0.0),
        ("vllm:num_requests_waiting", 0.0),
        ("kvroute_sim:kv_active_blocks", 0.0),
        ("kvroute_sim:kv_total_blocks", 4096.0),
        ("kvroute_sim:requests_total", 4.0),
        ("kvroute_sim:requests_rejected_total", 1.0),
        ("vllm:request_success_total", 3.0),
        ("vllm:generation_tokens_total", 6.0),
        ("vllm:prompt_tokens_total", 24.0),
    ] {
        assert_eq!(m.get(name), Some(&want), "{name} in {m:?}");
    }
    // 8 prompt + 1 computed generated token: 2 blocks stay cached, none held.
    assert_eq!(m["kvroute_sim:kv_inactive_blocks"], 2.0);
    assert!(m["kvroute_sim:kv_event_batches_total"] >= 1.0);
    w.shutdown().await;
}

#[tokio::test]
async fn bad_requests_get_openai_errors() {
    let mut cfg = fast_config();
    cfg.body_bytes_max = 1024;
    cfg.engine.blocks_per_worker = 8;
    let w = start(cfg).await;
    let a = w.http_addr();
    for (path, body, param) in [
        ("/v1/completions", "{not json", None),
        ("/v1/completions", "", None),
        ("/v1/completions", r#"{"max_tokens":2}"#, Some("prompt")),
        ("/v1/completions", r#"{"prompt":"x","max_tokens":0}"#, Some("max_tokens")),
        ("/v1/completions", r#"{"prompt":"x","stream":1}"#, Some("stream")),
        ("/v1/chat/completions", r#"{"messages":[]}"#, Some("messages")),
        // 8 blocks of 4 tokens hold 32 tokens; 40 prompt tokens (160 bytes) do not fit.
        ("/v1/completions", &json!({"prompt": "x".repeat(160)}).to_string(), Some("prompt")),
    ] {
        check_error(&post(a, path, body).await, StatusCode::BAD_REQUEST, param);
    }
    check_error(&post(a, "/v1/completions", &"x".repeat(2000)).await, StatusCode::PAYLOAD_TOO_LARGE, None);
    check_error(&get(a, "/v1/nothing").await, StatusCode::NOT_FOUND, None);
    check_error(&request(a, "DELETE", "/v1/models", "").await, StatusCode::METHOD_NOT_ALLOWED, None);
    check_error(&get(a, "/v1/completions").await, StatusCode::METHOD_NOT_ALLOWED, None);
    // The worker still serves after all that.
    check_full(&post(a, "/v1/completions", r#"{"prompt":"ok","max_tokens":1}"#).await, false, 1, 1);
    w.shutdown().await;
}

#[tokio::test]
async fn h2c_is_served_on_the_same_port() {
    let w = start(fast_config()).await;
    let r = request_h2(w.http_addr(), "/v1/completions", r#"{"prompt":"over h2","max_tokens":4}"#).await;
    check_full(&r, false, 2, 4);
    let r = request_h2(w.http_addr(), "/v1/completions", r#"{"prompt":"over h2","max_tokens":4,"stream":true}"#).await;
    check_stream(&r, false, 4, None);
    w.shutdown().await;
}

#[tokio::test]
async fn concurrent_streams_all_finish() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    let tasks: Vec<_> = (0..16)
        .map(|i| {
            tokio::spawn(async move {
                let body = json!({"prompt": format!("request number {i} with some text"), "max_tokens": 8 + i, "stream": true}).to_string();
                let r = post(a, "/v1/completions", &body).await;
                check_stream(&r, false, 8 + i as usize, None);
            })
        })
        .collect();
    for t in tasks {
        bounded(t).await.expect("stream task");
    }
    w.shutdown().await;
}

#[tokio::test]
async fn shutdown_closes_the_port() {
    let w = start(fast_config()).await;
    let a = w.http_addr();
    assert_eq!(get(a, "/health").await.status, StatusCode::OK);
    bounded(w.shutdown()).await;
    assert!(tokio::net::TcpStream::connect(a).await.is_err(), "nothing listens after shutdown");
}

#[tokio::test]
async fn tokens_arrive_on_the_models_clock() {
    use kvroute_sim::engine::{decode_ms, prefill_ms};
    let mut cfg = fast_config();
    cfg.engine.speedup = 1.0;
    let w = start(cfg).await;
    let body = r#"{"prompt":"abcdefgh","max_tokens":10,"stream":true}"#;
    let events = stream_arrivals(w.http_addr(), "/v1/completions", body).await;
    assert_eq!(events.len(), 10 + 2, "ten tokens, the final chunk, [DONE]");
    // Time never runs ahead of the model: the first token needs the prefill pass, the
    // last one nine decode passes more (each at least the empty-cache step time).
    let first = events[0].0.as_secs_f64() * 1000.0;
    let last = events[9].0.as_secs_f64() * 1000.0;
    assert!(first >= prefill_ms(8), "first token at {first:.2} ms");
    assert!(last >= prefill_ms(8) + 9.0 * decode_ms(0, 4096), "last token at {last:.2} ms");
    assert!(events.windows(2).all(|p| p[0].0 <= p[1].0));
    w.shutdown().await;
}

#[tokio::test]
async fn first_and_last_tokens_are_timed_as_vllm_times_them() {
    use kvroute_sim::engine::{decode_ms, prefill_ms};
    let mut cfg = fast_config();
    cfg.engine.speedup = 1.0;
    let w = start(cfg).await;
    let a = w.http_addr();
    let events = stream_arrivals(a, "/v1/completions", r#"{"prompt":"abcdefgh","max_tokens":10,"stream":true}"#).await;
    let seen = |i: usize| events[i].0.as_secs_f64();
    let m = metrics(&get(a, "/metrics").await);
    let (ttft, e2e) = (m["vllm:time_to_first_token_seconds_sum"], m["vllm:e2e_request_latency_seconds_sum"]);
    // The worker's clock starts after the client's and stops before the client reads.
    assert!(prefill_ms(8) / 1000.0 <= ttft && ttft <= seen(0), "ttft {ttft} s, client {} s", seen(0));
    let last_ms = prefill_ms(8) + 9.0 * decode_ms(0, 4096);
    assert!(last_ms / 1000.0 <= e2e && e2e <= seen(10), "e2e {e2e} s, client {} s", seen(10));
    // A full response and a refused request: one more of each timing, none for the refusal.
    let _ = post(a, "/v1/completions", r#"{"prompt":"hgfedcba","max_tokens":3}"#).await;
    let _ = post(a, "/v1/completions", "{").await;
    let m = metrics(&get(a, "/metrics").await);
    for name in ["vllm:time_to_first_token_seconds_count", "vllm:e2e_request_latency_seconds_count"] {
        assert_eq!(m[name], 2.0, "{name}");
    }
    assert!(m["vllm:e2e_request_latency_seconds_sum"] >= e2e + (prefill_ms(8) + 2.0 * decode_ms(0, 4096)) / 1000.0);
    w.shutdown().await;
}

#[tokio::test]
async fn the_in_flight_limit_refuses_with_503() {
    let mut cfg = fast_config();
    cfg.engine.speedup = 1.0;
    cfg.requests_in_flight_max = 1;
    let w = start(cfg).await;
    let a = w.http_addr();
    // A slow stream (about 300 ms of decoding) holds the only slot once it streams.
    let (conn, _, body) = open_stream(a, "/v1/completions", r#"{"prompt":"slow","max_tokens":50,"stream":true}"#).await;
    check_error(&post(a, "/v1/completions", r#"{"prompt":"x"}"#).await, StatusCode::SERVICE_UNAVAILABLE, None);
    assert_eq!(get(a, "/health").await.status, StatusCode::OK, "non-generation routes are not limited");
    conn.abort();
    drop(body);
    w.shutdown().await;
}

#[tokio::test]
async fn a_client_leaving_mid_stream_does_not_disturb_the_worker() {
    let mut cfg = fast_config();
    cfg.engine.speedup = 10.0;
    let w = start(cfg).await;
    let a = w.http_addr();
    let (conn, _, body) =
        open_stream(a, "/v1/completions", r#"{"prompt":"leaving early","max_tokens":40,"stream":true}"#).await;
    conn.abort();
    drop(body);
    // The model has no abort: the request runs to its end, its tokens discarded.
    bounded(async {
        loop {
            let m = metrics(&get(a, "/metrics").await);
            if m["vllm:request_success_total"] == 1.0 {
                assert_eq!(m["vllm:num_requests_running"], 0.0);
                break;
            }
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
    })
    .await;
    check_full(&post(a, "/v1/completions", r#"{"prompt":"still here","max_tokens":3}"#).await, false, 3, 3);
    w.shutdown().await;
}

#[tokio::test]
async fn shutdown_lets_open_streams_finish() {
    use http_body_util::BodyExt;
    let mut cfg = fast_config();
    cfg.engine.speedup = 10.0;
    let w = start(cfg).await;
    let (_conn, first, body) =
        open_stream(w.http_addr(), "/v1/completions", r#"{"prompt":"finish me","max_tokens":30,"stream":true}"#).await;
    let shutdown = tokio::spawn(w.shutdown());
    let rest = bounded(body.collect()).await.expect("the stream completes").to_bytes();
    let all = [first, rest].concat();
    let all = std::str::from_utf8(&all).expect("utf-8");
    assert!(all.ends_with("data: [DONE]\n\n"), "{all}");
    assert_eq!(all.matches("data: {").count(), 30 + 1, "every token and the final chunk: {all}");
    bounded(shutdown).await.expect("shutdown completes");
}
