//! SGLang's bootstrap protocol on the embedded worker: a prefill worker started with
//! `--bootstrap-port` and a decode worker that both get the same request body, joined by
//! its `bootstrap_host` / `bootstrap_port` / `bootstrap_room` fields, either arriving
//! first.
//!
//! Design (pull by room): the prefill worker runs the prefill, publishes the prompt's KV
//! under the id `bootstrap-room-<room>` and keeps it for its decode worker; the decode
//! worker reads the room from the prefill worker's bootstrap port, a second
//! `pdserve-kv-transfer` listener ([`source::RoomSource`]) whose reads wait for their
//! room. Rooms meet in [`rooms::RoomTable`]; both sides wait bounded
//! (`--bootstrap-timeout-secs`) and nothing stays pinned when a side never shows up.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use pdserve_protocol::{ApiError, BootstrapParams, OneOrMany, TransportParams, WorkerRole};

use crate::metrics::Metrics;

pub(crate) mod decode;
pub(crate) mod prefill;
pub mod rooms;
pub mod source;

/// The engine id room reads name: the decode worker knows only the bootstrap address.
pub const BOOTSTRAP_ENGINE_ID: &str = "pdserve-bootstrap";

/// Longest wait of a room read for its prefill to arrive, whatever the flag says: the
/// reader waits at most 30 s for the answer frame (`kv::pull::IO_TIMEOUT`).
const MAX_READ_WAIT: Duration = Duration::from_secs(25);

/// The publication id of `room`.
pub fn room_id(room: u64) -> String {
    format!("bootstrap-room-{room}")
}

/// The room a publication id names, if it names one.
pub fn parse_room_id(id: &str) -> Option<u64> {
    id.strip_prefix("bootstrap-room-")?.parse().ok()
}

/// The bootstrap fields of a request with `choices` choices (`n`), one entry per choice,
/// or none when it carries no `bootstrap_room`. As SGLang reads them: a list gives each
/// choice its own value; one room for several choices stands for the rooms `room + i`
/// (a one-item list counts as that one room: the router's list per prompt, here one
/// prompt); one host or port serves every choice.
pub fn fields(
    transport: &TransportParams,
    choices: usize,
) -> Result<Vec<BootstrapParams>, ApiError> {
    let Some(rooms) = &transport.bootstrap_room else {
        return Ok(Vec::new());
    };
    let rooms = match rooms {
        OneOrMany::Many(list) if list.len() == choices => list.clone(),
        OneOrMany::One(room) => consecutive(*room, choices)?,
        OneOrMany::Many(list) if list.len() == 1 => consecutive(list[0], choices)?,
        OneOrMany::Many(list) => return Err(count_mismatch("bootstrap_room", list.len(), choices)),
    };
    let hosts = per_choice(transport.bootstrap_host.as_ref(), choices, "bootstrap_host")?;
    let ports = per_choice(transport.bootstrap_port.as_ref(), choices, "bootstrap_port")?;
    Ok(rooms
        .into_iter()
        .zip(hosts)
        .zip(ports)
        .map(|((room, host), port)| BootstrapParams {
            bootstrap_room: room,
            bootstrap_host: host.unwrap_or_default(),
            bootstrap_port: port.flatten(),
        })
        .collect())
}

/// The rooms `room`, `room + 1`, ... for `choices` choices (SGLang's reading of one room
/// for several samples).
fn consecutive(room: u64, choices: usize) -> Result<Vec<u64>, ApiError> {
    (0..choices as u64)
        .map(|i| room.checked_add(i))
        .collect::<Option<Vec<u64>>>()
        .ok_or_else(|| {
            ApiError::bad_request(format!("bootstrap_room {room} + n overflows"))
                .with_param("bootstrap_room")
        })
}

/// `field`'s value for each of `choices` choices: one value for all, or one each.
fn per_choice<T: Clone>(
    field: Option<&OneOrMany<T>>,
    choices: usize,
    name: &str,
) -> Result<Vec<Option<T>>, ApiError> {
    match field {
        None => Ok(vec![None; choices]),
        Some(OneOrMany::One(v)) => Ok(vec![Some(v.clone()); choices]),
        Some(OneOrMany::Many(list)) if list.len() == choices => {
            Ok(list.iter().cloned().map(Some).collect())
        }
        Some(OneOrMany::Many(list)) if list.len() == 1 => Ok(vec![Some(list[0].clone()); choices]),
        Some(OneOrMany::Many(list)) => Err(count_mismatch(name, list.len(), choices)),
    }
}

fn count_mismatch(field: &str, len: usize, choices: usize) -> ApiError {
    ApiError::bad_request(format!(
        "{field} has {len} entries for n={choices} choices (give one, or one per choice)"
    ))
    .with_param(field)
}

/// What the worker knows about SGLang's protocol: its role (`disaggregation_mode`), its
/// bootstrap rooms and port, and what `/server_info` reports.
#[derive(Debug)]
pub struct Bootstrap {
    /// This worker's role.
    pub role: WorkerRole,
    /// The model file (`model_path` and `tokenizer_path` in `/server_info`).
    pub model_path: String,
    /// KV cache capacity in tokens (`max_total_num_tokens`).
    pub max_total_tokens: usize,
    /// How long either side of a room waits for the other.
    pub timeout: Duration,
    rooms: Option<Arc<RoomTable>>,
    addr: Option<SocketAddr>,
    metrics: Arc<Metrics>,
}

pub use rooms::RoomTable;

impl Bootstrap {
    /// The worker's bootstrap state without a bootstrap port (decode, aggregated, or a
    /// prefill worker that takes no rooms).
    pub fn new(
        role: WorkerRole,
        model_path: String,
        max_total_tokens: usize,
        timeout: Duration,
        metrics: Arc<Metrics>,
    ) -> Self {
        Self {
            role,
            model_path,
            max_total_tokens,
            timeout,
            rooms: None,
            addr: None,
            metrics,
        }
    }

    /// Serves room reads of `service` on `listener` (the bootstrap port); returns the
    /// serving task. `config` is the KV transfer service's own (peers, secret).
    pub fn listen(
        &mut self,
        listener: tokio::net::TcpListener,
        service: Arc<crate::kv::KvService>,
        config: pdserve_kv_transfer::ServerConfig,
    ) -> std::io::Result<tokio::task::JoinHandle<()>> {
        let rooms = Arc::new(RoomTable::new(self.metrics.clone()));
        let wait = self.timeout.min(MAX_READ_WAIT);
        let source = Arc::new(source::RoomSource::new(service, rooms.clone(), wait));
        self.addr = Some(listener.local_addr()?);
        self.rooms = Some(rooms);
        Ok(tokio::spawn(pdserve_kv_transfer::server::serve(
            listener,
            source,
            config,
            std::future::pending(),
        )))
    }

    /// The bootstrap port's address, when this worker listens on one.
    pub fn addr(&self) -> Option<SocketAddr> {
        self.addr
    }

    /// Rooms open now (0 without a bootstrap port).
    pub fn open_rooms(&self) -> usize {
        self.rooms.as_ref().map_or(0, |r| r.open_rooms())
    }

    /// SGLang's `disaggregation_mode`: `prefill`, `decode` or `null`.
    pub fn disaggregation_mode(&self) -> &'static str {
        match self.role {
            WorkerRole::Prefill => "prefill",
            WorkerRole::Decode => "decode",
            _ => "null",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn transport(v: serde_json::Value) -> TransportParams {
        serde_json::from_value(v).unwrap()
    }

    fn rooms(v: serde_json::Value, choices: usize) -> Result<Vec<u64>, ApiError> {
        let fields = fields(&transport(v), choices)?;
        Ok(fields.into_iter().map(|f| f.bootstrap_room).collect())
    }

    #[test]
    fn each_choice_gets_its_room_as_sglang_reads_the_fields() {
        assert!(fields(&transport(json!({"bootstrap_host": "h"})), 3)
            .unwrap()
            .is_empty());
        // One room per choice, as SGLang's router sends chat with n > 1.
        let f = fields(
            &transport(json!({
                "bootstrap_host": ["a", "b"],
                "bootstrap_port": [null, 7],
                "bootstrap_room": [5, 9],
            })),
            2,
        )
        .unwrap();
        let got: Vec<_> = f
            .iter()
            .map(|f| {
                (
                    f.bootstrap_host.as_str(),
                    f.bootstrap_port,
                    f.bootstrap_room,
                )
            })
            .collect();
        assert_eq!(got, [("a", None, 5), ("b", Some(7), 9)]);
        // One room for several choices: room + i (SGLang's normalisation).
        assert_eq!(
            rooms(json!({"bootstrap_room": 40}), 3).unwrap(),
            [40, 41, 42]
        );
        assert_eq!(rooms(json!({"bootstrap_room": [40]}), 2).unwrap(), [40, 41]);
        assert_eq!(rooms(json!({"bootstrap_room": 40}), 1).unwrap(), [40]);
        let f = fields(
            &transport(json!({"bootstrap_host": "h", "bootstrap_port": 8, "bootstrap_room": 1})),
            2,
        )
        .unwrap();
        assert!(f
            .iter()
            .all(|f| f.bootstrap_host == "h" && f.bootstrap_port == Some(8)));
    }

    #[test]
    fn mismatched_lists_are_refused_by_name() {
        let param = |v, n| rooms(v, n).unwrap_err().body.error.param.unwrap();
        assert_eq!(
            param(json!({"bootstrap_room": [1, 2, 3]}), 2),
            "bootstrap_room"
        );
        assert_eq!(
            param(
                json!({"bootstrap_room": [1, 2], "bootstrap_host": ["a", "b", "c"]}),
                2
            ),
            "bootstrap_host"
        );
        assert_eq!(
            param(json!({"bootstrap_room": u64::MAX}), 2),
            "bootstrap_room"
        );
    }
}
