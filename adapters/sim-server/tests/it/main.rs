//! Integration tests: real sockets on 127.0.0.1, a worker per test, high speedups so
//! every test takes well under a second. Every wait is bounded (see `support::T`).

mod api;
mod disagg;
mod endpoints;
mod events;
mod images;
mod info;
mod preprocess;
mod support;
