//! Sequence numbers (CmdSN, StatSN, DataSN, R2TSN) compared with RFC 1982 serial number
//! arithmetic, SERIAL_BITS = 32, as RFC 7143 section 4.2.2.1 requires.

use core::fmt;

/// A 32-bit serial number. Ordering wraps: `SerialNumber(0)` follows `SerialNumber(u32::MAX)`.
/// It deliberately does not implement `Ord`, because serial order is not total: two numbers
/// exactly 2^31 apart are not comparable.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct SerialNumber(pub u32);

impl SerialNumber {
    /// `self < other` in serial arithmetic.
    #[inline]
    pub fn lt(self, other: SerialNumber) -> bool {
        self.0 != other.0 && (other.0.wrapping_sub(self.0) as i32) > 0
    }

    /// `self > other` in serial arithmetic.
    #[inline]
    pub fn gt(self, other: SerialNumber) -> bool {
        other.lt(self)
    }

    /// `self <= other` in serial arithmetic.
    #[inline]
    pub fn le(self, other: SerialNumber) -> bool {
        self == other || self.lt(other)
    }

    /// `self >= other` in serial arithmetic.
    #[inline]
    pub fn ge(self, other: SerialNumber) -> bool {
        self == other || self.gt(other)
    }

    /// The next number, wrapping.
    #[inline]
    #[must_use]
    pub fn next(self) -> SerialNumber {
        self + 1
    }

    /// Whether `self` lies in the window `[low, high]` (both inclusive), as a CmdSN must lie in
    /// `[ExpCmdSN, MaxCmdSN]`.
    #[inline]
    pub fn in_window(self, low: SerialNumber, high: SerialNumber) -> bool {
        low.le(self) && self.le(high)
    }
}

impl fmt::Debug for SerialNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

impl fmt::Display for SerialNumber {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// `n` steps later, wrapping (serial addition, RFC 1982 section 3.1).
impl core::ops::Add<u32> for SerialNumber {
    type Output = SerialNumber;

    #[inline]
    fn add(self, n: u32) -> SerialNumber {
        SerialNumber(self.0.wrapping_add(n))
    }
}

impl From<u32> for SerialNumber {
    fn from(v: u32) -> Self {
        SerialNumber(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wraps() {
        let max = SerialNumber(u32::MAX);
        assert!(max.lt(SerialNumber(0)));
        assert!(SerialNumber(0).gt(max));
        assert_eq!(max.next(), SerialNumber(0));
        assert!(SerialNumber(5).in_window(SerialNumber(u32::MAX - 3), SerialNumber(10)));
        assert!(!SerialNumber(11).in_window(SerialNumber(u32::MAX - 3), SerialNumber(10)));
        // 2^31 apart: neither is less than the other.
        let a = SerialNumber(0);
        let b = SerialNumber(1 << 31);
        assert!(!a.lt(b) && !b.lt(a));
    }
}
