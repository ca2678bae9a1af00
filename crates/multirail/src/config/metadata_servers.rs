//! The addresses `metadata.servers` takes, per store kind: one `http://HOST:PORT/PATH` for
//! the HTTP store, `etcd://HOST:PORT[,HOST:PORT...]` for etcd. Validation checks them here so a
//! bad address is a configuration error naming the key; the stores parse them with the same
//! functions when they connect.

/// Default of `metadata.lease_ttl_s`: an engine killed without withdrawing its keys is gone
/// from etcd within this many seconds.
pub const DEFAULT_LEASE_TTL_S: u64 = 10;

/// Checks that `url` is `http://HOST:PORT/PATH`: one server, plain HTTP, an explicit port, a
/// path, no query or fragment. Returns the reason it is not, worded for a configuration error.
pub(crate) fn check_server_url(url: &str) -> std::result::Result<(), String> {
    let expected = || {
        format!("must be http://HOST:PORT/PATH (e.g. http://127.0.0.1:8080/metadata), got {url:?}")
    };
    let Some(rest) = url.strip_prefix("http://") else {
        if url.starts_with("https://") {
            return Err(format!(
                "https is not supported (the client speaks plain HTTP), got {url:?}"
            ));
        }
        if url.starts_with("etcd://") {
            return Err(format!(
                "is an etcd address; set metadata.type to \"etcd\" for it, got {url:?}"
            ));
        }
        return Err(expected());
    };
    if rest.contains(',') {
        return Err(format!("takes one HTTP server, got {url:?}"));
    }
    if rest
        .chars()
        .any(|c| c.is_whitespace() || c.is_control() || matches!(c, '?' | '#' | '@'))
    {
        return Err(format!(
            "{}; no query, fragment, user name or whitespace",
            expected()
        ));
    }
    let Some((authority, _path)) = rest.split_once('/') else {
        return Err(format!(
            "{}: the path is missing (Mooncake's servers use /metadata)",
            expected()
        ));
    };
    host_port(authority)
        .map(|_| ())
        .map_err(|reason| format!("{}: {reason}", expected()))
}

/// Parses `metadata.servers` for etcd: `etcd://HOST:PORT[,HOST:PORT...]`, or the same without
/// the scheme (as Mooncake reads a bare `host:port`). Returns the endpoints as
/// `http://HOST:PORT`, or the reason the text is not that, worded for a configuration error.
pub(crate) fn parse_etcd_endpoints(servers: &str) -> std::result::Result<Vec<String>, String> {
    let expected = || {
        format!(
            "must be etcd://HOST:PORT[,HOST:PORT...] (e.g. etcd://127.0.0.1:2379), got {servers:?}"
        )
    };
    let list = servers.strip_prefix("etcd://").unwrap_or(servers);
    if list.contains("://") {
        return Err(expected());
    }
    let mut endpoints = Vec::new();
    for part in list.split(',') {
        let part = part.trim();
        if part.is_empty()
            || part
                .chars()
                .any(|c| c.is_whitespace() || c.is_control() || "/?#@".contains(c))
        {
            return Err(expected());
        }
        let (host, port) = host_port(part).map_err(|reason| format!("{}: {reason}", expected()))?;
        endpoints.push(format!("http://{host}:{port}"));
    }
    Ok(endpoints)
}

/// Splits `HOST:PORT` (an IPv6 host in brackets) of a store's address. Fails with the reason,
/// for the caller to put after what it expected: the port missing, a bad host (empty,
/// unbalanced brackets, an unbracketed `:`), or a port that is not 1 to 65535.
pub(crate) fn host_port(authority: &str) -> std::result::Result<(&str, u16), String> {
    let Some((host, port)) = authority.rsplit_once(':') else {
        return Err("the port is missing".into());
    };
    let bracketed = host.starts_with('[') || host.ends_with(']');
    if host.is_empty()
        || (bracketed && !(host.len() > 2 && host.starts_with('[') && host.ends_with(']')))
        || (!bracketed && host.contains(':'))
    {
        return Err(format!("bad host {host:?}"));
    }
    match port.parse::<u16>() {
        Ok(p) if p != 0 => Ok((host, p)),
        _ => Err(format!("bad port {port:?}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn server_urls() {
        for good in [
            "http://127.0.0.1:8080/metadata",
            "http://h:1/",
            "http://[::1]:8080/metadata",
            "http://meta.example:80/a/b",
        ] {
            assert_eq!(check_server_url(good), Ok(()), "{good}");
        }
        for (bad, says) in [
            ("127.0.0.1:8080", "http://HOST:PORT/PATH"),
            ("https://h:8080/metadata", "https is not supported"),
            ("etcd://h:2379", "metadata.type to \"etcd\""),
            ("http://h:8080", "path is missing"),
            ("http://h/metadata", "port is missing"),
            ("http://:8080/metadata", "bad host"),
            ("http://h:0/metadata", "bad port"),
            ("http://h:99999/metadata", "bad port"),
            ("http://h:x/metadata", "bad port"),
            ("http://::1:8080/metadata", "bad host"),
            ("http://h:8080/metadata?x=1", "no query"),
            ("http://u@h:8080/metadata", "user name"),
            ("http://a:1/m,http://b:1/m", "one HTTP server"),
            ("", "http://HOST:PORT/PATH"),
        ] {
            let e = check_server_url(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }

    #[test]
    fn endpoints() {
        for (good, want) in [
            ("etcd://127.0.0.1:2379", vec!["http://127.0.0.1:2379"]),
            ("127.0.0.1:2379", vec!["http://127.0.0.1:2379"]),
            ("etcd://a:1,b:2", vec!["http://a:1", "http://b:2"]),
            ("[::1]:2379", vec!["http://[::1]:2379"]),
        ] {
            assert_eq!(parse_etcd_endpoints(good).unwrap(), want, "{good}");
        }
        for (bad, says) in [
            ("http://h:2379", "etcd://HOST:PORT"),
            ("etcd://h", "port"),
            ("etcd://h:0", "bad port"),
            ("etcd://h:x", "bad port"),
            ("etcd://:1", "bad host"),
            ("etcd://a:1,", "etcd://HOST:PORT"),
            ("etcd://a:1/x", "etcd://HOST:PORT"),
            ("", "etcd://HOST:PORT"),
            ("etcd://::1:5", "bad host"),
        ] {
            let e = parse_etcd_endpoints(bad).expect_err(bad);
            assert!(e.contains(says), "{bad}: {e}");
        }
    }
}
