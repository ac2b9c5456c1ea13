//! The initiator session's Data-In reassembly: data in order, out of order (DataPDUInOrder=No)
//! and with a gap land where their buffer offsets say, and the reply holds exactly the bytes
//! the status says came.

use bytes::Bytes;
use iscsi_pdu::initiator::{Command, Event, Reply, Session};
use iscsi_pdu::negotiation::{ConnectionParams, SessionParams};
use iscsi_pdu::{DataIn, DataInStatus, Lun, Pdu, Residual, ScsiStatus, SerialNumber};

const LEN: usize = 4096;

/// Reads `LEN` bytes with Data-In PDUs carrying `(offset, len)` of a known pattern, in that
/// order, the last with status and `residual`; returns the reply's data.
fn read(parts: &[(usize, usize)], residual: Residual) -> Bytes {
    let mut s = Session::new(
        SessionParams::default(),
        1,
        SerialNumber(1),
        SerialNumber(100),
    );
    let conn = s.add_connection(ConnectionParams::default(), SerialNumber(0));
    let mut cdb = [0u8; 16];
    cdb[0] = 0x28;
    cdb[8] = (LEN / 512) as u8;
    let now = std::time::Instant::now();
    let itt = s
        .start_command(now, &Command::read(Lun::ZERO, cdb, LEN as u32))
        .unwrap();
    while s.poll_transmit(conn).is_some() {}
    let pattern: Bytes = (0..LEN).map(|i| (i % 251) as u8 + 1).collect();
    for (n, &(at, len)) in parts.iter().enumerate() {
        let last = n + 1 == parts.len();
        let d = DataIn {
            final_bit: last,
            status: last.then_some(DataInStatus {
                status: ScsiStatus::GOOD,
                stat_sn: SerialNumber(1),
                residual,
            }),
            initiator_task_tag: itt,
            target_transfer_tag: u32::MAX,
            exp_cmd_sn: SerialNumber(2),
            max_cmd_sn: SerialNumber(100),
            data_sn: n as u32,
            buffer_offset: at as u32,
            data: pattern.slice(at..at + len),
            ..Default::default()
        };
        s.handle_pdu(now, conn, Pdu::DataIn(d)).unwrap();
    }
    while let Some(e) = s.poll_event() {
        if let Event::Done {
            itt: t,
            result: Ok(Reply::Scsi(r)),
        } = e
        {
            assert_eq!(t, itt);
            return r.data;
        }
    }
    panic!("the read did not end");
}

fn pattern(range: std::ops::Range<usize>) -> Vec<u8> {
    range.map(|i| (i % 251) as u8 + 1).collect()
}

#[test]
fn data_in_order_out_of_order_and_whole_lands_where_it_belongs() {
    let whole = pattern(0..LEN);
    assert_eq!(read(&[(0, LEN)], Residual::None), whole);
    assert_eq!(
        read(&[(0, 1024), (1024, 1024), (2048, 2048)], Residual::None),
        whole
    );
    assert_eq!(
        read(&[(2048, 2048), (0, 1024), (1024, 1024)], Residual::None),
        whole,
        "out of order"
    );
    assert_eq!(
        read(&[(1024, 1024), (0, 1024)], Residual::Underflow(2048)),
        pattern(0..2048),
        "a short read, out of order"
    );
}

#[test]
fn a_gap_reads_as_zeros() {
    // The target sent bytes 1024..2048 only and claims no residual: the reply holds what came
    // (1024 bytes), the unsent start as zeros.
    let data = read(&[(1024, 1024)], Residual::None);
    assert_eq!(data.len(), 1024);
    assert!(data.iter().all(|&b| b == 0));
}
