//! The HTTP/1.1 request parser: bytes read from a connection in, a request
//! head and body (or the reason to refuse them) out.
//!
//! It does no I/O, so the server's connection loop, the tests and the fuzz
//! target drive the same code: the loop calls [`parse_head`] on what it has
//! read so far and feeds the rest to a [`BodyReader`], and
//! [`parse_request`] does both on one buffer. Tokenizing the head is
//! `httparse`'s (hyper's parser); this module decides what the head means:
//! framing (`Content-Length`, `Transfer-Encoding: chunked`), keep-alive,
//! `Expect: 100-continue`, the request target, and every refusal with a
//! status code, a metrics label and a one-line reason for the client.

use std::fmt;

use crate::Limits;

/// Most header fields a request head may have (hyper's default too).
pub const MAX_HEADERS: usize = 100;

/// Longest chunk-size line (size, extensions) of a chunked body: a line
/// that never ends must not hold the connection.
const MAX_CHUNK_LINE: usize = 4096;

/// Most bytes of trailer fields after a chunked body; they are read and
/// dropped.
const MAX_TRAILER_BYTES: usize = 16 * 1024;

/// Head room past the longest percent-encoded key for the request line's
/// other parts and the header fields.
const HEAD_ALLOWANCE: usize = 32 * 1024;

/// How large a request may be, derived from [`Limits`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParseLimits {
    /// Longest request head (request line and header fields) in bytes.
    pub max_head_bytes: usize,
    /// Longest body in bytes (decoded, for a chunked one).
    pub max_body_bytes: usize,
}

impl ParseLimits {
    /// The parse limits the server uses for `limits`: a head must hold a
    /// key of `max_key_bytes` percent-encoded (three bytes per byte) plus
    /// room for ordinary headers; a body may be `max_value_bytes` long.
    pub fn from_limits(limits: &Limits) -> ParseLimits {
        ParseLimits {
            max_head_bytes: limits
                .max_key_bytes
                .saturating_mul(3)
                .saturating_add(HEAD_ALLOWANCE),
            max_body_bytes: limits.max_value_bytes,
        }
    }
}

/// A request method. Methods the server has no use for are all
/// [`Method::Other`], so a client inventing methods cannot grow a metric's
/// label set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Method {
    /// `GET`
    Get,
    /// `HEAD`
    Head,
    /// `PUT`
    Put,
    /// `DELETE`
    Delete,
    /// `POST`
    Post,
    /// Any other method.
    Other,
}

impl Method {
    fn from_token(token: &str) -> Method {
        // Methods are case-sensitive (RFC 9110, 9.1).
        match token {
            "GET" => Method::Get,
            "HEAD" => Method::Head,
            "PUT" => Method::Put,
            "DELETE" => Method::Delete,
            "POST" => Method::Post,
            _ => Method::Other,
        }
    }

    /// The method's name, `OTHER` for [`Method::Other`]: the value of the
    /// `method` label in the metrics.
    pub fn label(self) -> &'static str {
        match self {
            Method::Get => "GET",
            Method::Head => "HEAD",
            Method::Put => "PUT",
            Method::Delete => "DELETE",
            Method::Post => "POST",
            Method::Other => "OTHER",
        }
    }
}

/// How the body of a request is framed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BodyLength {
    /// `Content-Length: N` (a value too large for `u64` is `u64::MAX`, which
    /// any limit refuses).
    Length(u64),
    /// `Transfer-Encoding: chunked`.
    Chunked,
}

/// A parsed request head.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Head {
    /// The method.
    pub method: Method,
    /// The path of the request target, as sent (not percent-decoded), e.g.
    /// `/metadata`; an absolute-form target (`http://host/path`) is reduced
    /// to its path, `*` stays `*`.
    pub path: String,
    /// The query string after `?`, as sent; `None` when there is no `?`.
    pub query: Option<String>,
    /// Whether the request is HTTP/1.1 (else HTTP/1.0).
    pub http11: bool,
    /// How the body is framed; a request without `Content-Length` or
    /// `Transfer-Encoding` has an empty body (`Length(0)`).
    pub body: BodyLength,
    /// Whether the client wants the connection kept open after the answer
    /// (HTTP/1.1 unless `Connection: close`; HTTP/1.0 only with
    /// `Connection: keep-alive`).
    pub keep_alive: bool,
    /// Whether the client waits for `100 Continue` before sending the body
    /// (`Expect: 100-continue` on HTTP/1.1).
    pub expect_continue: bool,
}

/// Why a request was refused before any handler saw it. Each kind is a
/// `reason` label value of `multirail_metadata_rejected_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RejectKind {
    /// The request line or a header field is not valid HTTP/1.x.
    MalformedHead,
    /// `Content-Length` is not a number, or given twice with different
    /// values.
    ContentLength,
    /// `Transfer-Encoding` is malformed, unsupported, or given with
    /// `Content-Length` or on HTTP/1.0.
    TransferEncoding,
    /// The head is longer than allowed or has too many header fields.
    HeadTooLarge,
    /// The connection ended in the middle of a head.
    HeadIncomplete,
    /// The head did not arrive within the request timeout.
    HeadTimeout,
    /// The body is longer than the value limit.
    BodyTooLarge,
    /// The chunked framing of the body is malformed.
    BodyMalformed,
    /// The connection ended in the middle of a body.
    BodyIncomplete,
    /// The body did not arrive within the request timeout.
    BodyTimeout,
}

impl RejectKind {
    /// The `reason` label value.
    pub fn label(self) -> &'static str {
        match self {
            RejectKind::MalformedHead => "malformed_head",
            RejectKind::ContentLength => "content_length",
            RejectKind::TransferEncoding => "transfer_encoding",
            RejectKind::HeadTooLarge => "head_too_large",
            RejectKind::HeadIncomplete => "head_incomplete",
            RejectKind::HeadTimeout => "head_timeout",
            RejectKind::BodyTooLarge => "body_too_large",
            RejectKind::BodyMalformed => "body_malformed",
            RejectKind::BodyIncomplete => "body_incomplete",
            RejectKind::BodyTimeout => "body_timeout",
        }
    }
}

/// A refused request: the status code to answer with, what kind of refusal
/// it is, and the reason sent as the answer's body (one line).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// The HTTP status code (400, 408, 413, 431 or 501).
    pub status: u16,
    /// The kind, for the metrics.
    pub kind: RejectKind,
    /// The reason, never empty and never more than one line.
    pub reason: String,
}

impl Reject {
    /// A refusal; line breaks in `reason` become spaces, so that the body
    /// stays one line whatever a caller put in it.
    pub fn new(status: u16, kind: RejectKind, reason: impl Into<String>) -> Reject {
        let mut reason: String = reason.into();
        if reason.contains(['\r', '\n']) {
            reason = reason.replace(['\r', '\n'], " ");
        }
        if reason.is_empty() {
            reason = kind.label().to_owned();
        }
        Reject {
            status,
            kind,
            reason,
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} {}", self.status, self.reason)
    }
}

fn malformed(reason: impl Into<String>) -> Reject {
    Reject::new(400, RejectKind::MalformedHead, reason)
}

/// At most 40 characters of a client's bytes, quoted and escaped, for a
/// reason: enough to recognize, never a line break, never huge.
fn quoted(bytes: &[u8]) -> String {
    const SHOWN: usize = 40;
    let text = String::from_utf8_lossy(&bytes[..bytes.len().min(SHOWN)]);
    let more = if bytes.len() > SHOWN { "..." } else { "" };
    format!("{text:?}{more}")
}

/// Parses the request head at the start of `buf`.
///
/// Returns `Ok(None)` when `buf` holds only the beginning of a head (read
/// more and call again with the longer buffer), `Ok(Some((head, n)))` when
/// the head is complete and takes the first `n` bytes, and the refusal when
/// the head is invalid or longer than `limits.max_head_bytes`. Empty lines
/// before the request line are skipped, as RFC 9112 (2.2) allows.
pub fn parse_head(buf: &[u8], limits: &ParseLimits) -> Result<Option<(Head, usize)>, Reject> {
    let too_large = || {
        Reject::new(
            431,
            RejectKind::HeadTooLarge,
            format!(
                "request head is longer than {} bytes",
                limits.max_head_bytes
            ),
        )
    };
    let mut fields = [httparse::EMPTY_HEADER; MAX_HEADERS];
    let mut request = httparse::Request::new(&mut fields);
    // Only the bytes a head may take are looked at, so that the verdict on
    // a head past the limit (431, or 400 for a fault within the limit) is
    // the same however the reads split it.
    let window = &buf[..buf.len().min(limits.max_head_bytes)];
    let len = match request.parse(window) {
        Ok(httparse::Status::Complete(len)) => len,
        Ok(httparse::Status::Partial) if buf.len() > limits.max_head_bytes => {
            return Err(too_large())
        }
        Ok(httparse::Status::Partial) => return Ok(None),
        Err(httparse::Error::TooManyHeaders) => {
            return Err(Reject::new(
                431,
                RejectKind::HeadTooLarge,
                format!("more than {MAX_HEADERS} header fields"),
            ))
        }
        Err(err) => return Err(malformed(httparse_reason(err))),
    };
    let (Some(method), Some(target), Some(version)) =
        (request.method, request.path, request.version)
    else {
        // httparse fills all three in a complete request.
        return Err(malformed("malformed request line"));
    };
    let http11 = version == 1;
    let (path, query) = split_target(target)?;

    let mut content_length: Option<u64> = None;
    let mut codings: Vec<String> = Vec::new();
    let mut has_transfer_encoding = false;
    let mut close = false;
    let mut keep_alive_token = false;
    let mut expect_continue = false;
    for field in request.headers.iter() {
        let name = field.name;
        let value = trim(field.value);
        if name.eq_ignore_ascii_case("content-length") {
            let length = parse_content_length(value)?;
            match content_length {
                Some(previous) if previous != length => {
                    return Err(Reject::new(
                        400,
                        RejectKind::ContentLength,
                        format!(
                            "Content-Length given twice with different values ({previous} and {length})"
                        ),
                    ))
                }
                _ => content_length = Some(length),
            }
        } else if name.eq_ignore_ascii_case("transfer-encoding") {
            has_transfer_encoding = true;
            for coding in value.split(|&b| b == b',') {
                let coding = trim(coding);
                if !coding.is_empty() {
                    codings.push(String::from_utf8_lossy(coding).to_ascii_lowercase());
                }
            }
        } else if name.eq_ignore_ascii_case("connection") {
            for token in value.split(|&b| b == b',') {
                let token = trim(token);
                close |= token.eq_ignore_ascii_case(b"close");
                keep_alive_token |= token.eq_ignore_ascii_case(b"keep-alive");
            }
        } else if name.eq_ignore_ascii_case("expect") {
            expect_continue |= value.eq_ignore_ascii_case(b"100-continue");
        }
    }

    let body = if has_transfer_encoding {
        transfer_encoding(&codings, content_length.is_some(), http11)?
    } else {
        BodyLength::Length(content_length.unwrap_or(0))
    };
    let head = Head {
        method: Method::from_token(method),
        path,
        query,
        http11,
        body,
        keep_alive: !close && (http11 || keep_alive_token),
        expect_continue: http11 && expect_continue,
    };
    Ok(Some((head, len)))
}

fn httparse_reason(err: httparse::Error) -> String {
    let what = match err {
        httparse::Error::HeaderName => "a header field name is not a token",
        httparse::Error::HeaderValue => "a header field value holds a control character",
        httparse::Error::NewLine => "a line does not end with CRLF",
        httparse::Error::Token => "the request line is not METHOD TARGET HTTP/1.x",
        httparse::Error::Version => "the HTTP version is not HTTP/1.0 or HTTP/1.1",
        _ => "the head is not HTTP/1.x",
    };
    format!("malformed request: {what}")
}

/// Splits a request target into path and query.
fn split_target(target: &str) -> Result<(String, Option<String>), Reject> {
    let path_and_query = if target.starts_with('/') || target == "*" {
        target
    } else if let Some(rest) = strip_scheme(target) {
        // Absolute form (RFC 9112, 3.2.2): the authority is the host's
        // business, the path ours.
        match rest.find(['/', '?']) {
            Some(at) => &rest[at..],
            None => "/",
        }
    } else {
        return Err(malformed(format!(
            "request target {} is not a path",
            quoted(target.as_bytes())
        )));
    };
    Ok(match path_and_query.split_once('?') {
        Some((path, query)) => (
            if path.is_empty() { "/" } else { path }.to_owned(),
            Some(query.to_owned()),
        ),
        None => (path_and_query.to_owned(), None),
    })
}

fn strip_scheme(target: &str) -> Option<&str> {
    for scheme in ["http://", "https://"] {
        if target.len() >= scheme.len()
            && target.as_bytes()[..scheme.len()].eq_ignore_ascii_case(scheme.as_bytes())
        {
            return Some(&target[scheme.len()..]);
        }
    }
    None
}

fn trim(mut value: &[u8]) -> &[u8] {
    while let [b' ' | b'\t', rest @ ..] = value {
        value = rest;
    }
    while let [rest @ .., b' ' | b'\t'] = value {
        value = rest;
    }
    value
}

/// `1*DIGIT`, as RFC 9110 (8.6) has it: no sign, no spaces inside, no list.
fn parse_content_length(value: &[u8]) -> Result<u64, Reject> {
    if value.is_empty() || !value.iter().all(u8::is_ascii_digit) {
        return Err(Reject::new(
            400,
            RejectKind::ContentLength,
            format!(
                "Content-Length must be a decimal number of bytes, got {}",
                quoted(value)
            ),
        ));
    }
    // Too many digits for u64 is still a number: saturate and let the value
    // limit refuse it with 413, like any other too-large length.
    Ok(value.iter().fold(0u64, |n, &d| {
        n.saturating_mul(10).saturating_add(u64::from(d - b'0'))
    }))
}

/// The framing that `Transfer-Encoding` gives (RFC 9112, 6.1 and 6.3).
fn transfer_encoding(
    codings: &[String],
    has_content_length: bool,
    http11: bool,
) -> Result<BodyLength, Reject> {
    let refuse =
        |status, reason: String| Err(Reject::new(status, RejectKind::TransferEncoding, reason));
    if !http11 {
        return refuse(
            400,
            "Transfer-Encoding is not allowed in an HTTP/1.0 request".into(),
        );
    }
    if has_content_length {
        // Which one frames the body is what request smuggling exploits:
        // refuse rather than pick.
        return refuse(
            400,
            "both Content-Length and Transfer-Encoding given".into(),
        );
    }
    match codings {
        [] => refuse(400, "Transfer-Encoding is empty".into()),
        [only] if only == "chunked" => Ok(BodyLength::Chunked),
        [.., last] if last != "chunked" => refuse(
            400,
            format!(
                "the last Transfer-Encoding must be chunked, got {}",
                quoted(last.as_bytes())
            ),
        ),
        [first, ..] if first == "chunked" => refuse(400, "chunked given more than once".into()),
        [first, ..] => refuse(
            501,
            format!(
                "Transfer-Encoding {} is not supported (only chunked)",
                quoted(first.as_bytes())
            ),
        ),
    }
}

/// Takes in a request body as it arrives, bounded by a limit.
///
/// Feed it the bytes that follow the head with [`BodyReader::feed`], which
/// says how many it used (it never reads past the body's end, so the rest
/// is the next request), until [`BodyReader::is_done`].
#[derive(Debug)]
pub struct BodyReader {
    state: BodyState,
    body: Vec<u8>,
    max: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BodyState {
    Length {
        remaining: u64,
    },
    /// In a chunk's data.
    ChunkData {
        remaining: u64,
    },
    /// In a chunked body's framing.
    Chunked(Chunk),
    Done,
}

/// Where a chunked body's decoder is (RFC 9112, 7.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// In the chunk size's hex digits (`digits` of them so far).
    Size {
        size: u64,
        digits: usize,
        line: usize,
    },
    /// After the size: whitespace and extensions, skipped up to the CR.
    Extension {
        size: u64,
        line: usize,
    },
    /// The size line's CR was seen; its LF must follow.
    SizeLf {
        size: u64,
    },
    /// After the data: its CR, then its LF.
    DataCr,
    DataLf,
    /// At the start of a trailer line, or of the final empty line.
    TrailerStart {
        seen: usize,
    },
    /// In a trailer field line, skipped up to its CR.
    TrailerLine {
        seen: usize,
    },
    /// A trailer line's CR was seen; `last` when the line was empty.
    TrailerLf {
        seen: usize,
        last: bool,
    },
}

impl BodyReader {
    /// A reader for a body framed as `length`, refused with 413 if longer
    /// than `max_body_bytes` (at once for a `Content-Length`, as the chunks
    /// arrive for a chunked one).
    pub fn new(length: BodyLength, max_body_bytes: usize) -> Result<BodyReader, Reject> {
        let state = match length {
            BodyLength::Length(n) if n > max_body_bytes as u64 => {
                return Err(too_large(max_body_bytes))
            }
            BodyLength::Length(0) => BodyState::Done,
            BodyLength::Length(n) => BodyState::Length { remaining: n },
            BodyLength::Chunked => BodyState::Chunked(Chunk::Size {
                size: 0,
                digits: 0,
                line: 0,
            }),
        };
        // Reserve what a Content-Length announces only up to a bound: the
        // bytes may never come, and a huge limit must not mean a huge
        // allocation on a client's word.
        let reserve = match length {
            BodyLength::Length(n) => n.min(1 << 20) as usize,
            BodyLength::Chunked => 0,
        };
        Ok(BodyReader {
            state,
            body: Vec::with_capacity(reserve),
            max: max_body_bytes,
        })
    }

    /// Whether the whole body has been read.
    pub fn is_done(&self) -> bool {
        self.state == BodyState::Done
    }

    /// The body, complete once [`BodyReader::is_done`].
    pub fn into_body(self) -> Vec<u8> {
        self.body
    }

    /// The refusal for a connection that ended before the body did.
    pub fn incomplete(&self) -> Reject {
        let reason = match self.state {
            BodyState::Length { remaining } => format!(
                "request body ended after {} bytes, {remaining} short of its Content-Length",
                self.body.len()
            ),
            _ => format!(
                "chunked request body ended after {} bytes, before its last chunk",
                self.body.len()
            ),
        };
        Reject::new(400, RejectKind::BodyIncomplete, reason)
    }

    /// Takes what it can of `input` (the bytes after the head, or after
    /// what an earlier call took) and returns how many bytes it used; fewer
    /// than `input.len()` only once the body is complete.
    pub fn feed(&mut self, input: &[u8]) -> Result<usize, Reject> {
        let mut used = 0;
        while used < input.len() {
            match self.state {
                BodyState::Done => break,
                BodyState::Length { remaining } => {
                    let take = remaining.min((input.len() - used) as u64) as usize;
                    self.body.extend_from_slice(&input[used..used + take]);
                    used += take;
                    let remaining = remaining - take as u64;
                    self.state = if remaining == 0 {
                        BodyState::Done
                    } else {
                        BodyState::Length { remaining }
                    };
                }
                BodyState::ChunkData { remaining } => {
                    let take = remaining.min((input.len() - used) as u64) as usize;
                    self.body.extend_from_slice(&input[used..used + take]);
                    used += take;
                    let remaining = remaining - take as u64;
                    self.state = if remaining == 0 {
                        BodyState::Chunked(Chunk::DataCr)
                    } else {
                        BodyState::ChunkData { remaining }
                    };
                }
                BodyState::Chunked(chunk) => {
                    self.state = self.chunk_byte(chunk, input[used])?;
                    used += 1;
                }
            }
        }
        Ok(used)
    }

    /// One byte of a chunked body's framing.
    fn chunk_byte(&self, chunk: Chunk, byte: u8) -> Result<BodyState, Reject> {
        let bad = |reason: &str| Err(Reject::new(400, RejectKind::BodyMalformed, reason));
        let line_too_long = || {
            Err(Reject::new(
                400,
                RejectKind::BodyMalformed,
                format!("chunk size line longer than {MAX_CHUNK_LINE} bytes"),
            ))
        };
        let next = match chunk {
            Chunk::Size { size, digits, line } => {
                if line >= MAX_CHUNK_LINE {
                    return line_too_long();
                }
                match (byte as char).to_digit(16) {
                    Some(digit) => {
                        let Some(size) = size.checked_mul(16).map(|s| s + u64::from(digit)) else {
                            return Err(too_large(self.max));
                        };
                        Chunk::Size {
                            size,
                            digits: digits + 1,
                            line: line + 1,
                        }
                    }
                    None if digits == 0 => return bad("chunk size is not a hex number"),
                    None if byte == b'\r' => Chunk::SizeLf { size },
                    None if matches!(byte, b';' | b' ' | b'\t') => Chunk::Extension {
                        size,
                        line: line + 1,
                    },
                    None => return bad("chunk size is not a hex number"),
                }
            }
            Chunk::Extension { size, line } => {
                if line >= MAX_CHUNK_LINE {
                    return line_too_long();
                }
                match byte {
                    b'\r' => Chunk::SizeLf { size },
                    b'\n' => return bad("chunk size line does not end with CRLF"),
                    _ => Chunk::Extension {
                        size,
                        line: line + 1,
                    },
                }
            }
            Chunk::SizeLf { size } => {
                if byte != b'\n' {
                    return bad("chunk size line does not end with CRLF");
                }
                if size == 0 {
                    Chunk::TrailerStart { seen: 0 }
                } else if size > self.max.saturating_sub(self.body.len()) as u64 {
                    return Err(too_large(self.max));
                } else {
                    return Ok(BodyState::ChunkData { remaining: size });
                }
            }
            Chunk::DataCr if byte == b'\r' => Chunk::DataLf,
            Chunk::DataLf if byte == b'\n' => Chunk::Size {
                size: 0,
                digits: 0,
                line: 0,
            },
            Chunk::DataCr | Chunk::DataLf => return bad("chunk data not followed by CRLF"),
            Chunk::TrailerStart { seen } | Chunk::TrailerLine { seen }
                if seen >= MAX_TRAILER_BYTES =>
            {
                return Err(Reject::new(
                    400,
                    RejectKind::BodyMalformed,
                    format!("trailer fields longer than {MAX_TRAILER_BYTES} bytes"),
                ))
            }
            Chunk::TrailerStart { seen } => match byte {
                b'\r' => Chunk::TrailerLf {
                    seen: seen + 1,
                    last: true,
                },
                b'\n' => return bad("trailer line does not end with CRLF"),
                _ => Chunk::TrailerLine { seen: seen + 1 },
            },
            Chunk::TrailerLine { seen } => match byte {
                b'\r' => Chunk::TrailerLf {
                    seen: seen + 1,
                    last: false,
                },
                b'\n' => return bad("trailer line does not end with CRLF"),
                _ => Chunk::TrailerLine { seen: seen + 1 },
            },
            Chunk::TrailerLf { seen, last } => {
                if byte != b'\n' {
                    return bad("trailer line does not end with CRLF");
                }
                if last {
                    return Ok(BodyState::Done);
                }
                Chunk::TrailerStart { seen: seen + 1 }
            }
        };
        Ok(BodyState::Chunked(next))
    }
}

fn too_large(max: usize) -> Reject {
    Reject::new(
        413,
        RejectKind::BodyTooLarge,
        format!("value is larger than the limit of {max} bytes"),
    )
}

/// A complete request: head and body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Request {
    /// The head.
    pub head: Head,
    /// The body (de-chunked).
    pub body: Vec<u8>,
}

/// Parses one whole request at the start of `buf`, as the server's
/// connection loop does when every byte is already there.
///
/// Returns `Ok(None)` when `buf` holds only part of a request,
/// `Ok(Some((request, n)))` when the request takes the first `n` bytes (the
/// rest is the next pipelined request), or the refusal.
pub fn parse_request(buf: &[u8], limits: &ParseLimits) -> Result<Option<(Request, usize)>, Reject> {
    let Some((head, head_len)) = parse_head(buf, limits)? else {
        return Ok(None);
    };
    let mut reader = BodyReader::new(head.body, limits.max_body_bytes)?;
    let body_len = reader.feed(&buf[head_len..])?;
    if !reader.is_done() {
        return Ok(None);
    }
    Ok(Some((
        Request {
            head,
            body: reader.into_body(),
        },
        head_len + body_len,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: ParseLimits = ParseLimits {
        max_head_bytes: 1024,
        max_body_bytes: 64,
    };

    fn head(text: &str) -> Result<Option<(Head, usize)>, Reject> {
        parse_head(text.as_bytes(), &LIMITS)
    }

    fn refused(text: &str) -> Reject {
        parse_request(text.as_bytes(), &LIMITS).expect_err(text)
    }

    #[test]
    fn a_plain_get() {
        let text = "GET /metadata?key=a%2Fb HTTP/1.1\r\nHost: x\r\n\r\nNEXT";
        let (head, len) = head(text).unwrap().unwrap();
        assert_eq!(len, text.len() - 4);
        assert_eq!(head.method, Method::Get);
        assert_eq!(head.path, "/metadata");
        assert_eq!(head.query.as_deref(), Some("key=a%2Fb"));
        assert!(head.http11 && head.keep_alive && !head.expect_continue);
        assert_eq!(head.body, BodyLength::Length(0));
    }

    #[test]
    fn every_prefix_of_a_head_is_incomplete() {
        let text = "PUT /metadata?key=k HTTP/1.1\r\nContent-Length: 3\r\n\r\n";
        for n in 0..text.len() {
            assert_eq!(head(&text[..n]), Ok(None), "{n}");
        }
    }

    #[test]
    fn connection_and_expect() {
        let (h, _) = head("GET / HTTP/1.0\r\n\r\n").unwrap().unwrap();
        assert!(!h.http11 && !h.keep_alive);
        let (h, _) = head("GET / HTTP/1.0\r\nConnection: Keep-Alive\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(h.keep_alive);
        let (h, _) = head("GET / HTTP/1.1\r\nConnection: foo, close\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(!h.keep_alive);
        let (h, _) = head("PUT / HTTP/1.1\r\nExpect: 100-Continue\r\nContent-Length: 1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert!(h.expect_continue);
    }

    #[test]
    fn absolute_and_odd_targets() {
        let (h, _) = head("GET http://host:1/metadata?key=k HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!(
            (h.path.as_str(), h.query.as_deref()),
            ("/metadata", Some("key=k"))
        );
        let (h, _) = head("GET HTTP://host?key=k HTTP/1.1\r\n\r\n")
            .unwrap()
            .unwrap();
        assert_eq!((h.path.as_str(), h.query.as_deref()), ("/", Some("key=k")));
        let (h, _) = head("OPTIONS * HTTP/1.1\r\n\r\n").unwrap().unwrap();
        assert_eq!((h.method, h.path.as_str()), (Method::Other, "*"));
        assert_eq!(refused("GET host:80 HTTP/1.1\r\n\r\n").status, 400);
    }

    #[test]
    fn refusals_have_a_status_a_kind_and_a_one_line_reason() {
        let cases: &[(&str, u16, RejectKind)] = &[
            ("GARBAGE\r\n\r\n", 400, RejectKind::MalformedHead),
            ("GET / HTTP/2.0\r\n\r\n", 400, RejectKind::MalformedHead),
            ("GET / HTTP/1.1\r\nBad Name: x\r\n\r\n", 400, RejectKind::MalformedHead),
            (
                "PUT / HTTP/1.1\r\nContent-Length: -5\r\n\r\n",
                400,
                RejectKind::ContentLength,
            ),
            (
                "PUT / HTTP/1.1\r\nContent-Length: 1\r\nContent-Length: 2\r\n\r\nab",
                400,
                RejectKind::ContentLength,
            ),
            (
                "PUT / HTTP/1.1\r\nContent-Length: 1, 1\r\n\r\na",
                400,
                RejectKind::ContentLength,
            ),
            (
                "PUT / HTTP/1.1\r\nContent-Length: 99999999999999999999999\r\n\r\n",
                413,
                RejectKind::BodyTooLarge,
            ),
            (
                "PUT / HTTP/1.1\r\nContent-Length: 65\r\n\r\n",
                413,
                RejectKind::BodyTooLarge,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: gzip\r\n\r\n",
                400,
                RejectKind::TransferEncoding,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: gzip, chunked\r\n\r\n",
                501,
                RejectKind::TransferEncoding,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
                RejectKind::TransferEncoding,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\nContent-Length: 1\r\n\r\n",
                400,
                RejectKind::TransferEncoding,
            ),
            (
                "PUT / HTTP/1.0\r\nTransfer-Encoding: chunked\r\n\r\n",
                400,
                RejectKind::TransferEncoding,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n",
                400,
                RejectKind::BodyMalformed,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n41\r\n",
                413,
                RejectKind::BodyTooLarge,
            ),
            (
                "PUT / HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nab",
                400,
                RejectKind::BodyMalformed,
            ),
        ];
        for &(text, status, kind) in cases {
            let reject = refused(text);
            assert_eq!(
                (reject.status, reject.kind),
                (status, kind),
                "{text:?}: {reject}"
            );
            assert!(!reject.reason.is_empty() && !reject.reason.contains(['\r', '\n']));
        }
        let long = format!("GET /{} HTTP/1.1\r\n", "a".repeat(2000));
        assert_eq!(refused(&long).status, 431);
        let many = format!(
            "GET / HTTP/1.1\r\n{}\r\n",
            "a: b\r\n".repeat(MAX_HEADERS + 1)
        );
        assert_eq!(refused(&many).status, 431);
    }

    #[test]
    fn equal_content_lengths_are_one() {
        let text = "PUT / HTTP/1.1\r\nContent-Length: 2\r\nContent-Length:  2 \r\n\r\nab";
        let (request, len) = parse_request(text.as_bytes(), &LIMITS).unwrap().unwrap();
        assert_eq!((request.body.as_slice(), len), (&b"ab"[..], text.len()));
    }

    #[test]
    fn chunked_bodies_are_decoded_in_any_split() {
        let body = "4;ext=1\r\nabcd\r\n2 \r\nef\r\n0\r\nTrailer: x\r\n\r\n";
        let text = format!("PUT /k HTTP/1.1\r\nTransfer-Encoding: chunked\r\n\r\n{body}NEXT");
        let (request, len) = parse_request(text.as_bytes(), &LIMITS).unwrap().unwrap();
        assert_eq!(request.body, b"abcdef");
        assert_eq!(&text[len..], "NEXT");
        for split in 0..=body.len() {
            let mut reader = BodyReader::new(BodyLength::Chunked, 64).unwrap();
            let first = reader.feed(&body.as_bytes()[..split]).unwrap();
            assert_eq!(first, split);
            assert!(!reader.is_done() || split == body.len());
            let second = reader.feed(&body.as_bytes()[split..]).unwrap();
            assert_eq!(first + second, body.len());
            assert!(reader.is_done());
            assert_eq!(reader.into_body(), b"abcdef");
        }
    }

    #[test]
    fn a_body_cut_short_is_incomplete() {
        let mut reader = BodyReader::new(BodyLength::Length(10), 64).unwrap();
        assert_eq!(reader.feed(b"abc"), Ok(3));
        assert!(!reader.is_done());
        let reject = reader.incomplete();
        assert_eq!(
            (reject.status, reject.kind),
            (400, RejectKind::BodyIncomplete)
        );
        assert!(reject.reason.contains("after 3 bytes"), "{reject}");
    }
}
