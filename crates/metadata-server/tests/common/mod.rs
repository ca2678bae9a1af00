//! Helpers shared by the integration tests: a server on a free port and a
//! blocking client that reports status codes instead of failing on them.

#![allow(dead_code)] // each test file uses its own subset

use std::path::PathBuf;
use std::time::Duration;

use multirail_metadata_server::{Limits, MetadataServer, ServerConfig};
use percent_encoding::{utf8_percent_encode, NON_ALPHANUMERIC};

/// Starts a server on 127.0.0.1 with a free port.
pub fn start(data_dir: Option<PathBuf>, limits: Limits) -> MetadataServer {
    MetadataServer::start(ServerConfig {
        listen: "127.0.0.1:0".parse().expect("valid address"),
        data_dir,
        limits,
    })
    .expect("metadata server starts")
}

/// Starts an in-memory server with default limits.
pub fn start_default() -> MetadataServer {
    start(None, Limits::default())
}

/// An HTTP answer: status, body, content type.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub body: Vec<u8>,
    pub content_type: Option<String>,
}

impl Answer {
    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }
}

/// A blocking client bound to one server's `/metadata` URL.
pub struct Client {
    agent: ureq::Agent,
    base: String,
}

impl Client {
    pub fn new(server: &MetadataServer) -> Client {
        let agent: ureq::Agent = ureq::Agent::config_builder()
            .http_status_as_error(false)
            .timeout_global(Some(Duration::from_secs(30)))
            .build()
            .into();
        Client {
            agent,
            base: format!("http://{}", server.local_addr()),
        }
    }

    /// `base` + `path_and_query`, verbatim (the caller encodes).
    pub fn url(&self, path_and_query: &str) -> String {
        format!("{}{}", self.base, path_and_query)
    }

    pub fn get_raw(&self, path_and_query: &str) -> Answer {
        answer(self.agent.get(self.url(path_and_query)).call())
    }

    pub fn put_raw(&self, path_and_query: &str, body: &[u8]) -> Answer {
        answer(self.agent.put(self.url(path_and_query)).send(body))
    }

    pub fn delete_raw(&self, path_and_query: &str) -> Answer {
        answer(self.agent.delete(self.url(path_and_query)).call())
    }

    pub fn get(&self, key: &str) -> Answer {
        self.get_raw(&key_query(key))
    }

    pub fn put(&self, key: &str, value: &[u8]) -> Answer {
        self.put_raw(&key_query(key), value)
    }

    pub fn delete(&self, key: &str) -> Answer {
        self.delete_raw(&key_query(key))
    }

    /// The keys starting with `prefix` (the listing extension).
    pub fn list(&self, prefix: &str) -> Vec<String> {
        let answer = self.get_raw(&format!("/metadata?prefix={}", encode(prefix)));
        assert_eq!(answer.status, 200, "listing failed: {}", answer.text());
        serde_json::from_slice(&answer.body).expect("listing is a JSON array of strings")
    }
}

fn answer(result: Result<ureq::http::Response<ureq::Body>, ureq::Error>) -> Answer {
    let mut response = result.expect("HTTP exchange succeeds");
    let content_type = response
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .map(str::to_owned);
    let status = response.status().as_u16();
    let body = response
        .body_mut()
        .with_config()
        .limit(64 << 20)
        .read_to_vec()
        .expect("response body reads");
    Answer {
        status,
        body,
        content_type,
    }
}

/// Percent-encodes everything but ASCII letters and digits.
pub fn encode(s: &str) -> String {
    utf8_percent_encode(s, NON_ALPHANUMERIC).to_string()
}

pub fn key_query(key: &str) -> String {
    format!("/metadata?key={}", encode(key))
}
