//! Raw TCP anchors for `scripts/bench`, measured the way `fabric perf` measures and printed
//! in the same columns and JSON (`provider` = `raw-tcp`).
//!
//! * `pingpong`: two threads on loopback, `TCP_NODELAY`, non-blocking sockets busy-polled
//!   (`recv` / `send` retried on `EWOULDBLOCK` without yielding, as fi_pingpong polls its
//!   completion queue); usec/xfer is one-way: half a round trip.
//! * `stream`: one thread writes `iters` messages of `size` bytes with blocking `write_all`,
//!   the other reads them; the time runs until the reader's one-byte acknowledgement.
//!   Both kinds first run a tenth of the iterations (at most 1000) untimed, as `fabric
//!   perf` does; the stream's clock starts once the reader has them all.
//!
//! * `--cpus A,B` pins the first side (the timing thread) to CPU A and the other to CPU B,
//!   as `scripts/bench` pins the two processes of `fabric perf` and of fi_pingpong.
//!
//! ```text
//! fabric-raw pingpong|stream [--sizes 8,64,1K] [--iters N] [--cpus A,B] [--format text|json]
//! ```

use std::io::{ErrorKind, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::time::Instant;

use fabric_benches::{parse_size, Row};

fn usage() -> ! {
    eprintln!(
        "usage: fabric-raw pingpong|stream [--sizes 8,64,1K] [--iters N] [--cpus A,B] [--format text|json]"
    );
    std::process::exit(2)
}

fn main() {
    let mut args = std::env::args().skip(1);
    let test = args.next().unwrap_or_else(|| usage());
    let (mut sizes, mut iters, mut json) = (vec![8u64], None::<u64>, false);
    let mut cpus = None::<[usize; 2]>;
    while let Some(a) = args.next() {
        let v = args.next().unwrap_or_else(|| usage());
        match a.as_str() {
            "--sizes" | "--size" => {
                sizes = v
                    .split(',')
                    .map(|s| {
                        parse_size(s).unwrap_or_else(|e| {
                            eprintln!("fabric-raw: {e}");
                            std::process::exit(2)
                        })
                    })
                    .collect()
            }
            "--iters" => iters = Some(v.parse().unwrap_or_else(|_| usage())),
            "--format" => json = v == "json",
            "--cpus" => {
                let c: Vec<usize> = v
                    .split(',')
                    .map(|c| c.parse().unwrap_or_else(|_| usage()))
                    .collect();
                cpus = Some(c.try_into().unwrap_or_else(|_| usage()));
            }
            _ => usage(),
        }
    }
    let rows: Vec<Row> = sizes
        .iter()
        .map(|&size| {
            let n = iters.unwrap_or(if size <= 16 << 10 { 5000 } else { 500 });
            match test.as_str() {
                "pingpong" => pingpong(size as usize, n, cpus),
                "stream" => stream(size as usize, n, cpus),
                _ => usage(),
            }
        })
        .collect();
    if json {
        println!("{}", fabric_benches::rows_json("raw-tcp", &rows));
    } else {
        fabric_benches::print(&rows);
    }
}

/// Pins the calling thread to `cpu` (`None`: leaves it where it is); exits with a message
/// if the kernel refuses (a CPU that does not exist or is not allowed here).
fn pin(cpu: Option<usize>) {
    let Some(cpu) = cpu else { return };
    // SAFETY: `cpu_set_t` is plain bits, for which all zeroes is the empty set.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    if cpu >= 8 * std::mem::size_of::<libc::cpu_set_t>() {
        eprintln!("fabric-raw: no CPU {cpu}");
        std::process::exit(2);
    }
    // SAFETY: `cpu` is below the set's size in bits (checked above).
    unsafe { libc::CPU_SET(cpu, &mut set) };
    // SAFETY: pid 0 names the calling thread; the set is initialised and its size passed.
    let rc = unsafe { libc::sched_setaffinity(0, std::mem::size_of_val(&set), &set) };
    if rc != 0 {
        eprintln!(
            "fabric-raw: cannot pin to CPU {cpu}: {}",
            std::io::Error::last_os_error()
        );
        std::process::exit(2);
    }
}

fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").expect("bind");
    let a = TcpStream::connect(l.local_addr().expect("addr")).expect("connect");
    let (b, _) = l.accept().expect("accept");
    for s in [&a, &b] {
        s.set_nodelay(true).expect("nodelay");
    }
    (a, b)
}

/// Reads exactly `buf.len()` bytes from a non-blocking socket, spinning.
fn spin_read(s: &mut TcpStream, buf: &mut [u8]) {
    let mut got = 0;
    while got < buf.len() {
        match s.read(&mut buf[got..]) {
            Ok(0) => panic!("peer closed"),
            Ok(n) => got += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("read: {e}"),
        }
    }
}

/// Writes all of `buf` to a non-blocking socket, spinning.
fn spin_write(s: &mut TcpStream, buf: &[u8]) {
    let mut put = 0;
    while put < buf.len() {
        match s.write(&buf[put..]) {
            Ok(n) => put += n,
            Err(e) if e.kind() == ErrorKind::WouldBlock => std::hint::spin_loop(),
            Err(e) => panic!("write: {e}"),
        }
    }
}

fn pingpong(size: usize, n: u64, cpus: Option<[usize; 2]>) -> Row {
    let (mut a, mut b) = pair();
    a.set_nonblocking(true).expect("nonblocking");
    b.set_nonblocking(true).expect("nonblocking");
    let warmup = (n / 10).min(1000);
    let echo = std::thread::spawn(move || {
        pin(cpus.map(|c| c[1]));
        let mut buf = vec![0u8; size];
        for _ in 0..warmup + n {
            spin_read(&mut b, &mut buf);
            spin_write(&mut b, &buf);
        }
    });
    pin(cpus.map(|c| c[0]));
    let mut buf = vec![7u8; size];
    let mut t = Instant::now();
    for i in 0..warmup + n {
        if i == warmup {
            t = Instant::now();
        }
        spin_write(&mut a, &buf);
        spin_read(&mut a, &mut buf);
    }
    let secs = t.elapsed().as_secs_f64();
    echo.join().expect("echo thread");
    Row {
        name: "raw TCP ping-pong (busy poll)".into(),
        test: "pingpong".into(),
        op: "send".into(),
        bytes: size as u64,
        iters: n,
        xfers_per_iter: 2,
        secs,
    }
}

fn stream(size: usize, n: u64, cpus: Option<[usize; 2]>) -> Row {
    let (mut a, mut b) = pair();
    // As `fabric perf bw` (and the ping-pong above): a tenth of the run, at most 1000
    // messages, goes first untimed, so that both measure the connection's steady state
    // (its windows grown) rather than its start.
    let warmup = (n / 10).min(1000);
    let rx = std::thread::spawn(move || {
        pin(cpus.map(|c| c[1]));
        let mut buf = vec![0u8; size];
        for i in 0..warmup + n {
            b.read_exact(&mut buf).expect("read");
            if i + 1 == warmup {
                b.write_all(&[0]).expect("warmup ack");
            }
        }
        b.write_all(&[1]).expect("ack");
    });
    pin(cpus.map(|c| c[0]));
    let buf = vec![7u8; size];
    for _ in 0..warmup {
        a.write_all(&buf).expect("write");
    }
    if warmup > 0 {
        // The clock starts with nothing in flight.
        a.read_exact(&mut [0u8]).expect("warmup ack");
    }
    let t = Instant::now();
    for _ in 0..n {
        a.write_all(&buf).expect("write");
    }
    a.read_exact(&mut [0u8]).expect("ack");
    let secs = t.elapsed().as_secs_f64();
    rx.join().expect("reader thread");
    Row {
        name: "raw TCP stream".into(),
        test: "bw".into(),
        op: "send".into(),
        bytes: size as u64,
        iters: n,
        xfers_per_iter: 1,
        secs,
    }
}
