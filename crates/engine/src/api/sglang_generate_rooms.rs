//! Which bootstrap room each output of a SGLang `/generate` request uses.
//!
//! SGLang normalises the bootstrap fields of a batch of `inputs` prompts with `n` samples
//! each: output `k = i + s * inputs` (input `i`, sample `s`) takes `room + k` from a single
//! room, `list[k]` from a list of `inputs * n`, and `list[i] + s` from a list of one room
//! per input. Host and port follow the same indexing (a single value is shared).

use pdserve_protocol::{ApiError, BootstrapParams, OneOrMany};

/// The bootstrap fields of input `i` of `inputs` for each of its `samples` samples; empty
/// without `bootstrap_room`.
pub(super) fn sample_rooms(
    hosts: &Option<OneOrMany<String>>,
    ports: &Option<OneOrMany<Option<u16>>>,
    rooms: &Option<OneOrMany<u64>>,
    i: usize,
    inputs: usize,
    samples: usize,
) -> Result<Vec<BootstrapParams>, ApiError> {
    let Some(rooms) = rooms else {
        return Ok(Vec::new());
    };
    let total = inputs * samples;
    let slot = |s: usize| i + s * inputs;
    let mismatch = |field: &str, len: usize| {
        ApiError::bad_request(format!(
            "{field} has {len} entries for {inputs} inputs of {samples} samples (give one, \
             one per input or one per output)"
        ))
        .with_param(field)
    };
    (0..samples)
        .map(|s| {
            let room = match rooms {
                OneOrMany::One(r) => r.checked_add(slot(s) as u64),
                OneOrMany::Many(list) if list.len() == total => Some(list[slot(s)]),
                OneOrMany::Many(list) if list.len() == inputs => list[i].checked_add(s as u64),
                OneOrMany::Many(list) => return Err(mismatch("bootstrap_room", list.len())),
            }
            .ok_or_else(|| {
                ApiError::bad_request("bootstrap_room + n overflows").with_param("bootstrap_room")
            })?;
            let host = value(hosts, i, slot(s), inputs, total)
                .transpose()
                .map_err(|len| mismatch("bootstrap_host", len))?;
            let port = value(ports, i, slot(s), inputs, total)
                .transpose()
                .map_err(|len| mismatch("bootstrap_port", len))?;
            Ok(BootstrapParams {
                bootstrap_room: room,
                bootstrap_host: host.unwrap_or_default(),
                bootstrap_port: port.flatten(),
            })
        })
        .collect()
}

/// Output `slot`'s (input `i`'s) value of a field given once, per output or per input;
/// `Err(len)` for a list of another length.
fn value<T: Clone>(
    field: &Option<OneOrMany<T>>,
    i: usize,
    slot: usize,
    inputs: usize,
    total: usize,
) -> Option<Result<T, usize>> {
    match field.as_ref()? {
        OneOrMany::One(v) => Some(Ok(v.clone())),
        OneOrMany::Many(list) if list.len() == total => Some(Ok(list[slot].clone())),
        OneOrMany::Many(list) if list.len() == inputs => Some(Ok(list[i].clone())),
        OneOrMany::Many(list) => Some(Err(list.len())),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rooms_of(rooms: OneOrMany<u64>, i: usize, inputs: usize, samples: usize) -> Vec<u64> {
        sample_rooms(&None, &None, &Some(rooms), i, inputs, samples)
            .unwrap()
            .into_iter()
            .map(|b| b.bootstrap_room)
            .collect()
    }

    #[test]
    fn one_room_counts_up_across_inputs_then_samples() {
        // Two inputs, three samples: input 1 gets outputs k = 1, 3, 5.
        assert_eq!(rooms_of(OneOrMany::One(100), 1, 2, 3), vec![101, 103, 105]);
        assert_eq!(rooms_of(OneOrMany::One(100), 0, 2, 3), vec![100, 102, 104]);
    }

    #[test]
    fn lists_per_output_and_per_input() {
        let per_output = OneOrMany::Many(vec![10, 11, 12, 13]);
        assert_eq!(rooms_of(per_output, 1, 2, 2), vec![11, 13]);
        let per_input = OneOrMany::Many(vec![10, 50]);
        assert_eq!(rooms_of(per_input, 1, 2, 3), vec![50, 51, 52]);
    }

    #[test]
    fn hosts_and_ports_follow_the_rooms() {
        let hosts = Some(OneOrMany::Many(vec!["a".to_string(), "b".to_string()]));
        let ports = Some(OneOrMany::One(Some(8998)));
        let got = sample_rooms(&hosts, &ports, &Some(OneOrMany::One(7)), 1, 2, 2).unwrap();
        assert_eq!(got.len(), 2);
        assert!(got
            .iter()
            .all(|b| b.bootstrap_host == "b" && b.bootstrap_port == Some(8998)));
        assert_eq!(
            sample_rooms(&hosts, &ports, &None, 0, 2, 2).unwrap().len(),
            0
        );
    }

    #[test]
    fn wrong_lengths_and_overflow_are_400s() {
        let err =
            sample_rooms(&None, &None, &Some(OneOrMany::Many(vec![1, 2, 3])), 0, 2, 2).unwrap_err();
        assert_eq!(err.body.error.param.as_deref(), Some("bootstrap_room"));
        let hosts = Some(OneOrMany::Many(vec!["a".to_string(); 3]));
        let err = sample_rooms(&hosts, &None, &Some(OneOrMany::One(1)), 0, 2, 2).unwrap_err();
        assert_eq!(err.body.error.param.as_deref(), Some("bootstrap_host"));
        let err = sample_rooms(&None, &None, &Some(OneOrMany::One(u64::MAX)), 1, 2, 1).unwrap_err();
        assert_eq!(err.body.error.param.as_deref(), Some("bootstrap_room"));
    }
}
