//! The mocker's default "Polynomial" timing model, in milliseconds at speedup 1.
//!
//! Prefill time depends only on the tokens computed in a pass; decode time only on the
//! share of KV blocks held. Scaling by the engine's speedup is left to the caller.

/// Prefill time of one pass that computes `tokens` uncached prompt tokens (0 if none).
pub fn prefill_ms(tokens: u64) -> f64 {
    if tokens == 0 {
        return 0.0;
    }
    let t = tokens as f64;
    4.209989e-07 * t * t + 1.518344e-02 * t + 16.50142
}

/// Time of one decode step when `active_blocks` of `capacity_blocks` KV blocks are held.
///
/// The share is clamped to `[0, 1]` and the result floored at 1 ms.
pub fn decode_ms(active_blocks: u64, capacity_blocks: u64) -> f64 {
    let p = if capacity_blocks == 0 { 1.0 } else { (active_blocks as f64 / capacity_blocks as f64).min(1.0) };
    (-25.74 * p * p + 54.01 * p + 5.74).max(1.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(got: f64, want: f64) {
        assert!((got - want).abs() < 0.05, "got {got}, want {want}");
    }

    #[test]
    fn published_points() {
        // MOCKER_MODEL section 7.
        for (t, want) in [(128, 18.5), (512, 24.4), (2048, 49.4), (8192, 169.1), (16384, 378.3), (32768, 966.1)] {
            check(prefill_ms(t), want);
        }
        for (blocks, want) in [(0, 5.74), (4096, 17.63), (8192, 26.31), (12288, 31.77), (16384, 34.01)] {
            check(decode_ms(blocks, 16384), want);
        }
        assert_eq!(prefill_ms(0), 0.0);
        check(decode_ms(40_000, 16384), 34.01);
    }
}
