//! A TCP relay that emulates a WAN link the way the papers used Dummynet: each direction delays
//! every byte by a fixed one-way delay, and optionally serialises it at a link rate.
//!
//! Each direction is a reader that stamps every chunk it receives with the time it is due at the
//! far end, and a writer that sleeps until a chunk is due and forwards it. The delay is added
//! once per chunk as latency, not once per read as a sleep, so throughput at zero delay is that
//! of loopback and at a delay D it is bounded only by the TCP windows, as on a real link.

use std::net::SocketAddr;
use std::time::Duration;

use bytes::{Bytes, BytesMut};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio::time::Instant;

/// The emulated link.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Link {
    /// One-way delay, added in each direction.
    pub delay: Duration,
    /// Link rate in bits per second, each direction; `None` for unlimited.
    pub rate_bps: Option<u64>,
}

/// Chunks in flight per direction before the reader stops reading (and TCP pushes back).
const QUEUE_CHUNKS: usize = 4096;
/// The largest chunk read at once.
const CHUNK: usize = 64 * 1024;

/// A running proxy.
#[derive(Debug)]
pub struct Proxy {
    /// The address it listens on.
    pub local_addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Proxy {
    /// Listens on `listen` and relays every connection to `to` over `link`.
    pub async fn start(listen: &str, to: &str, link: Link) -> std::io::Result<Proxy> {
        let listener = TcpListener::bind(listen).await?;
        let local_addr = listener.local_addr()?;
        let to = to.to_string();
        let task = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let to = to.clone();
                tokio::spawn(async move {
                    match TcpStream::connect(&to).await {
                        Ok(server) => relay(client, server, link).await,
                        Err(e) => tracing::warn!("proxy: cannot reach {to}: {e}"),
                    }
                });
            }
        });
        Ok(Proxy { local_addr, task })
    }
}

async fn relay(client: TcpStream, server: TcpStream, link: Link) {
    let _ = client.set_nodelay(true);
    let _ = server.set_nodelay(true);
    let (cr, cw) = client.into_split();
    let (sr, sw) = server.into_split();
    let up = tokio::spawn(direction(cr, sw, link));
    let down = tokio::spawn(direction(sr, cw, link));
    let _ = tokio::join!(up, down);
}

/// One direction: read, stamp with the due time, deliver when due.
async fn direction(mut r: OwnedReadHalf, mut w: OwnedWriteHalf, link: Link) {
    let (tx, mut rx) = mpsc::channel::<(Instant, Bytes)>(QUEUE_CHUNKS);
    let reader = async move {
        let mut link_free = Instant::now();
        let mut buf = BytesMut::with_capacity(CHUNK);
        loop {
            buf.reserve(CHUNK);
            match r.read_buf(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(_) => {}
            }
            let now = Instant::now();
            let chunk = buf.split().freeze();
            // Serialisation: the chunk occupies the link after what is already on it.
            if let Some(bps) = link.rate_bps {
                let start = link_free.max(now);
                link_free = start
                    + Duration::from_nanos(
                        (chunk.len() as u64 * 8).saturating_mul(1_000_000_000) / bps.max(1),
                    );
            } else {
                link_free = now;
            }
            if tx.send((link_free + link.delay, chunk)).await.is_err() {
                break;
            }
        }
    };
    let writer = async move {
        while let Some((due, chunk)) = rx.recv().await {
            tokio::time::sleep_until(due).await;
            if w.write_all(&chunk).await.is_err() {
                break;
            }
        }
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Parses a duration such as `16ms`, `1.5s`, `250us` or `0`.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let s = s.trim();
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let v: f64 = num
        .parse()
        .map_err(|_| format!("{s:?} is not a duration (e.g. 16ms, 10s)"))?;
    let secs = match unit {
        "" | "s" => v,
        "ms" => v / 1e3,
        "us" => v / 1e6,
        "m" | "min" => v * 60.0,
        _ => return Err(format!("{s:?}: unknown unit {unit:?} (use us, ms, s or m)")),
    };
    if !secs.is_finite() || secs < 0.0 {
        return Err(format!("{s:?} is not a duration"));
    }
    Ok(Duration::from_secs_f64(secs))
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
        assert!(parse_duration("3h").is_err());
        assert_eq!(parse_rate("1gbit"), Ok(1_000_000_000));
        assert_eq!(parse_rate("100Mbit"), Ok(100_000_000));
        assert!(parse_rate("0").is_err());
        assert!(parse_rate("1gb").is_err());
    }
}
