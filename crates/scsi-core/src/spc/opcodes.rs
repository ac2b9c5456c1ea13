//! The commands this device server supports, with what each may do under a reservation, and
//! REPORT SUPPORTED OPERATION CODES (SPC-4 section 6.35) built from that table.

use crate::cdb::check_control;
use crate::sense::{FieldPointer, Sense};

/// What a command does to the medium: the reservations' word for it, kept where conflicts
/// are decided.
pub use crate::pr::Access;

/// One supported command.
#[derive(Debug)]
pub struct CommandInfo {
    /// OPERATION CODE.
    pub opcode: u8,
    /// SERVICE ACTION, for commands that have one.
    pub service_action: Option<u8>,
    /// CDB USAGE DATA: the CDB with every bit the device server looks at set.
    pub usage: &'static [u8],
    /// Reservation class.
    pub access: Access,
    /// Name, for logs.
    pub name: &'static str,
    /// Its place in [`COMMANDS`], where the dispatcher finds what runs it.
    pub(crate) index: usize,
}

/// Every supported command, for the macro `$m` to make a table of, in (opcode, service
/// action) order: `OPCODE[/SERVICE ACTION] ACCESS "NAME" [CDB USAGE after the opcode] =>
/// GROUP::HANDLER;`. The table here ([`COMMANDS`]) takes all but the handler; the dispatcher,
/// a layer above the device, takes the handlers in the same order, so this layer (which the
/// device looks commands up in) names no code that runs on the device.
macro_rules! for_each_command {
    ($m:ident) => {
        $m! {
    0x00 Always "TEST UNIT READY" [0, 0, 0, 0, 0] => spc::test_unit_ready;
    0x03 Exempt "REQUEST SENSE" [0x01, 0, 0, 0xff, 0] => spc::request_sense;
    0x04 Write "FORMAT UNIT" [0, 0, 0, 0, 0] => sbc::format_unit;
    0x08 Read "READ(6)" [0x1f, 0xff, 0xff, 0xff, 0] => sbc::read_write;
    0x0a Write "WRITE(6)" [0x1f, 0xff, 0xff, 0xff, 0] => sbc::read_write;
    0x12 Exempt "INQUIRY" [0x01, 0xff, 0xff, 0xff, 0] => spc::inquiry;
    0x15 Write "MODE SELECT(6)" [0x11, 0, 0, 0xff, 0] => spc::mode_select;
    0x16 Write "RESERVE(6)" [0, 0, 0, 0, 0] => spc::reserve;
    0x17 Write "RELEASE(6)" [0, 0, 0, 0, 0] => spc::release;
    0x1a Read "MODE SENSE(6)" [0x08, 0xff, 0xff, 0xff, 0] => spc::mode_sense;
    0x1b Write "START STOP UNIT" [0x01, 0, 0x0f, 0xf7, 0] => sbc::start_stop_unit;
    0x1e Write "PREVENT ALLOW MEDIUM REMOVAL" [0, 0, 0, 0x03, 0] => sbc::prevent_allow_medium_removal;
    0x25 Always "READ CAPACITY(10)" [0, 0, 0, 0, 0, 0, 0, 0, 0] => sbc::read_capacity10;
    0x28 Read "READ(10)" [0x18, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::read_write;
    0x2a Write "WRITE(10)" [0x18, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::read_write;
    0x2e Write "WRITE AND VERIFY(10)" [0x16, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::write_and_verify;
    0x2f Read "VERIFY(10)" [0x16, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::verify;
    0x34 Read "PRE-FETCH(10)" [0x02, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::pre_fetch;
    0x35 Write "SYNCHRONIZE CACHE(10)" [0x02, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::synchronize_cache;
    0x37 Read "READ DEFECT DATA(10)" [0x00, 0x1f, 0, 0, 0, 0, 0xff, 0xff, 0] => sbc::read_defect_data;
    0x41 Write "WRITE SAME(10)" [0x18, 0xff, 0xff, 0xff, 0xff, 0x3f, 0xff, 0xff, 0] => sbc::write_same;
    0x42 Write "UNMAP" [0x00, 0, 0, 0, 0, 0x3f, 0xff, 0xff, 0] => sbc::unmap;
    0x4d Always "LOG SENSE" [0x00, 0xff, 0xff, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::log_sense;
    0x55 Write "MODE SELECT(10)" [0x11, 0, 0, 0, 0, 0, 0xff, 0xff, 0] => spc::mode_select;
    0x56 Write "RESERVE(10)" [0, 0, 0, 0, 0, 0, 0, 0, 0] => spc::reserve;
    0x57 Write "RELEASE(10)" [0, 0, 0, 0, 0, 0, 0, 0, 0] => spc::release;
    0x5a Read "MODE SENSE(10)" [0x18, 0xff, 0xff, 0, 0, 0, 0xff, 0xff, 0] => spc::mode_sense;
    0x5e/0x00 Unrestricted "PERSISTENT RESERVE IN / READ KEYS" [0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0] => spc::persistent_reserve_in;
    0x5e/0x01 Unrestricted "PERSISTENT RESERVE IN / READ RESERVATION" [0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0] => spc::persistent_reserve_in;
    0x5e/0x02 Unrestricted "PERSISTENT RESERVE IN / REPORT CAPABILITIES" [0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0] => spc::persistent_reserve_in;
    0x5e/0x03 Unrestricted "PERSISTENT RESERVE IN / READ FULL STATUS" [0x1f, 0, 0, 0, 0, 0, 0xff, 0xff, 0] => spc::persistent_reserve_in;
    0x5f/0x00 Unrestricted "PERSISTENT RESERVE OUT / REGISTER" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x01 Unrestricted "PERSISTENT RESERVE OUT / RESERVE" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x02 Unrestricted "PERSISTENT RESERVE OUT / RELEASE" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x03 Unrestricted "PERSISTENT RESERVE OUT / CLEAR" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x04 Unrestricted "PERSISTENT RESERVE OUT / PREEMPT" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x05 Unrestricted "PERSISTENT RESERVE OUT / PREEMPT AND ABORT" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x06 Unrestricted "PERSISTENT RESERVE OUT / REGISTER AND IGNORE EXISTING KEY" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x5f/0x07 Unrestricted "PERSISTENT RESERVE OUT / REGISTER AND MOVE" [0x1f, 0xff, 0, 0, 0xff, 0xff, 0xff, 0xff, 0] => spc::persistent_reserve_out;
    0x83/0x00 Write "EXTENDED COPY(LID1)" [0x1f, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::extended_copy;
    0x84/0x00 Always "RECEIVE COPY RESULTS / COPY STATUS" [0x1f, 0xff, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::receive_copy_results;
    0x84/0x03 Always "RECEIVE COPY RESULTS / OPERATING PARAMETERS" [0x1f, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::receive_copy_results;
    0x88 Read "READ(16)" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::read_write;
    0x89 Write "COMPARE AND WRITE" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0, 0, 0xff, 0x3f, 0] => sbc::compare_and_write;
    0x8a Write "WRITE(16)" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::read_write;
    0x8b Write "ORWRITE(16)" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::orwrite;
    0x8e Write "WRITE AND VERIFY(16)" [0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::write_and_verify;
    0x8f Read "VERIFY(16)" [0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::verify;
    0x90 Read "PRE-FETCH(16)" [0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::pre_fetch;
    0x91 Write "SYNCHRONIZE CACHE(16)" [0x02, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::synchronize_cache;
    0x93 Write "WRITE SAME(16)" [0x19, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::write_same;
    0x9c Write "WRITE ATOMIC(16)" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::write_atomic;
    0x9e/0x10 Always "READ CAPACITY(16)" [0x1f, 0, 0, 0, 0, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => sbc::read_capacity16;
    0x9e/0x12 Read "GET LBA STATUS" [0x1f, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0] => sbc::get_lba_status;
    0xa0 Exempt "REPORT LUNS" [0, 0xff, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::report_luns;
    0xa3/0x0a Unrestricted "REPORT TARGET PORT GROUPS" [0x3f, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::report_target_port_groups;
    0xa3/0x0c Unrestricted "REPORT SUPPORTED OPERATION CODES" [0x1f, 0x87, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::report_supported_operation_codes;
    0xa3/0x0d Unrestricted "REPORT SUPPORTED TASK MANAGEMENT FUNCTIONS" [0x1f, 0x80, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::report_supported_tmfs;
    0xa4/0x0a Write "SET TARGET PORT GROUPS" [0x1f, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => spc::set_target_port_groups;
    0xa8 Read "READ(12)" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::read_write;
    0xaa Write "WRITE(12)" [0x18, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::read_write;
    0xae Write "WRITE AND VERIFY(12)" [0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::write_and_verify;
    0xaf Read "VERIFY(12)" [0x16, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0xff, 0x3f, 0] => sbc::verify;
    0xb7 Read "READ DEFECT DATA(12)" [0x1f, 0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff, 0, 0] => sbc::read_defect_data;
        }
    };
}
pub(crate) use for_each_command;

/// [`COMMANDS`] from [`for_each_command`]'s list, each entry numbered by its place (one entry
/// at a time, the count carried along).
macro_rules! command_infos {
    (@table [$($done:tt)*] $n:expr ;) => {
        /// Every supported command, by opcode and service action.
        pub static COMMANDS: &[CommandInfo] = &[$($done)*];
        /// How many commands [`COMMANDS`] has.
        pub(crate) const COMMAND_COUNT: usize = $n;
    };
    (@table [$($done:tt)*] $n:expr ; $op:literal $(/ $sa:literal)? $access:ident $name:literal
        [$($u:literal),*] => $group:ident :: $handler:ident ; $($rest:tt)*) => {
        command_infos! { @table [$($done)* CommandInfo {
            opcode: $op,
            service_action: command_infos!(@sa $($sa)?),
            usage: &[$op, $($u),*],
            access: Access::$access,
            name: $name,
            index: $n,
        },] $n + 1 ; $($rest)* }
    };
    (@sa) => { None };
    (@sa $sa:literal) => { Some($sa) };
    ($($list:tt)*) => { command_infos! { @table [] 0 ; $($list)* } };
}

for_each_command!(command_infos);

/// Whether the opcode's CDB carries a service action in byte 1 bits 4-0.
pub fn has_service_action(opcode: u8) -> bool {
    matches!(opcode, 0x5e | 0x5f | 0x83 | 0x84 | 0x9e | 0xa3 | 0xa4)
}

/// The table entry for a CDB, or the sense that says why there is none: an unknown opcode, or
/// an unknown service action of a known one (which points at the service action field).
pub fn lookup(cdb: &[u8]) -> Result<&'static CommandInfo, Sense> {
    let opcode = *cdb.first().ok_or_else(Sense::invalid_opcode)?;
    // The table is sorted by (opcode, service action).
    if has_service_action(opcode) {
        let sa = cdb.get(1).map_or(0, |b| b & 0x1f);
        return match COMMANDS
            .binary_search_by_key(&(opcode, Some(sa)), |c| (c.opcode, c.service_action))
        {
            Ok(i) => Ok(&COMMANDS[i]),
            Err(_) if COMMANDS.iter().any(|c| c.opcode == opcode) => {
                Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(1, 4)))
            }
            Err(_) => Err(Sense::invalid_opcode()),
        };
    }
    COMMANDS
        .binary_search_by_key(&(opcode, None), |c| (c.opcode, c.service_action))
        .map(|i| &COMMANDS[i])
        .map_err(|_| Sense::invalid_opcode())
}

/// Nominal timeout and recommended timeout (seconds) in the command timeouts descriptor.
const TIMEOUTS: (u32, u32) = (30, 60);

fn timeouts_descriptor(out: &mut Vec<u8>) {
    out.extend_from_slice(&[0x00, 0x0a, 0, 0]);
    out.extend_from_slice(&TIMEOUTS.0.to_be_bytes());
    out.extend_from_slice(&TIMEOUTS.1.to_be_bytes());
}

/// REPORT SUPPORTED OPERATION CODES parameter data, truncated to the ALLOCATION LENGTH.
/// REPORTING OPTIONS 000b lists every command; 001b, 010b and 011b describe one command (by
/// opcode, or opcode and service action) with its CDB usage data.
pub fn report_supported_operation_codes(cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    check_control(cdb, 12)?;
    let rctd = cdb[2] & 0x80 != 0;
    let options = cdb[2] & 0x07;
    let opcode = cdb[3];
    let sa = u16::from_be_bytes([cdb[4], cdb[5]]);
    let alloc = u32::from_be_bytes([cdb[6], cdb[7], cdb[8], cdb[9]]) as usize;
    let mut d = Vec::new();
    match options {
        0 => {
            d.extend_from_slice(&[0; 4]);
            for c in COMMANDS {
                d.push(c.opcode);
                d.push(0);
                d.extend_from_slice(&u16::from(c.service_action.unwrap_or(0)).to_be_bytes());
                d.push(0);
                d.push(u8::from(c.service_action.is_some()) | (u8::from(rctd) << 1));
                d.extend_from_slice(&(c.usage.len() as u16).to_be_bytes());
                if rctd {
                    timeouts_descriptor(&mut d);
                }
            }
            let len = (d.len() - 4) as u32;
            d[..4].copy_from_slice(&len.to_be_bytes());
        }
        1..=3 => {
            let with_sa = has_service_action(opcode);
            // 001b: by opcode, which must not have service actions; 010b: opcode and service
            // action, which it must have; 011b: either.
            match (options, with_sa) {
                (1, true) => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(2, 2))),
                (2, false) => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(2, 2))),
                _ => {}
            }
            if options == 1 && sa != 0 {
                return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(4)));
            }
            let found = COMMANDS.iter().find(|c| {
                c.opcode == opcode && (!with_sa || c.service_action.map(u16::from) == Some(sa))
            });
            d.extend_from_slice(&[0, 0, 0, 0]);
            match found {
                Some(c) => {
                    d[1] = 0x03 | (u8::from(rctd) << 7); // SUPPORT: supported as the standard says
                    d[2..4].copy_from_slice(&(c.usage.len() as u16).to_be_bytes());
                    d.extend_from_slice(c.usage);
                    if rctd {
                        timeouts_descriptor(&mut d);
                    }
                }
                None => d[1] = 0x01, // SUPPORT: not supported
            }
        }
        _ => return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb_bit(2, 2))),
    }
    d.truncate(alloc);
    Ok(d)
}

/// REPORT SUPPORTED TASK MANAGEMENT FUNCTIONS parameter data (SPC-4 section 6.36); REPD asks
/// for the extended format.
pub fn report_supported_tmfs(cdb: &[u8]) -> Result<Vec<u8>, Sense> {
    check_control(cdb, 12)?;
    let repd = cdb[2] & 0x80 != 0;
    let alloc = u32::from_be_bytes([cdb[6], cdb[7], cdb[8], cdb[9]]) as usize;
    if alloc < 4 {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(6)));
    }
    // ATS ATSS CACAS CTSS LURS QTS TRS (not WAKES); QAES QTSS ITNRS.
    let mut d = vec![0xfe, 0x07, 0, 0];
    if repd {
        d[3] = 0x0c;
        d.resize(16, 0);
    }
    d.truncate(alloc);
    Ok(d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cdb::cdb_length;

    #[test]
    fn table_is_consistent() {
        assert_eq!(COMMANDS.len(), COMMAND_COUNT);
        for (i, c) in COMMANDS.iter().enumerate() {
            assert_eq!(c.index, i, "{} is numbered by its place", c.name);
        }
        for c in COMMANDS {
            assert_eq!(cdb_length(c.opcode), Some(c.usage.len()), "{}", c.name);
            assert_eq!(
                has_service_action(c.opcode),
                c.service_action.is_some(),
                "{}",
                c.name
            );
            assert_eq!(*c.usage.last().unwrap(), 0, "{}: CONTROL byte", c.name);
        }
        for (i, a) in COMMANDS.iter().enumerate() {
            for b in &COMMANDS[i + 1..] {
                assert!((a.opcode, a.service_action) < (b.opcode, b.service_action));
            }
        }
        assert_eq!(lookup(&[0x28]).unwrap().name, "READ(10)");
        assert_eq!(lookup(&[0x9e, 0x12]).unwrap().name, "GET LBA STATUS");
        let e = lookup(&[0x9e, 0x11]).unwrap_err();
        assert_eq!(e.field.unwrap().byte, 1);
        assert_eq!(lookup(&[0xff]).unwrap_err().field.unwrap().byte, 0);
    }

    #[test]
    fn reports_all_and_one() {
        let all = report_supported_operation_codes(&[0xa3, 0x0c, 0, 0, 0, 0, 0, 0, 0x10, 0, 0, 0])
            .unwrap();
        assert_eq!(all.len(), 4 + 8 * COMMANDS.len());
        let with_timeouts =
            report_supported_operation_codes(&[0xa3, 0x0c, 0x80, 0, 0, 0, 0, 0, 0x10, 0, 0, 0])
                .unwrap();
        assert_eq!(with_timeouts.len(), 4 + 20 * COMMANDS.len());
        let one =
            report_supported_operation_codes(&[0xa3, 0x0c, 0x01, 0x28, 0, 0, 0, 0, 1, 0, 0, 0])
                .unwrap();
        assert_eq!(&one[..4], &[0, 3, 0, 10]);
        assert_eq!(one[4], 0x28);
        let sa =
            report_supported_operation_codes(&[0xa3, 0x0c, 0x02, 0x9e, 0, 0x10, 0, 0, 1, 0, 0, 0])
                .unwrap();
        assert_eq!(&sa[..4], &[0, 3, 0, 16]);
        let missing =
            report_supported_operation_codes(&[0xa3, 0x0c, 0x01, 0xee, 0, 0, 0, 0, 1, 0, 0, 0])
                .unwrap();
        assert_eq!(missing[1], 1);
        assert!(report_supported_operation_codes(&[
            0xa3, 0x0c, 0x01, 0x9e, 0, 0, 0, 0, 1, 0, 0, 0
        ])
        .is_err());
        assert!(
            report_supported_operation_codes(&[0xa3, 0x0c, 0x07, 0, 0, 0, 0, 0, 1, 0, 0, 0])
                .is_err()
        );
    }
}
