//! iSCSI control-type PDUs in RDMA Sends (RFC 7145 section 7): each Send is one iSER header
//! and one PDU, its BHS, AHS and data segment, with no digests (the RDMA transport checks
//! the bytes) and no padding needed. A message is whole when it arrives, so it is decoded in
//! one step; a SCSI Command's immediate data and a Data-Out's data are left where they are, for
//! the caller to copy straight into the task's buffer.

use std::ops::Range;

use bytes::{BufMut, Bytes, BytesMut};

use super::header::{IserHeader, Kind, ISER_HEADER_LEN};
use super::IserError;
use crate::{padding, Bhs, DecodeError, Opcode, Pdu, PduError, BHS_LEN};

/// A control-type PDU received in a Send.
#[derive(Debug)]
pub enum Received {
    /// A PDU with its data segment (if any) copied out of the message.
    Pdu(Pdu),
    /// A SCSI Command or Data-Out whose data segment stays in the message at `payload`: `pdu`
    /// carries no data.
    Header {
        /// The PDU, its data segment empty.
        pdu: Pdu,
        /// Its header as received, for a Reject.
        header: Bhs,
        /// Where its data segment is in the message.
        payload: Range<usize>,
    },
}

/// Whether a PDU's data segment is placed by the caller rather than copied into the PDU.
fn placed(op: Opcode) -> bool {
    matches!(op, Opcode::ScsiCommand | Opcode::DataOut)
}

/// Decodes the iSCSI PDU of a control-type message (after its iSER header). Its data segment
/// may be at most `max_data` bytes (TargetRecvDataSegmentLength); a message shorter than its
/// header says, or longer by more than padding, is refused before anything is copied.
///
/// A malformed PDU in a well-framed message comes back as [`IserError::Pdu`] with a
/// [`DecodeError::Malformed`]: answer it with a Reject and go on.
pub fn decode_pdu(msg: &[u8], max_data: u32) -> Result<Received, IserError> {
    let body = &msg[ISER_HEADER_LEN.min(msg.len())..];
    let Some(bhs) = body.first_chunk::<BHS_LEN>() else {
        return Err(IserError::Short(msg.len()));
    };
    let header = Bhs(*bhs);
    let ahs_len = header.total_ahs_length();
    let len = header.data_segment_length();
    if len > max_data {
        return Err(IserError::DataSegmentTooLong {
            length: len,
            limit: max_data,
        });
    }
    let data_at = ISER_HEADER_LEN + BHS_LEN + ahs_len;
    let data_end = data_at + len as usize;
    let padded = data_end + padding(len as usize).len();
    // libiscsi up to 1.19 (Debian 12's) announces immediate data in a write's header but
    // sends none: it names its whole buffer for RDMA READ instead. A command whose message
    // ends with its headers is taken as that: a command without immediate data.
    let announced_only = msg.len() == data_at && header.opcode() == Some(Opcode::ScsiCommand);
    if (msg.len() < data_end && !announced_only) || msg.len() > padded {
        return Err(IserError::Length {
            received: msg.len(),
            expected: data_end,
        });
    }
    let ahs = match ahs_len {
        0 => Bytes::new(),
        _ => Bytes::copy_from_slice(&msg[ISER_HEADER_LEN + BHS_LEN..data_at]),
    };
    let malformed = |e: DecodeError| match e {
        DecodeError::Malformed { error, .. } => IserError::Pdu(DecodeError::Malformed {
            header: Box::new(header),
            error,
        }),
        e => IserError::Pdu(e),
    };
    if announced_only {
        let mut bare = header;
        bare.0[5..8].fill(0);
        let pdu = Pdu::from_header_and_data(&bare, ahs, Bytes::new()).map_err(malformed)?;
        return Ok(Received::Pdu(pdu));
    }
    if len > 0 && header.opcode().is_some_and(placed) {
        let mut bare = header;
        bare.0[5..8].fill(0);
        let pdu = Pdu::from_header_and_data(&bare, ahs, Bytes::new()).map_err(malformed)?;
        return Ok(Received::Header {
            pdu,
            header,
            payload: data_at..data_end,
        });
    }
    let data = match len {
        0 => Bytes::new(),
        _ => Bytes::copy_from_slice(&msg[data_at..data_end]),
    };
    Pdu::from_header_and_data(&header, ahs, data)
        .map(Received::Pdu)
        .map_err(malformed)
}

/// A whole message as received.
// Nearly every message is a control-type PDU: boxing it would cost an allocation each to
// shrink the variants of the rare Hello.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Message {
    /// A control-type PDU and the buffers its iSER header names.
    Control(IserHeader, Received),
    /// iSER Hello.
    Hello(super::Hello),
    /// iSER HelloReply.
    HelloReply(super::HelloReply),
}

/// Decodes a received Send: its iSER header, then what follows it.
pub fn decode(msg: &[u8], max_data: u32) -> Result<Message, IserError> {
    match Kind::decode(msg)? {
        Kind::Control(h) => Ok(Message::Control(h, decode_pdu(msg, max_data)?)),
        Kind::Hello(h) => Ok(Message::Hello(h)),
        Kind::HelloReply(h) => Ok(Message::HelloReply(h)),
    }
}

/// Appends `pdu` as a control-type message: the iSER header `iser`, the BHS and AHS, the data
/// segment, no padding and no digests.
pub fn encode(pdu: &Pdu, iser: &IserHeader, dst: &mut BytesMut) {
    dst.put_slice(&iser.encode());
    let data = pdu.data();
    pdu.encode_header(data.len() as u32, false, dst);
    dst.put_slice(data);
}

/// The bytes of a message carrying a PDU with `data_len` bytes of data and no AHS.
pub const fn message_len(data_len: u32) -> usize {
    ISER_HEADER_LEN + BHS_LEN + data_len as usize
}

/// What a receive buffer must hold to take any message whose data segment is at most
/// `data_len`: the headers, the most AHS a PDU may have, and the data.
pub const fn receive_len(data_len: u32) -> usize {
    message_len(data_len) + super::MAX_AHS_LEN
}

impl IserError {
    /// The Reject a malformed PDU gets, if the error is one: its reason and header.
    pub fn reject(&self) -> Option<(crate::RejectReason, &Bhs)> {
        match self {
            IserError::Pdu(e) => e.reject(),
            _ => None,
        }
    }
}

/// A PDU error for a message whose iSCSI part is malformed (used by tests and fuzzing).
pub fn malformed(header: Bhs, error: PduError) -> IserError {
    IserError::Pdu(DecodeError::Malformed {
        header: Box::new(header),
        error,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{Lun, NopOut, ScsiCommand, SerialNumber};

    fn message(pdu: &Pdu, iser: IserHeader) -> BytesMut {
        let mut b = BytesMut::new();
        encode(pdu, &iser, &mut b);
        b
    }

    #[test]
    fn a_write_command_leaves_its_immediate_data_in_the_message() {
        let cmd = Pdu::ScsiCommand(ScsiCommand {
            final_bit: true,
            write: true,
            lun: Lun::ZERO,
            initiator_task_tag: 5,
            expected_data_transfer_length: 8192,
            cmd_sn: SerialNumber(1),
            cdb: [0x2a, 0, 0, 0, 0, 0, 0, 0, 16, 0, 0, 0, 0, 0, 0, 0],
            data: Bytes::from(vec![0xab; 1001]),
            ..ScsiCommand::default()
        });
        let iser = IserHeader {
            write: Some(super::super::RemoteBuffer {
                stag: 1,
                va: 0x1000 + 1001,
            }),
            read: None,
        };
        let m = message(&cmd, iser);
        assert_eq!(m.len(), message_len(1001), "no padding");
        let Message::Control(h, Received::Header { pdu, payload, .. }) = decode(&m, 8192).unwrap()
        else {
            panic!("a header with its payload left in place");
        };
        assert_eq!(h, iser);
        assert_eq!(payload, 76..1077);
        assert!(m[payload].iter().all(|&b| b == 0xab));
        let Pdu::ScsiCommand(c) = pdu else { panic!() };
        assert_eq!(c.initiator_task_tag, 5);
        assert!(c.data.is_empty());
        // Padded as over TCP is accepted too; one byte more is not.
        let mut padded = m.clone();
        padded.extend_from_slice(&[0; 3]);
        assert!(decode(&padded, 8192).is_ok());
        let mut long = m.clone();
        long.extend_from_slice(&[0; 4]);
        assert!(matches!(decode(&long, 8192), Err(IserError::Length { .. })));
        // More data than TargetRecvDataSegmentLength is refused before it is copied.
        assert!(matches!(
            decode(&m, 512),
            Err(IserError::DataSegmentTooLong {
                length: 1001,
                limit: 512
            })
        ));
        // A message cut short.
        assert!(matches!(
            decode(&m[..500], 8192),
            Err(IserError::Length { .. })
        ));
        assert!(matches!(decode(&m[..40], 8192), Err(IserError::Short(40))));
        // Cut after its headers, as libiscsi 1.19 sends a write: no immediate data.
        let Message::Control(_, Received::Pdu(Pdu::ScsiCommand(c))) =
            decode(&m[..ISER_HEADER_LEN + BHS_LEN], 8192).unwrap()
        else {
            panic!("a command without immediate data");
        };
        assert!(c.data.is_empty() && c.write);
    }

    #[test]
    fn other_pdus_carry_their_data() {
        let nop = Pdu::NopOut(NopOut {
            initiator_task_tag: 9,
            target_transfer_tag: crate::RESERVED_TAG,
            cmd_sn: SerialNumber(3),
            data: Bytes::from_static(b"ping"),
            ..NopOut::default()
        });
        let m = message(&nop, IserHeader::default());
        let Message::Control(_, Received::Pdu(Pdu::NopOut(n))) = decode(&m, 8192).unwrap() else {
            panic!("a whole NOP-Out");
        };
        assert_eq!(&n.data[..], b"ping");
        // A malformed PDU in a good frame is answered with a Reject.
        let mut bad = m.clone();
        bad[ISER_HEADER_LEN] = 0x1e;
        let e = decode(&bad, 8192).unwrap_err();
        assert!(e.reject().is_some(), "{e:?}");
    }
}
