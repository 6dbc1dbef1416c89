//! Fault injection for tests of what a router does when workers fail: answer every
//! generation request with a fixed status (and `Retry-After`), accept requests and never
//! answer them (a wedged engine), stall every stream after some tokens, or die outright
//! (every connection cut and the port closed, like a killed process).
//!
//! [`Faults`] is shared between the test and the running worker, so a test can change a
//! worker's behaviour while it serves. The default injects nothing.

use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::Arc;

use tokio::sync::watch;

/// Faults a running worker injects; cheap to clone, all clones share the settings.
#[derive(Clone, Debug)]
pub struct Faults(Arc<Inner>);

#[derive(Debug)]
struct Inner {
    /// 0: none; else the status every generation request gets.
    status: AtomicU16,
    /// `u64::MAX`: no header; else the `Retry-After` seconds sent with `status`.
    retry_after_s: AtomicU64,
    wedged: AtomicBool,
    /// `u32::MAX`: never; else the tokens a stream sends before it stalls for good.
    stall_after_tokens: AtomicU32,
    killed: watch::Sender<bool>,
}

impl Default for Faults {
    fn default() -> Self {
        Faults(Arc::new(Inner {
            status: AtomicU16::new(0),
            retry_after_s: AtomicU64::new(u64::MAX),
            wedged: AtomicBool::new(false),
            stall_after_tokens: AtomicU32::new(u32::MAX),
            killed: watch::channel(false).0,
        }))
    }
}

impl Faults {
    /// Every generation request is answered `status` (an OpenAI error body), with
    /// `Retry-After: retry_after_s` when given. `None` answers normally again.
    pub fn set_status(&self, status: Option<u16>, retry_after_s: Option<u64>) {
        self.0.retry_after_s.store(retry_after_s.unwrap_or(u64::MAX), Ordering::Relaxed);
        self.0.status.store(status.unwrap_or(0), Ordering::Relaxed);
    }

    /// Generation requests are read and never answered while `wedged`.
    pub fn set_wedged(&self, wedged: bool) {
        self.0.wedged.store(wedged, Ordering::Relaxed);
    }

    /// Streams started from now on send `tokens` tokens and then nothing more, never
    /// ending; `None` lets them run.
    pub fn set_stall_after_tokens(&self, tokens: Option<u32>) {
        self.0.stall_after_tokens.store(tokens.unwrap_or(u32::MAX), Ordering::Relaxed);
    }

    /// The worker dies: its port closes and every connection is cut at once, mid-stream
    /// or not. There is no coming back; start another worker.
    pub fn kill(&self) {
        self.0.killed.send_replace(true);
    }

    pub(crate) fn status(&self) -> Option<(u16, Option<u64>)> {
        let s = self.0.status.load(Ordering::Relaxed);
        let after = self.0.retry_after_s.load(Ordering::Relaxed);
        (s != 0).then_some((s, (after != u64::MAX).then_some(after)))
    }

    pub(crate) fn wedged(&self) -> bool {
        self.0.wedged.load(Ordering::Relaxed)
    }

    pub(crate) fn stall_after_tokens(&self) -> Option<u32> {
        let n = self.0.stall_after_tokens.load(Ordering::Relaxed);
        (n != u32::MAX).then_some(n)
    }

    /// Resolves once the worker is killed.
    pub(crate) async fn killed(&self) {
        let mut rx = self.0.killed.subscribe();
        let _ = rx.wait_for(|k| *k).await;
    }
}
