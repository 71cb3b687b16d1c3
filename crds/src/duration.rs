//! Go-style duration strings (`"150ms"`, `"30s"`, `"1h30m"`), as Kubernetes users
//! write them in `metav1.Duration` fields and as CEL's `duration()` parses them.
//!
//! Written by hand rather than with a crate because it must accept exactly the subset
//! the CRD's `pattern` admits ([`PATTERN`]): the API server validates the same strings
//! with CEL, and a more liberal parser here (e.g. `"2 min"`) would let the operator
//! act on values the API server would have rejected.

use std::time::Duration;

/// The OpenAPI `pattern` for duration fields: one or more `<number><unit>` parts,
/// units `ms`, `s`, `m`, `h`.
pub const PATTERN: &str = r"^([0-9]+(\.[0-9]+)?(ms|s|m|h))+$";

/// A duration string did not parse.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("invalid duration {input:?}: {why} (write e.g. \"150ms\", \"30s\", \"5m\", \"1h30m\")")]
pub struct DurationError {
    input: String,
    why: &'static str,
}

/// Parses a Go-style duration made of `<number><unit>` parts (units `ms`, `s`, `m`, `h`).
///
/// # Errors
/// Returns [`DurationError`] for an empty string, a missing or unknown unit, a
/// malformed number, or a value too large to represent.
pub fn parse(input: &str) -> Result<Duration, DurationError> {
    let fail = |why| DurationError {
        input: input.to_owned(),
        why,
    };
    if input.is_empty() {
        return Err(fail("empty"));
    }
    let mut total = 0.0_f64;
    let mut rest = input;
    while !rest.is_empty() {
        let number_len = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .ok_or_else(|| fail("missing unit"))?;
        let (number, tail) = rest.split_at(number_len);
        if number.is_empty() || number.starts_with('.') || number.ends_with('.') {
            return Err(fail("malformed number"));
        }
        let value: f64 = number.parse().map_err(|_| fail("malformed number"))?;
        let unit_len = tail
            .find(|c: char| c.is_ascii_digit())
            .unwrap_or(tail.len());
        let (unit, next) = tail.split_at(unit_len);
        let seconds_per_unit = match unit {
            "ms" => 0.001,
            "s" => 1.0,
            "m" => 60.0,
            "h" => 3600.0,
            _ => return Err(fail("unknown unit")),
        };
        total += value * seconds_per_unit;
        rest = next;
    }
    Duration::try_from_secs_f64(total).map_err(|_| fail("out of range"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_forms_users_write() {
        assert_eq!(parse("150ms"), Ok(Duration::from_millis(150)));
        assert_eq!(parse("30s"), Ok(Duration::from_secs(30)));
        assert_eq!(parse("1h30m"), Ok(Duration::from_secs(5400)));
        assert_eq!(parse("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse("0s"), Ok(Duration::ZERO));
    }

    #[test]
    fn rejects_what_the_crd_pattern_rejects() {
        for bad in ["", "5", "s", "5 s", "5d", "-1s", ".5s", "5.s", "1h3"] {
            assert!(parse(bad).is_err(), "{bad:?} should not parse");
        }
    }
}
