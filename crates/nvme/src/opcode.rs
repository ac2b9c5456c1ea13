//! Opcodes of the admin, fabrics and NVM command sets, and the fabrics command types.

macro_rules! opcodes {
    ($(#[$doc:meta])* $name:ident { $($(#[$vdoc:meta])* $variant:ident = $code:literal, $text:literal;)* }) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        pub enum $name {
            $($(#[$vdoc])* $variant,)*
        }

        impl $name {
            /// Every one this crate names.
            pub const ALL: &'static [$name] = &[$($name::$variant,)*];

            /// Its code.
            pub fn code(self) -> u8 {
                match self {
                    $($name::$variant => $code,)*
                }
            }

            /// The one with `code`, if named here.
            pub fn from_code(code: u8) -> Option<$name> {
                match code {
                    $($code => Some($name::$variant),)*
                    _ => None,
                }
            }

            /// Its name as the specification writes it.
            pub fn name(self) -> &'static str {
                match self {
                    $($name::$variant => $text,)*
                }
            }
        }
    };
}

opcodes! {
    /// Admin command set opcodes (the admin queue).
    AdminOpcode {
        /// Delete I/O Submission Queue.
        DeleteIoSq = 0x00, "Delete I/O Submission Queue";
        /// Create I/O Submission Queue.
        CreateIoSq = 0x01, "Create I/O Submission Queue";
        /// Get Log Page.
        GetLogPage = 0x02, "Get Log Page";
        /// Delete I/O Completion Queue.
        DeleteIoCq = 0x04, "Delete I/O Completion Queue";
        /// Create I/O Completion Queue.
        CreateIoCq = 0x05, "Create I/O Completion Queue";
        /// Identify.
        Identify = 0x06, "Identify";
        /// Abort.
        Abort = 0x08, "Abort";
        /// Set Features.
        SetFeatures = 0x09, "Set Features";
        /// Get Features.
        GetFeatures = 0x0a, "Get Features";
        /// Asynchronous Event Request.
        AsyncEventRequest = 0x0c, "Asynchronous Event Request";
        /// Namespace Management.
        NamespaceManagement = 0x0d, "Namespace Management";
        /// Firmware Commit.
        FirmwareCommit = 0x10, "Firmware Commit";
        /// Firmware Image Download.
        FirmwareDownload = 0x11, "Firmware Image Download";
        /// Device Self-test.
        DeviceSelfTest = 0x14, "Device Self-test";
        /// Namespace Attachment.
        NamespaceAttachment = 0x15, "Namespace Attachment";
        /// Keep Alive.
        KeepAlive = 0x18, "Keep Alive";
        /// Directive Send.
        DirectiveSend = 0x19, "Directive Send";
        /// Directive Receive.
        DirectiveReceive = 0x1a, "Directive Receive";
        /// Doorbell Buffer Config.
        DoorbellBufferConfig = 0x7c, "Doorbell Buffer Config";
        /// A fabrics command: its type is in byte 4 ([`FabricsType`]).
        Fabrics = 0x7f, "Fabrics Command";
        /// Format NVM.
        FormatNvm = 0x80, "Format NVM";
        /// Security Send.
        SecuritySend = 0x81, "Security Send";
        /// Security Receive.
        SecurityReceive = 0x82, "Security Receive";
        /// Sanitize.
        Sanitize = 0x84, "Sanitize";
        /// Get LBA Status.
        GetLbaStatus = 0x86, "Get LBA Status";
    }
}

opcodes! {
    /// NVM command set opcodes (the I/O queues).
    NvmOpcode {
        /// Flush.
        Flush = 0x00, "Flush";
        /// Write.
        Write = 0x01, "Write";
        /// Read.
        Read = 0x02, "Read";
        /// Write Uncorrectable.
        WriteUncorrectable = 0x04, "Write Uncorrectable";
        /// Compare.
        Compare = 0x05, "Compare";
        /// Write Zeroes.
        WriteZeroes = 0x08, "Write Zeroes";
        /// Dataset Management.
        DatasetManagement = 0x09, "Dataset Management";
        /// Verify.
        Verify = 0x0c, "Verify";
        /// Reservation Register.
        ReservationRegister = 0x0d, "Reservation Register";
        /// Reservation Report.
        ReservationReport = 0x0e, "Reservation Report";
        /// Reservation Acquire.
        ReservationAcquire = 0x11, "Reservation Acquire";
        /// Reservation Release.
        ReservationRelease = 0x15, "Reservation Release";
        /// Copy.
        Copy = 0x19, "Copy";
        /// A fabrics command on an I/O queue (Connect, Disconnect).
        Fabrics = 0x7f, "Fabrics Command";
    }
}

opcodes! {
    /// Fabrics command types (FCTYPE, byte 4 of a fabrics command's SQE).
    FabricsType {
        /// Property Set.
        PropertySet = 0x00, "Property Set";
        /// Connect.
        Connect = 0x01, "Connect";
        /// Property Get.
        PropertyGet = 0x04, "Property Get";
        /// Authentication Send.
        AuthenticationSend = 0x05, "Authentication Send";
        /// Authentication Receive.
        AuthenticationReceive = 0x06, "Authentication Receive";
        /// Disconnect.
        Disconnect = 0x08, "Disconnect";
    }
}

/// Whether an opcode transfers data from host to controller (bits 1:0 = 01b) or from
/// controller to host (10b): the data direction every NVMe opcode encodes in its low bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DataDirection {
    /// 00b: no data.
    None,
    /// 01b: host to controller (a write).
    HostToController,
    /// 10b: controller to host (a read).
    ControllerToHost,
    /// 11b: both.
    Bidirectional,
}

impl DataDirection {
    /// The direction opcode `code` encodes.
    pub fn of(code: u8) -> DataDirection {
        match code & 3 {
            0 => DataDirection::None,
            1 => DataDirection::HostToController,
            2 => DataDirection::ControllerToHost,
            _ => DataDirection::Bidirectional,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn codes_read_back_and_encode_their_direction() {
        for op in AdminOpcode::ALL {
            assert_eq!(AdminOpcode::from_code(op.code()), Some(*op));
        }
        for op in NvmOpcode::ALL {
            assert_eq!(NvmOpcode::from_code(op.code()), Some(*op));
        }
        assert_eq!(
            DataDirection::of(NvmOpcode::Write.code()),
            DataDirection::HostToController
        );
        assert_eq!(
            DataDirection::of(NvmOpcode::Read.code()),
            DataDirection::ControllerToHost
        );
        assert_eq!(
            DataDirection::of(AdminOpcode::Identify.code()),
            DataDirection::ControllerToHost
        );
        assert_eq!(FabricsType::from_code(0x01), Some(FabricsType::Connect));
        assert_eq!(FabricsType::from_code(0x02), None);
    }
}
