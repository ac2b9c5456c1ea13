//! The controller's end of one NVMe/TCP connection (one queue pair), as a machine: it takes
//! the bytes the host sends and hands back the commands and data they carry, and it turns
//! the controller's answers (an R2T for a write's data, a read's data, a completion) into
//! PDUs to send. What the commands mean is the controller's (above it); how the bytes move is
//! the shell's (below it).
//!
//! The connection starts with ICReq: the controller answers ICResp with the digests the host
//! asked for (when it allows them), its data alignment (CPDA) and MAXH2CDATA, and from then
//! on takes command capsules and H2CData. Each H2CData must answer an R2T this end sent: the
//! command's CID and the R2T's transfer tag, in order, within the R2T's range, LAST_PDU on
//! the PDU that ends it. Anything else is a fatal error: a C2HTermReq with the Fatal Error
//! Status and the header in error goes out, and the connection is over
//! ([`QueueEvent::Failed`]).

use std::collections::VecDeque;
use std::ops::Deref;

use bytes::{Bytes, BytesMut};
use cmdtrace::Stage;

use super::deframer::{DeframeError, Deframer, Limits, Pdu, Receiving, Side};
use super::pdu::{
    encode, DataHeader, Digests, EncodedHeader, FatalError, Framing, Header, IcResp, PduType, R2t,
    TermReq, MAX_PDA, MIN_MAXH2CDATA, PFV_1_0, SUCCESS,
};
use crate::cqe::Cqe;
use crate::sqe::Sqe;
pub use crate::transport::Payload;
use crate::transport::{Arrival, CommandCapsule, Transport, WriteData};

/// What the controller offers every connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueSettings {
    /// The digests the controller grants when a host asks for them.
    pub digests: Digests,
    /// CPDA: the data alignment the controller asks of the host (0: none).
    pub cpda: u8,
    /// MAXH2CDATA: the most data one H2CData PDU may carry (at least 4096).
    pub maxh2cdata: u32,
    /// The most in-capsule data a command capsule may carry (the I/O queue command capsule
    /// size less the SQE; the admin queue takes 8 KiB).
    pub max_in_capsule_data: u32,
    /// The most R2Ts outstanding per command the controller uses, whatever the host allows.
    pub max_r2t: u32,
}

impl Default for QueueSettings {
    /// Both digests granted when asked, no alignment, 128 KiB per H2CData, 8 KiB of
    /// in-capsule data, one R2T at a time per command.
    fn default() -> Self {
        QueueSettings {
            digests: Digests {
                header: true,
                data: true,
            },
            cpda: 0,
            maxh2cdata: 128 * 1024,
            max_in_capsule_data: 8192,
            max_r2t: 1,
        }
    }
}

/// What the host's ICReq settled.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Negotiated {
    /// The digests in force.
    pub digests: Digests,
    /// HPDA: the alignment of data in PDUs to the host.
    pub hpda: u8,
    /// R2Ts this end may have outstanding per command (MAXR2T + 1, at most the settings').
    pub max_r2t: u32,
}

/// What the connection hands up to the controller.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum QueueEvent {
    /// ICReq came and ICResp went: commands may follow.
    Initialized(Negotiated),
    /// A command capsule.
    Command(CommandCapsule),
    /// Data of a write, answering an R2T ([`ControllerQueue::request_data`]).
    Data(WriteData),
    /// The host ended the connection with an H2CTermReq.
    Terminated(TermReq),
    /// A fatal error: the C2HTermReq that says so is queued; close once it is sent.
    Failed {
        /// Why.
        fes: FatalError,
        /// The field in error.
        fei: u32,
    },
}

/// Bytes to send, in order: a header (with its digest and padding), data, and the data's
/// digest. Sent with one vectored write.
#[derive(Debug)]
pub struct Transmit<B = Bytes> {
    /// The header bytes.
    pub header: EncodedHeader,
    /// The data.
    pub data: Payload<B>,
    /// The data digest, when data digests are on.
    pub digest: Option<[u8; 4]>,
}

impl<B: Deref<Target = [u8]>> Transmit<B> {
    /// `header` with `data`, framed with `framing` (and the data's digest when data digests
    /// are on); `None` when the header cannot be framed with that data.
    pub fn frame(
        header: &Header,
        data: impl Into<Payload<B>>,
        framing: &Framing,
    ) -> Option<Transmit<B>> {
        let data = data.into();
        let encoded = encode(header, u32::try_from(data.len()).ok()?, framing)?;
        let digest = encoded
            .needs_data_digest()
            .then(|| super::pdu::data_digest([&data[..]]));
        Some(Transmit {
            header: encoded,
            data,
            digest,
        })
    }

    /// A TermReq (`header`) carrying the PDU header in error, at most 128 bytes of it, framed
    /// without digests (none apply to TermReqs).
    pub fn term_req(header: &Header, pdu_header: &[u8]) -> Option<Transmit<B>> {
        let error_data = Bytes::copy_from_slice(&pdu_header[..pdu_header.len().min(128)]);
        Transmit::frame(header, error_data, &Framing::default())
    }

    /// What the shell notes once it has written this PDU, while tracing (`cmdtrace`): a
    /// C2HData's data sent (its CID and length) and, with SUCCESS, its command ended; a
    /// CapsuleResp's command ended.
    pub fn sent_stages(&self) -> [Option<(Stage, u16, u32)>; 2] {
        let h = self.header.head();
        let le16 = |at: usize| h.get(at..at + 2).map(|b| u16::from_le_bytes([b[0], b[1]]));
        match h.first().copied().and_then(PduType::from_code) {
            Some(PduType::C2HData) => {
                let Some(cid) = le16(8) else {
                    return [None, None];
                };
                let ended = h[1] & SUCCESS != 0;
                [
                    Some((Stage::DataInSent, cid, self.data.len() as u32)),
                    ended.then_some((Stage::StatusSent, cid, 0)),
                ]
            }
            // The CQE follows the common header; its CID is at byte 12 of it.
            Some(PduType::CapsuleResp) => {
                [le16(8 + 12).map(|cid| (Stage::StatusSent, cid, 0)), None]
            }
            _ => [None, None],
        }
    }

    /// Its bytes in order, as the slices of one vectored write: the header's own bytes, its
    /// trailing zeros (reserved bytes, padding up to PDO), the data, the data digest; none
    /// empty.
    pub fn slices(&self) -> impl Iterator<Item = &[u8]> {
        let [head, zeros] = self.header.slices();
        [
            Some(head),
            Some(zeros),
            Some(&self.data[..]),
            self.digest.as_ref().map(|d| &d[..]),
        ]
        .into_iter()
        .flatten()
        .filter(|s| !s.is_empty())
    }

    /// Its length on the wire.
    pub fn len(&self) -> usize {
        self.header.len() + self.data.len() + self.digest.map_or(0, |d| d.len())
    }

    /// Whether it is empty (never: every PDU has a header).
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// Why the controller's request of the connection was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum QueueError {
    /// The connection is not initialized, or is over.
    #[error("the connection is not ready")]
    NotReady,
    /// The command has as many R2Ts outstanding as allowed.
    #[error("command {0} has its R2Ts outstanding")]
    R2tLimit(u16),
    /// A read's data is longer than a PDU can say.
    #[error("data too long for one PDU")]
    TooLong,
}

/// An R2T sent and not yet answered in full.
#[derive(Debug, Clone, Copy)]
struct Outstanding {
    cid: u16,
    ttag: u16,
    /// The next offset expected.
    next: u32,
    /// The end of the range asked.
    end: u32,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitingIcReq,
    Ready,
    Over,
}

/// The controller's end of one NVMe/TCP connection; `B` the buffers a read's data is sent
/// from.
#[derive(Debug)]
pub struct ControllerQueue<B = Bytes> {
    settings: QueueSettings,
    state: State,
    deframer: Deframer,
    /// How PDUs to the host are framed.
    framing: Framing,
    negotiated: Option<Negotiated>,
    r2ts: Vec<Outstanding>,
    next_ttag: u16,
    events: VecDeque<QueueEvent>,
    transmits: VecDeque<Transmit<B>>,
}

impl<B: Deref<Target = [u8]>> ControllerQueue<B> {
    /// A connection just accepted, waiting for ICReq.
    pub fn new(settings: QueueSettings) -> ControllerQueue<B> {
        let settings = QueueSettings {
            cpda: settings.cpda.min(MAX_PDA),
            maxh2cdata: settings.maxh2cdata.max(MIN_MAXH2CDATA),
            max_r2t: settings.max_r2t.max(1),
            ..settings
        };
        ControllerQueue {
            settings,
            state: State::AwaitingIcReq,
            deframer: Deframer::new(Side::Controller),
            framing: Framing::default(),
            negotiated: None,
            r2ts: Vec::new(),
            next_ttag: 1,
            events: VecDeque::new(),
            transmits: VecDeque::new(),
        }
    }

    /// The queue's part of a handover: what ICResp told the host and ICReq settled, the next
    /// transfer tag and the bytes read ahead, once nothing is half done (no R2T outstanding,
    /// no event untaken, nothing unsent). The connection fills in its binding
    /// ([`crate::tcp::ControllerConnection::handover`]).
    pub fn handover(&self) -> Result<crate::handover::QueueState, crate::handover::Busy> {
        use crate::handover::Busy;
        let n = match self.state {
            State::AwaitingIcReq => return Err(Busy::NotConnected),
            State::Over => return Err(Busy::Over),
            State::Ready => self.negotiated.ok_or(Busy::NotConnected)?,
        };
        if !self.r2ts.is_empty() {
            return Err(Busy::R2ts(self.r2ts.len()));
        }
        if !self.events.is_empty() {
            return Err(Busy::Events(self.events.len()));
        }
        if !self.transmits.is_empty() {
            return Err(Busy::Transmits(self.transmits.len()));
        }
        let unread = self.deframer.unread().ok_or(Busy::Over)?;
        Ok(crate::handover::QueueState {
            qid: 0,
            size: 0,
            sq_flow_control_disabled: false,
            sqhd: 0,
            cpda: self.settings.cpda,
            maxh2cdata: self.settings.maxh2cdata,
            max_in_capsule_data: self.settings.max_in_capsule_data,
            digests: n.digests,
            hpda: n.hpda,
            max_r2t: n.max_r2t,
            next_ttag: self.next_ttag,
            unread: unread.to_vec(),
        })
    }

    /// The queue a handover describes, ready for commands where the old process stopped:
    /// its terms as they were told to the host (whatever this process's settings are), the
    /// bytes read ahead taken first. `digests` are what this controller grants when asked
    /// (no new ICReq comes; kept for what the settings report).
    pub fn resume(state: &crate::handover::QueueState, digests: Digests) -> ControllerQueue<B> {
        let settings = QueueSettings {
            digests,
            cpda: state.cpda.min(MAX_PDA),
            maxh2cdata: state.maxh2cdata.max(MIN_MAXH2CDATA),
            max_in_capsule_data: state.max_in_capsule_data,
            max_r2t: state.max_r2t.max(1),
        };
        let mut q = ControllerQueue::new(settings);
        let n = Negotiated {
            digests: state.digests,
            hpda: state.hpda.min(MAX_PDA),
            max_r2t: state.max_r2t.max(1),
        };
        q.framing = Framing {
            digests: n.digests,
            pda: n.hpda,
        };
        q.deframer.set_limits(Limits {
            digests: n.digests,
            pda: settings.cpda,
            max_data: settings.maxh2cdata.max(settings.max_in_capsule_data),
        });
        q.negotiated = Some(n);
        q.state = State::Ready;
        q.next_ttag = state.next_ttag;
        q.receive(&state.unread);
        q
    }

    /// R2Ts sent and not answered in full: data the host owes.
    pub fn r2ts_outstanding(&self) -> usize {
        self.r2ts.len()
    }

    /// What ICReq settled, once it came.
    pub fn negotiated(&self) -> Option<Negotiated> {
        self.negotiated
    }

    /// Whether the connection is over (a TermReq either way): close it once the transmits
    /// are sent.
    pub fn is_over(&self) -> bool {
        self.state == State::Over
    }

    /// Bytes from the host.
    pub fn receive(&mut self, bytes: &[u8]) {
        if self.state == State::Over {
            return;
        }
        self.deframer.feed(bytes);
        self.received();
    }

    /// The buffer received bytes go in, for a shell that reads straight into it; reserve
    /// [`Self::needed`] first and call [`Self::received`] after.
    pub fn receive_buffer(&mut self) -> &mut BytesMut {
        self.deframer.buffer_mut()
    }

    /// Makes room in [`Self::receive_buffer`] for a read of at least `read` bytes
    /// ([`super::Deframer::reserve_for_read`]: sized once, then reclaimed in place).
    pub fn reserve_for_read(&mut self, read: usize) {
        self.deframer.reserve_for_read(read);
    }

    /// Takes the PDUs the bytes read into [`Self::receive_buffer`] complete.
    pub fn received(&mut self) {
        self.take_buffered();
    }

    /// How many more bytes the next PDU needs: what to read next.
    pub fn needed(&self) -> usize {
        self.deframer.needed().max(1)
    }

    /// The next event for the controller.
    pub fn poll_event(&mut self) -> Option<QueueEvent> {
        self.events.pop_front()
    }

    /// The next event for the controller, left in place.
    pub fn peek_event(&self) -> Option<&QueueEvent> {
        self.events.front()
    }

    /// The next bytes to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit<B>> {
        self.transmits.pop_front()
    }

    /// Asks the host for `len` bytes of command `cid`'s data at `offset` (an R2T); they come
    /// as [`QueueEvent::Data`], the last with `last` set.
    pub fn request_data(&mut self, cid: u16, offset: u32, len: u32) -> Result<(), QueueError> {
        let n = self.negotiated.ok_or(QueueError::NotReady)?;
        if self.state != State::Ready {
            return Err(QueueError::NotReady);
        }
        let outstanding = self.r2ts.iter().filter(|r| r.cid == cid).count();
        if outstanding as u32 >= n.max_r2t {
            return Err(QueueError::R2tLimit(cid));
        }
        let end = offset.checked_add(len).ok_or(QueueError::TooLong)?;
        let ttag = self.next_ttag;
        self.next_ttag = self.next_ttag.wrapping_add(1).max(1);
        self.r2ts.push(Outstanding {
            cid,
            ttag,
            next: offset,
            end,
        });
        let r2t = Header::R2T(R2t {
            cccid: cid,
            ttag,
            r2to: offset,
            r2tl: len,
        });
        self.send(&r2t, Bytes::new());
        Ok(())
    }

    /// Sends `data`, command `cid`'s read data at `offset`, in one C2HData; `last` on the
    /// last of the command's data, and `success` with it when the command succeeded and no
    /// CapsuleResp is to follow (the host must have disabled SQ flow control).
    pub fn send_data(
        &mut self,
        cid: u16,
        offset: u32,
        data: impl Into<Payload<B>>,
        last: bool,
        success: bool,
    ) -> Result<(), QueueError> {
        let data = data.into();
        if self.state != State::Ready {
            return Err(QueueError::NotReady);
        }
        let datal = u32::try_from(data.len()).map_err(|_| QueueError::TooLong)?;
        let h = Header::C2HData(DataHeader {
            cccid: cid,
            ttag: 0,
            datao: offset,
            datal,
            last,
            success: last && success,
        });
        if !self.send(&h, data) {
            return Err(QueueError::TooLong);
        }
        Ok(())
    }

    /// Ends a command with `cqe` (a CapsuleResp). Its R2Ts, if any remain, are forgotten.
    pub fn complete(&mut self, cqe: Cqe) -> Result<(), QueueError> {
        if self.state != State::Ready {
            return Err(QueueError::NotReady);
        }
        self.r2ts.retain(|r| r.cid != cqe.cid);
        self.send(&Header::CapsuleResp(cqe), Bytes::new());
        Ok(())
    }

    /// Ends the connection: a C2HTermReq with `fes` and `fei`, and the header in error.
    pub fn terminate(&mut self, fes: FatalError, fei: u32, pdu_header: &[u8]) {
        if self.state == State::Over {
            return;
        }
        self.transmits.extend(Transmit::term_req(
            &Header::C2HTermReq(TermReq { fes, fei }),
            pdu_header,
        ));
        self.state = State::Over;
        self.events.push_back(QueueEvent::Failed { fes, fei });
    }

    /// Frames `header` with `data` toward the host; false when it cannot be framed.
    fn send(&mut self, header: &Header, data: impl Into<Payload<B>>) -> bool {
        let Some(t) = Transmit::frame(header, data, &self.framing) else {
            return false;
        };
        self.transmits.push_back(t);
        true
    }

    fn fail(&mut self, e: DeframeError) {
        self.terminate(e.fes, e.fei, e.pdu_header());
    }

    /// A PDU from the host.
    fn take(&mut self, pdu: Pdu) -> Result<(), DeframeError> {
        let header_bytes = || -> Vec<u8> {
            encode(&pdu.header, pdu.data.len() as u32, &self.framing)
                .map(|e| e.to_vec())
                .unwrap_or_default()
        };
        let fatal = |fes, fei, bytes: Vec<u8>| Err(DeframeError::from_parts(fes, fei, &bytes));
        match (self.state, pdu.header) {
            (State::AwaitingIcReq, Header::IcReq(r)) => {
                if r.pfv != PFV_1_0 {
                    return fatal(FatalError::UnsupportedParameter, 8, header_bytes());
                }
                if r.hpda > MAX_PDA {
                    return fatal(FatalError::UnsupportedParameter, 10, header_bytes());
                }
                let digests = Digests {
                    header: r.digests.header && self.settings.digests.header,
                    data: r.digests.data && self.settings.digests.data,
                };
                let n = Negotiated {
                    digests,
                    hpda: r.hpda,
                    max_r2t: r.maxr2t.saturating_add(1).min(self.settings.max_r2t),
                };
                // ICResp goes out as initialization framing; what follows with the digests.
                let resp = Header::IcResp(IcResp {
                    pfv: PFV_1_0,
                    cpda: self.settings.cpda,
                    digests,
                    maxh2cdata: self.settings.maxh2cdata,
                });
                self.send(&resp, Bytes::new());
                self.framing = Framing {
                    digests,
                    pda: r.hpda,
                };
                self.deframer.set_limits(Limits {
                    digests,
                    pda: self.settings.cpda,
                    max_data: self
                        .settings
                        .maxh2cdata
                        .max(self.settings.max_in_capsule_data),
                });
                self.negotiated = Some(n);
                self.state = State::Ready;
                self.events.push_back(QueueEvent::Initialized(n));
                Ok(())
            }
            (_, Header::H2CTermReq(t)) => {
                self.state = State::Over;
                self.events.push_back(QueueEvent::Terminated(t));
                Ok(())
            }
            (State::Ready, Header::CapsuleCmd(sqe)) => {
                if pdu.data.len() > self.settings.max_in_capsule_data as usize {
                    return fatal(FatalError::DataLimitExceeded, 4, header_bytes());
                }
                self.events.push_back(QueueEvent::Command(CommandCapsule {
                    sqe,
                    data: pdu.data,
                    data_digest_ok: pdu.data_digest_ok,
                }));
                Ok(())
            }
            (State::Ready, Header::H2CData(d)) => {
                let Some(i) = self.r2ts.iter().position(|r| r.cid == d.cccid) else {
                    return fatal(FatalError::InvalidHeaderField, 8, header_bytes());
                };
                let Some(i) = self.r2ts[i..]
                    .iter()
                    .position(|r| r.cid == d.cccid && r.ttag == d.ttag)
                    .map(|j| i + j)
                else {
                    return fatal(FatalError::InvalidHeaderField, 10, header_bytes());
                };
                let r = self.r2ts[i];
                let end = d.datao.checked_add(d.datal);
                if d.datao != r.next || end.is_none_or(|e| e > r.end) {
                    return fatal(FatalError::DataOutOfRange, 0, header_bytes());
                }
                let next = d.datao + d.datal;
                let done = next == r.end;
                if d.last != done {
                    return fatal(FatalError::InvalidHeaderField, 1, header_bytes());
                }
                if done {
                    self.r2ts.remove(i);
                } else {
                    self.r2ts[i].next = next;
                }
                self.events.push_back(QueueEvent::Data(WriteData {
                    cid: d.cccid,
                    offset: d.datao,
                    data: pdu.data,
                    last: done,
                    data_digest_ok: pdu.data_digest_ok,
                }));
                Ok(())
            }
            // An ICReq again, or anything before it.
            _ => fatal(FatalError::PduSequence, 0, header_bytes()),
        }
    }
}

impl<B: Deref<Target = [u8]>> Receiving for ControllerQueue<B> {
    fn deframer(&mut self) -> &mut Deframer {
        &mut self.deframer
    }

    fn over(&self) -> bool {
        self.state == State::Over
    }

    fn take_pdu(&mut self, pdu: Pdu) -> Result<(), DeframeError> {
        self.take(pdu)
    }

    fn fail(&mut self, e: DeframeError) {
        ControllerQueue::fail(self, e)
    }
}

/// NVMe/TCP under a controller's connection: a write's data comes in H2CData answering an
/// R2T, copied into the command's buffer; a read's goes in one C2HData, which carries the
/// command's success when the host disabled SQ flow control.
impl<B: Deref<Target = [u8]>> Transport<B> for ControllerQueue<B> {
    type Error = QueueError;
    const DATA_CARRIES_SUCCESS: bool = true;

    fn poll_arrival(&mut self) -> Option<Arrival<B>> {
        Some(match self.poll_event()? {
            QueueEvent::Command(c) => Arrival::Command(c),
            QueueEvent::Data(d) => Arrival::Data(d),
            QueueEvent::Initialized(_) | QueueEvent::Terminated(_) | QueueEvent::Failed { .. } => {
                Arrival::Other
            }
        })
    }

    fn peek_command(&self) -> Option<(&Sqe, &[u8])> {
        match self.peek_event()? {
            QueueEvent::Command(c) => Some((&c.sqe, &c.data)),
            _ => None,
        }
    }

    fn has_arrival(&self) -> bool {
        self.peek_event().is_some()
    }

    fn request_data(
        &mut self,
        cid: u16,
        len: u32,
        buffer: B,
        _at: usize,
    ) -> Result<Option<B>, QueueError> {
        ControllerQueue::request_data(self, cid, 0, len)?;
        Ok(Some(buffer))
    }

    fn send_data(&mut self, cid: u16, data: Payload<B>, success: bool) -> Result<(), QueueError> {
        ControllerQueue::send_data(self, cid, 0, data, true, success)
    }

    fn complete(&mut self, cqe: Cqe) -> Result<(), QueueError> {
        ControllerQueue::complete(self, cqe)
    }

    fn is_over(&self) -> bool {
        ControllerQueue::is_over(self)
    }
}

#[cfg(test)]
mod tests {
    use super::super::pdu::{data_digest, IcReq, PduType};
    use super::*;
    use crate::sqe::Sgl;
    use crate::Status;

    /// A host's end for the tests: frames PDUs to the controller and reads its PDUs back.
    struct Host {
        framing: Framing,
        deframer: Deframer,
    }

    impl Host {
        fn new() -> Host {
            Host {
                framing: Framing::default(),
                deframer: Deframer::new(Side::Host),
            }
        }

        fn pdu(&self, header: Header, data: &[u8]) -> Vec<u8> {
            let e = encode(&header, data.len() as u32, &self.framing).unwrap();
            let mut v = e.to_vec();
            v.extend_from_slice(data);
            if e.needs_data_digest() {
                v.extend_from_slice(&data_digest([data]));
            }
            v
        }

        /// Every PDU the controller queued, read as the host would.
        fn read(&mut self, c: &mut ControllerQueue) -> Vec<Pdu> {
            let mut out = Vec::new();
            while let Some(t) = c.poll_transmit() {
                for s in t.slices() {
                    self.deframer.feed(s);
                }
                while let Some(p) = self.deframer.next_pdu().unwrap() {
                    if let Header::IcResp(r) = p.header {
                        self.framing = Framing {
                            digests: r.digests,
                            pda: r.cpda,
                        };
                        self.deframer.set_limits(Limits {
                            digests: r.digests,
                            pda: 0,
                            max_data: 1 << 20,
                        });
                    }
                    out.push(p);
                }
            }
            out
        }
    }

    fn connected(digests: Digests) -> (ControllerQueue, Host) {
        let mut c = ControllerQueue::new(QueueSettings::default());
        let mut h = Host::new();
        let icreq = h.pdu(
            Header::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests,
                maxr2t: 0,
            }),
            &[],
        );
        c.receive(&icreq);
        assert_eq!(
            c.poll_event(),
            Some(QueueEvent::Initialized(Negotiated {
                digests,
                hpda: 0,
                max_r2t: 1
            }))
        );
        let resp = h.read(&mut c);
        assert!(
            matches!(resp[..], [Pdu { header: Header::IcResp(r), .. }] if r.maxh2cdata == 128 * 1024 && r.digests == digests)
        );
        (c, h)
    }

    fn write(cid: u16, len: u32, in_capsule: bool) -> Sqe {
        let mut s = Sqe::new(0x01, cid);
        s.set_nsid(1);
        s.set_sgl(if in_capsule {
            Sgl::in_capsule(0, len)
        } else {
            Sgl::transport(len)
        });
        s
    }

    /// A write with in-capsule data, a write through an R2T in two H2CData PDUs, a read
    /// answered with C2HData and SUCCESS: with digests and without.
    #[test]
    fn commands_data_and_completions_flow() {
        for digests in [
            Digests::default(),
            Digests {
                header: true,
                data: true,
            },
        ] {
            let (mut c, mut h) = connected(digests);
            // In-capsule data.
            c.receive(&h.pdu(Header::CapsuleCmd(write(1, 512, true)), &[7; 512]));
            let Some(QueueEvent::Command(CommandCapsule {
                sqe,
                data,
                data_digest_ok: true,
            })) = c.poll_event()
            else {
                panic!("a command");
            };
            assert_eq!((sqe.cid(), data.len()), (1, 512));
            c.complete(Cqe::new(1, Status::SUCCESS)).unwrap();
            let got = h.read(&mut c);
            assert!(matches!(got[..], [Pdu { header: Header::CapsuleResp(r), .. }] if r.cid == 1));

            // 8 KiB through an R2T, sent as two H2CData.
            c.receive(&h.pdu(Header::CapsuleCmd(write(2, 8192, false)), &[]));
            assert!(matches!(c.poll_event(), Some(QueueEvent::Command(_))));
            c.request_data(2, 0, 8192).unwrap();
            assert_eq!(c.request_data(2, 0, 8192), Err(QueueError::R2tLimit(2)));
            let got = h.read(&mut c);
            let [Pdu {
                header: Header::R2T(r2t),
                ..
            }] = got[..]
            else {
                panic!("{got:?}");
            };
            assert_eq!((r2t.cccid, r2t.r2to, r2t.r2tl), (2, 0, 8192));
            for (offset, last) in [(0u32, false), (4096, true)] {
                let d = Header::H2CData(DataHeader {
                    cccid: 2,
                    ttag: r2t.ttag,
                    datao: offset,
                    datal: 4096,
                    last,
                    success: false,
                });
                c.receive(&h.pdu(d, &[offset as u8; 4096]));
                let Some(QueueEvent::Data(WriteData {
                    cid: 2,
                    offset: o,
                    data,
                    last: l,
                    ..
                })) = c.poll_event()
                else {
                    panic!("data");
                };
                assert_eq!((o, data.len(), l), (offset, 4096, last));
            }
            c.complete(Cqe::new(2, Status::SUCCESS)).unwrap();
            assert_eq!(h.read(&mut c).len(), 1);

            // A read: its data and SUCCESS, no CapsuleResp.
            c.send_data(3, 0, Bytes::from(vec![9u8; 4096]), true, true)
                .unwrap();
            let got = h.read(&mut c);
            let [Pdu {
                header: Header::C2HData(d),
                ref data,
                data_digest_ok: true,
            }] = got[..]
            else {
                panic!("{got:?}");
            };
            assert!(d.last && d.success && d.cccid == 3);
            assert_eq!(data.len(), 4096);
            assert!(!c.is_over());
        }
    }

    /// What the specification calls fatal ends the connection with a C2HTermReq naming it.
    #[test]
    fn protocol_errors_end_the_connection_with_a_c2htermreq() {
        let term = |c: &mut ControllerQueue, h: &mut Host| -> (FatalError, u32) {
            assert!(c.is_over());
            let got = h.read(c);
            let [Pdu {
                header: Header::C2HTermReq(t),
                ref data,
                ..
            }] = got[..]
            else {
                panic!("{got:?}");
            };
            assert!(!data.is_empty() && data.len() <= 128);
            let Some(QueueEvent::Failed { fes, fei }) =
                std::iter::from_fn(|| c.poll_event()).last()
            else {
                panic!("failed");
            };
            assert_eq!((fes, fei), (t.fes, t.fei));
            (t.fes, t.fei)
        };
        // A command before ICReq.
        let mut c = ControllerQueue::new(QueueSettings::default());
        let mut h = Host::new();
        c.receive(&h.pdu(Header::CapsuleCmd(write(1, 0, false)), &[]));
        assert_eq!(term(&mut c, &mut h), (FatalError::PduSequence, 0));
        // An ICReq of another PFV.
        let mut c = ControllerQueue::new(QueueSettings::default());
        let mut h = Host::new();
        c.receive(&h.pdu(
            Header::IcReq(IcReq {
                pfv: 1,
                hpda: 0,
                digests: Digests::default(),
                maxr2t: 0,
            }),
            &[],
        ));
        assert_eq!(term(&mut c, &mut h), (FatalError::UnsupportedParameter, 8));
        // A second ICReq.
        let (mut c, mut h) = connected(Digests::default());
        c.receive(&h.pdu(
            Header::IcReq(IcReq {
                pfv: 0,
                hpda: 0,
                digests: Digests::default(),
                maxr2t: 0,
            }),
            &[],
        ));
        assert_eq!(term(&mut c, &mut h).0, FatalError::PduSequence);
        // H2CData nobody asked for; beyond the R2T; with the wrong tag.
        let h2c = |cccid, ttag, datao, datal, last| {
            Header::H2CData(DataHeader {
                cccid,
                ttag,
                datao,
                datal,
                last,
                success: false,
            })
        };
        let (mut c, mut h) = connected(Digests::default());
        c.receive(&h.pdu(h2c(5, 1, 0, 16, true), &[0; 16]));
        assert_eq!(term(&mut c, &mut h), (FatalError::InvalidHeaderField, 8));
        let (mut c, mut h) = connected(Digests::default());
        c.request_data(5, 0, 16).unwrap();
        h.read(&mut c);
        c.receive(&h.pdu(h2c(5, 1, 0, 32, true), &[0; 32]));
        assert_eq!(term(&mut c, &mut h).0, FatalError::DataOutOfRange);
        let (mut c, mut h) = connected(Digests::default());
        c.request_data(5, 0, 16).unwrap();
        h.read(&mut c);
        c.receive(&h.pdu(h2c(5, 9, 0, 16, true), &[0; 16]));
        assert_eq!(term(&mut c, &mut h), (FatalError::InvalidHeaderField, 10));
        // More in-capsule data than the controller takes.
        let (mut c, mut h) = connected(Digests::default());
        c.receive(&h.pdu(Header::CapsuleCmd(write(1, 9000, true)), &[0; 9000]));
        assert_eq!(term(&mut c, &mut h).0, FatalError::DataLimitExceeded);
        // Garbage.
        let (mut c, mut h) = connected(Digests::default());
        c.receive(&[0xff; 8]);
        assert_eq!(term(&mut c, &mut h), (FatalError::InvalidHeaderField, 0));
        assert_eq!(PduType::C2HTermReq.code(), 3);
    }

    /// A data digest mismatch is not fatal: the command or data comes up marked.
    #[test]
    fn a_data_digest_mismatch_is_marked_not_fatal() {
        let both = Digests {
            header: true,
            data: true,
        };
        let (mut c, h) = connected(both);
        let mut b = h.pdu(Header::CapsuleCmd(write(1, 512, true)), &[7; 512]);
        let n = b.len();
        b[n - 1] ^= 0xff;
        c.receive(&b);
        assert!(matches!(
            c.poll_event(),
            Some(QueueEvent::Command(CommandCapsule {
                data_digest_ok: false,
                ..
            }))
        ));
        assert!(!c.is_over());
    }

    /// The host ends the connection.
    #[test]
    fn an_h2ctermreq_ends_the_connection() {
        let (mut c, h) = connected(Digests::default());
        c.receive(&h.pdu(
            Header::H2CTermReq(TermReq {
                fes: FatalError::HeaderDigest,
                fei: 0,
            }),
            &[1, 2, 3],
        ));
        assert_eq!(
            c.poll_event(),
            Some(QueueEvent::Terminated(TermReq {
                fes: FatalError::HeaderDigest,
                fei: 0
            }))
        );
        assert!(c.is_over());
        assert_eq!(c.request_data(1, 0, 1), Err(QueueError::NotReady));
    }
}
