//! SplitMix64: the simulation's only source of randomness, seeded per run. It is the
//! core's own `Draw` expansion, so a seed means the same stream everywhere.

use router_core::Draw;

/// A SplitMix64 generator (Steele, Lea and Flood); tiny, fast, and good enough to
/// choose operations.
#[derive(Clone, Debug)]
pub struct SplitMix64(Draw);

impl SplitMix64 {
    /// A generator started at `seed`.
    pub fn new(seed: u64) -> Self {
        SplitMix64(Draw(seed))
    }

    /// The next 64 bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0.next_u64()
    }

    /// A value in `0..n` (0 when `n == 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        self.0.below(n as usize) as u64
    }

    /// A byte.
    pub fn byte(&mut self) -> u8 {
        self.next_u64() as u8
    }

    /// True with probability `percent` / 100.
    pub fn chance(&mut self, percent: u64) -> bool {
        self.below(100) < percent
    }

    /// An index into `weights`, drawn in proportion to them.
    pub fn weighted(&mut self, weights: &[u64]) -> usize {
        let total: u64 = weights.iter().sum();
        let mut x = self.below(total);
        for (i, &w) in weights.iter().enumerate() {
            if x < w {
                return i;
            }
            x -= w;
        }
        weights.len() - 1
    }
}
