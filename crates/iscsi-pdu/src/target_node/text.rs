//! Text requests in full feature phase (RFC 7143 section 11.10): SendTargets and renegotiation,
//! with long requests reassembled and long responses continued under a Target Transfer Tag.

use crate::names::valid_iscsi_name;
use crate::negotiation::Negotiator;
use crate::text::{split_text, TextParams, TextReassembler};
use crate::{RejectReason, Stage, TextRequest, TextResponse, RESERVED_TAG};
use bytes::Bytes;

/// The TTT of a continued response.
const CONTINUE_TAG: u32 = 0x7fff_fffe;

/// One connection's text exchange in progress.
#[derive(Debug, Default)]
pub struct TextExchange {
    request: TextReassembler,
    /// The rest of a response: the text and how much was sent.
    rest: Option<(Bytes, usize)>,
}

impl TextExchange {
    /// Whether no exchange is half done (neither a request nor a response in pieces).
    pub fn is_idle(&self) -> bool {
        self.rest.is_none() && !self.request.in_progress()
    }

    /// Answers one Text Request. `send_targets` gives the SendTargets answer for a value. The
    /// response's StatSN, ExpCmdSN and MaxCmdSN are the caller's to fill.
    pub fn request(
        &mut self,
        req: &TextRequest,
        negotiator: &mut Negotiator,
        max_send: u32,
        send_targets: impl FnOnce(&str) -> TextParams,
    ) -> Result<TextResponse, RejectReason> {
        let mut r = TextResponse {
            final_bit: true,
            lun: req.lun,
            initiator_task_tag: req.initiator_task_tag,
            target_transfer_tag: RESERVED_TAG,
            ..TextResponse::default()
        };
        if req.target_transfer_tag != RESERVED_TAG {
            // The initiator asks for the rest of our response.
            let Some((text, at)) = self.rest.take() else {
                return Err(RejectReason::InvalidPduField);
            };
            if req.target_transfer_tag != CONTINUE_TAG || !req.data.is_empty() {
                return Err(RejectReason::ProtocolError);
            }
            self.chunk(&mut r, text, at, max_send);
            return Ok(r);
        }
        // A new exchange resets any response left unfinished (RFC 7143 section 11.10.4).
        self.rest = None;
        if !self.request.in_progress() {
            negotiator.begin_text_exchange();
        }
        let all = match self.request.push(&req.data, req.continue_bit) {
            Ok(Some(all)) => all,
            Ok(None) => {
                // More of the request follows: an empty answer that invites it.
                r.final_bit = false;
                r.target_transfer_tag = CONTINUE_TAG;
                return Ok(r);
            }
            Err(_) => {
                self.request.reset();
                return Err(RejectReason::ProtocolError);
            }
        };
        let params = TextParams::parse(&all).map_err(|_| RejectReason::ProtocolError)?;
        // A request this target cannot answer as asked (an unknown key, a SendTargets value
        // that is neither All, an iSCSI name nor empty) gets a Reject (protocol error), as
        // LIO answers: the RFC's key=NotUnderstood and SendTargets=Reject answers make
        // initiators such as libiscsi take the reply for a broken one and reconnect.
        let mut out = match params.get("SendTargets") {
            // All, an iSCSI name, or nothing (this session's target): RFC 7143 section 13.x.
            Some(v) if v == "All" || v.is_empty() || valid_iscsi_name(v) => send_targets(v),
            Some(v) => {
                tracing::debug!(value = %v, "SendTargets with a value it cannot have: Reject");
                return Err(RejectReason::ProtocolError);
            }
            None => TextParams::new(),
        };
        match negotiator.receive(Stage::FullFeaturePhase, &params) {
            Ok(answers) => {
                if let Some((key, _)) = answers.iter().find(|(_, v)| *v == "NotUnderstood") {
                    tracing::debug!(%key, "a text key this target does not know: Reject");
                    return Err(RejectReason::ProtocolError);
                }
                out.extend(answers)
            }
            Err(e) => {
                tracing::debug!("text negotiation: {e}");
                return Err(RejectReason::ProtocolError);
            }
        }
        self.chunk(&mut r, out.encode(), 0, max_send);
        Ok(r)
    }

    fn chunk(&mut self, r: &mut TextResponse, text: Bytes, at: usize, max_send: u32) {
        let rest = text.slice(at..);
        let (chunk, more) = split_text(&rest, max_send.max(512) as usize)
            .next()
            .unwrap_or((Bytes::new(), false));
        if more {
            r.final_bit = false;
            r.continue_bit = true;
            r.target_transfer_tag = CONTINUE_TAG;
            self.rest = Some((text, at + chunk.len()));
        }
        r.data = chunk;
    }
}
