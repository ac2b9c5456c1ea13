//! The handlers of SPC-4's commands in the command table ([`super::opcodes`]): each turns a
//! CDB whose reserved bits are checked into the task's first [`Step`].

use crate::device::{Device, Parameters, Reply, Step, TaskError};
use crate::dispatch::{be16, be32, data, internal, Cdb};
use crate::pr::ReservationRequest;
use crate::sense::{Asc, FieldPointer, Sense, SenseKey};
use crate::spc::{copy, inquiry, log, mode, opcodes, report_luns, tpg};

/// TEST UNIT READY: what admitted it (NOT READY, unit attentions) is the answer.
pub(crate) fn test_unit_ready(_: &mut Device, _: &Cdb<'_>) -> Result<Step, TaskError> {
    Ok(Step::Done(Reply::Good))
}

/// REQUEST SENSE: the nexus's next unit attention, or NO SENSE.
pub(crate) fn request_sense(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let desc = c.cdb[1] & 0x01 != 0;
    let sense = match d.nexus_ua_pop(c.nexus, c.lun) {
        Some(asc) => Sense::unit_attention(asc),
        None => Sense::new(SenseKey::NoSense, Asc::NO_ADDITIONAL_SENSE),
    };
    let mut bytes = sense.encode(desc).as_slice().to_vec();
    bytes.truncate(usize::from(c.cdb[4]));
    data(Ok(bytes))
}

/// INQUIRY: standard data or a VPD page, as the port the nexus came through shows the unit.
pub(crate) fn inquiry(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let port = d
        .ports
        .iter()
        .find(|p| Some(p.relative_port) == d.relative_port(c.nexus))
        .or(d.ports.first())
        .cloned()
        .ok_or_else(internal)?;
    let lu = d.lu(c.lun).ok_or_else(internal)?;
    data(inquiry::inquiry(&lu.unit, &port, c.cdb))
}

/// MODE SELECT (6) and (10): the parameter list, then [`Parameters::ModeSelect`].
pub(crate) fn mode_select(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    mode::check_mode_select(c.cdb)?;
    let ten = c.cdb[0] == 0x55;
    let len = if ten {
        be16(c.cdb, 7)
    } else {
        u32::from(c.cdb[4])
    };
    d.parameter_list(c.id, len, Parameters::ModeSelect { ten })
}

/// MODE SENSE (6) and (10).
pub(crate) fn mode_sense(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let ten = c.cdb[0] == 0x5a;
    let m = d.mode_parameters(c.lun)?;
    let alloc = if ten {
        be16(c.cdb, 7)
    } else {
        u32::from(c.cdb[4])
    };
    let mut bytes = mode::mode_sense(c.cdb, ten, &c.geometry, &m, d.default_wce(c.lun))?;
    bytes.truncate(alloc as usize);
    data(Ok(bytes))
}

/// RESERVE (6) and (10): an SPC-2 reservation.
pub(crate) fn reserve(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    d.change_reservations(c.id, ReservationRequest::Reserve)
}

/// RELEASE (6) and (10).
pub(crate) fn release(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    d.change_reservations(c.id, ReservationRequest::Release)
}

/// LOG SENSE: the supported pages.
pub(crate) fn log_sense(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let mut bytes = log::log_sense(c.cdb)?;
    bytes.truncate(be16(c.cdb, 7) as usize);
    data(Ok(bytes))
}

/// PERSISTENT RESERVE IN, every service action.
pub(crate) fn persistent_reserve_in(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let alloc = be16(c.cdb, 7) as usize;
    let capable = d.ptpl_capable(c.lun);
    let lu = d.lu(c.lun).ok_or_else(internal)?;
    data(
        lu.reservations
            .persistent
            .read(c.cdb[1] & 0x1f, alloc, capable),
    )
}

/// PERSISTENT RESERVE OUT, every service action: the parameter list, then
/// [`Parameters::PersistentReserveOut`].
pub(crate) fn persistent_reserve_out(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let len = be32(c.cdb, 5);
    if len == 0 {
        // Every service action needs at least the basic parameter list.
        return Err(Sense::parameter_list_length_error().into());
    }
    let p = Parameters::PersistentReserveOut {
        action: c.cdb[1] & 0x1f,
        scope_type: c.cdb[2],
    };
    d.parameter_list(c.id, len, p)
}

/// EXTENDED COPY (LID1): the table admits service action 00h only.
pub(crate) fn extended_copy(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let len = be32(c.cdb, 10);
    d.parameter_list(c.id, len, Parameters::ExtendedCopy)
}

/// RECEIVE COPY RESULTS: COPY STATUS of a held copy, or OPERATING PARAMETERS.
pub(crate) fn receive_copy_results(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let alloc = be32(c.cdb, 10) as usize;
    let mut bytes = if c.cdb[1] & 0x1f == 0x03 {
        copy::operating_parameters()
    } else {
        d.held_copy_status(c.id, c.cdb[2])?.to_vec()
    };
    bytes.truncate(alloc);
    data(Ok(bytes))
}

/// REPORT LUNS; it clears the nexus's REPORTED LUNS DATA HAS CHANGED.
pub(crate) fn report_luns(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let luns = d.luns();
    let bytes = report_luns::report_luns(&luns, c.cdb)?;
    if let Some(n) = d.nexus_mut(c.nexus) {
        n.unit_attentions
            .retain(|&(_, asc)| asc != Asc::REPORTED_LUNS_DATA_HAS_CHANGED);
    }
    data(Ok(bytes))
}

/// REPORT TARGET PORT GROUPS.
pub(crate) fn report_target_port_groups(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let alloc = be32(c.cdb, 6) as usize;
    let set = d.lu(c.lun).ok_or_else(internal)?.port_groups.is_some();
    let groups = d.port_groups(c.lun).ok_or_else(internal)?;
    let mut bytes = tpg::report_target_port_groups(&groups, c.cdb[1] & 0x20 != 0, set);
    bytes.truncate(alloc);
    data(Ok(bytes))
}

/// SET TARGET PORT GROUPS: the parameter list ([`Device::set_target_port_groups`]), at most
/// a descriptor per group of a large cluster.
pub(crate) fn set_target_port_groups(d: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    let len = be32(c.cdb, 6);
    if len > tpg::MAX_SET_TARGET_PORT_GROUPS {
        return Err(Sense::invalid_field_in_cdb(FieldPointer::cdb(6)).into());
    }
    d.parameter_list(c.id, len, Parameters::SetTargetPortGroups)
}

/// REPORT SUPPORTED OPERATION CODES, from the command table.
pub(crate) fn report_supported_operation_codes(
    _: &mut Device,
    c: &Cdb<'_>,
) -> Result<Step, TaskError> {
    data(opcodes::report_supported_operation_codes(c.cdb))
}

/// REPORT SUPPORTED TASK MANAGEMENT FUNCTIONS.
pub(crate) fn report_supported_tmfs(_: &mut Device, c: &Cdb<'_>) -> Result<Step, TaskError> {
    data(opcodes::report_supported_tmfs(c.cdb))
}
