//! Value parsers that several flag sets share.

use std::time::Duration;

/// Parses a non-negative number of seconds (fractions allowed) into a `Duration`.
pub fn parse_secs(s: &str) -> Result<Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds"))?;
    Duration::try_from_secs_f64(secs).map_err(|e| format!("`{s}`: {e}"))
}
