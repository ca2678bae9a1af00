//! The `auth` section: the membership token every connection proves.

use super::*;

/// Environment variable holding the membership token when `auth.token` is not set.
pub const TOKEN_ENV_VAR: &str = "MULTIRAIL_TOKEN";

/// What `multirail config show` prints instead of a token.
pub const REDACTED: &str = "<redacted>";

/// A secret string: shown as [`REDACTED`] by `Debug` and when serialized, so it never reaches
/// a log, `config show` or a descriptor.
#[derive(Clone, PartialEq, Eq, Deserialize)]
#[serde(transparent)]
pub struct Secret(String);

impl Secret {
    /// Wraps a secret.
    pub fn new(s: impl Into<String>) -> Self {
        Secret(s.into())
    }

    /// The secret itself, for the code that must use it (the handshake).
    pub fn expose(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for Secret {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(REDACTED)
    }
}

impl Serialize for Secret {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(REDACTED)
    }
}

/// Membership: when a token is set (here or in `MULTIRAIL_TOKEN`), every connection opens with
/// a challenge-response over it (HMAC-SHA256 over nonces), and only engines holding the same
/// token are served descriptors, keys, slices or messages. Off by default.
#[derive(Debug, Clone, PartialEq, Default, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The shared token (at least 16 bytes); null = `MULTIRAIL_TOKEN`, else no membership check.
    pub token: Option<Secret>,
}

/// Shortest accepted token: a short one can be guessed offline from one recorded handshake.
pub const MIN_TOKEN_LEN: usize = 16;

impl AuthConfig {
    /// The token in force: `auth.token`, else `MULTIRAIL_TOKEN` (empty counts as unset). Fails
    /// naming the key when the token is too short or is the placeholder `config show` prints.
    pub fn effective_token(&self) -> Result<Option<Secret>, ConfigError> {
        let (token, key) = match &self.token {
            Some(t) => (t.clone(), "auth.token"),
            None => match std::env::var(TOKEN_ENV_VAR) {
                Ok(t) if !t.is_empty() => (Secret(t), TOKEN_ENV_VAR),
                _ => return Ok(None),
            },
        };
        check_token(key, token.expose())?;
        Ok(Some(token))
    }
}

pub(crate) fn check_token(key: &str, token: &str) -> Result<(), ConfigError> {
    if token == REDACTED {
        return Err(ConfigError::new(
            key,
            "is the placeholder `config show` prints; give the real token",
        ));
    }
    if token.len() < MIN_TOKEN_LEN {
        return Err(ConfigError::new(
            key,
            format!(
                "must be at least {MIN_TOKEN_LEN} bytes, got {} (the token itself is not shown)",
                token.len()
            ),
        ));
    }
    Ok(())
}
