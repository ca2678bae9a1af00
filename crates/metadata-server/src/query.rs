//! Parsing `/metadata`'s query string: `key=K` or (extension) `prefix=P`.
//!
//! Public, like [`crate::request`], so the fuzz target reaches it without a
//! socket.

use percent_encoding::percent_decode;

/// What a `/metadata` request addresses.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Target {
    /// One key (`?key=K`).
    Key(String),
    /// Every key starting with this (`?prefix=P`, GET only).
    Prefix(String),
}

/// Why a query string was refused; the text is the 400 response's body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadQuery(pub String);

/// Mooncake's C++ server answers a missing or empty key with this body.
pub const MISSING_KEY: &str = "Missing key parameter";

/// Parses a raw query string (`None` when the URI has none); keys and
/// prefixes longer than `max_key_bytes` (decoded) are refused.
///
/// Decoding follows `application/x-www-form-urlencoded`, as Mooncake's
/// servers (aiohttp, Go's `url.Query`) do: `+` is a space and `%XX` a byte;
/// the decoded bytes must be UTF-8. Other parameters are ignored, a repeated
/// `key` or `prefix` is refused (which one was meant is unknowable), and an
/// empty key is refused as missing, like Mooncake's servers. An empty prefix
/// lists every key.
pub fn parse(raw: Option<&str>, max_key_bytes: usize) -> Result<Target, BadQuery> {
    let mut key = None;
    let mut prefix = None;
    for pair in raw.unwrap_or("").split('&').filter(|p| !p.is_empty()) {
        let (name, value) = pair.split_once('=').unwrap_or((pair, ""));
        let (name, slot) = match decode(name)?.as_str() {
            "key" => ("key", &mut key),
            "prefix" => ("prefix", &mut prefix),
            _ => continue,
        };
        if slot.is_some() {
            return Err(BadQuery(format!("{name} given more than once")));
        }
        *slot = Some(decode(value)?);
    }
    let (target, what) = match (key, prefix) {
        (Some(_), Some(_)) => {
            return Err(BadQuery("give either key or prefix, not both".to_owned()))
        }
        (Some(key), None) if key.is_empty() => return Err(BadQuery(MISSING_KEY.to_owned())),
        (Some(key), None) => (Target::Key(key), "key"),
        (None, Some(prefix)) => (Target::Prefix(prefix), "prefix"),
        (None, None) => return Err(BadQuery(MISSING_KEY.to_owned())),
    };
    let len = match &target {
        Target::Key(s) | Target::Prefix(s) => s.len(),
    };
    if len > max_key_bytes {
        return Err(BadQuery(format!(
            "{what} is {len} bytes, longer than the limit of {max_key_bytes} bytes"
        )));
    }
    Ok(target)
}

fn decode(component: &str) -> Result<String, BadQuery> {
    // '+' must become a space before percent-decoding, so that "%2B" stays a
    // literal plus.
    let spaced = component.replace('+', " ");
    let bytes: Vec<u8> = percent_decode(spaced.as_bytes()).collect();
    String::from_utf8(bytes)
        .map_err(|_| BadQuery("query parameter is not valid UTF-8 after URL decoding".to_owned()))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(raw: &str) -> Result<Target, BadQuery> {
        parse(Some(raw), 4096)
    }

    #[test]
    fn decodes_form_urlencoding() {
        assert_eq!(
            key("key=mooncake%2Fram%2Fhost%20name%3A1"),
            Ok(Target::Key("mooncake/ram/host name:1".into()))
        );
        assert_eq!(key("key=a+b%2Bc"), Ok(Target::Key("a b+c".into())));
        assert_eq!(key("key=%E2%9C%93"), Ok(Target::Key("\u{2713}".into())));
        assert_eq!(key("other=1&key=x&"), Ok(Target::Key("x".into())));
        assert_eq!(key("prefix="), Ok(Target::Prefix(String::new())));
    }

    #[test]
    fn refuses_bad_queries() {
        assert!(key("key=%FF").is_err());
        assert_eq!(key("key="), Err(BadQuery(MISSING_KEY.into())));
        assert_eq!(parse(None, 10), Err(BadQuery(MISSING_KEY.into())));
        assert_eq!(key("key"), Err(BadQuery(MISSING_KEY.into())));
        assert_eq!(
            key("key=a&key=b"),
            Err(BadQuery("key given more than once".into()))
        );
        assert_eq!(
            key("prefix=a&prefix=b"),
            Err(BadQuery("prefix given more than once".into()))
        );
        assert!(key("key=a&prefix=b").is_err());
        assert!(parse(Some("key=abcd"), 3).is_err());
        assert!(parse(Some("key=abc"), 3).is_ok());
    }
}
