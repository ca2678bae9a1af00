//! `multirail metadata-server`: an HTTP metadata server speaking Mooncake Transfer Engine's
//! protocol (`multirail-metadata-server`), which Mooncake's engines can use unchanged. Prints
//! its URL on the first line and serves until interrupted.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use multirail_metadata_server::{Limits, MetadataServer, ServerConfig, ServerError};

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
    /// Most connections served at once (more wait to be accepted), at least 1. Default: 1024.
    #[arg(long, default_value_t = 1024)]
    max_connections: usize,
    /// How long a client may take to send a request (seconds, or e.g. 500ms). Default: 30.
    #[arg(long, default_value = "30", value_parser = units::parse_duration)]
    request_timeout: Duration,
    /// Drop a key that is not PUT again within this many seconds (0, or 1 to 86400), as etcd
    /// drops the keys of an expired lease: the keys of an engine that died without deleting them
    /// go away. Every PUT of a key restarts its time; keys loaded from --data-dir get the full
    /// time at start. Default: 0, keys never expire (as with Mooncake's servers).
    #[arg(long, value_name = "SECONDS", default_value_t = 0, allow_hyphen_values = true,
          value_parser = clap::value_parser!(u64).range(0..=Limits::MAX_KEY_TTL.as_secs()))]
    key_ttl_s: u64,
}

pub fn run(args: MetadataServerArgs) -> Result<(), Failure> {
    let max_value_bytes = usize::try_from(args.max_value_size)
        .map_err(|_| Failure::Usage("--max-value-size is too large".into()))?;
    if args.max_connections == 0 {
        return Err(Failure::Usage(
            "--max-connections must be at least 1".into(),
        ));
    }
    let limits = Limits {
        max_value_bytes,
        max_connections: args.max_connections,
        request_timeout: args.request_timeout,
        key_ttl: (args.key_ttl_s > 0).then(|| Duration::from_secs(args.key_ttl_s)),
        ..Limits::default()
    };
    let server = MetadataServer::start(ServerConfig {
        listen: args.listen,
        data_dir: args.data_dir,
        limits,
    })
    .map_err(|e| match e {
        ServerError::InvalidLimits(_) => Failure::Usage(e.to_string()),
        // A directory the server cannot use is a wrong flag value, not a failure while
        // serving: say which flag, what is wrong, and the system's word for it, on one line.
        ServerError::DataDir {
            path,
            problem,
            source,
        } => Failure::Usage(match source {
            Some(source) => format!("--data-dir {}: {problem}: {source}", path.display()),
            None => format!("--data-dir {}: {problem}", path.display()),
        }),
        e => Failure::Runtime(e.into()),
    })?;
    println!("{}", server.url());
    server.wait();
    Ok(())
}
