//! Sense data (SPC-4 section 4.5): what a target says when a command ends in CHECK CONDITION,
//! in fixed (0x70) or descriptor (0x72) format, with the sense-key-specific field pointer that
//! tells an initiator which byte and bit of the CDB or parameter list was wrong.

use core::fmt;

/// SENSE KEY (SPC-4 table 48).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum SenseKey {
    /// 0h: no specific sense key information.
    NoSense = 0x0,
    /// 1h: the command completed with recovery action.
    RecoveredError = 0x1,
    /// 2h: the logical unit is not accessible.
    NotReady = 0x2,
    /// 3h: a flaw in the medium or the recorded data.
    MediumError = 0x3,
    /// 4h: a non-recoverable hardware failure.
    HardwareError = 0x4,
    /// 5h: an illegal value in the CDB or parameter data, or an unsupported command.
    IllegalRequest = 0x5,
    /// 6h: a unit attention condition.
    UnitAttention = 0x6,
    /// 7h: the medium is write protected (or the command conflicts with protection).
    DataProtect = 0x7,
    /// 8h: a write-once device met blank or non-blank medium.
    BlankCheck = 0x8,
    /// 9h: vendor specific.
    VendorSpecific = 0x9,
    /// Ah: EXTENDED COPY aborted.
    CopyAborted = 0xa,
    /// Bh: the device server aborted the command.
    AbortedCommand = 0xb,
    /// Dh: a buffered device reached the end of its partition.
    VolumeOverflow = 0xd,
    /// Eh: source data did not match the medium (VERIFY, COMPARE AND WRITE).
    Miscompare = 0xe,
}

/// ADDITIONAL SENSE CODE and QUALIFIER.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct Asc(pub u8, pub u8);

impl Asc {
    /// 00/00 NO ADDITIONAL SENSE INFORMATION.
    pub const NO_ADDITIONAL_SENSE: Asc = Asc(0x00, 0x00);
    /// 04/02 LOGICAL UNIT NOT READY, INITIALIZING COMMAND REQUIRED.
    pub const NOT_READY_INITIALIZING_COMMAND_REQUIRED: Asc = Asc(0x04, 0x02);
    /// 04/01 LOGICAL UNIT IS IN PROCESS OF BECOMING READY: initiators retry the command.
    pub const BECOMING_READY: Asc = Asc(0x04, 0x01);
    /// 04/0A LOGICAL UNIT NOT ACCESSIBLE, ASYMMETRIC ACCESS STATE TRANSITION.
    pub const ASYMMETRIC_ACCESS_STATE_TRANSITION: Asc = Asc(0x04, 0x0a);
    /// 04/0B LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN STANDBY STATE.
    pub const TARGET_PORT_IN_STANDBY_STATE: Asc = Asc(0x04, 0x0b);
    /// 04/0C LOGICAL UNIT NOT ACCESSIBLE, TARGET PORT IN UNAVAILABLE STATE.
    pub const TARGET_PORT_IN_UNAVAILABLE_STATE: Asc = Asc(0x04, 0x0c);
    /// 2A/06 ASYMMETRIC ACCESS STATE CHANGED.
    pub const ASYMMETRIC_ACCESS_STATE_CHANGED: Asc = Asc(0x2a, 0x06);
    /// 0E/03 INVALID FIELD IN COMMAND INFORMATION UNIT.
    pub const INVALID_FIELD_IN_COMMAND_INFORMATION_UNIT: Asc = Asc(0x0e, 0x03);
    /// 0C/00 WRITE ERROR.
    pub const WRITE_ERROR: Asc = Asc(0x0c, 0x00);
    /// 11/00 UNRECOVERED READ ERROR.
    pub const UNRECOVERED_READ_ERROR: Asc = Asc(0x11, 0x00);
    /// 1A/00 PARAMETER LIST LENGTH ERROR.
    pub const PARAMETER_LIST_LENGTH_ERROR: Asc = Asc(0x1a, 0x00);
    /// 1D/00 MISCOMPARE DURING VERIFY OPERATION.
    pub const MISCOMPARE_DURING_VERIFY: Asc = Asc(0x1d, 0x00);
    /// 20/00 INVALID COMMAND OPERATION CODE.
    pub const INVALID_COMMAND_OPERATION_CODE: Asc = Asc(0x20, 0x00);
    /// 21/00 LOGICAL BLOCK ADDRESS OUT OF RANGE.
    pub const LBA_OUT_OF_RANGE: Asc = Asc(0x21, 0x00);
    /// 24/00 INVALID FIELD IN CDB.
    pub const INVALID_FIELD_IN_CDB: Asc = Asc(0x24, 0x00);
    /// 25/00 LOGICAL UNIT NOT SUPPORTED.
    pub const LOGICAL_UNIT_NOT_SUPPORTED: Asc = Asc(0x25, 0x00);
    /// 26/00 INVALID FIELD IN PARAMETER LIST.
    pub const INVALID_FIELD_IN_PARAMETER_LIST: Asc = Asc(0x26, 0x00);
    /// 26/04 INVALID RELEASE OF PERSISTENT RESERVATION.
    pub const INVALID_RELEASE_OF_PERSISTENT_RESERVATION: Asc = Asc(0x26, 0x04);
    /// 27/00 WRITE PROTECTED.
    pub const WRITE_PROTECTED: Asc = Asc(0x27, 0x00);
    /// 27/07 SPACE ALLOCATION FAILED WRITE PROTECT.
    pub const SPACE_ALLOCATION_FAILED_WRITE_PROTECT: Asc = Asc(0x27, 0x07);
    /// 29/00 POWER ON, RESET, OR BUS DEVICE RESET OCCURRED.
    pub const POWER_ON_RESET: Asc = Asc(0x29, 0x00);
    /// 29/03 BUS DEVICE RESET FUNCTION OCCURRED (after a LOGICAL UNIT RESET).
    pub const BUS_DEVICE_RESET_OCCURRED: Asc = Asc(0x29, 0x03);
    /// 29/07 I_T NEXUS LOSS OCCURRED.
    pub const I_T_NEXUS_LOSS: Asc = Asc(0x29, 0x07);
    /// 2A/01 MODE PARAMETERS CHANGED.
    pub const MODE_PARAMETERS_CHANGED: Asc = Asc(0x2a, 0x01);
    /// 2A/03 RESERVATIONS PREEMPTED.
    pub const RESERVATIONS_PREEMPTED: Asc = Asc(0x2a, 0x03);
    /// 2A/04 RESERVATIONS RELEASED.
    pub const RESERVATIONS_RELEASED: Asc = Asc(0x2a, 0x04);
    /// 2A/05 REGISTRATIONS PREEMPTED.
    pub const REGISTRATIONS_PREEMPTED: Asc = Asc(0x2a, 0x05);
    /// 2A/09 CAPACITY DATA HAS CHANGED.
    pub const CAPACITY_DATA_HAS_CHANGED: Asc = Asc(0x2a, 0x09);
    /// 2C/00 COMMAND SEQUENCE ERROR.
    pub const COMMAND_SEQUENCE_ERROR: Asc = Asc(0x2c, 0x00);
    /// 2F/00 COMMANDS CLEARED BY ANOTHER INITIATOR.
    pub const COMMANDS_CLEARED_BY_ANOTHER_INITIATOR: Asc = Asc(0x2f, 0x00);
    /// 39/00 SAVING PARAMETERS NOT SUPPORTED.
    pub const SAVING_PARAMETERS_NOT_SUPPORTED: Asc = Asc(0x39, 0x00);
    /// 3A/00 MEDIUM NOT PRESENT.
    pub const MEDIUM_NOT_PRESENT: Asc = Asc(0x3a, 0x00);
    /// 3F/0E REPORTED LUNS DATA HAS CHANGED.
    pub const REPORTED_LUNS_DATA_HAS_CHANGED: Asc = Asc(0x3f, 0x0e);
    /// 49/00 INVALID MESSAGE ERROR (an ACA task without an ACA condition).
    pub const INVALID_MESSAGE_ERROR: Asc = Asc(0x49, 0x00);
    /// 44/00 INTERNAL TARGET FAILURE.
    pub const INTERNAL_TARGET_FAILURE: Asc = Asc(0x44, 0x00);
    /// 53/02 MEDIUM REMOVAL PREVENTED.
    pub const MEDIUM_REMOVAL_PREVENTED: Asc = Asc(0x53, 0x02);
    /// 55/03 INSUFFICIENT RESOURCES (a transport can never have the buffer a command needs).
    pub const INSUFFICIENT_RESOURCES: Asc = Asc(0x55, 0x03);
    /// 55/04 INSUFFICIENT REGISTRATION RESOURCES.
    pub const INSUFFICIENT_REGISTRATION_RESOURCES: Asc = Asc(0x55, 0x04);
    /// 4B/00 DATA PHASE ERROR (a transport could not move a command's data).
    pub const DATA_PHASE_ERROR: Asc = Asc(0x4b, 0x00);
    /// 4E/00 OVERLAPPED COMMANDS ATTEMPTED (a tag already in use on the nexus).
    pub const OVERLAPPED_COMMANDS_ATTEMPTED: Asc = Asc(0x4e, 0x00);
}

impl fmt::Debug for Asc {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:02X}/{:02X}", self.0, self.1)
    }
}

/// Which data a field pointer points into.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FieldIn {
    /// The CDB (C/D = 1).
    Cdb,
    /// The parameter list sent with the command (C/D = 0).
    ParameterList,
}

/// The sense-key-specific field pointer of ILLEGAL REQUEST (SPC-4 section 4.5.2.4.2): the byte,
/// and optionally the bit, where the offending field starts (its most significant bit).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FieldPointer {
    /// CDB or parameter list.
    pub within: FieldIn,
    /// Byte offset of the field.
    pub byte: u16,
    /// Bit within that byte (0..=7), when the field is narrower than a byte.
    pub bit: Option<u8>,
}

impl FieldPointer {
    /// A field starting at `byte` of the CDB.
    pub fn cdb(byte: u16) -> Self {
        FieldPointer {
            within: FieldIn::Cdb,
            byte,
            bit: None,
        }
    }

    /// A bit field at `byte`, `bit` of the CDB.
    pub fn cdb_bit(byte: u16, bit: u8) -> Self {
        FieldPointer {
            within: FieldIn::Cdb,
            byte,
            bit: Some(bit & 7),
        }
    }

    /// A field starting at `byte` of the parameter list.
    pub fn parameter(byte: u16) -> Self {
        FieldPointer {
            within: FieldIn::ParameterList,
            byte,
            bit: None,
        }
    }

    /// A bit field at `byte`, `bit` of the parameter list.
    pub fn parameter_bit(byte: u16, bit: u8) -> Self {
        FieldPointer {
            within: FieldIn::ParameterList,
            byte,
            bit: Some(bit & 7),
        }
    }

    /// The three sense-key-specific bytes, SKSV set.
    fn bytes(self) -> [u8; 3] {
        let mut b0 = 0x80;
        if self.within == FieldIn::Cdb {
            b0 |= 0x40;
        }
        if let Some(bit) = self.bit {
            b0 |= 0x08 | bit;
        }
        let [hi, lo] = self.byte.to_be_bytes();
        [b0, hi, lo]
    }
}

/// Sense data, independent of its encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Sense {
    /// SENSE KEY.
    pub key: SenseKey,
    /// ADDITIONAL SENSE CODE and QUALIFIER.
    pub asc: Asc,
    /// INFORMATION: the LBA of a medium error or the offset of a miscompare.
    pub information: Option<u64>,
    /// Sense-key-specific field pointer (ILLEGAL REQUEST).
    pub field: Option<FieldPointer>,
    /// Deferred error (response code 0x71/0x73) rather than current.
    pub deferred: bool,
}

/// The longest sense data this crate produces (descriptor format with an information and a
/// sense-key-specific descriptor).
pub const MAX_SENSE_LEN: usize = 8 + 12 + 8;

/// Encoded sense data, inline (no allocation on the error path of a command).
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct SenseBytes {
    buf: [u8; MAX_SENSE_LEN],
    len: u8,
}

impl SenseBytes {
    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        &self.buf[..usize::from(self.len)]
    }
}

impl fmt::Debug for SenseBytes {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "SenseBytes({:02x?})", self.as_slice())
    }
}

impl Sense {
    /// Sense with a key and code only.
    pub fn new(key: SenseKey, asc: Asc) -> Sense {
        Sense {
            key,
            asc,
            information: None,
            field: None,
            deferred: false,
        }
    }

    /// ILLEGAL REQUEST / INVALID FIELD IN CDB, pointing at the field.
    pub fn invalid_field_in_cdb(field: FieldPointer) -> Sense {
        Sense {
            field: Some(field),
            ..Sense::new(SenseKey::IllegalRequest, Asc::INVALID_FIELD_IN_CDB)
        }
    }

    /// ILLEGAL REQUEST / INVALID FIELD IN PARAMETER LIST, pointing at the field.
    pub fn invalid_field_in_parameter_list(field: FieldPointer) -> Sense {
        Sense {
            field: Some(field),
            ..Sense::new(
                SenseKey::IllegalRequest,
                Asc::INVALID_FIELD_IN_PARAMETER_LIST,
            )
        }
    }

    /// ILLEGAL REQUEST / PARAMETER LIST LENGTH ERROR: a parameter list shorter or longer than
    /// its contents say.
    pub fn parameter_list_length_error() -> Sense {
        Sense::new(SenseKey::IllegalRequest, Asc::PARAMETER_LIST_LENGTH_ERROR)
    }

    /// ILLEGAL REQUEST / INVALID COMMAND OPERATION CODE, pointing at byte 0 (and, for service
    /// actions, at the service action field).
    pub fn invalid_opcode() -> Sense {
        Sense {
            field: Some(FieldPointer::cdb(0)),
            ..Sense::new(
                SenseKey::IllegalRequest,
                Asc::INVALID_COMMAND_OPERATION_CODE,
            )
        }
    }

    /// ILLEGAL REQUEST / LOGICAL BLOCK ADDRESS OUT OF RANGE.
    pub fn lba_out_of_range() -> Sense {
        Sense::new(SenseKey::IllegalRequest, Asc::LBA_OUT_OF_RANGE)
    }

    /// MISCOMPARE / MISCOMPARE DURING VERIFY OPERATION, with the offset of the first differing
    /// byte in INFORMATION.
    pub fn miscompare(offset: u64) -> Sense {
        Sense {
            information: Some(offset),
            ..Sense::new(SenseKey::Miscompare, Asc::MISCOMPARE_DURING_VERIFY)
        }
    }

    /// UNIT ATTENTION with the given code.
    pub fn unit_attention(asc: Asc) -> Sense {
        Sense::new(SenseKey::UnitAttention, asc)
    }

    /// Encodes in fixed format (response code 0x70/0x71), 18 bytes. INFORMATION beyond 32 bits
    /// does not fit: VALID is then cleared, as SPC-4 requires.
    pub fn fixed(&self) -> SenseBytes {
        let mut b = [0u8; MAX_SENSE_LEN];
        b[0] = if self.deferred { 0x71 } else { 0x70 };
        if let Some(info) = self.information.and_then(|i| u32::try_from(i).ok()) {
            b[0] |= 0x80;
            b[3..7].copy_from_slice(&info.to_be_bytes());
        }
        b[2] = self.key as u8;
        b[7] = 10;
        b[12] = self.asc.0;
        b[13] = self.asc.1;
        if let Some(f) = self.field {
            b[15..18].copy_from_slice(&f.bytes());
        }
        SenseBytes { buf: b, len: 18 }
    }

    /// Encodes in descriptor format (response code 0x72/0x73), with an information descriptor
    /// and a sense-key-specific descriptor when they apply.
    pub fn descriptor(&self) -> SenseBytes {
        let mut b = [0u8; MAX_SENSE_LEN];
        b[0] = if self.deferred { 0x73 } else { 0x72 };
        b[1] = self.key as u8;
        b[2] = self.asc.0;
        b[3] = self.asc.1;
        let mut at = 8;
        if let Some(info) = self.information {
            b[at] = 0x00; // Information descriptor.
            b[at + 1] = 0x0a;
            b[at + 2] = 0x80; // VALID.
            b[at + 4..at + 12].copy_from_slice(&info.to_be_bytes());
            at += 12;
        }
        if let Some(f) = self.field {
            b[at] = 0x02; // Sense key specific descriptor.
            b[at + 1] = 0x06;
            b[at + 4..at + 7].copy_from_slice(&f.bytes());
            at += 8;
        }
        b[7] = (at - 8) as u8;
        SenseBytes {
            buf: b,
            len: at as u8,
        }
    }

    /// Encodes in the format the logical unit's D_SENSE bit (control mode page) selects.
    pub fn encode(&self, descriptor_format: bool) -> SenseBytes {
        if descriptor_format {
            self.descriptor()
        } else {
            self.fixed()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fixed_format_with_field_pointer() {
        let s = Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 3));
        let b = s.fixed();
        assert_eq!(
            b.as_slice(),
            &[0x70, 0, 0x05, 0, 0, 0, 0, 10, 0, 0, 0, 0, 0x24, 0x00, 0, 0xcb, 0x00, 0x01]
        );
        let s = Sense::invalid_field_in_parameter_list(FieldPointer::parameter(300));
        assert_eq!(&s.fixed().as_slice()[15..], &[0x80, 0x01, 0x2c]);
    }

    #[test]
    fn information_and_its_valid_bit() {
        let s = Sense::miscompare(0x1234);
        let b = s.fixed();
        assert_eq!(b.as_slice()[0], 0xf0);
        assert_eq!(&b.as_slice()[3..7], &[0, 0, 0x12, 0x34]);
        assert_eq!(b.as_slice()[2], 0x0e);
        // Beyond 32 bits the fixed format cannot say it: VALID clear.
        let big = Sense {
            information: Some(1 << 40),
            ..s
        };
        assert_eq!(big.fixed().as_slice()[0], 0x70);
        // The descriptor format can.
        let d = big.descriptor();
        assert_eq!(&d.as_slice()[..4], &[0x72, 0x0e, 0x1d, 0x00]);
        assert_eq!(d.as_slice()[7], 12);
        assert_eq!(&d.as_slice()[8..12], &[0x00, 0x0a, 0x80, 0x00]);
        assert_eq!(&d.as_slice()[12..20], &(1u64 << 40).to_be_bytes());
    }

    #[test]
    fn descriptor_format_with_field_pointer_and_deferred() {
        let s = Sense {
            deferred: true,
            ..Sense::invalid_opcode()
        };
        let d = s.descriptor();
        assert_eq!(
            d.as_slice(),
            &[0x73, 0x05, 0x20, 0x00, 0, 0, 0, 8, 0x02, 0x06, 0, 0, 0xc0, 0, 0, 0]
        );
        let plain = Sense::unit_attention(Asc::POWER_ON_RESET).descriptor();
        assert_eq!(plain.as_slice(), &[0x72, 0x06, 0x29, 0x00, 0, 0, 0, 0]);
        assert_eq!(
            Sense::unit_attention(Asc::POWER_ON_RESET)
                .encode(false)
                .as_slice()
                .len(),
            18
        );
    }
}
