//! One grammar for the sizes and durations people write in targetd's config, targetctl's
//! arguments and initiator-bench's options, so that `1G` is the same number everywhere.
//!
//! Sizes: a number, optionally with a fraction, then a unit, case-insensitive, spaces allowed
//! between: none or `B` (bytes); `K`, `KiB`, `M`, `MiB`, `G`, `GiB`, `T`, `TiB` (powers of
//! 1024, as dd and fio read `4k`); `KB`, `MB`, `GB`, `TB` (powers of 1000, as the SI and dd
//! read them). A fraction must come out in whole bytes: `1.5GiB` is 1610612736, `1.5B` is
//! refused.
//!
//! Durations: a bare number is seconds (what the config's keys always took); otherwise one or
//! more `<number><unit>` parts, `ns`, `us` (or `µs`), `ms`, `s`, `m` (or `min`), `h`, `d`,
//! added up: `30s`, `1h30m`, `1.5s`, `250us`.
#![forbid(unsafe_code)]

use std::time::Duration;

/// A size in bytes as people write it and [`parse_size`] reads it back: whole KiB, MiB, GiB
/// or TiB when exact (`64 MiB`), else with one decimal (`1.5 GiB`, rounded), or bytes.
pub fn format_size(n: u64) -> String {
    const UNITS: [(&str, u64); 4] = [
        ("TiB", 1 << 40),
        ("GiB", 1 << 30),
        ("MiB", 1 << 20),
        ("KiB", 1 << 10),
    ];
    for (unit, size) in UNITS {
        if n >= size {
            return if n % size == 0 {
                format!("{} {unit}", n / size)
            } else {
                format!("{:.1} {unit}", n as f64 / size as f64)
            };
        }
    }
    format!("{n} B")
}

/// A duration as [`parse_duration`] reads it back, in the largest whole units: `1d2h3m4s`,
/// `45s`, `0s`; below a second `250ms`, `80us` or `12ns`. Whole seconds drop the rest.
pub fn format_duration(d: Duration) -> String {
    let s = d.as_secs();
    if s == 0 {
        let n = d.subsec_nanos();
        return match n {
            0 => "0s".into(),
            n if n % 1_000_000 == 0 || n >= 10_000_000 => format!("{}ms", n / 1_000_000),
            n if n % 1_000 == 0 || n >= 10_000 => format!("{}us", n / 1_000),
            n => format!("{n}ns"),
        };
    }
    let mut out = String::new();
    let parts = [
        (s / 86400, "d"),
        (s % 86400 / 3600, "h"),
        (s % 3600 / 60, "m"),
        (s % 60, "s"),
    ];
    for (n, unit) in parts {
        if n > 0 {
            out += &format!("{n}{unit}");
        }
    }
    out
}

/// Parses a size in bytes; the error says what was wrong, with an example.
pub fn parse_size(text: &str) -> Result<u64, String> {
    let t = text.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let unit = unit.trim();
    let bad = || format!("{text:?} is not a size (e.g. 4096, 4k, 64MiB, 1.5GiB, 10GB)");
    if number.is_empty() {
        return Err(bad());
    }
    let multiplier: u64 = match unit.to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "k" | "kib" => 1 << 10,
        "m" | "mib" => 1 << 20,
        "g" | "gib" => 1 << 30,
        "t" | "tib" => 1 << 40,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        _ => {
            return Err(format!(
                "{text:?}: unknown size unit {unit:?} (B, K or KiB, M or MiB, G or GiB, T or \
                 TiB are powers of 1024; KB, MB, GB, TB powers of 1000)"
            ))
        }
    };
    let (whole, fraction) = number.split_once('.').unwrap_or((number, ""));
    let whole: u64 = if whole.is_empty() {
        0
    } else {
        whole.parse().map_err(|_| bad())?
    };
    if fraction.contains('.') || (whole == 0 && fraction.is_empty() && number.contains('.')) {
        return Err(bad());
    }
    let too_large = || format!("{text:?} is too large");
    let mut bytes = whole.checked_mul(multiplier).ok_or_else(too_large)?;
    if !fraction.is_empty() {
        // fraction / 10^len of the unit, in whole bytes only.
        let digits = u32::try_from(fraction.len()).map_err(|_| bad())?;
        let scale = 10u128.checked_pow(digits).ok_or_else(bad)?;
        let f: u128 = fraction.parse().map_err(|_| bad())?;
        let part = f * u128::from(multiplier);
        if part % scale != 0 {
            return Err(format!("{text:?} is not a whole number of bytes"));
        }
        let part = u64::try_from(part / scale).map_err(|_| too_large())?;
        bytes = bytes.checked_add(part).ok_or_else(too_large)?;
    }
    Ok(bytes)
}

/// Parses a duration; the error says what was wrong, with an example.
pub fn parse_duration(text: &str) -> Result<Duration, String> {
    let t = text.trim();
    let bad = || format!("{text:?} is not a duration (e.g. 30, 30s, 1h30m, 1.5s, 250ms)");
    if t.is_empty() {
        return Err(bad());
    }
    if let Ok(seconds) = t.parse::<u64>() {
        return Ok(Duration::from_secs(seconds));
    }
    let mut total = 0f64;
    let mut rest = t;
    while !rest.is_empty() {
        let split = rest
            .find(|c: char| !(c.is_ascii_digit() || c == '.'))
            .unwrap_or(rest.len());
        let (number, after) = rest.split_at(split);
        let end = after
            .find(|c: char| c.is_ascii_digit() || c == '.')
            .unwrap_or(after.len());
        let (unit, next) = after.split_at(end);
        let value: f64 = number.parse().map_err(|_| bad())?;
        let seconds = match unit.trim() {
            "ns" => 1e-9,
            "us" | "µs" => 1e-6,
            "ms" => 1e-3,
            "s" => 1.0,
            "m" | "min" => 60.0,
            "h" => 3600.0,
            "d" => 86400.0,
            "" => {
                return Err(format!(
                    "{text:?}: a number without a unit after another part"
                ))
            }
            u => {
                return Err(format!(
                    "{text:?}: unknown unit {u:?} (ns, us, ms, s, m, h, d)"
                ))
            }
        };
        total += value * seconds;
        rest = next.trim_start();
    }
    if !total.is_finite() || total < 0.0 || total > u64::MAX as f64 {
        return Err(bad());
    }
    Ok(Duration::from_secs_f64(total))
}

/// Parses a duration that must be whole seconds (the config's timeouts): `30`, `30s`,
/// `1h30m`; `1.5s` is refused.
pub fn parse_seconds(text: &str) -> Result<u64, String> {
    let d = parse_duration(text)?;
    if d.subsec_nanos() != 0 {
        return Err(format!("{text:?}: whole seconds only"));
    }
    Ok(d.as_secs())
}

/// serde helpers for config keys that take a number or this grammar's text.
pub mod serde {
    use serde::de::{Deserializer, Error};
    use serde::Deserialize;

    #[derive(Deserialize)]
    #[serde(untagged)]
    enum Raw {
        Number(u64),
        Text(String),
    }

    /// Seconds: a number, or a duration in whole seconds (`"30s"`, `"2m"`).
    pub fn seconds<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(n),
            Raw::Text(t) => super::parse_seconds(&t).map_err(D::Error::custom),
        }
    }

    /// As [`seconds`], for a key that may be absent.
    pub fn optional_seconds<'de, D: Deserializer<'de>>(d: D) -> Result<Option<u64>, D::Error> {
        seconds(d).map(Some)
    }

    /// Bytes: a number, or a size (`"64MiB"`).
    pub fn bytes<'de, D: Deserializer<'de>>(d: D) -> Result<u64, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(n),
            Raw::Text(t) => super::parse_size(&t).map_err(D::Error::custom),
        }
    }

    /// A duration that may be shorter than a second: a number of seconds, or a duration
    /// (`"500ms"`, `"1.5s"`).
    pub fn duration<'de, D: Deserializer<'de>>(d: D) -> Result<std::time::Duration, D::Error> {
        match Raw::deserialize(d)? {
            Raw::Number(n) => Ok(std::time::Duration::from_secs(n)),
            Raw::Text(t) => super::parse_duration(&t).map_err(D::Error::custom),
        }
    }

    /// Writes a duration as [`duration`] reads it (`"500ms"`).
    pub fn write_duration<S: serde::Serializer>(
        d: &std::time::Duration,
        s: S,
    ) -> Result<S::Ok, S::Error> {
        s.serialize_str(&super::format_duration(*d))
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations_format_as_they_parse() {
        for (d, text) in [
            (Duration::ZERO, "0s"),
            (Duration::from_secs(45), "45s"),
            (Duration::from_secs(3600), "1h"),
            (Duration::from_secs(93784), "1d2h3m4s"),
            (Duration::from_millis(250), "250ms"),
            (Duration::from_micros(80), "80us"),
            (Duration::from_nanos(12), "12ns"),
        ] {
            assert_eq!(format_duration(d), text);
            assert_eq!(parse_duration(text), Ok(d), "{text}");
        }
    }

    #[test]
    fn exact_sizes_are_written_as_they_read_back() {
        for n in [0, 512, 4096, 64 << 20, 1 << 30, 3 << 40] {
            assert_eq!(super::parse_size(&super::format_size(n)), Ok(n), "{n}");
        }
        assert_eq!(super::format_size(1536 << 20), "1.5 GiB");
        assert_eq!(super::format_size(1000), "1000 B");
    }

    use super::*;

    #[test]
    fn sizes_have_one_meaning() {
        for (text, bytes) in [
            ("4096", 4096),
            ("512B", 512),
            ("4k", 4096),
            ("4K", 4096),
            ("4KiB", 4096),
            ("4 KiB", 4096),
            ("64MiB", 64 << 20),
            ("64m", 64 << 20),
            ("1G", 1 << 30),
            ("1gib", 1 << 30),
            ("1.5GiB", 3 << 29),
            ("2T", 2 << 40),
            ("10GB", 10_000_000_000),
            ("1gb", 1_000_000_000),
            ("3kB", 3000),
            ("0.5k", 512),
            (".5k", 512),
        ] {
            assert_eq!(parse_size(text), Ok(bytes), "{text}");
        }
        for bad in [
            "",
            "k",
            "1.5",
            "1.5B",
            "1.2.3k",
            "1x",
            "-1",
            "99999999999T",
            "1.0001k",
        ] {
            let e = parse_size(bad).expect_err(bad);
            assert!(e.contains(&format!("{bad:?}")), "{bad}: {e}");
        }
    }

    #[test]
    fn durations_have_one_meaning() {
        for (text, d) in [
            ("30", Duration::from_secs(30)),
            ("30s", Duration::from_secs(30)),
            ("1h30m", Duration::from_secs(5400)),
            ("1h 30m", Duration::from_secs(5400)),
            ("2min", Duration::from_secs(120)),
            ("1.5s", Duration::from_millis(1500)),
            ("250ms", Duration::from_millis(250)),
            ("16ms", Duration::from_millis(16)),
            ("250us", Duration::from_micros(250)),
            ("0", Duration::ZERO),
            ("1d", Duration::from_secs(86400)),
        ] {
            assert_eq!(parse_duration(text), Ok(d), "{text}");
        }
        for bad in ["", "s", "10x", "1h30", "-1s", "abc"] {
            assert!(parse_duration(bad).is_err(), "{bad}");
        }
        assert_eq!(parse_seconds("2m"), Ok(120));
        assert!(parse_seconds("1.5s").unwrap_err().contains("whole seconds"));
    }

    #[test]
    fn config_keys_take_numbers_or_text() {
        #[derive(::serde::Deserialize)]
        struct K {
            #[serde(deserialize_with = "crate::serde::seconds")]
            t: u64,
            #[serde(deserialize_with = "crate::serde::bytes")]
            b: u64,
            #[serde(default, deserialize_with = "crate::serde::optional_seconds")]
            o: Option<u64>,
        }
        let k: K = toml::from_str("t = \"1m\"\nb = \"4k\"\no = 5").unwrap();
        assert_eq!((k.t, k.b, k.o), (60, 4096, Some(5)));
        let k: K = toml::from_str("t = 30\nb = 512").unwrap();
        assert_eq!((k.t, k.b, k.o), (30, 512, None));
        let e = toml::from_str::<K>("t = \"1.5s\"\nb = 1").err().unwrap();
        assert!(e.to_string().contains("whole seconds"), "{e}");
    }
}
