//! The core's own clock type. The core never reads a clock; callers pass `now`.

use core::fmt;

/// A point in time, in microseconds since an epoch the caller chooses.
///
/// Only differences matter. Arithmetic saturates, so time going backwards or jumping
/// far ahead never panics.
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct Instant(u64);

impl Instant {
    /// The epoch.
    pub const ZERO: Instant = Instant(0);
    /// The far future; useful as "never".
    pub const MAX: Instant = Instant(u64::MAX);

    /// An instant `us` microseconds after the epoch.
    pub const fn from_micros(us: u64) -> Self {
        Instant(us)
    }
    /// An instant `ms` milliseconds after the epoch (saturating).
    pub const fn from_millis(ms: u64) -> Self {
        Instant(ms.saturating_mul(1000))
    }
    /// Microseconds since the epoch.
    pub const fn as_micros(self) -> u64 {
        self.0
    }
    /// Whole milliseconds since the epoch.
    pub const fn as_millis(self) -> u64 {
        self.0 / 1000
    }
    /// `self + ms` milliseconds, saturating at [`Instant::MAX`].
    pub const fn add_ms(self, ms: u64) -> Self {
        Instant(self.0.saturating_add(ms.saturating_mul(1000)))
    }
    /// `self + us` microseconds, saturating at [`Instant::MAX`].
    pub const fn add_us(self, us: u64) -> Self {
        Instant(self.0.saturating_add(us))
    }
    /// Microseconds from `earlier` to `self`, or 0 if `earlier` is later.
    pub const fn micros_since(self, earlier: Instant) -> u64 {
        self.0.saturating_sub(earlier.0)
    }
}

impl fmt::Debug for Instant {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.{:06}s", self.0 / 1_000_000, self.0 % 1_000_000)
    }
}
