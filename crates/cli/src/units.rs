//! Parsing of sizes (`64KiB`, `1GiB`, `4M`) and durations (`5`, `5s`, `500ms`, `2h`) for flags.

use std::time::Duration;

/// Parses a byte count with an optional binary unit: B, K/KB/KiB, M/MB/MiB, G/GB/GiB, T/TB/TiB.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let value: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a size like 64KiB, 4MiB or 1GiB"))?;
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kb" | "kib" => 1 << 10,
        "m" | "mb" | "mib" => 1 << 20,
        "g" | "gb" | "gib" => 1 << 30,
        "t" | "tb" | "tib" => 1 << 40,
        u => return Err(format!("unknown size unit {u:?} in {s:?}")),
    };
    let bytes = value * mult as f64;
    if !bytes.is_finite() || bytes < 0.0 || bytes > u64::MAX as f64 {
        return Err(format!("{s:?} is out of range"));
    }
    Ok(bytes as u64)
}

/// Parses seconds (`5`, `2.5`, `5s`), milliseconds (`500ms`) or hours (`2h`).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let (num, scale) = if let Some(n) = t.strip_suffix("ms") {
        (n, 1e-3)
    } else if let Some(n) = t.strip_suffix('h') {
        (n, 3600.0)
    } else if let Some(n) = t.strip_suffix('s') {
        (n, 1.0)
    } else {
        (t, 1.0)
    };
    let v: f64 = num
        .trim()
        .parse()
        .map_err(|_| format!("{s:?} is not a duration like 5, 5s, 500ms or 2h"))?;
    if !v.is_finite() || v <= 0.0 {
        return Err(format!("duration {s:?} must be positive"));
    }
    // `from_secs_f64` panics on values a Duration cannot hold (e.g. `1e300`); a flag value
    // must give an error instead.
    Duration::try_from_secs_f64(v * scale).map_err(|_| format!("duration {s:?} is out of range"))
}

/// Like [`parse_duration`], and 0 (`0`, `0s`, `0ms`) is allowed: for warm-ups that may be
/// left out.
pub fn parse_duration_or_zero(s: &str) -> Result<Duration, String> {
    let t = s
        .trim()
        .trim_end_matches("ms")
        .trim_end_matches('s')
        .trim_end_matches('h');
    if t.parse::<f64>().is_ok_and(|v| v == 0.0) {
        return Ok(Duration::ZERO);
    }
    parse_duration(s)
}

/// Formats a byte count with a binary unit, e.g. `64 KiB`.
pub fn format_size(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u < UNITS.len() - 1 && (v / 1024.0).fract() == 0.0 {
        v /= 1024.0;
        u += 1;
    }
    format!("{v} {}", UNITS[u])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64KiB").unwrap(), 65536);
        assert_eq!(parse_size("1GiB").unwrap(), 1 << 30);
        assert_eq!(parse_size("4M").unwrap(), 4 << 20);
        assert_eq!(parse_size("100").unwrap(), 100);
        assert_eq!(parse_size("1.5KiB").unwrap(), 1536);
        assert!(parse_size("abc").is_err());
        assert!(parse_size("10XB").is_err());
        assert_eq!(format_size(65536), "64 KiB");
        assert_eq!(format_size(1000), "1000 B");
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("5").unwrap(), Duration::from_secs(5));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2.5s").unwrap(), Duration::from_millis(2500));
        assert_eq!(parse_duration("2h").unwrap(), Duration::from_secs(7200));
        assert!(parse_duration("-1").is_err());
        assert!(parse_duration("x").is_err());
        assert!(parse_duration("1e300").is_err());
        assert!(parse_duration("1e300ms").is_err());
    }
}
