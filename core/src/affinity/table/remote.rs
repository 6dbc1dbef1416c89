//! Bindings shared between router replicas: storing another replica's binding, dropping
//! one it invalidated, and the rule that settles two bindings of one session.
//!
//! The rule: the binding with the lower [`BindStamp`] wins, on every replica, whatever
//! order the announcements arrive in. A replica that holds the winner answers a losing
//! announcement with [`RemoteApplied::Kept`], so the façade announces the winner again
//! and the other replica converges even if it had forgotten the first announcement.

use super::{bump, entry_mut, AffinityTable, Entry, State};
use crate::affinity::{AffinityError, BindStamp, Binding, RemoteApplied, RemoteBinding};
use crate::time::Instant;
use crate::types::Phase;

impl AffinityTable {
    /// Stores `remote`, another replica's binding of (`session`, `phase`), unless the
    /// binding held here wins; see [`RemoteApplied`] for each outcome.
    ///
    /// A session unknown here is bound idle to the remote's worker, expiring at
    /// `now + lease_ttl_ms` unless acquired, within `sessions_max` (evicting the idle
    /// binding due soonest when full). Refused with [`AffinityError::TableFull`] when
    /// every entry is leased or initializing. Costs one hash of the session id plus
    /// O(log n) in the idle set.
    pub fn apply_remote(
        &mut self,
        now: Instant,
        session: &[u8],
        phase: Phase,
        remote: RemoteBinding,
    ) -> Result<RemoteApplied, AffinityError> {
        self.validate(session)?;
        let hash = self.hash(session, phase);
        if let Some(idx) = self.find(hash, session, phase) {
            if let Some(applied) = self.settle(now, idx, remote) {
                return Ok(applied);
            }
        }
        if self.index.len() >= self.cfg.sessions_max && self.idle.is_empty() {
            self.stats.remote_refused += 1;
            return Err(AffinityError::TableFull { sessions_max: self.cfg.sessions_max });
        }
        self.make_room(now)?;
        let serial = bump(&mut self.serial);
        let binding = Binding { worker: remote.worker, rank: remote.rank, revision: bump(&mut self.serial) };
        let deadline = now.add_ms(self.cfg.lease_ttl_ms);
        let state = State::Bound { binding, leases: 0, idle_deadline: Some(deadline), stamp: remote.stamp };
        let slot = self.insert(session, Entry { hash, phase, serial, state });
        self.idle.insert((deadline, serial, slot));
        self.stats.remote_inserted += 1;
        Ok(RemoteApplied::Inserted)
    }

    /// Drops the binding of (`session`, `phase`) if it is the one stamped `stamp` (its
    /// committer invalidated it), and says whether it did. A newer binding survives. Its
    /// leases become orphans, as with [`Self::invalidate`].
    pub fn unbind_remote(&mut self, session: &[u8], phase: Phase, stamp: BindStamp) -> bool {
        if self.validate(session).is_err() {
            return false;
        }
        let Some(idx) = self.find(self.hash(session, phase), session, phase) else {
            return false;
        };
        match entry_mut(&mut self.slots, idx).map(|e| &mut e.state) {
            Some(State::Bound { stamp: s, .. }) if *s == stamp => {}
            Some(State::Initializing { remote, .. }) => {
                if remote.is_some_and(|(r, _)| r.stamp == stamp) {
                    *remote = None;
                    self.stats.remote_unbound += 1;
                    return true;
                }
                return false;
            }
            _ => return false,
        }
        self.remove(idx);
        self.stats.remote_unbound += 1;
        true
    }

    /// The stamp of the binding of (`session`, `phase`), if bound. Changes nothing.
    pub fn stamp(&self, session: &[u8], phase: Phase) -> Option<BindStamp> {
        self.validate(session).ok()?;
        let idx = self.find(self.hash(session, phase), session, phase)?;
        match self.slots.get(idx as usize)?.entry.as_ref()?.state {
            State::Bound { stamp, .. } => Some(stamp),
            State::Initializing { .. } => None,
        }
    }

    /// Settles `remote` against the entry in slot `idx`; `None` when that entry turned
    /// out to be expired and was dropped, so the caller inserts afresh.
    fn settle(&mut self, now: Instant, idx: u32, remote: RemoteBinding) -> Option<RemoteApplied> {
        let entry = entry_mut(&mut self.slots, idx)?;
        match &mut entry.state {
            State::Initializing { remote: pending, .. } => {
                if pending.is_none_or(|(p, _)| (remote.stamp, remote.worker, remote.rank) < (p.stamp, p.worker, p.rank))
                {
                    *pending = Some((remote, now));
                }
                Some(RemoteApplied::Pending)
            }
            State::Bound { idle_deadline: Some(deadline), .. } if *deadline <= now => {
                self.expire(idx);
                None
            }
            State::Bound { binding, stamp, .. } => {
                if (binding.worker, binding.rank) == (remote.worker, remote.rank) {
                    *stamp = (*stamp).min(remote.stamp);
                    return Some(RemoteApplied::Same);
                }
                // Ties of stamp (one id on two replicas) fall to the worker, so two
                // replicas never both keep theirs and answer each other forever.
                if (remote.stamp, remote.worker, remote.rank) < (*stamp, binding.worker, binding.rank) {
                    *binding = Binding { worker: remote.worker, rank: remote.rank, revision: bump(&mut self.serial) };
                    *stamp = remote.stamp;
                    self.stats.remote_won += 1;
                    return Some(RemoteApplied::Replaced);
                }
                self.stats.remote_lost += 1;
                let kept = RemoteBinding { worker: binding.worker, rank: binding.rank, stamp: *stamp };
                Some(RemoteApplied::Kept(kept))
            }
        }
    }
}

#[cfg(test)]
mod tests;
