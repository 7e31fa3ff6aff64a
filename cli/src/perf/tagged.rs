//! `fabric perf pingpong|lat --op tagged`: the ping-pong over reliable datagram endpoints
//! with tagged messages (fabric-rdm), the measurement `fi_pingpong -e rdm` makes of
//! libfabric's RDM layer, so that the layer's cost can be read against `--op send` on the
//! same provider in the same sitting.
//!
//! The server opens an RDM endpoint listening at `--listen` and prints its address. The
//! client opens its own, sends the plan as one tagged message (tag [`PLAN`]: the number of
//! phases, how to wait for completions (0 busy, 1 spin, 2 block, as the client does), then
//! `size, warmup + iters` per phase; little-endian `u64`s), and then, per iteration, posts
//! the receive for the echo and sends `size` bytes with tag [`DATA`]; the server receives
//! each message from the client and sends it back. The connections come and go on demand
//! as the RDM layer makes them, outside the timed iterations (the warm-up makes them).

use std::net::{IpAddr, SocketAddr, UdpSocket};
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric_rdm::{Peer, RdmCompletion, RdmConfig, RdmEndpoint, RdmOp, RecvBuf, Source};

use super::{Mode, Op, Phase, Plan, Row};

/// Tag of the plan message.
const PLAN: u64 = 1;
/// Tag of the ping-pong messages.
const DATA: u64 = 2;
/// Contexts: the client's and server's receives, and their sends.
const RECV: u64 = 1;
const SEND: u64 = 2;
/// How long a side waits for its peer's next message before giving up.
const STALL: Duration = Duration::from_secs(120);
/// How long the server waits for a client.
const IDLE: Duration = Duration::from_secs(1800);
/// Largest plan accepted by the server: phases.
const MAX_PHASES: u64 = 1024;

fn e(what: &'static str) -> impl Fn(fabric::Error) -> String {
    move |err| format!("{what}: {err}")
}

/// Memory both sides send from and receive into: registered for the rendezvous protocol's
/// RDMA Read above the eager size.
fn region(domain: &AnyDomain, size: usize) -> Result<Arc<MemoryRegion>, String> {
    domain
        .alloc(size.max(1), Access::LOCAL_WRITE | Access::REMOTE_READ)
        .map(Arc::new)
        .map_err(e("register"))
}

/// Waits for the next completion of `want` (a receive), counting the sends that complete
/// meanwhile; busy-polls (yielding when empty, or not with `Mode::Spin`) or blocks in the
/// endpoint's wait (`Mode::Block`). The clock is read for the stall check every 1024
/// empty polls when polling, as the untagged tests' loop does (`run::Reaper`): a read per
/// poll would be part of what the tagged figure measures and not of the untagged one.
fn next_recv(
    ep: &RdmEndpoint,
    mode: Mode,
    stash: &mut Vec<RdmCompletion>,
    timeout: Duration,
) -> Result<RdmCompletion, String> {
    let mut since = None::<Instant>;
    let mut idle = 0u32;
    loop {
        ep.poll(stash).map_err(e("poll"))?;
        let mut found = None;
        for c in stash.drain(..) {
            if !c.is_ok() {
                return Err(format!("{:?} completed with {:?}", c.op, c.status));
            }
            if c.context == RECV {
                found = Some(c);
            }
        }
        if let Some(c) = found {
            return Ok(c);
        }
        idle = idle.wrapping_add(1);
        if (mode == Mode::Block || idle.is_multiple_of(1024))
            && since.get_or_insert_with(Instant::now).elapsed() > timeout
        {
            return Err(format!("no message from the peer within {timeout:?}"));
        }
        match mode {
            Mode::Busy => std::thread::yield_now(),
            // No pause instruction: see `Mode::Spin`.
            Mode::Spin => {}
            Mode::Block => {
                ep.wait(Duration::from_millis(100)).map_err(e("wait"))?;
            }
        }
    }
}

/// The server: prints the endpoint's address, then echoes one client's plan.
pub(crate) fn serve(domain: AnyDomain, listen: SocketAddr) -> Result<(), String> {
    let cfg = RdmConfig {
        bind: listen,
        ..RdmConfig::default()
    };
    let domain = Arc::new(domain);
    let ep = RdmEndpoint::new(domain.clone(), cfg).map_err(e("open the rdm endpoint"))?;
    println!("listening on {}", ep.addr());
    std::io::Write::flush(&mut std::io::stdout()).map_err(|e| e.to_string())?;
    let plan_buf = region(&domain, (2 + 2 * MAX_PHASES as usize) * 8)?;
    ep.trecv(Source::Any, PLAN, 0, RecvBuf::whole(plan_buf.clone()), RECV)
        .map_err(e("post the plan's receive"))?;
    let mut stash = Vec::new();
    let got = next_recv(&ep, Mode::Block, &mut stash, IDLE)?;
    let client = got
        .peer
        .ok_or("the plan came without its sender's address")?;
    let words: Vec<u64> = plan_buf
        .buffer()
        .to_vec(0, got.len as usize)
        .chunks_exact(8)
        .map(|w| u64::from_le_bytes(w.try_into().expect("8 bytes")))
        .collect();
    let (mode, phases) = parse_plan(&words)?;
    let max = phases.iter().map(|p| p.0).max().unwrap_or(1);
    let buf = region(&domain, max as usize)?;
    for (size, n) in phases {
        let size = size as usize;
        for _ in 0..n {
            ep.trecv(
                Source::Peer(client),
                DATA,
                0,
                RecvBuf::new(buf.clone(), 0, size),
                RECV,
            )
            .map_err(e("post a receive"))?;
            let c = next_recv(&ep, mode, &mut stash, STALL)?;
            check_len(&c, size)?;
            ep.tsend(client, DATA, buf.slice(0..size).map_err(e("slice"))?, SEND)
                .map_err(e("send"))?;
        }
    }
    // The last echo leaves before the endpoint closes (dropping it lingers for that too).
    ep.close(Duration::from_secs(5)).map_err(e("close"))?;
    Ok(())
}

/// The waiting mode's code in a plan message.
fn mode_code(m: Mode) -> u64 {
    match m {
        Mode::Busy => 0,
        Mode::Spin => 1,
        Mode::Block => 2,
    }
}

/// A plan message: the waiting mode and the phases, `(size, iterations)`.
fn parse_plan(words: &[u64]) -> Result<(Mode, Vec<(u64, u64)>), String> {
    let bad = |why: &str| format!("a malformed plan from the client: {why}");
    let [n, mode, rest @ ..] = words else {
        return Err(bad(&format!("{} words", words.len())));
    };
    let n = *n;
    if n == 0 || n > MAX_PHASES || rest.len() != 2 * n as usize {
        return Err(bad(&format!("{n} phases in {} words", words.len())));
    }
    let mode = [Mode::Busy, Mode::Spin, Mode::Block]
        .into_iter()
        .find(|&m| mode_code(m) == *mode)
        .ok_or_else(|| bad(&format!("waiting mode {mode}")))?;
    let phases: Vec<(u64, u64)> = rest.chunks_exact(2).map(|p| (p[0], p[1])).collect();
    if phases.iter().any(|&(size, _)| size == 0 || size > 1 << 30) {
        return Err(bad("a size outside 1 byte to 1 GiB"));
    }
    Ok((mode, phases))
}

fn check_len(c: &RdmCompletion, size: usize) -> Result<(), String> {
    if c.op != RdmOp::TaggedRecv || c.len != size as u64 || c.msg_len != size as u64 {
        return Err(format!(
            "expected a tagged message of {size} bytes, got {:?} of {} ({} sent)",
            c.op, c.len, c.msg_len
        ));
    }
    Ok(())
}

/// The address the server can reach this host at: the local end of a route to `server`.
fn local_toward(server: SocketAddr) -> Result<IpAddr, String> {
    if server.ip().is_loopback() {
        return Ok(server.ip());
    }
    let any: SocketAddr = if server.is_ipv4() {
        "0.0.0.0:0".parse().expect("address")
    } else {
        "[::]:0".parse().expect("address")
    };
    let s = UdpSocket::bind(any).map_err(|e| format!("finding a route to {server}: {e}"))?;
    s.connect(server)
        .map_err(|e| format!("finding a route to {server}: {e}"))?;
    Ok(s.local_addr().map_err(|e| e.to_string())?.ip())
}

/// The client: sends the plan, then runs and times the ping-pongs.
pub(crate) fn client(
    domain: &Arc<AnyDomain>,
    server: SocketAddr,
    plan: &Plan,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<Row>, String> {
    let cfg = RdmConfig {
        bind: SocketAddr::new(local_toward(server)?, 0),
        ..RdmConfig::default()
    };
    let ep = RdmEndpoint::new(domain.clone(), cfg).map_err(e("open the rdm endpoint"))?;
    let peer = ep.av_insert(server);
    let mut words = vec![plan.phases.len() as u64, mode_code(plan.mode)];
    for p in &plan.phases {
        words.extend([p.size, p.warmup + p.iters]);
    }
    let plan_buf = region(domain, words.len() * 8)?;
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    plan_buf.buffer().write(0, &bytes);
    ep.tsend(
        peer,
        PLAN,
        plan_buf.slice(0..bytes.len()).map_err(e("slice"))?,
        SEND,
    )
    .map_err(e("send the plan"))?;
    let max = plan.max_size() as usize;
    let (out, back) = (region(domain, max)?, region(domain, max)?);
    let mut stash = Vec::new();
    let mut rows = Vec::new();
    for p in &plan.phases {
        let mut pingpong = |n: u64, timed: bool| -> Result<Vec<f64>, String> {
            ping(
                &ep,
                peer,
                p,
                (&out, &back),
                plan.mode,
                &mut stash,
                n,
                timed,
                bar,
            )
        };
        pingpong(p.warmup, false)?;
        let start = Instant::now();
        let samples = pingpong(p.iters, plan.test == super::Test::Lat)?;
        let secs = start.elapsed().as_secs_f64();
        rows.push(Row {
            test: plan.test,
            op: Op::Tagged,
            bytes: p.size,
            iters: p.iters,
            xfers_per_iter: 2,
            secs,
            dist: (!samples.is_empty()).then(|| super::run::distribution(samples, 2)),
        });
    }
    ep.close(Duration::from_secs(5)).map_err(e("close"))?;
    Ok(rows)
}

/// `n` iterations: post the echo's receive, send, wait for the echo. Per-iteration seconds
/// when `timed`.
#[allow(clippy::too_many_arguments)]
fn ping(
    ep: &RdmEndpoint,
    peer: Peer,
    p: &Phase,
    (out, back): (&Arc<MemoryRegion>, &Arc<MemoryRegion>),
    mode: Mode,
    stash: &mut Vec<RdmCompletion>,
    n: u64,
    timed: bool,
    bar: &indicatif::ProgressBar,
) -> Result<Vec<f64>, String> {
    let size = p.size as usize;
    let src = out.slice(0..size).map_err(e("slice"))?;
    let mut laps = super::Laps::start(timed, n);
    for i in 0..n {
        ep.trecv(
            Source::Peer(peer),
            DATA,
            0,
            RecvBuf::new(back.clone(), 0, size),
            RECV,
        )
        .map_err(e("post a receive"))?;
        ep.tsend(peer, DATA, src, SEND).map_err(e("send"))?;
        laps.sent(i);
        let c = next_recv(ep, mode, stash, STALL)?;
        check_len(&c, size)?;
        laps.done(i, bar);
    }
    bar.inc(n & 255);
    Ok(laps.into_samples())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_plan_is_checked_before_it_is_run() {
        assert_eq!(
            parse_plan(&[1, 0, 8, 100]),
            Ok((Mode::Busy, vec![(8, 100)]))
        );
        assert_eq!(
            parse_plan(&[2, 2, 8, 100, 1 << 20, 10]),
            Ok((Mode::Block, vec![(8, 100), (1 << 20, 10)]))
        );
        for bad in [
            &[][..],
            &[1],
            &[0, 0],
            &[1, 0, 8],
            &[2, 0, 8, 100],
            &[1, 3, 8, 100],
            &[1, 0, 0, 100],
            &[1, 0, (1 << 30) + 1, 1],
            &[MAX_PHASES + 1, 0],
        ] {
            assert!(parse_plan(bad).is_err(), "{bad:?}");
        }
    }
}
