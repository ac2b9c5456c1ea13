//! NVMe over Fabrics commands (NVM Express over Fabrics 1.1): Connect, with its 1024 bytes of
//! data, and the controller properties a host reads and writes with Property Get and Set
//! (CAP, VS, CC, CSTS), with what enabling and shutting down the controller do.

use crate::sqe::Sqe;
use crate::status::Status;

/// The NQN of discovery controllers.
pub const DISCOVERY_NQN: &str = "nqn.2014-08.org.nvmexpress.discovery";

/// Why a name is not an NQN.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NqnError {
    /// Empty.
    #[error("empty")]
    Empty,
    /// Longer than 223 bytes.
    #[error("{0} bytes, more than 223")]
    TooLong(usize),
    /// Not `nqn.yyyy-mm.reverse.domain[:anything]` or the UUID form.
    #[error("not nqn.yyyy-mm.<reverse domain>[:<name>] or nqn.2014-08.org.nvmexpress:uuid:<UUID>")]
    Form,
    /// A character a name may not have (a control character or a space).
    #[error("has a space or a control character")]
    Character,
}

/// Checks `name` is an NQN: `nqn.` then a year and month, a dot, a reverse domain name, and
/// anything after a colon; at most 223 bytes of UTF-8, no spaces or control characters.
pub fn check_nqn(name: &str) -> Result<(), NqnError> {
    if name.is_empty() {
        return Err(NqnError::Empty);
    }
    if name.len() > MAX_NQN_LEN {
        return Err(NqnError::TooLong(name.len()));
    }
    if name.chars().any(|c| c.is_control() || c.is_whitespace()) {
        return Err(NqnError::Character);
    }
    let b = name.as_bytes();
    let date = b.len() > 12
        && b.starts_with(b"nqn.")
        && b[4..8].iter().all(u8::is_ascii_digit)
        && b[8] == b'-'
        && b[9..11].iter().all(u8::is_ascii_digit)
        && b[11] == b'.';
    let domain = name[12.min(name.len())..].split(':').next().unwrap_or("");
    if !date || domain.is_empty() {
        return Err(NqnError::Form);
    }
    Ok(())
}

/// The longest NQN (its field is 256 bytes, NUL terminated).
pub const MAX_NQN_LEN: usize = 223;

/// The length of Connect's data.
pub const CONNECT_DATA_LEN: usize = 1024;

/// Connect's CNTLID asking for any controller (the dynamic controller model).
pub const CNTLID_DYNAMIC: u16 = 0xffff;

/// CATTR bit 2: SQ flow control disabled (the host does not need SQHD in completions, so a
/// read may end with C2HData's SUCCESS flag and no CapsuleResp).
pub const CATTR_SQ_FLOW_CONTROL_DISABLE: u8 = 1 << 2;

/// A Connect command's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Connect {
    /// RECFMT: 0.
    pub recfmt: u16,
    /// QID: 0 for the admin queue.
    pub qid: u16,
    /// SQSIZE: the queue's size, 0's based.
    pub sqsize: u16,
    /// CATTR.
    pub cattr: u8,
    /// KATO: the keep alive timeout in milliseconds (admin queue; 0: none).
    pub kato: u32,
}

impl Connect {
    /// From the SQE of a Connect.
    pub fn from_sqe(sqe: &Sqe) -> Connect {
        let (c10, c11) = (sqe.cdw(10), sqe.cdw(11));
        Connect {
            recfmt: c10 as u16,
            qid: (c10 >> 16) as u16,
            sqsize: c11 as u16,
            cattr: (c11 >> 16) as u8,
            kato: sqe.cdw(12),
        }
    }

    /// Writes it into `sqe` (a host's Connect).
    pub fn to_sqe(&self, sqe: &mut Sqe) {
        sqe.set_cdw(10, u32::from(self.recfmt) | u32::from(self.qid) << 16);
        sqe.set_cdw(11, u32::from(self.sqsize) | u32::from(self.cattr) << 16);
        sqe.set_cdw(12, self.kato);
    }
}

/// Connect's data: who the host is and what it connects to.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConnectData {
    /// HOSTID: the host identifier.
    pub hostid: [u8; 16],
    /// CNTLID: [`CNTLID_DYNAMIC`] on the admin queue; the controller's ID on an I/O queue.
    pub cntlid: u16,
    /// SUBNQN.
    pub subnqn: String,
    /// HOSTNQN.
    pub hostnqn: String,
}

/// Why Connect's data was refused: Connect Invalid Parameters pointing at the field, in the
/// data (IATTR 1) at byte offset IPO.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct InvalidParameter {
    /// IATTR: 0 the field is in the command, 1 in its data.
    pub in_data: bool,
    /// IPO: the field's byte offset.
    pub offset: u16,
}

impl InvalidParameter {
    /// The completion's status and DW0 (IPO in bits 15:0, IATTR in bits 23:16).
    pub fn completion(&self) -> (Status, u32) {
        (
            Status::CONNECT_INVALID_PARAMETERS,
            u32::from(self.offset) | u32::from(self.in_data) << 16,
        )
    }
}

/// An NQN field: NUL terminated (or filling the field), printable ASCII, at most 223 bytes.
fn nqn(field: &[u8], offset: u16) -> Result<String, InvalidParameter> {
    let bad = InvalidParameter {
        in_data: true,
        offset,
    };
    let len = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    let text = &field[..len];
    if text.is_empty() || text.len() > MAX_NQN_LEN || !text.iter().all(|b| (0x21..0x7f).contains(b))
    {
        return Err(bad);
    }
    Ok(String::from_utf8_lossy(text).into_owned())
}

impl ConnectData {
    /// Reads Connect's data; fewer than 1024 bytes, or an NQN that is empty, too long or not
    /// printable, is an invalid parameter.
    pub fn parse(data: &[u8]) -> Result<ConnectData, InvalidParameter> {
        if data.len() < CONNECT_DATA_LEN {
            return Err(InvalidParameter {
                in_data: false,
                offset: 24,
            });
        }
        let mut hostid = [0u8; 16];
        hostid.copy_from_slice(&data[..16]);
        Ok(ConnectData {
            hostid,
            cntlid: u16::from_le_bytes([data[16], data[17]]),
            subnqn: nqn(&data[256..512], 256)?,
            hostnqn: nqn(&data[512..768], 512)?,
        })
    }

    /// Its 1024 bytes (a host's Connect).
    pub fn to_bytes(&self) -> Box<[u8; CONNECT_DATA_LEN]> {
        let mut b = Box::new([0u8; CONNECT_DATA_LEN]);
        b[..16].copy_from_slice(&self.hostid);
        b[16..18].copy_from_slice(&self.cntlid.to_le_bytes());
        let sub = self.subnqn.as_bytes();
        let host = self.hostnqn.as_bytes();
        b[256..256 + sub.len().min(255)].copy_from_slice(&sub[..sub.len().min(255)]);
        b[512..512 + host.len().min(255)].copy_from_slice(&host[..host.len().min(255)]);
        b
    }
}

/// Property offsets.
pub mod property {
    /// CAP: Controller Capabilities (8 bytes).
    pub const CAP: u32 = 0x00;
    /// VS: Version.
    pub const VS: u32 = 0x08;
    /// CC: Controller Configuration.
    pub const CC: u32 = 0x14;
    /// CSTS: Controller Status.
    pub const CSTS: u32 = 0x1c;
    /// NSSR: NVM Subsystem Reset.
    pub const NSSR: u32 = 0x20;
}

/// Property Get or Set's fields.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PropertyAccess {
    /// ATTRIB bits 2:0: 0 a 4-byte property, 1 an 8-byte one.
    pub eight_bytes: bool,
    /// OFST.
    pub offset: u32,
    /// VALUE (Property Set).
    pub value: u64,
}

impl PropertyAccess {
    /// From the SQE of a Property Get or Set.
    pub fn from_sqe(sqe: &Sqe) -> PropertyAccess {
        PropertyAccess {
            eight_bytes: sqe.cdw(10) & 7 == 1,
            offset: sqe.cdw(11),
            value: sqe.qword(12),
        }
    }

    /// Writes it into `sqe`.
    pub fn to_sqe(&self, sqe: &mut Sqe) {
        sqe.set_cdw(10, u32::from(self.eight_bytes));
        sqe.set_cdw(11, self.offset);
        sqe.set_qword(12, self.value);
    }
}

/// What a change of CC does.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CcChange {
    /// Nothing beyond the register.
    None,
    /// EN went 0 to 1 with a valid configuration: the controller is ready.
    Enabled,
    /// EN went 1 to 0: a controller reset (every command ends, I/O queues go).
    Reset,
    /// SHN asked a shutdown: it is complete (CSTS.SHST 10b).
    Shutdown,
}

/// A controller's registers as the host sees them through Property Get and Set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Properties {
    /// CAP.
    pub cap: u64,
    /// VS.
    pub vs: u32,
    /// CC.
    pub cc: u32,
    /// CSTS.
    pub csts: u32,
}

/// CC.EN.
pub const CC_EN: u32 = 1;
/// CC.SHN (bits 15:14).
pub const CC_SHN_MASK: u32 = 3 << 14;
/// CSTS.RDY.
pub const CSTS_RDY: u32 = 1;
/// CSTS.CFS: controller fatal status.
pub const CSTS_CFS: u32 = 1 << 1;
/// CSTS.SHST = 10b: shutdown processing complete.
pub const CSTS_SHST_COMPLETE: u32 = 2 << 2;

impl Properties {
    /// A controller with queues of up to `max_queue_entries` entries, version `vs`, that
    /// takes `ready_timeout_500ms` half-seconds at most to become ready: disabled.
    pub fn new(max_queue_entries: u16, vs: u32, ready_timeout_500ms: u8) -> Properties {
        // MQES (0's based), CQR (contiguous queues required: bit 16), TO (bits 31:24), CSS
        // bit 37 (the NVM command set).
        let cap = u64::from(max_queue_entries.max(2) - 1)
            | 1 << 16
            | u64::from(ready_timeout_500ms) << 24
            | 1 << 37;
        Properties {
            cap,
            vs,
            cc: 0,
            csts: 0,
        }
    }

    /// MQES + 1: the most entries a queue may have.
    pub fn max_queue_entries(&self) -> u32 {
        (self.cap & 0xffff) as u32 + 1
    }

    /// Whether CC.EN and CSTS.RDY are set: the controller takes I/O commands.
    pub fn is_ready(&self) -> bool {
        self.cc & CC_EN != 0 && self.csts & CSTS_RDY != 0
    }

    /// Property Get: the value, or Invalid Field for an offset or size that is not a
    /// property.
    pub fn get(&self, access: &PropertyAccess) -> Result<u64, Status> {
        match (access.offset, access.eight_bytes) {
            (property::CAP, true) => Ok(self.cap),
            (property::VS, false) => Ok(u64::from(self.vs)),
            (property::CC, false) => Ok(u64::from(self.cc)),
            (property::CSTS, false) => Ok(u64::from(self.csts)),
            (property::NSSR, false) => Ok(0),
            _ => Err(Status::INVALID_FIELD),
        }
    }

    /// Property Set: CC is the one property a host writes. Enabling checks the queue entry
    /// sizes (64-byte SQEs, 16-byte CQEs), the page size (4 KiB) and the command set (NVM);
    /// a configuration the controller cannot take sets CSTS.CFS, as a drive would.
    pub fn set(&mut self, access: &PropertyAccess) -> Result<CcChange, Status> {
        if access.offset != property::CC || access.eight_bytes {
            return Err(Status::INVALID_FIELD);
        }
        let new = access.value as u32;
        let old = self.cc;
        self.cc = new;
        let enable = new & CC_EN != 0;
        if old & CC_EN == 0 && enable {
            let iosqes = (new >> 16) & 0xf;
            let iocqes = (new >> 20) & 0xf;
            let mps = (new >> 7) & 0xf;
            let css = (new >> 4) & 7;
            if iosqes != 6 || iocqes != 4 || mps != 0 || css != 0 {
                self.csts |= CSTS_CFS;
                return Ok(CcChange::None);
            }
            self.csts = CSTS_RDY;
            return Ok(CcChange::Enabled);
        }
        if old & CC_EN != 0 && !enable {
            self.csts = 0;
            return Ok(CcChange::Reset);
        }
        if new & CC_SHN_MASK != 0 && old & CC_SHN_MASK == 0 {
            self.csts = self.csts & !(3 << 2) | CSTS_SHST_COMPLETE;
            return Ok(CcChange::Shutdown);
        }
        Ok(CcChange::None)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::opcode::FabricsType;

    #[test]
    fn nqns_are_checked() {
        for good in [
            "nqn.2014-08.org.nvmexpress.discovery",
            "nqn.2026-11.io.example:disk1",
            "nqn.2014-08.org.nvmexpress:uuid:8e7f0c4a-3b1e-4d2a-9c5f-1a2b3c4d5e6f",
        ] {
            assert_eq!(check_nqn(good), Ok(()), "{good}");
        }
        assert_eq!(check_nqn(""), Err(NqnError::Empty));
        assert_eq!(check_nqn("iqn.2026-11.io.example:x"), Err(NqnError::Form));
        assert_eq!(check_nqn("nqn.26-11.io.example"), Err(NqnError::Form));
        assert_eq!(check_nqn("nqn.2026-11.:x"), Err(NqnError::Form));
        assert_eq!(check_nqn("nqn.2026-11.io.x:a b"), Err(NqnError::Character));
        let long = format!("nqn.2026-11.io.example:{}", "x".repeat(201));
        assert_eq!(check_nqn(&long), Err(NqnError::TooLong(long.len())));
    }

    #[test]
    fn connect_reads_back() {
        let c = Connect {
            recfmt: 0,
            qid: 3,
            sqsize: 127,
            cattr: CATTR_SQ_FLOW_CONTROL_DISABLE,
            kato: 15000,
        };
        let mut sqe = Sqe::new(0x7f, 1);
        sqe.set_fctype(FabricsType::Connect.code());
        c.to_sqe(&mut sqe);
        assert_eq!(
            &sqe.as_bytes()[40..52],
            &[0, 0, 3, 0, 127, 0, 4, 0, 0x98, 0x3a, 0, 0]
        );
        assert_eq!(Connect::from_sqe(&sqe), c);
        let d = ConnectData {
            hostid: [9; 16],
            cntlid: CNTLID_DYNAMIC,
            subnqn: "nqn.2026-11.io.example:sub".into(),
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:1b4e28ba".into(),
        };
        assert_eq!(ConnectData::parse(&d.to_bytes()[..]), Ok(d.clone()));
        // An empty host NQN, a non-printable one, short data.
        let mut b = d.to_bytes();
        b[512] = 0;
        assert_eq!(
            ConnectData::parse(&b[..]),
            Err(InvalidParameter {
                in_data: true,
                offset: 512
            })
        );
        let mut b = d.to_bytes();
        b[260] = 0x07;
        assert_eq!(ConnectData::parse(&b[..]).unwrap_err().offset, 256);
        assert!(ConnectData::parse(&b[..1000]).is_err());
        let (status, dw0) = InvalidParameter {
            in_data: true,
            offset: 512,
        }
        .completion();
        assert_eq!(
            (status, dw0),
            (Status::CONNECT_INVALID_PARAMETERS, 0x1_0200)
        );
    }

    /// Linux's host: read CAP, write CC with EN and the entry sizes, wait for CSTS.RDY; at
    /// the end, CC.SHN and CSTS.SHST.
    #[test]
    fn enable_reset_and_shutdown() {
        let mut p = Properties::new(128, 0x0001_0400, 30);
        let get = |p: &Properties, offset, eight_bytes| {
            p.get(&PropertyAccess {
                eight_bytes,
                offset,
                value: 0,
            })
        };
        assert_eq!(get(&p, property::CAP, true).unwrap() & 0xffff, 127);
        assert_eq!(get(&p, property::VS, false), Ok(0x0001_0400));
        assert_eq!(get(&p, property::CAP, false), Err(Status::INVALID_FIELD));
        let set = |p: &mut Properties, cc: u32| {
            p.set(&PropertyAccess {
                eight_bytes: false,
                offset: property::CC,
                value: u64::from(cc),
            })
        };
        let cc = CC_EN | 6 << 16 | 4 << 20;
        assert_eq!(set(&mut p, cc), Ok(CcChange::Enabled));
        assert!(p.is_ready());
        assert_eq!(set(&mut p, cc | 1 << 14), Ok(CcChange::Shutdown));
        assert_eq!(get(&p, property::CSTS, false).unwrap() & 0xc, 0x8);
        assert_eq!(set(&mut p, 0), Ok(CcChange::Reset));
        assert!(!p.is_ready());
        // 128-byte SQEs: the controller cannot; CSTS.CFS.
        assert_eq!(set(&mut p, CC_EN | 7 << 16 | 4 << 20), Ok(CcChange::None));
        assert_eq!(p.csts & CSTS_CFS, CSTS_CFS);
        assert_eq!(
            p.set(&PropertyAccess {
                eight_bytes: false,
                offset: property::CSTS,
                value: 1
            }),
            Err(Status::INVALID_FIELD)
        );
    }
}
