//! A request's latency objectives: a first token within `x-slo-ttft-ms`, then a token
//! every `x-slo-tpot-ms` (llm-d's headers), else the gateway's `--slo-ttft-ms` and
//! `--slo-tpot-ms`. What routing, admission and the disaggregation decision aim at.

use std::time::Duration;

use http::HeaderMap;
use pdserve_protocol::ApiError;

/// The header that sets a request's time-to-first-token objective, in milliseconds.
pub const TTFT_HEADER: &str = "x-slo-ttft-ms";
/// The header that sets a request's time-per-output-token objective, in milliseconds.
pub const TPOT_HEADER: &str = "x-slo-tpot-ms";
/// The longest objective taken seriously: a day. Larger is a mistake, not a wish.
const MAX_MS: f64 = 86_400_000.0;

/// A request's objectives; `None` where neither the request nor the gateway sets one.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Slo {
    /// Time to first token.
    pub ttft: Option<Duration>,
    /// Time per output token after the first.
    pub tpot: Option<Duration>,
}

impl Slo {
    /// The request's objectives from its `headers`, each falling back to `defaults`'. A
    /// value that is not a positive number of milliseconds up to a day is a 400 naming
    /// its header.
    #[allow(clippy::result_large_err)]
    pub fn from_headers(headers: &HeaderMap, defaults: Slo) -> Result<Slo, ApiError> {
        let read = |name: &str, default: Option<Duration>| match headers.get(name) {
            None => Ok(default),
            Some(value) => {
                let text = value.to_str().unwrap_or_default();
                parse_ms(text).map(Some).map_err(|why| {
                    ApiError::bad_request(format!("{name} {why}, got '{text}'")).with_param(name)
                })
            }
        };
        Ok(Slo {
            ttft: read(TTFT_HEADER, defaults.ttft)?,
            tpot: read(TPOT_HEADER, defaults.tpot)?,
        })
    }

    /// When the first token is due for a request that arrived at `arrival`.
    pub fn ttft_deadline(&self, arrival: std::time::Instant) -> Option<std::time::Instant> {
        self.ttft.map(|ttft| arrival + ttft)
    }
}

/// `text` as an objective: a positive, finite number of milliseconds up to a day
/// (fractions allowed). The error says what is wrong.
pub fn parse_ms(text: &str) -> Result<Duration, String> {
    let ms: f64 = text
        .trim()
        .parse()
        .map_err(|_| "must be a number of milliseconds".to_string())?;
    if !ms.is_finite() || ms <= 0.0 {
        return Err("must be a positive number of milliseconds".into());
    }
    if ms > MAX_MS {
        return Err(format!("must be at most {MAX_MS} (a day)"));
    }
    Ok(Duration::from_secs_f64(ms / 1000.0))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut map = HeaderMap::new();
        for (name, value) in pairs {
            map.insert(*name, value.parse().unwrap());
        }
        map
    }

    #[test]
    fn headers_set_the_objectives_and_flags_fill_in() {
        let defaults = Slo {
            ttft: Some(Duration::from_millis(500)),
            tpot: Some(Duration::from_millis(50)),
        };
        let both = Slo::from_headers(
            &headers(&[(TTFT_HEADER, "200"), (TPOT_HEADER, "12.5")]),
            defaults,
        )
        .unwrap();
        assert_eq!(both.ttft, Some(Duration::from_millis(200)));
        assert_eq!(both.tpot, Some(Duration::from_micros(12_500)));
        assert_eq!(
            Slo::from_headers(&HeaderMap::new(), defaults).unwrap(),
            defaults
        );
        assert_eq!(
            Slo::from_headers(&HeaderMap::new(), Slo::default()).unwrap(),
            Slo::default()
        );
    }

    #[test]
    fn a_bad_objective_is_a_400_naming_its_header() {
        for (name, value) in [
            (TTFT_HEADER, "fast"),
            (TTFT_HEADER, "0"),
            (TPOT_HEADER, "-5"),
            (TPOT_HEADER, "NaN"),
            (TTFT_HEADER, "1e12"),
            (TTFT_HEADER, "inf"),
        ] {
            let e = Slo::from_headers(&headers(&[(name, value)]), Slo::default()).unwrap_err();
            assert_eq!(e.status, http::StatusCode::BAD_REQUEST, "{value}");
            assert_eq!(e.body.error.param.as_deref(), Some(name), "{value}");
            assert!(
                e.body.error.message.contains(value),
                "{}",
                e.body.error.message
            );
        }
    }
}
