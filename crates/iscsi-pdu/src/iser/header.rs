//! The iSER header (RFC 7145 section 9.2) that precedes every iSCSI control-type PDU in an
//! RDMA Send, and the iSER Hello and HelloReply messages (section 9.3) that iWARP peers
//! exchange before the login.

use super::IserError;

/// Bytes of the iSER header of a control-type PDU.
pub const ISER_HEADER_LEN: usize = 28;

/// The iSER version this side speaks (RFC 7145 section 9.3: 10).
pub const ISER_VERSION: u8 = 10;

/// The opcode in the high nibble of the first byte.
const OPCODE_CONTROL: u8 = 0x1;
const OPCODE_HELLO: u8 = 0x2;
const OPCODE_HELLO_REPLY: u8 = 0x3;
/// Write STag valid.
const WSV: u8 = 0x08;
/// Read STag valid.
const RSV: u8 = 0x04;
/// HelloReply: the peer's versions are refused.
const REJ: u8 = 0x01;

/// A buffer of the peer's that RDMA reaches: its STag (the remote key) and the tagged offset
/// (the virtual address) of its first byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct RemoteBuffer {
    /// The STag.
    pub stag: u32,
    /// Its base offset.
    pub va: u64,
}

/// The iSER header of a control-type PDU. An initiator names in a SCSI Command the buffers
/// the target moves the data with: the write buffer it reads solicited data-out from (RDMA
/// READ), the read buffer it writes data-in into (RDMA WRITE). Every other PDU, and every PDU
/// a target sends, has neither.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct IserHeader {
    /// Write STag and Write Base Offset: where the data-out beyond the unsolicited data is.
    pub write: Option<RemoteBuffer>,
    /// Read STag and Read Base Offset: where the data-in goes.
    pub read: Option<RemoteBuffer>,
}

impl IserHeader {
    /// The header as sent.
    pub fn encode(&self) -> [u8; ISER_HEADER_LEN] {
        let mut b = [0u8; ISER_HEADER_LEN];
        b[0] = OPCODE_CONTROL << 4;
        if let Some(w) = self.write {
            b[0] |= WSV;
            b[4..8].copy_from_slice(&w.stag.to_be_bytes());
            b[8..16].copy_from_slice(&w.va.to_be_bytes());
        }
        if let Some(r) = self.read {
            b[0] |= RSV;
            b[16..20].copy_from_slice(&r.stag.to_be_bytes());
            b[20..28].copy_from_slice(&r.va.to_be_bytes());
        }
        b
    }

    /// Decodes the header of a control-type message (its opcode already checked).
    fn decode(b: &[u8; ISER_HEADER_LEN]) -> IserHeader {
        let stag = |at: usize| u32::from_be_bytes(b[at..at + 4].try_into().expect("4 bytes"));
        let va = |at: usize| u64::from_be_bytes(b[at..at + 8].try_into().expect("8 bytes"));
        IserHeader {
            write: (b[0] & WSV != 0).then(|| RemoteBuffer {
                stag: stag(4),
                va: va(8),
            }),
            read: (b[0] & RSV != 0).then(|| RemoteBuffer {
                stag: stag(16),
                va: va(20),
            }),
        }
    }
}

/// iSER Hello: the initiator's versions and how many RDMA READs it answers at once (IRD).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Hello {
    /// The highest iSER version it speaks.
    pub max_version: u8,
    /// The lowest.
    pub min_version: u8,
    /// Its inbound RDMA READ queue depth.
    pub ird: u16,
}

/// iSER HelloReply: the target's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HelloReply {
    /// The initiator's versions are refused (the connection then closes).
    pub reject: bool,
    /// The highest iSER version the target speaks.
    pub max_version: u8,
    /// The version the connection runs.
    pub current_version: u8,
    /// How many RDMA READs the target issues at once (ORD).
    pub ord: u16,
}

impl Hello {
    /// The target's answer: version 10 when the initiator's range holds it, with at most
    /// `ord` RDMA READs outstanding and never more than the initiator answers.
    pub fn reply(&self, ord: u16) -> HelloReply {
        let ok = (self.min_version..=self.max_version).contains(&ISER_VERSION);
        HelloReply {
            reject: !ok,
            max_version: ISER_VERSION,
            current_version: ISER_VERSION,
            ord: ord.min(self.ird),
        }
    }

    /// As sent.
    pub fn encode(&self) -> [u8; ISER_HEADER_LEN] {
        let mut b = [0u8; ISER_HEADER_LEN];
        b[0] = OPCODE_HELLO << 4;
        b[1] = (self.max_version & 0xf) << 4 | (self.min_version & 0xf);
        b[2..4].copy_from_slice(&self.ird.to_be_bytes());
        b
    }
}

impl HelloReply {
    /// As sent.
    pub fn encode(&self) -> [u8; ISER_HEADER_LEN] {
        let mut b = [0u8; ISER_HEADER_LEN];
        b[0] = OPCODE_HELLO_REPLY << 4 | if self.reject { REJ } else { 0 };
        b[1] = (self.max_version & 0xf) << 4 | (self.current_version & 0xf);
        b[2..4].copy_from_slice(&self.ord.to_be_bytes());
        b
    }
}

/// What an RDMA Send carries, by the opcode of its iSER header.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// An iSCSI control-type PDU follows the header.
    Control(IserHeader),
    /// iSER Hello.
    Hello(Hello),
    /// iSER HelloReply.
    HelloReply(HelloReply),
}

impl Kind {
    /// Decodes the iSER header at the start of a message.
    pub fn decode(msg: &[u8]) -> Result<Kind, IserError> {
        let Some(b) = msg.first_chunk::<ISER_HEADER_LEN>() else {
            return Err(IserError::Short(msg.len()));
        };
        let versions = (b[1] >> 4, b[1] & 0xf);
        let ird_ord = u16::from_be_bytes([b[2], b[3]]);
        match b[0] >> 4 {
            OPCODE_CONTROL => Ok(Kind::Control(IserHeader::decode(b))),
            OPCODE_HELLO => Ok(Kind::Hello(Hello {
                max_version: versions.0,
                min_version: versions.1,
                ird: ird_ord,
            })),
            OPCODE_HELLO_REPLY => Ok(Kind::HelloReply(HelloReply {
                reject: b[0] & REJ != 0,
                max_version: versions.0,
                current_version: versions.1,
                ord: ird_ord,
            })),
            op => Err(IserError::Opcode(op)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn headers_round_trip_as_linux_lays_them_out() {
        let h = IserHeader {
            write: Some(RemoteBuffer {
                stag: 0x1234_5678,
                va: 0x7f00_0000_1000,
            }),
            read: None,
        };
        let b = h.encode();
        // struct iser_ctrl: flags, 3 reserved, write_stag, write_va, read_stag, read_va.
        assert_eq!(b[0], 0x18);
        assert_eq!(&b[4..8], &[0x12, 0x34, 0x56, 0x78]);
        assert_eq!(&b[8..16], &0x7f00_0000_1000u64.to_be_bytes());
        assert_eq!(&b[16..], &[0; 12]);
        assert_eq!(Kind::decode(&b).unwrap(), Kind::Control(h));
        let r = IserHeader {
            write: None,
            read: Some(RemoteBuffer { stag: 7, va: 9 }),
        };
        assert_eq!(r.encode()[0], 0x14);
        assert_eq!(Kind::decode(&r.encode()).unwrap(), Kind::Control(r));
        assert_eq!(IserHeader::default().encode()[0], 0x10);
    }

    #[test]
    fn hello_is_answered_with_version_10_or_refused() {
        let hello = Hello {
            max_version: 10,
            min_version: 10,
            ird: 4,
        };
        let b = hello.encode();
        assert_eq!((b[0], b[1], b[3]), (0x20, 0xaa, 4));
        assert_eq!(Kind::decode(&b).unwrap(), Kind::Hello(hello));
        let reply = hello.reply(16);
        assert!(!reply.reject);
        assert_eq!(
            reply.ord, 4,
            "no more RDMA READs than the initiator answers"
        );
        assert_eq!(
            Kind::decode(&reply.encode()).unwrap(),
            Kind::HelloReply(reply)
        );
        let old = Hello {
            max_version: 9,
            min_version: 8,
            ird: 4,
        };
        assert!(old.reply(16).reject);
        assert_eq!(old.reply(16).encode()[0], 0x31);
    }

    #[test]
    fn short_and_unknown_messages_are_errors() {
        assert_eq!(Kind::decode(&[0x10; 27]), Err(IserError::Short(27)));
        let mut b = [0u8; ISER_HEADER_LEN];
        b[0] = 0x40;
        assert_eq!(Kind::decode(&b), Err(IserError::Opcode(4)));
    }
}
