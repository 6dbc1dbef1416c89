//! Integration tests for kvroute; see `it/`. This library is empty on purpose.
