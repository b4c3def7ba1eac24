//! A simulated P/D link: with `--sim`, a pull of KV from a peer takes the time it would
//! take on the link the profile describes, not the loopback's.

use std::time::Duration;

/// The link's latency and bandwidth, and what a token's KV weighs on it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SimulatedLink {
    /// Fixed cost of one transfer.
    pub latency: Duration,
    /// Bytes a second.
    pub bytes_per_second: f64,
    /// Bytes of KV per token of the engine simulated (not of the sim's small blocks).
    pub kv_bytes_per_token: u64,
}

impl SimulatedLink {
    /// How long moving the KV of `tokens` tokens takes.
    pub fn transfer_time(&self, tokens: usize) -> Duration {
        let bytes = tokens as f64 * self.kv_bytes_per_token as f64;
        self.latency + Duration::from_secs_f64(bytes / self.bytes_per_second)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn latency_plus_bytes_over_bandwidth() {
        let link = SimulatedLink {
            latency: Duration::from_micros(100),
            bytes_per_second: 25e9,
            kv_bytes_per_token: 131_072,
        };
        // 2,000 tokens of Llama-3.1-8B KV (262 MB) over 25 GB/s: 10.5 ms.
        let t = link.transfer_time(2000).as_secs_f64();
        assert!(
            (t - (100e-6 + 2000.0 * 131_072.0 / 25e9)).abs() < 1e-9,
            "{t}"
        );
    }
}
