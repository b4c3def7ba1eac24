//! Prometheus metrics of a worker, served as text on `/metrics`.

use prometheus_client::encoding::text::{encode_eof, encode_registry};
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::metrics::histogram::{exponential_buckets, Histogram};
use prometheus_client::registry::Registry;

mod bootstrap;
mod orchestrator;
mod sim;
mod vllm;
pub use bootstrap::BootstrapMetrics;
pub use orchestrator::OrchestratorMetrics;
pub use sim::SimMetrics;
pub use vllm::VllmMetrics;

/// Label set naming a finish reason.
pub type ReasonLabels = Vec<(&'static str, &'static str)>;

/// Engine metrics; cheap to update from the scheduler thread.
#[derive(Debug)]
pub struct Metrics {
    registry: Registry,
    /// The `vllm:*` series (see [`VllmMetrics`]).
    vllm_registry: Registry,
    /// vLLM-named histograms and the KV usage gauge.
    pub vllm: VllmMetrics,
    /// Sequences in the running batch.
    pub running: Gauge,
    /// Sequences waiting for admission.
    pub waiting: Gauge,
    /// KV blocks referenced by a sequence or a pin.
    pub kv_blocks_used: Gauge,
    /// KV blocks that can be allocated (including reclaimable cached ones).
    pub kv_blocks_free: Gauge,
    /// KV blocks findable in the prefix cache.
    pub kv_blocks_cached: Gauge,
    /// KV blocks held for a KV transfer.
    pub kv_blocks_pinned: Gauge,
    /// Prompt tokens of admitted requests.
    pub prompt_tokens: Counter,
    /// Generated tokens.
    pub generation_tokens: Counter,
    /// Prompt tokens looked up in the prefix cache.
    pub prefix_cache_queries: Counter,
    /// Prompt tokens found in the prefix cache.
    pub prefix_cache_hits: Counter,
    /// Sequences preempted (blocks freed, recomputed later) for lack of KV blocks.
    pub preemptions: Counter,
    /// Finished requests by finish reason (`stop`, `length`, `abort`, `error`).
    pub requests_finished: Family<ReasonLabels, Counter>,
    /// From arrival at the scheduler to the first generated token.
    pub time_to_first_token_seconds: Histogram,
    /// From arrival at the scheduler to the first admission into the running batch.
    pub queue_seconds: Histogram,
    /// From arrival at the scheduler to the last token.
    pub request_seconds: Histogram,
    /// Wall time of one scheduler step (forward pass plus sampling).
    pub step_seconds: Histogram,
    /// Sequences per forward step.
    pub batch_size: Histogram,
    /// Largest batch of any step so far.
    pub batch_size_max: Gauge,
    /// KV transfer (P/D) metrics.
    pub kv: KvTransferMetrics,
    /// Prompts this worker tokenized (a chat template rendered and tokenized, or a
    /// completion's text prompt): one per request it was the first to see, none for a
    /// token-id prompt, so an orchestrated request counts once, on the decode worker.
    pub prompts_tokenized: Counter,
    /// Decode-as-orchestrator metrics (`--prefill`).
    pub orchestrator: OrchestratorMetrics,
    /// SGLang bootstrap rendezvous metrics (`--bootstrap-port`, `bootstrap_room`).
    pub bootstrap: BootstrapMetrics,
    /// The simulated engine's metrics (`--sim` only).
    pub sim: Option<SimMetrics>,
}

/// Metrics of the KV transfer service and of pulls from peers.
#[derive(Debug)]
pub struct KvTransferMetrics {
    /// Blocks pinned for a peer to read (published or being read).
    pub pinned_blocks: Gauge,
    /// Block sets published for peers (prefill exports and conversation hand-backs).
    pub published: Counter,
    /// Blocks sent to peers.
    pub blocks_sent: Counter,
    /// Bytes of blocks sent to peers.
    pub bytes_sent: Counter,
    /// Blocks received from peers.
    pub blocks_received: Counter,
    /// Bytes of blocks received from peers.
    pub bytes_received: Counter,
    /// Prompt tokens whose KV was loaded from a peer instead of computed.
    pub imported_tokens: Counter,
    /// Wall time of one completed transfer, either direction.
    pub transfer_seconds: Histogram,
    /// Published blocks freed because no peer read them within --kv-abort-timeout.
    pub aborted_by_timeout: Counter,
    /// Published conversation blocks freed early to keep room for new requests.
    pub evicted: Counter,
    /// Accepted reads that broke off (the peer's blocks are freed).
    pub serve_failures: Counter,
    /// Pulls from a peer that failed.
    pub pull_failures: Counter,
    /// Reads refused before dialling: `remote_host` not in `--kv-peers`.
    pub peers_refused: Counter,
    /// Publications freed by `POST /v1/kv/release`.
    pub released: Counter,
    /// Reads of a peer's conversation hand-back that found it reclaimed ("gone"); the
    /// prompt was computed instead (`pdserve_kv_handback_gone_total`).
    pub handback_gone: Counter,
    /// Hand-back blocks this worker's pool reclaimed for new requests before anyone
    /// read them (`pdserve_kv_handback_reclaimed_blocks_total`).
    pub handback_reclaimed_blocks: Counter,
    /// Blocks sent to a reader while their prefill was still computing the prompt
    /// (`pdserve_kv_transfer_blocks_streamed_total`; see `kv_feed`).
    pub blocks_streamed: Counter,
    /// Decode side: time from the last block of a prompt's KV arriving from the prefill
    /// worker to its sequence's first step here (admitted, the KV written into the
    /// pool, its first forward next): what the decode waits once the KV is here
    /// (`pdserve_kv_import_wait_seconds`).
    pub import_wait_seconds: Histogram,
    /// Prefill side: time from a prefill's last prompt chunk being computed to its
    /// reader confirming every block (`ReadComplete`), for completed reads of prefill
    /// publications: the transfer's tail past the prefill, short when blocks went out
    /// while it computed (`pdserve_kv_stream_tail_seconds`).
    pub stream_tail_seconds: Histogram,
}

impl KvTransferMetrics {
    fn new() -> Self {
        Self {
            pinned_blocks: Gauge::default(),
            published: Counter::default(),
            blocks_sent: Counter::default(),
            bytes_sent: Counter::default(),
            blocks_received: Counter::default(),
            bytes_received: Counter::default(),
            imported_tokens: Counter::default(),
            transfer_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            aborted_by_timeout: Counter::default(),
            evicted: Counter::default(),
            serve_failures: Counter::default(),
            pull_failures: Counter::default(),
            peers_refused: Counter::default(),
            released: Counter::default(),
            handback_gone: Counter::default(),
            handback_reclaimed_blocks: Counter::default(),
            blocks_streamed: Counter::default(),
            import_wait_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
            stream_tail_seconds: Histogram::new(exponential_buckets(0.0001, 2.0, 18)),
        }
    }

    fn register(&self, r: &mut Registry) {
        {
            let r = r.sub_registry_with_prefix("kv_handback");
            r.register(
                "gone",
                "Reads of a peer's conversation hand-back that found it reclaimed (the prompt was computed instead)",
                self.handback_gone.clone(),
            );
            r.register(
                "reclaimed_blocks",
                "Conversation hand-back blocks reclaimed for new requests before anyone read them",
                self.handback_reclaimed_blocks.clone(),
            );
        }
        {
            let r = r.sub_registry_with_prefix("kv");
            r.register(
                "import_wait_seconds",
                "Decode side: time from a prompt's last KV block arriving from the prefill worker to its sequence's first step",
                self.import_wait_seconds.clone(),
            );
            r.register(
                "stream_tail_seconds",
                "Prefill side: time from a prefill's last prompt chunk being computed to its reader confirming every KV block",
                self.stream_tail_seconds.clone(),
            );
        }
        let r = r.sub_registry_with_prefix("kv_transfer");
        r.register(
            "blocks_streamed",
            "KV blocks sent while their prefill was still computing the prompt",
            self.blocks_streamed.clone(),
        );
        r.register(
            "peers_refused",
            "KV reads refused before connecting: remote_host not in --kv-peers",
            self.peers_refused.clone(),
        );
        r.register(
            "released",
            "Publications freed by POST /v1/kv/release",
            self.released.clone(),
        );
        r.register(
            "pinned_blocks",
            "KV blocks pinned for a peer to read",
            self.pinned_blocks.clone(),
        );
        r.register(
            "published",
            "Block sets published for peers",
            self.published.clone(),
        );
        r.register(
            "blocks_sent",
            "KV blocks sent to peers",
            self.blocks_sent.clone(),
        );
        r.register(
            "bytes_sent",
            "Bytes of KV blocks sent to peers",
            self.bytes_sent.clone(),
        );
        r.register(
            "blocks_received",
            "KV blocks received from peers",
            self.blocks_received.clone(),
        );
        r.register(
            "bytes_received",
            "Bytes of KV blocks received from peers",
            self.bytes_received.clone(),
        );
        r.register(
            "imported_tokens",
            "Prompt tokens whose KV was loaded from a peer",
            self.imported_tokens.clone(),
        );
        r.register(
            "seconds",
            "Wall time of one completed KV transfer",
            self.transfer_seconds.clone(),
        );
        r.register(
            "aborted_by_timeout",
            "Published blocks freed because no peer read them in time",
            self.aborted_by_timeout.clone(),
        );
        r.register(
            "evicted",
            "Published conversation blocks freed early for room",
            self.evicted.clone(),
        );
        r.register(
            "serve_failures",
            "Accepted reads that broke off",
            self.serve_failures.clone(),
        );
        r.register(
            "pull_failures",
            "Pulls from a peer that failed",
            self.pull_failures.clone(),
        );
    }
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl Metrics {
    /// All metrics, registered under the `pdserve` prefix (and the `vllm:` names with
    /// `model_name="pdserve"`).
    pub fn new() -> Self {
        Self::for_model("pdserve")
    }

    /// All metrics, the `vllm:*` series labelled `model_name=<model_name>`.
    pub fn for_model(model_name: &str) -> Self {
        let mut m = Self {
            registry: Registry::with_prefix("pdserve"),
            vllm_registry: Registry::default(),
            vllm: VllmMetrics::default(),
            running: Gauge::default(),
            waiting: Gauge::default(),
            kv_blocks_used: Gauge::default(),
            kv_blocks_free: Gauge::default(),
            kv_blocks_cached: Gauge::default(),
            kv_blocks_pinned: Gauge::default(),
            prompt_tokens: Counter::default(),
            generation_tokens: Counter::default(),
            prefix_cache_queries: Counter::default(),
            prefix_cache_hits: Counter::default(),
            preemptions: Counter::default(),
            requests_finished: Family::default(),
            time_to_first_token_seconds: Histogram::new(exponential_buckets(0.005, 2.0, 14)),
            queue_seconds: Histogram::new(exponential_buckets(0.001, 2.0, 16)),
            request_seconds: Histogram::new(exponential_buckets(0.01, 2.0, 14)),
            step_seconds: Histogram::new(exponential_buckets(0.0005, 2.0, 16)),
            batch_size: Histogram::new(exponential_buckets(1.0, 2.0, 9)),
            batch_size_max: Gauge::default(),
            kv: KvTransferMetrics::new(),
            prompts_tokenized: Counter::default(),
            orchestrator: Default::default(),
            bootstrap: Default::default(),
            sim: None,
        };
        let r = &mut m.registry;
        r.register(
            "num_requests_running",
            "Sequences in the running batch",
            m.running.clone(),
        );
        r.register(
            "num_requests_waiting",
            "Sequences waiting for admission",
            m.waiting.clone(),
        );
        r.register(
            "kv_blocks_used",
            "KV blocks referenced by a sequence or a pin",
            m.kv_blocks_used.clone(),
        );
        r.register(
            "kv_blocks_free",
            "KV blocks that can be allocated, reclaimable cached ones included",
            m.kv_blocks_free.clone(),
        );
        r.register(
            "kv_blocks_cached",
            "KV blocks findable in the prefix cache",
            m.kv_blocks_cached.clone(),
        );
        r.register(
            "kv_blocks_pinned",
            "KV blocks held for a KV transfer",
            m.kv_blocks_pinned.clone(),
        );
        r.register(
            "prompt_tokens",
            "Prompt tokens of admitted requests",
            m.prompt_tokens.clone(),
        );
        r.register(
            "generation_tokens",
            "Generated tokens",
            m.generation_tokens.clone(),
        );
        r.register(
            "prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache",
            m.prefix_cache_queries.clone(),
        );
        r.register(
            "prefix_cache_hits",
            "Prompt tokens found in the prefix cache",
            m.prefix_cache_hits.clone(),
        );
        r.register(
            "preemptions",
            "Sequences preempted for lack of KV blocks",
            m.preemptions.clone(),
        );
        r.register(
            "requests_finished",
            "Finished requests by reason",
            m.requests_finished.clone(),
        );
        r.register(
            "time_to_first_token_seconds",
            "From arrival at the scheduler to the first generated token",
            m.time_to_first_token_seconds.clone(),
        );
        r.register(
            "queue_seconds",
            "From arrival at the scheduler to first admission into the running batch",
            m.queue_seconds.clone(),
        );
        r.register(
            "request_seconds",
            "From arrival at the scheduler to the last token",
            m.request_seconds.clone(),
        );
        r.register(
            "step_seconds",
            "Wall time of one scheduler step",
            m.step_seconds.clone(),
        );
        r.register(
            "batch_size",
            "Sequences per forward step",
            m.batch_size.clone(),
        );
        r.register(
            "batch_size_max",
            "Largest batch of any forward step",
            m.batch_size_max.clone(),
        );
        r.register(
            "prompts_tokenized",
            "Prompts this worker tokenized (token-id prompts are not counted)",
            m.prompts_tokenized.clone(),
        );
        m.vllm_registry = m.vllm.registry(
            model_name,
            vllm::Shared {
                running: m.running.clone(),
                waiting: m.waiting.clone(),
                prompt_tokens: m.prompt_tokens.clone(),
                generation_tokens: m.generation_tokens.clone(),
                prefix_cache_queries: m.prefix_cache_queries.clone(),
                prefix_cache_hits: m.prefix_cache_hits.clone(),
            },
        );
        m.kv.register(r);
        m.orchestrator.register(r);
        m.bootstrap.register(r);
        m
    }

    /// These metrics and a simulated engine's (`pdserve_sim_*`).
    pub fn with_sim(mut self) -> Self {
        let sim = SimMetrics::default();
        sim.register(&mut self.registry);
        self.sim = Some(sim);
        self
    }

    /// Counts one finished request.
    pub fn finished(&self, reason: &'static str) {
        self.requests_finished
            .get_or_create(&vec![("reason", reason)])
            .inc();
    }

    /// The Prometheus text exposition of every metric.
    pub fn encode(&self) -> String {
        self.vllm.set_kv_usage(
            self.kv_blocks_used.get().max(0) as usize,
            self.kv_blocks_free.get().max(0) as usize,
        );
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = encode_registry(&mut out, &self.registry)
            .and_then(|()| encode_registry(&mut out, &self.vllm_registry))
            .and_then(|()| encode_eof(&mut out));
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn text_exposition_names_the_engine_metrics() {
        let m = Metrics::new();
        m.batch_size.observe(3.0);
        m.kv_blocks_used.set(5);
        m.finished("stop");
        let text = m.encode();
        for needle in [
            "pdserve_kv_blocks_used 5",
            "pdserve_batch_size_count 1",
            "pdserve_prefix_cache_hits_total 0",
            "pdserve_requests_finished_total{reason=\"stop\"} 1",
            "pdserve_kv_transfer_pinned_blocks 0",
            "pdserve_kv_transfer_aborted_by_timeout_total 0",
            "pdserve_prompts_tokenized_total 0",
            "pdserve_orchestrator_warm_prefill_workers 0",
            "pdserve_bootstrap_rooms_open 0",
            "# EOF",
        ] {
            assert!(text.contains(needle), "missing {needle}:\n{text}");
        }
    }

    #[test]
    fn vllm_names_share_values_and_carry_the_model_name() {
        let m = Metrics::for_model("smol");
        m.running.set(3);
        m.waiting.set(2);
        m.kv_blocks_used.set(1);
        m.kv_blocks_free.set(3);
        m.prompt_tokens.inc_by(34);
        m.prefix_cache_hits.inc_by(16);
        m.vllm.time_to_first_token.observe(0.03);
        m.vllm.inter_token_latency.observe(0.02);
        m.vllm.e2e_request_latency.observe(0.9);
        let text = m.encode();
        let labels = "model_name=\"smol\",engine=\"0\"";
        for needle in [
            format!("vllm:num_requests_running{{{labels}}} 3"),
            format!("vllm:num_requests_waiting{{{labels}}} 2"),
            format!("vllm:kv_cache_usage_perc{{{labels}}} 0.25"),
            format!("vllm:prompt_tokens_total{{{labels}}} 34"),
            format!("vllm:generation_tokens_total{{{labels}}} 0"),
            format!("vllm:prefix_cache_hits_total{{{labels}}} 16"),
            format!("vllm:prefix_cache_queries_total{{{labels}}} 0"),
            format!("vllm:time_to_first_token_seconds_bucket{{{labels},le=\"0.02\"}} 0"),
            format!("vllm:time_to_first_token_seconds_bucket{{{labels},le=\"0.04\"}} 1"),
            format!("vllm:inter_token_latency_seconds_bucket{{{labels},le=\"0.025\"}} 1"),
            format!("vllm:e2e_request_latency_seconds_bucket{{{labels},le=\"0.8\"}} 0"),
            format!("vllm:e2e_request_latency_seconds_bucket{{{labels},le=\"1.0\"}} 1"),
            format!("vllm:e2e_request_latency_seconds_count{{{labels}}} 1"),
            "# TYPE vllm:prompt_tokens counter".to_string(),
        ] {
            assert!(text.contains(&needle), "missing {needle}:\n{text}");
        }
        assert!(text.contains("pdserve_prompt_tokens_total 34"), "{text}");
        assert!(text.ends_with("# EOF\n"), "one EOF, at the end");
        assert_eq!(text.matches("# EOF").count(), 1);
    }
}
