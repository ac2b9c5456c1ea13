//! A single-threaded iSCSI target over std `TcpStream`, on the crates' public API alone: one
//! target with a 64 MiB memory logical unit, any number of connections (login, full feature
//! phase, logout). `iscsi-inq`, `iscsi-ls` and other initiators talk to it:
//!
//! ```text
//! cargo run -p storage-target-iscsi-pdu --example tcp_target -- 127.0.0.1:3260
//! iscsi-inq iscsi://127.0.0.1:3260/iqn.2026-11.io.example:tcp-target/0
//! ```
//!
//! The protocol is in the machines: [`Login`] answers the login phase, [`Connection`] the full
//! feature phase, and [`LocalTarget`] holds the SCSI device and the sessions. What is here is
//! only I/O: bytes in, PDUs to the machine, its events carried out, its PDUs out. The sockets
//! are non-blocking and polled in turn, with a short sleep when none had anything; an embedder
//! with an event loop (mio, tokio, io_uring) waits on readiness instead.

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::{Duration, Instant};

use bytes::{Buf, BytesMut};
use iscsi_pdu::negotiation::Settings as Negotiation;
use iscsi_pdu::target_node::{
    Connection, Event, LocalLogin, LocalTarget, Login, Plan, Settings, Step,
};
use iscsi_pdu::{Deframer, Digests, Pdu};
use scsi_core::{
    Backend, Device, Geometry, Identity, Limits, LogicalUnit, MemoryBackend, NexusId, TargetPort,
};

/// The target's name.
pub const TARGET: &str = "iqn.2026-11.io.example:tcp-target";
const BLOCK_SIZE: u32 = 512;
const BLOCKS: u64 = (64 << 20) / BLOCK_SIZE as u64;

fn main() -> std::io::Result<()> {
    let addr = std::env::args().nth(1).unwrap_or("127.0.0.1:3260".into());
    let listener = TcpListener::bind(&addr)?;
    println!("serving {TARGET} on {}", listener.local_addr()?);
    serve(listener, || false)
}

/// One connection: its socket, the bytes each way, and where it is.
struct Link {
    stream: TcpStream,
    route: u64,
    rx: Deframer,
    out: BytesMut,
    phase: Phase,
}

enum Phase {
    Login(Box<Login>),
    Full {
        conn: Box<Connection<Vec<u8>>>,
        tsih: u16,
        nexus: NexusId,
        digests: Digests,
    },
    /// The connection is over (a refused login, a logout, a closed socket, an error).
    Closed,
}

/// Serves connections from `listener` until `stop` says so.
pub fn serve(listener: TcpListener, stop: impl Fn() -> bool) -> std::io::Result<()> {
    let addr = listener.local_addr()?;
    listener.set_nonblocking(true)?;
    let mut device = Device::new(TARGET, vec![TargetPort::iscsi(TARGET, 1)]);
    let unit = LogicalUnit {
        identity: Identity::new("EXAMPLE", "memory", "0001", b"tcp-target-lu0"),
        geometry: Geometry {
            block_size: BLOCK_SIZE,
            blocks: BLOCKS,
            thin: false,
            write_cache: false,
            read_only: false,
        },
        limits: Limits::default(),
    };
    device.add_lu(0, unit).expect("LUN 0 is free");
    let mut target = LocalTarget::new(device, 32);
    target.advertise(TARGET, &format!("{addr},1"));
    let mut storage = MemoryBackend::new(BLOCK_SIZE, BLOCKS);
    let mut links: Vec<Link> = Vec::new();
    let mut next_route = 0;
    while !stop() {
        let mut busy = false;
        while let Ok((stream, _)) = listener.accept() {
            stream.set_nonblocking(true)?;
            next_route += 1;
            links.push(Link {
                stream,
                route: next_route,
                rx: Deframer::new(),
                out: BytesMut::new(),
                phase: Phase::Login(Box::default()),
            });
        }
        for link in &mut links {
            let mut buf = [0; 64 << 10];
            let got = match link.stream.read(&mut buf) {
                Ok(0) => Err(ErrorKind::UnexpectedEof.into()),
                Ok(n) => Ok(&buf[..n]),
                Err(e) if e.kind() == ErrorKind::WouldBlock => Ok(&buf[..0]),
                Err(e) => Err(e),
            };
            let stepped = got.and_then(|bytes| {
                busy |= !bytes.is_empty();
                link.rx.feed(bytes);
                link.step(&mut target, &mut storage)
            });
            let written = stepped.and_then(|()| link.flush());
            if let Err(e) = written {
                if e.kind() != ErrorKind::UnexpectedEof {
                    eprintln!("connection {}: {e}", link.route);
                }
                link.phase.end(link.route, &mut target, &mut storage);
            }
        }
        // Connections another one asked to close (a logout for its session, a reset).
        for route in std::mem::take(&mut target.close_requests) {
            if let Some(link) = links.iter_mut().find(|l| l.route == route) {
                link.phase.end(route, &mut target, &mut storage);
            }
        }
        links.retain(|l| !matches!(l.phase, Phase::Closed));
        if !busy {
            std::thread::sleep(Duration::from_millis(1));
        }
    }
    Ok(())
}

impl Link {
    /// Hands the machine whatever whole PDUs have arrived, lets its timers fire, carries out
    /// what it asks for, and queues its PDUs for the socket.
    fn step(
        &mut self,
        target: &mut LocalTarget,
        storage: &mut MemoryBackend,
    ) -> std::io::Result<()> {
        let now = Instant::now();
        let route = self.route;
        while let Some(pdu) = self.rx.next_pdu().map_err(invalid)? {
            match &mut self.phase {
                Phase::Login(login) => {
                    let Pdu::LoginRequest(req) = pdu else {
                        return Err(invalid("a PDU other than a Login Request during login"));
                    };
                    let mut policy = LocalLogin::new(target, Negotiation::default(), route, None);
                    let step = login.handle_request(&req, &mut policy);
                    let admitted = policy.admitted.take();
                    let (Step::Continue(r) | Step::Done(r, _) | Step::Refused(r)) = &step;
                    Pdu::LoginResponse(r.clone()).encode(Digests::NONE, &mut self.out);
                    match (step, admitted) {
                        (Step::Done(_, done), Some(a)) => {
                            // Full feature phase, with what the login negotiated.
                            let n = done.negotiator;
                            let c = *n.connection();
                            let digests = Digests {
                                header: c.header_digest,
                                data: c.data_digest,
                            };
                            self.rx.set_digests(digests);
                            self.rx
                                .set_max_recv_data_segment_length(c.max_recv_data_segment_length);
                            let settings = Settings {
                                cid: done.cid,
                                session_type: n.session().declared.session_type,
                                max_io: 4 << 20,
                                nop_interval: Duration::from_secs(5),
                                nop_timeout: Duration::from_secs(5),
                                data_out_timeout: Duration::from_secs(30),
                            };
                            let op = n.session().operational;
                            let conn = Connection::new(now, settings, n, op, done.stat_sn);
                            self.phase = Phase::Full {
                                conn: Box::new(conn),
                                tsih: a.tsih,
                                nexus: a.nexus,
                                digests,
                            };
                        }
                        (Step::Refused(_), _) => self.phase = Phase::Closed,
                        _ => {}
                    }
                }
                Phase::Full {
                    conn, tsih, nexus, ..
                } => {
                    let nexus = &mut target.connection(route, *tsih, *nexus);
                    let mut plan = conn.handle_pdu(now, pdu, nexus);
                    // A command's immediate data needs a buffer: always granted here.
                    while let Plan::Allocate(len) = plan {
                        plan = conn.handle_allocated(now, Ok(vec![0; len as usize]), nexus);
                    }
                }
                Phase::Closed => break,
            }
        }
        if matches!(self.phase, Phase::Closed) {
            // A refused login: its response goes out before the socket closes.
            return self.flush_all();
        }
        if let Phase::Full {
            conn,
            tsih,
            nexus,
            digests,
        } = &mut self.phase
        {
            if conn.poll_timeout().is_some_and(|at| at <= now) {
                conn.handle_timeout(now, &mut target.connection(route, *tsih, *nexus));
            }
            run(conn, &mut target.connection(route, *tsih, *nexus), storage);
            let (exp_cmd_sn, max_cmd_sn) = target.window(*nexus);
            let max_segment = conn.max_send_data_segment_length();
            while let Some(t) = conn.poll_transmit() {
                t.encode(*digests, max_segment, exp_cmd_sn, max_cmd_sn, &mut self.out);
            }
            if conn.closing().is_some() {
                self.flush_all()?;
                self.phase.end(route, target, storage);
            }
        }
        Ok(())
    }

    /// Writes what the socket takes now.
    fn flush(&mut self) -> std::io::Result<()> {
        while !self.out.is_empty() {
            match self.stream.write(&self.out) {
                Ok(n) => self.out.advance(n),
                Err(e) if e.kind() == ErrorKind::WouldBlock => return Ok(()),
                Err(e) => return Err(e),
            }
        }
        Ok(())
    }

    /// Writes everything queued (the last PDUs before a close).
    fn flush_all(&mut self) -> std::io::Result<()> {
        self.stream.set_nonblocking(false)?;
        self.flush()
    }
}

impl Phase {
    /// Ends the connection: it leaves its session, its tasks end, and the target forgets it.
    fn end(&mut self, route: u64, target: &mut LocalTarget, storage: &mut MemoryBackend) {
        if let Phase::Full {
            conn, tsih, nexus, ..
        } = self
        {
            target.leave(route, *tsih, *nexus, conn);
            run(conn, &mut target.connection(route, *tsih, *nexus), storage);
            target.forget(route);
        }
        *self = Phase::Closed;
    }
}

/// Carries out the machine's requests: backend operations on the memory unit (which
/// completes at once) and buffers for data the initiator will send.
fn run(
    conn: &mut Connection<Vec<u8>>,
    nexus: &mut impl iscsi_pdu::target_node::Core,
    storage: &mut MemoryBackend,
) {
    let now = Instant::now();
    while let Some(event) = conn.poll_event(now, nexus) {
        match event {
            Event::Backend {
                task, op, buffer, ..
            } => {
                storage.submit(0, op, buffer);
                while let Some((_, result, buffer)) = storage.poll_completion() {
                    conn.handle_backend_done(now, task, buffer, result, nexus);
                }
            }
            Event::BufferWanted { tag, len } => {
                conn.handle_buffer(now, tag, Some(vec![0; len]), nexus);
            }
            Event::Completed(_) => {}
        }
    }
}

fn invalid(e: impl std::fmt::Display) -> std::io::Error {
    std::io::Error::new(ErrorKind::InvalidData, e.to_string())
}
