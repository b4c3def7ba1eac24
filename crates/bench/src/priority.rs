//! `serve --priority VALUE:SHARE`: vLLM's request `priority` field (lower is served
//! first) on a seeded share of the requests. The latency per class is reported by
//! `priority_report`.

use std::fmt;

use serde::{Deserialize, Serialize};
use serde_json::{Map, Value};

/// Mixed into the seed so the classes do not correlate with prompts or arrival times.
const PRIORITY_SEED_SALT: u64 = 0x0071_0a55_1f1e_d5a1;

/// Rounding the shares may carry past 1 (0.1 ten times sums to 0.9999999999999999).
const SHARE_EPSILON: f64 = 1e-9;

/// Why a `--priority` value or the list of them is unusable; its `Display` is the clap
/// error message.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum PriorityError {
    /// Not `VALUE:SHARE`.
    #[error("expected VALUE:SHARE, e.g. `-1:0.5` (an integer priority, lower is served first, and the share of requests sending it), got `{0}`")]
    Syntax(String),
    /// VALUE is not an integer.
    #[error("the priority must be an integer (vLLM's `priority`), got `{0}`")]
    Value(String),
    /// SHARE is not in (0, 1].
    #[error("the share must be a number in (0, 1], got `{0}`")]
    Share(String),
    /// The same VALUE twice.
    #[error("priority {0} is given twice; give each value once with its whole share")]
    Duplicate(i64),
    /// The shares add up to more than every request.
    #[error(
        "the shares sum to {}, more than 1 (the remainder below 1 is sent without `priority`)",
        rounded(*.0)
    )]
    SharesOverOne(f64),
}

/// `x` to 9 decimals, so a sum of shares reads as typed (1.2, not 1.2000000000000002).
fn rounded(x: f64) -> f64 {
    (x * 1e9).round() / 1e9
}

/// One `--priority VALUE:SHARE`: this share of the requests sends `"priority": value`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct PriorityClass {
    /// vLLM's `priority` (lower is served first).
    pub value: i64,
    /// Share of the requests, in (0, 1].
    pub share: f64,
}

impl PriorityClass {
    /// Parses `VALUE:SHARE`, e.g. `-1:0.5`.
    pub fn parse(text: &str) -> Result<Self, PriorityError> {
        let (value, share) = text
            .split_once(':')
            .ok_or_else(|| PriorityError::Syntax(text.to_string()))?;
        let (value, share) = (value.trim(), share.trim());
        if value.is_empty() || share.is_empty() {
            return Err(PriorityError::Syntax(text.to_string()));
        }
        let value = value
            .parse::<i64>()
            .map_err(|_| PriorityError::Value(value.to_string()))?;
        let bad_share = || PriorityError::Share(share.to_string());
        let share = share.parse::<f64>().map_err(|_| bad_share())?;
        // `share > 0.0` is false for NaN too.
        if !(share > 0.0 && share <= 1.0) {
            return Err(bad_share());
        }
        Ok(Self { value, share })
    }
}

impl fmt::Display for PriorityClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.value, self.share)
    }
}

/// The classes of `--priority`; empty when the flag is not given (no request sends
/// `priority`).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct PriorityMix {
    classes: Vec<PriorityClass>,
}

impl PriorityMix {
    /// A mix of distinct values whose shares sum to at most 1.
    pub fn new(classes: Vec<PriorityClass>) -> Result<Self, PriorityError> {
        for (i, c) in classes.iter().enumerate() {
            if classes[..i].iter().any(|earlier| earlier.value == c.value) {
                return Err(PriorityError::Duplicate(c.value));
            }
        }
        let total: f64 = classes.iter().map(|c| c.share).sum();
        if total > 1.0 + SHARE_EPSILON {
            return Err(PriorityError::SharesOverOne(total));
        }
        Ok(Self { classes })
    }

    /// The classes, in the order given.
    pub fn classes(&self) -> &[PriorityClass] {
        &self.classes
    }

    /// Whether `--priority` was not given.
    pub fn is_empty(&self) -> bool {
        self.classes.is_empty()
    }

    /// The share of requests sent without `priority` (class "none").
    pub fn remainder(&self) -> f64 {
        let rest = 1.0 - self.classes.iter().map(|c| c.share).sum::<f64>();
        if rest <= SHARE_EPSILON {
            0.0
        } else {
            rest
        }
    }

    /// The priority request `index` sends (`None`: no `priority` field). It depends only
    /// on `seed` and `index`, never on when the request goes out, so a seed fixes the
    /// assignment whatever the load mode or the server's speed.
    pub fn class_of(&self, seed: u64, index: u64) -> Option<i64> {
        let draw = unit_draw(seed ^ PRIORITY_SEED_SALT, index);
        let mut upper = 0.0;
        for class in &self.classes {
            upper += class.share;
            if draw < upper {
                return Some(class.value);
            }
        }
        // Shares summing to 1 up to rounding leave no request without a class.
        if self.remainder() > 0.0 {
            None
        } else {
            self.classes.last().map(|c| c.value)
        }
    }

    /// The priority the probe sends: the first non-zero one (a server that serves only
    /// fcfs, like vLLM's default scheduler, answers 400 to those), else the first.
    pub fn probe_class(&self) -> Option<i64> {
        self.classes
            .iter()
            .find(|c| c.value != 0)
            .or(self.classes.first())
            .map(|c| c.value)
    }
}

/// A uniform draw in [0, 1) from `(seed, index)`: splitmix64's finalizer over the pair,
/// so every request has its own draw without a shared generator (whose stream would
/// tie a request's class to how many were drawn before it).
fn unit_draw(seed: u64, index: u64) -> f64 {
    let mut z = seed.wrapping_add(index.wrapping_add(1).wrapping_mul(0x9e37_79b9_7f4a_7c15));
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^= z >> 31;
    // The top 53 bits fill an f64 mantissa exactly.
    (z >> 11) as f64 / (1u64 << 53) as f64
}

/// The top-level body fields of a request of class `priority` (none for `None`).
pub fn body_fields(priority: Option<i64>) -> Map<String, Value> {
    let mut extra = Map::new();
    if let Some(value) = priority {
        extra.insert("priority".into(), Value::from(value));
    }
    extra
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mix(specs: &[&str]) -> Result<PriorityMix, PriorityError> {
        let classes = specs
            .iter()
            .map(|s| PriorityClass::parse(s))
            .collect::<Result<Vec<_>, _>>()?;
        PriorityMix::new(classes)
    }

    #[test]
    fn classes_parse_value_colon_share() {
        let c = PriorityClass::parse("-1:0.5").unwrap();
        assert_eq!((c.value, c.share), (-1, 0.5));
        assert_eq!(c.to_string(), "-1:0.5");
        assert_eq!(
            PriorityClass::parse(" 7 : 1 ").unwrap(),
            PriorityClass {
                value: 7,
                share: 1.0
            }
        );
        assert_eq!(PriorityClass::parse("0:1e-3").unwrap().share, 0.001);
    }

    #[test]
    fn bad_classes_say_what_is_wrong() {
        for text in ["", "1", "0.5", ":0.5", "1:", "1:0.2:3"] {
            let err = PriorityClass::parse(text).unwrap_err();
            // "1:0.2:3" splits at the first colon: its share `0.2:3` is not a number.
            assert!(
                matches!(err, PriorityError::Syntax(_) | PriorityError::Share(_)),
                "{text}: {err:?}"
            );
        }
        assert!(PriorityClass::parse("1")
            .unwrap_err()
            .to_string()
            .contains("VALUE:SHARE"));
        for text in ["high:0.5", "1.5:0.5", "99999999999999999999:0.5"] {
            assert!(
                matches!(PriorityClass::parse(text), Err(PriorityError::Value(_))),
                "{text}"
            );
        }
        for text in ["1:0", "1:-0.5", "1:1.5", "1:NaN", "1:inf", "1:half"] {
            let err = PriorityClass::parse(text).unwrap_err();
            assert!(matches!(err, PriorityError::Share(_)), "{text}: {err:?}");
            assert!(err.to_string().contains("(0, 1]"), "{err}");
        }
    }

    #[test]
    fn mixes_reject_duplicates_and_shares_over_one() {
        assert_eq!(
            mix(&["-1:0.5", "3:0.2", "-1:0.1"]).unwrap_err(),
            PriorityError::Duplicate(-1)
        );
        let err = mix(&["-1:0.1", "0:0.2", "1:0.9"]).unwrap_err();
        assert!(matches!(err, PriorityError::SharesOverOne(_)), "{err:?}");
        assert!(err.to_string().contains("sum to 1.2, more than 1"), "{err}");
        // Rounding is no excess: ten tenths are a whole.
        let tenths: Vec<String> = (0..10).map(|v| format!("{v}:0.1")).collect();
        let tenths: Vec<&str> = tenths.iter().map(String::as_str).collect();
        assert_eq!(mix(&tenths).unwrap().remainder(), 0.0);
        let half = mix(&["-1:0.25", "0:0.25"]).unwrap();
        assert_eq!(half.remainder(), 0.5);
        assert!(PriorityMix::new(Vec::new()).unwrap().is_empty());
    }

    #[test]
    fn assignment_follows_the_shares_and_the_seed() {
        const DRAWS: u64 = 10_000;
        let m = mix(&["-1:0.5", "5:0.2"]).unwrap();
        let count = |seed: u64, class: Option<i64>| {
            (0..DRAWS).filter(|&i| m.class_of(seed, i) == class).count() as f64 / DRAWS as f64
        };
        for seed in [0, 1, 42] {
            // Binomial sd at 10k draws is at most 0.005: 0.02 is four of them.
            for (class, share) in [(Some(-1), 0.5), (Some(5), 0.2), (None, 0.3)] {
                let got = count(seed, class);
                assert!((got - share).abs() < 0.02, "seed {seed} {class:?}: {got}");
            }
        }
        let assignment = |seed: u64| (0..DRAWS).map(|i| m.class_of(seed, i)).collect::<Vec<_>>();
        assert_eq!(assignment(7), assignment(7), "same seed, same classes");
        assert_ne!(assignment(7), assignment(8), "the seed matters");
        // A request's class does not depend on which others were drawn before it.
        assert_eq!(m.class_of(7, 1234), assignment(7)[1234]);
        // Shares summing to 1 leave nobody without a class.
        let whole = mix(&["-1:0.5", "0:0.5"]).unwrap();
        assert!((0..DRAWS).all(|i| whole.class_of(3, i).is_some()));
        assert!((0..100).all(|i| PriorityMix::default().class_of(3, i).is_none()));
    }

    #[test]
    fn probe_prefers_a_non_zero_priority_and_bodies_carry_the_field() {
        assert_eq!(mix(&["0:0.5", "-1:0.5"]).unwrap().probe_class(), Some(-1));
        assert_eq!(mix(&["0:0.5"]).unwrap().probe_class(), Some(0));
        assert_eq!(PriorityMix::default().probe_class(), None);
        assert_eq!(body_fields(Some(-1))["priority"], -1);
        assert!(body_fields(None).is_empty());
    }
}
