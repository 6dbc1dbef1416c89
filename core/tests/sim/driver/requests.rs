//! Requests and their lifecycle inputs, each with the answer the model expects.

use super::*;

impl Driver {
    // ---- requests ----

    pub(super) fn request(&mut self, r: ReqOp) -> Check {
        let dup = r.duplicate && !r.preview && !self.reqs.is_empty();
        let (id, phase) = if dup {
            *self.reqs.keys().nth((r.draw % self.reqs.len() as u64) as usize).expect("in range")
        } else {
            self.next_id += 1;
            (
                RequestId(self.next_id),
                [Phase::Aggregated, Phase::Aggregated, Phase::Prefill, Phase::Decode][r.phase as usize % 4],
            )
        };
        let (req, valid_session) = self.build(id, phase, &r);
        let session = req.session.clone().filter(|_| valid_session);
        let mut m = MReq {
            session: session.clone(),
            chain: r.chain,
            len: r.len,
            follows_binding: valid_session && r.pin == 0 && r.planned == 0,
            ..MReq::unrouted(&req, self.now)
        };
        let fcfs = (-req.priority.strict, i128::from(self.now.as_micros()) - i128::from(req.priority.jump_ms) * 1000);
        let replay = req.clone();
        let peek = |router: &Router| session.as_ref().and_then(|s| router.session_binding(s, phase));
        let bound_before = peek(&self.router);
        let before = fingerprint(&self.router);
        let res = self.router.handle_request(self.now, req, Draw(r.draw));
        self.tally.requests += 1;
        if r.preview {
            self.tally.previews += 1;
            if let Ok(d) = &res {
                match d {
                    Decision::Routed(rt) if rt.preview => self.check_routed(rt, &m.blocks)?,
                    other => return Err(format!("a preview answered {other:?}")),
                }
            }
            if fingerprint(&self.router) != before {
                return Err(format!("a preview changed state: {before:?} -> {:?}", fingerprint(&self.router)));
            }
            if let Some(o) = self.router.poll_output() {
                return Err(format!("a preview produced output {o:?}"));
            }
            return match res {
                Ok(Decision::Routed(p)) if replay.session.is_none() => self.commit_preview(replay, r.draw, p.target),
                _ => Ok(()),
            };
        }
        if dup {
            if res != Err(RouteError::DuplicateRequest { id, phase }) || fingerprint(&self.router) != before {
                return Err(format!("a duplicate of a tracked request answered {res:?}"));
            }
            return self.drain();
        }
        let state = match res {
            Ok(Decision::Routed(rt)) => {
                if rt.id != id || rt.phase != phase || rt.preview {
                    return Err(format!("routed the wrong request: {rt:?}"));
                }
                self.check_routed(&rt, &m.blocks)?;
                // The same binding before and after: the request took a lease on it, and
                // unless pinned itself, went where it points.
                if let (Some(b), Some(a)) = (bound_before, peek(&self.router)) {
                    if a.revision == b.revision {
                        m.lease_rev = Some(b.revision);
                        let elsewhere = b.worker != rt.target.worker || b.rank.is_some_and(|r| r != rt.target.rank);
                        if m.follows_binding && elsewhere {
                            return Err(format!("session bound to {b:?} was routed to {}", rt.target));
                        }
                    }
                }
                self.tally.routed += 1;
                m.book(rt.target, rt.overlap.device, phase, self.now);
                Some(m.state)
            }
            Ok(Decision::Queued) => {
                self.tally.queued += 1;
                self.pushes += 1;
                m.fcfs = Some((fcfs.0, fcfs.1, self.pushes));
                Some(MState::Pending { seen_queued: true })
            }
            Ok(Decision::Waiting) => {
                if !valid_session {
                    return Err("a request without a valid session was told to wait".into());
                }
                self.tally.waiting += 1;
                Some(MState::Pending { seen_queued: false })
            }
            Ok(Decision::Rejected(_)) => {
                self.tally.rejected += 1;
                None
            }
            Ok(other) => return Err(format!("unexpected decision {other:?}")),
            Err(e) => {
                self.refusal(&e, m.follows_binding)?;
                self.tally.refused += 1;
                None
            }
        };
        match state {
            Some(state) => {
                m.state = state;
                self.reqs.insert((id, phase), m);
                self.transitions += 1;
            }
            None => self.remember_ended((id, phase)),
        }
        self.drain()
    }

    /// Sends a previewed request for real, with the same draw and nothing changed in
    /// between: it must go where the preview said.
    pub(super) fn commit_preview(&mut self, mut req: Request, draw: u64, previewed: WorkerKey) -> Check {
        self.next_id += 1;
        req.id = RequestId(self.next_id);
        req.preview = false;
        let (id, phase) = (req.id, req.phase.0);
        let mut m = MReq::unrouted(&req, self.now);
        match self.router.handle_request(self.now, req, Draw(draw)) {
            Ok(Decision::Routed(rt)) if rt.target == previewed => {
                m.book(rt.target, rt.overlap.device, phase, self.now);
                self.reqs.insert((id, phase), m);
                self.transitions += 1;
                self.tally.routed += 1;
                self.drain()
            }
            // A preview holds no slot, so only the real request meets the limit.
            Err(RouteError::TooManyRequests { .. }) => {
                self.remember_ended((id, phase));
                Ok(())
            }
            other => Err(format!("previewed {previewed}, then the same request answered {other:?}")),
        }
    }

    /// Soft affinity, where a binding is a preference (Direct mode refuses every request
    /// without an explicit pin, bound or not).
    pub(super) fn soft_affinity(&self) -> bool {
        self.cfg.affinity.mode == AffinityMode::Soft && self.cfg.mode != RouterMode::Direct
    }

    /// Refusals that contradict a documented rule (both broken today, see
    /// `sim_regressions.rs`).
    pub(super) fn refusal(&self, e: &RouteError, follows_binding: bool) -> Check {
        let busy =
            matches!(e, RouteError::Pin(PinError::Ineligible { reason: ExclusionReason::Overloaded { .. }, .. }));
        if busy && !avoid(Bug::BusyPin) {
            return Err(format!("a request pinned to a busy worker must queue, it failed: {e:?}"));
        }
        let soft = follows_binding && self.soft_affinity() && matches!(e, RouteError::Pin(_));
        if soft && !avoid(Bug::SoftBinding) {
            return Err(format!("a soft session binding acted as a pin: {e:?}"));
        }
        Ok(())
    }

    pub(super) fn build(&self, id: RequestId, phase: Phase, r: &ReqOp) -> (Request, bool) {
        let mut blocks = chain_blocks(r.chain, 0, u32::from(r.len) % (CHAIN_BLOCKS + 1));
        blocks.extend((0..u32::from(r.tail % 4)).map(|i| private_block(id.0, i)));
        let session = match r.session {
            0 => None,
            1 => Some(Vec::new()),
            2 => Some(vec![b'x'; self.cfg.affinity.session_id_bytes_max + 1]),
            n => Some(format!("s{}", (n - 3) % SESSIONS).into_bytes()),
        };
        let valid_session = r.session >= 3;
        let hints = RoutingHints {
            backend_instance_id: (r.pin > 0).then(|| WorkerId(u64::from(r.pin - 1) % (u64::from(WORKERS) + 1))),
            dp_rank: (r.pin_rank > 0).then(|| DpRank(u32::from(r.pin_rank - 1) % 5)),
            allowed_worker_ids: (r.allow > 0).then(|| {
                (0..8u64).filter(|b| r.allow & (1 << b) != 0 && *b < u64::from(WORKERS)).map(WorkerId).collect()
            }),
            tolerations: if r.tolerate {
                vec![Toleration { key: String::new(), value: None, effect: None }]
            } else {
                Vec::new()
            },
            ..RoutingHints::default()
        };
        let req = Request {
            id,
            phase: PhaseField(phase),
            isl_tokens: blocks.len() as u32 * 64 + (r.draw % 64) as u32,
            blocks,
            session,
            hints,
            priority: Priority {
                strict: i32::from(r.strict % 3),
                jump_ms: i64::from(r.jump_ms),
                class: match r.class % 3 {
                    0 => None,
                    1 => Some("a".into()),
                    _ => Some(format!("x{}", id.0 % 100)),
                },
            },
            expected_output_tokens: (r.expected_out > 0).then_some(u32::from(r.expected_out)),
            planned: (r.planned > 0).then(|| WorkerKey::new(u64::from(r.planned - 1) % u64::from(WORKERS), 0)),
            same_label_as: (r.label > 0).then(|| ("zone".into(), format!("z{}", r.label % 2))),
            preview: r.preview,
            ..Request::default()
        };
        (req, valid_session)
    }

    /// A routed key must exist, be healthy, serve the phase and be one of its ranks; the
    /// overlap figures must fit the prompt and (exact mode) what the index holds, except
    /// where a worker said to tokenize otherwise adds its predictions.
    pub(super) fn check_routed(&self, rt: &Routed, blocks: &[SeqHash]) -> Check {
        let (raw, max) = (rt.overlap.raw(), rt.max_overlap_blocks);
        if rt.request_blocks as usize != blocks.len() || raw > max || max > rt.request_blocks {
            return Err(format!("routed with overlap {:?}, max {max}, of {} blocks", rt.overlap, rt.request_blocks));
        }
        if !self.cfg.approximate {
            let exact = self.index.find_matches(blocks);
            let best = exact.iter().map(|(_, o)| o.raw()).max().unwrap_or(0);
            let mine = exact.iter().find(|(k, _)| *k == rt.target).map_or(0, |(_, o)| o.raw());
            let (foreign, any_foreign) = (self.foreign.contains(&rt.target.worker), !self.foreign.is_empty());
            if (raw > mine && !foreign) || (max > best && !any_foreign) {
                return Err(format!("routed with overlap {raw} (max {max}); the index holds {mine} (max {best})"));
            }
        }
        self.check_target(rt.target, rt.phase)
    }

    fn check_target(&self, key: WorkerKey, phase: Phase) -> Check {
        let Some((spec, health)) = self.workers.get(&key.worker) else {
            return Err(format!("routed to {key}, which is not in the fleet"));
        };
        if *health != Health::Healthy || !spec.role.serves(phase) {
            return Err(format!("routed {phase} to {key}: {health:?} {:?}", spec.role));
        }
        if spec.dp_ranks.is_some_and(|n| key.rank.0 >= n) {
            return Err(format!("routed to {key}, beyond its {:?} ranks", spec.dp_ranks));
        }
        Ok(())
    }

    // ---- lifecycle ----

    pub(super) fn lifecycle(&mut self, pick: u16, life: Life) -> Check {
        if self.reqs.is_empty() {
            return self.late(pick, life.kind());
        }
        let fk = *self.reqs.keys().nth(pick as usize % self.reqs.len()).expect("in range");
        let state = self.reqs[&fk].state;
        let (id, phase) = fk;
        let wrong = Err(InputError::WrongState { id, phase });
        let booked = matches!(state, MState::Booked(_) | MState::Dispatched(_) | MState::Orphaned);
        // What the input must answer, and what the request becomes (None: it ended).
        let (want, next): (Result<(), InputError>, Option<MState>) = match (life, state) {
            (Life::Dispatched, MState::Booked(k)) => (Ok(()), Some(MState::Dispatched(k))),
            (Life::Dispatched, s) => (wrong, Some(s)),
            (Life::Failed(_) | Life::Finished, _) if booked => (Ok(()), None),
            (Life::PrefillDone, s) if booked => (Ok(()), Some(s)),
            (Life::Progress(_), s) => (Ok(()), Some(s)),
            (Life::Cancel, _) => (Ok(()), None),
            (_, s) => (wrong, Some(s)),
        };
        let session = self.reqs[&fk].session.clone();
        let peek = |r: &Router| session.as_ref().and_then(|s| r.session_binding(s, phase));
        let bound_before = peek(&self.router);
        let got = match life {
            Life::Dispatched => self.router.handle_dispatched(self.now, id, phase),
            Life::Failed(why) => self.router.handle_dispatch_failed(self.now, id, phase, why),
            Life::PrefillDone => self.router.handle_prefill_done(self.now, id, phase),
            Life::Progress(t) => self.router.handle_decode_progress(self.now, id, phase, u32::from(t)),
            Life::Finished => self.router.handle_finished(self.now, id, phase),
            Life::Cancel => self.router.handle_cancel(self.now, id, phase),
        };
        if got != want {
            return Err(format!("{life:?} of {fk:?} in state {state:?} answered {got:?}, want {want:?}"));
        }
        let bound_after = peek(&self.router);
        if let (Life::Dispatched, Ok(()), MState::Booked(k)) = (life, &got, state) {
            // A binding that appeared (or changed) was committed by this dispatch.
            if let Some(b) = bound_after.filter(|a| bound_before.is_none_or(|b| b.revision != a.revision)) {
                if b.worker != k.worker || b.rank != Some(k.rank) {
                    return Err(format!("dispatch to {k} committed the session to {b:?}"));
                }
                if let Some(m) = self.reqs.get_mut(&fk) {
                    m.lease_rev = Some(b.revision);
                }
            }
        }
        if let (Life::Failed(DispatchFailure::Refused), Ok(()), Some(b)) = (life, &got, bound_before) {
            // A refusal (429, 5xx, no first byte) moves the request, never the binding.
            if bound_after.map(|a| a.revision) != Some(b.revision) {
                return Err(format!("a refusal of {fk:?} moved the binding {b:?} to {bound_after:?}"));
            }
        }
        if let (Life::Failed(DispatchFailure::Worker), Ok(()), Some(b)) = (life, &got, bound_before) {
            // A worker failure may drop the binding the request held, never a newer one.
            let dropped = bound_after.is_none_or(|a| a.revision != b.revision);
            let held = self.reqs[&fk].lease_rev;
            if dropped && held.is_some_and(|rev| rev != b.revision) && !avoid(Bug::LateFailure) {
                return Err(format!("a worker failure of a request leased on revision {held:?} dropped {b:?}"));
            }
        }
        match (got.is_ok(), next) {
            (false, _) => self.tally.wrong_state += 1,
            (true, Some(s)) => {
                if s != state {
                    self.transitions += 1;
                    self.tally.dispatched += 1;
                }
                if let Some(r) = self.reqs.get_mut(&fk) {
                    r.state = s;
                    let holds_load = matches!(s, MState::Booked(_) | MState::Dispatched(_));
                    match life {
                        Life::PrefillDone if holds_load => r.prefill_left = 0,
                        Life::Progress(t) if holds_load => {
                            if t > 0 {
                                r.prefill_left = 0;
                            }
                            r.generated_blocks = r.generated_blocks.max(u32::from(t).div_ceil(BLOCK_TOKENS));
                        }
                        _ => {}
                    }
                }
            }
            (true, None) => {
                match life {
                    Life::Failed(_) => self.tally.dispatch_failed += 1,
                    Life::Cancel => self.tally.cancelled += 1,
                    _ => self.tally.finished += 1,
                }
                self.end(fk);
            }
        }
        if matches!(life, Life::Progress(_)) && avoid(Bug::DecodeProgress) {
            // Stands in for the queue re-try `handle_decode_progress` lacks (see
            // `sim_regressions::decode_progress_retries_the_queue`).
            self.drain()?;
            self.router.handle_timeout(self.now);
        }
        self.drain()
    }

    pub(super) fn late(&mut self, pick: u16, kind: u8) -> Check {
        let (id, phase) = if self.ended.is_empty() {
            (RequestId(u64::MAX - u64::from(pick)), Phase::Aggregated)
        } else {
            self.ended[pick as usize % self.ended.len()]
        };
        let now = self.now;
        let r = &mut self.router;
        let got = match kind % 6 {
            0 => r.handle_dispatched(now, id, phase),
            1 => r.handle_dispatch_failed(now, id, phase, DispatchFailure::Worker),
            2 => r.handle_prefill_done(now, id, phase),
            3 => r.handle_decode_progress(now, id, phase, 5),
            4 => r.handle_finished(now, id, phase),
            _ => r.handle_cancel(now, id, phase),
        };
        let want = Err(InputError::UnknownRequest { id, phase });
        if got != want {
            return Err(format!("a late input for ended request {id:?} {phase} answered {got:?}"));
        }
        self.tally.late += 1;
        self.drain()
    }

    pub(super) fn end(&mut self, fk: (RequestId, Phase)) {
        self.reqs.remove(&fk);
        self.transitions += 1;
        self.remember_ended(fk);
    }

    pub(super) fn remember_ended(&mut self, fk: (RequestId, Phase)) {
        if self.ended.len() >= ENDED_KEPT {
            self.ended.pop_front();
        }
        self.ended.push_back(fk);
    }
}
