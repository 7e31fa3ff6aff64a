//! Benchmark helpers: the field's report columns (fabtests style).

/// One measured row.
#[derive(Debug, Clone)]
pub struct Row {
    /// What was measured.
    pub name: String,
    /// Bytes per transfer.
    pub bytes: u64,
    /// Transfers.
    pub iters: u64,
    /// Seconds.
    pub secs: f64,
}

impl Row {
    /// MB/sec with MB = 10^6 bytes.
    pub fn mb_per_sec(&self) -> f64 {
        (self.bytes * self.iters) as f64 / self.secs / 1e6
    }
    /// Microseconds per transfer.
    pub fn usec_per_xfer(&self) -> f64 {
        self.secs * 1e6 / self.iters as f64
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
            r.bytes * r.iters,
            r.secs,
            r.mb_per_sec(),
            r.usec_per_xfer(),
            r.iters as f64 / r.secs / 1e6
        );
    }
}
