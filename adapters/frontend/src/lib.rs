//! `kvroute-frontend` is what a request goes through before transport, shared by the
//! HTTP proxy (`kvroute-proxy`) and the gateway's endpoint picker (`kvroute-epp`):
//! the configuration file ([`config`]), the fleet of pools, one router per model
//! ([`fleet`]), request parsing ([`request`], [`headers`]) and [`trust`], the tokenizer
//! seam ([`tokenize`]), the images of chat requests ([`media`]), KV-event subscriptions ([`events`]), [`metrics`], engine-load
//! scraping of the workers' metrics ([`scrape`], each server bringing its client),
//! [`ApiError`], the OpenAI-shaped refusal both servers answer with; and [`otel`],
//! distributed tracing for the proxy; [`tenants`], the `[[tenants]]` and their keys;
//! [`tls`], rustls for `[tls]` and for `https` workers and collectors.
//!
//! Both servers start it the same way, with [`start`], and ask it the same question
//! for every request ([`ask::question`]): a buffered body and its headers in, the pool
//! and the router's `Request` out.
//!
//! What it leaves to the servers: sockets, forwarding and streaming (the proxy), the
//! gateway protocol (the picker).
#![forbid(unsafe_code)]
#![warn(missing_docs, unreachable_pub)]

pub mod agree;
pub mod ask;
pub mod config;
pub mod cost_header;
pub mod error;
pub mod events;
pub mod fleet;
pub mod headers;
pub mod learn;
pub mod media;
pub mod metrics;
pub mod otel;
pub mod otlp;
pub mod request;
pub mod scrape;
pub mod shape;
pub mod span_drops;
mod start;
pub mod tenants;
pub mod tls;
pub mod tokenize;
pub mod trust;

pub use config::{ConfigError, ProxyConfig, WorkerConfig};
pub use error::ApiError;
pub use fleet::FleetError;
pub use start::{start, FrontEnd, StartError};
pub use tokenize::{Tokenize, TokenizeError, Tokenizers};
