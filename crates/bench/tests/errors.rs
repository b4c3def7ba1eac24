//! Clear errors: unreachable server, non-OpenAI server, a server that never answers,
//! and bad flags.

mod support;

use std::time::Duration;

use axum::http::StatusCode;
use pdserve_bench::serve::run_serve;
use pdserve_bench::BenchError;
use support::scripted_server::ScriptedServer;
use support::{never, parse, serve_args, TEST_LIMIT};
use tokio::net::TcpListener;
use tokio::time::timeout;

/// A port on 127.0.0.1 that nothing listens on (bound, then released).
async fn closed_port() -> u16 {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    listener.local_addr().expect("addr").port()
}

#[tokio::test]
async fn unreachable_server_is_a_clear_error() {
    let url = format!("http://127.0.0.1:{}", closed_port().await);
    for extra in [&[][..], &["--model", "m"][..]] {
        let mut flags = vec![
            "--url",
            url.as_str(),
            "--concurrency",
            "1",
            "--connect-timeout-s",
            "2",
        ];
        flags.extend_from_slice(extra);
        let err = timeout(TEST_LIMIT, run_serve(&serve_args(&flags), never()))
            .await
            .expect("bounded")
            .unwrap_err();
        assert!(matches!(err, BenchError::Unreachable { .. }), "{err:?}");
        let text = err.to_string();
        assert!(
            text.contains("cannot reach") && text.contains(&url),
            "{text}"
        );
    }
}

#[tokio::test]
async fn html_server_is_not_openai() {
    for status in [StatusCode::OK, StatusCode::NOT_FOUND] {
        html_server_case(status).await;
    }
}

async fn html_server_case(status: StatusCode) {
    let server = ScriptedServer::start_html(status).await;
    let url = server.url();
    for extra in [&[][..], &["--model", "m"][..]] {
        let mut flags = vec!["--url", url.as_str(), "--concurrency", "1"];
        flags.extend_from_slice(extra);
        let err = timeout(TEST_LIMIT, run_serve(&serve_args(&flags), never()))
            .await
            .expect("bounded")
            .unwrap_err();
        assert!(
            matches!(err, BenchError::NotOpenAi { .. }),
            "{status}: {err:?}"
        );
        let text = err.to_string();
        assert!(
            text.contains("not an OpenAI-compatible API") && text.contains("text/html"),
            "{text}"
        );
    }
    server.stop().await;
}

#[tokio::test]
async fn silent_server_times_out_within_the_request_timeout() {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let url = format!("http://{}", listener.local_addr().expect("addr"));
    // Accept connections and hold them without ever answering.
    let holder = tokio::spawn(async move {
        let mut held = Vec::new();
        while let Ok((socket, _)) = listener.accept().await {
            held.push(socket);
        }
    });
    let args = serve_args(&[
        "--url",
        &url,
        "--model",
        "m",
        "--concurrency",
        "1",
        "--request-timeout-s",
        "0.5",
    ]);
    let begun = std::time::Instant::now();
    let err = timeout(TEST_LIMIT, run_serve(&args, never()))
        .await
        .expect("bounded")
        .unwrap_err();
    holder.abort();
    assert!(begun.elapsed() < Duration::from_secs(5));
    assert!(matches!(err, BenchError::ProbeFailed { .. }), "{err:?}");
    assert!(err.to_string().contains("timed out after 0.5 s"), "{err}");
}

#[test]
fn flags_are_validated() {
    let url = "http://127.0.0.1:1";
    // An SLO flag needs a value.
    let err = parse(&["serve", "--url", url, "--concurrency", "1", "--slo-ttft-ms"]).unwrap_err();
    assert!(err.to_string().contains("--slo-ttft-ms"), "{err}");
    let err = parse(&[
        "serve",
        "--url",
        url,
        "--concurrency",
        "1",
        "--slo-tpot-ms=-3",
    ])
    .unwrap_err();
    assert!(err.to_string().contains("positive"), "{err}");
    // Exactly one of --concurrency and --request-rate.
    assert!(parse(&["serve", "--url", url]).is_err());
    assert!(parse(&[
        "serve",
        "--url",
        url,
        "--concurrency",
        "2",
        "--request-rate",
        "3"
    ])
    .is_err());
    assert!(parse(&["serve", "--url", url, "--request-rate", "0"]).is_err());
    assert!(parse(&["serve", "--url", url, "--request-rate", "inf"]).is_err());
    assert!(parse(&["serve", "--url", url, "--concurrency", "0"]).is_err());
    assert!(parse(&[
        "serve",
        "--url",
        url,
        "--concurrency",
        "1",
        "--range-ratio",
        "1.5"
    ])
    .is_err());
    assert!(parse(&[
        "serve",
        "--url",
        url,
        "--concurrency",
        "1",
        "--endpoint",
        "embeddings"
    ])
    .is_err());
    assert!(parse(&[
        "serve",
        "--url",
        url,
        "--request-rate",
        "2.5",
        "--endpoint",
        "chat"
    ])
    .is_ok());
    assert!(parse(&["compare"]).is_err(), "compare needs files");
    // `--priority`: negative values are values, and the shares are checked together.
    let prioritized = &[
        "serve",
        "--url",
        url,
        "--concurrency",
        "1",
        "--priority",
        "-1:0.5",
        "--priority",
        "0:0.5",
    ];
    assert!(parse(prioritized).is_ok());
    let mut twice = prioritized.to_vec();
    twice.extend(["--priority", "0:0.1"]);
    let err = parse(&twice).unwrap_err().to_string();
    assert!(
        err.contains("--priority") && err.contains("given twice"),
        "{err}"
    );
    let err = parse(&[
        "serve",
        "--url",
        url,
        "--concurrency",
        "1",
        "--priority",
        "x",
    ])
    .unwrap_err()
    .to_string();
    assert!(err.contains("VALUE:SHARE"), "{err}");
}

#[tokio::test]
async fn bad_url_is_rejected_before_any_request() {
    let err = run_serve(
        &serve_args(&["--url", "localhost:8000", "--concurrency", "1"]),
        never(),
    )
    .await
    .unwrap_err();
    assert!(matches!(err, BenchError::BadUrl { .. }), "{err:?}");
}
