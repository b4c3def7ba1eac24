//! DNS discovery against a resolver started by the test (UDP on 127.0.0.1): names that
//! gain an address are added, names that lose theirs (NXDOMAIN) removed, and a resolver
//! that fails or falls silent keeps the last roster.

use std::collections::HashMap;
use std::net::Ipv4Addr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hickory_proto::op::{Message, MessageType, ResponseCode};
use hickory_proto::rr::rdata::A;
use hickory_proto::rr::{RData, Record, RecordType};
use pdserve_gateway::fleet::discovery::parse_dns_target;
use pdserve_gateway::GatewayConfig;

use crate::double::{Double, Role};
use crate::{bounded, metric, Gateway, RosterRow};

/// How the stand-in resolver answers.
#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Answer,
    ServFail,
    Silent,
}

/// A DNS server for a few names, each with its A records (none: NXDOMAIN).
struct Resolver {
    addr: std::net::SocketAddr,
    names: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>>,
    mode: Arc<Mutex<Mode>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Resolver {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Resolver {
    async fn start() -> Self {
        let socket = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = socket.local_addr().unwrap();
        let names: Arc<Mutex<HashMap<String, Vec<Ipv4Addr>>>> = Arc::default();
        let mode = Arc::new(Mutex::new(Mode::Answer));
        let (n, m) = (names.clone(), mode.clone());
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((len, from)) = socket.recv_from(&mut buf).await else {
                    return;
                };
                let Ok(query) = Message::from_vec(&buf[..len]) else {
                    continue;
                };
                let mode = *m.lock().unwrap();
                if mode == Mode::Silent {
                    continue;
                }
                let reply = answer(&query, &n.lock().unwrap(), mode);
                let _ = socket.send_to(&reply.to_vec().unwrap(), from).await;
            }
        });
        Self {
            addr,
            names,
            mode,
            task,
        }
    }

    fn set(&self, name: &str, addresses: &[Ipv4Addr]) {
        self.names
            .lock()
            .unwrap()
            .insert(format!("{name}."), addresses.to_vec());
    }

    fn remove(&self, name: &str) {
        self.names.lock().unwrap().remove(&format!("{name}."));
    }

    fn mode(&self, mode: Mode) {
        *self.mode.lock().unwrap() = mode;
    }
}

fn answer(query: &Message, names: &HashMap<String, Vec<Ipv4Addr>>, mode: Mode) -> Message {
    let mut reply = Message::response(query.metadata.id, query.metadata.op_code);
    reply.metadata.message_type = MessageType::Response;
    reply.metadata.recursion_desired = query.metadata.recursion_desired;
    reply.metadata.recursion_available = true;
    reply.metadata.authoritative = true;
    reply.add_queries(query.queries.clone());
    if mode == Mode::ServFail {
        reply.metadata.response_code = ResponseCode::ServFail;
        return reply;
    }
    let Some(q) = query.queries.first() else {
        reply.metadata.response_code = ResponseCode::FormErr;
        return reply;
    };
    let name = q.name().to_ascii().to_lowercase();
    match names.get(&name) {
        Some(addresses) if !addresses.is_empty() => {
            if q.query_type() == RecordType::A {
                for ip in addresses {
                    reply.add_answer(Record::from_rdata(q.name().clone(), 0, RData::A(A(*ip))));
                }
            }
            // AAAA: the name exists with no IPv6 address (NOERROR, no answers).
        }
        // Known with no address (NODATA) or unknown (NXDOMAIN).
        Some(_) => {}
        None => reply.metadata.response_code = ResponseCode::NXDomain,
    }
    reply
}

fn port_of(double: &Double) -> u16 {
    double.url.rsplit(':').next().unwrap().parse().unwrap()
}

async fn roster_becomes(gw: &Gateway, expected: &[RosterRow]) {
    gw.roster_becomes(expected, Instant::now()).await;
}

fn row(double: &Double, role: &str) -> RosterRow {
    (double.url.clone(), role.into(), "dns".into())
}

#[tokio::test]
async fn dns_names_add_and_remove_workers_and_a_failing_resolver_keeps_them() {
    bounded(async {
        let p = Double::start(Role::Prefill, "P").await;
        let d0 = Double::start(Role::Decode, "D0").await;
        let d1 = Double::start(Role::Decode, "D1").await;
        let dns = Resolver::start().await;
        let local = [Ipv4Addr::LOCALHOST];
        dns.set("prefill.pool.test", &local);
        dns.set("d0.pool.test", &local);
        let mut config = GatewayConfig::new(Vec::new(), Vec::new(), Vec::new());
        config.discovery.dns = vec![
            parse_dns_target(&format!("prefill=prefill.pool.test:{}", port_of(&p))).unwrap(),
            parse_dns_target(&format!("decode=d0.pool.test:{}", port_of(&d0))).unwrap(),
            parse_dns_target(&format!("decode=d1.pool.test:{}", port_of(&d1))).unwrap(),
        ];
        config.discovery.dns_server = Some(dns.addr);
        config.discovery.interval = Duration::from_millis(50);
        config.probe.timeout = Duration::from_millis(300);
        let gw = Gateway::start(config).await;

        roster_becomes(&gw, &[row(&p, "prefill"), row(&d0, "decode")]).await;
        assert_eq!(gw.chat_status().await, 200);

        // A name gains an address: added. Another loses it (NXDOMAIN): removed.
        dns.set("d1.pool.test", &local);
        let all = [row(&p, "prefill"), row(&d0, "decode"), row(&d1, "decode")];
        roster_becomes(&gw, &all).await;
        dns.remove("d0.pool.test");
        roster_becomes(&gw, &[row(&p, "prefill"), row(&d1, "decode")]).await;
        // A name that exists with no address (NODATA) has no workers either.
        dns.set("d0.pool.test", &local);
        roster_becomes(&gw, &all).await;
        dns.set("d0.pool.test", &[]);
        let kept = [row(&p, "prefill"), row(&d1, "decode")];
        roster_becomes(&gw, &kept).await;

        // SERVFAIL, then silence: counted as failures, the roster stays.
        for mode in [Mode::ServFail, Mode::Silent] {
            let errors = metric(
                &gw,
                r#"pdserve_gateway_discovery_errors_total{source="dns"}"#,
            )
            .await;
            dns.mode(mode);
            for _ in 0..300 {
                if metric(
                    &gw,
                    r#"pdserve_gateway_discovery_errors_total{source="dns"}"#,
                )
                .await
                    > errors
                {
                    break;
                }
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            assert!(
                metric(
                    &gw,
                    r#"pdserve_gateway_discovery_errors_total{source="dns"}"#
                )
                .await
                    > errors,
                "failed lookups are counted"
            );
            tokio::time::sleep(Duration::from_millis(200)).await;
            let mut expected = kept.to_vec();
            expected.sort();
            assert_eq!(gw.roster().await, expected);
        }
        // The resolver comes back with a change: applied.
        dns.mode(Mode::Answer);
        dns.set("d0.pool.test", &local);
        roster_becomes(&gw, &all).await;
    })
    .await;
}
