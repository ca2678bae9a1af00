//! The parent of a `--local` run: starts the child members, joins as member 0, sets the
//! clock of the run, runs its own part, kills a member when asked, and gathers the reports.

use std::io::{BufRead, BufReader, Write};
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::{self, Receiver, RecvTimeoutError};
use std::thread;
use std::time::Duration;

use anyhow::{anyhow, bail, Context};
use multirail::{Config, Engine};

use super::member::{self, MemberReport, Plan, Run};
use super::report::{self, Kill};
use super::{mono_ns, stall_limit, KillSignal, McastBenchArgs};
use crate::child::{self, Guarded, Stop};
use crate::Failure;

/// How long a child may take to start its engine, or to answer `join` past the join timeout.
const ANSWER_SLACK: Duration = Duration::from_secs(30);
/// The start of sending lies this far after the last member joined, so every member has the
/// `start` line before it.
const START_LEAD_NS: u64 = 50_000_000;

/// A child member; asked to stop (stdin closed) and killed if it lingers, when dropped.
struct ChildMember {
    index: usize,
    child: Guarded,
    lines: Receiver<String>,
    name: String,
}

/// The child members, stopped together when dropped: asked at once and given one grace
/// period between them, so an error with 63 members lingering takes seconds, not minutes.
struct Members(Vec<ChildMember>);

impl Drop for Members {
    fn drop(&mut self) {
        let mut children: Vec<Guarded> = self
            .0
            .drain(..)
            .map(|m| {
                let ChildMember { child, .. } = m;
                child
            })
            .collect();
        child::stop_all(&mut children);
    }
}

impl ChildMember {
    fn start(
        config_path: Option<&Path>,
        args: &McastBenchArgs,
        index: usize,
    ) -> anyhow::Result<ChildMember> {
        let exe = std::env::current_exe().context("locating the multirail binary")?;
        let mut cmd = Command::new(exe);
        if let Some(p) = config_path {
            cmd.arg("--config").arg(p);
        }
        cmd.args(["mcast-bench", "--serve-member"])
            .args(args.member_flags())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        let mut child = Guarded::spawn(&mut cmd, Stop::CloseStdin)
            .with_context(|| format!("starting member {index}"))?;
        let stdout = BufReader::new(child.take_stdout().expect("piped"));
        let (tx, lines) = mpsc::channel();
        thread::Builder::new()
            .name(format!("mb-member-{index}"))
            .spawn(move || {
                for line in stdout.lines() {
                    let Ok(line) = line else { break };
                    if tx.send(line).is_err() {
                        break;
                    }
                }
            })
            .context("spawning a reader of a member's output")?;
        let mut m = ChildMember {
            index,
            child,
            lines,
            name: String::new(),
        };
        m.name = m.line(ANSWER_SLACK, "its segment name")?;
        Ok(m)
    }

    fn say(&mut self, line: &str) -> anyhow::Result<()> {
        let index = self.index;
        let stdin = self.child.stdin().expect("stdin open until dropped");
        writeln!(stdin, "{line}")
            .and_then(|()| stdin.flush())
            .with_context(|| format!("writing to member {index} (did it exit?)"))
    }

    /// The child's next line, waiting up to `timeout`; fails naming `what` when it exited or
    /// did not answer.
    fn line(&mut self, timeout: Duration, what: &str) -> anyhow::Result<String> {
        match self.lines.recv_timeout(timeout) {
            Ok(l) => Ok(l),
            Err(RecvTimeoutError::Timeout) => bail!(
                "member {} did not send {what} within {:.0} s",
                self.index,
                timeout.as_secs_f64()
            ),
            Err(RecvTimeoutError::Disconnected) => {
                let status = self.child.wait().ok();
                bail!(
                    "member {} exited ({}) before sending {what}",
                    self.index,
                    status.map_or("unknown status".into(), |s| s.to_string())
                )
            }
        }
    }
}

pub(super) fn run(
    config: Config,
    config_path: Option<&Path>,
    args: &McastBenchArgs,
) -> Result<(), Failure> {
    let stall = stall_limit(&config);
    // The group's default join timeout (the bench does not change it).
    let join_timeout = Duration::from_secs(30);
    let mut members = Members(Vec::with_capacity(args.members - 1));
    for index in 1..args.members {
        members
            .0
            .push(ChildMember::start(config_path, args, index)?);
    }
    let children = &mut members.0;
    let engine = Engine::new(config, "127.0.0.1:0")?;
    let names: Vec<String> = std::iter::once(engine.segment_name())
        .chain(children.iter().map(|c| c.name.clone()))
        .collect();
    let join_line = format!("join {}", names.join(","));
    for c in children.iter_mut() {
        c.say(&join_line)?;
    }
    let group = member::join(&engine, args.group_config(&names))
        .map_err(|e| Failure::Runtime(anyhow!("member 0 could not join: {e}")))?;
    for c in children.iter_mut() {
        let answer = c.line(join_timeout + ANSWER_SLACK, "`joined`")?;
        if answer != "joined" {
            let why = answer.strip_prefix("error ").unwrap_or(&answer);
            return Err(Failure::Runtime(anyhow!(
                "member {} could not join: {why}",
                c.index
            )));
        }
    }
    let t_start = mono_ns() + START_LEAD_NS;
    let (t_warm, t_end) = match args.messages {
        Some(_) => (t_start, 0),
        None => (
            t_start + args.warmup.as_nanos() as u64,
            t_start + args.duration.as_nanos() as u64,
        ),
    };
    let start_line = format!("start {t_start} {t_warm} {t_end}");
    for c in children.iter_mut() {
        c.say(&start_line)?;
    }
    let plan = Plan {
        t_start,
        t_warm,
        t_end: (t_end != 0).then_some(t_end),
        quota: args.quota(0),
        rate: args.rate,
        idle: args.is_idle(0),
        stall_limit: stall,
    };
    let run = Run {
        sizes: args.size,
        senders: args.senders,
        names: &names,
        me: 0,
    };
    let delivered = AtomicU64::new(0);
    let done = AtomicBool::new(false);
    let mut kill: Option<Kill> = None;
    let (own, own_failed_group) = thread::scope(|scope| {
        let worker = scope.spawn(|| {
            let r = member::run(group, &run, plan, &delivered);
            done.store(true, Ordering::Release);
            r
        });
        let pb = progress(args);
        let kill_at = args
            .kill_member
            .zip(args.kill_after)
            .map(|(m, after)| (m, t_start + after.as_nanos() as u64));
        while !done.load(Ordering::Acquire) {
            thread::sleep(Duration::from_millis(20));
            let now = mono_ns();
            match args.messages {
                Some(_) => pb.set_position(delivered.load(Ordering::Relaxed)),
                None => pb.set_position(now.saturating_sub(t_start) / 1_000_000),
            }
            if let Some((m, at)) = kill_at {
                if kill.is_none() && now >= at {
                    let c = &mut children[m - 1];
                    match args.kill_signal {
                        KillSignal::Kill => c.child.kill(),
                        KillSignal::Stop => c.child.signal(libc::SIGSTOP),
                    }
                    kill = Some(Kill {
                        member: m,
                        name: names[m].clone(),
                        at_ns: mono_ns(),
                    });
                }
            }
        }
        pb.finish_and_clear();
        worker.join().expect("the member thread does not panic")
    });
    let mut reports: Vec<Option<MemberReport>> = vec![Some(own)];
    for c in children.iter_mut() {
        if kill.as_ref().is_some_and(|k| k.member == c.index) {
            reports.push(None);
            continue;
        }
        let line = c.line(stall + ANSWER_SLACK, "its report")?;
        let r: MemberReport = serde_json::from_str(&line)
            .with_context(|| format!("member {}'s report {line:?}", c.index))?;
        reports.push(Some(r));
    }
    // The children leave once their stdin closes; a failed group of ours goes after them
    // (see `member::run`).
    drop(members);
    drop(own_failed_group);
    report::finish(args, &reports, kill.as_ref())
}

fn progress(args: &McastBenchArgs) -> indicatif::ProgressBar {
    match args.messages {
        Some(n) if !args.json && std::io::IsTerminal::is_terminal(&std::io::stderr()) => {
            let pb = indicatif::ProgressBar::new(n);
            pb.set_style(
                indicatif::ProgressStyle::with_template(
                    "{spinner} [{elapsed_precise}] {bar:40} {pos}/{len} delivered at member 0",
                )
                .expect("valid template"),
            );
            pb
        }
        Some(_) => indicatif::ProgressBar::hidden(),
        None => crate::timed_progress(args.json, args.duration),
    }
}
