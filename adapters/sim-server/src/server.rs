//! Starting and stopping a worker: binding, spawning the three tasks (HTTP accept loop,
//! engine, publisher) and a prefill worker's bootstrap server, and the ordered shutdown.
//!
//! Shutdown order: stop accepting, let open connections finish (bounded by
//! `shutdown_grace_ms`) while the engine keeps running so in-flight streams complete,
//! then stop the engine, whose dropped event sender lets the publisher drain its queue
//! and close the sockets.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use kvroute_sim::engine::Engine;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tokio::task::JoinHandle;

use crate::bootstrap::{self, Rooms};
use crate::engine_task::EngineTask;
use crate::faults::Faults;
use crate::http::{handle, State};
use crate::info::Facts;
use crate::metrics::Metrics;
use crate::openai::ParseLimits;
use crate::publisher::Publisher;
use crate::{SimServerConfig, SimServerError};

/// Submissions queued for the engine task before handlers wait.
const SUBMIT_QUEUE_MAX: usize = 1024;

/// The largest speedup accepted: beyond it pass durations vanish next to the clock's
/// resolution and the engine could spin.
pub const SPEEDUP_MAX: f64 = 1e6;

/// A running worker: its bound addresses and the way to stop it. Dropping the handle
/// also stops the worker, without waiting for it.
#[derive(Debug)]
pub struct SimServerHandle {
    http_addr: SocketAddr,
    events_port: u16,
    replay_port: Option<u16>,
    bootstrap_port: Option<u16>,
    events_bind: String,
    stop: watch::Sender<bool>,
    done: JoinHandle<()>,
}

impl SimServerHandle {
    /// The HTTP listener's address (with the port actually bound).
    pub fn http_addr(&self) -> SocketAddr {
        self.http_addr
    }

    /// `http://host:port`, for clients.
    pub fn base_url(&self) -> String {
        format!("http://{}", self.http_addr)
    }

    /// The ZeroMQ PUB port actually bound.
    pub fn events_port(&self) -> u16 {
        self.events_port
    }

    /// The PUB endpoint to connect a SUB socket to, e.g. `tcp://127.0.0.1:5557`.
    pub fn events_endpoint(&self) -> String {
        format!("tcp://{}:{}", bracket(&self.events_bind), self.events_port)
    }

    /// The replay ROUTER port actually bound, if enabled.
    pub fn replay_port(&self) -> Option<u16> {
        self.replay_port
    }

    /// The bootstrap server's port actually bound, if this prefill worker runs one.
    pub fn bootstrap_port(&self) -> Option<u16> {
        self.bootstrap_port
    }

    /// The replay endpoint to connect a DEALER socket to, if enabled.
    pub fn replay_endpoint(&self) -> Option<String> {
        self.replay_port.map(|p| format!("tcp://{}:{p}", bracket(&self.events_bind)))
    }

    /// Stops accepting, lets open requests finish (bounded by the grace period), then
    /// stops the engine and the publisher; returns when all three tasks are done.
    pub async fn shutdown(self) {
        let _ = self.stop.send(true);
        if let Err(e) = self.done.await {
            tracing::warn!(error = %e, "worker task ended abnormally");
        }
    }
}

/// `[::1]` for IPv6 literals, so endpoints and URLs parse.
pub(crate) fn bracket(host: &str) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]")
    } else {
        host.to_string()
    }
}

fn validate(cfg: &SimServerConfig) -> Result<(), SimServerError> {
    if cfg.engine.speedup.is_nan() || cfg.engine.speedup > SPEEDUP_MAX {
        return Err(SimServerError::Config("speedup must be at most 1e6"));
    }
    if cfg.max_tokens_default == 0 || cfg.max_tokens_max == 0 || cfg.max_tokens_default > cfg.max_tokens_max {
        return Err(SimServerError::Config("max_tokens_default must be in 1..=max_tokens_max"));
    }
    if cfg.bootstrap_port.is_some() && cfg.engine.role != kvroute_sim::engine::EngineRole::Prefill {
        return Err(SimServerError::Config("only a prefill worker runs a bootstrap server"));
    }
    if cfg.bootstrap_rooms_max == 0 || cfg.bootstrap_timeout_ms == 0 {
        return Err(SimServerError::Config("bootstrap_rooms_max and bootstrap_timeout_ms must be positive"));
    }
    if cfg.body_bytes_max == 0 || cfg.requests_in_flight_max == 0 || cfg.event_queue_max == 0 {
        return Err(SimServerError::Config(
            "body_bytes_max, requests_in_flight_max and event_queue_max must be positive",
        ));
    }
    Ok(())
}

/// Binds every socket, starts the worker and returns once it serves. Must be called
/// inside a tokio runtime.
pub async fn spawn(cfg: SimServerConfig) -> Result<SimServerHandle, SimServerError> {
    validate(&cfg)?;
    let engine = Engine::new(cfg.engine.clone(), cfg.dp_rank).map_err(SimServerError::Engine)?;
    let listener = TcpListener::bind((cfg.host, cfg.port)).await.map_err(SimServerError::HttpBind)?;
    let http_addr = listener.local_addr().map_err(SimServerError::HttpBind)?;
    let bootstrap = match cfg.bootstrap_port {
        Some(port) => Some(TcpListener::bind((cfg.host, port)).await.map_err(SimServerError::BootstrapBind)?),
        None => None,
    };
    let bootstrap_port = match &bootstrap {
        Some(l) => Some(l.local_addr().map_err(SimServerError::BootstrapBind)?.port()),
        None => None,
    };
    let rooms = Arc::new(Rooms::new(cfg.bootstrap_rooms_max, Duration::from_millis(cfg.bootstrap_timeout_ms)));
    let metrics = Metrics::default();
    let (publisher, ports) = Publisher::bind(&cfg, metrics.clone()).await?;

    let (submit_tx, submit_rx) = mpsc::channel(SUBMIT_QUEUE_MAX);
    let (events_tx, events_rx) = mpsc::channel(cfg.event_queue_max);
    let (stop_tx, stop_rx) = watch::channel(false);
    let (engine_stop_tx, engine_stop_rx) = watch::channel(false);

    let engine_id = format!("kvroute-sim-{}-dp{}", http_addr.port(), cfg.dp_rank);
    let created = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
    let state = Arc::new(State {
        model: cfg.model.clone(),
        role: cfg.engine.role,
        facts: Facts::new(&cfg, engine_id.clone(), ports.events, ports.replay),
        limits: ParseLimits { max_tokens_default: cfg.max_tokens_default, max_tokens_max: cfg.max_tokens_max },
        body_bytes_max: cfg.body_bytes_max,
        requests_in_flight_max: cfg.requests_in_flight_max,
        tokenizer: cfg.tokenizer.clone(),
        media: cfg.media.clone(),
        submit_tx,
        registry: metrics.registry(),
        metrics: metrics.clone(),
        in_flight: Arc::new(AtomicUsize::new(0)),
        next_response: AtomicU64::new(0),
        engine_id,
        host: http_addr.ip().to_string(),
        port: http_addr.port(),
        created,
        rooms: rooms.clone(),
        faults: cfg.faults.clone(),
    });

    let publisher_task = tokio::spawn(publisher.run(events_rx));
    let engine_task = tokio::spawn(EngineTask::new(engine, events_tx, metrics).run(submit_rx, engine_stop_rx));
    let grace = Duration::from_millis(cfg.shutdown_grace_ms);
    let bootstrap_task = bootstrap.map(|l| tokio::spawn(bootstrap::serve(l, rooms, stop_rx.clone())));
    let faults = cfg.faults.clone();
    let done = tokio::spawn(async move {
        serve(listener, state, stop_rx, grace, faults).await;
        if let Some(t) = bootstrap_task {
            let _ = t.await;
        }
        let _ = engine_stop_tx.send(true);
        let _ = engine_task.await;
        let _ = publisher_task.await;
    });
    tracing::info!(%http_addr, events_port = ports.events, replay_port = ?ports.replay, "sim worker serving");
    Ok(SimServerHandle {
        http_addr,
        events_port: ports.events,
        replay_port: ports.replay,
        bootstrap_port,
        events_bind: cfg.events_bind.clone(),
        stop: stop_tx,
        done,
    })
}

async fn serve(
    listener: TcpListener,
    state: Arc<State>,
    mut stop: watch::Receiver<bool>,
    grace: Duration,
    faults: Faults,
) {
    let graceful = GracefulShutdown::new();
    let builder = auto::Builder::new(TokioExecutor::new());
    loop {
        tokio::select! {
            _ = stop.changed() => break,
            // Killed: the port closes and every connection is cut, nothing graceful.
            _ = faults.killed() => return,
            accepted = listener.accept() => {
                let stream = match accepted {
                    Ok((s, _)) => s,
                    Err(e) => {
                        // Out of descriptors or a reset before accept: keep serving.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(10)).await;
                        continue;
                    }
                };
                if let Err(e) = stream.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY not set");
                }
                let state = state.clone();
                let svc = service_fn(move |req| handle(state.clone(), req));
                let conn = builder.serve_connection(TokioIo::new(stream), svc).into_owned();
                let conn = graceful.watch(conn);
                let faults = faults.clone();
                tokio::spawn(async move {
                    tokio::select! {
                        ended = conn => if let Err(e) = ended {
                            tracing::debug!(error = %e, "connection ended with an error");
                        },
                        _ = faults.killed() => {}
                    }
                });
            }
        }
    }
    drop(listener);
    if tokio::time::timeout(grace, graceful.shutdown()).await.is_err() {
        tracing::warn!("connections still open after the shutdown grace period; closing");
    }
}

/// Runs a worker until ctrl-c or SIGTERM, then shuts it down gracefully.
pub async fn run(cfg: SimServerConfig) -> Result<(), SimServerError> {
    let handle = spawn(cfg).await?;
    wait_for_signal().await?;
    tracing::info!("shutting down");
    handle.shutdown().await;
    Ok(())
}

#[cfg(unix)]
async fn wait_for_signal() -> Result<(), SimServerError> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut term = signal(SignalKind::terminate()).map_err(SimServerError::Signal)?;
    tokio::select! {
        r = tokio::signal::ctrl_c() => r.map_err(SimServerError::Signal),
        _ = term.recv() => Ok(()),
    }
}

#[cfg(not(unix))]
async fn wait_for_signal() -> Result<(), SimServerError> {
    tokio::signal::ctrl_c().await.map_err(SimServerError::Signal)
}
