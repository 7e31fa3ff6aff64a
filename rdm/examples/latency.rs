//! Tagged messages against the provider's own send/receive, in one process over loopback:
//! one-way latency (half the mean round trip of a ping-pong, both sides busy-polling) and
//! large-message round trips, printed in fabtests' style (usec one-way; MB = 10^6 bytes).
//!
//! `cargo run --release -p fabric-rdm --example latency [-- PROVIDER [ITERS [ROUNDS]]]`

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric_rdm::{RdmCompletion, RdmConfig, RdmEndpoint, RecvBuf, Source};

fn open(provider: &str) -> fabric::Result<Arc<AnyDomain>> {
    Ok(Arc::new(
        fabric::Selector::new().providers(provider)?.open()?.0,
    ))
}

/// Ping-pong of `len` bytes over the provider's connected endpoints; returns usec one-way.
fn raw(provider: &str, len: usize, iters: usize) -> fabric::Result<f64> {
    let (da, db) = (open(provider)?, open(provider)?);
    let (cqa, cqb) = (da.create_cq(64)?, db.create_cq(64)?);
    let l = db.listen("127.0.0.1:0".parse().expect("addr"))?;
    let addr = l.local_addr();
    let b = std::thread::scope(|s| {
        let h = s.spawn(|| l.accept(&EndpointConfig::new(&cqb), Duration::from_secs(10)));
        let a = da.connect(addr, &EndpointConfig::new(&cqa));
        (a, h.join().expect("accept thread"))
    });
    let (a, b) = (b.0?, b.1?);
    let (ma, mb) = (
        da.alloc(len.max(1), Access::LOCAL_WRITE)?,
        db.alloc(len.max(1), Access::LOCAL_WRITE)?,
    );
    let (sa, sb) = (ma.slice(0..len)?, mb.slice(0..len)?);
    // Both sides busy-poll, as two processes would (here one thread polls both, the
    // waiting side first): waits for receive completion `want` on `cq`; send completions
    // (contexts 1 and 2) are counted as they come, not waited for: a send completes once
    // the peer acknowledged it, and tcp's delivery acks ride on the peer's next message.
    let spin = |cq: &AnyCq,
                other: &AnyCq,
                stash: &mut Vec<Completion>,
                sent: &mut usize,
                want: u64|
     -> fabric::Result<()> {
        loop {
            cq.poll(stash, 4)?;
            other.poll(stash, 4)?;
            let mut found = false;
            for c in stash.drain(..) {
                assert!(c.is_ok(), "{c:?}");
                if c.context == want {
                    found = true;
                } else {
                    *sent += 1;
                }
            }
            if found {
                return Ok(());
            }
        }
    };
    let (mut stash, mut sent) = (Vec::new(), 0usize);
    let mut run = |n: usize| -> fabric::Result<Duration> {
        let t = Instant::now();
        for _ in 0..n {
            b.post_recv(&RecvWr::new(10, &[sb]))?;
            a.post_recv(&RecvWr::new(20, &[sa]))?;
            a.post_send(&SendWr::send(1, &[sa]))?;
            spin(&cqb, &cqa, &mut stash, &mut sent, 10)?;
            b.post_send(&SendWr::send(2, &[sb]))?;
            spin(&cqa, &cqb, &mut stash, &mut sent, 20)?;
        }
        let elapsed = t.elapsed();
        // Every send completes (outside the timing).
        while sent < 2 * n {
            cqa.poll(&mut stash, 4)?;
            cqb.poll(&mut stash, 4)?;
            for c in stash.drain(..) {
                assert!(c.is_ok(), "{c:?}");
                sent += 1;
            }
        }
        sent = 0;
        Ok(elapsed)
    };
    run(iters / 10 + 1)?;
    Ok(run(iters)?.as_secs_f64() * 1e6 / iters as f64 / 2.0)
}

/// The same ping-pong with tagged messages over RDM endpoints.
fn tagged(provider: &str, len: usize, iters: usize) -> fabric::Result<f64> {
    let (da, db) = (open(provider)?, open(provider)?);
    let a = RdmEndpoint::new(da.clone(), RdmConfig::default())?;
    let b = RdmEndpoint::new(db.clone(), RdmConfig::default())?;
    let ab = a.av_insert(b.addr());
    let ba = b.av_insert(a.addr());
    let acc = Access::LOCAL_WRITE | Access::REMOTE_READ;
    let (sa, sb) = (da.alloc(len.max(1), acc)?, db.alloc(len.max(1), acc)?);
    let (ra, rb) = (
        Arc::new(da.alloc(len.max(1), acc)?),
        Arc::new(db.alloc(len.max(1), acc)?),
    );
    // As in `raw`: both sides busy-poll, the waiting side first; waits for receive
    // completion `want` on `ep`, counting send completions as they come.
    let until = |ep: &RdmEndpoint,
                 other: &RdmEndpoint,
                 stash: &mut Vec<RdmCompletion>,
                 sent: &mut usize,
                 want: u64|
     -> fabric::Result<()> {
        loop {
            ep.poll(stash)?;
            other.poll(stash)?;
            let mut found = false;
            for c in stash.drain(..) {
                assert!(c.is_ok(), "{c:?}");
                if c.context == want {
                    found = true;
                } else {
                    *sent += 1;
                }
            }
            if found {
                return Ok(());
            }
        }
    };
    let (mut stash, mut sent) = (Vec::new(), 0usize);
    let mut run = |n: usize| -> fabric::Result<Duration> {
        let t = Instant::now();
        for _ in 0..n {
            b.trecv(Source::Peer(ba), 1, 0, RecvBuf::new(rb.clone(), 0, len), 10)?;
            a.trecv(Source::Peer(ab), 2, 0, RecvBuf::new(ra.clone(), 0, len), 20)?;
            a.tsend(ab, 1, sa.slice(0..len)?, 1)?;
            until(&b, &a, &mut stash, &mut sent, 10)?;
            b.tsend(ba, 2, sb.slice(0..len)?, 2)?;
            until(&a, &b, &mut stash, &mut sent, 20)?;
        }
        let elapsed = t.elapsed();
        while sent < 2 * n {
            a.poll(&mut stash)?;
            b.poll(&mut stash)?;
            for c in stash.drain(..) {
                assert!(c.is_ok(), "{c:?}");
                sent += 1;
            }
        }
        sent = 0;
        Ok(elapsed)
    };
    run(iters / 10 + 1)?;
    Ok(run(iters)?.as_secs_f64() * 1e6 / iters as f64 / 2.0)
}

/// The median of `v` (sorted in place).
fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    let m = v.len() / 2;
    if v.len() % 2 == 1 {
        v[m]
    } else {
        (v[m - 1] + v[m]) / 2.0
    }
}

fn main() -> fabric::Result<()> {
    let arg = |i: usize, default: usize| {
        std::env::args()
            .nth(i)
            .and_then(|v| v.parse().ok())
            .unwrap_or(default)
    };
    let provider = std::env::args().nth(1).unwrap_or_else(|| "tcp".into());
    let iters = arg(2, 2000);
    let rounds = arg(3, 5).max(1);
    println!(
        "# {provider}, one process, both sides busy-polling; usec one-way, MB/s = 10^6 B/s; \
         median of {rounds} rounds, send and tagged alternating (the ratio is of the medians)"
    );
    println!(
        "{:>10} {:>8} {:>14} {:>14} {:>8} {:>12}",
        "bytes", "iters", "send (us)", "tagged (us)", "ratio", "tagged MB/s"
    );
    for len in [8usize, 1024, 65536, 1 << 20] {
        let n = if len >= 65536 { iters / 20 + 10 } else { iters };
        // Alternating rounds: a slow spell of a shared machine lands on both sides.
        let (mut r, mut t) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            r.push(raw(&provider, len, n)?);
            t.push(tagged(&provider, len, n)?);
        }
        let (r, t) = (median(&mut r), median(&mut t));
        println!(
            "{len:>10} {n:>8} {r:>14.2} {t:>14.2} {:>7.2}x {:>12.1}",
            t / r,
            len as f64 / t
        );
    }
    Ok(())
}
