//! A `Router` driven by the smallest event loop that honours its calling contract.
//!
//! Everything runs on virtual time, so the example is deterministic and instant: three
//! simulated workers serve a stream of chat turns from a few conversations. The loop
//! feeds the router its four kinds of input (requests, KV events, timers, worker
//! changes: a join, a drain and a removal), drains `poll_output` after every one of them, and jumps the clock to the
//! earlier of the next event and `poll_timeout`. A real adapter does the same with
//! sockets and a sleep instead of a queue of events.
//!
//! Run it with `cargo run -p router-core --example event_loop`.

use std::collections::{BTreeMap, BTreeSet};

use router_core::{
    hash_tokens, BlockHash, BlockSize, Decision, Draw, HashSeed, Health, IndexEvent, Instant, Output, Phase, Request,
    RequestId, Router, RouterConfig, Tier, WorkerId, WorkerKey, WorkerRole, WorkerSpec, WorkerUpdate,
};

/// What happens next in the simulated world, in time order.
#[derive(Debug)]
enum Event {
    /// A client sends one turn of a conversation.
    Arrive { id: u64, conversation: u64, turn: u64 },
    /// The worker finished the prefill and publishes the prompt's blocks as KV events.
    Prefilled { id: u64, key: WorkerKey },
    /// The worker streamed the last token.
    Finished { id: u64 },
    /// The fleet changes: a worker joins.
    Join(WorkerId),
    /// The fleet changes: a worker starts draining (it finishes what it has, takes
    /// nothing new).
    Drain(WorkerId),
    /// The fleet changes: a worker leaves.
    Leave(WorkerId),
}

/// What the loop saw, for the test at the bottom and for `main` to print.
#[derive(Debug, Default, PartialEq)]
struct Summary {
    routed: u64,
    finished: u64,
    /// Routed with part of the prompt already in the chosen worker's cache.
    cache_hits: u64,
    timer_calls: u64,
    /// Conversations whose session binding expired after their last turn.
    sessions_expired: u64,
    /// Requests routed to a worker after it started draining (never, if health works).
    routed_while_draining: u64,
    /// Later turns sent elsewhere because their conversation's worker was draining.
    rebound_from_draining: u64,
}

const BLOCK_TOKENS: u32 = 16;
const PREFILL_MS: u64 = 40;
const DECODE_MS: u64 = 300;

struct World {
    router: Router,
    now: Instant,
    events: BTreeMap<(Instant, u64), Event>,
    seq: u64,
    prompts: BTreeMap<u64, Vec<BlockHash>>,
    /// Each request's conversation, and each conversation's last worker.
    conversation_of: BTreeMap<u64, u64>,
    last_worker: BTreeMap<u64, WorkerId>,
    draining: BTreeSet<WorkerId>,
    summary: Summary,
}

impl World {
    fn new() -> Self {
        let cfg =
            RouterConfig { block_size: BlockSize::new(BLOCK_TOKENS).expect("a power of two"), ..Default::default() };
        World {
            router: Router::new(cfg),
            now: Instant::ZERO,
            events: BTreeMap::new(),
            seq: 0,
            prompts: BTreeMap::new(),
            conversation_of: BTreeMap::new(),
            last_worker: BTreeMap::new(),
            draining: BTreeSet::new(),
            summary: Summary::default(),
        }
    }

    fn at(&mut self, ms: u64, event: Event) {
        self.seq += 1;
        self.events.insert((Instant::from_millis(ms), self.seq), event);
    }

    /// The loop: the next event or the router's next deadline, whichever is first.
    fn run(&mut self) {
        loop {
            let next_event = self.events.first_key_value().map(|(&(t, _), _)| t);
            let deadline = self.router.poll_timeout();
            match (next_event, deadline) {
                (None, None) => return,
                (Some(t), Some(d)) if d < t => self.timer(d),
                (None, Some(d)) => self.timer(d),
                _ => {
                    let ((t, _), event) = self.events.pop_first().expect("an event is due");
                    self.now = self.now.max(t);
                    self.handle(event);
                }
            }
            self.drain();
        }
    }

    fn timer(&mut self, deadline: Instant) {
        self.now = self.now.max(deadline);
        self.router.handle_timeout(self.now);
        self.summary.timer_calls += 1;
    }

    fn handle(&mut self, event: Event) {
        let now = self.now;
        match event {
            Event::Join(id) => {
                let spec = WorkerSpec::new(id, WorkerRole::Aggregated);
                self.router.handle_worker_update(now, WorkerUpdate::Upsert(spec)).expect("a valid worker");
            }
            Event::Drain(id) => {
                // Its sessions re-bind on their next turn; its requests run to the end.
                self.router.handle_worker_update(now, WorkerUpdate::Health(id, Health::Draining)).expect("known");
                self.draining.insert(id);
            }
            Event::Leave(id) => {
                // Its index entries, load and bindings go with it.
                self.router.handle_worker_update(now, WorkerUpdate::Removed(id)).expect("known");
            }
            Event::Arrive { id, conversation, turn } => {
                // Every turn repeats the conversation so far, as a chat client does.
                let tokens: Vec<u32> = (0..(turn + 1) * 64).map(|t| (conversation * 100_000 + t) as u32).collect();
                let mut blocks = Vec::new();
                hash_tokens(&tokens, self.router.config().block_size, HashSeed::DEFAULT, &[], &mut blocks);
                let request = Request {
                    id: RequestId(id),
                    blocks: blocks.iter().map(|b| b.seq).collect(),
                    isl_tokens: tokens.len() as u32,
                    // Turns of one conversation stick to one worker while it is bound.
                    session: Some(conversation.to_be_bytes().to_vec()),
                    ..Default::default()
                };
                self.prompts.insert(id, blocks);
                self.conversation_of.insert(id, conversation);
                // The draw would come from the adapter's RNG; the id is random enough here.
                match self.router.handle_request(now, request, Draw(id.wrapping_mul(0x9E37_79B9_7F4A_7C15))) {
                    Ok(Decision::Routed(r)) => self.dispatch(r.id.0, r.target, r.overlap.raw()),
                    Ok(Decision::Queued | Decision::Waiting) => {} // comes back through poll_output
                    Ok(other) => panic!("request {id} refused: {other:?}"),
                    Err(e) => panic!("request {id} failed: {e}"),
                }
            }
            Event::Prefilled { id, key } => {
                let blocks = &self.prompts[&id];
                let stored = IndexEvent::Stored { parent: None, blocks, tier: Tier::Device };
                self.router.handle_kv_event(now, key, stored).expect("the worker is registered");
                self.router.handle_prefill_done(now, RequestId(id), Phase::Aggregated).expect("booked");
            }
            Event::Finished { id } => {
                self.router.handle_finished(now, RequestId(id), Phase::Aggregated).expect("booked");
                self.summary.finished += 1;
            }
        }
    }

    /// Confirms the booking (the request "reached" its worker) and schedules its life.
    fn dispatch(&mut self, id: u64, key: WorkerKey, overlap_blocks: u32) {
        self.router.handle_dispatched(self.now, RequestId(id), Phase::Aggregated).expect("just booked");
        self.summary.routed += 1;
        self.summary.routed_while_draining += u64::from(self.draining.contains(&key.worker));
        self.summary.cache_hits += u64::from(overlap_blocks > 0);
        let conversation = self.conversation_of[&id];
        if let Some(last) = self.last_worker.insert(conversation, key.worker) {
            self.summary.rebound_from_draining += u64::from(last != key.worker && self.draining.contains(&last));
        }
        let now_ms = self.now.as_millis();
        self.at(now_ms + PREFILL_MS, Event::Prefilled { id, key });
        self.at(now_ms + PREFILL_MS + DECODE_MS, Event::Finished { id });
    }

    /// Drains the router's outputs, as the contract asks after every input.
    fn drain(&mut self) {
        while let Some(out) = self.router.poll_output() {
            match out {
                Output::Routed(r) => self.dispatch(r.id.0, r.target, r.overlap.raw()),
                Output::LeaseExpired { .. } => self.summary.sessions_expired += 1,
                other => panic!("unexpected output {other:?}"),
            }
        }
        // A lone router (no replica id) never has anything for other replicas.
        assert!(self.router.poll_replica_update().is_none());
    }
}

fn simulate() -> (Summary, Router) {
    let mut w = World::new();
    w.at(0, Event::Join(WorkerId(1)));
    w.at(0, Event::Join(WorkerId(2)));
    // A third worker joins halfway through; the second drains soon after, and leaves
    // once its last request has finished.
    w.at(1_000, Event::Join(WorkerId(3)));
    w.at(1_200, Event::Drain(WorkerId(2)));
    w.at(2_000, Event::Leave(WorkerId(2)));
    let mut id = 0;
    for turn in 0..4 {
        for conversation in 0..5 {
            id += 1;
            w.at(turn * 500 + conversation * 7, Event::Arrive { id, conversation, turn });
        }
    }
    w.run();
    (w.summary, w.router)
}

fn main() {
    let (summary, router) = simulate();
    println!("{summary:?}");
    println!("{:?}", router.counts());
}

#[test]
fn every_turn_is_served_and_later_turns_find_their_prefix() {
    let (summary, router) = simulate();
    assert_eq!((summary.routed, summary.finished), (20, 20));
    // The sessions' idle bindings expire on the router's timer once the turns stop.
    assert_eq!(summary.sessions_expired, 5, "{summary:?}");
    assert!(summary.timer_calls > 0);
    // Each conversation's first turn finds nothing cached; each later turn extends a
    // prompt some worker already published, and the kv policy sends it there. The
    // conversations bound to the draining worker are the exception: their last turn
    // starts again on another worker, with nothing cached.
    let rebound = summary.rebound_from_draining;
    assert!((1..5).contains(&rebound), "the draining worker held some conversations: {summary:?}");
    assert_eq!(summary.cache_hits, 15 - rebound, "{summary:?}");
    let counts = router.counts();
    assert_eq!((counts.requests_in_flight, counts.bookings, counts.queue_depth), (0, 0, 0));
    assert_eq!(counts.affinity_sessions, 0);
    // Nothing new went to the draining worker, and the one that left is gone.
    assert_eq!(summary.routed_while_draining, 0, "{summary:?}");
    let workers: Vec<WorkerId> = router.snapshot().workers.iter().map(|w| w.spec.id).collect();
    assert_eq!(workers, [WorkerId(1), WorkerId(3)]);
    router.check_invariants().expect("the router's books balance");
}
