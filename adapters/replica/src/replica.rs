//! The running replica: one NATS client, a publisher task per model, a heartbeat task,
//! a subscriber task and a connection-event task.

use std::collections::BTreeMap;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use async_nats::connection::State as NatsState;
use async_nats::{Client, ConnectOptions, Event};
use futures_util::StreamExt;
use kvroute_driver::{Driver, ReplicaId, ReplicaUpdate};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::options::{replica_id, ReplicaOptions, ReplicaStartError};
use crate::wire::{self, Envelope, Kind, Msg, WIRE_VERSION};

/// How long a goodbye may take before shutdown goes on without it.
const GOODBYE_TIMEOUT: Duration = Duration::from_millis(500);

/// One model's router, as the replica sees it.
#[derive(Clone)]
pub struct PoolLink {
    /// The model name; peers match pools by it.
    pub model: String,
    /// The model's router.
    pub driver: Driver,
}

/// Counters of a replica, for metrics.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ReplicaCounters {
    /// Updates handed to NATS.
    pub published_updates: u64,
    /// NATS messages published (batches, heartbeats, goodbyes).
    pub published_messages: u64,
    /// Updates dropped: NATS disconnected, or the publish failed.
    pub dropped_updates: u64,
    /// Peers' updates the routers applied.
    pub received_updates: u64,
    /// Peers' updates the routers refused (unknown request, full table...).
    pub refused_updates: u64,
    /// Messages that did not decode.
    pub decode_errors: u64,
    /// Updates for a model this replica does not serve.
    pub unknown_model: u64,
    /// Times a peer's earlier reports were dropped: its restart, reconnect or goodbye.
    pub peer_resets: u64,
    /// Times the NATS connection was lost.
    pub disconnects: u64,
}

#[derive(Default)]
struct Counters {
    published_updates: AtomicU64,
    published_messages: AtomicU64,
    dropped_updates: AtomicU64,
    received_updates: AtomicU64,
    refused_updates: AtomicU64,
    decode_errors: AtomicU64,
    unknown_model: AtomicU64,
    peer_resets: AtomicU64,
    disconnects: AtomicU64,
}

fn bump(c: &AtomicU64, n: u64) {
    c.fetch_add(n, Ordering::Relaxed);
}

struct Shared {
    opts: ReplicaOptions,
    id: ReplicaId,
    /// Changes at every loss of the connection, so peers drop what they missed the end of.
    epoch: AtomicU64,
    client: Client,
    pools: BTreeMap<String, Driver>,
    /// Peers heard from, with their epoch.
    peers: Mutex<BTreeMap<ReplicaId, u64>>,
    counters: Counters,
}

/// A running replica. Its tasks stop when the handle is dropped or
/// [`ReplicaHandle::abort`] is called; [`ReplicaHandle::goodbye`] first tells the peers
/// to drop this replica's load at once instead of after `replica_silence_max_ms`.
pub struct ReplicaHandle {
    shared: Arc<Shared>,
    tasks: Mutex<Vec<JoinHandle<()>>>,
}

/// Connects to NATS (in the background: an unreachable server is not an error), wires
/// every pool's driver to it and starts the tasks. Needs a tokio runtime.
pub async fn start(opts: ReplicaOptions, pools: Vec<PoolLink>) -> Result<ReplicaHandle, ReplicaStartError> {
    opts.validate()?;
    let (events_tx, events_rx) = mpsc::channel::<Event>(64);
    let client = ConnectOptions::new()
        .retry_on_initial_connect()
        .no_echo()
        .name(format!("kvroute-{}", opts.name))
        .event_callback(move |ev| {
            let tx = events_tx.clone();
            async move {
                // A full queue only loses a duplicate of a state the task reads anyway.
                let _ = tx.try_send(ev);
            }
        })
        .connect(opts.nats_url.as_str())
        .await
        .map_err(|e| ReplicaStartError::Connect(Box::new(e)))?;
    let sub = client.subscribe(opts.subscription()).await.map_err(|e| ReplicaStartError::Subscribe(Box::new(e)))?;
    let shared = Arc::new(Shared {
        id: replica_id(&opts.name),
        epoch: AtomicU64::new(random_u64()),
        client,
        pools: pools.iter().map(|p| (p.model.clone(), p.driver.clone())).collect(),
        peers: Mutex::new(BTreeMap::new()),
        counters: Counters::default(),
        opts,
    });
    let mut tasks = Vec::new();
    for p in pools {
        let (tx, rx) = mpsc::channel(shared.opts.outbox_max);
        p.driver.set_replica_sink(tx);
        tasks.push(tokio::spawn(publish_loop(shared.clone(), p, rx)));
    }
    tasks.push(tokio::spawn(heartbeat_loop(shared.clone())));
    tasks.push(tokio::spawn(subscribe_loop(shared.clone(), sub)));
    tasks.push(tokio::spawn(events_loop(shared.clone(), events_rx)));
    Ok(ReplicaHandle { shared, tasks: Mutex::new(tasks) })
}

impl ReplicaHandle {
    /// This replica's id.
    pub fn id(&self) -> ReplicaId {
        self.shared.id
    }

    /// Whether NATS is connected now. While it is not, the routers work alone: they
    /// publish nothing and other replicas' load expires.
    pub fn connected(&self) -> bool {
        self.shared.client.connection_state() == NatsState::Connected
    }

    /// Peers heard from since the last loss of the connection.
    pub fn peers(&self) -> usize {
        lock(&self.shared.peers).len()
    }

    /// The counters.
    pub fn counters(&self) -> ReplicaCounters {
        let c = &self.shared.counters;
        let get = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ReplicaCounters {
            published_updates: get(&c.published_updates),
            published_messages: get(&c.published_messages),
            dropped_updates: get(&c.dropped_updates),
            received_updates: get(&c.received_updates),
            refused_updates: get(&c.refused_updates),
            decode_errors: get(&c.decode_errors),
            unknown_model: get(&c.unknown_model),
            peer_resets: get(&c.peer_resets),
            disconnects: get(&c.disconnects),
        }
    }

    /// Tells the peers this replica is leaving (they drop its load at once), then stops.
    /// Bounded in time: a lost NATS connection only skips the goodbye.
    pub async fn goodbye(&self) {
        self.abort();
        if self.connected() {
            let s = &self.shared;
            let bye = async {
                publish(s, "", Kind::Heartbeat, vec![Msg::Bye]).await;
                let _ = s.client.flush().await;
            };
            let _ = tokio::time::timeout(GOODBYE_TIMEOUT, bye).await;
        }
    }

    /// Stops every task at once, announcing nothing (as a crash would): peers drop this
    /// replica's load after `replica_silence_max_ms`.
    pub fn abort(&self) {
        for t in lock(&self.tasks).drain(..) {
            t.abort();
        }
    }
}

impl Drop for ReplicaHandle {
    fn drop(&mut self) {
        self.abort();
    }
}

/// Drains one pool's updates in batches and publishes them, split by subject.
async fn publish_loop(s: Arc<Shared>, pool: PoolLink, mut rx: mpsc::Receiver<ReplicaUpdate>) {
    let mut batch = Vec::with_capacity(s.opts.batch_updates_max);
    while rx.recv_many(&mut batch, s.opts.batch_updates_max).await > 0 {
        let connected = s.client.connection_state() == NatsState::Connected;
        if !connected {
            bump(&s.counters.dropped_updates, batch.len() as u64);
            batch.clear();
            continue;
        }
        let (mut load, mut affinity) = (Vec::new(), Vec::new());
        for u in batch.drain(..) {
            match wire::to_msg(&u, |t| pool.driver.unix_us(t)) {
                Some(m) if m.kind() == Kind::Affinity => affinity.push(m),
                Some(m) => load.push(m),
                None => {}
            }
        }
        for (kind, msgs) in [(Kind::Load, load), (Kind::Affinity, affinity)] {
            for chunk in chunks(msgs) {
                publish(&s, &pool.model, kind, chunk).await;
            }
        }
    }
}

/// Splits messages into envelopes within [`wire::UPDATES_PER_MESSAGE_MAX`] updates and
/// [`wire::BLOCKS_PER_MESSAGE_MAX`] prompt blocks each.
fn chunks(msgs: Vec<Msg>) -> Vec<Vec<Msg>> {
    let mut out: Vec<Vec<Msg>> = Vec::new();
    let mut blocks = 0;
    for m in msgs {
        let n = m.blocks();
        let full = out.last().is_none_or(|c| {
            c.len() >= wire::UPDATES_PER_MESSAGE_MAX || (!c.is_empty() && blocks + n > wire::BLOCKS_PER_MESSAGE_MAX)
        });
        if full {
            out.push(Vec::new());
            blocks = 0;
        }
        blocks += n;
        if let Some(c) = out.last_mut() {
            c.push(m);
        }
    }
    out
}

/// Publishes one envelope, counting it; failures drop it.
async fn publish(s: &Shared, model: &str, kind: Kind, msgs: Vec<Msg>) {
    let n = msgs.iter().filter(|m| m.kind() != Kind::Heartbeat).count() as u64;
    let env = Envelope {
        v: WIRE_VERSION,
        from: s.id.0,
        epoch: s.epoch.load(Ordering::Relaxed),
        model: model.to_string(),
        msgs,
    };
    match s.client.publish(s.opts.subject(kind), wire::encode(&env).into()).await {
        Ok(()) => {
            bump(&s.counters.published_messages, 1);
            bump(&s.counters.published_updates, n);
        }
        Err(e) => {
            tracing::debug!(error = %e, "replica publish failed");
            bump(&s.counters.dropped_updates, n);
        }
    }
}

async fn heartbeat_loop(s: Arc<Shared>) {
    let mut tick = tokio::time::interval(Duration::from_millis(s.opts.heartbeat_ms));
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        if s.client.connection_state() == NatsState::Connected {
            publish(&s, "", Kind::Heartbeat, vec![Msg::Heartbeat]).await;
        }
    }
}

async fn subscribe_loop(s: Arc<Shared>, mut sub: async_nats::Subscriber) {
    while let Some(m) = sub.next().await {
        match wire::decode(&m.payload) {
            Ok(env) => receive(&s, env),
            Err(e) => {
                tracing::debug!(error = %e, subject = %m.subject, "undecodable replica message");
                bump(&s.counters.decode_errors, 1);
            }
        }
    }
}

/// Applies one peer envelope to the routers.
fn receive(s: &Shared, env: Envelope) {
    let from = ReplicaId(env.from);
    if from == s.id {
        return; // An echo, or a peer misconfigured with this replica's name.
    }
    let known = lock(&s.peers).insert(from, env.epoch);
    if known.is_some_and(|e| e != env.epoch) {
        forget_peer(s, from);
    }
    for m in env.msgs {
        match m {
            Msg::Heartbeat => {
                for d in s.pools.values() {
                    let _ = d.replica_heartbeat(from);
                }
            }
            Msg::Bye => {
                lock(&s.peers).remove(&from);
                forget_peer(s, from);
            }
            m => apply(s, from, &env.model, m),
        }
    }
}

fn apply(s: &Shared, from: ReplicaId, model: &str, m: Msg) {
    let Some(driver) = s.pools.get(model) else {
        bump(&s.counters.unknown_model, 1);
        return;
    };
    match wire::to_update(m, |us| driver.instant_at_unix_us(us)) {
        Ok(Some(u)) => match driver.apply_replica_update(from, u) {
            Ok(()) => bump(&s.counters.received_updates, 1),
            Err(_) => bump(&s.counters.refused_updates, 1),
        },
        Ok(None) => {}
        Err(_) => bump(&s.counters.decode_errors, 1),
    }
}

/// Drops everything `peer` reported, in every pool.
fn forget_peer(s: &Shared, peer: ReplicaId) {
    bump(&s.counters.peer_resets, 1);
    for d in s.pools.values() {
        let _ = d.replica_gone(peer);
    }
}

/// On a lost connection, forgets every peer (the ends of their requests may be lost)
/// and starts a new epoch, so peers forget this replica's reports too.
async fn events_loop(s: Arc<Shared>, mut events: mpsc::Receiver<Event>) {
    while let Some(ev) = events.recv().await {
        match ev {
            Event::Disconnected => {
                tracing::warn!("NATS connection lost: routing on local load only");
                bump(&s.counters.disconnects, 1);
                s.epoch.fetch_add(1, Ordering::Relaxed);
                let peers: Vec<ReplicaId> = std::mem::take(&mut *lock(&s.peers)).into_keys().collect();
                for p in peers {
                    forget_peer(&s, p);
                }
            }
            Event::Connected => tracing::info!("NATS connected: sharing load with peer replicas"),
            other => tracing::debug!(event = %other, "NATS event"),
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

/// A seed from the process's random hasher keys: epochs differ across restarts.
fn random_u64() -> u64 {
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u64(0x6b76_7265_706c_6963);
    h.finish()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn added(blocks: usize) -> Msg {
        Msg::Added { id: 1, phase: 0, worker: 0, rank: 0, prefill: 0, output: 0, blocks: vec![1; blocks] }
    }

    #[track_caller]
    fn check(msgs: Vec<Msg>, want_sizes: &[usize]) {
        let got: Vec<usize> = chunks(msgs).iter().map(Vec::len).collect();
        assert_eq!(got, want_sizes);
    }

    #[test]
    fn batches_split_by_updates_and_blocks() {
        check(vec![], &[]);
        check(vec![Msg::Finished { id: 1, phase: 0 }; 3], &[3]);
        check(
            vec![Msg::Finished { id: 1, phase: 0 }; wire::UPDATES_PER_MESSAGE_MAX + 1],
            &[wire::UPDATES_PER_MESSAGE_MAX, 1],
        );
        let half = wire::BLOCKS_PER_MESSAGE_MAX / 2;
        check(vec![added(half), added(half), added(1)], &[2, 1]);
        // An update larger than a message's budget still travels, alone.
        check(vec![added(1), added(wire::BLOCKS_PER_MESSAGE_MAX + 1), added(1)], &[1, 1, 1]);
    }

    #[tokio::test]
    async fn a_refused_url_keeps_the_clients_error_as_the_source() {
        use std::error::Error;
        let opts = ReplicaOptions { nats_url: "nats://127.0.0.1:notaport".into(), ..ReplicaOptions::default() };
        let e = match start(opts, Vec::new()).await {
            Err(e) => e,
            Ok(_) => panic!("a URL without a port number started a replica"),
        };
        assert!(matches!(e, ReplicaStartError::Connect(_)), "{e:?}");
        let source = e.source().expect("the client's error is the source");
        assert!(source.is::<async_nats::ConnectError>(), "{source:?}");
        assert_eq!(e.to_string(), format!("NATS client: {source}"));
    }
}
