//! Section 8: bad input gets a clear error, never a crash, a hang or lost data.

use std::io::Write;

use fabric::prelude::*;
use fabric::Selector;

use super::cases;
use crate::ensure;
use crate::harness::{expect_ok, region, Case, CaseResultOf, Ctx, Ctxt, PairOpts};

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "bad.oversized_private_data", "8", OpSet::empty() => oversized_private_data;
        "bad.queue_depths_and_capacity", "8", OpSet::empty() => bad_depths;
        "bad.atomic_result_not_8_bytes", "8", OpSet::FETCH_ADD => atomic_result_size;
        "bad.unknown_provider_and_config", "8", OpSet::empty() => bad_config;
        "bad.garbage_to_listener", "8", OpSet::SEND => garbage_to_listener;
        "bad.client_closes_before_accept", "8", OpSet::SEND | OpSet::LISTEN_EARLY_CLOSE => closes_before_accept;
        "bad.error_keeps_acknowledged_data", "8", OpSet::WRITE => keeps_acknowledged;
    }
}

fn oversized_private_data(ctx: &Ctx) -> CaseResultOf {
    let max = ctx.info().caps.limits.max_private_data as usize;
    match ctx.pair_with(PairOpts {
        private_a: vec![7; max + 1],
        ..PairOpts::default()
    }) {
        Err(e) if e.contains("InvalidArgument") => {}
        Err(e) => {
            return Err(format!(
                "{} bytes of private data (max {max}): unclear error {e}",
                max + 1
            ))
        }
        Ok(_) => {
            return Err(format!(
                "{} bytes of private data (max {max}) were accepted",
                max + 1
            ))
        }
    }
    ctx.pair_with(PairOpts {
        private_a: vec![7; max],
        ..PairOpts::default()
    })
    .map(|_| ())
    .map_err(|e| format!("exactly {max} bytes of private data: {e}"))
}

fn bad_depths(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    match d.create_cq(0) {
        Err(e) if e.kind() == ErrorKind::InvalidArgument => {}
        other => return Err(format!("create_cq(0) returned {other:?}")),
    }
    let max_cq = ctx.info().caps.limits.max_cq_entries as usize;
    if d.create_cq(max_cq + 1).is_ok() {
        return Err(format!(
            "create_cq({}) above the advertised max {max_cq} succeeded",
            max_cq + 1
        ));
    }
    match ctx.pair_with(PairOpts {
        sq_depth: 0,
        ..PairOpts::default()
    }) {
        Err(e) if e.contains("InvalidArgument") => {}
        other => return Err(format!("send queue depth 0: {:?}", other.map(|_| ()))),
    }
    Ok(())
}

fn atomic_result_size(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let r = region(&p.da, 16, Access::LOCAL_WRITE)?;
    let t = region(&p.db, 16, Access::all())?;
    match p.a.post_send(&SendWr::fetch_add(
        1,
        r.slice(0..4).ctx("s")?,
        t.desc().at(0),
        1,
    )) {
        Err(e) if e.kind() == ErrorKind::InvalidArgument => Ok(()),
        other => Err(format!(
            "atomic with a 4-byte result buffer returned {other:?}"
        )),
    }
}

fn bad_config(_ctx: &Ctx) -> CaseResultOf {
    match Selector::new().providers("tcp,infiniband") {
        Err(e) if e.kind() == ErrorKind::Config && e.message().contains("ib, roce, iwarp, tcp") => {
        }
        other => return Err(format!("unknown provider name: {other:?}")),
    }
    for text in [
        "provider = 3",
        "provider = \"tcp\"\nbogus = 1",
        "require = [\"WARP\"]",
        "[tcp]\ncrc = \"yes\"",
        "\u{0}\u{1}",
    ] {
        match Selector::new().config_str(text) {
            Err(e) if e.kind() == ErrorKind::Config && !e.message().is_empty() => {}
            other => return Err(format!("config {text:?} returned {other:?}")),
        }
    }
    Ok(())
}

fn garbage_to_listener(ctx: &Ctx) -> CaseResultOf {
    let mut star = ctx.listening()?;
    let addr = star.listener.local_addr();
    // Hostile clients: garbage, a truncated request, an oversized length, silence.
    let garbage: [&[u8]; 4] = [
        b"GET / HTTP/1.1\r\n\r\n",
        b"MPA ID Req Fr",
        &[0xff; 64],
        b"",
    ];
    // The hostile connections stay open until the good client was served: one closed
    // before the listener accepted it is `bad.client_closes_before_accept`.
    let mut held = Vec::new();
    for g in garbage {
        if let Ok(mut s) = std::net::TcpStream::connect(addr) {
            let _ = s.write_all(g);
            held.push(s);
        }
    }
    // The listener still serves a well-behaved client.
    star.connect(ctx, 1)
        .map_err(|e| format!("good client after garbage: {e}"))?;
    serves(&star)?;
    drop(held);
    Ok(())
}

/// Clients that connect and close at once, before the listener could accept them (a port
/// scanner, a crashing peer): the listener still serves a well-behaved client.
fn closes_before_accept(ctx: &Ctx) -> CaseResultOf {
    let mut star = ctx.listening()?;
    let addr = star.listener.local_addr();
    for g in [&b""[..], b"MPA ID Req Frame"] {
        for _ in 0..4 {
            if let Ok(mut s) = std::net::TcpStream::connect(addr) {
                let _ = s.write_all(g);
            }
        }
    }
    star.connect(ctx, 1)
        .map_err(|e| format!("good client after early closes: {e}"))?;
    serves(&star)
}

/// The first client of `star` sends the server one message, which arrives intact.
fn serves(star: &crate::harness::Star) -> CaseResultOf {
    let rq = region(&star.server, 16, Access::LOCAL_WRITE)?;
    star.accepted[0]
        .post_recv(&RecvWr::new(1, &[rq.all()]))
        .ctx("post_recv")?;
    let client = &star.clients[0];
    let m = region(&client.domain, 5, Access::empty())?;
    m.buffer().write(0, b"still");
    client
        .ep
        .post_send(&SendWr::send(2, &[m.all()]))
        .ctx("post_send")?;
    expect_ok(&star.server_cq, 1, Opcode::Recv)?;
    ensure!(
        rq.buffer().to_vec(0, 5) == b"still",
        "message after hostile clients corrupted"
    );
    Ok(())
}

fn keeps_acknowledged(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 4096, Access::empty())?;
    src.buffer().fill(0, 4096, 0x6b);
    let t = region(&p.db, 8192, Access::all())?;
    p.a.post_send(&SendWr::write(1, &[src.all()], t.desc().at(0)))
        .ctx("post")?;
    expect_ok(&p.cqa, 1, Opcode::Write)?;
    // A later hostile request (bad key) breaks the connection but must not undo or
    // disturb what was already acknowledged.
    let mut bad = t.desc().at(4096);
    bad.key = bad.key.wrapping_add(1);
    p.a.post_send(&SendWr::write(2, &[src.all()], bad))
        .ctx("post bad")?;
    let c = crate::harness::next(&p.cqa, ctx.timeout)?;
    ensure!(
        c.status == Status::Error(ErrorKind::RemoteAccess),
        "bad-key write completed {c:?}"
    );
    ensure!(
        t.buffer().to_vec(0, 4096).iter().all(|&b| b == 0x6b),
        "acknowledged data changed after the error"
    );
    ensure!(
        t.buffer().to_vec(4096, 4096).iter().all(|&b| b == 0),
        "refused write touched memory"
    );
    Ok(())
}
