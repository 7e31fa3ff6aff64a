//! Section 7: connections.

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{
    expect_err, expect_none, expect_ok, next, readable, region, wait_state, Case, CaseResultOf,
    Ctx, Ctxt, PairOpts,
};

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "conn.private_data_both_ways", "7", OpSet::empty() => private_data;
        "conn.refused_promptly", "7", OpSet::empty() => refused;
        "conn.unreachable_times_out", "7", OpSet::empty() => unreachable;
        "conn.accept_times_out", "7", OpSet::empty() => accept_timeout;
        "conn.graceful_close_flushes_both_sides", "7", OpSet::SEND => graceful_close;
        "conn.post_after_close_fails", "7", OpSet::SEND => post_after_close;
        "conn.many_endpoints_one_listener", "7", OpSet::SEND => many_endpoints;
        "conn.peer_exit_is_a_disconnect", "7", OpSet::SEND => peer_exit;
        "conn.peer_killed_mid_transfer", "7", OpSet::SEND | OpSet::WRITE | OpSet::RNR_WAIT => peer_killed;
        "conn.ring_of_two_on_one_thread", "7", OpSet::SEND => ring_of_two;
        "conn.try_accept_never_waits", "7", OpSet::empty() => try_accept_never_waits;
        "conn.nonblocking_connect_refused", "7", OpSet::empty() => nonblocking_refused;
        "conn.events_report_close_both_sides", "7", OpSet::empty() => close_events;
        "conn.close_drained_completes_what_was_posted", "7", OpSet::SEND | OpSet::RNR_WAIT => close_drained;
    }
}

fn private_data(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair_with(PairOpts {
        private_a: b"from the client".to_vec(),
        private_b: b"from the server".to_vec(),
        ..PairOpts::default()
    })?;
    ensure!(
        p.b.peer_private_data() == b"from the client",
        "server saw {:?}",
        String::from_utf8_lossy(&p.b.peer_private_data())
    );
    ensure!(
        p.a.peer_private_data() == b"from the server",
        "client saw {:?}",
        String::from_utf8_lossy(&p.a.peer_private_data())
    );
    Ok(())
}

/// An address on `ctx.bind` where nobody listens.
fn closed_port(ctx: &Ctx) -> Result<SocketAddr, String> {
    let l = std::net::TcpListener::bind(ctx.any_port()).map_err(|e| e.to_string())?;
    let a = l.local_addr().map_err(|e| e.to_string())?;
    drop(l);
    Ok(a)
}

fn refused(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let cq = d.create_cq(8).ctx("cq")?;
    let addr = closed_port(ctx)?;
    let t = Instant::now();
    match d.connect(addr, &EndpointConfig::new(&cq)) {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
        other => {
            return Err(format!(
                "connect to {addr} (nobody listening) returned {other:?}"
            ))
        }
    }
    ensure!(
        t.elapsed() < Duration::from_secs(3),
        "refusal took {:?}",
        t.elapsed()
    );
    Ok(())
}

/// An address that never answers. For providers that connect over TCP (tcp, and iwarp
/// through rdma_cm): a listener whose accept queue is full, so the kernel drops further SYNs
/// (TEST-NET addresses cannot be trusted: some networks refuse them at once). Otherwise:
/// TEST-NET-1 (RFC 5737), never routed.
fn blackhole(ctx: &Ctx) -> Result<(SocketAddr, Vec<Box<dyn std::any::Any>>), String> {
    if !matches!(ctx.initiator.as_str(), "tcp" | "iwarp") {
        return Ok(("192.0.2.1:7471".parse().expect("literal"), Vec::new()));
    }
    use socket2::{Domain, Socket, Type};
    let s = Socket::new(Domain::for_address(ctx.any_port()), Type::STREAM, None)
        .map_err(|e| e.to_string())?;
    s.bind(&ctx.any_port().into()).map_err(|e| e.to_string())?;
    s.listen(0).map_err(|e| e.to_string())?;
    let addr = s
        .local_addr()
        .map_err(|e| e.to_string())?
        .as_socket()
        .ok_or("not an IP socket")?;
    let mut keep: Vec<Box<dyn std::any::Any>> = vec![Box::new(s)];
    // Fill the accept queue (nobody accepts) until a connect attempt hangs.
    for _ in 0..8 {
        match std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)) {
            Ok(c) => keep.push(Box::new(c)),
            Err(_) => return Ok((addr, keep)),
        }
    }
    Err("could not fill a listen queue to make an unreachable address".into())
}

fn unreachable(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let cq = d.create_cq(8).ctx("cq")?;
    let (addr, _keep) = blackhole(ctx)?;
    let mut cfg = EndpointConfig::new(&cq);
    cfg.timeout = Duration::from_millis(1500);
    let t = Instant::now();
    match d.connect(addr, &cfg) {
        Err(e) if e.kind() == ErrorKind::TimedOut => {}
        other => {
            return Err(format!(
                "connect to unreachable {addr} returned {other:?}, expected TimedOut"
            ))
        }
    }
    ensure!(
        t.elapsed() < Duration::from_secs(5),
        "connect to an unreachable address took {:?}",
        t.elapsed()
    );
    Ok(())
}

fn accept_timeout(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let cq = d.create_cq(8).ctx("cq")?;
    let l = d.listen(ctx.any_port()).ctx("listen")?;
    let t = Instant::now();
    match l.accept(&EndpointConfig::new(&cq), Duration::from_millis(300)) {
        Err(e) if e.kind() == ErrorKind::TimedOut => {}
        other => return Err(format!("accept with nobody connecting returned {other:?}")),
    }
    let took = t.elapsed();
    ensure!(
        took >= Duration::from_millis(250) && took < Duration::from_secs(3),
        "accept timeout of 300 ms took {took:?}"
    );
    Ok(())
}

fn graceful_close(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let ra = region(&p.da, 256, Access::LOCAL_WRITE)?;
    let rb = region(&p.db, 256, Access::LOCAL_WRITE)?;
    p.a.post_recv(&RecvWr::new(1, &[ra.slice(0..128).ctx("s")?]))
        .ctx("post_recv a")?;
    p.b.post_recv(&RecvWr::new(2, &[rb.slice(0..128).ctx("s")?]))
        .ctx("post_recv b")?;
    p.b.post_recv(&RecvWr::new(3, &[rb.slice(128..256).ctx("s")?]))
        .ctx("post_recv b")?;
    p.a.close().ctx("close")?;
    expect_err(&p.cqa, 1, ErrorKind::Flushed)?;
    wait_state(&p.b, EndpointState::Disconnected, Duration::from_secs(5))?;
    expect_err(&p.cqb, 2, ErrorKind::Flushed)?;
    expect_err(&p.cqb, 3, ErrorKind::Flushed)?;
    ensure!(
        p.a.state() == EndpointState::Disconnected,
        "closed endpoint is {:?}",
        p.a.state()
    );
    expect_none(&p.cqa, Duration::from_millis(50))?;
    Ok(())
}

fn post_after_close(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let mr = region(&p.da, 64, Access::LOCAL_WRITE)?;
    p.a.close().ctx("close")?;
    for (what, r) in [
        ("send", p.a.post_send(&SendWr::send(1, &[mr.all()]))),
        ("recv", p.a.post_recv(&RecvWr::new(2, &[mr.all()]))),
    ] {
        match r {
            Err(e) if e.kind() == ErrorKind::InvalidState => {}
            other => return Err(format!("{what} after close returned {other:?}")),
        }
    }
    Ok(())
}

fn many_endpoints(ctx: &Ctx) -> CaseResultOf {
    let n = 16;
    let star = ctx.star(n)?;
    let rq = region(&star.server, 8 * n, Access::LOCAL_WRITE)?;
    for (i, ep) in star.accepted.iter().enumerate() {
        ep.post_recv(&RecvWr::new(
            i as u64,
            &[rq.slice(i * 8..i * 8 + 8).ctx("s")?],
        ))
        .ctx("post_recv")?;
    }
    for (i, c) in star.clients.iter().enumerate() {
        let m = region(&c.domain, 8, Access::empty())?;
        m.buffer().write(0, &(i as u64).to_be_bytes());
        c.ep.post_send(&SendWr::send(i as u64, &[m.all()]).inline())
            .ctx("post_send")?;
    }
    for _ in 0..n {
        let c = next(&star.server_cq, ctx.timeout)?;
        ensure!(c.is_ok(), "server completion {c:?}");
        let j = c.context as usize;
        let from = u64::from_be_bytes(rq.buffer().to_vec(j * 8, 8).try_into().expect("8")) as usize;
        // accepted[j] is connected to clients[j] and to nobody else.
        ensure!(from == j, "endpoint {j} received client {from}'s message");
    }
    Ok(())
}

fn peer_exit(ctx: &Ctx) -> CaseResultOf {
    let mut peer = ctx.peer(&["--mode", "echo"])?;
    let m = region(&peer.domain, 8, Access::LOCAL_WRITE)?;
    m.buffer().write(0, b"quit");
    peer.ep
        .post_send(&SendWr::send(1, &[m.slice(0..4).ctx("s")?]))
        .ctx("post quit")?;
    expect_ok(&peer.cq, 1, Opcode::Send)?;
    let code = peer.wait_exit(Duration::from_secs(10))?;
    ensure!(code == 0, "peer exited with {code}");
    wait_state(
        &peer.ep,
        EndpointState::Disconnected,
        Duration::from_secs(5),
    )
}

fn peer_killed(ctx: &Ctx) -> CaseResultOf {
    // The peer keeps no receive posted, so our sends stay outstanding until it dies.
    let mut peer = ctx.peer(&["--mode", "idle", "--recv", "0"])?;
    let m = region(&peer.domain, 64 << 10, Access::LOCAL_WRITE)?;
    for i in 0..4 {
        peer.ep
            .post_send(&SendWr::send(i, &[m.slice(0..1024).ctx("s")?]))
            .ctx("post_send")?;
    }
    peer.ep
        .post_send(&SendWr::write(4, &[m.all()], peer.desc.at(0)))
        .ctx("post write")?;
    expect_none(&peer.cq, Duration::from_millis(200))?;
    peer.kill()?;
    let t = Instant::now();
    for i in 0..5 {
        let c = next(&peer.cq, Duration::from_secs(10))
            .map_err(|e| format!("after the peer was killed: {e}"))?;
        ensure!(
            c.context == i,
            "completion order after kill: got context {} expected {i}",
            c.context
        );
        if i < 4 {
            ensure!(
                c.status != Status::Success,
                "send {i} reported success although the peer died before receiving it"
            );
        }
    }
    ensure!(
        t.elapsed() < Duration::from_secs(10),
        "errors took {:?}",
        t.elapsed()
    );
    ensure!(
        peer.ep.state() != EndpointState::Connected,
        "endpoint still Connected after its peer died"
    );
    match peer
        .ep
        .post_send(&SendWr::send(9, &[m.slice(0..8).ctx("s")?]))
    {
        Err(e) if e.kind() == ErrorKind::InvalidState => Ok(()),
        other => Err(format!("post after peer death returned {other:?}")),
    }
}

/// Two applications that each connect to the other before either accepts (the first
/// link of a ring): with `connect_start` and `try_accept` one thread brings both
/// connections up, and the listener's descriptor says when a request waits. Each
/// connection then carries a message.
fn ring_of_two(ctx: &Ctx) -> CaseResultOf {
    let (da, db) = (ctx.domain()?, ctx.target_domain()?);
    let (cqa, cqb) = (da.create_cq(64).ctx("cq")?, db.create_cq(64).ctx("cq")?);
    let (la, lb) = (
        da.listen(ctx.any_port()).ctx("listen a")?,
        db.listen(ctx.any_port()).ctx("listen b")?,
    );
    let (ca, cb) = (EndpointConfig::new(&cqa), EndpointConfig::new(&cqb));
    let mut a_out = Some(
        da.connect_start(lb.local_addr(), &ca)
            .ctx("connect_start a")?,
    );
    let mut b_out = Some(
        db.connect_start(la.local_addr(), &cb)
            .ctx("connect_start b")?,
    );
    // Nothing accepted yet: once a's request reached b's listener (polling a's
    // connection is what sends it), the listener's descriptor says so.
    let deadline = Instant::now() + ctx.timeout;
    loop {
        if let Some(c) = a_out.as_mut() {
            ensure!(
                c.poll().ctx("connecting a->b")?.is_none(),
                "a's connection completed before b accepted it"
            );
        }
        if readable(lb.as_fd(), Duration::from_millis(10))? {
            break;
        }
        ensure!(
            Instant::now() < deadline,
            "b's listener descriptor not readable within {:?} of a's connection request",
            ctx.timeout
        );
    }
    let (mut eps_a, mut eps_b) = (None, None);
    let (mut acc_a, mut acc_b) = (None, None);
    let deadline = Instant::now() + ctx.timeout;
    while eps_a.is_none() || eps_b.is_none() || acc_a.is_none() || acc_b.is_none() {
        if Instant::now() >= deadline {
            return Err(format!(
                "ring of two not connected within {:?}: a->b {}, b->a {}, a accepted {}, b accepted {}",
                ctx.timeout,
                eps_a.is_some(),
                eps_b.is_some(),
                acc_a.is_some(),
                acc_b.is_some()
            ));
        }
        if acc_a.is_none() {
            acc_a = la.try_accept(&ca).ctx("try_accept a")?;
        }
        if acc_b.is_none() {
            acc_b = lb.try_accept(&cb).ctx("try_accept b")?;
        }
        if let Some(c) = a_out.as_mut() {
            if let Some(ep) = c.poll().ctx("connecting a->b")? {
                eps_a = Some(ep);
                a_out = None;
            }
        }
        if let Some(c) = b_out.as_mut() {
            if let Some(ep) = c.poll().ctx("connecting b->a")? {
                eps_b = Some(ep);
                b_out = None;
            }
        }
        std::thread::sleep(Duration::from_millis(1));
    }
    let (a_out, b_out) = (eps_a.expect("set"), eps_b.expect("set"));
    let (a_in, b_in) = (acc_a.expect("set"), acc_b.expect("set"));
    // a->b is a_out with b_in, b->a is b_out with a_in: a message over each.
    let (ra, rb) = (
        region(&da, 64, Access::LOCAL_WRITE)?,
        region(&db, 64, Access::LOCAL_WRITE)?,
    );
    b_in.post_recv(&RecvWr::new(1, &[rb.slice(0..32).ctx("s")?]))
        .ctx("post_recv b")?;
    a_in.post_recv(&RecvWr::new(2, &[ra.slice(0..32).ctx("s")?]))
        .ctx("post_recv a")?;
    ra.buffer().write(32, b"a to b");
    rb.buffer().write(32, b"b to a");
    a_out
        .post_send(&SendWr::send(3, &[ra.slice(32..38).ctx("s")?]))
        .ctx("send a->b")?;
    b_out
        .post_send(&SendWr::send(4, &[rb.slice(32..38).ctx("s")?]))
        .ctx("send b->a")?;
    crate::harness::expect_ok_each(&cqa, &[(2, Opcode::Recv), (3, Opcode::Send)])?;
    crate::harness::expect_ok_each(&cqb, &[(1, Opcode::Recv), (4, Opcode::Send)])?;
    ensure!(
        rb.buffer().to_vec(0, 6) == b"a to b" && ra.buffer().to_vec(0, 6) == b"b to a",
        "messages arrived as {:?} and {:?}",
        rb.buffer().to_vec(0, 6),
        ra.buffer().to_vec(0, 6)
    );
    Ok(())
}

/// `try_accept` with no request waiting returns `None` at once, and the listener's
/// descriptor is not readable.
fn try_accept_never_waits(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.target_domain()?;
    let cq = d.create_cq(8).ctx("cq")?;
    let l = d.listen(ctx.any_port()).ctx("listen")?;
    ensure!(
        !readable(l.as_fd(), Duration::from_millis(50))?,
        "listener descriptor readable with no request"
    );
    let t = Instant::now();
    let r = l.try_accept(&EndpointConfig::new(&cq)).ctx("try_accept")?;
    ensure!(r.is_none(), "try_accept with no request gave an endpoint");
    ensure!(
        t.elapsed() < Duration::from_millis(500),
        "try_accept took {:?}",
        t.elapsed()
    );
    Ok(())
}

/// A non-blocking connect to a port nobody listens on fails ConnectionRefused, promptly,
/// and afterwards reports InvalidState.
fn nonblocking_refused(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let cq = d.create_cq(8).ctx("cq")?;
    let addr = closed_port(ctx)?;
    let t = Instant::now();
    let mut c = match d.connect_start(addr, &EndpointConfig::new(&cq)) {
        Ok(c) => c,
        // Refused while starting is as good (the provider learned it at once).
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => return Ok(()),
        Err(e) => return Err(format!("connect_start to {addr}: {e}")),
    };
    loop {
        match c.poll() {
            Ok(None) if t.elapsed() < Duration::from_secs(3) => {
                readable(c.as_fd(), Duration::from_millis(20))?;
            }
            Err(e) if e.kind() == ErrorKind::ConnectionRefused => break,
            other => {
                return Err(format!(
                    "connecting to {addr} (nobody listening) gave {other:?} after {:?}",
                    t.elapsed()
                ))
            }
        }
    }
    match c.poll() {
        Err(e) if e.kind() == ErrorKind::InvalidState => Ok(()),
        other => Err(format!("poll after the failure returned {other:?}")),
    }
}

/// One close gives one event on each side: `Closed` here, `PeerClosed` there, with each
/// event descriptor readable while its event is unread.
fn close_events(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    ensure!(p.a.next_event().is_none(), "event on a fresh endpoint");
    ensure!(
        !readable(p.b.event_fd().ctx("event_fd")?, Duration::ZERO)?,
        "event descriptor readable on a fresh endpoint"
    );
    p.a.close().ctx("close")?;
    ensure!(
        readable(p.b.event_fd().ctx("event_fd")?, ctx.timeout)?,
        "peer's event descriptor not readable within {:?} of the close",
        ctx.timeout
    );
    match p.b.next_event() {
        Some(EndpointEvent::PeerClosed) => {}
        other => return Err(format!("peer's event after a close: {other:?}")),
    }
    ensure!(
        p.b.state() == EndpointState::Disconnected,
        "peer is {:?} after its PeerClosed event",
        p.b.state()
    );
    ensure!(
        !readable(p.b.event_fd().ctx("event_fd")?, Duration::ZERO)?,
        "event descriptor still readable after the event was taken"
    );
    match p.a.next_event() {
        Some(EndpointEvent::Closed) => {}
        other => return Err(format!("closing side's event: {other:?}")),
    }
    ensure!(
        p.a.next_event().is_none(),
        "a second event on the closing side"
    );
    Ok(())
}

/// Sends posted right before a draining close all complete successfully and arrive;
/// only then does the connection go down.
fn close_drained(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let n = 32usize;
    let len = 4096usize;
    let src = region(&p.da, n * len, Access::empty())?;
    let dst = region(&p.db, n * len, Access::LOCAL_WRITE)?;
    for i in 0..n {
        src.buffer().fill(i * len, len, i as u8 + 1);
        p.b.post_recv(&RecvWr::new(
            i as u64,
            &[dst.slice(i * len..(i + 1) * len).ctx("s")?],
        ))
        .ctx("post_recv")?;
    }
    for i in 0..n {
        p.a.post_send(&SendWr::send(
            100 + i as u64,
            &[src.slice(i * len..(i + 1) * len).ctx("s")?],
        ))
        .ctx("post_send")?;
    }
    p.a.close_drained(ctx.timeout).ctx("close_drained")?;
    for i in 0..n {
        expect_ok(&p.cqa, 100 + i as u64, Opcode::Send)
            .map_err(|e| format!("send {i} after a draining close: {e}"))?;
    }
    for i in 0..n {
        expect_ok(&p.cqb, i as u64, Opcode::Recv)?;
    }
    for i in 0..n {
        let got = dst.buffer().to_vec(i * len, len);
        ensure!(
            got.iter().all(|&b| b == i as u8 + 1),
            "message {i} arrived damaged"
        );
    }
    ensure!(
        p.a.state() == EndpointState::Disconnected,
        "endpoint is {:?} after close_drained",
        p.a.state()
    );
    Ok(())
}
