//! Reading and validating request traces in Mooncake's format (the FAST'25 Mooncake
//! traces, also replayed by Dynamo's and vLLM's benchmarks): one JSON object per line,
//!
//! ```json
//! {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, 48]}
//! ```
//!
//! `timestamp` is the send time in ms from the start of the trace, `input_length` and
//! `output_length` are token counts, and `hash_ids` name the prompt's 512-token blocks:
//! block i covers prompt tokens `[512 i, 512 (i + 1))`, the last one may be partial, and
//! two requests with the same id in the same position share that block's tokens (which is
//! how the trace encodes prefix reuse). Other fields (a session id, ...) are ignored.

use std::collections::HashMap;
use std::io::BufRead;
use std::path::{Path, PathBuf};

use serde::de::DeserializeOwned;
use serde::{Deserialize, Serialize, Serializer};
use serde_json::{Map, Value};

/// Tokens per hash block in Mooncake traces.
pub const BLOCK_TOKENS: u64 = 512;

/// One request of a trace.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TraceEntry {
    /// Send time, ms from the start of the trace (written as an integer when it is one,
    /// as Mooncake's files have it).
    #[serde(serialize_with = "integral_ms")]
    pub timestamp: f64,
    /// Prompt tokens.
    pub input_length: u64,
    /// Output tokens (`max_tokens`).
    pub output_length: u64,
    /// Ids of the prompt's 512-token blocks, in order.
    pub hash_ids: Vec<u64>,
}

impl TraceEntry {
    /// The most hash blocks a prompt of `input_length` tokens can have.
    pub fn max_blocks(input_length: u64) -> u64 {
        input_length.div_ceil(BLOCK_TOKENS)
    }
}

/// Writes whole milliseconds as integers (`27482`, not `27482.0`), as the traces do.
fn integral_ms<S: Serializer>(ms: &f64, s: S) -> Result<S::Ok, S::Error> {
    // Below 2^53 every integer is exact in an f64, so the cast loses nothing.
    if ms.fract() == 0.0 && (0.0..9.007_199_254_740_992e15).contains(ms) {
        s.serialize_u64(*ms as u64)
    } else {
        s.serialize_f64(*ms)
    }
}

/// A trace read from a file: its requests in send order.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    /// The requests, sorted by timestamp (stable: equal timestamps keep file order).
    pub entries: Vec<TraceEntry>,
    /// Lines whose timestamp was earlier than one before them (they were moved).
    pub out_of_order: usize,
}

/// What is wrong with one line of a trace.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum LineProblem {
    /// The line does not parse as JSON.
    #[error("not JSON: {0}")]
    NotJson(String),
    /// The line is JSON, but not an object.
    #[error("not a JSON object")]
    NotObject,
    /// A required field is absent.
    #[error("missing field `{0}`")]
    MissingField(&'static str),
    /// A field has the wrong type or an impossible value.
    #[error("field `{field}`: {reason}")]
    BadField {
        /// The field.
        field: &'static str,
        /// What is wrong with its value.
        reason: String,
    },
    /// More hash blocks than the prompt has tokens for.
    #[error(
        "{blocks} hash_ids are too many for input_length {input_length}: at most {} blocks \
         of {BLOCK_TOKENS} tokens",
        TraceEntry::max_blocks(*input_length)
    )]
    TooManyBlocks {
        /// `hash_ids.len()`.
        blocks: u64,
        /// `input_length`.
        input_length: u64,
    },
    /// `input_length` is 0: there is no prompt to send.
    #[error("input_length is 0 (a request needs a prompt)")]
    NoInput,
    /// `output_length` is 0: nothing to generate.
    #[error("output_length is 0 (a request must ask for at least one token)")]
    NoOutput,
}

/// Why a trace could not be read.
#[derive(Debug, thiserror::Error)]
pub enum TraceError {
    /// The file could not be opened or read.
    #[error("trace {}: {reason}", path.display())]
    Io {
        /// The file.
        path: PathBuf,
        /// What went wrong.
        reason: String,
    },
    /// A line is not a valid request.
    #[error("trace {} line {line}: {problem}", path.display())]
    Line {
        /// The file.
        path: PathBuf,
        /// The line, from 1.
        line: usize,
        /// What is wrong with it.
        problem: LineProblem,
    },
    /// The file holds no request (only blank lines, or none).
    #[error("trace {}: no requests", path.display())]
    Empty {
        /// The file.
        path: PathBuf,
    },
}

/// Reads the first `limit` requests (all without a limit) of the trace at `path`:
/// blank lines are skipped, every other line must be a valid request, and the requests
/// come back sorted by timestamp. Lines after the limit are not read, so a large trace
/// can be sampled cheaply.
pub fn read_trace(path: &Path, limit: Option<u64>) -> Result<Trace, TraceError> {
    let file = std::fs::File::open(path).map_err(|e| TraceError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    })?;
    parse_trace(std::io::BufReader::new(file), limit).map_err(|e| match e {
        ParseError::Io(reason) => TraceError::Io {
            path: path.to_path_buf(),
            reason,
        },
        ParseError::Line(line, problem) => TraceError::Line {
            path: path.to_path_buf(),
            line,
            problem,
        },
        ParseError::Empty => TraceError::Empty {
            path: path.to_path_buf(),
        },
    })
}

/// Why [`parse_trace`] failed (without the file name, which [`read_trace`] adds).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum ParseError {
    /// Reading failed.
    #[error("{0}")]
    Io(String),
    /// Line `.0` (from 1) is not a valid request.
    #[error("line {0}: {1}")]
    Line(usize, LineProblem),
    /// No requests.
    #[error("no requests")]
    Empty,
}

/// [`read_trace`] over any reader.
pub fn parse_trace(reader: impl BufRead, limit: Option<u64>) -> Result<Trace, ParseError> {
    let limit = limit.unwrap_or(u64::MAX);
    let mut entries = Vec::new();
    let mut out_of_order = 0usize;
    let mut latest = f64::NEG_INFINITY;
    for (i, line) in reader.lines().enumerate() {
        if entries.len() as u64 >= limit {
            break;
        }
        let number = i + 1;
        let line = line.map_err(|e| match e.kind() {
            // `lines` reports a line that is not UTF-8 as invalid data: that line's fault.
            std::io::ErrorKind::InvalidData => {
                ParseError::Line(number, LineProblem::NotJson("not UTF-8".into()))
            }
            _ => ParseError::Io(e.to_string()),
        })?;
        if line.trim().is_empty() {
            continue;
        }
        let entry = parse_line(&line).map_err(|p| ParseError::Line(number, p))?;
        if entry.timestamp < latest {
            out_of_order += 1;
        }
        latest = latest.max(entry.timestamp);
        entries.push(entry);
    }
    if entries.is_empty() {
        return Err(ParseError::Empty);
    }
    // `sort_by` is stable: requests at the same millisecond keep their file order.
    entries.sort_by(|a, b| a.timestamp.total_cmp(&b.timestamp));
    Ok(Trace {
        entries,
        out_of_order,
    })
}

/// One line as a request, checked.
pub fn parse_line(line: &str) -> Result<TraceEntry, LineProblem> {
    let value: Value = serde_json::from_str(line).map_err(|e| {
        // serde_json ends its message with "at line 1 column N"; on one line only the
        // column means anything.
        let text = e.to_string();
        let position = format!(" at line {} column {}", e.line(), e.column());
        let text = text.strip_suffix(&position).unwrap_or(&text);
        LineProblem::NotJson(format!("{text} at column {}", e.column()))
    })?;
    let Value::Object(object) = value else {
        return Err(LineProblem::NotObject);
    };
    let timestamp: f64 = field(&object, "timestamp")?;
    if !timestamp.is_finite() || timestamp < 0.0 {
        return Err(LineProblem::BadField {
            field: "timestamp",
            reason: format!("{timestamp} is not a time in ms from the trace start (>= 0)"),
        });
    }
    let entry = TraceEntry {
        timestamp,
        input_length: field(&object, "input_length")?,
        output_length: field(&object, "output_length")?,
        hash_ids: field(&object, "hash_ids")?,
    };
    if entry.input_length == 0 {
        return Err(LineProblem::NoInput);
    }
    if entry.output_length == 0 {
        return Err(LineProblem::NoOutput);
    }
    let blocks = entry.hash_ids.len() as u64;
    if blocks > TraceEntry::max_blocks(entry.input_length) {
        return Err(LineProblem::TooManyBlocks {
            blocks,
            input_length: entry.input_length,
        });
    }
    Ok(entry)
}

/// Field `name` of `object` as a `T`. Deserialized field by field (not as a struct) so
/// that a type error names its field, which serde's derived errors do not.
fn field<T: DeserializeOwned>(
    object: &Map<String, Value>,
    name: &'static str,
) -> Result<T, LineProblem> {
    let value = object.get(name).ok_or(LineProblem::MissingField(name))?;
    serde_json::from_value(value.clone()).map_err(|e| LineProblem::BadField {
        field: name,
        reason: e.to_string(),
    })
}

/// The share of the trace's prompt tokens that an earlier request already sent as the
/// same prefix: the hit rate of an unbounded prefix cache, to hold the server's reported
/// cached share against. Prefixes are matched as sequences of hash ids (a trie), block by
/// block, each block up to the most tokens an earlier request sent of it there.
pub fn reusable_token_share(entries: &[TraceEntry]) -> Option<f64> {
    // (parent node, hash id) → (node, the most tokens of that block sent at that place).
    let mut trie: HashMap<(u64, u64), (u64, u64)> = HashMap::new();
    const ROOT: u64 = 0;
    let (mut reusable, mut total) = (0u64, 0u64);
    for entry in entries {
        total += entry.input_length;
        let mut left = entry.input_length;
        let mut parent = ROOT;
        let mut matching = true;
        for &id in &entry.hash_ids {
            let n = left.min(BLOCK_TOKENS);
            left -= n;
            let fresh = trie.len() as u64 + 1;
            let (node, before) = trie.entry((parent, id)).or_insert((fresh, 0));
            if matching {
                reusable += (*before).min(n);
                // A block sent shorter before matches only that far: the rest is new.
                matching = *before >= n;
            }
            *before = (*before).max(n);
            parent = *node;
        }
    }
    (total > 0).then(|| reusable as f64 / total as f64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn whole_milliseconds_are_written_as_integers() {
        let mut entry = TraceEntry {
            timestamp: 27482.0,
            input_length: 600,
            output_length: 5,
            hash_ids: vec![1, 2],
        };
        let text = serde_json::to_string(&entry).unwrap();
        assert_eq!(
            text,
            r#"{"timestamp":27482,"input_length":600,"output_length":5,"hash_ids":[1,2]}"#
        );
        assert_eq!(parse_line(&text).unwrap(), entry);
        entry.timestamp = 1.5;
        let text = serde_json::to_string(&entry).unwrap();
        assert!(text.contains(r#""timestamp":1.5"#), "{text}");
        assert_eq!(parse_line(&text).unwrap(), entry);
    }

    #[test]
    fn reusable_share_counts_prefixes_seen_before() {
        let e = |input_length, ids: &[u64]| TraceEntry {
            timestamp: 0.0,
            input_length,
            output_length: 1,
            hash_ids: ids.to_vec(),
        };
        let entries = [
            e(1024, &[1, 2]),       // new
            e(1100, &[1, 2, 9]),    // 1024 seen, block 9 new
            e(1536, &[1, 9, 2]),    // 512: no 9 after 1 before
            e(1600, &[1, 2, 9, 5]), // 1024 + the 76 tokens of 9 sent before
            e(512, &[2]),           // block 2 at the start is another prefix
        ];
        let share = reusable_token_share(&entries).unwrap();
        let expected = (1024.0 + 512.0 + 1100.0) / (1024.0 + 1100.0 + 1536.0 + 1600.0 + 512.0);
        assert!((share - expected).abs() < 1e-12, "{share} vs {expected}");
    }
}
