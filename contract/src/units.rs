//! The units values cross the command line in, with one parser each.

use std::time::Duration;

/// Parses a duration flag: whole milliseconds, digits only (`1500`).
///
/// # Errors
/// A message for anything else, `1.5s` and `-1` included: the unit is in the flag's
/// name, so a suffix here is a caller that mixed up two conventions.
pub fn parse_millis(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "`{s}` is not a whole number of milliseconds (the flag's unit is ms)"
        ));
    }
    t.parse::<u64>()
        .map(Duration::from_millis)
        .map_err(|_| format!("`{s}` milliseconds is out of range"))
}

/// Writes a duration for [`parse_millis`]: whole milliseconds, rounded up so a bound
/// is never shortened.
#[must_use]
pub fn format_millis(d: Duration) -> String {
    let ms = d.as_millis() + u128::from(!d.subsec_nanos().is_multiple_of(1_000_000));
    ms.to_string()
}

/// Parses a duration flag in whole seconds (`15`), digits only: the operator's lease
/// flags, which predate the milliseconds convention and which its Deployment passes.
///
/// # Errors
/// A message for anything else, `1.5`, `2s` and `-1` included.
pub fn parse_seconds(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    if t.is_empty() || !t.bytes().all(|b| b.is_ascii_digit()) {
        return Err(format!(
            "`{s}` is not a whole number of seconds (the flag's unit is seconds)"
        ));
    }
    t.parse::<u64>()
        .map(Duration::from_secs)
        .map_err(|_| format!("`{s}` seconds is out of range"))
}

/// Writes a duration for [`parse_seconds`]: whole seconds, rounded up so a bound is
/// never shortened.
#[must_use]
pub fn format_seconds(d: Duration) -> String {
    let s = d.as_secs().saturating_add(u64::from(d.subsec_nanos() != 0));
    s.to_string()
}

/// Parses a byte size: a number with an optional K/M/G/T suffix, binary (KiB, MiB,
/// ...) or decimal (KB, MB, ...; bare K/M/G/T are binary).
///
/// Not `bytesize`'s parser, which was considered: it reads a bare `2G` as decimal
/// (2,000,000,000), so `--kv-memory=2G` in a release's engine args would silently
/// shrink the KV pool by 7 %; it also accepts `0` and saturates out-of-range values
/// instead of refusing them.
///
/// # Errors
/// A message for anything else.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size like 512MiB or 2GiB"))?;
    let mult: f64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1.0,
        "k" | "kib" => 1024.0,
        "m" | "mib" => 1024f64.powi(2),
        "g" | "gib" => 1024f64.powi(3),
        "t" | "tib" => 1024f64.powi(4),
        "kb" => 1e3,
        "mb" => 1e6,
        "gb" => 1e9,
        "tb" => 1e12,
        other => return Err(format!("unknown size unit `{other}` in `{s}`")),
    };
    let bytes = n * mult;
    if !(1.0..1.8e19).contains(&bytes) {
        return Err(format!("`{s}` is out of range"));
    }
    // In range and positive: the cast truncates a fraction of a byte only.
    #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
    Ok(bytes as u64)
}

/// A fraction in [0, 1].
///
/// # Errors
/// A message naming the value.
pub fn parse_fraction(s: &str) -> Result<f64, String> {
    match s.trim().parse::<f64>() {
        Ok(v) if (0.0..=1.0).contains(&v) => Ok(v),
        _ => Err(format!("`{s}` is not a fraction in [0, 1]")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_and_decimal_units() {
        assert_eq!(parse_size("1500"), Ok(1500));
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("2GiB"), Ok(2 << 30));
        assert_eq!(parse_size("2G"), Ok(2 << 30));
        assert_eq!(parse_size("1.5kb"), Ok(1500));
        for bad in ["", "MiB", "12XB", "-1", "0"] {
            assert!(parse_size(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn millis_are_digits_only_and_round_trip() {
        assert_eq!(parse_millis("1500"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_millis("0"), Ok(Duration::ZERO));
        for bad in ["", "1.5", "2s", "-1", "1m30s", "99999999999999999999999"] {
            assert!(parse_millis(bad).is_err(), "{bad}");
        }
        assert_eq!(format_millis(Duration::from_millis(41_000)), "41000");
        // A fraction of a millisecond rounds up: a budget is never cut short.
        assert_eq!(format_millis(Duration::from_micros(1500)), "2");
    }

    #[test]
    fn seconds_are_digits_only_and_round_trip() {
        assert_eq!(parse_seconds("15"), Ok(Duration::from_secs(15)));
        assert_eq!(parse_seconds("0"), Ok(Duration::ZERO));
        for bad in [
            "",
            "1.5",
            "2s",
            "-1",
            "+1",
            "1m30s",
            "99999999999999999999999",
        ] {
            assert!(parse_seconds(bad).is_err(), "{bad}");
        }
        assert_eq!(format_seconds(Duration::from_secs(15)), "15");
        // A fraction of a second rounds up: a lease is never cut short.
        assert_eq!(format_seconds(Duration::from_millis(1500)), "2");
    }
}
