//! A target that asks to be logged out (AsyncEvent 1, as a gateway going down does): the
//! initiator session reports it at once, starts no new command on the connection, lets the
//! commands in flight end, and then logs out by itself; with nothing in flight, or when the
//! target's Parameter3 runs out, it logs out at once.

use std::time::{Duration, Instant};

use iscsi_pdu::initiator::{Command, Event, Session, StartError};
use iscsi_pdu::negotiation::{ConnectionParams, SessionParams};
use iscsi_pdu::{
    AsyncEvent, AsyncMessage, LogoutReason, Lun, Pdu, ScsiResponse, ScsiStatus, SerialNumber,
};

fn session() -> (Session, usize) {
    let mut s = Session::new(
        SessionParams::default(),
        1,
        SerialNumber(1),
        SerialNumber(100),
    );
    let conn = s.add_connection(ConnectionParams::default(), SerialNumber(0));
    (s, conn)
}

fn write(s: &mut Session, now: Instant) -> Result<u32, StartError> {
    let mut cdb = [0u8; 16];
    cdb[0] = 0x2a;
    cdb[8] = 1;
    s.start_command(now, &Command::write(Lun::ZERO, cdb, vec![7u8; 512].into()))
}

fn logout_request(seconds: u16) -> Pdu {
    Pdu::AsyncMessage(AsyncMessage {
        event: AsyncEvent::LogoutRequested,
        stat_sn: SerialNumber(1),
        exp_cmd_sn: SerialNumber(2),
        max_cmd_sn: SerialNumber(100),
        parameter3: seconds,
        ..Default::default()
    })
}

/// The Logout requests queued on `conn`.
fn logouts(s: &mut Session, conn: usize) -> Vec<LogoutReason> {
    std::iter::from_fn(|| s.poll_transmit(conn))
        .filter_map(|p| match p {
            Pdu::LogoutRequest(l) => Some(l.reason),
            _ => None,
        })
        .collect()
}

#[test]
fn a_requested_logout_waits_for_the_commands_in_flight() {
    let (mut s, conn) = session();
    let now = Instant::now();
    let itt = write(&mut s, now).unwrap();
    while s.poll_transmit(conn).is_some() {}
    s.handle_pdu(now, conn, logout_request(10)).unwrap();
    let Some((c, within)) = std::iter::from_fn(|| s.poll_event()).find_map(|e| match e {
        Event::LogoutRequested { conn, within } => Some((conn, within)),
        _ => None,
    }) else {
        panic!("no LogoutRequested event");
    };
    assert_eq!((c, within), (conn, Duration::from_secs(10)));
    assert!(s.logout_requested());
    // No new command, and no Logout while the write is in flight.
    assert_eq!(write(&mut s, now), Err(StartError::LogoutRequested));
    assert!(logouts(&mut s, conn).is_empty());
    // The write ends: the Logout goes, closing the session (its only connection).
    let done = ScsiResponse {
        status: ScsiStatus::GOOD,
        initiator_task_tag: itt,
        stat_sn: SerialNumber(2),
        exp_cmd_sn: SerialNumber(2),
        max_cmd_sn: SerialNumber(100),
        ..Default::default()
    };
    s.handle_pdu(now, conn, Pdu::ScsiResponse(done)).unwrap();
    assert!(std::iter::from_fn(|| s.poll_event())
        .any(|e| matches!(e, Event::Done { itt: t, result: Ok(_) } if t == itt)));
    assert_eq!(logouts(&mut s, conn), vec![LogoutReason::CloseSession]);
    // Once only.
    s.handle_timeout(now + Duration::from_secs(11));
    assert!(logouts(&mut s, conn).is_empty());
}

#[test]
fn a_requested_logout_goes_at_once_when_idle_or_when_its_time_is_up() {
    let (mut s, conn) = session();
    let now = Instant::now();
    s.handle_pdu(now, conn, logout_request(5)).unwrap();
    assert_eq!(logouts(&mut s, conn), vec![LogoutReason::CloseSession]);

    // A command the target never answers: the Logout goes at Parameter3.
    let (mut s, conn) = session();
    write(&mut s, now).unwrap();
    while s.poll_transmit(conn).is_some() {}
    s.handle_pdu(now, conn, logout_request(5)).unwrap();
    assert_eq!(s.poll_timeout(), Some(now + Duration::from_secs(5)));
    s.handle_timeout(now + Duration::from_secs(4));
    assert!(logouts(&mut s, conn).is_empty());
    s.handle_timeout(now + Duration::from_secs(5));
    assert_eq!(logouts(&mut s, conn), vec![LogoutReason::CloseSession]);
}

#[test]
fn with_two_connections_only_the_one_asked_is_logged_out() {
    let (mut s, first) = session();
    let second = s.add_connection(ConnectionParams::default(), SerialNumber(0));
    let now = Instant::now();
    s.handle_pdu(now, first, logout_request(5)).unwrap();
    assert_eq!(logouts(&mut s, first), vec![LogoutReason::CloseConnection]);
    assert!(!s.logout_requested());
    // New commands go on the other connection.
    for _ in 0..4 {
        write(&mut s, now).unwrap();
    }
    assert_eq!(
        std::iter::from_fn(|| s.poll_transmit(first)).count(),
        0,
        "a command on the connection being logged out"
    );
    assert!(s.poll_transmit(second).is_some());
}
