//! The host's end of one NVMe/TCP connection, as a machine: it opens the connection with
//! ICReq, sends command capsules and the H2CData an R2T asks for, and hands up what the
//! controller sends (ICResp's terms, completions, read data, R2Ts). What the commands are is
//! the caller's (initiator-bench, the tests); how the bytes move is the shell's.

use std::collections::VecDeque;

use bytes::{Bytes, BytesMut};

use super::deframer::{DeframeError, Deframer, Limits, Pdu, Receiving, Side};
use super::pdu::{
    encode, DataHeader, Digests, FatalError, Framing, Header, IcReq, IcResp, R2t, TermReq, MAX_PDA,
    MIN_MAXH2CDATA, PFV_1_0,
};
use super::queue::{QueueError, Transmit};
use crate::cqe::Cqe;
use crate::sqe::Sqe;

/// What the host asks of a connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostSettings {
    /// The digests asked for.
    pub digests: Digests,
    /// HPDA: the data alignment the host asks of the controller.
    pub hpda: u8,
    /// MAXR2T: R2Ts the controller may have outstanding per command, 0's based.
    pub maxr2t: u32,
    /// The most data the host takes in one C2HData.
    pub max_data: u32,
}

impl Default for HostSettings {
    /// No digests, no alignment, one R2T at a time, up to 1 MiB per C2HData.
    fn default() -> Self {
        HostSettings {
            digests: Digests::default(),
            hpda: 0,
            maxr2t: 0,
            max_data: 1 << 20,
        }
    }
}

/// What the connection hands up to the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HostEvent {
    /// ICResp came: the controller's terms.
    Initialized(IcResp),
    /// A completion.
    Response(Cqe),
    /// Read data.
    Data {
        /// The command's CID.
        cid: u16,
        /// Offset in the command's data.
        offset: u32,
        /// The data.
        data: Bytes,
        /// The last of it.
        last: bool,
        /// SUCCESS: the command succeeded, no completion follows.
        success: bool,
        /// False when the data digest did not match.
        data_digest_ok: bool,
    },
    /// The controller asks for a write's data.
    R2T(R2t),
    /// The controller ended the connection with a C2HTermReq.
    Terminated(TermReq),
    /// A fatal error here: the H2CTermReq that says so is queued.
    Failed {
        /// Why.
        fes: FatalError,
        /// The field in error.
        fei: u32,
    },
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    AwaitingIcResp,
    Ready,
    Over,
}

/// The host's end of one NVMe/TCP connection.
#[derive(Debug)]
pub struct HostQueue {
    settings: HostSettings,
    state: State,
    deframer: Deframer,
    framing: Framing,
    terms: Option<IcResp>,
    events: VecDeque<HostEvent>,
    transmits: VecDeque<Transmit>,
}

impl HostQueue {
    /// A connection just made: its ICReq is queued.
    pub fn new(settings: HostSettings) -> HostQueue {
        let settings = HostSettings {
            hpda: settings.hpda.min(MAX_PDA),
            ..settings
        };
        let mut q = HostQueue {
            settings,
            state: State::AwaitingIcResp,
            deframer: Deframer::new(Side::Host),
            framing: Framing::default(),
            terms: None,
            events: VecDeque::new(),
            transmits: VecDeque::new(),
        };
        q.send(
            &Header::IcReq(IcReq {
                pfv: PFV_1_0,
                hpda: settings.hpda,
                digests: settings.digests,
                maxr2t: settings.maxr2t,
            }),
            Bytes::new(),
        );
        q
    }

    /// The controller's terms, once ICResp came.
    pub fn terms(&self) -> Option<IcResp> {
        self.terms
    }

    /// Whether the connection is over.
    pub fn is_over(&self) -> bool {
        self.state == State::Over
    }

    /// Bytes from the controller.
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

    /// Takes the PDUs the bytes read into [`Self::receive_buffer`] complete.
    pub fn received(&mut self) {
        self.take_buffered();
    }

    /// How many more bytes the next PDU needs.
    pub fn needed(&self) -> usize {
        self.deframer.needed().max(1)
    }

    /// The next event.
    pub fn poll_event(&mut self) -> Option<HostEvent> {
        self.events.pop_front()
    }

    /// The next bytes to send.
    pub fn poll_transmit(&mut self) -> Option<Transmit> {
        self.transmits.pop_front()
    }

    /// Sends command `sqe` with its in-capsule `data` (empty when none).
    pub fn send_command(&mut self, sqe: &Sqe, data: Bytes) -> Result<(), QueueError> {
        if self.state != State::Ready {
            return Err(QueueError::NotReady);
        }
        if !self.send(&Header::CapsuleCmd(*sqe), data) {
            return Err(QueueError::TooLong);
        }
        Ok(())
    }

    /// Answers R2T `r2t` with `data` (its R2TL bytes), in H2CData PDUs of at most the
    /// controller's MAXH2CDATA.
    pub fn send_data(&mut self, r2t: &R2t, data: Bytes) -> Result<(), QueueError> {
        let terms = self.terms.ok_or(QueueError::NotReady)?;
        if self.state != State::Ready {
            return Err(QueueError::NotReady);
        }
        if data.len() != r2t.r2tl as usize {
            return Err(QueueError::TooLong);
        }
        let chunk = terms.maxh2cdata.max(MIN_MAXH2CDATA) as usize;
        let mut at = 0usize;
        while at < data.len() {
            let end = (at + chunk).min(data.len());
            let piece = data.slice(at..end);
            let h = Header::H2CData(DataHeader {
                cccid: r2t.cccid,
                ttag: r2t.ttag,
                datao: r2t.r2to + at as u32,
                datal: piece.len() as u32,
                last: end == data.len(),
                success: false,
            });
            self.send(&h, piece);
            at = end;
        }
        Ok(())
    }

    /// Ends the connection with an H2CTermReq.
    pub fn terminate(&mut self, fes: FatalError, fei: u32, pdu_header: &[u8]) {
        if self.state == State::Over {
            return;
        }
        self.transmits.extend(Transmit::term_req(
            &Header::H2CTermReq(TermReq { fes, fei }),
            pdu_header,
        ));
        self.state = State::Over;
        self.events.push_back(HostEvent::Failed { fes, fei });
    }

    fn send(&mut self, header: &Header, data: Bytes) -> bool {
        let Some(t) = Transmit::frame(header, data, &self.framing) else {
            return false;
        };
        self.transmits.push_back(t);
        true
    }

    fn fail(&mut self, e: DeframeError) {
        self.terminate(e.fes, e.fei, e.pdu_header());
    }

    fn take(
        &mut self,
        header: Header,
        data: Bytes,
        data_digest_ok: bool,
    ) -> Result<(), DeframeError> {
        let fatal = |fes, fei| {
            let bytes = encode(&header, data.len() as u32, &self.framing)
                .map(|e| e.to_vec())
                .unwrap_or_default();
            Err(DeframeError::from_parts(fes, fei, &bytes))
        };
        match (self.state, header) {
            (State::AwaitingIcResp, Header::IcResp(r)) => {
                if r.pfv != PFV_1_0 {
                    return fatal(FatalError::UnsupportedParameter, 8);
                }
                if r.cpda > MAX_PDA {
                    return fatal(FatalError::UnsupportedParameter, 10);
                }
                if r.maxh2cdata < MIN_MAXH2CDATA || r.maxh2cdata % 4 != 0 {
                    return fatal(FatalError::InvalidHeaderField, 12);
                }
                // The controller grants at most what was asked.
                let asked = self.settings.digests;
                if (r.digests.header && !asked.header) || (r.digests.data && !asked.data) {
                    return fatal(FatalError::InvalidHeaderField, 11);
                }
                self.framing = Framing {
                    digests: r.digests,
                    pda: r.cpda,
                };
                self.deframer.set_limits(Limits {
                    digests: r.digests,
                    pda: self.settings.hpda,
                    max_data: self.settings.max_data,
                });
                self.terms = Some(r);
                self.state = State::Ready;
                self.events.push_back(HostEvent::Initialized(r));
                Ok(())
            }
            (_, Header::C2HTermReq(t)) => {
                self.state = State::Over;
                self.events.push_back(HostEvent::Terminated(t));
                Ok(())
            }
            (State::Ready, Header::CapsuleResp(cqe)) => {
                self.events.push_back(HostEvent::Response(cqe));
                Ok(())
            }
            (State::Ready, Header::C2HData(d)) => {
                if d.success && !d.last {
                    return fatal(FatalError::InvalidHeaderField, 1);
                }
                self.events.push_back(HostEvent::Data {
                    cid: d.cccid,
                    offset: d.datao,
                    data,
                    last: d.last,
                    success: d.success,
                    data_digest_ok,
                });
                Ok(())
            }
            (State::Ready, Header::R2T(r)) => {
                self.events.push_back(HostEvent::R2T(r));
                Ok(())
            }
            _ => fatal(FatalError::PduSequence, 0),
        }
    }
}

impl Receiving for HostQueue {
    fn deframer(&mut self) -> &mut Deframer {
        &mut self.deframer
    }

    fn over(&self) -> bool {
        self.state == State::Over
    }

    fn take_pdu(&mut self, pdu: Pdu) -> Result<(), DeframeError> {
        self.take(pdu.header, pdu.data, pdu.data_digest_ok)
    }

    fn fail(&mut self, e: DeframeError) {
        HostQueue::fail(self, e)
    }
}
