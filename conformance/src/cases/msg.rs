//! Section 3: messaging (send / receive).

use std::time::{Duration, Instant};

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{
    expect_err, expect_none, expect_ok, expect_ok_each, note, region, wait_state, Case,
    CaseResultOf, Ctx, Ctxt,
};

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "msg.send_recv", "3", OpSet::SEND => send_recv;
        "msg.receives_in_post_order", "3", OpSet::SEND => receives_in_order;
        "msg.bytes_beyond_message_untouched", "3", OpSet::SEND => beyond_untouched;
        "msg.receiver_not_ready_waits", "3", OpSet::SEND | OpSet::RNR_WAIT => receiver_not_ready;
        "msg.longer_than_receive", "3", OpSet::SEND => too_long;
        "msg.send_with_immediate", "3", OpSet::SEND_IMM => send_imm;
        "msg.gather_and_scatter_lists", "3", OpSet::SEND => gather_scatter;
        "msg.gather_list_over_max", "3", OpSet::SEND => sge_over_max;
        "msg.zero_byte_message", "3", OpSet::SEND => zero_byte;
        "msg.zero_byte_message_empty_receive", "3", OpSet::SEND => zero_byte_empty_receive;
        "msg.inline_buffer_free_at_once", "3", OpSet::SEND | OpSet::INLINE | OpSet::RNR_WAIT => inline_free;
        "msg.inline_over_max", "3", OpSet::SEND | OpSet::INLINE => inline_over_max;
        "msg.endpoint_request_limits", "3", OpSet::SEND => endpoint_limits;
        "msg.two_processes", "3", OpSet::SEND => two_processes;
        "msg.more_posts_leave_in_order", "3", OpSet::SEND | OpSet::WRITE => more_posts;
        "msg.both_directions_at_once", "3", OpSet::SEND | OpSet::RNR_WAIT => both_directions;
        "msg.send_completes_while_receiver_never_polls", "3", OpSet::SEND => receiver_never_polls;
        "msg.transmit_complete_sends_fill_posted_receives", "3", OpSet::SEND => transmit_complete_sends;
    }
}

/// `SendFlags::MORE` is a hint: requests posted with it arrive in post order with the
/// others, and a last one with no follower still leaves (here: while its sender polls).
fn more_posts(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 4096, Access::empty())?;
    let dst = region(&p.db, 16 * 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let wdst = region(&p.db, 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    for i in 0..16u8 {
        src.buffer().fill(usize::from(i) * 64, 64, b'a' + i);
    }
    src.buffer().fill(2048, 64, b'W');
    for i in 0..17u64 {
        let at = i as usize * 64;
        p.b.post_recv(&RecvWr::new(
            100 + i,
            &[dst.slice(at % 1024..at % 1024 + 64).ctx("slice")?],
        ))
        .ctx("post_recv")?;
    }
    // Sixteen sends of 1..=16 bytes and, in the middle, a write: every one but the last
    // posted with MORE.
    for i in 0..16u64 {
        let len = i as usize + 1;
        let sge = [src
            .slice(i as usize * 64..i as usize * 64 + len)
            .ctx("slice")?];
        let wr = SendWr::send(i, &sge);
        p.a.post_send(&if i < 15 { wr.more() } else { wr })
            .ctx("post_send")?;
        if i == 7 {
            p.a.post_send(
                &SendWr::write(
                    50,
                    &[src.slice(2048..2112).ctx("slice")?],
                    wdst.desc().at(0),
                )
                .more(),
            )
            .ctx("post write")?;
        }
    }
    for i in 0..16u64 {
        let r = expect_ok(&p.cqb, 100 + i, Opcode::Recv)?;
        ensure!(r.byte_len == i + 1, "message {i} has {} bytes", r.byte_len);
        let got = dst.buffer().to_vec(i as usize * 64, r.byte_len as usize);
        ensure!(
            got.iter().all(|&b| b == b'a' + i as u8),
            "receive {i} holds {:?}: messages out of post order",
            String::from_utf8_lossy(&got)
        );
    }
    for i in 0..8u64 {
        expect_ok(&p.cqa, i, Opcode::Send)?;
    }
    expect_ok(&p.cqa, 50, Opcode::Write)?;
    for i in 8..16u64 {
        expect_ok(&p.cqa, i, Opcode::Send)?;
    }
    ensure!(
        wdst.buffer().to_vec(0, 64).iter().all(|&b| b == b'W'),
        "the write posted with MORE was not placed"
    );
    // A last MORE post with nothing after it: it leaves anyway.
    p.a.post_send(&SendWr::send(99, &[src.slice(0..8).ctx("slice")?]).more())
        .ctx("post_send")?;
    let r = expect_ok(&p.cqb, 116, Opcode::Recv)?;
    ensure!(
        r.byte_len == 8,
        "the lone MORE send arrived with {} bytes",
        r.byte_len
    );
    expect_ok(&p.cqa, 99, Opcode::Send)?;
    Ok(())
}

fn send_recv(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 4096, Access::empty())?;
    let dst = region(&p.db, 4096, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"hello, fabric");
    p.b.post_recv(&RecvWr::new(7, &[dst.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(3, &[src.slice(0..13).ctx("slice")?]))
        .ctx("post_send")?;
    let r = expect_ok(&p.cqb, 7, Opcode::Recv)?;
    ensure!(r.byte_len == 13, "receive length {} != 13", r.byte_len);
    ensure!(r.imm.is_none(), "unexpected immediate {:?}", r.imm);
    expect_ok(&p.cqa, 3, Opcode::Send)?;
    ensure!(
        dst.buffer().to_vec(0, 13) == b"hello, fabric",
        "payload differs"
    );
    Ok(())
}

/// Posts `n` receives on `ep`, each into the next `slot` bytes of `dst`, with the contexts
/// `first`, `first + 1`, and so on.
fn post_slots(
    ep: &AnyEndpoint,
    dst: &MemoryRegion,
    first: u64,
    n: usize,
    slot: usize,
) -> Result<(), String> {
    for i in 0..n {
        let piece = dst.slice(i * slot..(i + 1) * slot).ctx("slice")?;
        ep.post_recv(&RecvWr::new(first + i as u64, &[piece]))
            .ctx("post_recv")?;
    }
    Ok(())
}

/// A send completes whether or not the receiving application ever polls or posts again: on
/// RC devices the target's NIC acknowledges it; the software providers must confirm it
/// themselves (the iwarp provider's count of completed receives never comes from a
/// receiver that does not poll, so its delivery read has to go after all). Two sends, the
/// second while the application waits on the queue: each completes, and only then does
/// the receiver look.
fn receiver_never_polls(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 128, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"unpolled");
    post_slots(&p.b, &dst, 10, 2, 64)?;
    for i in 0..2u64 {
        p.a.post_send(&SendWr::send(i, &[src.slice(0..8).ctx("slice")?]))
            .ctx("post_send")?;
        expect_ok(&p.cqa, i, Opcode::Send)?;
    }
    for i in 0..2u64 {
        let r = expect_ok(&p.cqb, 10 + i, Opcode::Recv)?;
        ensure!(r.byte_len == 8, "receive {i}: {} bytes", r.byte_len);
        let got = dst.buffer().to_vec(i as usize * 64, 8);
        ensure!(got == b"unpolled", "receive {i} holds {got:?}");
    }
    Ok(())
}

/// Transmit-complete sends need no confirmation of delivery, so a provider may tell its
/// sender of posted receives less often (iwarp batches its credit updates then). Every
/// receive posted must still be filled:
/// - one transmit-complete send first (a provider learns from it what the sender needs),
///   then 100 receives posted at once and none after (a batched count stops short of 100
///   when they are posted), 100 transmit-complete sends: all arrive, in order;
/// - then sends alternating between transmit and delivery complete in an irregular
///   pattern, each receive reposted as it completes: each arrives in order, and a
///   delivery-complete send completes only once its message is in the receive buffer.
fn transmit_complete_sends(ctx: &Ctx) -> CaseResultOf {
    const N: usize = 100;
    const LEN: usize = 16;
    let p = ctx.pair()?;
    let src = region(&p.da, N * LEN, Access::empty())?;
    let dst = region(&p.db, N * LEN, Access::LOCAL_WRITE)?;
    for i in 0..N {
        src.buffer().fill(i * LEN, LEN, i as u8);
    }
    p.b.post_recv(&RecvWr::new(999, &[dst.slice(0..LEN).ctx("slice")?]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(500, &[src.slice(0..LEN).ctx("slice")?]).transmit_complete())
        .ctx("post_send")?;
    expect_ok(&p.cqb, 999, Opcode::Recv)?;
    expect_ok(&p.cqa, 500, Opcode::Send)?;
    post_slots(&p.b, &dst, 1000, N, LEN)?;
    for i in 0..N {
        let at = i * LEN;
        p.a.post_send(
            &SendWr::send(i as u64, &[src.slice(at..at + LEN).ctx("slice")?]).transmit_complete(),
        )
        .ctx("post_send")?;
    }
    for i in 0..N as u64 {
        expect_ok(&p.cqa, i, Opcode::Send)?;
    }
    for i in 0..N {
        let r = expect_ok(&p.cqb, 1000 + i as u64, Opcode::Recv)?;
        ensure!(
            r.byte_len == LEN as u64,
            "receive {i}: {} bytes",
            r.byte_len
        );
        let got = dst.buffer().to_vec(i * LEN, LEN);
        ensure!(
            got.iter().all(|&b| b == i as u8),
            "receive {i} holds {got:?}"
        );
    }
    // Irregular: transmit complete where bit (i * 7) % 5 of 0b10110 is set.
    let slot = dst.slice(0..LEN).ctx("slice")?;
    p.b.post_recv(&RecvWr::new(2000, std::slice::from_ref(&slot)))
        .ctx("post_recv")?;
    for i in 0..40u64 {
        let tc = 0b10110u64 >> ((i * 7) % 5) & 1 == 1;
        let at = (i as usize % N) * LEN;
        let piece = [src.slice(at..at + LEN).ctx("slice")?];
        let wr = SendWr::send(100 + i, &piece);
        p.a.post_send(&if tc { wr.transmit_complete() } else { wr })
            .ctx("post_send")?;
        if !tc {
            expect_ok(&p.cqa, 100 + i, Opcode::Send)?;
            let got = dst.buffer().to_vec(0, LEN);
            ensure!(
                got.iter().all(|&b| b == (i as usize % N) as u8),
                "delivery-complete send {i} completed before its message was in the receive buffer ({got:?})"
            );
        }
        expect_ok(&p.cqb, 2000 + i, Opcode::Recv)?;
        let got = dst.buffer().to_vec(0, LEN);
        ensure!(
            got.iter().all(|&b| b == (i as usize % N) as u8),
            "receive {i} holds {got:?}"
        );
        p.b.post_recv(&RecvWr::new(2001 + i, std::slice::from_ref(&slot)))
            .ctx("post_recv")?;
        if tc {
            expect_ok(&p.cqa, 100 + i, Opcode::Send)?;
        }
    }
    Ok(())
}

fn receives_in_order(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 3 * 64, Access::LOCAL_WRITE)?;
    post_slots(&p.b, &dst, 100, 3, 64)?;
    for i in 0..3u8 {
        src.buffer().fill(0, 64, b'a' + i);
        p.a.post_send(
            &SendWr::send(i.into(), &[src.slice(0..(10 + i as usize)).ctx("slice")?]).inline(),
        )
        .ctx("post_send")?;
    }
    for i in 0..3u64 {
        let r = expect_ok(&p.cqb, 100 + i, Opcode::Recv)?;
        ensure!(r.byte_len == 10 + i, "message {i} has {} bytes", r.byte_len);
        let got = dst.buffer().to_vec(i as usize * 64, r.byte_len as usize);
        ensure!(
            got.iter().all(|&b| b == b'a' + i as u8),
            "receive {i} holds {:?}",
            String::from_utf8_lossy(&got)
        );
    }
    Ok(())
}

fn beyond_untouched(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 256, Access::LOCAL_WRITE)?;
    dst.buffer().fill(0, 256, 0xAA);
    src.buffer().fill(0, 64, 0x11);
    p.b.post_recv(&RecvWr::new(1, &[dst.slice(16..256).ctx("slice")?]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(2, &[src.slice(0..40).ctx("slice")?]))
        .ctx("post_send")?;
    expect_ok(&p.cqb, 1, Opcode::Recv)?;
    let all = dst.buffer().to_vec(0, 256);
    ensure!(
        all[..16].iter().all(|&b| b == 0xAA),
        "bytes before the receive changed"
    );
    ensure!(
        all[16..56].iter().all(|&b| b == 0x11),
        "message bytes wrong"
    );
    ensure!(
        all[56..].iter().all(|&b| b == 0xAA),
        "bytes beyond the message changed"
    );
    Ok(())
}

fn receiver_not_ready(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 1024, Access::empty())?;
    let dst = region(&p.db, 1024, Access::LOCAL_WRITE)?;
    src.buffer().fill(0, 1024, 0x5c);
    p.a.post_send(&SendWr::send(9, &[src.all()]))
        .ctx("post_send")?;
    // Nothing may complete, nothing may fail, while no receive is posted.
    expect_none(&p.cqa, Duration::from_millis(300))?;
    expect_none(&p.cqb, Duration::from_millis(10))?;
    ensure!(
        p.a.state() == EndpointState::Connected,
        "sender left Connected: {:?}",
        p.a.state()
    );
    p.b.post_recv(&RecvWr::new(4, &[dst.all()]))
        .ctx("post_recv")?;
    let r = expect_ok(&p.cqb, 4, Opcode::Recv)?;
    ensure!(r.byte_len == 1024, "length {}", r.byte_len);
    expect_ok(&p.cqa, 9, Opcode::Send)?;
    ensure!(
        dst.buffer().to_vec(0, 1024).iter().all(|&b| b == 0x5c),
        "payload lost or corrupted"
    );
    Ok(())
}

fn too_long(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[dst.slice(0..8).ctx("slice")?]))
        .ctx("post_recv")?;
    p.b.post_recv(&RecvWr::new(2, &[dst.slice(8..64).ctx("slice")?]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(5, &[src.all()]))
        .ctx("post_send")?;
    let r = expect_err(&p.cqb, 1, ErrorKind::LocalLength)?;
    ensure!(r.opcode == Opcode::Recv, "opcode {:?}", r.opcode);
    expect_err(&p.cqb, 2, ErrorKind::Flushed)?;
    expect_err(&p.cqa, 5, ErrorKind::RemoteInvalidRequest)?;
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(5))?;
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(5))?;
    Ok(())
}

fn send_imm(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[dst.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(2, &[src.slice(0..5).ctx("slice")?]).with_imm(0xdead_beef))
        .ctx("post_send")?;
    let r = expect_ok(&p.cqb, 1, Opcode::Recv)?;
    ensure!(r.imm == Some(0xdead_beef), "immediate {:?}", r.imm);
    ensure!(r.byte_len == 5, "length {}", r.byte_len);
    expect_ok(&p.cqa, 2, Opcode::Send)?;
    Ok(())
}

fn gather_scatter(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let a1 = region(&p.da, 16, Access::empty())?;
    let a2 = region(&p.da, 16, Access::empty())?;
    a1.buffer().write(0, b"0123456789");
    a2.buffer().write(0, b"abcdefghij");
    let d1 = region(&p.db, 16, Access::LOCAL_WRITE)?;
    let d2 = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[d1.slice(0..6).ctx("slice")?, d2.all()]))
        .ctx("post_recv")?;
    let sgl = [
        a1.slice(0..4).ctx("s")?,
        a2.slice(2..8).ctx("s")?,
        a1.slice(8..10).ctx("s")?,
    ];
    p.a.post_send(&SendWr::send(2, &sgl)).ctx("post_send")?;
    let r = expect_ok(&p.cqb, 1, Opcode::Recv)?;
    ensure!(r.byte_len == 12, "length {}", r.byte_len);
    let got = [d1.buffer().to_vec(0, 6), d2.buffer().to_vec(0, 6)].concat();
    ensure!(
        got == b"0123cdefgh89",
        "scattered {:?}",
        String::from_utf8_lossy(&got)
    );
    Ok(())
}

fn sge_over_max(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let max = p.da.info().caps.limits.max_sge as usize;
    let src = region(&p.da, max + 1, Access::empty())?;
    let sgl: Vec<_> = (0..=max)
        .map(|i| src.slice(i..i + 1).expect("in range"))
        .collect();
    match p.a.post_send(&SendWr::send(1, &sgl)) {
        Err(e) if e.kind() == ErrorKind::InvalidArgument => {}
        other => {
            return Err(format!(
                "{} gather entries (max {max}) returned {other:?}",
                max + 1
            ))
        }
    }
    // The endpoint is still usable.
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[dst.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(2, &sgl[..max]))
        .ctx("post_send at max")?;
    let r = expect_ok(&p.cqb, 1, Opcode::Recv)?;
    ensure!(r.byte_len == max as u64, "length {}", r.byte_len);
    Ok(())
}

fn zero_byte(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let dst = region(&p.db, 16, Access::LOCAL_WRITE)?;
    dst.buffer().fill(0, 16, 0x77);
    p.b.post_recv(&RecvWr::new(1, &[dst.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(2, &[])).ctx("post_send")?;
    let r = expect_ok(&p.cqb, 1, Opcode::Recv)?;
    ensure!(r.byte_len == 0, "length {}", r.byte_len);
    ensure!(
        dst.buffer().to_vec(0, 16).iter().all(|&b| b == 0x77),
        "zero-byte message changed the buffer"
    );
    expect_ok(&p.cqa, 2, Opcode::Send)?;
    Ok(())
}

/// A receive with no scatter entries takes a zero-byte message (and is a receive like any
/// other: it consumes one message, in order).
fn zero_byte_empty_receive(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let dst = region(&p.db, 16, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[]))
        .ctx("post_recv with no entries")?;
    p.b.post_recv(&RecvWr::new(2, &[dst.all()]))
        .ctx("post_recv")?;
    let src = region(&p.da, 16, Access::empty())?;
    src.buffer().write(0, b"second");
    p.a.post_send(&SendWr::send(3, &[])).ctx("post_send")?;
    p.a.post_send(&SendWr::send(4, &[src.slice(0..6).ctx("s")?]))
        .ctx("post_send")?;
    let r = expect_ok(&p.cqb, 1, Opcode::Recv)?;
    ensure!(r.byte_len == 0, "length {}", r.byte_len);
    let r = expect_ok(&p.cqb, 2, Opcode::Recv)?;
    ensure!(
        r.byte_len == 6 && dst.buffer().to_vec(0, 6) == b"second",
        "second message: {} bytes, {:?}",
        r.byte_len,
        dst.buffer().to_vec(0, 6)
    );
    crate::harness::expect_ok_each(&p.cqa, &[(3, Opcode::Send), (4, Opcode::Send)])?;
    Ok(())
}

fn inline_free(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    src.buffer().fill(0, 64, b'x');
    // No receive yet: the message cannot have left, so only a copy at post time saves it.
    p.a.post_send(&SendWr::send(1, &[src.all()]).inline())
        .ctx("post_send inline")?;
    src.buffer().fill(0, 64, b'y');
    drop(src);
    p.b.post_recv(&RecvWr::new(2, &[dst.all()]))
        .ctx("post_recv")?;
    expect_ok(&p.cqb, 2, Opcode::Recv)?;
    ensure!(
        dst.buffer().to_vec(0, 64).iter().all(|&b| b == b'x'),
        "inline payload was not copied at post time"
    );
    Ok(())
}

fn inline_over_max(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let max = p.da.info().caps.limits.max_inline as usize;
    let src = region(&p.da, max + 1, Access::empty())?;
    match p.a.post_send(&SendWr::send(1, &[src.all()]).inline()) {
        Err(e) if e.kind() == ErrorKind::InvalidArgument => Ok(()),
        other => Err(format!(
            "inline of {} bytes (max {max}) returned {other:?}",
            max + 1
        )),
    }
}

/// An endpoint configured with fewer gather/scatter entries and a smaller inline payload
/// than its domain's refuses a request over them (`InvalidArgument`, nothing posted, the
/// endpoint usable) and carries requests within them; a configuration beyond the domain's
/// limits is refused when the endpoint is made.
fn endpoint_limits(ctx: &Ctx) -> CaseResultOf {
    // Within both sides' domains (a mixed pair's differ).
    let domain_inline =
        (ctx.info().caps.limits.max_inline).min(ctx.target_info().caps.limits.max_inline);
    let inline = domain_inline.min(8);
    let inlines = ctx.info().caps.ops.contains(OpSet::INLINE);
    let p = ctx.pair_with(crate::harness::PairOpts {
        max_sge: Some(1),
        max_inline: Some(inline),
        ..Default::default()
    })?;
    let src = region(&p.da, 64, Access::empty())?;
    let dst = region(&p.db, 64, Access::LOCAL_WRITE)?;
    src.buffer().write(0, b"abcdefghijklmnop");
    let two = [src.slice(0..2).ctx("s")?, src.slice(2..4).ctx("s")?];
    let invalid = |what: &str, r: fabric::Result<()>| match r {
        Err(e) if e.kind() == ErrorKind::InvalidArgument => Ok(()),
        other => Err(format!("{what} returned {other:?}")),
    };
    invalid(
        "a send of 2 entries (max_sge 1)",
        p.a.post_send(&SendWr::send(1, &two)),
    )?;
    invalid(
        "a receive of 2 entries (max_sge 1)",
        p.b.post_recv(&RecvWr::new(
            2,
            &[dst.slice(0..8).ctx("s")?, dst.slice(8..16).ctx("s")?],
        )),
    )?;
    if inlines {
        let over = [src.slice(0..inline as usize + 1).ctx("s")?];
        invalid(
            &format!(
                "an inline send of {} bytes (max_inline {inline})",
                inline + 1
            ),
            p.a.post_send(&SendWr::send(3, &over).inline()),
        )?;
    }
    // Within the limits: one entry, and inline up to the endpoint's limit.
    p.b.post_recv(&RecvWr::new(4, &[dst.slice(0..16).ctx("s")?]))
        .ctx("post_recv")?;
    p.b.post_recv(&RecvWr::new(5, &[dst.slice(16..32).ctx("s")?]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::send(6, &[src.slice(0..16).ctx("s")?]))
        .ctx("post_send of one entry")?;
    let second = src.slice(0..inline as usize).ctx("s")?;
    let second = if inline > 0 && inlines {
        SendWr::send(7, std::slice::from_ref(&second)).inline()
    } else {
        SendWr::send(7, std::slice::from_ref(&second))
    };
    p.a.post_send(&second)
        .ctx("post_send at the inline limit")?;
    let r = expect_ok(&p.cqb, 4, Opcode::Recv)?;
    ensure!(r.byte_len == 16, "first: {} bytes", r.byte_len);
    let r = expect_ok(&p.cqb, 5, Opcode::Recv)?;
    ensure!(
        r.byte_len == u64::from(inline)
            && dst.buffer().to_vec(16, inline as usize) == b"abcdefghijklmnop"[..inline as usize],
        "second: {} bytes",
        r.byte_len
    );
    expect_ok_each(&p.cqa, &[(6, Opcode::Send), (7, Opcode::Send)])?;
    // Beyond the domain's limits, or no entry at all: refused before any connection.
    let limits = p.da.info().caps.limits;
    let cq = p.da.create_cq(8).ctx("create_cq")?;
    let listener =
        p.db.listen(std::net::SocketAddr::new(p.b.local_addr().ip(), 0))
            .ctx("listen")?;
    for (sge, inl) in [
        (Some(limits.max_sge + 1), None),
        (Some(0), None),
        (None, Some(limits.max_inline + 1)),
    ] {
        let mut cfg = EndpointConfig::new(&cq);
        cfg.max_sge = sge;
        cfg.max_inline = inl;
        cfg.timeout = Duration::from_secs(5);
        match p.da.connect(listener.local_addr(), &cfg) {
            Err(e) if e.kind() == ErrorKind::InvalidArgument => {}
            other => {
                return Err(format!(
                "an endpoint of max_sge {sge:?}, max_inline {inl:?} (domain: {}, {}) returned {:?}",
                limits.max_sge,
                limits.max_inline,
                other.map(|_| "an endpoint")
            ))
            }
        }
    }
    Ok(())
}

fn two_processes(ctx: &Ctx) -> CaseResultOf {
    let peer = ctx.peer(&["--mode", "echo"])?;
    let out = region(&peer.domain, 4096, Access::empty())?;
    let back = region(&peer.domain, 4096, Access::LOCAL_WRITE)?;
    for round in 0..5u8 {
        let msg: Vec<u8> = b"echo:"
            .iter()
            .copied()
            .chain((0..1000).map(|i| (i as u8) ^ round))
            .collect();
        out.buffer().write(0, &msg);
        peer.ep
            .post_recv(&RecvWr::new(10 + u64::from(round), &[back.all()]))
            .ctx("post_recv")?;
        peer.ep
            .post_send(&SendWr::send(
                u64::from(round),
                &[out.slice(0..msg.len()).ctx("slice")?],
            ))
            .ctx("post_send")?;
        let both = expect_ok_each(
            &peer.cq,
            &[
                (u64::from(round), Opcode::Send),
                (10 + u64::from(round), Opcode::Recv),
            ],
        )?;
        let r = &both[1];
        ensure!(r.byte_len == 1000, "echo length {}", r.byte_len);
        ensure!(
            back.buffer().to_vec(0, 1000) == msg[5..],
            "echo payload differs in round {round}"
        );
    }
    out.buffer().write(0, b"quit");
    peer.ep
        .post_send(&SendWr::send(99, &[out.slice(0..4).ctx("slice")?]))
        .ctx("post quit")?;
    expect_ok(&peer.cq, 99, Opcode::Send)?;
    let mut peer = peer;
    let code = peer.wait_exit(Duration::from_secs(10))?;
    ensure!(code == 0, "peer exited with {code}");
    Ok(())
}

/// Messages each side of [`both_directions`] sends.
const BOTH_WAYS: u64 = 1000;
/// Sends each side keeps outstanding, and receive slots (twice as many) it keeps posted.
const BOTH_WINDOW: u64 = 8;
/// Length of each message: its sequence number, then the sender's mark.
const BOTH_LEN: usize = 64;
/// Receive contexts of [`both_directions`] (slot number added).
const BOTH_RECV: u64 = 1 << 32;

/// One side of [`both_directions`]: sends [`BOTH_WAYS`] messages marked `mark` with
/// [`BOTH_WINDOW`] outstanding, while it receives as many marked `peer_mark`, in order,
/// reposting each receive slot as it completes. Fails when its queue shows nothing for the
/// run's timeout.
fn one_direction(
    ctx: &Ctx,
    d: &AnyDomain,
    ep: &AnyEndpoint,
    cq: &AnyCq,
    marks: (u8, u8),
) -> CaseResultOf {
    let (mark, peer_mark) = marks;
    let slots = 2 * BOTH_WINDOW;
    let src = region(d, BOTH_LEN * BOTH_WINDOW as usize, Access::empty())?;
    let dst = region(d, BOTH_LEN * slots as usize, Access::LOCAL_WRITE)?;
    fn slot(r: &MemoryRegion, i: u64) -> Result<fabric::Slice<'_>, String> {
        let at = (i as usize) * BOTH_LEN;
        r.slice(at..at + BOTH_LEN).ctx("slice")
    }
    for i in 0..slots {
        ep.post_recv(&RecvWr::new(BOTH_RECV + i, &[slot(&dst, i)?]))
            .ctx("post_recv")?;
    }
    let (mut sent, mut done, mut got) = (0u64, 0u64, 0u64);
    let mut out = Vec::with_capacity(16);
    let mut heard = Instant::now();
    while done < BOTH_WAYS || got < BOTH_WAYS {
        while sent < BOTH_WAYS && sent - done < BOTH_WINDOW {
            // Slot `sent % window` was last sent `window` messages ago, which completed.
            let s = sent % BOTH_WINDOW;
            let mut msg = [mark; BOTH_LEN];
            msg[..8].copy_from_slice(&sent.to_le_bytes());
            src.buffer().write(s as usize * BOTH_LEN, &msg);
            ep.post_send(&SendWr::send(sent, &[slot(&src, s)?]))
                .ctx("post_send")?;
            sent += 1;
        }
        if cq.poll(&mut out, 16).ctx("poll")? == 0 {
            ensure!(
                heard.elapsed() < ctx.timeout,
                "nothing completed for {:?}: {sent} of {BOTH_WAYS} sent, {done} completed, {got} received",
                ctx.timeout
            );
            std::thread::yield_now();
            continue;
        }
        heard = Instant::now();
        for c in out.drain(..) {
            ensure!(c.status == Status::Success, "completion failed: {c:?}");
            match c.opcode {
                Opcode::Send => {
                    ensure!(
                        c.context == done,
                        "send {} completed as number {done}",
                        c.context
                    );
                    done += 1;
                }
                Opcode::Recv => {
                    let i = got % slots;
                    ensure!(
                        c.context == BOTH_RECV + i,
                        "receive {:#x} completed as number {got}",
                        c.context
                    );
                    ensure!(
                        c.byte_len == BOTH_LEN as u64,
                        "message of {} bytes",
                        c.byte_len
                    );
                    let b = dst.buffer().to_vec(i as usize * BOTH_LEN, BOTH_LEN);
                    let seq = u64::from_le_bytes(b[..8].try_into().expect("8 bytes"));
                    ensure!(
                        seq == got && b[8..].iter().all(|&x| x == peer_mark),
                        "receive {got} holds message {seq} (mark {:#x})",
                        b[8]
                    );
                    got += 1;
                    ep.post_recv(&RecvWr::new(BOTH_RECV + i, &[slot(&dst, i)?]))
                        .ctx("repost")?;
                }
                o => return Err(format!("unexpected completion {o:?}")),
            }
        }
    }
    Ok(())
}

fn both_directions(ctx: &Ctx) -> CaseResultOf {
    // Both ends send to each other at once, each from its own thread: every message
    // arrives, in order, and neither end stalls. (On siw a fenced request could stop a
    // connection for good when both ends were fenced behind a read of the other: see
    // fabric-verbs' `Profile::soft_fence`.)
    let p = ctx.pair()?;
    std::thread::scope(|s| {
        let a = s.spawn(|| one_direction(ctx, &p.da, &p.a, &p.cqa, (b'a', b'b')));
        let b = one_direction(ctx, &p.db, &p.b, &p.cqb, (b'b', b'a'));
        let a = a.join().map_err(|_| "side a panicked".to_string())?;
        a.map_err(|e| format!("side a: {e}"))?;
        b.map_err(|e| format!("side b: {e}"))
    })?;
    note(format!(
        "{BOTH_WAYS} messages of {BOTH_LEN} B each way at once, {BOTH_WINDOW} outstanding a side"
    ));
    Ok(())
}
