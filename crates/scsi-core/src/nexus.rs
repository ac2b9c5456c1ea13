//! Initiator ports and I_T nexuses (SAM-5 section 4.6), and the TransportID that names an
//! initiator port in persistent reservation parameter data (SPC-4 section 7.6.4).

use crate::sense::{FieldPointer, Sense};

/// PROTOCOL IDENTIFIER values (SPC-4 table 362) of the transports this crate serves.
pub mod protocol {
    /// SCSI RDMA Protocol.
    pub const SRP: u8 = 0x4;
    /// iSCSI.
    pub const ISCSI: u8 = 0x5;
    /// An NVMe host, named by its Host Identifier: no SCSI protocol identifier names one, so
    /// it takes "no specific protocol". Its reservations are kept by the same engine; no
    /// SCSI command ever carries such a TransportID.
    pub const NVME_HOST: u8 = 0xf;
}

/// The name of an initiator port, as a TransportID carries it.
///
/// For iSCSI the name is the initiator's iSCSI name and `port` the ISID in hex (the initiator
/// port is `name,i,0x<isid>`); a TransportID without an ISID (format 00b) stands for every port
/// of that name. For SRP the name is the 16-byte initiator port identifier in hex.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TransportId {
    /// PROTOCOL IDENTIFIER.
    pub protocol: u8,
    /// iSCSI name (compared case-insensitively) or SRP port identifier in hex.
    pub name: String,
    /// iSCSI ISID as 12 hex digits; `None` for a name-only TransportID.
    pub port: Option<String>,
}

impl TransportId {
    /// The iSCSI initiator port `name,i,0x<isid>`.
    pub fn iscsi(name: &str, isid: [u8; 6]) -> TransportId {
        let port = isid.iter().map(|b| format!("{b:02x}")).collect();
        TransportId {
            protocol: protocol::ISCSI,
            name: name.to_ascii_lowercase(),
            port: Some(port),
        }
    }

    /// The SRP initiator port with this 16-byte identifier.
    pub fn srp(id: [u8; 16]) -> TransportId {
        TransportId {
            protocol: protocol::SRP,
            name: id.iter().map(|b| format!("{b:02x}")).collect(),
            port: None,
        }
    }

    /// The NVMe host with this 128-bit Host Identifier (every controller of one host shares
    /// its registrations).
    pub fn nvme_host(hostid: [u8; 16]) -> TransportId {
        TransportId {
            protocol: protocol::NVME_HOST,
            name: hostid.iter().map(|b| format!("{b:02x}")).collect(),
            port: None,
        }
    }

    /// Whether this TransportID designates `port` (a name-only iSCSI TransportID designates
    /// every ISID of the name).
    pub fn designates(&self, port: &TransportId) -> bool {
        self.protocol == port.protocol
            && self.name.eq_ignore_ascii_case(&port.name)
            && (self.port.is_none() || self.port == port.port)
    }

    /// Encodes the TransportID (SPC-4 7.6.4; iSCSI in format 01b when it has an ISID).
    pub fn encode(&self, out: &mut Vec<u8>) {
        if self.protocol == protocol::SRP {
            out.push(protocol::SRP);
            out.extend_from_slice(&[0; 7]);
            let mut id = [0u8; 16];
            for (i, b) in id.iter_mut().enumerate() {
                *b = self
                    .name
                    .get(2 * i..2 * i + 2)
                    .and_then(|h| u8::from_str_radix(h, 16).ok())
                    .unwrap_or(0);
            }
            out.extend_from_slice(&id);
            return;
        }
        let mut text = self.name.clone();
        if let Some(isid) = &self.port {
            text.push_str(",i,0x");
            text.push_str(isid);
        }
        // NUL-terminated, padded to a multiple of 4, at least 20 bytes.
        let len = (text.len() + 1).next_multiple_of(4).max(20);
        let format = if self.port.is_some() { 0x40 } else { 0x00 };
        out.push(format | self.protocol);
        out.push(0);
        out.extend_from_slice(&(len as u16).to_be_bytes());
        out.extend_from_slice(text.as_bytes());
        out.resize(out.len() + len - text.len(), 0);
    }

    /// Parses one TransportID at the start of `b`; returns it and its length. `at` is its offset
    /// in the parameter list, for the field pointer of an error.
    pub fn parse(b: &[u8], at: usize) -> Result<(TransportId, usize), Sense> {
        let bad = |off: usize| {
            Sense::invalid_field_in_parameter_list(FieldPointer::parameter((at + off) as u16))
        };
        let first = *b.first().ok_or_else(|| bad(0))?;
        match (first >> 6, first & 0x0f) {
            (0, protocol::SRP) => {
                let id: [u8; 16] = b.get(8..24).ok_or_else(|| bad(0))?.try_into().unwrap();
                Ok((TransportId::srp(id), 24))
            }
            (format @ (0 | 1), protocol::ISCSI) => {
                let len = usize::from(u16::from_be_bytes([
                    *b.get(2).ok_or_else(|| bad(2))?,
                    *b.get(3).ok_or_else(|| bad(2))?,
                ]));
                if len < 4 || len % 4 != 0 {
                    return Err(bad(2));
                }
                let text = b.get(4..4 + len).ok_or_else(|| bad(2))?;
                let end = text.iter().position(|&c| c == 0).ok_or_else(|| bad(4))?;
                let text = std::str::from_utf8(&text[..end]).map_err(|_| bad(4))?;
                let (name, port) = if format == 1 {
                    let (name, isid) = text
                        .split_once(",i,0x")
                        .or_else(|| text.split_once(",I,0X"))
                        .ok_or_else(|| bad(4))?;
                    if isid.len() != 12 || !isid.bytes().all(|c| c.is_ascii_hexdigit()) {
                        return Err(bad(4));
                    }
                    (name, Some(isid.to_ascii_lowercase()))
                } else {
                    (text, None)
                };
                if name.is_empty() {
                    return Err(bad(4));
                }
                Ok((
                    TransportId {
                        protocol: protocol::ISCSI,
                        name: name.to_ascii_lowercase(),
                        port,
                    },
                    4 + len,
                ))
            }
            _ => Err(bad(0)),
        }
    }
}

/// An I_T nexus by name: an initiator port and the relative identifier of the target port it
/// reached. Reservations are held by these names, so they outlive a connection.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct ItNexus {
    /// The initiator port.
    pub initiator: TransportId,
    /// RELATIVE TARGET PORT IDENTIFIER.
    pub relative_port: u16,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transport_ids_round_trip_and_designate() {
        let port = TransportId::iscsi("iqn.2026-11.Example:Host", [0x80, 0, 0x12, 0x34, 0, 1]);
        let mut b = Vec::new();
        port.encode(&mut b);
        assert_eq!(b[0], 0x45);
        assert_eq!(b.len() % 4, 0);
        assert!(b.starts_with(&[0x45, 0, 0, (b.len() - 4) as u8]));
        assert_eq!(&b[4..33], b"iqn.2026-11.example:host,i,0x");
        let (parsed, len) = TransportId::parse(&b, 0).unwrap();
        assert_eq!((parsed.clone(), len), (port.clone(), b.len()));

        let name_only = TransportId {
            port: None,
            ..port.clone()
        };
        let mut n = Vec::new();
        name_only.encode(&mut n);
        assert_eq!(n[0], 0x05);
        assert_eq!(TransportId::parse(&n, 0).unwrap().0, name_only);
        assert!(name_only.designates(&port));
        assert!(!port.designates(&TransportId::iscsi("iqn.2026-11.example:host", [0; 6])));

        let srp = TransportId::srp([0xab; 16]);
        let mut s = Vec::new();
        srp.encode(&mut s);
        assert_eq!(s.len(), 24);
        assert_eq!(TransportId::parse(&s, 0).unwrap().0, srp);

        for bad in [
            &[0x45u8, 0, 0, 3][..],
            &[0x45, 0, 0, 8, b'a', b'b', 1, 2],
            &[0x09],
        ] {
            assert!(TransportId::parse(bad, 10).is_err());
        }
    }
}
