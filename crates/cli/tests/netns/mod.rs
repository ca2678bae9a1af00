//! Shaped test rails for tests that need two hosts: `scripts/rails` builds 4 veth rails at 800,
//! 400, 200 and 200 Mbit/s between two network namespaces, torn down when dropped. Needs root
//! (network namespaces, tc); `Rails::up` says why when it cannot.

#![allow(dead_code)]

use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Child, Command, Output, Stdio};

const RATES: [&str; 4] = ["800mbit", "400mbit", "200mbit", "200mbit"];

pub fn script() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../scripts/rails")
}

/// The rails of one test, torn down when dropped.
pub struct Rails {
    prefix: String,
}

impl Rails {
    /// Builds the rails, or returns why it cannot (not root, no namespaces).
    pub fn up(prefix: &str) -> Result<Rails, String> {
        let out = Command::new(script())
            .args(["up", "4"])
            .args(RATES)
            .args(["--prefix", prefix])
            .output()
            .map_err(|e| format!("cannot run scripts/rails: {e}"))?;
        match out.status.code() {
            Some(0) => Ok(Rails {
                prefix: prefix.to_owned(),
            }),
            Some(77) => Err(format!(
                "skipped: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            )),
            _ => panic!(
                "scripts/rails up failed: {}",
                String::from_utf8_lossy(&out.stderr)
            ),
        }
    }

    /// As [`Rails::up`], printing why it cannot instead: `None` tells the test to skip.
    pub fn up_or_skip(prefix: &str) -> Option<Rails> {
        Rails::up(prefix).map_err(|why| eprintln!("{why}")).ok()
    }

    pub fn run(&self, args: &[&str]) -> Output {
        let out = Command::new(script())
            .args(args)
            .args(["--prefix", &self.prefix])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "scripts/rails {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out
    }

    pub fn ns(&self, side: char) -> String {
        format!("{}{side}", self.prefix)
    }

    pub fn counters(&self) -> serde_json::Value {
        serde_json::from_slice(&self.run(&["counters"]).stdout).unwrap()
    }

    /// Starts `multirail target` in namespace a; returns it and its segment name.
    pub fn target(&self, size: &str) -> (Child, String) {
        self.target_with(size, None)
    }

    /// As `target`, with configuration `conf` (inline JSON).
    pub fn target_with(&self, size: &str, conf: Option<&str>) -> (Child, String) {
        let mut cmd = Command::new("ip");
        match conf {
            Some(c) => cmd.env("MULTIRAIL_CONF", c),
            None => cmd.env_remove("MULTIRAIL_CONF"),
        };
        let mut child = cmd
            .args([
                "netns",
                "exec",
                &self.ns('a'),
                env!("CARGO_BIN_EXE_multirail"),
                "target",
                "--size",
                size,
            ])
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut line = String::new();
        BufReader::new(child.stdout.take().unwrap())
            .read_line(&mut line)
            .unwrap();
        let name = line.trim().to_owned();
        assert!(
            name.starts_with("10.77."),
            "target publishes a rail address, got {name:?}"
        );
        (child, name)
    }

    /// Runs `multirail bench` in namespace b with config `conf`.
    pub fn bench(&self, conf: &str, args: &[&str]) -> std::process::Child {
        Command::new("ip")
            .args([
                "netns",
                "exec",
                &self.ns('b'),
                env!("CARGO_BIN_EXE_multirail"),
                "bench",
                "--json",
                "--transport",
                "tcp",
            ])
            .args(args)
            .env("MULTIRAIL_CONF", conf)
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
    }
}

impl Rails {
    /// `ip` with `args`, which must succeed; returns its output.
    pub fn ip(&self, args: &[&str]) -> String {
        let out = Command::new("ip").args(args).output().unwrap();
        assert!(
            out.status.success(),
            "ip {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8_lossy(&out.stdout).into_owned()
    }
}

impl Drop for Rails {
    fn drop(&mut self) {
        let _ = Command::new(script())
            .args(["teardown", "--prefix", &self.prefix])
            .output();
    }
}
