//! Byte sizes on the command line (`5GB`, `5GiB`, `500MB`, `1048576`) and in messages.
//!
//! Error messages print sizes with [`human`], so this module sits below the error type and
//! names none of the crate: a size that does not parse comes back as a [`BadSize`], which the
//! error module turns into a usage error.

/// Why a size argument was refused; the message is the whole sentence shown to the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BadSize(pub String);

/// Parses `N`, `N{B,KB,MB,GB,TB}` (powers of 1000) or `N{KiB,MiB,GiB,TiB}` (powers of 1024),
/// case-insensitive, fractions allowed (`1.5GiB`). Hugging Face's `max_shard_size` uses the
/// same convention.
pub fn parse_size(s: &str) -> Result<u64, BadSize> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let mult: u64 = match unit.trim().to_ascii_lowercase().as_str() {
        "" | "b" => 1,
        "kb" => 1_000,
        "mb" => 1_000_000,
        "gb" => 1_000_000_000,
        "tb" => 1_000_000_000_000,
        "kib" => 1 << 10,
        "mib" => 1 << 20,
        "gib" => 1 << 30,
        "tib" => 1 << 40,
        _ => return Err(bad_size(s)),
    };
    let value = if num.contains('.') {
        let f: f64 = num.parse().map_err(|_| bad_size(s))?;
        (f * mult as f64).round() as u64
    } else {
        num.parse::<u64>()
            .ok()
            .and_then(|n| n.checked_mul(mult))
            .ok_or_else(|| bad_size(s))?
    };
    if value == 0 {
        return Err(BadSize(format!("size `{s}` must be larger than zero")));
    }
    Ok(value)
}

fn bad_size(s: &str) -> BadSize {
    BadSize(format!(
        "invalid size `{s}`: use bytes or a number with B, KB, MB, GB, TB (powers of 1000) or KiB, MiB, GiB, TiB"
    ))
}

/// Human-readable binary size: `1.50 GiB`.
pub fn human(bytes: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes as f64;
    let mut u = 0;
    while v >= 1024.0 && u + 1 < UNITS.len() {
        v /= 1024.0;
        u += 1;
    }
    if u == 0 {
        format!("{bytes} B")
    } else {
        format!("{v:.2} {}", UNITS[u])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_decimal_binary_and_plain() {
        assert_eq!(parse_size("5GB").unwrap(), 5_000_000_000);
        assert_eq!(parse_size("5GiB").unwrap(), 5 << 30);
        assert_eq!(parse_size("500MB").unwrap(), 500_000_000);
        assert_eq!(parse_size("256mib").unwrap(), 256 << 20);
        assert_eq!(parse_size("1048576").unwrap(), 1 << 20);
        assert_eq!(parse_size("1.5GiB").unwrap(), 3 << 29);
        assert!(parse_size("5XB").is_err());
        assert!(parse_size("0").is_err());
        assert!(parse_size("99999999999TB").is_err());
    }

    #[test]
    fn human_sizes() {
        assert_eq!(human(512), "512 B");
        assert_eq!(human(3 << 29), "1.50 GiB");
    }
}
