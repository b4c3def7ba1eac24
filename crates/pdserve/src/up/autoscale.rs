//! `pdserve up --autoscale`: the stack acts on its gateway's P:D planner (`GET
//! /planner`). Every `--autoscale-interval-secs` it reads the desired prefill and decode
//! counts and moves each pool towards them, within `--max-workers` and never below one
//! per pool: up to the desired count at once, down by one worker; a pool just resized is
//! left alone for `--autoscale-cooldown-secs`, so the planner's window sees the new size
//! first. Growth the prompt work arriving asks for (the desired count within the
//! planner's `demand.needed_now`) does not wait out the cooldown: that rate is measured
//! over the last seconds of arrivals, not over a window of misses from before the resize,
//! and a burst must not take several cooldowns to be served (Kubernetes' HPA has no
//! scale-up stabilization by default either).
//!
//! The gateways know the workers from a listing file the stack rewrites (their
//! `--discover-file`). A worker is added once it answers `/health`; one is removed by
//! taking it out of the listing first (no new requests reach it after the gateways' next
//! read), waiting for its queue and running requests to empty, and only then stopping it
//! (SIGTERM, which drains what is left within `--shutdown-timeout`).

use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use pdserve_protocol::WorkerRole;

use super::stack::{write_listing, Listed, Stack, Started, LISTING_INTERVAL_SECS};
use super::STOP_MARGIN;
use crate::members::{first_exit, stop_one, wait_ready, Member};
use crate::placement::Placement;

/// The pools the planner sizes.
const POOLS: [WorkerRole; 2] = [WorkerRole::Prefill, WorkerRole::Decode];

/// A worker behind the gateways, with the name its member carries.
struct Scaled {
    listed: Listed,
    name: String,
}

/// The autoscaling loop's state (see the module documentation).
pub(super) struct Autoscaler<'s, 'a> {
    stack: &'s Stack<'a>,
    /// The gateway whose planner is read.
    gateway: String,
    workers: Vec<Scaled>,
    /// Workers started so far (names their sockets).
    started: usize,
    /// Per pool: workers started so far (names their members), and the last resize.
    per_pool: [(usize, Option<Instant>); 2],
    http: reqwest::Client,
}

impl<'s, 'a> Autoscaler<'s, 'a> {
    /// The autoscaler of what `stack` started.
    pub(super) fn new(stack: &'s Stack<'a>, started: Started) -> Self {
        let count = |role| started.workers.iter().filter(|w| w.role == role).count();
        let per_pool = [(count(POOLS[0]), None), (count(POOLS[1]), None)];
        let mut seen = [0usize; 2];
        let workers = started
            .workers
            .into_iter()
            .map(|listed| {
                let pool = pool_index(listed.role);
                let name = format!("{}-{}", listed.role, seen[pool]);
                seen[pool] += 1;
                Scaled { listed, name }
            })
            .collect::<Vec<_>>();
        Self {
            stack,
            gateway: started.entry,
            started: workers.len(),
            workers,
            per_pool,
            http: reqwest::Client::builder()
                .timeout(Duration::from_secs(10))
                .no_proxy()
                .build()
                .expect("a plain HTTP client builds"),
        }
    }

    /// Acts on the planner until a member exits (an error, as without autoscaling).
    pub(super) async fn run(mut self, members: &mut Vec<Member>) -> anyhow::Result<()> {
        let every = Duration::from_secs_f64(self.stack.args.autoscale_interval_secs.max(0.1));
        let mut tick = tokio::time::interval(every);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tokio::select! {
                (name, status) = first_exit(members) => {
                    bail!("{name} exited unexpectedly ({status}); stopping the stack")
                }
                _ = tick.tick() => {}
            }
            if let Err(e) = self.step(members).await {
                tracing::warn!("autoscale: {e:#}");
            }
        }
    }

    /// Reads the planner and resizes each pool it wants resized.
    async fn step(&mut self, members: &mut Vec<Member>) -> anyhow::Result<()> {
        let plan: serde_json::Value = self
            .http
            .get(format!("{}/planner", self.gateway))
            .send()
            .await
            .and_then(|r| r.error_for_status())
            .context("cannot read the gateway's /planner")?
            .json()
            .await
            .context("the gateway's /planner is not JSON")?;
        let reason = plan["reason"].as_str().unwrap_or_default().to_string();
        let cooldown = Duration::from_secs_f64(self.stack.args.autoscale_cooldown_secs.max(0.0));
        let needed_by_arrivals = plan["demand"]["needed_now"].as_u64();
        for role in POOLS {
            let Some(desired) = plan[role.as_str()].as_u64() else {
                bail!("/planner has no `{role}` count: {plan}");
            };
            let pool = pool_index(role);
            let current = self.count(role) as u64;
            let cooling = self.per_pool[pool]
                .1
                .is_some_and(|at| at.elapsed() < cooldown);
            if cooling && !arrivals_ask(role, desired, current, needed_by_arrivals) {
                continue;
            }
            // The planner counted a pool other than this one (a worker just listed or
            // removed that the gateway has not read yet): its count is for that pool.
            if plan["current"][role.as_str()].as_u64() != Some(current) {
                continue;
            }
            if desired > current && self.workers.len() < self.stack.args.max_workers {
                // Up at once: load that needs several more workers misses until they run.
                let room = self.stack.args.max_workers - self.workers.len();
                let more = usize::try_from(desired - current).map_or(room, |n| n.min(room));
                self.grow(role, more, members, &reason).await?;
                self.per_pool[pool].1 = Some(Instant::now());
            } else if desired < current && current > 1 {
                self.shrink(role, members, &reason).await?;
                self.per_pool[pool].1 = Some(Instant::now());
            }
        }
        Ok(())
    }

    fn count(&self, role: WorkerRole) -> usize {
        self.workers
            .iter()
            .filter(|w| w.listed.role == role)
            .count()
    }

    fn write(&self) -> anyhow::Result<()> {
        let listing = self
            .stack
            .listing
            .as_deref()
            .context("no workers' listing")?;
        let listed: Vec<Listed> = self.workers.iter().map(|w| w.listed.clone()).collect();
        write_listing(listing, &listed)
    }

    /// Starts `more` workers of `role` together, and lists each once it is ready (they
    /// start side by side: a pool short of several workers waits for one start, not for
    /// several in a row).
    async fn grow(
        &mut self,
        role: WorkerRole,
        more: usize,
        members: &mut Vec<Member>,
        reason: &str,
    ) -> anyhow::Result<()> {
        let pool = pool_index(role);
        let mut launched = Vec::with_capacity(more);
        let mut failed = None;
        for _ in 0..more {
            let name = format!("{role}-{}", self.per_pool[pool].0);
            self.per_pool[pool].0 += 1;
            let index = self.started;
            self.started += 1;
            match self
                .stack
                .launch(role, index, &name, &Placement::anywhere())
            {
                Ok((member, listed, line)) => {
                    members.push(member);
                    launched.push((name, listed, line));
                }
                // Those already launched are still waited for and listed: none is left
                // running unlisted.
                Err(e) => {
                    failed = Some(e.context(format!("{name} could not be started")));
                    break;
                }
            }
        }
        let limit = Duration::from_secs(self.stack.args.ready_timeout_secs);
        for (name, listed, line) in launched {
            if let Err(e) = wait_ready(members, &listed.url, limit).await {
                // A worker that did not come up is stopped and forgotten; the stack goes
                // on with the workers it had.
                if let Some(at) = members.iter().position(|m| m.name() == name) {
                    let mut member = members.remove(at);
                    stop_one(&mut member, STOP_MARGIN).await;
                }
                failed = Some(e.context(format!("{name} did not come up; not added")));
                continue;
            }
            self.workers.push(Scaled { listed, name });
            self.write()?;
            println!("autoscale: started {line} (planner: {reason})");
        }
        failed.map_or(Ok(()), Err)
    }

    /// Drains the newest worker of `role` and stops it.
    async fn shrink(
        &mut self,
        role: WorkerRole,
        members: &mut Vec<Member>,
        reason: &str,
    ) -> anyhow::Result<()> {
        let Some(i) = self.workers.iter().rposition(|w| w.listed.role == role) else {
            return Ok(());
        };
        let gone = self.workers.remove(i);
        self.write()?;
        // The gateways stop routing to it at their next read of the listing.
        tokio::time::sleep(Duration::from_millis(
            2 * LISTING_INTERVAL_SECS * 1000 + 500,
        ))
        .await;
        let limit = Duration::from_secs(self.stack.args.shutdown_timeout);
        let idle = self.wait_idle(&gone.listed.url, limit).await;
        if let Some(at) = members.iter().position(|m| m.name() == gone.name) {
            let mut member = members.remove(at);
            stop_one(&mut member, limit + STOP_MARGIN).await;
        }
        let drained = if idle {
            "drained"
        } else {
            "still busy after --shutdown-timeout"
        };
        println!(
            "autoscale: stopped {} at {} ({drained}; planner: {reason})",
            gone.name, gone.listed.url
        );
        Ok(())
    }

    /// Waits until the worker at `url` reports nothing waiting or running (its vLLM-named
    /// gauges), for at most `limit`; whether it got there.
    async fn wait_idle(&self, url: &str, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let text = match self.http.get(format!("{url}/metrics")).send().await {
                Ok(response) => response.text().await.unwrap_or_default(),
                // Gone already: nothing left to drain.
                Err(_) => return true,
            };
            let busy = ["vllm:num_requests_running", "vllm:num_requests_waiting"]
                .iter()
                .map(|name| gauge(&text, name))
                .sum::<f64>();
            if busy == 0.0 {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
        false
    }
}

/// Whether growing `role`'s pool from `current` to `desired` is what the prompt work
/// arriving needs (`needed`, the planner's `demand.needed_now`): such growth does not wait
/// out a cooldown.
fn arrivals_ask(role: WorkerRole, desired: u64, current: u64, needed: Option<u64>) -> bool {
    role == WorkerRole::Prefill && desired > current && needed.is_some_and(|n| desired <= n)
}

fn pool_index(role: WorkerRole) -> usize {
    usize::from(role == WorkerRole::Decode)
}

/// The sum of `name`'s samples in a Prometheus text exposition.
fn gauge(text: &str, name: &str) -> f64 {
    text.lines()
        .filter(|l| l.starts_with(name) && l[name.len()..].starts_with([' ', '{']))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::{arrivals_ask, gauge};
    use pdserve_protocol::WorkerRole;

    #[test]
    fn only_prefill_growth_within_what_arrivals_need_skips_the_cooldown() {
        let prefill = WorkerRole::Prefill;
        assert!(arrivals_ask(prefill, 3, 1, Some(3)));
        assert!(
            arrivals_ask(prefill, 2, 1, Some(3)),
            "towards it, within it"
        );
        assert!(
            !arrivals_ask(prefill, 4, 3, Some(3)),
            "past it: the misses' growth"
        );
        assert!(!arrivals_ask(prefill, 2, 1, None), "no rate known");
        assert!(!arrivals_ask(prefill, 1, 2, Some(3)), "shrinking waits");
        assert!(!arrivals_ask(prefill, 2, 2, Some(3)));
        assert!(
            !arrivals_ask(WorkerRole::Decode, 2, 1, Some(3)),
            "decode's is misses"
        );
    }

    #[test]
    fn a_gauge_is_summed_over_its_series_and_not_confused_with_a_longer_name() {
        let text = "# TYPE vllm:num_requests_running gauge\n\
                    vllm:num_requests_running{model_name=\"m\"} 2\n\
                    vllm:num_requests_running_total 7\n\
                    vllm:num_requests_waiting 1\n";
        assert_eq!(gauge(text, "vllm:num_requests_running"), 2.0);
        assert_eq!(gauge(text, "vllm:num_requests_waiting"), 1.0);
        assert_eq!(gauge(text, "vllm:absent"), 0.0);
    }
}
