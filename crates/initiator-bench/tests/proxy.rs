//! The delay proxy on loopback: the added one-way delay is within 1 ms of the setting, a delay is
//! latency and not a per-read sleep, and an unlimited link is not capped.
//!
//! The time bounds below are deliberately loose (ten times the margins a loaded machine needs);
//! they tell a working proxy from a broken design, they do not measure speed.

use std::time::{Duration, Instant};

use initiator_bench::proxy::{Link, Proxy};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// The tests take turns: the bulk transfers would otherwise disturb the delay measurement.
static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// A proxy on a free loopback port in front of `to`.
async fn proxy(to: &str, delay: Duration, rate_bps: Option<u64>) -> Proxy {
    Proxy::start("127.0.0.1:0", to, Link { delay, rate_bps })
        .await
        .unwrap()
}

/// An echo server on loopback; returns its address.
async fn echo() -> String {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = l.accept().await {
            tokio::spawn(async move {
                let mut buf = vec![0u8; 65536];
                loop {
                    match s.read(&mut buf).await {
                        Ok(0) | Err(_) => return,
                        Ok(n) => {
                            if s.write_all(&buf[..n]).await.is_err() {
                                return;
                            }
                        }
                    }
                }
            });
        }
    });
    addr
}

/// A sink that counts what it receives and reports the count when the sender closes.
async fn sink() -> (String, tokio::sync::oneshot::Receiver<u64>) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = l.local_addr().unwrap().to_string();
    let (tx, rx) = tokio::sync::oneshot::channel();
    tokio::spawn(async move {
        let (mut s, _) = l.accept().await.unwrap();
        let mut buf = vec![0u8; 1 << 20];
        let mut n = 0u64;
        while let Ok(k) = s.read(&mut buf).await {
            if k == 0 {
                break;
            }
            n += k as u64;
        }
        let _ = tx.send(n);
    });
    (addr, rx)
}

/// Median round trip of a one-byte ping.
async fn median_rtt(addr: &str) -> Duration {
    let mut s = TcpStream::connect(addr).await.unwrap();
    s.set_nodelay(true).unwrap();
    let mut rtts = Vec::new();
    let mut b = [0u8; 1];
    for _ in 0..21 {
        let t = Instant::now();
        s.write_all(b"x").await.unwrap();
        s.read_exact(&mut b).await.unwrap();
        rtts.push(t.elapsed());
    }
    rtts.sort();
    rtts[rtts.len() / 2]
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn adds_the_configured_one_way_delay() {
    let _turn = SERIAL.lock().await;
    let server = echo().await;
    let base = median_rtt(&server).await;
    for ms in [5u64, 16] {
        let delay = Duration::from_millis(ms);
        let p = proxy(&server, delay, None).await;
        let rtt = median_rtt(&p.local_addr.to_string()).await;
        let one_way = rtt.saturating_sub(base) / 2;
        // The proxy must add at least the delay (less would be a bug, whatever the load); how
        // much more a loaded 2-core CI machine's scheduler adds is not this test's business,
        // so the upper bound only catches a delay applied twice or per byte.
        assert!(
            one_way + Duration::from_micros(500) >= delay
                && one_way < delay * 2 + Duration::from_millis(20),
            "set {delay:?}, measured {one_way:?} one way (rtt {rtt:?}, base {base:?})"
        );
    }
}

async fn transfer(to: &str, bytes: usize) -> Duration {
    let mut s = TcpStream::connect(to).await.unwrap();
    let chunk = vec![7u8; 64 * 1024];
    let t = Instant::now();
    let mut sent = 0;
    while sent < bytes {
        s.write_all(&chunk).await.unwrap();
        sent += chunk.len();
    }
    s.shutdown().await.unwrap();
    t.elapsed()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delay_is_latency_not_a_sleep_per_read() {
    let _turn = SERIAL.lock().await;
    // 64 MiB in 64 KiB writes through a 20 ms link. A proxy that slept 20 ms per read would need
    // at least 1024 x 20 ms = 20 s; a link with 20 ms of latency needs little more than 20 ms
    // beyond the copying.
    let (dst, got) = sink().await;
    let p = proxy(&dst, Duration::from_millis(20), None).await;
    let t = Instant::now();
    transfer(&p.local_addr.to_string(), 64 << 20).await;
    assert_eq!(got.await.unwrap(), 64 << 20);
    assert!(
        t.elapsed() < Duration::from_secs(5),
        "64 MiB through a 20 ms link took {:?}",
        t.elapsed()
    );

    // Unlimited and without delay: not capped (loopback does GB/s; 50 MB/s is a floor any
    // working relay clears by far).
    let (dst, got) = sink().await;
    let p = proxy(&dst, Duration::ZERO, None).await;
    let t = Instant::now();
    transfer(&p.local_addr.to_string(), 256 << 20).await;
    assert_eq!(got.await.unwrap(), 256 << 20);
    let mbps = 256.0 / t.elapsed().as_secs_f64();
    assert!(mbps > 50.0, "256 MiB at zero delay ran at {mbps:.0} MiB/s");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rate_limit_serialises_at_the_link_rate() {
    let _turn = SERIAL.lock().await;
    // 8 MiB at 100 Mbit/s takes at least 0.67 s on the wire.
    let (dst, got) = sink().await;
    let p = proxy(&dst, Duration::ZERO, Some(100_000_000)).await;
    let t = Instant::now();
    transfer(&p.local_addr.to_string(), 8 << 20).await;
    assert_eq!(got.await.unwrap(), 8 << 20);
    let took = t.elapsed();
    assert!(
        took >= Duration::from_millis(600),
        "8 MiB at 100 Mbit/s arrived in {took:?}"
    );
    assert!(
        took < Duration::from_secs(10),
        "8 MiB at 100 Mbit/s took {took:?}"
    );
}
