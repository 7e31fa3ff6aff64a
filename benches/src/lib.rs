//! Benchmark helpers: the field's report columns (fabtests style), the JSON rows of
//! `fabric perf`, and the plots of `scripts/bench` (see the `fabric-plot` binary).

/// One measured row.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// The test, in `fabric perf`'s words: `pingpong`, `bw` or `lat`.
    pub test: String,
    /// The operation: `send`, `write`, ...
    pub op: String,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Iterations.
    pub iters: u64,
    /// Transfers per iteration (2 in a ping-pong: there and back).
    pub xfers_per_iter: u64,
    /// Seconds.
    pub secs: f64,
}

impl Row {
    /// A row of one transfer per iteration.
    pub fn new(name: impl Into<String>, bytes: u64, iters: u64, secs: f64) -> Row {
        Row {
            name: name.into(),
            test: "bw".into(),
            op: "send".into(),
            bytes,
            iters,
            xfers_per_iter: 1,
            secs,
        }
    }
    /// Bytes moved: bytes x iters x transfers per iteration.
    pub fn total(&self) -> u64 {
        self.bytes * self.iters * self.xfers_per_iter
    }
    /// MB/sec with MB = 10^6 bytes.
    pub fn mb_per_sec(&self) -> f64 {
        self.total() as f64 / self.secs / 1e6
    }
    /// Microseconds per transfer (one-way in a ping-pong).
    pub fn usec_per_xfer(&self) -> f64 {
        self.secs * 1e6 / (self.iters * self.xfers_per_iter) as f64
    }
    /// Millions of transfers per second.
    pub fn mxfers_per_sec(&self) -> f64 {
        (self.iters * self.xfers_per_iter) as f64 / self.secs / 1e6
    }
}

/// Prints rows with the columns bytes, iters, total, time, MB/sec, usec/xfer, Mxfers/sec.
pub fn print(rows: &[Row]) {
    println!("MB = 10^6 bytes");
    println!(
        "{:<34} {:>9} {:>8} {:>12} {:>9} {:>10} {:>10} {:>11}",
        "name", "bytes", "iters", "total", "time", "MB/sec", "usec/xfer", "Mxfers/sec"
    );
    for r in rows {
        println!(
            "{:<34} {:>9} {:>8} {:>12} {:>8.3}s {:>10.2} {:>10.2} {:>11.4}",
            r.name,
            r.bytes,
            r.iters,
            r.total(),
            r.secs,
            r.mb_per_sec(),
            r.usec_per_xfer(),
            r.mxfers_per_sec()
        );
    }
}

/// The rows as `fabric perf --format json` prints them.
pub fn rows_json(provider: &str, rows: &[Row]) -> serde_json::Value {
    serde_json::json!({
        "provider": provider,
        "rows": rows.iter().map(|r| serde_json::json!({
            "test": r.test,
            "op": r.op,
            "bytes": r.bytes,
            "iters": r.iters,
            "total": r.total(),
            "secs": r.secs,
            "mb_per_sec": r.mb_per_sec(),
            "usec_per_xfer": r.usec_per_xfer(),
            "mxfers_per_sec": r.mxfers_per_sec(),
        })).collect::<Vec<_>>(),
    })
}

/// Parses a size: digits with an optional K, M or G suffix (K = 1024).
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let (digits, mult) = match t.char_indices().last() {
        Some((i, 'k' | 'K')) => (&t[..i], 1u64 << 10),
        Some((i, 'm' | 'M')) => (&t[..i], 1 << 20),
        Some((i, 'g' | 'G')) => (&t[..i], 1 << 30),
        _ => (t, 1),
    };
    digits
        .parse::<u64>()
        .ok()
        .and_then(|n| n.checked_mul(mult))
        .filter(|&v| v > 0)
        .ok_or_else(|| format!("{s:?} is not a size (digits with an optional K, M or G suffix)"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ping_pong_rows_count_both_directions() {
        let mut r = Row::new("x", 8, 1000, 0.02);
        r.xfers_per_iter = 2;
        assert_eq!(r.total(), 16_000);
        assert!((r.usec_per_xfer() - 10.0).abs() < 1e-9);
        assert_eq!(parse_size("64K"), Ok(65536));
        assert!(parse_size("K").is_err());
    }
}
