//! Where a URL's host is: `host:port`, as iSCSI's and NVMe/TCP's URLs both name it. A leaf:
//! the URL parsers of both protocols use it, and it uses nothing of the crate.

/// `host` (a name, an IPv4 address, or an IPv6 address in brackets) as `host:port`, with
/// `default_port` when it names none; why not, when its port is not a number or its brackets
/// are not closed. iSCSI's and NVMe/TCP's URLs name their hosts alike.
pub fn portal(host: &str, default_port: u16) -> std::result::Result<String, &'static str> {
    if host.starts_with('[') {
        return match host.rfind("]:") {
            Some(at) => {
                host[at + 2..]
                    .parse::<u16>()
                    .map_err(|_| "port is not a number")?;
                Ok(host.to_string())
            }
            None if host.ends_with(']') => Ok(format!("{host}:{default_port}")),
            None => Err("unterminated IPv6 address"),
        };
    }
    match host.rsplit_once(':') {
        Some((_, port)) => {
            port.parse::<u16>().map_err(|_| "port is not a number")?;
            Ok(host.to_string())
        }
        None => Ok(format!("{host}:{default_port}")),
    }
}

#[cfg(test)]
mod tests {
    use super::portal;

    #[test]
    fn a_portal_takes_the_default_port_only_when_it_names_none() {
        assert_eq!(portal("192.0.2.1", 4420).unwrap(), "192.0.2.1:4420");
        assert_eq!(portal("192.0.2.1:8009", 4420).unwrap(), "192.0.2.1:8009");
        assert_eq!(portal("[::1]", 8009).unwrap(), "[::1]:8009");
        assert_eq!(portal("[::1]:4421", 8009).unwrap(), "[::1]:4421");
        assert_eq!(portal("host:x", 1), Err("port is not a number"));
        assert_eq!(portal("[::1]:x", 1), Err("port is not a number"));
        assert_eq!(portal("[::1", 1), Err("unterminated IPv6 address"));
    }
}
