//! Shared helpers for the bench binaries (trace loading, timing, JSON).
