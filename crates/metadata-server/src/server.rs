//! The accept loop: connection limit, HTTP/1 settings, graceful shutdown.

use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};

use crate::metrics::Metrics;
use crate::Limits;

/// Pause after a failed accept (typically out of file descriptors) so the
/// loop does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `router` on `listener` until `shutdown` turns true (or its sender
/// is dropped), then stops accepting and lets open connections finish their
/// current request, for at most one request timeout plus a margin.
pub(crate) async fn serve(
    listener: TcpListener,
    router: Router,
    limits: Limits,
    metrics: Arc<Metrics>,
    mut shutdown: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(
        limits.max_connections.min(Semaphore::MAX_PERMITS),
    ));
    let graceful = GracefulShutdown::new();
    let mut http = http1::Builder::new();
    // Besides bounding how long headers may take, this closes idle
    // keep-alive connections: hyper arms it whenever it waits for a request
    // head, so an idle client cannot hold a connection slot forever.
    http.timer(TokioTimer::new())
        .header_read_timeout(limits.request_timeout);

    loop {
        // Taking the permit before accepting leaves connections past the
        // limit queued in the kernel instead of accepted and starved.
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            _ = stopping(&mut shutdown) => break,
        };
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stopping(&mut shutdown) => break,
        };
        let (stream, peer) = match accepted {
            Ok(accepted) => accepted,
            Err(err) => {
                tracing::warn!(%err, "accept failed; retrying");
                drop(permit);
                tokio::select! {
                    _ = tokio::time::sleep(ACCEPT_BACKOFF) => continue,
                    _ = stopping(&mut shutdown) => break,
                }
            }
        };
        // Small request/response exchanges: do not let Nagle delay answers.
        let _ = stream.set_nodelay(true);
        let service = TowerToHyperService::new(router.clone());
        let connection = graceful.watch(http.serve_connection(TokioIo::new(stream), service));
        let metrics = Arc::clone(&metrics);
        metrics.connection_opened();
        tokio::spawn(async move {
            // Errors here are the client's (garbage, hang-ups, timeouts):
            // hyper has already answered what could be answered and the
            // connection is closed when this task ends.
            if let Err(err) = connection.await {
                tracing::debug!(%peer, %err, "connection ended with an error");
            }
            metrics.connection_closed();
            drop(permit);
        });
    }

    drop(listener);
    let grace = limits.request_timeout + Duration::from_secs(5);
    tokio::select! {
        _ = graceful.shutdown() => {}
        _ = tokio::time::sleep(grace) => {
            tracing::warn!(?grace, "connections still open after the shutdown grace period; closing them");
        }
    }
}

/// Resolves once shutdown is requested or the handle that could request it
/// is gone.
async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    // `wait_for` also returns at once if the flag was set before the call.
    let _ = shutdown.wait_for(|stop| *stop).await;
}
