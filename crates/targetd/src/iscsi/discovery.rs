//! Discovery sessions (RFC 7143 section 4.3): SendTargets, NOP-Out and Logout; anything else is
//! rejected. Only the targets the initiator may log in to are listed.

use iscsi_pdu::negotiation::Negotiator;
use iscsi_pdu::{
    Bhs, Digests, LogoutResponse, LogoutResponseCode, NopIn, Pdu, Reject, RejectReason,
    SerialNumber, RESERVED_TAG,
};

use super::connection::wait_for;
use super::login::Peer;
use super::session::Request;
use super::wire::{Incoming, ReadError, Reader, Writer};
use crate::server::Shared;
use iscsi_pdu::target::TextExchange;

/// Serves a discovery session until logout or close.
#[allow(clippy::too_many_arguments)]
pub async fn serve(
    mut reader: Reader,
    mut writer: Writer,
    mut negotiator: Negotiator,
    initiator: &str,
    mut stat_sn: SerialNumber,
    mut exp_cmd_sn: SerialNumber,
    shared: &Shared,
    peer: &Peer,
) {
    let c = *negotiator.connection();
    let digests = Digests {
        header: c.header_digest,
        data: c.data_digest,
    };
    reader.set_digests(digests);
    reader.set_max_recv(c.max_recv_data_segment_length);
    writer.digests = digests;
    writer.max_send = c.max_send_data_segment_length;
    let window = shared.window();
    let mut text = TextExchange::default();
    loop {
        let incoming = tokio::select! {
            i = reader.next() => i,
            _ = wait_for(&peer.control, Request::Logout) => return,
        };
        let pdu = match incoming {
            Ok(Incoming::Whole(p)) => Ok(p),
            Ok(Incoming::Payload { header, .. }) => {
                // SCSI commands and Data-Out have no place in a discovery session.
                reader.discard();
                Err((RejectReason::ProtocolError, header))
            }
            Err(ReadError::Reject { reason, header }) => Err((reason, *header)),
            Err(e) => {
                tracing::debug!(peer = %peer.addr, "discovery session ends: {e}");
                return;
            }
        };
        let pdu = match pdu {
            Ok(p) => p,
            Err((reason, header)) => {
                let r = reject(
                    reason,
                    &header,
                    stat_sn,
                    exp_cmd_sn,
                    exp_cmd_sn + (window - 1),
                );
                stat_sn = stat_sn.next();
                if writer.send_pdu(r).await.is_err() {
                    return;
                }
                continue;
            }
        };
        let (immediate, cmd_sn) = match &pdu {
            Pdu::TextRequest(t) => (t.immediate, t.cmd_sn),
            Pdu::NopOut(n) => (n.immediate, n.cmd_sn),
            Pdu::LogoutRequest(l) => (l.immediate, l.cmd_sn),
            _ => (true, exp_cmd_sn),
        };
        if !immediate && cmd_sn == exp_cmd_sn {
            exp_cmd_sn = exp_cmd_sn.next();
        }
        let max_cmd_sn = exp_cmd_sn + (window - 1);
        let (reply, end) = match pdu {
            Pdu::TextRequest(t) => {
                let r = text.request(&t, &mut negotiator, writer.max_send, |value| {
                    shared.send_targets(initiator, peer.addr.ip(), peer.local, value, None)
                });
                match r {
                    Ok(mut r) => {
                        r.stat_sn = stat_sn;
                        r.exp_cmd_sn = exp_cmd_sn;
                        r.max_cmd_sn = max_cmd_sn;
                        writer.max_send = negotiator.connection().max_send_data_segment_length;
                        (Pdu::TextResponse(r), false)
                    }
                    Err(reason) => (
                        reject(
                            reason,
                            &Pdu::TextRequest(t).bhs(),
                            stat_sn,
                            exp_cmd_sn,
                            max_cmd_sn,
                        ),
                        false,
                    ),
                }
            }
            Pdu::NopOut(n) if n.initiator_task_tag != RESERVED_TAG => {
                let mut data = n.data;
                data.truncate(writer.max_send as usize);
                (
                    Pdu::NopIn(NopIn {
                        lun: n.lun,
                        initiator_task_tag: n.initiator_task_tag,
                        target_transfer_tag: RESERVED_TAG,
                        stat_sn,
                        exp_cmd_sn,
                        max_cmd_sn,
                        data,
                    }),
                    false,
                )
            }
            Pdu::NopOut(_) => continue,
            Pdu::LogoutRequest(l) => (
                Pdu::LogoutResponse(LogoutResponse {
                    response: LogoutResponseCode::ClosedSuccessfully,
                    initiator_task_tag: l.initiator_task_tag,
                    stat_sn,
                    exp_cmd_sn,
                    max_cmd_sn,
                    time2wait: 0,
                    time2retain: 0,
                }),
                true,
            ),
            other => (
                reject(
                    RejectReason::ProtocolError,
                    &other.bhs(),
                    stat_sn,
                    exp_cmd_sn,
                    max_cmd_sn,
                ),
                false,
            ),
        };
        stat_sn = stat_sn.next();
        if writer.send_pdu(reply).await.is_err() || end {
            let _ = writer.shutdown().await;
            return;
        }
    }
}

fn reject(
    reason: RejectReason,
    header: &Bhs,
    stat_sn: SerialNumber,
    exp_cmd_sn: SerialNumber,
    max_cmd_sn: SerialNumber,
) -> Pdu {
    let mut r = Reject::of(reason, header);
    r.stat_sn = stat_sn;
    r.exp_cmd_sn = exp_cmd_sn;
    r.max_cmd_sn = max_cmd_sn;
    Pdu::Reject(r)
}
