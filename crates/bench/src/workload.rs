//! What `serve` sends: prompts generated up front (random, shared-prefix), or a trace's
//! requests whose prompts are built from their hash ids when they are sent.

use std::sync::Arc;
use std::time::Duration;

use serde_json::Value;

use crate::args::{Dataset, Endpoint, ServeArgs};
use crate::client::{request_body, RequestInput};
use crate::dataset::{load_tokenizer, PromptGenerator, SyntheticRequest};
use crate::priority::body_fields;
use crate::report::TraceConfig;
use crate::trace::{read_trace, reusable_token_share, TraceEntry};
use crate::trace_prompt::TracePrompts;
use crate::BenchError;

/// The requests of a run, read or generated before the server is contacted.
pub enum Workload {
    /// Prompts built up front (random, shared-prefix), as text or (`--tokenize-prompt`)
    /// token ids.
    Built(Vec<(RequestInput, SyntheticRequest)>),
    /// A trace: prompts are built at send time from the hash ids (a production trace's
    /// prompts would take gigabytes); `offsets` are the planned send times.
    Trace {
        /// The requests, in send order.
        entries: Vec<TraceEntry>,
        /// Builds their prompts.
        prompts: TracePrompts,
        /// Planned send time of each, from the start of the run.
        offsets: Vec<Duration>,
        /// What the result file records about the trace.
        config: TraceConfig,
    },
}

impl Workload {
    /// Reads the trace (`--dataset mooncake`) or generates the prompts `args` asks for.
    pub fn load(args: &ServeArgs) -> Result<Self, BenchError> {
        if args.tokenize_prompt && args.endpoint != Endpoint::Completions {
            return Err(BenchError::TokenIdsNeedCompletions);
        }
        let tokenizer = load_tokenizer(args.server.tokenizer_gguf.as_deref())?;
        if let Some((path, speedup)) = args.load.trace() {
            let trace = read_trace(path, args.num_prompts)?;
            if trace.out_of_order > 0 {
                // A warning, not an error: Mooncake-style traces are often concatenated
                // logs, and sorting them is the obvious reading.
                eprintln!(
                    "warning: {} of the {} requests read from {} were out of timestamp \
                     order; replaying them sorted by timestamp",
                    trace.out_of_order,
                    trace.entries.len(),
                    path.display()
                );
            }
            // The first request goes at once; the others keep their gaps to it, scaled.
            let first = trace.entries[0].timestamp;
            let offsets: Vec<Duration> = trace
                .entries
                .iter()
                .map(|e| Duration::from_secs_f64((e.timestamp - first) / 1e3 / speedup))
                .collect();
            let config = TraceConfig {
                path: path.display().to_string(),
                speedup,
                out_of_order: trace.out_of_order as u64,
                span_s: offsets.last().copied().unwrap_or_default().as_secs_f64(),
                reusable_token_share: reusable_token_share(&trace.entries),
            };
            return Ok(Self::Trace {
                prompts: TracePrompts::new(args.seed, tokenizer.as_deref())?,
                entries: trace.entries,
                offsets,
                config,
            });
        }
        let mut generator = PromptGenerator::new(args.seed).with_tokenizer(tokenizer.clone());
        let requests = match args.load.dataset {
            Dataset::SharedPrefix => generator.shared_prefix(
                args.gsp_num_groups,
                args.gsp_prompts_per_group,
                args.gsp_system_prompt_len,
                args.gsp_question_len,
                args.gsp_output_len,
            )?,
            // `Load`'s checks give mooncake a trace, so it does not get here.
            Dataset::Random | Dataset::Mooncake => generator.requests(
                args.num_prompts_or_default(),
                args.input_len,
                args.output_len,
                args.range_ratio,
            )?,
        };
        let ids_of = tokenizer.filter(|_| args.tokenize_prompt);
        let requests = requests
            .into_iter()
            .map(|mut r| {
                let input = match &ids_of {
                    // `clap` makes `--tokenize-prompt` need `--tokenizer-gguf`.
                    Some(tokenizer) => RequestInput::TokenIds(tokenizer.encode(&r.prompt)?),
                    None => RequestInput::Prompt(std::mem::take(&mut r.prompt)),
                };
                Ok((input, r))
            })
            .collect::<Result<_, BenchError>>()?;
        Ok(Self::Built(requests))
    }

    /// The jobs to send with `model`, their planned send times (a trace's; `None`: the
    /// dispatcher decides), the body builder they need and what the config records.
    pub fn into_jobs(
        self,
        args: &ServeArgs,
        model: &str,
    ) -> (Vec<Job>, Option<Vec<Duration>>, Arc<Bodies>, Planned) {
        let priority_of = |index: usize| args.priority.class_of(args.seed, index as u64);
        let bodies = Arc::new(Bodies {
            endpoint: args.endpoint,
            model: model.to_string(),
            ignore_eos: !args.server.no_ignore_eos,
            token_ids: args.tokenize_prompt,
        });
        match self {
            Self::Built(requests) => {
                let shared = args.load.dataset == Dataset::SharedPrefix;
                let planned = Planned {
                    count: requests.len() as u64,
                    input_len: if shared {
                        args.gsp_system_prompt_len + args.gsp_question_len
                    } else {
                        args.input_len
                    },
                    output_len: if shared {
                        args.gsp_output_len
                    } else {
                        args.output_len
                    },
                    trace: None,
                };
                let jobs = requests
                    .into_iter()
                    .enumerate()
                    .map(|(index, (input, r))| {
                        let priority = priority_of(index);
                        Job {
                            body: JobBody::Ready(bodies.body(input, r.output_tokens, priority)),
                            prompt_tokens: r.prompt_tokens,
                            output_tokens: r.output_tokens,
                            priority,
                        }
                    })
                    .collect();
                (jobs, None, bodies, planned)
            }
            Self::Trace {
                entries,
                prompts,
                offsets,
                config,
            } => {
                let n = entries.len().max(1) as f64;
                let mean = |f: fn(&TraceEntry) -> u64| {
                    (entries.iter().map(f).sum::<u64>() as f64 / n).round() as u64
                };
                let planned = Planned {
                    count: entries.len() as u64,
                    input_len: mean(|e| e.input_length),
                    output_len: mean(|e| e.output_length),
                    trace: Some(config),
                };
                let prompts = Arc::new(prompts);
                let jobs = entries
                    .into_iter()
                    .enumerate()
                    .map(|(index, entry)| Job {
                        prompt_tokens: entry.input_length,
                        output_tokens: entry.output_length,
                        priority: priority_of(index),
                        body: JobBody::Trace {
                            entry,
                            prompts: prompts.clone(),
                        },
                    })
                    .collect();
                (jobs, Some(offsets), bodies, planned)
            }
        }
    }
}

/// What the result's config records about the workload.
pub struct Planned {
    /// Requests planned.
    pub count: u64,
    /// Prompt tokens per request (a trace's mean).
    pub input_len: u64,
    /// Output tokens per request (a trace's mean).
    pub output_len: u64,
    /// Trace replay: the trace.
    pub trace: Option<TraceConfig>,
}

/// One request to send: its body (or the trace line that makes it) and what it asks for.
pub struct Job {
    /// The body, or what builds it.
    pub body: JobBody,
    /// Prompt tokens built.
    pub prompt_tokens: u64,
    /// `max_tokens`.
    pub output_tokens: u64,
    /// `priority` sent, if any.
    pub priority: Option<i64>,
}

/// A request body, ready or to build at send time.
pub enum JobBody {
    /// Built up front.
    Ready(Value),
    /// A trace request, whose prompt [`Bodies::build`] makes with `prompts`.
    Trace {
        /// The trace line.
        entry: TraceEntry,
        /// The run's prompt builder.
        prompts: Arc<TracePrompts>,
    },
}

/// Turns planned requests into request bodies.
pub struct Bodies {
    endpoint: Endpoint,
    model: String,
    ignore_eos: bool,
    /// `--tokenize-prompt`: trace prompts go as token ids.
    token_ids: bool,
}

impl Bodies {
    /// Whether `ignore_eos: true` is sent.
    pub fn ignore_eos(&self) -> bool {
        self.ignore_eos
    }

    fn body(&self, input: RequestInput, output_tokens: u64, priority: Option<i64>) -> Value {
        request_body(
            self.endpoint,
            &self.model,
            input,
            output_tokens,
            self.ignore_eos,
            body_fields(priority),
        )
    }

    /// Request `index`'s body, building a trace request's prompt now.
    pub fn build(&self, index: usize, body: JobBody, priority: Option<i64>) -> Value {
        match body {
            JobBody::Ready(body) => body,
            JobBody::Trace { entry, prompts } => {
                let index = index as u64;
                // With `--tokenize-prompt` the prompts were built with the tokenizer
                // (`clap` requires it), so they have ids.
                let input = match self.token_ids.then(|| prompts.prompt_ids(index, &entry)) {
                    Some(Some(ids)) => RequestInput::TokenIds(ids),
                    _ => RequestInput::Prompt(prompts.prompt(index, &entry)),
                };
                self.body(input, entry.output_length, priority)
            }
        }
    }
}
