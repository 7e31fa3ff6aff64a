//! criterion micro-benchmarks of the API's fixed costs (`cargo bench -p fabric-benches
//! --bench micro`):
//!
//! * `dispatch`: the same tcp completion queue and domain called through the run-time
//!   `Any*` enums and directly through the provider's own types (`fabric_tcp`);
//! * `post_poll`: post one operation on a loopback tcp connection and poll until its
//!   completion (busy polling with `sched_yield`), per operation;
//! * `register`: memory registration (and deregistration on drop) by size;
//! * `cq_poll`: one poll of an empty queue, and one poll of 16 from a queue holding at
//!   least 16 completions.

// `criterion_group!` generates an undocumented public function.
#![allow(missing_docs)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use criterion::{black_box, criterion_group, criterion_main, BenchmarkId, Criterion, Throughput};
use fabric::prelude::*;
use fabric::spi::{CompletionQueue, Domain};
use fabric::Selector;
use fabric_tcp::{TcpDomain, TcpOptions};

fn dispatch(c: &mut Criterion) {
    // One domain and one queue, reached both ways.
    let any = AnyDomain::from(TcpDomain::open(TcpOptions::default()).expect("tcp domain"));
    let AnyDomain::Tcp(direct) = &any else {
        unreachable!("built from a TcpDomain")
    };
    let cq = Domain::create_cq(direct, 64).expect("cq");
    let any_cq = AnyCq::from(cq.clone());
    let buf = Arc::new(Buffer::new(4096));
    let mut g = c.benchmark_group("dispatch");
    let mut out = Vec::with_capacity(16);
    g.bench_function("cq_poll_empty/direct", |b| {
        b.iter(|| black_box(CompletionQueue::poll(&cq, &mut out, 16).expect("poll")))
    });
    g.bench_function("cq_poll_empty/any", |b| {
        b.iter(|| black_box(CqOps::poll(&any_cq, &mut out, 16).expect("poll")))
    });
    g.bench_function("register_4k/direct", |b| {
        b.iter(|| {
            black_box(Domain::register(direct, buf.clone(), Access::LOCAL_WRITE).expect("reg"))
        })
    });
    g.bench_function("register_4k/any", |b| {
        b.iter(|| {
            black_box(DomainOps::register(&any, buf.clone(), Access::LOCAL_WRITE).expect("reg"))
        })
    });
    g.bench_function("info/direct", |b| {
        b.iter(|| black_box(Domain::info(direct).name.len()))
    });
    g.bench_function("info/any", |b| {
        b.iter(|| black_box(DomainOps::info(&any).name.len()))
    });
    g.finish();
}

struct Pair {
    da: AnyDomain,
    db: AnyDomain,
    cqa: AnyCq,
    cqb: AnyCq,
    a: AnyEndpoint,
    b: AnyEndpoint,
}

fn pair() -> Pair {
    let sel = Selector::new().providers("tcp").expect("tcp");
    let (da, _) = sel.open().expect("open");
    let (db, _) = sel.open().expect("open");
    let cqa = da.create_cq(4096).expect("cq");
    let cqb = db.create_cq(4096).expect("cq");
    let l = db
        .listen("127.0.0.1:0".parse().expect("addr"))
        .expect("listen");
    let addr = l.local_addr();
    let (a, b) = std::thread::scope(|s| {
        let h = s.spawn(|| {
            da.connect(addr, &EndpointConfig::new(&cqa))
                .expect("connect")
        });
        let b = l
            .accept(&EndpointConfig::new(&cqb), Duration::from_secs(10))
            .expect("accept");
        (h.join().expect("connect thread"), b)
    });
    Pair {
        da,
        db,
        cqa,
        cqb,
        a,
        b,
    }
}

/// Polls every queue of `want` in turn, all of them every round (yielding when none gave
/// anything), until each gave its count of completions; panics on an error.
///
/// All of them every round, also once one has its count: an application that owns both
/// ends of a send keeps polling both. The receiver's delivery ack, deferred by the poll
/// that placed the message (for the application's next message to that peer to carry),
/// leaves at the receiver's next poll; a loop that waits on the sender's queue alone, or
/// stops polling the receiver's once its completion came, leaves it to the domain's
/// progress thread, which takes over a connection only `HANDOFF` (1 ms) after the
/// application's last poll of it (see the tcp provider's `engine.rs`): the send then
/// measured 1.08 ms an iteration instead of tens of microseconds.
fn reap(want: &mut [(&AnyCq, usize)], out: &mut Vec<Completion>) {
    while want.iter().any(|(_, n)| *n > 0) {
        let mut got = 0;
        for (cq, left) in want.iter_mut() {
            out.clear();
            let n = cq.poll(out, 16).expect("poll");
            for c in out.iter() {
                assert!(c.is_ok(), "{c:?}");
            }
            *left = left.saturating_sub(n);
            got += n;
        }
        if got == 0 {
            std::thread::yield_now();
        }
    }
}

fn post_poll(c: &mut Criterion) {
    let p = pair();
    let src = p.da.alloc(8, Access::LOCAL_WRITE).expect("mr");
    let dst = p.db.alloc(8, Access::all()).expect("mr");
    let rx = p.db.alloc(8, Access::LOCAL_WRITE).expect("mr");
    let remote = dst.desc();
    let mut out = Vec::with_capacity(16);
    let mut g = c.benchmark_group("post_poll_tcp_loopback");
    g.throughput(Throughput::Elements(1));
    let sgl = [src.all()];
    let rsgl = [rx.all()];
    g.bench_function("write_8", |b| {
        b.iter(|| {
            p.a.post_send(&SendWr::write(1, &sgl, remote.at(0)))
                .expect("post");
            reap(&mut [(&p.cqa, 1)], &mut out);
        })
    });
    g.bench_function("read_8", |b| {
        b.iter(|| {
            p.a.post_send(&SendWr::read(1, &sgl, remote.at(0)))
                .expect("post");
            reap(&mut [(&p.cqa, 1)], &mut out);
        })
    });
    g.bench_function("fetch_add", |b| {
        b.iter(|| {
            p.a.post_send(&SendWr::fetch_add(1, src.all(), remote.at(0), 1))
                .expect("post");
            reap(&mut [(&p.cqa, 1)], &mut out);
        })
    });
    g.bench_function("send_8 (receive posted, both completions)", |b| {
        b.iter(|| {
            p.b.post_recv(&RecvWr::new(1, &rsgl)).expect("post_recv");
            p.a.post_send(&SendWr::send(1, &sgl)).expect("post");
            reap(&mut [(&p.cqa, 1), (&p.cqb, 1)], &mut out);
        })
    });
    g.finish();
}

fn register(c: &mut Criterion) {
    let (d, _) = Selector::new()
        .providers("tcp")
        .expect("tcp")
        .open()
        .expect("open");
    let mut g = c.benchmark_group("register_tcp");
    for size in [4usize << 10, 64 << 10, 1 << 20, 16 << 20] {
        let buf = Arc::new(Buffer::new(size));
        g.bench_with_input(BenchmarkId::from_parameter(size), &size, |b, _| {
            b.iter(|| black_box(d.register(buf.clone(), Access::all()).expect("register")))
        });
    }
    g.finish();
}

fn cq_poll(c: &mut Criterion) {
    let p = pair();
    let src = p.da.alloc(8, Access::LOCAL_WRITE).expect("mr");
    let dst = p.db.alloc(8, Access::all()).expect("mr");
    let sgl = [src.all()];
    let remote = dst.desc();
    let mut g = c.benchmark_group("cq_poll_tcp");
    let mut out = Vec::with_capacity(16);
    g.bench_function("empty", |b| {
        b.iter(|| black_box(p.cqa.poll(&mut out, 16).expect("poll")))
    });
    g.throughput(Throughput::Elements(16));
    g.bench_function("full_16_of_at_least_16", |b| {
        b.iter_custom(|iters| {
            let mut timed = Duration::ZERO;
            let mut done = 0;
            while done < iters {
                // Fill outside the timing: 240 writes (the send queue holds 256), then
                // give the completions time to arrive.
                for i in 0..240 {
                    p.a.post_send(&SendWr::write(i, &sgl, remote.at(0)))
                        .expect("post");
                }
                std::thread::sleep(Duration::from_millis(30));
                loop {
                    out.clear();
                    let t = Instant::now();
                    let n = p.cqa.poll(&mut out, 16).expect("poll");
                    let dt = t.elapsed();
                    if n < 16 {
                        break;
                    }
                    timed += dt;
                    done += 1;
                    if done == iters {
                        break;
                    }
                }
                // Drain what is left before the next fill.
                let deadline = Instant::now() + Duration::from_millis(50);
                while Instant::now() < deadline {
                    out.clear();
                    if p.cqa.poll(&mut out, 64).expect("poll") == 0 {
                        std::thread::sleep(Duration::from_millis(1));
                    }
                }
            }
            timed
        })
    });
    g.finish();
    drop(p.b);
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2))
        .sample_size(20);
    targets = dispatch, post_poll, register, cq_poll
}
criterion_main!(benches);
