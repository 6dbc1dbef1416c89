//! Integration tests of `kvroute-tokenize`, one module per concern.

mod cache;
mod fixture;
mod inner;
mod load;
mod parity;
