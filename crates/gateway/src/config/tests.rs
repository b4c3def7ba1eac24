//! The flags' defaults, checks and resolution.

use super::*;
use clap::Parser;

#[derive(Parser)]
struct Cli {
    #[command(flatten)]
    args: GatewayArgs,
}

#[test]
fn defaults_and_repeated_pools() {
    let cli = Cli::parse_from([
        "x",
        "--prefill",
        "http://127.0.0.1:1/",
        "--prefill",
        "http://127.0.0.1:2",
        "--decode",
        "http://127.0.0.1:3",
        "--conversation-ttl-secs",
        "0.5",
    ]);
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cli.args.port, 8000);
    assert_eq!(cli.args.host, "127.0.0.1");
    assert_eq!(cli.args.listen_addr(), "127.0.0.1:8000");
    let v6 = Cli::parse_from(["x", "--host", "::1", "--port", "9"]);
    assert_eq!(v6.args.listen_addr(), "[::1]:9");
    assert_eq!(cfg.prefill.len(), 2);
    assert_eq!(cfg.max_retries, 2);
    assert_eq!(cfg.health.breaker.failure_threshold, 5);
    assert_eq!(cfg.conversation_ttl, Duration::from_millis(500));
    assert!(cfg.upstream_idle_timeout < Duration::from_secs(5));
    assert_eq!(cfg.prefill[0].as_str(), "http://127.0.0.1:1/");
}

#[test]
fn rejects_half_a_disaggregated_pair_and_bad_urls() {
    let cli = Cli::parse_from(["x", "--prefill", "http://127.0.0.1:1"]);
    assert!(cli.args.to_config().is_err());
    let cli = Cli::parse_from(["x", "--worker", "ftp://h"]);
    assert!(cli.args.to_config().is_err());
    let cli = Cli::parse_from(["x", "--worker", "http://127.0.0.1:9"]);
    assert!(cli.args.to_config().is_ok());
    let cli = Cli::parse_from([
        "x",
        "--worker",
        "http://127.0.0.1:9",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:2",
    ]);
    assert!(
        cli.args.to_config().is_err(),
        "prefill_decode mixed with P/D"
    );
}

#[test]
fn encoders_join_either_topology() {
    let cli = Cli::parse_from([
        "x",
        "--encode",
        "http://127.0.0.1:7",
        "--encode",
        "http://127.0.0.1:8",
        "--worker",
        "http://127.0.0.1:9",
        "--encoder-max-batch-size",
        "4",
        "--no-rewrite",
    ]);
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cfg.encode.len(), 2);
    assert_eq!((cfg.encoder_max_batch_size, cfg.no_rewrite), (4, true));
    let roles: Vec<_> = cfg.static_workers().map(|s| s.role).collect();
    assert_eq!(
        roles,
        [
            WorkerRole::PrefillDecode,
            WorkerRole::Encode,
            WorkerRole::Encode
        ]
    );
    let defaults = Cli::parse_from(["x", "--worker", "http://127.0.0.1:9"]);
    let cfg = defaults.args.to_config().unwrap();
    assert_eq!((cfg.encoder_max_batch_size, cfg.no_rewrite), (0, false));
    assert_eq!(
        defaults.args.max_retries, 2,
        "--decode-retries is its alias"
    );
    let alone = Cli::parse_from(["x", "--encode", "http://127.0.0.1:7"]);
    assert!(alone.args.to_config().is_err(), "encoders need a consumer");
    let alias = Cli::parse_from(["x", "--decode-retries", "1"]);
    assert_eq!(alias.args.max_retries, 1);
}

#[test]
fn sglang_router_flags() {
    let cli = Cli::parse_from([
        "x",
        "--pd-disaggregation",
        "--prefill",
        "http://127.0.0.1:1",
        "8998",
        "--prefill",
        "http://127.0.0.1:2",
        "--prefill",
        "http://127.0.0.1:3",
        "none",
        "--decode",
        "http://127.0.0.1:4",
        "--policy",
        "cache_aware",
    ]);
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cfg.protocol, Protocol::Sglang);
    assert_eq!(cfg.prefill.len(), 3);
    assert_eq!(cfg.prefill_bootstrap_ports, [Some(8998), None, None]);
    let ports: Vec<_> = cfg
        .static_workers()
        .filter(|s| s.role == WorkerRole::Prefill)
        .map(|s| s.bootstrap_port)
        .collect();
    assert_eq!(ports, [Some(8998), None, None]);
    // vLLM mode stays the default, and comma-separated pools still split.
    let cli = Cli::parse_from([
        "x",
        "--prefill",
        "http://127.0.0.1:1,http://127.0.0.1:2",
        "--decode",
        "http://127.0.0.1:4",
    ]);
    let cfg = cli.args.to_config().unwrap();
    assert_eq!((cfg.protocol, cfg.prefill.len()), (Protocol::Vllm, 2));
    let cli = Cli::parse_from([
        "x",
        "--pd-disaggregation",
        "--protocol",
        "vllm",
        "--prefill",
        "http://127.0.0.1:1",
        "--decode",
        "http://127.0.0.1:4",
    ]);
    assert_eq!(cli.args.to_config().unwrap().protocol, Protocol::Vllm);
    let cli = Cli::parse_from([
        "x",
        "--worker-urls",
        "http://127.0.0.1:1",
        "http://127.0.0.1:2",
    ]);
    assert_eq!(cli.args.to_config().unwrap().worker.len(), 2);
    for bad in [
        vec!["x", "--pd-disaggregation", "--decode", "http://127.0.0.1:4"],
        vec!["x", "--prefill", "8998", "--decode", "http://127.0.0.1:4"],
        vec![
            "x",
            "--prefill",
            "http://127.0.0.1:1",
            "70000",
            "--decode",
            "http://127.0.0.1:4",
        ],
    ] {
        let cli = Cli::parse_from(bad.clone());
        assert!(cli.args.to_config().is_err(), "{bad:?}");
    }
}

#[test]
fn dynamic_registration_needs_an_admin_key() {
    let cli = Cli::parse_from(["x", "--dynamic-registration", "--admin-api-key", ""]);
    assert!(cli.args.to_config().is_err());
    let cli = Cli::parse_from([
        "x",
        "--dynamic-registration",
        "--admin-api-key",
        "k",
        "--prefill",
        "http://127.0.0.1:1",
    ]);
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cfg.admin_api_key.as_deref(), Some("k"));
    assert_eq!(cfg.health.fail_threshold, 3);
    assert_eq!(cfg.health.evicted_ttl, Some(Duration::from_secs(900)));
    assert_eq!(cfg.probe.interval, Duration::from_secs(5));
    let cli = Cli::parse_from(["x", "--admin-api-key", "k", "--evicted-ttl", "0"]);
    let cfg = cli.args.to_config().unwrap();
    assert!(
        cfg.admin_api_key.is_none(),
        "admin routes stay closed without the flag"
    );
    assert!(cfg.health.evicted_ttl.is_none());
    assert!(Cli::try_parse_from(["x", "--fail-threshold", "0"]).is_err());
    assert!(Cli::try_parse_from(["x", "--policy", "nope"]).is_err());
    let cli = Cli::parse_from([
        "x",
        "--decode-policy",
        "cache_aware",
        "--cache-threshold",
        "0.3",
    ]);
    let cfg = cli.args.to_config().unwrap();
    assert_eq!(cfg.decode_policy.as_deref(), Some("cache_aware"));
    assert_eq!(cfg.policy_config.cache_threshold, 0.3);
    for bad in [
        ["--cache-threshold", "1.5"],
        ["--session-fallback", "session"],
        ["--max-tree-size", "0"],
    ] {
        let cli = Cli::parse_from(["x", bad[0], bad[1]]);
        assert!(cli.args.to_config().is_err(), "{bad:?}");
    }
}
