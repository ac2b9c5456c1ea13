//! iSCSI names (RFC 7143 section 4.2.7): `iqn.`, `eui.` and `naa.` formats.

/// The longest iSCSI name, in bytes.
pub const MAX_NAME_LEN: usize = 223;

/// Why a string is not an iSCSI name: what an administrator who typed it needs to fix it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum NameError {
    /// Nothing given.
    #[error("an iSCSI name cannot be empty")]
    Empty,
    /// More than [`MAX_NAME_LEN`] bytes.
    #[error("{0} bytes: an iSCSI name has at most 223")]
    TooLong(usize),
    /// A space or a control character at this byte offset.
    #[error("a space or control character at byte {0}: iSCSI names have none")]
    Space(usize),
    /// Neither `iqn.`, `eui.` nor `naa.`.
    #[error(
        "it must start with iqn. (iqn.YYYY-MM.reversed.domain[:id]), eui. (16 hex digits) or \
         naa. (16 or 32 hex digits)"
    )]
    Format,
    /// `iqn.` without a valid `YYYY-MM.` after it.
    #[error(
        "iqn. must be followed by the year and month the naming authority owned its domain \
         and a dot (iqn.2026-11.)"
    )]
    IqnDate,
    /// `iqn.YYYY-MM.` without the reversed domain name after it.
    #[error("the date must be followed by the naming authority's reversed domain (iqn.2026-11.com.example)")]
    IqnAuthority,
    /// `eui.` or `naa.` with the wrong number of hex digits, or not hex.
    #[error("{prefix} must be followed by {expected} hex digits, not {given:?}")]
    Hex {
        /// `eui.` or `naa.`.
        prefix: &'static str,
        /// "16" or "16 or 32".
        expected: &'static str,
        /// What followed the prefix.
        given: String,
    },
}

/// Whether `name` is a well-formed iSCSI name: `iqn.YYYY-MM.reversed.domain[:anything]`,
/// `eui.` + 16 hex digits, or `naa.` + 16 or 32 hex digits; at most 223 bytes, no spaces.
pub fn valid_iscsi_name(name: &str) -> bool {
    check_iscsi_name(name).is_ok()
}

/// [`valid_iscsi_name`], with the reason when it is not.
pub fn check_iscsi_name(name: &str) -> Result<(), NameError> {
    if name.is_empty() {
        return Err(NameError::Empty);
    }
    if name.len() > MAX_NAME_LEN {
        return Err(NameError::TooLong(name.len()));
    }
    if let Some(at) = name.bytes().position(|c| c <= b' ' || c == 0x7f) {
        return Err(NameError::Space(at));
    }
    let lower = name.to_ascii_lowercase();
    let hex = |prefix: &'static str, digits: &str, lengths: &[usize]| {
        if lengths.contains(&digits.len()) && digits.bytes().all(|c| c.is_ascii_hexdigit()) {
            Ok(())
        } else {
            Err(NameError::Hex {
                prefix,
                expected: if lengths.len() == 1 { "16" } else { "16 or 32" },
                given: digits.to_string(),
            })
        }
    };
    if let Some(rest) = lower.strip_prefix("iqn.") {
        let b = rest.as_bytes();
        // YYYY-MM then '.' and a naming authority.
        let date = b.len() > 7
            && b[..4].iter().all(u8::is_ascii_digit)
            && b[4] == b'-'
            && b[5..7].iter().all(u8::is_ascii_digit)
            && matches!(
                &rest[5..7],
                "01" | "02" | "03" | "04" | "05" | "06" | "07" | "08" | "09" | "10" | "11" | "12"
            )
            && b[7] == b'.';
        if !date {
            Err(NameError::IqnDate)
        } else if !b.get(8).is_some_and(u8::is_ascii_alphanumeric) {
            Err(NameError::IqnAuthority)
        } else {
            Ok(())
        }
    } else if let Some(digits) = lower.strip_prefix("eui.") {
        hex("eui.", digits, &[16])
    } else if let Some(digits) = lower.strip_prefix("naa.") {
        hex("naa.", digits, &[16, 32])
    } else {
        Err(NameError::Format)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names() {
        assert!(valid_iscsi_name("iqn.2026-11.io.example:disk1"));
        assert!(valid_iscsi_name("iqn.1994-05.com.redhat:a1b2c3"));
        assert!(valid_iscsi_name("eui.02004567A425678D"));
        assert!(valid_iscsi_name("naa.52004567BA64678D"));
        assert!(!valid_iscsi_name("iqn.2026-13.io.example"));
        assert!(!valid_iscsi_name("iqn.26-11.io.example"));
        assert!(!valid_iscsi_name("iqn.2026-11.io.example:has space"));
        assert!(!valid_iscsi_name("eui.123"));
        assert!(!valid_iscsi_name("disk1"));
        assert!(!valid_iscsi_name(&format!(
            "iqn.2026-11.io.{}",
            "a".repeat(220)
        )));
    }

    #[test]
    fn a_refused_name_says_why() {
        assert_eq!(check_iscsi_name(""), Err(NameError::Empty));
        assert_eq!(check_iscsi_name("iqn.bad name"), Err(NameError::Space(7)));
        assert_eq!(check_iscsi_name("iqn.2026-11"), Err(NameError::IqnDate));
        assert_eq!(
            check_iscsi_name("iqn.2026-13.io.x"),
            Err(NameError::IqnDate)
        );
        assert_eq!(
            check_iscsi_name("iqn.2026-11."),
            Err(NameError::IqnAuthority)
        );
        assert_eq!(check_iscsi_name("disk1"), Err(NameError::Format));
        assert!(matches!(
            check_iscsi_name("naa.123"),
            Err(NameError::Hex { prefix: "naa.", .. })
        ));
        assert_eq!(
            check_iscsi_name(&"a".repeat(224)),
            Err(NameError::TooLong(224))
        );
        let why = check_iscsi_name("eui.xyz").unwrap_err().to_string();
        assert_eq!(why, "eui. must be followed by 16 hex digits, not \"xyz\"");
    }
}
