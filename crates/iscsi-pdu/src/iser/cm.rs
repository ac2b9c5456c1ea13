//! The private data of the RDMA/CM connection request and reply (RFC 7145 section 9.1, Linux's
//! `struct iser_cm_hdr`): what each side does not support of zero-based virtual addresses
//! and Send with Invalidate.

/// The initiator's flags: zero-based virtual addresses not supported.
const ZBVA_NOT_SUPPORTED: u8 = 0x80;
/// Send with Invalidate not supported.
const SEND_WITH_INVALIDATE_NOT_SUPPORTED: u8 = 0x40;

/// Bytes of the iSER CM header.
pub const CM_HEADER_LEN: usize = 4;

/// The iSER CM header of a connection request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CmRequest {
    /// The initiator cannot take zero-based virtual addresses.
    pub zbva_not_supported: bool,
    /// The initiator cannot take Send with Invalidate.
    pub send_with_invalidate_not_supported: bool,
}

impl CmRequest {
    /// Decodes a request's private data. An initiator that sends none (or an RDMA/CM that
    /// pads it with zeros) supports both; reserved bits are ignored.
    pub fn decode(private_data: &[u8]) -> CmRequest {
        let flags = private_data.first().copied().unwrap_or(0);
        CmRequest {
            zbva_not_supported: flags & ZBVA_NOT_SUPPORTED != 0,
            send_with_invalidate_not_supported: flags & SEND_WITH_INVALIDATE_NOT_SUPPORTED != 0,
        }
    }

    /// As sent.
    pub fn encode(&self) -> [u8; CM_HEADER_LEN] {
        let mut flags = 0;
        if self.zbva_not_supported {
            flags |= ZBVA_NOT_SUPPORTED;
        }
        if self.send_with_invalidate_not_supported {
            flags |= SEND_WITH_INVALIDATE_NOT_SUPPORTED;
        }
        [flags, 0, 0, 0]
    }
}

/// The iSER CM header of the target's reply: what it will not use. This target names the
/// initiator's buffers by the addresses the initiator gives and never sends with invalidate,
/// so it uses neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CmReply {
    /// Zero-based virtual addresses are not used.
    pub zbva_not_used: bool,
    /// Send with Invalidate is not used.
    pub send_with_invalidate_not_used: bool,
}

impl Default for CmReply {
    /// This target's reply: uses neither.
    fn default() -> CmReply {
        CmReply {
            zbva_not_used: true,
            send_with_invalidate_not_used: true,
        }
    }
}

impl CmReply {
    /// As sent.
    pub fn encode(&self) -> [u8; CM_HEADER_LEN] {
        let r = CmRequest {
            zbva_not_supported: self.zbva_not_used,
            send_with_invalidate_not_supported: self.send_with_invalidate_not_used,
        };
        r.encode()
    }

    /// Decodes a reply's private data.
    pub fn decode(private_data: &[u8]) -> CmReply {
        let r = CmRequest::decode(private_data);
        CmReply {
            zbva_not_used: r.zbva_not_supported,
            send_with_invalidate_not_used: r.send_with_invalidate_not_supported,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_data_as_linux_and_libiscsi_send_it() {
        // ib_iser on a device without remote invalidation; libiscsi always.
        let r = CmRequest::decode(&[0xc0, 0, 0, 0]);
        assert!(r.zbva_not_supported && r.send_with_invalidate_not_supported);
        assert_eq!(r.encode(), [0xc0, 0, 0, 0]);
        // RDMA/CM pads the private data with zeros; none at all is every feature.
        assert_eq!(CmRequest::decode(&[0x80; 56]).encode(), [0x80, 0, 0, 0]);
        assert_eq!(CmRequest::decode(&[]), CmRequest::default());
        assert_eq!(CmReply::default().encode(), [0xc0, 0, 0, 0]);
        assert_eq!(
            CmReply::decode(&CmReply::default().encode()),
            CmReply::default()
        );
    }
}
