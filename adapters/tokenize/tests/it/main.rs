//! Integration tests of `kvroute-tokenize`, one module per concern.

mod fixture;
mod parity;
