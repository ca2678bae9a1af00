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

/// What the effective configuration prints in place of a token taken from `MULTIRAIL_TOKEN`:
/// where it came from, never the token.
pub const REDACTED_FROM_ENV: &str = "<redacted, from MULTIRAIL_TOKEN>";

/// Membership: when a token is set (here or in `MULTIRAIL_TOKEN`), every connection opens with
/// a challenge-response over it (HMAC-SHA256 over nonces), and only engines holding the same
/// token are served descriptors, keys, slices or messages. Off by default.
#[derive(Debug, Clone, PartialEq, Default, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AuthConfig {
    /// The shared token (at least 16 bytes); null = `MULTIRAIL_TOKEN`, else no membership check.
    pub token: Option<Secret>,
}

/// Prints the token as [`REDACTED`] when the configuration holds one, as
/// [`REDACTED_FROM_ENV`] when it comes from `MULTIRAIL_TOKEN`, and `null` when there is none:
/// the effective configuration says where the token came from and never what it is.
impl Serialize for AuthConfig {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        use serde::ser::SerializeStruct;
        let mut out = s.serialize_struct("AuthConfig", 1)?;
        match self.token_source() {
            Some(TokenSource::Config) => out.serialize_field("token", REDACTED)?,
            Some(TokenSource::Environment) => out.serialize_field("token", REDACTED_FROM_ENV)?,
            None => out.serialize_field("token", &None::<&str>)?,
        }
        out.end()
    }
}

/// Where the membership token in force comes from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TokenSource {
    /// `auth.token` in the configuration (file, `MULTIRAIL_CONF`, or a binding's JSON).
    Config,
    /// The `MULTIRAIL_TOKEN` environment variable (set, to anything, even empty).
    Environment,
}

/// Shortest accepted token: a short one can be guessed offline from one recorded handshake.
pub const MIN_TOKEN_LEN: usize = 16;

impl AuthConfig {
    /// The token in force: `auth.token`, else `MULTIRAIL_TOKEN`, else none (membership off).
    /// Fails closed, naming the source, when the token is empty or only whitespace (an
    /// exported but empty `MULTIRAIL_TOKEN` included: it must never turn membership off),
    /// shorter than [`MIN_TOKEN_LEN`], not UTF-8, or the placeholder `config show` prints.
    pub fn effective_token(&self) -> Result<Option<Secret>, ConfigError> {
        let (token, key) = match &self.token {
            Some(t) => (t.clone(), "auth.token"),
            None => match std::env::var(TOKEN_ENV_VAR) {
                Ok(t) => (Secret(t), TOKEN_ENV_VAR),
                Err(std::env::VarError::NotPresent) => return Ok(None),
                Err(std::env::VarError::NotUnicode(_)) => {
                    return Err(ConfigError::new(TOKEN_ENV_VAR, "is not valid UTF-8"))
                }
            },
        };
        check_token(key, token.expose())?;
        Ok(Some(token))
    }

    /// Where the token in force comes from: `auth.token` wins over `MULTIRAIL_TOKEN` (which
    /// counts when it is set at all, even empty, so that an empty one is refused rather than
    /// ignored). `None`: membership is off.
    pub fn token_source(&self) -> Option<TokenSource> {
        if self.token.is_some() {
            Some(TokenSource::Config)
        } else if std::env::var_os(TOKEN_ENV_VAR).is_some() {
            Some(TokenSource::Environment)
        } else {
            None
        }
    }
}

pub(crate) fn check_token(key: &str, token: &str) -> Result<(), ConfigError> {
    if token.trim().is_empty() {
        return Err(ConfigError::new(
            key,
            if key == TOKEN_ENV_VAR {
                "is set but empty or only whitespace; a token that is set must be real \
                 (at least 16 bytes), so unset the variable to run without membership"
            } else {
                "is empty or only whitespace; give a token of at least 16 bytes, or remove \
                 the key to run without membership"
            },
        ));
    }
    if token.starts_with(REDACTED.trim_end_matches('>')) {
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
