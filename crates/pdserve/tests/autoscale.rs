//! `pdserve up --autoscale` on a simulated fleet: requests that miss their TTFT objective
//! make the gateway's planner ask for a larger pool and the stack starts a worker (up to
//! `--max-workers`); once the objectives are met again with room to spare, it drains a
//! worker and stops it, and no request fails while it does.

use std::time::{Duration, Instant};

use serde_json::{json, Value};

#[path = "support/up.rs"]
mod up;

use up::Up;

/// Live prefill and decode workers as the gateway's `/instances` lists them.
async fn live(http: &reqwest::Client, entry: &str) -> (usize, usize) {
    let roster: Value = http
        .get(format!("{entry}/instances"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    let count = |role: &str| roster[role]["live"].as_array().map_or(0, Vec::len);
    (count("prefill"), count("decode"))
}

/// Polls until the live counts add up to `total`, for at most `limit`.
async fn wait_for_total(
    http: &reqwest::Client,
    entry: &str,
    total: usize,
    limit: Duration,
) -> (usize, usize) {
    let deadline = Instant::now() + limit;
    loop {
        let (p, d) = live(http, entry).await;
        if p + d == total || Instant::now() > deadline {
            return (p, d);
        }
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

/// A streamed completion of a prompt long enough to take the prefill leg.
fn request(i: usize) -> Value {
    let prompt: String = (0..600).map(|w| format!("a{i}b{w} ")).collect();
    json!({"prompt": prompt, "max_tokens": 6, "temperature": 0, "stream": true})
}

/// Sends `n` requests, four at a time, each with `headers`; every one must succeed.
async fn send(http: &reqwest::Client, entry: &str, from: usize, n: usize, slo: Option<&str>) {
    for round in (from..from + n).step_by(4) {
        let mut sends = tokio::task::JoinSet::new();
        for i in round..(round + 4).min(from + n) {
            let mut post = http
                .post(format!("{entry}/v1/completions"))
                .json(&request(i));
            if let Some(ttft) = slo {
                post = post.header("x-slo-ttft-ms", ttft);
            }
            sends.spawn(async move {
                let response = post.send().await.unwrap();
                let status = response.status();
                let body = response.text().await.unwrap();
                assert_eq!(status, 200, "{body}");
                assert!(body.contains("[DONE]"), "{body}");
            });
        }
        while let Some(sent) = sends.join_next().await {
            sent.unwrap();
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stack_grows_a_pool_the_planner_asks_for_and_drains_one_it_does_not_need() {
    let model = pdserve_model::ensure_default_model(&pdserve_model::home_dir()).unwrap();
    let up = Up::start(
        &model,
        &[
            "--sim",
            "h100-llama-3.1-8b",
            "--prefill",
            "1",
            "--decode",
            "1",
            "--policy",
            "slo",
            "--autoscale",
            "--max-workers",
            "3",
            "--autoscale-interval-secs",
            "0.5",
            "--autoscale-cooldown-secs",
            "1",
            "--gateway-arg=--planner-interval-secs",
            "--gateway-arg=0.5",
            "--gateway-arg=--planner-window-secs",
            "--gateway-arg=3",
            // The pools' targets: loose, so that one worker fewer is clearly enough
            // once the misses are gone, however slow this machine.
            "--gateway-arg=--slo-ttft-ms",
            "--gateway-arg=5000",
        ],
    );
    tokio::time::timeout(Duration::from_secs(240), async {
        let http = reqwest::Client::builder().no_proxy().build().unwrap();
        assert_eq!(live(&http, &up.entry).await, (1, 1));
        // An objective nothing meets: the planner asks for more, the stack starts one
        // worker (then --max-workers stops it). The predictor trains meanwhile.
        send(&http, &up.entry, 0, 72, Some("0.5")).await;
        let grown = wait_for_total(&http, &up.entry, 3, Duration::from_secs(30)).await;
        assert_eq!(grown.0 + grown.1, 3, "{grown:?}; {}", up.log_tail());
        let plan: Value = http
            .get(format!("{}/planner", up.entry))
            .send()
            .await
            .unwrap()
            .json()
            .await
            .unwrap();
        eprintln!("grown to {grown:?}; /planner: {plan}");
        // Objectives met (the gateway's loose one) with room to spare: the grown pool is
        // drained back to one worker, serving throughout.
        let traffic = {
            let (http, entry) = (http.clone(), up.entry.clone());
            tokio::spawn(async move {
                for k in 0..10 {
                    send(&http, &entry, 1000 + 8 * k, 8, None).await;
                    tokio::time::sleep(Duration::from_millis(300)).await;
                }
            })
        };
        let shrunk = wait_for_total(&http, &up.entry, 2, Duration::from_secs(60)).await;
        assert_eq!(shrunk, (1, 1), "{}", up.log_tail());
        traffic
            .await
            .expect("every request during the drain succeeded");
        send(&http, &up.entry, 5000, 4, None).await;
    })
    .await
    .expect("the test ran past its time limit");
    up.stop();
}
