//! Sizes on the command line: digits with an optional binary suffix.

/// Parses `65536`, `64K`, `512M`, `4G` or `1T` (K = 2^10, case-insensitive) into bytes.
pub(crate) fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (num, mult) = match t.char_indices().last() {
        Some((i, c)) if c.is_ascii_alphabetic() => {
            let m: u64 = match c.to_ascii_uppercase() {
                'K' => 1 << 10,
                'M' => 1 << 20,
                'G' => 1 << 30,
                'T' => 1 << 40,
                _ => {
                    return Err(format!(
                        "{s:?}: unknown size suffix {c:?} (expected K, M, G or T)"
                    ))
                }
            };
            (&t[..i], m)
        }
        _ => (t, 1),
    };
    let n: u64 = num.parse().map_err(|_| {
        format!("{s:?} is not a size: digits with an optional K, M, G or T suffix, e.g. 64K")
    })?;
    n.checked_mul(mult)
        .ok_or_else(|| format!("{s:?} is too large"))
}

/// [`parse_size`] within `min..=max` bytes.
pub(crate) fn parse_size_in(s: &str, min: u64, max: u64) -> Result<u64, String> {
    let v = parse_size(s)?;
    if v < min || v > max {
        return Err(format!("size {s} out of range: {min} to {max} bytes"));
    }
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_parse_with_binary_suffixes() {
        assert_eq!(parse_size("65536"), Ok(65536));
        assert_eq!(parse_size("8"), Ok(8));
        assert_eq!(parse_size("1K"), Ok(1024));
        assert_eq!(parse_size("64k"), Ok(65536));
        assert_eq!(parse_size(" 512M "), Ok(512 << 20));
        assert_eq!(parse_size("4g"), Ok(4 << 30));
        assert_eq!(parse_size("1T"), Ok(1 << 40));
        assert!(parse_size("12Q").unwrap_err().contains("suffix"));
        assert!(parse_size("M").is_err());
        assert!(parse_size("-1").is_err());
        assert!(parse_size("x").is_err());
        assert!(parse_size("").is_err());
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .contains("too large"));
    }

    #[test]
    fn ranges_are_checked() {
        assert_eq!(parse_size_in("1K", 1, 1 << 30), Ok(1024));
        assert!(parse_size_in("0", 1, 1 << 30).is_err());
        assert!(parse_size_in("2G", 1, 1 << 30).is_err());
    }
}
