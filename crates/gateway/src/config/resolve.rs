//! The flags checked and resolved into a [`GatewayConfig`].

use reqwest::Url;

use crate::error::GatewayError;
use crate::fleet::registry::probe::ProbeSettings;
use crate::fleet::registry::{parse_worker_url, BreakerSettings, HealthPolicy};
use crate::policy::PolicyConfig;

use super::{GatewayArgs, GatewayConfig, Protocol};

/// Splits `--prefill` values into URLs, each with the bootstrap port that follows it
/// (a number or `none`), as SGLang's router reads `--prefill URL [BOOTSTRAP_PORT]`.
pub fn split_prefill_values(raw: &[String]) -> Result<Vec<(String, Option<u16>)>, GatewayError> {
    let mut out: Vec<(String, Option<u16>)> = Vec::new();
    for value in raw.iter().map(|s| s.trim()).filter(|s| !s.is_empty()) {
        let port = if value.eq_ignore_ascii_case("none") {
            Some(None)
        } else if value.bytes().all(|b| b.is_ascii_digit()) {
            match value.parse::<u16>() {
                Ok(p) if p > 0 => Some(Some(p)),
                _ => {
                    return Err(GatewayError::Config(format!(
                        "--prefill bootstrap port `{value}` is not a port number (1-65535)"
                    )))
                }
            }
        } else {
            None
        };
        match (port, out.last_mut()) {
            (None, _) => out.push((value.to_string(), None)),
            (Some(port), Some(last)) => last.1 = port,
            (Some(_), None) => {
                return Err(GatewayError::Config(format!(
                    "--prefill `{value}`: a bootstrap port must follow a URL"
                )))
            }
        }
    }
    Ok(out)
}

impl GatewayArgs {
    /// Validates the flags into a runtime configuration.
    pub fn to_config(&self) -> Result<GatewayConfig, GatewayError> {
        let urls = |flag: &str, raw: &[String]| -> Result<Vec<Url>, GatewayError> {
            raw.iter()
                .filter(|s| !s.trim().is_empty())
                .map(|s| parse_worker_url(flag, s))
                .collect()
        };
        let discovery = self.discovery.to_config()?;
        // With registration or discovery on, workers may join after start.
        let joins_later = self.dynamic_registration || discovery.any();
        let prefill_values = split_prefill_values(&self.prefill)?;
        let prefill = prefill_values
            .iter()
            .map(|(url, _)| parse_worker_url("--prefill", url))
            .collect::<Result<Vec<_>, _>>()?;
        let decode = urls("--decode", &self.decode)?;
        let mut worker = urls("--worker", &self.worker)?;
        worker.extend(urls("--worker-urls", &self.worker_urls)?);
        if self.pd_disaggregation && (prefill.is_empty() || decode.is_empty()) && !joins_later {
            return Err(GatewayError::Config(
                "--pd-disaggregation needs at least one --prefill and one --decode worker".into(),
            ));
        }
        let protocol = self.protocol.unwrap_or(if self.pd_disaggregation {
            Protocol::Sglang
        } else {
            Protocol::Vllm
        });
        let encode = urls("--encode", &self.encode)?;
        let split = !prefill.is_empty() || !decode.is_empty();
        if !worker.is_empty() && split {
            return Err(GatewayError::Config(
                "--worker (prefill_decode) workers cannot be mixed with --prefill/--decode workers"
                    .into(),
            ));
        }
        // With registration or discovery on, the missing half of a pair may join later.
        if prefill.is_empty() != decode.is_empty() && !joins_later {
            return Err(GatewayError::Config(
                "prefill/decode disaggregation needs at least one --prefill and one --decode worker \
                 (or give --worker for aggregated serving)"
                    .into(),
            ));
        }
        if !encode.is_empty() && prefill.is_empty() && worker.is_empty() && !joins_later {
            return Err(GatewayError::Config(
                "--encode workers need --prefill/--decode or --worker workers to serve the \
                 encoded requests"
                    .into(),
            ));
        }
        let admin_api_key = self.admin_api_key.clone().filter(|k| !k.is_empty());
        if self.dynamic_registration && admin_api_key.is_none() {
            return Err(GatewayError::Config(
                "--dynamic-registration needs an admin key: set ADMIN_API_KEY (or --admin-api-key)"
                    .into(),
            ));
        }
        let policy_config = PolicyConfig {
            cache_threshold: self.cache_threshold,
            balance_abs_threshold: self.balance_abs_threshold,
            balance_rel_threshold: self.balance_rel_threshold,
            max_tree_size: self.max_tree_size,
            session_fallback: self.session_fallback.clone(),
            queue_cost: self.cache_queue_cost,
            precise_load_cost: self.precise_load_cost,
            cache_source: self.cache_source,
        };
        policy_config.validate().map_err(GatewayError::Config)?;
        for (flag, key) in [
            ("--api-key", &self.api_key),
            ("--worker-api-key", &self.worker_api_key),
            ("--kv-secret", &self.kv_secret),
        ] {
            if let Some(key) = key {
                if http::HeaderValue::from_str(&format!("Bearer {key}")).is_err() {
                    return Err(GatewayError::Config(format!(
                        "{flag} must be printable ASCII (it travels in an HTTP header)"
                    )));
                }
            }
        }
        if self.header_read_timeout_secs.is_zero() || self.body_read_timeout_secs.is_zero() {
            return Err(GatewayError::Config(
                "--header-read-timeout-secs and --body-read-timeout-secs must be positive".into(),
            ));
        }
        if self.probe_timeout.is_zero() {
            return Err(GatewayError::Config(
                "--probe-timeout must be positive".into(),
            ));
        }
        if self.max_body_bytes == 0 {
            return Err(GatewayError::Config(
                "--max-body-bytes must be positive".into(),
            ));
        }
        Ok(GatewayConfig {
            prefill,
            decode,
            worker,
            encode,
            encoder_max_batch_size: self.encoder_max_batch_size,
            no_rewrite: self.no_rewrite,
            max_body_bytes: self.max_body_bytes,
            max_retries: self.max_retries,
            disagg_threshold: self.disagg_threshold,
            disagg_min_prefill_load: self.disagg_min_prefill_load,
            expose_routing: self.expose_routing,
            prefill_timeout: self.prefill_timeout_secs,
            decode_timeout: self.decode_timeout_secs,
            stream_idle_timeout: self.stream_idle_timeout_secs,
            conversation_ttl: self.conversation_ttl_secs,
            max_conversations: self.max_conversations,
            max_concurrent_requests: self.max_concurrent_requests,
            queue_size: self.queue_size,
            queue_timeout: self.queue_timeout_secs,
            upstream_idle_timeout: self.upstream_idle_timeout_secs,
            connect_timeout: self.connect_timeout_secs,
            policy: self.policy.clone(),
            prefill_policy: self.prefill_policy.clone(),
            decode_policy: self.decode_policy.clone(),
            policy_config,
            // Without dynamic registration the key has no use; admin routes stay closed.
            admin_api_key: admin_api_key.filter(|_| self.dynamic_registration),
            probe: ProbeSettings {
                interval: self.probe_interval,
                timeout: self.probe_timeout,
            },
            allow_gateway_workers: self.allow_gateway_workers,
            load_scrape_interval: self.load_scrape_interval,
            tokenizer: self.tokenizer.clone(),
            tokenizer_cache_bytes: self.tokenizer_cache_bytes,
            discovery,
            kv_events: self.kv_events.to_config()?,
            max_hops: self.max_hops,
            health: HealthPolicy {
                max_workers: self.max_workers as usize,
                fail_threshold: self.fail_threshold,
                evicted_ttl: (!self.evicted_ttl.is_zero()).then_some(self.evicted_ttl),
                breaker: BreakerSettings {
                    failure_threshold: self.cb_failure_threshold,
                    cooldown: self.cb_cooldown_secs,
                },
            },
            shutdown_timeout: self.shutdown_timeout,
            prewarm: self.prewarm,
            protocol,
            prefill_bootstrap_ports: prefill_values.iter().map(|(_, port)| *port).collect(),
            sglang_wait_prefill_head: self.sglang_wait_prefill_head,
            first_token_from_prefill: self.first_token_from_prefill,
            serve: pdserve_http_server::ServeOptions {
                header_read_timeout: self.header_read_timeout_secs,
                body_read_timeout: self.body_read_timeout_secs,
                max_connections: self.max_connections,
            },
            api_key: self.api_key.clone().filter(|k| !k.is_empty()),
            worker_api_key: self.worker_api_key.clone().filter(|k| !k.is_empty()),
            kv_secret: self.kv_secret.clone().filter(|k| !k.is_empty()),
            history: self.history.to_options(),
            slo: crate::ingress::slo::Slo {
                ttft: self.slo_ttft_ms,
                tpot: self.slo_tpot_ms,
            },
            shed_priority: self.shed_priority,
            planner_interval: self.planner_interval_secs,
            planner_window: self.planner_window_secs,
        })
    }
}
