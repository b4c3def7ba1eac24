//! `pdserve bench serve`: send N synthetic requests on a schedule, or replay a trace at
//! its timestamps, and measure them.

use std::future::Future;
use std::time::Duration;

use pdserve_protocol::unix_now;
use serde_json::{Map, Value};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::args::{Dataset, Endpoint, ServeArgs};
use crate::client::{request_body, ApiClient, RequestError, RequestInput};
use crate::dataset::PromptGenerator;
use crate::metrics::{failures, summarize, RequestRecord, Slo};
use crate::priority::body_fields;
use crate::priority_report::per_priority;
use crate::report::{BenchResult, RunConfig, RunKind, SharedPrefixConfig, SCHEMA_VERSION};
use crate::schedule::Dispatcher;
use crate::workload::{Job, Planned, Workload};
use crate::{progress, BenchError};

/// Mixed into the seed for the probe's prompt, so it shares no prefix with the
/// workload (a cached probe would flatter the first request).
const PROBE_SEED_SALT: u64 = 0x9e37_79b9_7f4a_7c15;

/// A short prompt unrelated to the workload, for [`probe`].
pub fn probe_prompt(seed: u64) -> String {
    PromptGenerator::new(seed ^ PROBE_SEED_SALT).words(16)
}

/// `max_tokens` of the probe request (kept tiny: it only proves the server speaks
/// OpenAI streaming before the load starts).
pub const PROBE_MAX_TOKENS: u64 = 1;

/// The model to ask for: `--model`, else the first one the server lists.
pub async fn resolve_model(client: &ApiClient, model: Option<&str>) -> Result<String, BenchError> {
    match model {
        Some(m) => Ok(m.to_string()),
        None => client.first_model().await,
    }
}

/// Sends one small streaming request, with the workload's `extra` body fields, so that
/// an unreachable or non-OpenAI server, or one refusing those fields, is a clear error
/// up front instead of N identical failures.
pub async fn probe(
    client: &ApiClient,
    endpoint: Endpoint,
    model: &str,
    input: RequestInput,
    ignore_eos: bool,
    extra: Map<String, Value>,
) -> Result<(), BenchError> {
    let body = request_body(endpoint, model, input, PROBE_MAX_TOKENS, ignore_eos, extra);
    let url = format!("{}{}", client.base_url(), endpoint.path());
    match client.stream(endpoint, &body).await {
        Ok(_) | Err(RequestError::Empty) => Ok(()),
        Err(RequestError::Connect(reason)) => Err(BenchError::Unreachable {
            url: client.base_url().to_string(),
            reason,
        }),
        Err(RequestError::NotOpenAi(reason)) => Err(BenchError::NotOpenAi { url, reason }),
        Err(e) => Err(BenchError::ProbeFailed {
            url,
            reason: e.to_string(),
        }),
    }
}

/// Runs the benchmark until every request has finished or `shutdown` resolves (then the
/// result holds what finished and is marked interrupted).
pub async fn run_serve(
    args: &ServeArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<BenchResult, BenchError> {
    let clients = ApiClient::replicas(&args.server)?;
    let client = clients[0].clone();
    // The trace is read before the server is asked anything: a bad line is the user's
    // first problem to fix.
    let workload = Workload::load(args)?;
    let model = resolve_model(&client, args.server.model.as_deref()).await?;
    let endpoint = args.endpoint;
    let (jobs, offsets, bodies, planned) = workload.into_jobs(args, &model);
    for replica in &clients {
        probe(
            replica,
            endpoint,
            &model,
            RequestInput::Prompt(probe_prompt(args.seed)),
            bodies.ignore_eos(),
            body_fields(args.priority.probe_class()),
        )
        .await?;
    }
    let mut jobs: Vec<Option<Job>> = jobs.into_iter().map(Some).collect();

    tracing::info!(url = client.base_url(), %model, requests = planned.count, "benchmark starting");
    let started_at_unix_s = unix_now();
    let bar = progress::requests_bar(planned.count);
    let start = Instant::now();
    let dispatcher = match (offsets, args.load.concurrency, args.load.request_rate) {
        (Some(offsets), _, _) => Dispatcher::at(start, offsets),
        (None, _, Some(rate)) => Dispatcher::poisson(jobs.len(), rate, args.seed, start),
        (None, concurrency, None) => Dispatcher::concurrency(concurrency.unwrap_or(1) as usize),
    };
    let mut tasks = JoinSet::new();
    let mut records: Vec<RequestRecord> = Vec::with_capacity(jobs.len());
    let mut failed = 0u64;
    let mut next = 0usize;
    let mut interrupted = false;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        if next >= jobs.len() && tasks.is_empty() {
            break;
        }
        tokio::select! {
            biased;
            () = &mut shutdown => {
                interrupted = true;
                break;
            }
            // Sending comes before collecting answers: in an open loop, a burst of
            // answers must not delay a send that is due.
            permit = dispatcher.ready(next), if next < jobs.len() => {
                let index = next;
                next += 1;
                let Some(job) = jobs[index].take() else {
                    continue;
                };
                let client = clients[index % clients.len()].clone();
                let scheduled = dispatcher.scheduled(index);
                let bodies = bodies.clone();
                tasks.spawn(async move {
                    let _slot = permit;
                    // A trace request's prompt is built here, so its cost shows in the
                    // send lateness instead of hiding from it.
                    let body = bodies.build(index, job.body, job.priority);
                    let sent = start.elapsed();
                    let outcome = client.stream(endpoint, &body).await;
                    let mut record = RequestRecord::new(
                        index as u64,
                        sent,
                        job.prompt_tokens,
                        job.output_tokens,
                        &outcome,
                    );
                    record.priority = job.priority;
                    record.scheduled_s = scheduled.map(|d| d.as_secs_f64());
                    record
                });
            }
            Some(joined) = tasks.join_next(), if !tasks.is_empty() => {
                let record: RequestRecord = joined.map_err(|e| BenchError::Task(e.to_string()))?;
                failed += u64::from(!record.ok);
                progress::record(&bar, failed);
                records.push(record);
            }
        }
    }
    let duration = start.elapsed();
    // On interruption, in-flight requests are dropped (their connections close).
    tasks.abort_all();
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);
    let run = Run {
        started_at_unix_s,
        interrupted,
        duration,
    };
    Ok(assemble(args, model, &clients, run, planned, records))
}

/// When and how long a run went.
struct Run {
    started_at_unix_s: u64,
    interrupted: bool,
    duration: Duration,
}

fn assemble(
    args: &ServeArgs,
    model: String,
    clients: &[ApiClient],
    run: Run,
    planned: Planned,
    records: Vec<RequestRecord>,
) -> BenchResult {
    let slo = Slo {
        ttft_ms: args.slo.slo_ttft_ms,
        tpot_ms: args.slo.slo_tpot_ms,
    };
    let dataset = args.load.dataset;
    BenchResult {
        schema_version: SCHEMA_VERSION,
        kind: RunKind::Serve,
        tool: format!("pdserve-bench {}", env!("CARGO_PKG_VERSION")),
        label: args.output.label.clone().unwrap_or_else(|| model.clone()),
        started_at_unix_s: run.started_at_unix_s,
        interrupted: run.interrupted,
        config: RunConfig {
            url: clients[0].base_url().to_string(),
            urls: clients.iter().map(|c| c.base_url().to_string()).collect(),
            dataset: Some(dataset),
            shared_prefix: (dataset == Dataset::SharedPrefix).then_some(SharedPrefixConfig {
                groups: args.gsp_num_groups,
                prompts_per_group: args.gsp_prompts_per_group,
                system_prompt_len: args.gsp_system_prompt_len,
                question_len: args.gsp_question_len,
            }),
            model,
            endpoint: args.endpoint,
            num_requests: planned.count,
            concurrency: args
                .load
                .request_rate
                .is_none()
                .then_some(args.load.concurrency)
                .flatten(),
            request_rate: args.load.request_rate,
            // What each request carried: the shared-prefix set and traces have their own
            // lengths (a trace's are its means).
            input_len: planned.input_len,
            output_len: planned.output_len,
            range_ratio: (dataset != Dataset::Mooncake).then_some(args.range_ratio),
            seed: args.seed,
            ignore_eos: !args.server.no_ignore_eos,
            slo_ttft_ms: slo.ttft_ms,
            slo_tpot_ms: slo.tpot_ms,
            conversations: None,
            turns: None,
            turn_input_len: None,
            send_conversation_id: None,
            api: None,
            system_prompt_len: None,
            priorities: args.priority.classes().to_vec(),
            trace: planned.trace,
            tokenize_prompt: args.tokenize_prompt,
        },
        summary: summarize(&records, planned.count, run.duration, &slo),
        failures: failures(&records),
        turns: Vec::new(),
        per_priority: per_priority(&records, &args.priority),
        requests: records,
    }
}
