//! Per-class usage accounting and limit checks.
//!
//! Each queued request is counted in one bucket: its listed class, the default class,
//! or, for a class name not in the config, a bucket of its own that uses the default
//! limits. Buckets of unlisted names exist only while they have queued requests, and at
//! most `extra_classes_max` at once; past that, new unlisted names are counted under the
//! default class, so client-chosen names cannot grow the table.

use alloc::collections::BTreeMap;
use alloc::string::String;
use alloc::vec::Vec;

use super::{ClassLimits, ClassUsage, LimitKind, QueueConfig, QueueEntry, QueueRejection};

/// Where a queued request is counted; fixed at push so removal undoes exactly the push.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub(super) enum Bucket {
    /// `QueueConfig::classes[i]`.
    Listed(usize),
    /// The default class.
    Default,
    /// An unlisted name with its own usage, keyed by the entry's class name.
    Extra,
}

#[derive(Debug)]
pub(super) struct Classes {
    listed: Vec<(ClassLimits, ClassUsage)>,
    default: (ClassLimits, ClassUsage),
    extra: BTreeMap<String, ClassUsage>,
    extra_max: usize,
}

impl Classes {
    pub(super) fn new(cfg: &QueueConfig) -> Self {
        Classes {
            listed: cfg.classes.iter().map(|c| (c.clone(), ClassUsage::default())).collect(),
            default: (cfg.default_class.clone(), ClassUsage::default()),
            extra: BTreeMap::new(),
            extra_max: cfg.extra_classes_max,
        }
    }

    /// The bucket a request of class `name` would be counted in now.
    pub(super) fn bucket(&self, name: Option<&str>) -> Bucket {
        let Some(name) = name else {
            return Bucket::Default;
        };
        if let Some(i) = self.listed.iter().position(|(l, _)| l.name == name) {
            return Bucket::Listed(i);
        }
        if name == self.default.0.name {
            return Bucket::Default;
        }
        if self.extra.contains_key(name) || self.extra.len() < self.extra_max {
            return Bucket::Extra;
        }
        Bucket::Default
    }

    /// Refuses `entry` if counting it in `bucket` would break one of the bucket's limits.
    pub(super) fn check(&self, bucket: Bucket, entry: &QueueEntry) -> Result<(), QueueRejection> {
        let (limits, usage) = self.get(bucket, entry);
        let reject = |limit_kind, current: u64, limit: u64| QueueRejection {
            class: String::from(self.name(bucket, entry)),
            limit_kind,
            current,
            limit,
        };
        if let Some(max) = limits.queued_requests_max {
            if u64::from(usage.requests) + 1 > u64::from(max) {
                return Err(reject(LimitKind::QueuedRequests, usage.requests.into(), max.into()));
            }
        }
        if let Some(max) = limits.queued_prompt_tokens_max {
            if usage.prompt_tokens.saturating_add(entry.isl_tokens.into()) > max {
                return Err(reject(LimitKind::QueuedPromptTokens, usage.prompt_tokens, max));
            }
        }
        if let Some(max) = limits.queued_cached_tokens_max {
            if usage.cached_tokens.saturating_add(entry.cached_tokens.into()) > max {
                return Err(reject(LimitKind::QueuedCachedTokens, usage.cached_tokens, max));
            }
        }
        Ok(())
    }

    /// The name rejections and usage report for `bucket`.
    pub(super) fn name<'a>(&'a self, bucket: Bucket, entry: &'a QueueEntry) -> &'a str {
        match bucket {
            Bucket::Listed(i) => self.listed.get(i).map_or("", |(l, _)| &l.name),
            Bucket::Default => &self.default.0.name,
            Bucket::Extra => entry.class.as_deref().unwrap_or(""),
        }
    }

    pub(super) fn add(&mut self, bucket: Bucket, entry: &QueueEntry) {
        if let Some(u) = self.usage_mut(bucket, entry, true) {
            u.requests = u.requests.saturating_add(1);
            u.prompt_tokens = u.prompt_tokens.saturating_add(entry.isl_tokens.into());
            u.cached_tokens = u.cached_tokens.saturating_add(entry.cached_tokens.into());
        }
    }

    /// Undoes [`add`](Self::add) of the same entry and bucket.
    pub(super) fn sub(&mut self, bucket: Bucket, entry: &QueueEntry) {
        let Some(u) = self.usage_mut(bucket, entry, false) else {
            return;
        };
        u.requests = u.requests.saturating_sub(1);
        u.prompt_tokens = u.prompt_tokens.saturating_sub(entry.isl_tokens.into());
        u.cached_tokens = u.cached_tokens.saturating_sub(entry.cached_tokens.into());
        let empty = u.requests == 0;
        if let (Bucket::Extra, Some(name), true) = (bucket, entry.class.as_deref(), empty) {
            self.extra.remove(name);
        }
    }

    /// Usage of the class named `name`: a listed class, the default class, or an unlisted
    /// name with its own bucket; zero otherwise.
    #[cfg(test)]
    pub(super) fn usage(&self, name: &str) -> ClassUsage {
        if let Some((_, u)) = self.listed.iter().find(|(l, _)| l.name == name) {
            return *u;
        }
        if name == self.default.0.name {
            return self.default.1;
        }
        self.extra.get(name).copied().unwrap_or_default()
    }

    fn get(&self, bucket: Bucket, entry: &QueueEntry) -> (&ClassLimits, ClassUsage) {
        let default = &self.default.0;
        match bucket {
            Bucket::Listed(i) => self.listed.get(i).map_or((default, ClassUsage::default()), |(l, u)| (l, *u)),
            Bucket::Default => (default, self.default.1),
            Bucket::Extra => {
                let name = entry.class.as_deref().unwrap_or("");
                (default, self.extra.get(name).copied().unwrap_or_default())
            }
        }
    }

    fn usage_mut(&mut self, bucket: Bucket, entry: &QueueEntry, create: bool) -> Option<&mut ClassUsage> {
        match bucket {
            Bucket::Listed(i) => self.listed.get_mut(i).map(|(_, u)| u),
            Bucket::Default => Some(&mut self.default.1),
            Bucket::Extra => {
                let name = entry.class.as_deref()?;
                if create && !self.extra.contains_key(name) {
                    self.extra.insert(String::from(name), ClassUsage::default());
                }
                self.extra.get_mut(name)
            }
        }
    }
}
