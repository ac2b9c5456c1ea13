//! The RDMA connection manager's private data for an NVMe queue (NVM Express RDMA Transport
//! Specification 1.0b, section 3.2): the host's request names the queue (QID) and the
//! sizes of its send and receive queues, and the controller accepts with its receive queue
//! size or rejects with a status that names the field it refuses. Each is read here from
//! the bytes the connection manager hands over, whatever their length, and checked before
//! anything is sized by them.

/// RECFMT: the private data's format; 0 (1.0) is the only one.
pub const RECFMT_1_0: u16 = 0;
/// The request's private data: 32 bytes.
pub const REQUEST_LEN: usize = 32;
/// The accept's private data: 32 bytes.
pub const ACCEPT_LEN: usize = 32;
/// The reject's private data: 4 bytes.
pub const REJECT_LEN: usize = 4;

/// Why a controller refuses a queue (the reject's STS).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectStatus {
    /// 01h: the private data is not as long as a request.
    InvalidLength,
    /// 02h: a RECFMT this controller does not know.
    InvalidRecfmt,
    /// 03h: a QID this controller does not admit.
    InvalidQid,
    /// 04h: a host send queue size (HSQSIZE) out of range.
    InvalidHsqsize,
    /// 05h: a host receive queue size (HRQSIZE) out of range.
    InvalidHrqsize,
    /// 06h: no resources for the queue.
    NoResources,
    /// 07h: the RDMA READ depth asked (IRD) is not one this controller gives.
    InvalidIrd,
    /// 08h: the RDMA READ depth offered (ORD) is not one this controller can use.
    InvalidOrd,
    /// 09h: a CNTLID that names no controller of this subsystem.
    InvalidCntlid,
}

impl RejectStatus {
    /// Its STS value.
    pub fn code(self) -> u16 {
        match self {
            RejectStatus::InvalidLength => 0x01,
            RejectStatus::InvalidRecfmt => 0x02,
            RejectStatus::InvalidQid => 0x03,
            RejectStatus::InvalidHsqsize => 0x04,
            RejectStatus::InvalidHrqsize => 0x05,
            RejectStatus::NoResources => 0x06,
            RejectStatus::InvalidIrd => 0x07,
            RejectStatus::InvalidOrd => 0x08,
            RejectStatus::InvalidCntlid => 0x09,
        }
    }

    /// The status of STS `code`, if it is one.
    pub fn from_code(code: u16) -> Option<RejectStatus> {
        Some(match code {
            0x01 => RejectStatus::InvalidLength,
            0x02 => RejectStatus::InvalidRecfmt,
            0x03 => RejectStatus::InvalidQid,
            0x04 => RejectStatus::InvalidHsqsize,
            0x05 => RejectStatus::InvalidHrqsize,
            0x06 => RejectStatus::NoResources,
            0x07 => RejectStatus::InvalidIrd,
            0x08 => RejectStatus::InvalidOrd,
            0x09 => RejectStatus::InvalidCntlid,
            _ => return None,
        })
    }
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

/// The host's request for a queue (RDMA_CM_REQUEST's private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmRequest {
    /// RECFMT.
    pub recfmt: u16,
    /// QID: 0 the admin queue.
    pub qid: u16,
    /// HRQSIZE: entries of the host's receive queue (the responses it can take at once).
    pub hrqsize: u16,
    /// HSQSIZE: the host's send queue size, 0's based (the commands it may send at once,
    /// less one).
    pub hsqsize: u16,
    /// CNTLID: the controller an I/O queue joins (FFFFh: none named; Connect names it).
    pub cntlid: u16,
}

impl CmRequest {
    /// Reads a request from the private data the connection manager delivered; shorter than
    /// a request is [`RejectStatus::InvalidLength`] (more is the transport's padding).
    pub fn decode(private_data: &[u8]) -> Result<CmRequest, RejectStatus> {
        if private_data.len() < REQUEST_LEN {
            return Err(RejectStatus::InvalidLength);
        }
        let b = private_data;
        Ok(CmRequest {
            recfmt: le16(b, 0),
            qid: le16(b, 2),
            hrqsize: le16(b, 4),
            hsqsize: le16(b, 6),
            cntlid: le16(b, 8),
        })
    }

    /// The request's private data.
    pub fn encode(&self) -> [u8; REQUEST_LEN] {
        let mut b = [0u8; REQUEST_LEN];
        for (at, v) in [
            (0, self.recfmt),
            (2, self.qid),
            (4, self.hrqsize),
            (6, self.hsqsize),
            (8, self.cntlid),
        ] {
            b[at..at + 2].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}

/// What a controller admits on a queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueLimits {
    /// Entries an admin queue may have (the host's send queue, HSQSIZE + 1).
    pub admin_entries: u16,
    /// Entries an I/O queue may have (MQES + 1).
    pub io_entries: u16,
    /// The highest QID (the I/O queues a controller may have).
    pub max_qid: u16,
}

/// A queue's terms once the controller accepted them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QueueTerms {
    /// QID.
    pub qid: u16,
    /// Commands the host may have outstanding (HSQSIZE + 1): the receives the controller
    /// posts for its capsules.
    pub entries: u16,
    /// Responses the host can take at once (HRQSIZE): the controller never has more SENDs
    /// of responses outstanding.
    pub host_receives: u16,
}

impl QueueTerms {
    /// Checks `request` against `limits`: RECFMT 1.0, a QID this controller has, a send
    /// queue of at least one entry and at most the queue's limit, and a receive queue able
    /// to take a response for each command the host may send.
    pub fn negotiate(
        request: &CmRequest,
        limits: &QueueLimits,
    ) -> Result<QueueTerms, RejectStatus> {
        if request.recfmt != RECFMT_1_0 {
            return Err(RejectStatus::InvalidRecfmt);
        }
        if request.qid > limits.max_qid {
            return Err(RejectStatus::InvalidQid);
        }
        let most = if request.qid == 0 {
            limits.admin_entries
        } else {
            limits.io_entries
        };
        let entries = u32::from(request.hsqsize) + 1;
        if entries > u32::from(most) {
            return Err(RejectStatus::InvalidHsqsize);
        }
        let entries = entries as u16;
        if request.hrqsize < entries {
            return Err(RejectStatus::InvalidHrqsize);
        }
        Ok(QueueTerms {
            qid: request.qid,
            entries,
            host_receives: request.hrqsize,
        })
    }

    /// The accept that grants these terms: the controller's receive queue takes `entries`
    /// capsules.
    pub fn accept(&self) -> CmAccept {
        CmAccept {
            recfmt: RECFMT_1_0,
            crqsize: self.entries,
        }
    }
}

/// The controller's accept (RDMA_CM_ACCEPT's private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmAccept {
    /// RECFMT.
    pub recfmt: u16,
    /// CRQSIZE: entries of the controller's receive queue.
    pub crqsize: u16,
}

impl CmAccept {
    /// The accept's private data.
    pub fn encode(&self) -> [u8; ACCEPT_LEN] {
        let mut b = [0u8; ACCEPT_LEN];
        b[0..2].copy_from_slice(&self.recfmt.to_le_bytes());
        b[2..4].copy_from_slice(&self.crqsize.to_le_bytes());
        b
    }

    /// Reads an accept (a host's end); `None` if too short.
    pub fn decode(private_data: &[u8]) -> Option<CmAccept> {
        (private_data.len() >= 4).then(|| CmAccept {
            recfmt: le16(private_data, 0),
            crqsize: le16(private_data, 2),
        })
    }
}

/// The controller's reject (RDMA_CM_REJECT's private data).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmReject {
    /// RECFMT.
    pub recfmt: u16,
    /// STS.
    pub status: RejectStatus,
}

impl CmReject {
    /// The reject of a request for `status`.
    pub fn new(status: RejectStatus) -> CmReject {
        CmReject {
            recfmt: RECFMT_1_0,
            status,
        }
    }

    /// The reject's private data.
    pub fn encode(&self) -> [u8; REJECT_LEN] {
        let mut b = [0u8; REJECT_LEN];
        b[0..2].copy_from_slice(&self.recfmt.to_le_bytes());
        b[2..4].copy_from_slice(&self.status.code().to_le_bytes());
        b
    }

    /// Reads a reject (a host's end); `None` if too short or its STS unknown.
    pub fn decode(private_data: &[u8]) -> Option<CmReject> {
        if private_data.len() < REJECT_LEN {
            return None;
        }
        Some(CmReject {
            recfmt: le16(private_data, 0),
            status: RejectStatus::from_code(le16(private_data, 2))?,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LIMITS: QueueLimits = QueueLimits {
        admin_entries: 32,
        io_entries: 128,
        max_qid: 8,
    };

    fn request(qid: u16, hrqsize: u16, hsqsize: u16) -> CmRequest {
        CmRequest {
            recfmt: RECFMT_1_0,
            qid,
            hrqsize,
            hsqsize,
            cntlid: 0xffff,
        }
    }

    /// What Linux's nvme-rdma host asks: an admin queue of 32 entries, then I/O queues of
    /// 128, each receive queue as large as its send queue.
    #[test]
    fn a_hosts_requests_are_read_checked_and_accepted() {
        let admin = request(0, 32, 31);
        let read = CmRequest::decode(&admin.encode()).unwrap();
        assert_eq!(read, admin);
        let terms = QueueTerms::negotiate(&read, &LIMITS).unwrap();
        assert_eq!((terms.entries, terms.host_receives), (32, 32));
        let accept = CmAccept::decode(&terms.accept().encode()).unwrap();
        assert_eq!(
            accept,
            CmAccept {
                recfmt: 0,
                crqsize: 32
            }
        );
        let io = QueueTerms::negotiate(&request(3, 128, 127), &LIMITS).unwrap();
        assert_eq!((io.qid, io.entries), (3, 128));
        // Longer private data (the transport pads it) reads the same.
        let mut padded = admin.encode().to_vec();
        padded.extend_from_slice(&[0xee; 24]);
        assert_eq!(CmRequest::decode(&padded), Ok(admin));
    }

    #[test]
    fn each_field_out_of_range_is_rejected_by_name() {
        let cases = [
            (
                CmRequest {
                    recfmt: 1,
                    ..request(0, 32, 31)
                },
                RejectStatus::InvalidRecfmt,
            ),
            (request(9, 32, 31), RejectStatus::InvalidQid),
            (request(0, 64, 32), RejectStatus::InvalidHsqsize),
            (request(1, 200, 128), RejectStatus::InvalidHsqsize),
            (request(1, 0xffff, 0xffff), RejectStatus::InvalidHsqsize),
            (request(1, 16, 31), RejectStatus::InvalidHrqsize),
        ];
        for (r, want) in cases {
            assert_eq!(QueueTerms::negotiate(&r, &LIMITS), Err(want), "{r:?}");
            let reject = CmReject::decode(&CmReject::new(want).encode()).unwrap();
            assert_eq!(reject.status, want);
        }
        for n in 0..REQUEST_LEN {
            assert_eq!(
                CmRequest::decode(&vec![0; n]),
                Err(RejectStatus::InvalidLength)
            );
        }
        for code in 1..=9 {
            assert_eq!(RejectStatus::from_code(code).unwrap().code(), code);
        }
        assert_eq!(RejectStatus::from_code(0), None);
        assert_eq!(CmReject::decode(&[0, 0, 0x0a, 0]), None);
    }
}
