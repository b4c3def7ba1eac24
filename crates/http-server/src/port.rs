//! Picking a free port to hand to another process.

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::net::{Ipv4Addr, TcpListener};

/// Where picks start: above the well-known and common service ports.
const PICK_FLOOR: u16 = 20_000;
/// The start of Linux's default ephemeral range, when `/proc` does not say.
const DEFAULT_EPHEMERAL_LOW: u16 = 32_768;

/// A port on 127.0.0.1 that was free a moment ago, for a process started next to bind.
///
/// A port found by binding port 0 comes from the kernel's ephemeral range, and once
/// released the kernel may hand it out again at once — to another `bind(0)` or as the
/// source port of an outgoing connection — before the process it was meant for binds it.
/// Picks here come from below that range (random, checked bindable), where the kernel
/// never assigns ports on its own; only if that range is missing or full is a port-0 port
/// returned.
pub fn free_local_port() -> std::io::Result<u16> {
    let ephemeral_low = ephemeral_low();
    if ephemeral_low > PICK_FLOOR {
        let span = u64::from(ephemeral_low - PICK_FLOOR);
        let mut hasher = RandomState::new().build_hasher();
        hasher.write_u32(std::process::id());
        let start = hasher.finish();
        for attempt in 0..256u64 {
            // A stride coprime to most spans spreads the attempts over the range.
            let port = PICK_FLOOR + ((start + attempt * 7_919) % span) as u16;
            if TcpListener::bind((Ipv4Addr::LOCALHOST, port)).is_ok() {
                return Ok(port);
            }
        }
    }
    Ok(TcpListener::bind((Ipv4Addr::LOCALHOST, 0))?
        .local_addr()?
        .port())
}

/// The first port of the kernel's ephemeral range (`net.ipv4.ip_local_port_range`).
fn ephemeral_low() -> u16 {
    std::fs::read_to_string("/proc/sys/net/ipv4/ip_local_port_range")
        .ok()
        .and_then(|text| text.split_whitespace().next()?.parse().ok())
        .unwrap_or(DEFAULT_EPHEMERAL_LOW)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn picks_are_bindable_and_below_the_ephemeral_range() {
        let low = ephemeral_low();
        for _ in 0..20 {
            let port = free_local_port().unwrap();
            if low > PICK_FLOOR {
                assert!((PICK_FLOOR..low).contains(&port), "{port}");
            }
            TcpListener::bind((Ipv4Addr::LOCALHOST, port)).unwrap();
        }
    }
}
