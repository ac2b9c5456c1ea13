//! Field types shared by several PDUs: LUNs, ISIDs, task attributes, SCSI status, login stages.

use core::fmt;

/// The reserved tag value `0xffffffff` (an unsolicited NOP-In's ITT, "no TTT", and so on).
pub const RESERVED_TAG: u32 = 0xffff_ffff;

/// An 8-byte SAM logical unit number as it travels in the BHS (bytes 8..16).
///
/// The raw form is kept so any addressing method round-trips; [`Lun::from_index`] and
/// [`Lun::index`] cover the single-level peripheral and flat-space methods that targets use.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Lun(pub [u8; 8]);

impl Lun {
    /// LUN 0 in peripheral addressing (all zero bytes).
    pub const ZERO: Lun = Lun([0; 8]);

    /// The single-level LUN for `index`: peripheral device addressing below 256, flat space
    /// addressing up to 16383, as SAM-5 and most initiators expect.
    pub fn from_index(index: u16) -> Lun {
        let mut b = [0u8; 8];
        if index < 256 {
            b[1] = index as u8;
        } else {
            let i = index.min(0x3fff);
            b[0] = 0x40 | (i >> 8) as u8;
            b[1] = i as u8;
        }
        Lun(b)
    }

    /// The index of a single-level LUN in peripheral or flat space addressing; `None` for
    /// hierarchical or other addressing methods.
    pub fn index(&self) -> Option<u16> {
        let b = &self.0;
        if b[2..].iter().any(|&x| x != 0) {
            return None;
        }
        match b[0] >> 6 {
            0b00 if b[0] == 0 => Some(u16::from(b[1])),
            0b01 => Some((u16::from(b[0] & 0x3f) << 8) | u16::from(b[1])),
            _ => None,
        }
    }

    /// The LUN as a big-endian integer (the form REPORT LUNS lists).
    pub fn as_u64(&self) -> u64 {
        u64::from_be_bytes(self.0)
    }
}

impl From<u64> for Lun {
    fn from(v: u64) -> Self {
        Lun(v.to_be_bytes())
    }
}

impl fmt::Debug for Lun {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.index() {
            Some(i) => write!(f, "Lun({i})"),
            None => write!(f, "Lun({:#018x})", self.as_u64()),
        }
    }
}

/// The 6-byte initiator session identifier of a Login PDU (RFC 7143 section 11.12.5): together
/// with the initiator name it names the initiator port of an I_T nexus.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Isid(pub [u8; 6]);

impl Isid {
    /// The 2-bit type field T (OUI-format, IANA enterprise number, random, reserved).
    pub fn kind(&self) -> u8 {
        self.0[0] >> 6
    }
}

impl fmt::Debug for Isid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Isid(")?;
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        write!(f, ")")
    }
}

impl fmt::Display for Isid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for b in self.0 {
            write!(f, "{b:02x}")?;
        }
        Ok(())
    }
}

/// SAM task attribute carried in the ATTR field of a SCSI Command (RFC 7143 section 11.3.1.1).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TaskAttribute {
    /// 0: untagged (treated as SIMPLE by SAM-5 targets).
    Untagged,
    /// 1: SIMPLE.
    #[default]
    Simple,
    /// 2: ORDERED.
    Ordered,
    /// 3: HEAD OF QUEUE.
    HeadOfQueue,
    /// 4: ACA.
    Aca,
    /// 5..=7: reserved; kept so the SCSI layer can answer it with INVALID FIELD.
    Reserved(u8),
}

impl TaskAttribute {
    /// From the 3-bit field.
    pub fn from_bits(v: u8) -> Self {
        match v & 7 {
            0 => TaskAttribute::Untagged,
            1 => TaskAttribute::Simple,
            2 => TaskAttribute::Ordered,
            3 => TaskAttribute::HeadOfQueue,
            4 => TaskAttribute::Aca,
            r => TaskAttribute::Reserved(r),
        }
    }

    /// The 3-bit field.
    pub fn bits(self) -> u8 {
        match self {
            TaskAttribute::Untagged => 0,
            TaskAttribute::Simple => 1,
            TaskAttribute::Ordered => 2,
            TaskAttribute::HeadOfQueue => 3,
            TaskAttribute::Aca => 4,
            TaskAttribute::Reserved(r) => r & 7,
        }
    }
}

/// SCSI status byte (SAM-5 section 5.3). Any value is carried; the constants name the defined ones.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct ScsiStatus(pub u8);

impl ScsiStatus {
    /// GOOD.
    pub const GOOD: ScsiStatus = ScsiStatus(0x00);
    /// CHECK CONDITION: sense data follows.
    pub const CHECK_CONDITION: ScsiStatus = ScsiStatus(0x02);
    /// CONDITION MET.
    pub const CONDITION_MET: ScsiStatus = ScsiStatus(0x04);
    /// BUSY.
    pub const BUSY: ScsiStatus = ScsiStatus(0x08);
    /// RESERVATION CONFLICT.
    pub const RESERVATION_CONFLICT: ScsiStatus = ScsiStatus(0x18);
    /// TASK SET FULL.
    pub const TASK_SET_FULL: ScsiStatus = ScsiStatus(0x28);
    /// ACA ACTIVE.
    pub const ACA_ACTIVE: ScsiStatus = ScsiStatus(0x30);
    /// TASK ABORTED.
    pub const TASK_ABORTED: ScsiStatus = ScsiStatus(0x40);

    fn name(self) -> Option<&'static str> {
        Some(match self {
            ScsiStatus::GOOD => "GOOD",
            ScsiStatus::CHECK_CONDITION => "CHECK CONDITION",
            ScsiStatus::CONDITION_MET => "CONDITION MET",
            ScsiStatus::BUSY => "BUSY",
            ScsiStatus::RESERVATION_CONFLICT => "RESERVATION CONFLICT",
            ScsiStatus::TASK_SET_FULL => "TASK SET FULL",
            ScsiStatus::ACA_ACTIVE => "ACA ACTIVE",
            ScsiStatus::TASK_ABORTED => "TASK ABORTED",
            _ => return None,
        })
    }
}

impl fmt::Debug for ScsiStatus {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.name() {
            Some(n) => f.write_str(n),
            None => write!(f, "ScsiStatus({:#04x})", self.0),
        }
    }
}

/// Login stage (CSG/NSG, RFC 7143 section 11.12.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Stage {
    /// 0: SecurityNegotiation.
    SecurityNegotiation,
    /// 1: LoginOperationalNegotiation.
    LoginOperationalNegotiation,
    /// 2: reserved; a login state machine refuses it.
    Reserved,
    /// 3: FullFeaturePhase.
    FullFeaturePhase,
}

impl Stage {
    /// From the 2-bit field.
    pub fn from_bits(v: u8) -> Stage {
        match v & 3 {
            0 => Stage::SecurityNegotiation,
            1 => Stage::LoginOperationalNegotiation,
            2 => Stage::Reserved,
            _ => Stage::FullFeaturePhase,
        }
    }

    /// The 2-bit field.
    pub fn bits(self) -> u8 {
        match self {
            Stage::SecurityNegotiation => 0,
            Stage::LoginOperationalNegotiation => 1,
            Stage::Reserved => 2,
            Stage::FullFeaturePhase => 3,
        }
    }
}

/// Residual information of a SCSI Response or a final Data-In (the O/U flags and Residual Count).
/// Both flags set at once is a protocol error and does not decode.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum Residual {
    /// Neither flag: the transfer length matched the expected length.
    #[default]
    None,
    /// U: the command transferred fewer bytes than expected; the count is the shortfall.
    Underflow(u32),
    /// O: the command wanted more bytes than expected; the count is the excess.
    Overflow(u32),
}

impl Residual {
    /// The Residual Count field value.
    pub fn count(self) -> u32 {
        match self {
            Residual::None => 0,
            Residual::Underflow(n) | Residual::Overflow(n) => n,
        }
    }
}
