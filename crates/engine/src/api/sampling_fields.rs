//! The sampling fields of a request (temperature, top-p, top-k, min-p, the penalties and
//! `logit_bias`), checked with vLLM's ranges and turned into [`SamplingParams`].

use pdserve_protocol::{ApiError, GenerationParams};

use crate::sampling::SamplingParams;
use crate::serving::ModelLimits;

fn invalid(param: &str, message: String) -> ApiError {
    ApiError::bad_request(message).with_param(param)
}

/// `value` (default `default`) checked to be a finite number in `range`.
fn in_range(
    param: &str,
    value: Option<f64>,
    default: f64,
    range: std::ops::RangeInclusive<f64>,
) -> Result<f32, ApiError> {
    let v = value.unwrap_or(default);
    if !v.is_finite() || !range.contains(&v) {
        return Err(invalid(
            param,
            format!(
                "{param} must be in [{}, {}], got {v}",
                range.start(),
                range.end()
            ),
        ));
    }
    Ok(v as f32)
}

/// The sampling fields of `params`, checked with vLLM's ranges.
pub fn sampling_params(
    params: &GenerationParams,
    limits: &ModelLimits,
) -> Result<SamplingParams, ApiError> {
    let temperature = params.temperature.unwrap_or(1.0);
    if !temperature.is_finite() || temperature < 0.0 {
        return Err(invalid(
            "temperature",
            format!("temperature must be a non-negative number, got {temperature}"),
        ));
    }
    let top_p = params.top_p.unwrap_or(1.0);
    if !(top_p > 0.0 && top_p <= 1.0) {
        return Err(invalid(
            "top_p",
            format!("top_p must be in (0, 1], got {top_p}"),
        ));
    }
    let top_k = match params.top_k.unwrap_or(0) {
        -1 | 0 => 0,
        k if k > 0 => k as usize,
        k => {
            return Err(invalid(
                "top_k",
                format!("top_k must be -1 (disabled) or at least 1, got {k}"),
            ))
        }
    };
    let presence_penalty = in_range("presence_penalty", params.presence_penalty, 0.0, -2.0..=2.0)?;
    let frequency_penalty = in_range(
        "frequency_penalty",
        params.frequency_penalty,
        0.0,
        -2.0..=2.0,
    )?;
    let min_p = in_range("min_p", params.min_p, 0.0, 0.0..=1.0)?;
    let repetition_penalty = params.repetition_penalty.unwrap_or(1.0);
    if !(repetition_penalty.is_finite() && repetition_penalty > 0.0) {
        return Err(invalid(
            "repetition_penalty",
            format!("repetition_penalty must be greater than zero, got {repetition_penalty}"),
        ));
    }
    let mut logit_bias = Vec::new();
    for (key, &bias) in params.logit_bias.iter().flatten() {
        let id = match key.trim().parse::<u32>() {
            Ok(id) if (id as usize) < limits.vocab_size => id,
            Ok(id) => {
                return Err(invalid(
                    "logit_bias",
                    format!(
                        "token id {id} in logit_bias is out of range (vocabulary size {})",
                        limits.vocab_size
                    ),
                ))
            }
            Err(_) => {
                return Err(invalid(
                    "logit_bias",
                    format!("logit_bias keys must be token ids, got {key:?}"),
                ))
            }
        };
        if !bias.is_finite() {
            return Err(invalid(
                "logit_bias",
                format!("logit_bias values must be numbers, got {bias} for token {id}"),
            ));
        }
        // As OpenAI (and vLLM): values beyond +-100 act as +-100.
        logit_bias.push((id, bias.clamp(-100.0, 100.0) as f32));
    }
    Ok(SamplingParams {
        temperature,
        top_p,
        top_k,
        // Negative seeds are accepted (as by vLLM) and used bit for bit.
        seed: params.seed.map(|s| s as u64),
        min_p,
        presence_penalty,
        frequency_penalty,
        // A positive value too small for f32 stays positive.
        repetition_penalty: (repetition_penalty as f32).max(f32::MIN_POSITIVE),
        logit_bias,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use http::StatusCode;

    fn check(params: GenerationParams) -> Result<SamplingParams, ApiError> {
        let limits = ModelLimits {
            served_model_name: "m".into(),
            max_model_len: 100,
            eos_token_ids: vec![2],
            vocab_size: 1000,
        };
        sampling_params(&params, &limits)
    }

    fn param_of(e: ApiError) -> String {
        assert_eq!(e.status, StatusCode::BAD_REQUEST);
        e.body.error.param.unwrap_or_default()
    }

    #[test]
    fn penalties_min_p_and_logit_bias_are_checked_with_vllm_ranges() {
        let p = GenerationParams::default;
        let r = check(GenerationParams {
            presence_penalty: Some(-2.0),
            frequency_penalty: Some(2.0),
            repetition_penalty: Some(1.3),
            min_p: Some(1.0),
            logit_bias: Some(
                [("7".to_string(), -300.0), ("9".to_string(), 5.5)]
                    .into_iter()
                    .collect(),
            ),
            ..p()
        })
        .unwrap();
        assert_eq!(
            (
                r.presence_penalty,
                r.frequency_penalty,
                r.repetition_penalty,
                r.min_p
            ),
            (-2.0, 2.0, 1.3, 1.0)
        );
        assert_eq!(
            r.logit_bias,
            vec![(7, -100.0), (9, 5.5)],
            "clamped to +-100"
        );
        let d = check(p()).unwrap();
        assert_eq!(d, SamplingParams::default(), "absent fields change nothing");
        for (params, field) in [
            (
                GenerationParams {
                    presence_penalty: Some(2.01),
                    ..p()
                },
                "presence_penalty",
            ),
            (
                GenerationParams {
                    frequency_penalty: Some(-3.0),
                    ..p()
                },
                "frequency_penalty",
            ),
            (
                GenerationParams {
                    frequency_penalty: Some(1e39),
                    ..p()
                },
                "frequency_penalty",
            ),
            (
                GenerationParams {
                    repetition_penalty: Some(0.0),
                    ..p()
                },
                "repetition_penalty",
            ),
            (
                GenerationParams {
                    min_p: Some(1.5),
                    ..p()
                },
                "min_p",
            ),
            (
                GenerationParams {
                    min_p: Some(-0.1),
                    ..p()
                },
                "min_p",
            ),
            (
                GenerationParams {
                    temperature: Some(f32::INFINITY),
                    ..p()
                },
                "temperature",
            ),
            (
                GenerationParams {
                    top_p: Some(f32::INFINITY),
                    ..p()
                },
                "top_p",
            ),
            (
                GenerationParams {
                    logit_bias: Some([("1000".to_string(), 1.0)].into_iter().collect()),
                    ..p()
                },
                "logit_bias",
            ),
            (
                GenerationParams {
                    logit_bias: Some([("hello".to_string(), 1.0)].into_iter().collect()),
                    ..p()
                },
                "logit_bias",
            ),
        ] {
            assert_eq!(param_of(check(params).unwrap_err()), field);
        }
    }
}
