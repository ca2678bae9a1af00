//! `multirail metadata-server`: an HTTP metadata server speaking Mooncake Transfer Engine's
//! protocol (`multirail-metadata-server`), which Mooncake's engines can use unchanged. Prints
//! its URL on the first line and serves until interrupted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use multirail_metadata_server::{Limits, MetadataServer, ServerConfig};

use crate::units;
use crate::Failure;

#[derive(Args)]
pub struct MetadataServerArgs {
    /// Address to listen on (port 0: any free port). Default: 127.0.0.1:8080.
    #[arg(long, default_value = "127.0.0.1:8080")]
    listen: SocketAddr,
    /// Keep every key in this directory (created if missing) and serve them again after a
    /// restart. Without it the server keeps keys in memory only.
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// Largest value a PUT may store (larger ones get 413). Default: 1MiB.
    #[arg(long, default_value = "1MiB", value_parser = units::parse_size)]
    max_value_size: u64,
    /// Most connections served at once (more wait to be accepted). Default: 1024.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// How long a client may take to send a request (seconds, or e.g. 500ms). Default: 30.
    #[arg(long, default_value = "30", value_parser = units::parse_duration)]
    request_timeout: Duration,
}

pub fn run(args: MetadataServerArgs) -> Result<(), Failure> {
    let max_value_bytes = usize::try_from(args.max_value_size)
        .map_err(|_| Failure::Usage("--max-value-size is too large".into()))?;
    let limits = Limits {
        max_value_bytes,
        max_connections: args.max_connections,
        request_timeout: args.request_timeout,
        ..Limits::default()
    };
    let server = MetadataServer::start(ServerConfig {
        listen: args.listen,
        data_dir: args.data_dir,
        limits,
    })
    .map_err(|e| match e {
        multirail_metadata_server::ServerError::InvalidLimits(_) => Failure::Usage(e.to_string()),
        e => Failure::Runtime(e.into()),
    })?;
    println!("{}", server.url());
    server.wait();
    Ok(())
}
