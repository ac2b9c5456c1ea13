//! A TCP relay that emulates a WAN link the way the papers used Dummynet: each direction delays
//! every byte by a fixed one-way delay, and optionally serialises it at a link rate.
//!
//! Each direction is a reader that stamps every chunk it receives with the time it is due at the
//! far end, and a writer that sleeps until a chunk is due and forwards it. The delay is added
//! once per chunk as latency, not once per read as a sleep, so throughput at zero delay is that
//! of loopback and at a delay D it is bounded only by the TCP windows, as on a real link.
//!
//! For fault tests a [`Cut`] ends every relayed connection once a given number of bytes has
//! passed in one direction (mid-Data-Out or mid-Data-In): both sockets are shut down, as when a
//! link or a switch port dies.
//!
//! The data path runs on plain threads with blocking sockets: `thread::sleep` wakes within about
//! 0.1 ms of its deadline, where tokio's timer wheel rounds up to the next millisecond, which
//! would add up to 1 ms to every emulated delay.

use std::io::{Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{sync_channel, Receiver};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// The emulated link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// One-way delay, added in each direction.
    pub delay: Duration,
    /// Link rate in bits per second, each direction; `None` for unlimited.
    pub rate_bps: Option<u64>,
}

/// Where relayed connections are cut: after this many bytes from the initiator (upstream) or
/// from the target (downstream), counted per connection. The bytes up to the cut are delivered;
/// then both sockets are shut down.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Cut {
    /// Bytes from the initiator to the target before the cut.
    pub upstream: Option<u64>,
    /// Bytes from the target to the initiator before the cut.
    pub downstream: Option<u64>,
}

/// Chunks in flight per direction before the reader stops reading (and TCP pushes back).
const QUEUE_CHUNKS: usize = 4096;
/// The largest chunk read at once.
const CHUNK: usize = 64 * 1024;

/// A running proxy; dropping it stops accepting (relayed connections run until they close).
#[derive(Debug)]
pub struct Proxy {
    /// The address it listens on.
    pub local_addr: SocketAddr,
    stop: Arc<AtomicBool>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        // Wake the accept loop so it sees the flag.
        let _ = TcpStream::connect(self.local_addr);
    }
}

impl Proxy {
    /// Listens on `listen` and relays every connection to `to` over `link`.
    pub async fn start(listen: &str, to: &str, link: Link) -> std::io::Result<Proxy> {
        Proxy::start_with_cut(listen, to, link, Cut::default()).await
    }

    /// As [`Proxy::start`], cutting every relayed connection where `cut` says.
    pub async fn start_with_cut(
        listen: &str,
        to: &str,
        link: Link,
        cut: Cut,
    ) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(listen)?;
        let local_addr = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let (to, flag) = (to.to_string(), stop.clone());
        std::thread::Builder::new()
            .name("proxy-accept".into())
            .spawn(move || {
                for client in listener.incoming() {
                    if flag.load(Ordering::Acquire) {
                        return;
                    }
                    let Ok(client) = client else { continue };
                    match TcpStream::connect(&to) {
                        Ok(server) => relay(client, server, link, cut),
                        Err(e) => tracing::warn!("proxy: cannot reach {to}: {e}"),
                    }
                }
            })?;
        Ok(Proxy { local_addr, stop })
    }
}

/// Starts both directions of one relayed connection.
fn relay(client: TcpStream, server: TcpStream, link: Link, cut: Cut) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    for (from, to, limit) in [
        (&client, &server, cut.upstream),
        (&server, &client, cut.downstream),
    ] {
        match (from.try_clone(), to.try_clone()) {
            (Ok(from), Ok(to)) => direction(from, to, link, limit),
            _ => tracing::warn!("proxy: cannot clone a socket"),
        }
    }
}

/// One direction: a reader thread stamps chunks with their due time, a writer thread delivers
/// them when due.
fn direction(mut from: TcpStream, mut to: TcpStream, link: Link, limit: Option<u64>) {
    let (tx, rx) = sync_channel::<(Instant, Vec<u8>)>(QUEUE_CHUNKS);
    // The writer cuts the connection once the last byte before the cut is delivered.
    let cut = match limit.map(|_| from.try_clone()) {
        Some(Ok(s)) => Some(s),
        Some(Err(e)) => {
            tracing::warn!("proxy: cannot clone a socket: {e}");
            return;
        }
        None => None,
    };
    let spawn = |name: &str, f: Box<dyn FnOnce() + Send>| {
        if let Err(e) = std::thread::Builder::new()
            .name(name.into())
            .stack_size(64 * 1024)
            .spawn(f)
        {
            tracing::warn!("proxy: cannot start a thread: {e}");
        }
    };
    spawn(
        "proxy-read",
        Box::new(move || {
            let mut link_free = Instant::now();
            let mut buf = vec![0u8; CHUNK];
            let mut left = limit.unwrap_or(u64::MAX);
            while left > 0 {
                let n = match from.read(&mut buf) {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n.min(usize::try_from(left).unwrap_or(usize::MAX)),
                };
                left -= n as u64;
                let now = Instant::now();
                // Serialisation: the chunk occupies the link after what is already on it.
                link_free = match link.rate_bps {
                    Some(bps) => {
                        let wire = Duration::from_nanos(
                            (n as u64 * 8).saturating_mul(1_000_000_000) / bps.max(1),
                        );
                        link_free.max(now) + wire
                    }
                    None => now,
                };
                if tx
                    .send((link_free + link.delay, buf[..n].to_vec()))
                    .is_err()
                {
                    break;
                }
            }
        }),
    );
    spawn(
        "proxy-write",
        Box::new(move || {
            deliver(rx, &mut to);
            if let Some(from) = cut {
                // The reader stopped at the cut (or its peer closed first): the link is gone.
                let _ = from.shutdown(Shutdown::Both);
                let _ = to.shutdown(Shutdown::Both);
            }
        }),
    );
}

fn deliver(rx: Receiver<(Instant, Vec<u8>)>, to: &mut TcpStream) {
    while let Ok((due, chunk)) = rx.recv() {
        let now = Instant::now();
        if due > now {
            std::thread::sleep(due - now);
        }
        if to.write_all(&chunk).is_err() {
            break;
        }
    }
    let _ = to.shutdown(Shutdown::Write);
}

/// Parses a duration such as `16ms`, `1.5s`, `250us`, `1h30m` or `0` (a bare number is
/// seconds): the grammar of targetd's config ([`units::parse_duration`]).
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    units::parse_duration(s)
}

/// Parses a rate such as `1gbit`, `100mbit`, `10kbit` or plain bits per second.
pub fn parse_rate(s: &str) -> Result<u64, String> {
    let lower = s.trim().to_ascii_lowercase();
    let split = lower
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(lower.len());
    let (num, unit) = lower.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a rate (e.g. 1gbit)"))?;
    let mult = match unit {
        "" | "bit" | "bps" => 1.0,
        "kbit" => 1e3,
        "mbit" => 1e6,
        "gbit" => 1e9,
        _ => {
            return Err(format!(
                "{s:?}: unknown unit {unit:?} (use kbit, mbit or gbit)"
            ))
        }
    };
    let bps = v * mult;
    if !(bps >= 1.0 && bps.is_finite()) {
        return Err(format!("{s:?} is not a positive rate"));
    }
    Ok(bps as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_durations_and_rates() {
        assert_eq!(parse_duration("16ms"), Ok(Duration::from_millis(16)));
        assert_eq!(parse_duration("0"), Ok(Duration::ZERO));
        assert_eq!(parse_duration("1.5s"), Ok(Duration::from_millis(1500)));
        assert_eq!(parse_duration("250us"), Ok(Duration::from_micros(250)));
        assert!(parse_duration("fast").is_err());
        assert_eq!(parse_duration("3h"), Ok(Duration::from_secs(3 * 3600)));
        assert!(parse_duration("3 fortnights").is_err());
        assert_eq!(parse_rate("1gbit"), Ok(1_000_000_000));
        assert_eq!(parse_rate("100Mbit"), Ok(100_000_000));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("1gb").is_err());
    }
}
