//! The gRPC server: the ext_proc service (one task per gateway stream) beside the
//! standard health service, with a graceful stop.

use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use futures::Stream;
use tokio::net::TcpListener;
use tokio::sync::{mpsc, watch};
use tonic::transport::Server;
use tonic::{Request, Response, Status, Streaming};
use tonic_health::pb::health_server::{Health, HealthServer};

use crate::pb::ext_proc::external_processor_server::{ExternalProcessor, ExternalProcessorServer};
use crate::pb::ext_proc::{ProcessingRequest, ProcessingResponse};
use crate::{exchange, health_names, EppConfig, EppError, Shared};

/// Answers queued per stream before the stream's task waits for the gateway to read.
const ANSWERS_QUEUED_MAX: usize = 16;

/// The ext_proc service.
struct Picker {
    shared: Arc<Shared>,
}

type Answers = Pin<Box<dyn Stream<Item = Result<ProcessingResponse, Status>> + Send>>;

#[tonic::async_trait]
impl ExternalProcessor for Picker {
    type ProcessStream = Answers;

    async fn process(
        &self,
        request: Request<Streaming<ProcessingRequest>>,
    ) -> Result<Response<Self::ProcessStream>, Status> {
        let (tx, rx) = mpsc::channel(ANSWERS_QUEUED_MAX);
        tokio::spawn(exchange::run(self.shared.clone(), request.into_inner(), tx));
        let answers = futures::stream::unfold(rx, |mut rx| async move { rx.recv().await.map(|a| (a, rx)) });
        Ok(Response::new(Box::pin(answers)))
    }
}

/// How often an idle gateway connection is pinged, so a vanished gateway's streams end.
const KEEPALIVE_INTERVAL_S: u64 = 30;

/// The server settings: one HTTP/2 stream per request in flight, keepalive pings, and
/// TLS when configured.
pub(crate) fn server(cfg: &EppConfig) -> Result<Server, EppError> {
    let streams = u32::try_from(cfg.proxy.limits.concurrent_requests_max).unwrap_or(u32::MAX);
    let server = Server::builder()
        .max_concurrent_streams(streams)
        .http2_keepalive_interval(Some(Duration::from_secs(KEEPALIVE_INTERVAL_S)));
    let Some(id) = &cfg.tls else { return Ok(server) };
    #[cfg(feature = "tls")]
    {
        let tls = tonic::transport::ServerTlsConfig::new()
            .identity(tonic::transport::Identity::from_pem(&id.cert_pem, &id.key_pem));
        server.tls_config(tls).map_err(EppError::Tls)
    }
    #[cfg(not(feature = "tls"))]
    {
        let _ = (id, server);
        Err(EppError::TlsNotBuilt)
    }
}

/// Serves until `shutdown` turns true, then reports `NOT_SERVING` and drains.
pub(crate) async fn run(
    mut server: Server,
    listener: TcpListener,
    shared: Arc<Shared>,
    health: HealthServer<impl Health>,
    mut shutdown: watch::Receiver<bool>,
) {
    let reporter = shared.health.clone();
    let picker = ExternalProcessorServer::new(Picker { shared: shared.clone() }).max_decoding_message_size(
        usize::try_from(shared.cfg.proxy.limits.body_bytes_max).unwrap_or(usize::MAX).saturating_add(64 << 10),
    );
    let stop = async move {
        let _ = shutdown.wait_for(|s| *s).await;
        for name in [health_names::READINESS, health_names::EXT_PROC, "", health_names::LIVENESS] {
            reporter.set_service_status(name, tonic_health::ServingStatus::NotServing).await;
        }
    };
    let incoming = tonic::transport::server::TcpIncoming::from(listener).with_nodelay(Some(true));
    let served = server.add_service(health).add_service(picker).serve_with_incoming_shutdown(incoming, stop).await;
    if let Err(e) = served {
        tracing::error!(error = %e, "the ext_proc server stopped");
    }
}

/// Serves only the health service, in plaintext, until `shutdown` turns true.
pub(crate) async fn run_health(
    listener: TcpListener,
    health: HealthServer<impl Health>,
    mut shutdown: watch::Receiver<bool>,
) {
    let incoming = tonic::transport::server::TcpIncoming::from(listener);
    let stop = async move {
        let _ = shutdown.wait_for(|s| *s).await;
    };
    if let Err(e) = Server::builder().add_service(health).serve_with_incoming_shutdown(incoming, stop).await {
        tracing::error!(error = %e, "the health server stopped");
    }
}
