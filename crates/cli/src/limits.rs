//! The ranges of count, size and duration flags, checked while clap parses them.
//!
//! Every such flag of every subcommand parses through [`count`], [`size`] or [`duration`], so
//! a value out of range stops the command before it starts a child, allocates a buffer or
//! sends a byte: clap names the flag, the value and the range, and exits 2 (a usage error).
//! Each flag's help states the same range. The ranges reach far past what a real run on one
//! host asks for, and stop where memory or time would explode (a million sender engines, a
//! `Vec` sized by 2^64 iterations, a benchmark timed to outlast the machine).

use std::time::Duration;

use crate::units;

/// Shortest duration a timed flag takes: the run loops cannot resolve less.
pub const MIN_DURATION: Duration = Duration::from_millis(1);

/// Longest duration a timed flag takes (24 hours): longer is a typo, not a benchmark.
pub const MAX_DURATION: Duration = Duration::from_secs(24 * 3600);

/// Largest buffer or request a size flag takes (1 TiB); buffers are also checked against the
/// host's memory ([`host_memory`]) where they are allocated.
pub const MAX_BYTES: u64 = 1 << 40;

/// A value parser for a whole number from `min` to `max` (clap's own ranged parser says
/// `0 is not in 1..=65536`; this one says `must be 1 to 65536`, as the help does).
pub fn count<T>(min: u64, max: u64) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<u64>,
{
    count_setting(min, max, "")
}

/// [`count`] for a flag that overrides a configuration key: the error also names `key` (e.g.
/// `transports.<transport>.receive.queue_depth`), which the configuration file spells it as.
pub fn count_setting<T>(
    min: u64,
    max: u64,
    key: &'static str,
) -> impl Fn(&str) -> Result<T, String> + Clone + Send + Sync
where
    T: TryFrom<u64>,
{
    move |s: &str| {
        let range = || {
            if key.is_empty() {
                format!("must be {min} to {max}")
            } else {
                format!("must be {min} to {max} (it sets {key})")
            }
        };
        let v: u64 = s.trim().parse().map_err(|_| {
            format!(
                "not a whole number: {}",
                range().trim_start_matches("must be ")
            )
        })?;
        if !(min..=max).contains(&v) {
            return Err(range());
        }
        T::try_from(v).map_err(|_| range())
    }
}

/// A value parser for a size (`64KiB`, `4MiB`, see [`units::parse_size`]) from `min` to `max`
/// bytes.
pub fn size(min: u64, max: u64) -> impl Fn(&str) -> Result<u64, String> + Clone + Send + Sync {
    move |s: &str| {
        let v = units::parse_size(s)?;
        if !(min..=max).contains(&v) {
            return Err(format!(
                "must be {} to {}",
                units::format_size(min),
                units::format_size(max)
            ));
        }
        Ok(v)
    }
}

/// A value parser for a duration (`5`, `2.5s`, `500ms`, `2h`) from `min` to `max`; with a `min` of
/// zero, `0` is taken too.
pub fn duration(
    min: Duration,
    max: Duration,
) -> impl Fn(&str) -> Result<Duration, String> + Clone + Send + Sync {
    move |s: &str| {
        let parsed = if min.is_zero() {
            units::parse_duration_or_zero(s)
        } else {
            units::parse_duration(s)
        };
        let range = || {
            format!(
                "must be {} to {}",
                format_duration(min),
                format_duration(max)
            )
        };
        // A value too large for a Duration is out of range too, not a malformed one.
        let v = parsed.map_err(|e| {
            if e.contains("out of range") {
                range()
            } else {
                e
            }
        })?;
        if v < min || v > max {
            return Err(range());
        }
        Ok(v)
    }
}

/// A duration the way flags are written: `24h`, `5s`, `1ms`, `0`.
pub fn format_duration(d: Duration) -> String {
    let ms = d.as_millis();
    if d.is_zero() {
        "0".into()
    } else if ms.is_multiple_of(3_600_000) {
        format!("{}h", ms / 3_600_000)
    } else if ms.is_multiple_of(1000) {
        format!("{}s", ms / 1000)
    } else {
        format!("{ms}ms")
    }
}

/// Physical memory of this host in bytes, if the OS says.
pub fn host_memory() -> Option<u64> {
    // SAFETY: sysconf takes no pointers and only reads system parameters.
    let (pages, page) = unsafe {
        (
            libc::sysconf(libc::_SC_PHYS_PAGES),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    let (pages, page) = (u64::try_from(pages).ok()?, u64::try_from(page).ok()?);
    pages.checked_mul(page)
}

/// Checks that `copies` buffers of `bytes` each (what `flag` asks for) fit in this host's
/// memory: the commands write every byte of their buffers, so a size past memory would end
/// in the OOM killer rather than an error. The message names `flag` and both amounts.
pub fn fits_in_memory(flag: &str, bytes: u64, copies: u64) -> Result<(), String> {
    if usize::try_from(bytes).is_err() {
        return Err(format!(
            "{flag} {} does not fit in this host's address space",
            units::format_size(bytes)
        ));
    }
    let need = bytes.saturating_mul(copies);
    match host_memory() {
        Some(have) if need > have => Err(format!(
            "{flag} {}{} needs {}, more than this host's {} of memory",
            units::format_size(bytes),
            if copies > 1 {
                format!(" × {copies} buffers")
            } else {
                String::new()
            },
            units::format_size(need),
            units::format_size(have)
        )),
        _ => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_outside_a_range_are_refused_with_it() {
        let peers = count::<usize>(1, 1024);
        assert_eq!(peers("32"), Ok(32));
        assert_eq!(peers("0"), Err("must be 1 to 1024".into()));
        assert_eq!(peers("1000000"), Err("must be 1 to 1024".into()));
        assert!(peers("18446744073709551616")
            .unwrap_err()
            .contains("1 to 1024"));
        assert!(peers("x").is_err());
        let bytes = size(1, MAX_BYTES);
        assert_eq!(bytes("1MiB"), Ok(1 << 20));
        assert_eq!(bytes("2TiB"), Err("must be 1 B to 1 TiB".into()));
        assert!(bytes("0").is_err());
        let time = duration(MIN_DURATION, MAX_DURATION);
        assert_eq!(time("500ms"), Ok(Duration::from_millis(500)));
        assert_eq!(time("1e12"), Err("must be 1ms to 24h".into()));
        assert_eq!(time("1e300"), Err("must be 1ms to 24h".into()));
        assert_eq!(time("0.1ms"), Err("must be 1ms to 24h".into()));
        assert!(time("x").is_err());
        let warmup = duration(Duration::ZERO, MAX_DURATION);
        assert_eq!(warmup("0"), Ok(Duration::ZERO));
        assert_eq!(warmup("25h"), Err("must be 0 to 24h".into()));
        assert_eq!(warmup("90000"), Err("must be 0 to 24h".into()));
    }

    #[test]
    fn memory_past_the_host_is_refused() {
        assert!(fits_in_memory("--size", 4096, 2).is_ok());
        let e = fits_in_memory("--size", MAX_BYTES, 1 << 20).unwrap_err();
        assert!(e.starts_with("--size 1 TiB × 1048576 buffers needs"), "{e}");
    }
}
