//! Repeated authentication failures slowed per source address.
//!
//! A CHAP secret of 12 to 16 bytes is strong only if guessing is slow. After the second failure
//! from an address, every new login from it waits for a turn: turns are spaced by a delay that
//! doubles with each failure (200 ms, 400 ms, ... up to [`MAX_DELAY`]), so parallel connections
//! from one address do not multiply its guesses (each waits for its own turn, and a login that
//! waits past `server.login_timeout` is dropped). An address is forgotten [`FORGET_AFTER`] its
//! last failure. At most [`MAX_SOURCES`] addresses are remembered, so a flood of sources costs
//! bounded memory (the one failing longest ago is forgotten first).
//!
//! The policy takes `now` from its caller, so it is tested on a virtual clock.

use std::collections::HashMap;
use std::net::IpAddr;
use std::time::{Duration, Instant};

/// The longest spacing between two logins of one address.
pub const MAX_DELAY: Duration = Duration::from_secs(5);
/// How long an address's failures are remembered after its last one.
pub const FORGET_AFTER: Duration = Duration::from_secs(600);
/// Addresses remembered at most.
pub const MAX_SOURCES: usize = 4096;

#[derive(Debug, Clone, Copy)]
struct Source {
    failures: u32,
    last: Instant,
    /// The earliest time the next login of this address may start.
    next_turn: Instant,
}

/// Authentication failures by source address.
#[derive(Debug, Default)]
pub struct AuthThrottle {
    sources: HashMap<IpAddr, Source>,
    /// Failures recorded in all.
    pub failures: u64,
}

/// The spacing of logins after `failures` failures.
pub fn delay(failures: u32) -> Duration {
    if failures < 2 {
        return Duration::ZERO;
    }
    let ms = 100u64.saturating_mul(1 << (failures - 1).min(16));
    Duration::from_millis(ms).min(MAX_DELAY)
}

impl AuthThrottle {
    /// How long a login from `ip` starting at `now` waits for its turn (zero for an address
    /// with fewer than two recent failures); the turn after it is taken.
    pub fn admit(&mut self, ip: IpAddr, now: Instant) -> Duration {
        let Some(s) = self.sources.get_mut(&ip) else {
            return Duration::ZERO;
        };
        if now.saturating_duration_since(s.last) >= FORGET_AFTER {
            self.sources.remove(&ip);
            return Duration::ZERO;
        }
        let d = delay(s.failures);
        if d.is_zero() {
            return d;
        }
        let turn = s.next_turn.max(now);
        s.next_turn = turn + d;
        turn - now
    }

    /// A login from `ip` failed authentication at `now`.
    pub fn failed(&mut self, ip: IpAddr, now: Instant) {
        self.failures += 1;
        if !self.sources.contains_key(&ip) && self.sources.len() >= MAX_SOURCES {
            self.sources
                .retain(|_, s| now.saturating_duration_since(s.last) < FORGET_AFTER);
            if self.sources.len() >= MAX_SOURCES {
                if let Some(oldest) = self.sources.iter().min_by_key(|(_, s)| s.last) {
                    let oldest = *oldest.0;
                    self.sources.remove(&oldest);
                }
            }
        }
        let s = self.sources.entry(ip).or_insert(Source {
            failures: 0,
            last: now,
            next_turn: now,
        });
        s.failures = s.failures.saturating_add(1);
        s.last = now;
        s.next_turn = s.next_turn.max(now + delay(s.failures));
    }

    /// Addresses remembered now.
    pub fn sources(&self) -> usize {
        self.sources.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(n: u32) -> IpAddr {
        IpAddr::from(n.to_be_bytes())
    }

    #[test]
    fn the_delay_doubles_from_the_second_failure_up_to_a_bound() {
        let ms = |n| delay(n).as_millis();
        assert_eq!((ms(0), ms(1), ms(2), ms(3), ms(4)), (0, 0, 200, 400, 800));
        assert_eq!(delay(7), MAX_DELAY);
        assert_eq!(delay(u32::MAX), MAX_DELAY);
    }

    #[test]
    fn parallel_logins_of_a_failing_address_take_turns() {
        let t0 = Instant::now();
        let mut t = AuthThrottle::default();
        assert_eq!(t.admit(ip(1), t0), Duration::ZERO, "unknown");
        t.failed(ip(1), t0);
        assert_eq!(t.admit(ip(1), t0), Duration::ZERO, "one failure is a typo");
        t.failed(ip(1), t0);
        t.failed(ip(1), t0);
        // Three failures: turns 400 ms apart, the first after the last failure's delay.
        let waits: Vec<_> = (0..4).map(|_| t.admit(ip(1), t0).as_millis()).collect();
        assert_eq!(waits, [400, 800, 1200, 1600]);
        assert_eq!(
            t.admit(ip(2), t0),
            Duration::ZERO,
            "another address is not slowed"
        );
        // Later logins wait only for what is left of the queue.
        let later = t0 + Duration::from_secs(10);
        assert_eq!(t.admit(ip(1), later), Duration::ZERO);
        assert_eq!(t.admit(ip(1), later).as_millis(), 400);
        // Forgotten after a quiet while.
        assert_eq!(t.admit(ip(1), t0 + FORGET_AFTER), Duration::ZERO);
        assert_eq!(t.sources(), 0);
        assert_eq!(t.failures, 3);
    }

    #[test]
    fn memory_stays_bounded_under_a_flood_of_sources() {
        let t0 = Instant::now();
        let mut t = AuthThrottle::default();
        for n in 0..(MAX_SOURCES as u32 + 100) {
            t.failed(ip(n), t0 + Duration::from_millis(u64::from(n)));
        }
        assert_eq!(t.sources(), MAX_SOURCES);
        // The newest are kept.
        t.failed(ip(MAX_SOURCES as u32 + 99), t0 + Duration::from_secs(100));
        let newest = ip(MAX_SOURCES as u32 + 99);
        assert!(t.admit(newest, t0 + Duration::from_secs(100)) > Duration::ZERO);
    }
}
