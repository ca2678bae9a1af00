//! A child member of a `--local` run (`--serve-member`): the protocol of the module doc, on
//! stdin and stdout.

use std::io::{BufRead, Write};
use std::sync::atomic::AtomicU64;

use anyhow::{anyhow, Context};
use multirail::{Config, Engine};

use super::member::{self, Plan, Run};
use super::{stall_limit, McastBenchArgs};
use crate::Failure;

/// Reads the next line of stdin; `None` at its end (the parent is gone or gave up).
fn next_line(lines: &mut impl Iterator<Item = std::io::Result<String>>) -> Option<String> {
    lines.next().and_then(Result::ok)
}

fn say(line: &str) -> anyhow::Result<()> {
    let mut out = std::io::stdout().lock();
    writeln!(out, "{line}")
        .and_then(|()| out.flush())
        .context("writing to the parent")
}

/// Serves as one member until the run ends or the parent goes away.
pub(super) fn serve(config: Config, args: &McastBenchArgs) -> Result<(), Failure> {
    // The parent started this process to die with it (`child::Guarded`).
    let stall = stall_limit(&config);
    let engine = Engine::new(config, "127.0.0.1:0")?;
    say(&engine.segment_name())?;
    let stdin = std::io::stdin();
    let mut lines = stdin.lock().lines();
    let Some(join) = next_line(&mut lines) else {
        return Ok(());
    };
    let names: Vec<String> = join
        .strip_prefix("join ")
        .ok_or_else(|| anyhow!("expected `join NAMES` from the parent, got {join:?}"))?
        .split(',')
        .map(str::to_owned)
        .collect();
    let me = names
        .iter()
        .position(|n| *n == engine.segment_name())
        .ok_or_else(|| {
            anyhow!(
                "this member ({}) is not in the join list",
                engine.segment_name()
            )
        })?;
    let group = match member::join(&engine, args.group_config(&names)) {
        Ok(g) => g,
        Err(e) => {
            say(&format!("error {e}"))?;
            return Err(Failure::Runtime(anyhow!(e)));
        }
    };
    say("joined")?;
    let Some(start) = next_line(&mut lines) else {
        return Ok(());
    };
    let times: Vec<u64> = start
        .strip_prefix("start ")
        .map(|t| t.split(' ').filter_map(|v| v.parse().ok()).collect())
        .unwrap_or_default();
    let [t_start, t_warm, t_end] = times[..] else {
        return Err(Failure::Runtime(anyhow!(
            "expected `start T_START T_WARM T_END` from the parent, got {start:?}"
        )));
    };
    let plan = Plan {
        t_start,
        t_warm,
        t_end: (t_end != 0).then_some(t_end),
        quota: args.quota(me),
        rate: args.rate,
        idle: args.is_idle(me),
        stall_limit: stall,
    };
    let run = Run {
        sizes: args.size,
        senders: args.senders,
        names: &names,
        me,
    };
    let (report, _failed_group) = member::run(group, &run, plan, &AtomicU64::new(0));
    let line = serde_json::to_string(&report).expect("a report serializes");
    // The parent may be gone: nothing to tell then.
    let _ = say(&line);
    // Stay (with the engine, and a failed group's table) until the parent has every report
    // and closes our stdin: a member that exited at once would look failed to the members
    // still waiting to see the failure this one saw.
    while next_line(&mut lines).is_some() {}
    Ok(())
}
