//! The endpoints that reach a worker: every inference endpoint vLLM serves, by path,
//! and what each one routes on. All of them take `POST` with a JSON body, pass the
//! same authentication, tenant limits and model restrictions, and go through the same
//! stack (handler, limits, route, tries, stream); the worker's answer, streamed or
//! whole, passes through unchanged.
//!
//! | path | endpoint | routed on |
//! |---|---|---|
//! | `/v1/chat/completions` | chat | the rendered chat's prefix |
//! | `/v1/completions` | completions | the prompt's prefix (a batch: its first prompt) |
//! | `/v1/responses` | Responses API | its `instructions` and `input` rendered as the chat vLLM builds from them, so a conversation resent with one more turn lands where its prefix is cached; streamed or not |
//! | `/v1/embeddings` | embeddings | the input's prefix (a batch: its first input) |
//! | `/v1/score`, `/score` | scoring | the query side (`queries`, `text_1` or `data_1`): every pair starts with it |
//! | `/v1/rerank`, `/rerank`, `/v2/rerank` | reranking | `query`, which leads every query-document pair |
//! | `/tokenize`, `/detokenize` | tokenizer | load alone: they touch no KV cache, so a prefix would only pull them to a busy worker |
//!
//! A multimodal query (an object instead of text) routes by load too. A body without a
//! `model` is refused (400), except for `/tokenize` and `/detokenize`, which vLLM
//! serves without one: they reach the `default_model`'s pool, and without a default
//! get the 400. Migration of a broken stream applies to chat and
//! completions only, and only they take the disaggregated path.
//!
//! Not routed: the stored responses of `GET /v1/responses/{id}` and
//! `POST /v1/responses/{id}/cancel` live on the one engine that made them, which the
//! router does not record; they get 404, as does every other unknown path. A client
//! that continues a stored conversation (`previous_response_id`) keeps it on its
//! engine by sending its requests with one session id (the session header).

use http::{Method, StatusCode};

use crate::error::ApiError;
use crate::request::Endpoint;

/// The endpoint a request to `method path` is for: `Ok(None)` for a path the proxy
/// does not forward, 405 for a forwarded path with another method than `POST`. The
/// paths are [`Endpoint::at`]'s, which the endpoint picker shares.
pub(crate) fn proxied(method: &Method, path: &str) -> Result<Option<Endpoint>, ApiError> {
    match Endpoint::at(path) {
        Some(e) if method == Method::POST => Ok(Some(e)),
        Some(_) => Err(wrong_method(path)),
        None => Ok(None),
    }
}

/// 405: a forwarded path takes `POST` only.
fn wrong_method(path: &str) -> ApiError {
    ApiError {
        status: StatusCode::METHOD_NOT_ALLOWED,
        kind: "invalid_request_error",
        code: "method_not_allowed",
        message: format!("{path} takes POST"),
        retry_after_s: None,
        detail: None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(method: Method, path: &str, want: Result<Option<Endpoint>, u16>) {
        assert_eq!(proxied(&method, path).map_err(|e| e.status.as_u16()), want, "{method} {path}");
    }

    #[test]
    fn every_vllm_inference_path_is_forwarded_by_post_only() {
        use Endpoint::*;
        let post = Method::POST;
        check(post.clone(), "/v1/chat/completions", Ok(Some(Chat)));
        check(post.clone(), "/v1/completions", Ok(Some(Completions)));
        check(post.clone(), "/v1/embeddings", Ok(Some(Embeddings)));
        check(post.clone(), "/v1/responses", Ok(Some(Responses)));
        check(post.clone(), "/v1/score", Ok(Some(Score)));
        check(post.clone(), "/score", Ok(Some(Score)));
        check(post.clone(), "/v1/rerank", Ok(Some(Rerank)));
        check(post.clone(), "/rerank", Ok(Some(Rerank)));
        check(post.clone(), "/v2/rerank", Ok(Some(Rerank)));
        check(post.clone(), "/tokenize", Ok(Some(Tokenize)));
        check(post.clone(), "/detokenize", Ok(Some(Detokenize)));
        check(Method::GET, "/v1/responses", Err(405));
        check(Method::PUT, "/tokenize", Err(405));
        check(post.clone(), "/v1/responses/resp_1/cancel", Ok(None));
        check(Method::GET, "/v1/models", Ok(None));
        check(post, "/v1/nothing", Ok(None));
    }
}
