//! A session's command ordering (RFC 7143 section 4.2.2.1): every non-immediate request takes a
//! CmdSN inside the window the target advertises (ExpCmdSN..=MaxCmdSN) and the target carries
//! them out in CmdSN order, whichever of the session's connections they came on. A request that
//! arrives ahead of a gap waits until the gap is filled.
//!
//! This is the ordering alone, without locks or I/O: a daemon whose connections run on several
//! threads keeps one per session behind its own lock.

use std::collections::VecDeque;

use crate::SerialNumber;

/// The CmdSN window of one session and the requests waiting for their turn in it.
///
/// Memory is bounded by the window: at most one queued request per CmdSN inside it.
#[derive(Debug)]
pub struct CommandOrder<T> {
    window: u32,
    exp_cmd_sn: SerialNumber,
    /// Requests that arrived ahead of ExpCmdSN; `None` marks a request handled on arrival that
    /// only takes its number (NOP-Out, Text, Logout, task management).
    pending: VecDeque<(SerialNumber, Option<T>)>,
}

impl<T> CommandOrder<T> {
    /// A session whose first expected CmdSN is `exp_cmd_sn` (the leading login's CmdSN),
    /// admitting `window` commands ahead (at least 1).
    pub fn new(exp_cmd_sn: SerialNumber, window: u32) -> CommandOrder<T> {
        let window = window.max(1);
        CommandOrder {
            window,
            exp_cmd_sn,
            pending: VecDeque::with_capacity(window.min(128) as usize),
        }
    }

    /// ExpCmdSN and MaxCmdSN to advertise now.
    pub fn window(&self) -> (SerialNumber, SerialNumber) {
        (self.exp_cmd_sn, self.exp_cmd_sn + (self.window - 1))
    }

    /// Queues `request` under `cmd_sn` (`None` for a request handled on arrival, which only
    /// takes the number). False when `cmd_sn` is outside the window or already taken: RFC 7143
    /// has the target drop such a request silently.
    pub fn admit(&mut self, cmd_sn: SerialNumber, request: Option<T>) -> bool {
        let (exp, max) = self.window();
        if !cmd_sn.in_window(exp, max) || self.pending.iter().any(|(sn, _)| *sn == cmd_sn) {
            return false;
        }
        self.pending.push_back((cmd_sn, request));
        true
    }

    /// Takes `cmd_sn` for a request to run at once when its turn has come and nothing waits:
    /// `cmd_sn` is ExpCmdSN, which advances past it. What [`CommandOrder::admit`] then
    /// [`CommandOrder::next_ready`] would do, without queueing the request: on a session
    /// whose commands come in order (one connection, the usual case) none is ever queued.
    /// False (nothing changed) otherwise; the caller admits it.
    pub fn take_next(&mut self, cmd_sn: SerialNumber) -> bool {
        if cmd_sn != self.exp_cmd_sn || !self.pending.is_empty() {
            return false;
        }
        self.exp_cmd_sn = cmd_sn.next();
        true
    }

    /// The next request whose turn has come, advancing ExpCmdSN past it and past every
    /// number-only request before it; `None` while the next CmdSN has not arrived.
    pub fn next_ready(&mut self) -> Option<T> {
        loop {
            let exp = self.exp_cmd_sn;
            let i = self.pending.iter().position(|(sn, _)| *sn == exp)?;
            let (_, request) = self.pending.remove(i)?;
            self.exp_cmd_sn = exp.next();
            if request.is_some() {
                return request;
            }
        }
    }

    /// Drops the queued requests `cancelled` picks (a closed connection's), keeping their
    /// numbers taken so the requests after them still run in order.
    pub fn cancel(&mut self, mut cancelled: impl FnMut(&T) -> bool) {
        for (_, request) in &mut self.pending {
            if request.as_ref().is_some_and(&mut cancelled) {
                *request = None;
            }
        }
    }

    /// Requests waiting behind a gap.
    pub fn waiting(&self) -> usize {
        self.pending.len()
    }

    /// The highest CmdSN taken so far: the highest waiting, else ExpCmdSN - 1. A request at
    /// or below it fills a gap; one above it is new. (A park for a handover reads only the
    /// former, so that the session's connections stop where no gap is left.)
    pub fn highest_taken(&self) -> SerialNumber {
        let mut highest = SerialNumber(self.exp_cmd_sn.0.wrapping_sub(1));
        for (sn, _) in &self.pending {
            if sn.gt(highest) {
                highest = *sn;
            }
        }
        highest
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_highest_cmd_sn_taken_is_the_highest_waiting_or_the_last_run() {
        let mut o = CommandOrder::new(SerialNumber(u32::MAX - 1), 8);
        assert_eq!(o.highest_taken(), SerialNumber(u32::MAX - 2));
        assert!(o.admit(SerialNumber(1), Some(1)));
        assert!(o.admit(SerialNumber(u32::MAX), Some(0)));
        // Serial arithmetic: 1 comes after u32::MAX.
        assert_eq!(o.highest_taken(), SerialNumber(1));
        assert!(o.admit(SerialNumber(u32::MAX - 1), Some(9)));
        assert!(o.admit(SerialNumber(0), Some(5)));
        while o.next_ready().is_some() {}
        assert_eq!(o.waiting(), 0);
        assert_eq!(o.highest_taken(), SerialNumber(1));
    }

    #[test]
    fn a_request_in_turn_with_nothing_waiting_runs_at_once() {
        let mut o = CommandOrder::new(SerialNumber(u32::MAX), 4);
        assert!(o.take_next(SerialNumber(u32::MAX)));
        assert_eq!(
            o.window(),
            (SerialNumber(0), SerialNumber(3)),
            "ExpCmdSN wraps"
        );
        assert!(!o.take_next(SerialNumber(u32::MAX)), "taken already");
        assert!(!o.take_next(SerialNumber(1)), "not its turn");
        assert!(o.admit(SerialNumber(1), Some("b")));
        assert!(
            !o.take_next(SerialNumber(0)),
            "1 waits: 0 goes through the queue, which releases both in order"
        );
        assert!(o.admit(SerialNumber(0), Some("a")));
        assert_eq!(o.next_ready(), Some("a"));
        assert_eq!(o.next_ready(), Some("b"));
        assert!(o.take_next(SerialNumber(2)));
        assert_eq!(o.window(), (SerialNumber(3), SerialNumber(6)));
    }

    /// Against the queue alone: taking a request at once when `take_next` allows it leaves the
    /// order where admitting and releasing it would, for any arrival order.
    #[test]
    fn taking_at_once_is_admitting_and_releasing() {
        use proptest::prelude::*;
        proptest!(|(start in any::<u32>(), arrivals in proptest::collection::vec(0u32..12, 0..40))| {
            let mut fast = CommandOrder::new(SerialNumber(start), 8);
            let mut slow = CommandOrder::new(SerialNumber(start), 8);
            let (mut ran_fast, mut ran_slow) = (Vec::new(), Vec::new());
            for a in arrivals {
                let sn = SerialNumber(start.wrapping_add(a));
                let admitted_slow = slow.admit(sn, Some(a));
                while let Some(r) = slow.next_ready() {
                    ran_slow.push(r);
                }
                let admitted_fast = if fast.take_next(sn) {
                    ran_fast.push(a);
                    true
                } else {
                    fast.admit(sn, Some(a))
                };
                while let Some(r) = fast.next_ready() {
                    ran_fast.push(r);
                }
                prop_assert_eq!(admitted_fast, admitted_slow);
                prop_assert_eq!(&ran_fast, &ran_slow);
                prop_assert_eq!(fast.window(), slow.window());
                prop_assert_eq!(fast.waiting(), slow.waiting());
            }
        });
    }

    #[test]
    fn releases_in_order_across_gaps_and_markers() {
        let mut o = CommandOrder::new(SerialNumber(10), 4);
        assert_eq!(o.window(), (SerialNumber(10), SerialNumber(13)));
        assert!(o.admit(SerialNumber(12), Some("c")));
        assert!(o.admit(SerialNumber(11), None));
        assert_eq!(o.next_ready(), None, "10 has not arrived");
        assert!(o.admit(SerialNumber(10), Some("a")));
        assert_eq!(o.next_ready(), Some("a"));
        assert_eq!(o.next_ready(), Some("c"), "the marker 11 is passed over");
        assert_eq!(o.next_ready(), None);
        assert_eq!(o.window(), (SerialNumber(13), SerialNumber(16)));
        assert_eq!(o.waiting(), 0);
    }

    #[test]
    fn cancelled_requests_keep_their_numbers() {
        let mut o = CommandOrder::new(SerialNumber(1), 8);
        assert!(o.admit(SerialNumber(2), Some(("dead", 2))));
        assert!(o.admit(SerialNumber(3), Some(("live", 3))));
        o.cancel(|(conn, _)| *conn == "dead");
        assert!(
            !o.admit(SerialNumber(2), Some(("live", 2))),
            "2 stays taken"
        );
        assert!(o.admit(SerialNumber(1), None));
        assert_eq!(o.next_ready(), Some(("live", 3)));
        assert_eq!(o.window().0, SerialNumber(4));
    }

    #[test]
    fn refuses_outside_the_window_and_duplicates() {
        let mut o = CommandOrder::new(SerialNumber(u32::MAX), 2);
        assert!(!o.admit(SerialNumber(1), Some(1)), "beyond MaxCmdSN");
        assert!(
            !o.admit(SerialNumber(u32::MAX - 1), Some(1)),
            "before ExpCmdSN"
        );
        assert!(o.admit(SerialNumber(0), Some(2)), "the window wraps");
        assert!(!o.admit(SerialNumber(0), Some(3)), "taken");
        assert!(o.admit(SerialNumber(u32::MAX), Some(4)));
        assert_eq!(o.next_ready(), Some(4));
        assert_eq!(o.next_ready(), Some(2));
    }
}
