//! iSER's datamover on the initiator's side: an initiator [`Session`] of one connection whose
//! PDUs travel in Sends behind an iSER header, and whose data the target moves itself, by RDMA
//! READ from the buffer a write names and RDMA WRITE into the buffer a read names (RFC 7145
//! sections 7.3.1 and 9.2).
//!
//! The session is the TCP initiator's, unchanged: it sends a write's unsolicited data
//! (immediate data, and the first burst's Data-Out PDUs when InitialR2T=No) as it always does,
//! and those PDUs go in Sends. What it never sees are R2Ts and Data-In: the target reads the
//! solicited data-out and writes the data-in before it answers, so a read's reply carries no
//! data ([`ScsiReply::data`](crate::initiator::ScsiReply) is empty) and the caller takes it from
//! the buffer it named, `len` minus the residual. What this adds is the iSER header of each
//! SCSI Command: the caller's buffers, the write buffer's base offset moved past the
//! unsolicited data (the target reads from the first solicited byte).

use std::collections::VecDeque;
use std::time::Instant;

use bytes::BytesMut;

use super::header::{IserHeader, RemoteBuffer};
use super::message::{self, Message, Received};
use super::IserError;
use crate::initiator::{Command, ConnectionError, Event, Session, StartError};
use crate::Pdu;

/// Why a received message ends the connection.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum IserInitiatorError {
    /// The message could not be taken (its framing, or a PDU that is not the target's).
    #[error(transparent)]
    Message(#[from] IserError),
    /// The session refused the PDU it carried.
    #[error(transparent)]
    Session(#[from] ConnectionError),
}

/// An initiator's iSER connection: a [`Session`] with one connection, its PDUs framed as
/// iSER messages, each SCSI Command carrying the buffers its caller named.
#[derive(Debug)]
pub struct IserInitiator {
    session: Session,
    conn: usize,
    /// The buffers each command in flight names, by Initiator Task Tag, until its SCSI
    /// Command has been sent.
    named: VecDeque<(u32, IserHeader)>,
    /// InitiatorRecvDataSegmentLength: the most data a received PDU may carry.
    max_recv_data: u32,
}

impl IserInitiator {
    /// The datamover around `session`, whose connection `conn` was logged in with
    /// RDMAExtensions=Yes and receives data segments of at most `max_recv_data` bytes (the
    /// negotiated InitiatorRecvDataSegmentLength).
    pub fn new(mut session: Session, conn: usize, max_recv_data: u32) -> IserInitiator {
        // Reads land in the caller's buffers by RDMA WRITE: the session keeps none.
        session.set_data_in_placed_by_target();
        IserInitiator {
            session,
            conn,
            named: VecDeque::new(),
            max_recv_data,
        }
    }

    /// The session.
    pub fn session(&self) -> &Session {
        &self.session
    }

    /// The session, to start what is not a SCSI command (a NOP, task management, a logout)
    /// or to run its timers.
    pub fn session_mut(&mut self) -> &mut Session {
        &mut self.session
    }

    /// Starts `cmd`: a write's data-out is `cmd.data_out`, the same bytes the caller put in
    /// the registered buffer `write` names (the target reads what is beyond the unsolicited
    /// data from there); a read's data-in goes into `read`, at least `cmd.data_in_len` bytes.
    /// Returns the command's Initiator Task Tag.
    pub fn start_command(
        &mut self,
        now: Instant,
        cmd: &Command,
        write: Option<RemoteBuffer>,
        read: Option<RemoteBuffer>,
    ) -> Result<u32, StartError> {
        let itt = self.session.start_command(now, cmd)?;
        let header = IserHeader {
            write: write.filter(|_| !cmd.data_out.is_empty()),
            read: read.filter(|_| cmd.data_in_len > 0),
        };
        self.named.push_back((itt, header));
        Ok(itt)
    }

    /// Appends the next message to send to `dst` (the body of one Send); false when there is
    /// none.
    pub fn poll_transmit(&mut self, dst: &mut BytesMut) -> bool {
        let Some(pdu) = self.session.poll_transmit(self.conn) else {
            return false;
        };
        let header = match &pdu {
            Pdu::ScsiCommand(c) => self.header_of(c),
            _ => IserHeader::default(),
        };
        message::encode(&pdu, &header, dst);
        true
    }

    /// The iSER header of SCSI Command `c`: the buffers its caller named, the write buffer's
    /// base offset at the first byte the target solicits (none when all of it is unsolicited).
    fn header_of(&mut self, c: &crate::ScsiCommand) -> IserHeader {
        let itt = c.initiator_task_tag;
        let Some(at) = self.named.iter().position(|(t, _)| *t == itt) else {
            return IserHeader::default();
        };
        let (_, mut header) = self.named.remove(at).expect("found");
        if let Some(w) = header.write.as_mut() {
            let edtl = c.expected_data_transfer_length;
            let immediate = c.data.len() as u32;
            // The session sends the first burst unsolicited unless InitialR2T=Yes; the Final
            // bit of the command says whether any Data-Out PDUs follow it.
            let unsolicited = if c.final_bit {
                immediate
            } else {
                self.session
                    .params()
                    .operational
                    .first_burst_length
                    .min(edtl)
            };
            if unsolicited >= edtl {
                header.write = None;
            } else {
                w.va += u64::from(unsolicited);
            }
        }
        header
    }

    /// A message the target sent (the bytes of one receive).
    pub fn handle_message(&mut self, now: Instant, msg: &[u8]) -> Result<(), IserInitiatorError> {
        let pdu = match message::decode(msg, self.max_recv_data)? {
            Message::Control(_, Received::Pdu(pdu)) => pdu,
            Message::Control(_, Received::Header { .. }) => {
                return Err(
                    IserError::Unexpected("a SCSI Command or Data-Out from a target").into(),
                )
            }
            Message::Hello(_) | Message::HelloReply(_) => {
                return Err(IserError::Unexpected("an iSER Hello in full feature phase").into())
            }
        };
        self.session.handle_pdu(now, self.conn, pdu)?;
        Ok(())
    }

    /// What the session reports: a task's end (a read's data is in the buffer it named), the
    /// window opening.
    pub fn poll_event(&mut self) -> Option<Event> {
        self.session.poll_event()
    }
}
