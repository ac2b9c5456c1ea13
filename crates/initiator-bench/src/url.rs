//! iSCSI URLs in libiscsi's form: `iscsi://[user[%secret]@]host[:port]/IQN/LUN`, and
//! `iscsi://host[:port]` for discovery.

use crate::error::{Error, Result};
use crate::portal::portal;

/// The default iSCSI port.
pub const DEFAULT_PORT: u16 = 3260;

/// A parsed iSCSI URL.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct IscsiUrl {
    /// `host:port` to connect to (IPv6 hosts keep their brackets).
    pub portal: String,
    /// The target name, absent for a discovery URL.
    pub target: Option<String>,
    /// The LUN (0 when absent).
    pub lun: u16,
    /// CHAP user, if given.
    pub user: Option<String>,
    /// CHAP secret, if given.
    pub secret: Option<String>,
}

impl IscsiUrl {
    /// Parses a URL.
    pub fn parse(url: &str) -> Result<IscsiUrl> {
        let bad = |reason| Error::Url {
            url: url.into(),
            reason,
        };
        let rest = url
            .strip_prefix("iscsi://")
            .ok_or_else(|| bad("must start with iscsi://"))?;
        let (auth, rest) = match rest.rsplit_once('@') {
            Some((a, r)) if !a.contains('/') => (Some(a), r),
            _ => (None, rest),
        };
        let (user, secret) = match auth {
            Some(a) => match a.split_once('%') {
                Some((u, s)) => (Some(u.to_string()), Some(s.to_string())),
                None => (Some(a.to_string()), None),
            },
            None => (None, None),
        };
        let mut parts = rest.splitn(3, '/');
        let host = parts
            .next()
            .filter(|h| !h.is_empty())
            .ok_or_else(|| bad("no host"))?;
        let portal = portal(host, DEFAULT_PORT).map_err(bad)?;
        let target = parts.next().filter(|t| !t.is_empty()).map(str::to_string);
        let lun = match parts.next().filter(|l| !l.is_empty()) {
            Some(l) => l
                .parse()
                .map_err(|_| bad("LUN is not a number from 0 to 65535"))?,
            None => 0,
        };
        Ok(IscsiUrl {
            portal,
            target,
            lun,
            user,
            secret,
        })
    }
}

impl std::fmt::Display for IscsiUrl {
    /// The URL without the secret.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "iscsi://")?;
        if let Some(u) = &self.user {
            write!(f, "{u}@")?;
        }
        write!(f, "{}", self.portal)?;
        if let Some(t) = &self.target {
            write!(f, "/{t}/{}", self.lun)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_libiscsi_urls() {
        let u =
            IscsiUrl::parse("iscsi://user%secret123456@10.0.0.1:3261/iqn.2026-11.io.example:d/3")
                .unwrap();
        assert_eq!(u.portal, "10.0.0.1:3261");
        assert_eq!(u.target.as_deref(), Some("iqn.2026-11.io.example:d"));
        assert_eq!(u.lun, 3);
        assert_eq!(u.user.as_deref(), Some("user"));
        assert_eq!(u.secret.as_deref(), Some("secret123456"));
        assert_eq!(
            u.to_string(),
            "iscsi://user@10.0.0.1:3261/iqn.2026-11.io.example:d/3"
        );

        let u = IscsiUrl::parse("iscsi://127.0.0.1").unwrap();
        assert_eq!(u.portal, "127.0.0.1:3260");
        assert_eq!(u.target, None);
        let u = IscsiUrl::parse("iscsi://[::1]/iqn.2026-11.x:y/0").unwrap();
        assert_eq!(u.portal, "[::1]:3260");
        let u = IscsiUrl::parse("iscsi://[::1]:3261/iqn.2026-11.x:y").unwrap();
        assert_eq!((u.portal.as_str(), u.lun), ("[::1]:3261", 0));

        for bad in [
            "http://x",
            "iscsi://",
            "iscsi://h:port/t/0",
            "iscsi://h/t/lun",
            "iscsi://[::1/t/0",
        ] {
            assert!(IscsiUrl::parse(bad).is_err(), "{bad}");
        }
    }
}
