//! The accept loop: connection limit, graceful shutdown.

use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{watch, Semaphore};
use tokio::task::JoinSet;

use crate::conn;
use crate::http::App;

/// Pause after a failed accept (typically out of file descriptors) so the
/// loop does not spin while the condition lasts.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Serves `app` on `listener` until `shutdown` turns true (or its sender is
/// dropped), then stops accepting and lets open connections finish their
/// current request, for at most one request timeout plus a margin.
pub(crate) async fn serve(
    listener: TcpListener,
    app: Arc<App>,
    mut shutdown: watch::Receiver<bool>,
) {
    let permits = Arc::new(Semaphore::new(
        app.limits.max_connections.min(Semaphore::MAX_PERMITS),
    ));
    let mut connections = JoinSet::new();

    loop {
        // Taking the permit before accepting leaves connections past the
        // limit queued in the kernel instead of accepted and starved.
        let permit = tokio::select! {
            permit = Arc::clone(&permits).acquire_owned() => match permit {
                Ok(permit) => permit,
                Err(_) => break,
            },
            Some(ended) = connections.join_next() => {
                log_panic(ended);
                continue;
            }
            _ = stopping(&mut shutdown) => break,
        };
        let accepted = loop {
            tokio::select! {
                accepted = listener.accept() => break Some(accepted),
                Some(ended) = connections.join_next() => log_panic(ended),
                _ = stopping(&mut shutdown) => break None,
            }
        };
        let Some(accepted) = accepted else { break };
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
        let app = Arc::clone(&app);
        let stop = shutdown.clone();
        app.metrics.connection_opened();
        connections.spawn(async move {
            conn::serve_connection(stream, peer, &app, stop).await;
            app.metrics.connection_closed();
            drop(permit);
        });
    }

    drop(listener);
    let grace = app.limits.request_timeout + Duration::from_secs(5);
    let drained = tokio::time::timeout(grace, async {
        while let Some(ended) = connections.join_next().await {
            log_panic(ended);
        }
    })
    .await;
    if drained.is_err() {
        tracing::warn!(
            ?grace,
            "connections still open after the shutdown grace period; closing them"
        );
        connections.shutdown().await;
    }
}

fn log_panic(ended: Result<(), tokio::task::JoinError>) {
    if let Err(err) = ended {
        if err.is_panic() {
            tracing::error!(%err, "a connection task panicked");
        }
    }
}

/// Resolves once shutdown is requested or the handle that could request it
/// is gone.
pub(crate) async fn stopping(shutdown: &mut watch::Receiver<bool>) {
    // `wait_for` also returns at once if the flag was set before the call.
    let _ = shutdown.wait_for(|stop| *stop).await;
}
