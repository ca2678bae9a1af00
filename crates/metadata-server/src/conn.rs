//! One client connection: read a request with [`crate::request`], answer it,
//! and again while the client keeps the connection open.
//!
//! The server speaks HTTP/1.1 itself rather than through hyper because
//! hyper answers a request it cannot parse with a bare status and no body,
//! and the protocol here promises a reason with every refusal (and counts
//! each refusal by kind).

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tokio::sync::watch;
use tokio::time::Instant;

use crate::http::{self, App, Response};
use crate::request::{parse_head, BodyReader, Head, Method, ParseLimits, Reject, RejectKind};
use crate::server::stopping;

/// Bytes asked of the socket per read.
const READ_CHUNK: usize = 16 * 1024;

/// After refusing a request the server closes the connection, but first
/// reads (and drops) what the client is still sending, for at most this
/// long or [`LINGER_BYTES`]: closing with unread bytes makes the kernel
/// send a reset, which can destroy the answer before the client reads it.
const LINGER: Duration = Duration::from_secs(1);
const LINGER_BYTES: usize = 4 << 20;

/// `deadline` after `timeout` from now, or far in the future when that does
/// not fit an `Instant` (a timeout of years is a timeout never reached).
fn deadline_after(timeout: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(timeout)
        .unwrap_or_else(|| now + Duration::from_secs(100 * 365 * 86_400))
}

/// Serves requests on `stream` until the client closes it, a request asks
/// to close it, a request is refused, or the server stops (between
/// requests).
pub(crate) async fn serve_connection(
    mut stream: TcpStream,
    peer: SocketAddr,
    app: &Arc<App>,
    mut stop: watch::Receiver<bool>,
) {
    let limits = ParseLimits::from_limits(&app.limits);
    let timeout = app.limits.request_timeout;
    let mut buf: Vec<u8> = Vec::with_capacity(READ_CHUNK);
    loop {
        let (head, head_len) = match read_head(&mut stream, &mut buf, &limits, timeout, &mut stop)
            .await
        {
            Ok(Some(head)) => head,
            Ok(None) => return,
            Err(Refused::Reject(reject)) => return refuse(&mut stream, app, None, reject).await,
            Err(Refused::Io(err)) => {
                tracing::debug!(%peer, %err, "connection ended while reading a request head");
                return;
            }
        };
        buf.drain(..head_len);
        let body = match read_body(&mut stream, &mut buf, &head, &limits, timeout).await {
            Ok(body) => body,
            Err(Refused::Reject(reject)) => {
                return refuse(&mut stream, app, Some(&head), reject).await
            }
            Err(Refused::Io(err)) => {
                tracing::debug!(%peer, %err, "connection ended while reading a request body");
                return;
            }
        };
        let response = http::handle(app, &head, body).await;
        let keep_alive = head.keep_alive && !response.close && !*stop.borrow();
        let send_body = head.method != Method::Head;
        let written = write_response(
            &mut stream,
            &response,
            send_body,
            keep_alive,
            head.http11,
            timeout,
        )
        .await;
        if let Err(err) = written {
            tracing::debug!(%peer, %err, "cannot send a response");
            return;
        }
        if !keep_alive {
            let _ = stream.shutdown().await;
            return;
        }
    }
}

enum Refused {
    /// Answer with this and close.
    Reject(Reject),
    /// The connection failed; nothing can be answered.
    Io(std::io::Error),
}

/// Reads until `buf` starts with a complete head. `Ok(None)` when the
/// connection should end without an answer: the client closed it or kept
/// it idle past the timeout between requests, or the server is stopping.
async fn read_head(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    limits: &ParseLimits,
    timeout: Duration,
    stop: &mut watch::Receiver<bool>,
) -> Result<Option<(Head, usize)>, Refused> {
    // Like hyper's header_read_timeout, the clock runs from when the server
    // starts waiting for the head, so an idle keep-alive connection is
    // closed after one timeout and cannot hold a connection slot forever.
    let deadline = deadline_after(timeout);
    // Bytes left over from the previous request may hold this one already.
    let mut parse = !buf.is_empty();
    loop {
        if parse {
            if let Some(head) = parse_head(buf, limits).map_err(Refused::Reject)? {
                return Ok(Some(head));
            }
        }
        let idle = is_blank(buf);
        let read = tokio::select! {
            read = tokio::time::timeout_at(deadline, read_more(stream, buf)) => read,
            _ = stopping(stop), if idle => return Ok(None),
        };
        match read {
            Err(_elapsed) if idle => return Ok(None),
            Err(_elapsed) => {
                return Err(Refused::Reject(Reject::new(
                    408,
                    RejectKind::HeadTimeout,
                    format!("request head not received within {timeout:?}"),
                )))
            }
            Ok(Ok(0)) if idle => return Ok(None),
            Ok(Ok(0)) => {
                return Err(Refused::Reject(Reject::new(
                    400,
                    RejectKind::HeadIncomplete,
                    format!(
                        "connection ended after {} bytes of a request head",
                        buf.len()
                    ),
                )))
            }
            Ok(Ok(n)) => {
                // A head ends with a line feed: parsing again before one
                // arrives cannot succeed, and a client sending one byte at
                // a time must not make every byte cost a parse of the whole
                // buffer. Past the limit, parse to refuse it.
                parse = buf[buf.len() - n..].contains(&b'\n') || buf.len() > limits.max_head_bytes;
            }
            Ok(Err(err)) => return Err(Refused::Io(err)),
        }
    }
}

/// Nothing, or only the empty lines a client may send between requests.
fn is_blank(buf: &[u8]) -> bool {
    buf.iter().all(|&b| b == b'\r' || b == b'\n')
}

/// Reads the body the head announces, taking first what `buf` already
/// holds; leaves in `buf` what follows the body.
async fn read_body(
    stream: &mut TcpStream,
    buf: &mut Vec<u8>,
    head: &Head,
    limits: &ParseLimits,
    timeout: Duration,
) -> Result<Vec<u8>, Refused> {
    let mut reader = BodyReader::new(head.body, limits.max_body_bytes).map_err(Refused::Reject)?;
    let used = reader.feed(buf).map_err(Refused::Reject)?;
    buf.drain(..used);
    if reader.is_done() {
        return Ok(reader.into_body());
    }
    if head.expect_continue {
        stream
            .write_all(b"HTTP/1.1 100 Continue\r\n\r\n")
            .await
            .map_err(Refused::Io)?;
    }
    let deadline = deadline_after(timeout);
    while !reader.is_done() {
        match tokio::time::timeout_at(deadline, read_more(stream, buf)).await {
            Err(_elapsed) => {
                return Err(Refused::Reject(Reject::new(
                    408,
                    RejectKind::BodyTimeout,
                    format!("request body not received within {timeout:?}"),
                )))
            }
            Ok(Ok(0)) => return Err(Refused::Reject(reader.incomplete())),
            Ok(Ok(_)) => {
                let used = reader.feed(buf).map_err(Refused::Reject)?;
                buf.drain(..used);
            }
            Ok(Err(err)) => return Err(Refused::Io(err)),
        }
    }
    Ok(reader.into_body())
}

/// Appends what one read returns to `buf`.
async fn read_more(stream: &mut TcpStream, buf: &mut Vec<u8>) -> std::io::Result<usize> {
    let old = buf.len();
    buf.resize(old + READ_CHUNK, 0);
    let result = stream.read(&mut buf[old..]).await;
    buf.truncate(old + *result.as_ref().unwrap_or(&0));
    result
}

/// Answers `reject`, counts it, and closes the connection.
async fn refuse(stream: &mut TcpStream, app: &Arc<App>, head: Option<&Head>, reject: Reject) {
    app.metrics.rejected(&reject);
    if let Some(head) = head {
        if head.path == http::METADATA_PATH {
            app.metrics.request(head.method, reject.status);
        }
    }
    tracing::debug!(status = reject.status, reason = %reject.reason, "request refused");
    // Mooncake labels every /metadata answer JSON; so do refusals there.
    let response = match head {
        Some(head) if head.path == http::METADATA_PATH => {
            Response::metadata_text(reject.status, reject.reason)
        }
        _ => Response::text(reject.status, reject.reason),
    };
    let timeout = app.limits.request_timeout.min(LINGER);
    let send_body = !head.is_some_and(|head| head.method == Method::Head);
    let http11 = head.is_none_or(|head| head.http11);
    let written = write_response(stream, &response, send_body, false, http11, timeout).await;
    if written.is_err() {
        return;
    }
    let _ = stream.shutdown().await;
    let linger = async {
        let mut sink = vec![0u8; READ_CHUNK];
        let mut drained = 0;
        while drained < LINGER_BYTES {
            match stream.read(&mut sink).await {
                Ok(0) | Err(_) => break,
                Ok(n) => drained += n,
            }
        }
    };
    let _ = tokio::time::timeout(LINGER, linger).await;
}

/// Writes `response` (its body only if `send_body`: not for HEAD), bounded
/// by `timeout`: a client that does not read its answers must not hold the
/// connection forever.
async fn write_response(
    stream: &mut TcpStream,
    response: &Response,
    send_body: bool,
    keep_alive: bool,
    http11: bool,
    timeout: Duration,
) -> std::io::Result<()> {
    let mut out = response.head_bytes(keep_alive, http11);
    let body = response.body();
    // One write for a small answer, so it leaves in one segment.
    let small = body.len() <= READ_CHUNK;
    if send_body && small {
        out.extend_from_slice(body);
    }
    let write = async {
        stream.write_all(&out).await?;
        if send_body && !small {
            stream.write_all(body).await?;
        }
        stream.flush().await
    };
    match tokio::time::timeout(timeout, write).await {
        Ok(result) => result,
        Err(_) => Err(std::io::Error::new(
            std::io::ErrorKind::TimedOut,
            "client did not read its answer in time",
        )),
    }
}
