//! What the latency predictor says of a request's routes through the live pools before
//! any worker is chosen: the best P/D route (the fastest prefill leg, then the decode
//! worker with the fastest first token among those predicted to meet the TPOT
//! objective), the best decode worker prefilling the prompt itself, and the best
//! prefill_decode worker. Shedding and SLO-aware disaggregation decide on it; it is known
//! only where the pools' policies predict (`--policy slo`, once trained).

use std::time::Duration;

use pdserve_protocol::WorkerRole;

use crate::fleet::registry::Roster;
use crate::ingress::slo::Slo;
use crate::policy::predictor::Forecast;
use crate::policy::RouteRequest;

use super::Serving;

/// One route's predicted latency, in milliseconds.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct RouteForecast {
    /// Time to first token.
    pub ttft_ms: f64,
    /// Time per output token, where predicted.
    pub tpot_ms: Option<f64>,
}

impl RouteForecast {
    /// Whether the route is predicted to meet `slo` (an objective the request does not
    /// set is met; an unpredicted TPOT meets its objective).
    pub fn meets(&self, slo: Slo) -> bool {
        let within = |predicted: f64, goal: Option<Duration>| {
            goal.is_none_or(|goal| predicted <= goal.as_secs_f64() * 1000.0)
        };
        within(self.ttft_ms, slo.ttft) && self.tpot_ms.is_none_or(|tpot| within(tpot, slo.tpot))
    }

    /// How far past `slo`'s TTFT objective the first token is predicted.
    pub fn ttft_excess(&self, slo: Slo) -> Duration {
        let goal = slo.ttft.map_or(f64::INFINITY, |g| g.as_secs_f64() * 1000.0);
        Duration::from_secs_f64(((self.ttft_ms - goal) / 1000.0).clamp(0.0, 86_400.0))
    }
}

/// The best predicted routes of one request (see the module documentation).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Outlook {
    /// Through a prefill worker, then a decode worker.
    pub disaggregated: Option<RouteForecast>,
    /// On a decode worker alone, which prefills the prompt itself.
    pub local: Option<RouteForecast>,
    /// On a prefill_decode worker.
    pub aggregated: Option<RouteForecast>,
}

impl Outlook {
    /// The outlook of `route` over `roster`'s live workers.
    pub fn of(state: &Serving, roster: &Roster, route: &RouteRequest<'_>) -> Self {
        let forecasts = |role| {
            let live = roster.live(role);
            state.policy(role).forecast(role, live, route)
        };
        let slo = route.slo;
        let decode = forecasts(WorkerRole::Decode);
        let prefill_ttft = forecasts(WorkerRole::Prefill).and_then(|pool| {
            pool.iter()
                .filter_map(|f| f.ttft)
                .min_by(|a, b| a.total_cmp(b))
        });
        let after_transfer = decode
            .as_deref()
            .and_then(|pool| best(pool, |f| f.ttft, slo));
        let disaggregated = prefill_ttft
            .zip(after_transfer)
            .map(|(p, d)| RouteForecast {
                ttft_ms: p + d.ttft_ms,
                tpot_ms: d.tpot_ms,
            });
        Self {
            disaggregated,
            local: decode
                .as_deref()
                .and_then(|pool| best(pool, |f| f.ttft_local, slo)),
            aggregated: forecasts(WorkerRole::PrefillDecode)
                .and_then(|pool| best(&pool, |f| f.ttft, slo)),
        }
    }

    /// The routes open to the request: P/D (and, with conditional disaggregation, a
    /// decode worker prefilling alone) when the fleet disaggregates, else aggregated.
    pub fn open_routes(&self, disaggregates: bool, local_allowed: bool) -> Vec<RouteForecast> {
        if disaggregates {
            let local = self.local.filter(|_| local_allowed);
            self.disaggregated.into_iter().chain(local).collect()
        } else {
            self.aggregated.into_iter().collect()
        }
    }
}

/// The route in `pool` with the fastest first token (read by `ttft`) among those meeting
/// the TPOT objective, else among all.
fn best(
    pool: &[Forecast],
    ttft: impl Fn(&Forecast) -> Option<f64>,
    slo: Slo,
) -> Option<RouteForecast> {
    let routes = pool.iter().filter_map(|f| {
        ttft(f).map(|ttft_ms| RouteForecast {
            ttft_ms,
            tpot_ms: f.tpot,
        })
    });
    let fastest = |routes: Vec<RouteForecast>| {
        routes
            .into_iter()
            .min_by(|a, b| a.ttft_ms.total_cmp(&b.ttft_ms))
    };
    let all: Vec<RouteForecast> = routes.collect();
    let tpot_only = Slo {
        ttft: None,
        tpot: slo.tpot,
    };
    let meeting: Vec<RouteForecast> = all.iter().copied().filter(|r| r.meets(tpot_only)).collect();
    fastest(meeting).or_else(|| fastest(all))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(ttft: f64, local: f64, tpot: f64) -> Forecast {
        Forecast {
            held: 0,
            ttft: Some(ttft),
            ttft_local: Some(local),
            tpot: Some(tpot),
        }
    }

    fn slo(ttft: u64, tpot: u64) -> Slo {
        Slo {
            ttft: Some(Duration::from_millis(ttft)),
            tpot: Some(Duration::from_millis(tpot)),
        }
    }

    #[test]
    fn the_fastest_first_token_among_those_meeting_tpot() {
        let pool = [
            f(10.0, 300.0, 80.0),
            f(40.0, 200.0, 30.0),
            f(60.0, 100.0, 20.0),
        ];
        let route = best(&pool, |f| f.ttft, slo(500, 50)).unwrap();
        assert_eq!(
            route,
            RouteForecast {
                ttft_ms: 40.0,
                tpot_ms: Some(30.0)
            }
        );
        // Without a TPOT objective the fastest wins.
        let route = best(&pool, |f| f.ttft, Slo::default()).unwrap();
        assert_eq!(route.ttft_ms, 10.0);
        // None meets TPOT: the fastest of all.
        let route = best(&pool, |f| f.ttft_local, slo(500, 5)).unwrap();
        assert_eq!(route.ttft_ms, 100.0);
        assert!(best(&[Forecast::default()], |f| f.ttft, slo(1, 1)).is_none());
    }

    #[test]
    fn meeting_and_missing_an_objective() {
        let route = RouteForecast {
            ttft_ms: 700.0,
            tpot_ms: Some(30.0),
        };
        assert!(!route.meets(slo(500, 50)));
        assert!(route.meets(slo(800, 50)));
        assert!(!route.meets(slo(800, 20)));
        assert!(route.meets(Slo::default()));
        assert_eq!(route.ttft_excess(slo(500, 50)), Duration::from_millis(200));
        assert_eq!(route.ttft_excess(slo(900, 50)), Duration::ZERO);
    }

    #[test]
    fn local_prefill_is_a_route_only_where_allowed() {
        let outlook = Outlook {
            disaggregated: Some(RouteForecast {
                ttft_ms: 900.0,
                tpot_ms: Some(20.0),
            }),
            local: Some(RouteForecast {
                ttft_ms: 100.0,
                tpot_ms: Some(40.0),
            }),
            aggregated: None,
        };
        assert_eq!(outlook.open_routes(true, true).len(), 2);
        assert_eq!(outlook.open_routes(true, false).len(), 1);
        assert!(outlook.open_routes(false, true).is_empty());
    }
}
