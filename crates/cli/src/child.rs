//! Ending the child processes a `--local` benchmark starts.

use std::process::{Child, ChildStdin};
use std::thread;
use std::time::{Duration, Instant};

/// How long a child gets to exit by itself once its stdin is closed.
const GRACE: Duration = Duration::from_secs(3);

/// Closes the child's stdin (`stdin`, taken from it), which asks a benchmark child to finish
/// and exit; kills it if it has not exited within 3 s, and reaps it either way.
pub fn stop(child: &mut Child, stdin: Option<ChildStdin>) {
    drop(stdin);
    let deadline = Instant::now() + GRACE;
    while Instant::now() < deadline {
        if let Ok(Some(_)) = child.try_wait() {
            return;
        }
        thread::sleep(Duration::from_millis(10));
    }
    let _ = child.kill();
    let _ = child.wait();
}
