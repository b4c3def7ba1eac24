//! Flag values and flag sets checked beyond what clap checks: number parsers with
//! ranges, and `checked_args!` for a set of flags whose values are checked together.

/// `Args` and `FromArgMatches` for `$checked`, a flag set whose values are checked
/// together: clap parses `$flags`, then `$checked::checked` turns them into the value
/// (or a usage error) and `$checked::flags` back, so update-from-matches re-checks.
macro_rules! checked_args {
    ($checked:ty, $flags:ty) => {
        impl FromArgMatches for $checked {
            fn from_arg_matches(matches: &clap::ArgMatches) -> Result<Self, clap::Error> {
                Self::checked(<$flags>::from_arg_matches(matches)?)
            }

            fn from_arg_matches_mut(matches: &mut clap::ArgMatches) -> Result<Self, clap::Error> {
                Self::checked(<$flags>::from_arg_matches_mut(matches)?)
            }

            fn update_from_arg_matches(
                &mut self,
                matches: &clap::ArgMatches,
            ) -> Result<(), clap::Error> {
                let mut flags = self.flags();
                flags.update_from_arg_matches(matches)?;
                *self = Self::checked(flags)?;
                Ok(())
            }

            fn update_from_arg_matches_mut(
                &mut self,
                matches: &mut clap::ArgMatches,
            ) -> Result<(), clap::Error> {
                let mut flags = self.flags();
                flags.update_from_arg_matches_mut(matches)?;
                *self = Self::checked(flags)?;
                Ok(())
            }
        }

        impl Args for $checked {
            fn group_id() -> Option<clap::Id> {
                <$flags>::group_id()
            }

            fn augment_args(cmd: clap::Command) -> clap::Command {
                <$flags>::augment_args(cmd)
            }

            fn augment_args_for_update(cmd: clap::Command) -> clap::Command {
                <$flags>::augment_args_for_update(cmd)
            }
        }
    };
}

/// Used by `args` and `load`.
pub(crate) use checked_args;

pub(crate) fn parse_f64(s: &str) -> Result<f64, String> {
    s.trim()
        .parse::<f64>()
        .map_err(|e| format!("`{s}` is not a number: {e}"))
}

pub(crate) fn positive_finite(s: &str, what: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if v.is_finite() && v > 0.0 {
        Ok(v)
    } else {
        Err(format!(
            "{what} must be a positive, finite number, got `{s}`"
        ))
    }
}

pub(crate) fn positive_seconds(s: &str) -> Result<f64, String> {
    positive_finite(s, "a timeout in seconds")
}

pub(crate) fn positive_ms(s: &str) -> Result<f64, String> {
    positive_finite(s, "an SLO in milliseconds")
}

pub(crate) fn positive_rate(s: &str) -> Result<f64, String> {
    positive_finite(s, "a request rate (use --concurrency for all-at-once)")
}

pub(crate) fn range_ratio(s: &str) -> Result<f64, String> {
    let v = parse_f64(s)?;
    if (0.0..1.0).contains(&v) {
        Ok(v)
    } else {
        Err(format!("the range ratio must be in [0, 1), got `{s}`"))
    }
}
