//! The proxy's two fuzz targets: what a client sends ([`proxy_request`]) and what the
//! operator writes ([`config_parse`]). Both stop short of sockets and tokio: they call
//! the pure functions the handler and `kvroute serve` call.

use http::header::{HeaderMap, HeaderName, HeaderValue, CONNECTION, CONTENT_LENGTH, HOST};
use kvroute_media::data_url::is_data_url;
use kvroute_media::{ImageModel, ImagePart, PlaceholderRule};
use kvroute_proxy::config::{router_config, ConfigError, ProxyConfig, TrustConfig};
use kvroute_proxy::error::ApiError;
use kvroute_proxy::media::{expand, image_parts, ChatMedia, MediaSection};
use kvroute_proxy::request::{self, Build, Endpoint, Prompt};
use kvroute_proxy::tokenize::{fallback_chat, fallback_text};
use kvroute_proxy::trust::Trust;
use kvroute_proxy::upstream::{upstream_headers, PIN_HEADERS, PREVIEW_HEADER};
use router_core::{BlockSize, MediaItems, RequestId, RoutingHints};
use serde_json::Value;

// ---- proxy_request ----

/// Headers read per input at most (hyper's own default cap is 100).
pub const HEADERS_MAX: usize = 64;

/// The shared token the fuzzed proxy trusts, so inputs can reach the trusted paths.
pub const TOKEN: &str = "fuzz-token";

/// `data` as a request the way the handler reads one. The input is HTTP-like text:
///
/// ```text
/// chat|completions|embeddings|responses|score|rerank|tokenize|detokenize|guess [trusted]
/// header-name: value
/// ...
///
/// {"model": "m", ...}
/// ```
///
/// Header lines that are not a valid name and value are skipped (hyper refuses them
/// before the handler runs). Checks: every outcome is a 400 or a parse whose forwarded
/// body has no `kvroute` object; untrusted clients keep no pin, preview or priority;
/// a forwarded header set carries no hop-by-hop, pin, internal or token header; a
/// chat's image parts are read as the front end reads them ([`check_images`]).
pub fn proxy_request(data: &[u8]) {
    let (control, rest) = split_line(data);
    let (headers, body) = read_headers(rest);
    let endpoint = match control.split(|&b| b == b' ').next().unwrap_or_default() {
        b"chat" => Some(Endpoint::Chat),
        b"completions" => Some(Endpoint::Completions),
        b"embeddings" => Some(Endpoint::Embeddings),
        b"responses" => Some(Endpoint::Responses),
        b"score" => Some(Endpoint::Score),
        b"rerank" => Some(Endpoint::Rerank),
        b"tokenize" => Some(Endpoint::Tokenize),
        b"detokenize" => Some(Endpoint::Detokenize),
        _ => None,
    };
    let trust = Trust::new(&TrustConfig { cidrs: vec![], token_header: None, token: Some(TOKEN.into()) });
    let peer = std::net::IpAddr::from([203, 0, 113, 7]);
    let trusted = control.ends_with(b" trusted") || trust.is_trusted(peer, &headers);

    check_forwarded_headers(&headers, trust.token_header(), body.len());
    let hints = check_header_hints(&headers, trusted);

    let Ok(mut json) = serde_json::from_slice::<Value>(body) else { return };
    let Some(endpoint) = endpoint.or_else(|| Endpoint::guess(&json)) else { return };
    let mut parsed = match request::parse(endpoint, &mut json) {
        Ok(p) => p,
        Err(e) => {
            assert_eq!(e.status, 400, "{e}");
            return;
        }
    };
    assert!(json.get("kvroute").is_none(), "the kvroute object is forwarded");
    let modelless = matches!(endpoint, Endpoint::Tokenize | Endpoint::Detokenize);
    assert!(!parsed.model.is_empty() || modelless);
    let forwarded = json.to_string();
    let again: Value = serde_json::from_str(&forwarded).expect("the forwarded body is JSON");
    assert!(again.get("kvroute").is_none());

    if !trusted {
        let had = [parsed.kv.priority.is_some(), parsed.kv.priority_jump.is_some(), parsed.kv.policy_class.is_some()];
        let gone = parsed.kv.strip_untrusted();
        assert_eq!(gone.len(), had.iter().filter(|&&h| h).count(), "{gone:?}");
        assert!(parsed.kv.priority.is_none() && parsed.kv.priority_jump.is_none() && parsed.kv.policy_class.is_none());
    }

    let tokens = match &parsed.prompt {
        Prompt::Tokens(t) => {
            assert!(!t.is_empty(), "token prompts are never empty");
            t.clone()
        }
        Prompt::Text(t) => fallback_text(t),
        Prompt::Chat => fallback_chat(&json),
        Prompt::ChatBody(chat) => fallback_chat(chat),
        Prompt::Absent => Vec::new(),
    };
    let block_size = BlockSize::new(4).expect("4 is a valid block size");
    let lora = parsed.kv.lora_name.clone();
    let build = Build {
        id: RequestId(1),
        block_size,
        lora: lora.as_deref(),
        parsed: &parsed,
        hints,
        session: headers.get("x-session-id").map(|v| v.as_bytes().to_vec()),
    };
    let req = request::build(build, &tokens);
    assert_eq!(req.blocks.len(), tokens.len() / 4);
    assert_eq!(req.isl_tokens as usize, tokens.len().min(u32::MAX as usize));
    if !trusted {
        assert_eq!((req.priority.strict, req.priority.jump_ms, &req.priority.class), (0, 0, &None));
    }
    if parsed.prompt == Prompt::Chat {
        check_images(&json, &tokens, &parsed, block_size);
    }
}

/// The placeholder token of the fuzzed image model.
const IMAGE_TOKEN: u32 = 7;

/// A chat's image parts as the front end reads them for a LLaVA-like model (five
/// tokens an image, at most four images): each resolves or is a 400/413 (an http(s)
/// URL is never allowed by default); resolved images expand a prompt of the fallback
/// tokens plus one placeholder each into blocks hashed with their media keys, which
/// differ from the text's from the first block an image touches.
fn check_images(json: &Value, text: &[u32], parsed: &request::Parsed, block_size: BlockSize) {
    let model =
        ImageModel { rule: PlaceholderRule::Fixed { tokens: 5 }, token_id: IMAGE_TOKEN, prompt_text: "<image>" };
    let media = ChatMedia::new(&model, "m", &MediaSection { items_max: 4, ..MediaSection::default() });
    let parts = match image_parts(json, 4) {
        Ok(p) => p,
        Err(e) => return assert_eq!(e.status, 400, "{e}"),
    };
    let mut images = Vec::new();
    for p in &parts {
        let resolved = match p.url {
            Some(url) if !is_data_url(url) => {
                assert!(!media.fetcher.allows(url), "nothing is fetched by default: {url}");
                return;
            }
            url => media.config.resolve(ImagePart { url, uuid: p.uuid.as_deref() }),
        };
        match resolved {
            Ok(img) => images.push(img),
            Err(e) => return assert!(matches!(ApiError::media(&e).status.as_u16(), 400 | 413), "{e}"),
        }
    }
    let mut prompt: Vec<u32> = text.iter().map(|&t| if t == IMAGE_TOKEN { t + 1 } else { t }).collect();
    prompt.extend(std::iter::repeat_n(IMAGE_TOKEN, images.len()));
    let (tokens, items) = expand(&media, &prompt, &images).expect("one placeholder per image expands");
    assert_eq!(tokens.len(), prompt.len() + 4 * images.len());
    assert_eq!(items.items().len(), images.len());
    let build = |media: &MediaItems| {
        let b =
            Build { id: RequestId(1), block_size, lora: None, parsed, hints: RoutingHints::default(), session: None };
        request::build_with_media(b, &tokens, media).blocks
    };
    let (with, without) = (build(&items), build(&MediaItems::none()));
    assert_eq!(with.len(), tokens.len() / 4);
    // Blocks before the first image's first block hash alike; from there they differ.
    let first = items.items().first().map_or(with.len(), |i| i.offset_tokens as usize / 4);
    let same = with.iter().zip(&without).take_while(|(a, b)| a == b).count();
    assert_eq!(same, first.min(with.len()), "text blocks never equal image blocks");
}

/// The first line of `data` (without its `\n`) and the rest.
fn split_line(data: &[u8]) -> (&[u8], &[u8]) {
    match data.iter().position(|&b| b == b'\n') {
        Some(at) => (&data[..at], &data[at + 1..]),
        None => (data, &[]),
    }
}

/// `name: value` lines up to an empty line, then the body.
fn read_headers(mut rest: &[u8]) -> (HeaderMap, &[u8]) {
    let mut headers = HeaderMap::new();
    for _ in 0..HEADERS_MAX {
        let (line, tail) = split_line(rest);
        if line.is_empty() {
            return (headers, tail);
        }
        rest = tail;
        let Some(colon) = line.iter().position(|&b| b == b':') else { continue };
        let value = line[colon + 1..].strip_prefix(b" ").unwrap_or(&line[colon + 1..]);
        if let (Ok(n), Ok(v)) = (HeaderName::from_bytes(&line[..colon]), HeaderValue::from_bytes(value)) {
            headers.append(n, v);
        }
    }
    (headers, rest)
}

/// `header_hints`: untrusted clients get nothing and are told which headers they sent;
/// trusted ones get their pins, or a 400.
fn check_header_hints(headers: &HeaderMap, trusted: bool) -> RoutingHints {
    match request::header_hints(headers, trusted) {
        Ok((hh, sent)) if !trusted => {
            assert_eq!(hh, request::HeaderHints::default());
            for name in &sent {
                assert!(headers.contains_key(*name), "{name} reported but not sent");
            }
            let pins = PIN_HEADERS.iter().chain([&PREVIEW_HEADER]).filter(|p| headers.contains_key(**p)).count();
            assert_eq!(sent.len(), pins);
            hh.hints
        }
        Ok((hh, sent)) => {
            assert!(sent.is_empty());
            hh.hints
        }
        Err(e) => {
            assert!(trusted, "untrusted pins are stripped, never refused: {e}");
            assert_eq!(e.status, 400);
            RoutingHints::default()
        }
    }
}

/// `upstream_headers`: none of the proxy's own or hop-by-hop headers leave.
fn check_forwarded_headers(client: &HeaderMap, token_header: &HeaderName, body_len: usize) {
    let out = upstream_headers(client, token_header, body_len);
    let named: Vec<String> = client
        .get_all(CONNECTION)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|n| n.trim().to_ascii_lowercase())
        .collect();
    for name in out.keys() {
        let n = name.as_str();
        assert!(!PIN_HEADERS.contains(&n) && !n.starts_with("x-kvroute-"), "{n} forwarded");
        assert!(n != token_header.as_str() && *name != HOST, "{n} forwarded");
        // The proxy sets its own length for the body it forwards, whatever the client's
        // `Connection` header named.
        let own = *name == CONTENT_LENGTH;
        assert!(!HOP_BY_HOP.contains(&n) && (own || !named.iter().any(|c| c == n)), "hop-by-hop {n} forwarded");
    }
    assert_eq!(out.get_all(CONTENT_LENGTH).iter().count(), 1);
    assert_eq!(out[CONTENT_LENGTH], HeaderValue::from(body_len));
}

/// Connection-scoped headers (RFC 9110 §7.6.1), plus `upgrade`.
const HOP_BY_HOP: [&str; 9] = [
    "connection",
    "keep-alive",
    "proxy-connection",
    "proxy-authenticate",
    "proxy-authorization",
    "te",
    "trailer",
    "transfer-encoding",
    "upgrade",
];

// ---- config_parse ----

/// `data` (lossily decoded) as a TOML configuration, with command-line style overrides
/// taken from its `#! key = value` comment lines. An accepted configuration validates
/// again and yields a router configuration for every model; a refusal is a typed error
/// whose line, if any, lies within the text.
pub fn config_parse(data: &[u8]) {
    let text = String::from_utf8_lossy(data);
    check_config(&text, ProxyConfig::from_toml_str(&text));
    let overrides: Vec<(&str, &str)> = text
        .lines()
        .filter_map(|l| l.strip_prefix("#!"))
        .filter_map(|l| l.split_once('='))
        .map(|(k, v)| (k.trim(), v.trim()))
        .take(16)
        .collect();
    if !overrides.is_empty() {
        check_config(&text, ProxyConfig::from_toml_with_overrides(&text, &overrides));
    }
}

fn check_config(text: &str, parsed: Result<ProxyConfig, ConfigError>) {
    let cfg = match parsed {
        Ok(cfg) => cfg,
        Err(e) => {
            let shown = e.to_string();
            if let ConfigError::Parse { line: Some(line), .. } = e {
                let lines = text.lines().count().max(1);
                assert!(line >= 1 && line <= lines + 1, "line {line} of {lines}: {shown}");
            }
            return;
        }
    };
    cfg.validate().expect("an accepted configuration validates again");
    let _trust = Trust::new(&cfg.trust);
    for model in &cfg.models {
        let rc = router_config(&cfg, model, 7);
        let want = model.block_size.unwrap_or(cfg.router.block_size);
        assert_eq!(rc.block_size.tokens(), want, "a validated block size is kept");
    }
    for w in &cfg.workers {
        assert!(cfg.models.iter().any(|m| m.name == w.model));
        let spec = w.spec();
        assert_eq!(spec.taints.len(), w.taints.len());
        let _ = w.url.join("/v1/completions");
    }
}
