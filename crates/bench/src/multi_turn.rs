//! `pdserve bench multi-turn`: K conversations of T turns. Each turn sends the whole
//! conversation so far (every earlier user message and answer) plus a new user
//! message, so a server that keeps the previous turn's KV cache has most of the prompt
//! cached; the report gives per-turn TTFT and the cached share the server reports in
//! `usage.prompt_tokens_details.cached_tokens`.
//!
//! With `--api responses` each turn sends only its new user message, with the previous
//! turn's response id as `previous_response_id`, to `POST /v1/responses`: the server
//! holds the conversation, and reports its cached share in `usage.input_tokens_details`.

use std::collections::BTreeMap;
use std::future::Future;
use std::sync::Arc;

use pdserve_protocol::{unix_now, ChatMessage};
use serde_json::{Map, Value};
use tokio::sync::{mpsc, Semaphore};
use tokio::task::JoinSet;
use tokio::time::Instant;

use crate::args::{Api, Endpoint, MultiTurnArgs};
use crate::client::{chat_message, request_body, ApiClient, RequestError, RequestInput};
use crate::dataset::{load_tokenizer, PromptGenerator};
use crate::metrics::{cached_share, failures, summarize, Distribution, RequestRecord, Slo};
use crate::report::{BenchResult, RunConfig, RunKind, TurnSummary, SCHEMA_VERSION};
use crate::responses_client::{
    responses_body, responses_probe_body, ResponsesTurn, RESPONSES_PATH,
};
use crate::serve::{probe, probe_prompt, resolve_model, PROBE_MAX_TOKENS};
use crate::{progress, BenchError};

/// What every conversation task shares.
struct Shared {
    /// One per `--url`; conversation c talks to `clients[c % len]`.
    clients: Vec<ApiClient>,
    model: String,
    api: Api,
    output_len: u64,
    ignore_eos: bool,
    turns: u64,
    /// The system prompt every conversation starts with, and its length in tokens.
    system: Option<(String, u64)>,
    start: Instant,
    slots: Arc<Semaphore>,
    records: mpsc::UnboundedSender<RequestRecord>,
}

/// One conversation: its id (if sent) and the user message of every turn.
struct Script {
    index: u64,
    conversation_id: Option<String>,
    user_messages: Vec<(String, u64)>,
}

/// Runs the conversations until they finish or `shutdown` resolves.
pub async fn run_multi_turn(
    args: &MultiTurnArgs,
    shutdown: impl Future<Output = ()>,
) -> Result<BenchResult, BenchError> {
    let clients = ApiClient::replicas(&args.server)?;
    let client = clients[0].clone();
    let model = resolve_model(&client, args.server.model.as_deref()).await?;
    let ignore_eos = !args.server.no_ignore_eos;
    let api = args.protocol.api;
    let started_at_unix_s = unix_now();
    let tokenizer = load_tokenizer(args.server.tokenizer_gguf.as_deref())?;
    let mut generator = PromptGenerator::new(args.seed).with_tokenizer(tokenizer);
    let system = match args.system_prompt_len {
        0 => None,
        len => Some((generator.prompt(len)?, len)),
    };
    let mut scripts = Vec::with_capacity(args.conversations as usize);
    for k in 0..args.conversations {
        let mut user_messages = Vec::with_capacity(args.turns as usize);
        for t in 0..args.turns {
            let len = if t == 0 {
                args.input_len
            } else {
                args.turn_input_len
            };
            user_messages.push((generator.prompt(len)?, len));
        }
        scripts.push(Script {
            index: k,
            conversation_id: args
                .protocol
                .send_conversation_id
                .then(|| format!("pdserve-bench-{started_at_unix_s}-{}-{k}", args.seed)),
            user_messages,
        });
    }
    match api {
        Api::Chat => {
            let probe_input = RequestInput::Prompt(probe_prompt(args.seed));
            probe(
                &client,
                Endpoint::Chat,
                &model,
                probe_input,
                ignore_eos,
                Map::new(),
            )
            .await?;
        }
        Api::Responses => probe_responses(&client, &model, args.seed, ignore_eos).await?,
    }

    let planned = args.conversations * args.turns;
    let (tx, mut rx) = mpsc::unbounded_channel();
    let shared = Arc::new(Shared {
        clients: clients.clone(),
        model: model.clone(),
        api,
        output_len: args.output_len,
        ignore_eos,
        turns: args.turns,
        system,
        start: Instant::now(),
        slots: Arc::new(Semaphore::new(
            args.concurrency.unwrap_or(args.conversations) as usize,
        )),
        records: tx,
    });
    let bar = progress::requests_bar(planned);
    let mut tasks = JoinSet::new();
    for script in scripts {
        tasks.spawn(converse(shared.clone(), script));
    }
    let start = shared.start;
    // The tasks hold the only senders now, so the channel closes when they are done.
    drop(shared);

    let mut records = Vec::with_capacity(planned as usize);
    let mut failed = 0;
    let mut interrupted = false;
    let mut shutdown = std::pin::pin!(shutdown);
    loop {
        tokio::select! {
            biased;
            () = &mut shutdown => {
                interrupted = true;
                break;
            }
            record = rx.recv() => match record {
                Some(record) => {
                    failed += u64::from(!record.ok);
                    progress::record(&bar, failed);
                    records.push(record);
                }
                None => break,
            },
        }
    }
    let duration = start.elapsed();
    tasks.abort_all();
    while let Some(joined) = tasks.join_next().await {
        if let Err(e) = joined {
            if e.is_panic() {
                return Err(BenchError::Task(e.to_string()));
            }
        }
    }
    bar.finish_and_clear();
    records.sort_by_key(|r| r.index);

    let slo = Slo {
        ttft_ms: args.slo.slo_ttft_ms,
        tpot_ms: args.slo.slo_tpot_ms,
    };
    Ok(BenchResult {
        schema_version: SCHEMA_VERSION,
        kind: RunKind::MultiTurn,
        tool: format!("pdserve-bench {}", env!("CARGO_PKG_VERSION")),
        label: args.output.label.clone().unwrap_or_else(|| model.clone()),
        started_at_unix_s,
        interrupted,
        config: RunConfig {
            url: client.base_url().to_string(),
            urls: clients.iter().map(|c| c.base_url().to_string()).collect(),
            dataset: None,
            shared_prefix: None,
            model,
            endpoint: Endpoint::Chat,
            num_requests: planned,
            concurrency: Some(args.concurrency.unwrap_or(args.conversations)),
            request_rate: None,
            input_len: args.input_len,
            output_len: args.output_len,
            range_ratio: None,
            seed: args.seed,
            ignore_eos,
            slo_ttft_ms: slo.ttft_ms,
            slo_tpot_ms: slo.tpot_ms,
            conversations: Some(args.conversations),
            turns: Some(args.turns),
            turn_input_len: Some(args.turn_input_len),
            send_conversation_id: Some(args.protocol.send_conversation_id),
            api: Some(api),
            system_prompt_len: Some(args.system_prompt_len),
            priorities: Vec::new(),
            trace: None,
            tokenize_prompt: false,
        },
        summary: summarize(&records, planned, duration, &slo),
        failures: failures(&records),
        turns: per_turn(&records),
        per_priority: Vec::new(),
        requests: records,
    })
}

/// Checks with one small non-streaming `/v1/responses` request that the server speaks
/// the Responses API (a chat probe would pass a server that serves only chat).
async fn probe_responses(
    client: &ApiClient,
    model: &str,
    seed: u64,
    ignore_eos: bool,
) -> Result<(), BenchError> {
    let body = responses_probe_body(model, &probe_prompt(seed), PROBE_MAX_TOKENS, ignore_eos);
    let url = format!("{}{RESPONSES_PATH}", client.base_url());
    match client.responses_once(&body).await {
        Ok(()) => Ok(()),
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

/// Where a conversation stands between turns.
enum History {
    /// Chat: every message so far, resent each turn.
    Chat(Vec<ChatMessage>),
    /// Responses: the id of the last response (the server holds the rest).
    Responses(Option<String>),
}

/// Plays one conversation turn by turn; a failed turn ends it (the next prompt would
/// need its answer).
async fn converse(shared: Arc<Shared>, script: Script) {
    let Ok(_slot) = shared.slots.clone().acquire_owned().await else {
        return;
    };
    let mut history_tokens = 0u64;
    if let Some((_, tokens)) = &shared.system {
        history_tokens += tokens;
    }
    let mut history = match shared.api {
        Api::Chat => History::Chat(
            shared
                .system
                .iter()
                .map(|(text, _)| chat_message("system", text.clone()))
                .collect(),
        ),
        Api::Responses => History::Responses(None),
    };
    let mut extra = Map::new();
    if let Some(id) = &script.conversation_id {
        extra.insert("conversation_id".into(), Value::String(id.clone()));
    }
    let client = &shared.clients[script.index as usize % shared.clients.len()];
    for (turn, (text, tokens)) in script.user_messages.into_iter().enumerate() {
        history_tokens += tokens;
        let sent;
        // Responses: the answer's id goes to `previous`, for the next turn to continue.
        let outcome = match &mut history {
            History::Chat(messages) => {
                messages.push(chat_message("user", text));
                let body = request_body(
                    Endpoint::Chat,
                    &shared.model,
                    RequestInput::Messages(messages.clone()),
                    shared.output_len,
                    shared.ignore_eos,
                    extra.clone(),
                );
                sent = shared.start.elapsed();
                client.stream(Endpoint::Chat, &body).await
            }
            History::Responses(previous) => {
                let body = responses_body(&ResponsesTurn {
                    model: &shared.model,
                    user: &text,
                    instructions: shared.system.as_ref().map(|(s, _)| s.as_str()),
                    previous_response_id: previous.as_deref(),
                    max_output_tokens: shared.output_len,
                    ignore_eos: shared.ignore_eos,
                });
                sent = shared.start.elapsed();
                client.responses_stream(&body).await.map(|r| {
                    *previous = Some(r.id);
                    r.stream
                })
            }
        };
        let index = script.index * shared.turns + turn as u64;
        let mut record =
            RequestRecord::new(index, sent, history_tokens, shared.output_len, &outcome);
        record.conversation = Some(script.index);
        record.turn = Some(turn as u64);
        history_tokens += record.output_tokens;
        if shared.records.send(record).is_err() {
            return;
        }
        match (outcome, &mut history) {
            (Ok(answer), History::Chat(messages)) => {
                messages.push(chat_message("assistant", answer.text))
            }
            (Ok(_), History::Responses(_)) => {}
            (Err(_), _) => return,
        }
    }
}

/// Figures per turn.
fn per_turn(records: &[RequestRecord]) -> Vec<TurnSummary> {
    let mut by_turn: BTreeMap<u64, Vec<&RequestRecord>> = BTreeMap::new();
    for r in records {
        by_turn.entry(r.turn.unwrap_or(0)).or_default().push(r);
    }
    by_turn
        .into_iter()
        .map(|(turn, rs)| {
            let done: Vec<&RequestRecord> = rs.iter().copied().filter(|r| r.ok).collect();
            let ttft: Vec<f64> = done.iter().filter_map(|r| r.ttft_ms).collect();
            let prompt: Vec<u64> = done.iter().map(|r| r.input_tokens()).collect();
            TurnSummary {
                turn,
                completed: done.len() as u64,
                failed: (rs.len() - done.len()) as u64,
                mean_prompt_tokens: (!prompt.is_empty())
                    .then(|| prompt.iter().sum::<u64>() as f64 / prompt.len() as f64),
                cached_token_share: cached_share(done.iter().copied()),
                ttft_ms: Distribution::of(&ttft),
            }
        })
        .collect()
}
