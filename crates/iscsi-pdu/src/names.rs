//! iSCSI names (RFC 7143 section 4.2.7): `iqn.`, `eui.` and `naa.` formats.

/// The longest iSCSI name, in bytes.
pub const MAX_NAME_LEN: usize = 223;

/// Whether `name` is a well-formed iSCSI name: `iqn.YYYY-MM.reversed.domain[:anything]`,
/// `eui.` + 16 hex digits, or `naa.` + 16 or 32 hex digits; at most 223 bytes, no spaces.
pub fn valid_iscsi_name(name: &str) -> bool {
    if name.is_empty() || name.len() > MAX_NAME_LEN || name.bytes().any(|c| c <= b' ' || c == 0x7f)
    {
        return false;
    }
    let lower = name.to_ascii_lowercase();
    if let Some(rest) = lower.strip_prefix("iqn.") {
        let b = rest.as_bytes();
        // YYYY-MM then '.' and a naming authority.
        b.len() > 8
            && b[..4].iter().all(u8::is_ascii_digit)
            && b[4] == b'-'
            && b[5..7].iter().all(u8::is_ascii_digit)
            && matches!(
                &rest[5..7],
                "01" | "02" | "03" | "04" | "05" | "06" | "07" | "08" | "09" | "10" | "11" | "12"
            )
            && b[7] == b'.'
            && b[8].is_ascii_alphanumeric()
    } else if let Some(hex) = lower.strip_prefix("eui.") {
        hex.len() == 16 && hex.bytes().all(|c| c.is_ascii_hexdigit())
    } else if let Some(hex) = lower.strip_prefix("naa.") {
        (hex.len() == 16 || hex.len() == 32) && hex.bytes().all(|c| c.is_ascii_hexdigit())
    } else {
        false
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
}
