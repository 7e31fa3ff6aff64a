//! Section 4: RMA (write, read, write with immediate, ordering, progress).

use std::time::Duration;

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{
    all_access, expect_ok, expect_ok_each, next, region, Case, CaseResultOf, Ctx, Ctxt,
};
use crate::peer::pattern;

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "rma.write_delivery_complete", "4", OpSet::WRITE => write_delivered;
        "rma.read", "4", OpSet::READ => read;
        "rma.write_with_immediate", "4", OpSet::WRITE_IMM => write_imm;
        "rma.write_then_send_ordering", "4", OpSet::WRITE | OpSet::SEND => write_then_send;
        "rma.transmit_complete_ordering", "4", OpSet::WRITE | OpSet::SEND | OpSet::READ => transmit_complete_ordering;
        "rma.read_after_write", "4", OpSet::WRITE | OpSet::READ => read_after_write;
        "rma.fenced_write_after_read", "4", OpSet::WRITE | OpSet::READ => fenced_write_after_read;
        "rma.one_mib_write_and_read", "4", OpSet::WRITE | OpSet::READ => one_mib;
        "rma.zero_length_write_and_read", "4", OpSet::WRITE | OpSet::READ => zero_length;
        "rma.gather_write_scatter_read", "4", OpSet::WRITE | OpSet::READ => gather_scatter;
        "rma.target_never_polls_two_processes", "4", OpSet::WRITE | OpSet::READ => target_never_polls;
    }
}

fn write_delivered(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 4096, Access::empty())?;
    let dst = region(&p.db, 8192, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    for i in 0..4096 {
        src.buffer().write(i, &[(i % 253) as u8]);
    }
    p.a.post_send(&SendWr::write(1, &[src.all()], dst.desc().at(100)))
        .ctx("post write")?;
    expect_ok(&p.cqa, 1, Opcode::Write)?;
    // The completion alone must mean the bytes are in target memory: check at once, and
    // the target never polled its queue.
    let got = dst.buffer().to_vec(100, 4096);
    ensure!(
        got == src.buffer().to_vec(0, 4096),
        "target memory does not hold the written bytes at completion time"
    );
    ensure!(
        dst.buffer().to_vec(0, 100).iter().all(|&b| b == 0),
        "bytes before the target range changed"
    );
    let mut out = Vec::new();
    ensure!(
        p.cqb.poll(&mut out, 4).ctx("poll")? == 0,
        "a plain write produced a target completion: {out:?}"
    );
    Ok(())
}

fn read(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.db, 4096, Access::REMOTE_READ)?;
    src.buffer().write(1000, b"remote bytes");
    let dst = region(&p.da, 64, Access::LOCAL_WRITE)?;
    dst.buffer().fill(0, 64, 0xEE);
    p.a.post_send(&SendWr::read(
        4,
        &[dst.slice(8..20).ctx("slice")?],
        src.desc().at(1000),
    ))
    .ctx("post read")?;
    let c = expect_ok(&p.cqa, 4, Opcode::Read)?;
    ensure!(c.byte_len == 12, "read completion length {}", c.byte_len);
    ensure!(
        dst.buffer().to_vec(8, 12) == b"remote bytes",
        "read data differs"
    );
    ensure!(
        dst.buffer()
            .to_vec(0, 8)
            .iter()
            .chain(dst.buffer().to_vec(20, 44).iter())
            .all(|&b| b == 0xEE),
        "read wrote outside its sink"
    );
    Ok(())
}

fn write_imm(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 256, Access::empty())?;
    src.buffer().fill(0, 256, 3);
    let dst = region(&p.db, 256, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let rq = region(&p.db, 16, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(11, &[rq.all()]))
        .ctx("post_recv")?;
    p.a.post_send(
        &SendWr::write(12, &[src.slice(0..200).ctx("slice")?], dst.desc().at(0))
            .with_imm(0x1234_5678),
    )
    .ctx("post write imm")?;
    expect_ok(&p.cqa, 12, Opcode::Write)?;
    let r = expect_ok(&p.cqb, 11, Opcode::RecvWriteWithImm)?;
    ensure!(r.imm == Some(0x1234_5678), "immediate {:?}", r.imm);
    ensure!(r.byte_len == 200, "written length {}", r.byte_len);
    ensure!(
        dst.buffer().to_vec(0, 200).iter().all(|&b| b == 3),
        "written data missing at the immediate's completion"
    );
    ensure!(
        rq.buffer().to_vec(0, 16).iter().all(|&b| b == 0),
        "write with immediate put data into the receive buffer"
    );
    Ok(())
}

fn write_then_send(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let big = 256 << 10;
    let src = region(&p.da, big, Access::empty())?;
    src.buffer().fill(0, big, 0x42);
    let note = region(&p.da, 8, Access::empty())?;
    let dst = region(&p.db, big, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    let rq = region(&p.db, 8, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(1, &[rq.all()]))
        .ctx("post_recv")?;
    p.a.post_send(&SendWr::write(2, &[src.all()], dst.desc().at(0)).unsignaled())
        .ctx("post write")?;
    p.a.post_send(&SendWr::send(3, &[note.all()]))
        .ctx("post send")?;
    expect_ok(&p.cqb, 1, Opcode::Recv)?;
    // At the receive completion the earlier write must be visible, every byte of it.
    ensure!(
        dst.buffer().to_vec(0, big).iter().all(|&b| b == 0x42),
        "send overtook the write posted before it"
    );
    expect_ok(&p.cqa, 3, Opcode::Send)?;
    Ok(())
}

/// Transmit-complete writes and sends (`SendFlags::TRANSMIT_COMPLETE`) keep the
/// contract's ordering: a send after a write is received after the write's data is
/// visible, and a read after a write returns the written data.
fn transmit_complete_ordering(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let big = 64 << 10;
    let src = region(&p.da, big, Access::empty())?;
    let note = region(&p.da, 8, Access::empty())?;
    let back = region(&p.da, big, Access::LOCAL_WRITE)?;
    let dst = region(
        &p.db,
        big,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    let rq = region(&p.db, 8, Access::LOCAL_WRITE)?;
    for round in 0..3u64 {
        let fill = 0x40 | round as u8;
        src.buffer().fill(0, big, fill);
        p.b.post_recv(&RecvWr::new(100 + round, &[rq.all()]))
            .ctx("post_recv")?;
        p.a.post_send(
            &SendWr::write(10 + round, &[src.all()], dst.desc().at(0)).transmit_complete(),
        )
        .ctx("post write")?;
        p.a.post_send(&SendWr::send(20 + round, &[note.all()]).transmit_complete())
            .ctx("post send")?;
        p.a.post_send(&SendWr::read(30 + round, &[back.all()], dst.desc().at(0)))
            .ctx("post read")?;
        expect_ok(&p.cqb, 100 + round, Opcode::Recv)?;
        ensure!(
            dst.buffer().to_vec(0, big).iter().all(|&b| b == fill),
            "round {round}: the send overtook the transmit-complete write posted before it"
        );
        expect_ok_each(
            &p.cqa,
            &[
                (10 + round, Opcode::Write),
                (20 + round, Opcode::Send),
                (30 + round, Opcode::Read),
            ],
        )?;
        ensure!(
            back.buffer().to_vec(0, big).iter().all(|&b| b == fill),
            "round {round}: a read after a transmit-complete write returned other bytes"
        );
    }
    // Completions stay in post order: a transmit-complete write behind a long read
    // completes after it (on iWARP the device would complete the write at transmit).
    let far = region(&p.db, 1 << 20, Access::REMOTE_READ)?;
    let near = region(&p.da, 1 << 20, Access::LOCAL_WRITE)?;
    p.a.post_send(&SendWr::read(40, &[near.all()], far.desc().at(0)))
        .ctx("post the long read")?;
    p.a.post_send(&SendWr::write(41, &[note.all()], dst.desc().at(0)).transmit_complete())
        .ctx("post the write behind it")?;
    let first = next(&p.cqa, Duration::from_secs(10))?;
    let second = next(&p.cqa, Duration::from_secs(10))?;
    ensure!(
        (first.context, first.opcode, first.status) == (40, Opcode::Read, Status::Success)
            && (second.context, second.opcode, second.status)
                == (41, Opcode::Write, Status::Success),
        "completions out of post order or failed: {first:?}, then {second:?}"
    );
    Ok(())
}

fn read_after_write(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let src = region(&p.da, 64 << 10, Access::LOCAL_WRITE)?;
    let back = region(&p.da, 64 << 10, Access::LOCAL_WRITE)?;
    let dst = region(
        &p.db,
        64 << 10,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    dst.buffer().fill(0, 64 << 10, 0x01);
    for round in 0..4u8 {
        src.buffer().fill(0, 64 << 10, 0x80 | round);
        p.a.post_send(
            &SendWr::write(10 + u64::from(round), &[src.all()], dst.desc().at(0)).unsignaled(),
        )
        .ctx("post write")?;
        p.a.post_send(&SendWr::read(
            20 + u64::from(round),
            &[back.all()],
            dst.desc().at(0),
        ))
        .ctx("post read")?;
        expect_ok(&p.cqa, 20 + u64::from(round), Opcode::Read)?;
        ensure!(
            back.buffer()
                .to_vec(0, 64 << 10)
                .iter()
                .all(|&b| b == 0x80 | round),
            "read did not return the data written before it (round {round})"
        );
    }
    Ok(())
}

fn fenced_write_after_read(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let len = 128 << 10;
    let old = region(&p.da, len, Access::LOCAL_WRITE)?;
    let new = region(&p.da, len, Access::empty())?;
    new.buffer().fill(0, len, 0xBB);
    let target = region(
        &p.db,
        len,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ,
    )?;
    target.buffer().fill(0, len, 0xAA);
    p.a.post_send(&SendWr::read(1, &[old.all()], target.desc().at(0)))
        .ctx("post read")?;
    p.a.post_send(&SendWr::write(2, &[new.all()], target.desc().at(0)).fenced())
        .ctx("post fenced write")?;
    expect_ok(&p.cqa, 1, Opcode::Read)?;
    expect_ok(&p.cqa, 2, Opcode::Write)?;
    ensure!(
        old.buffer().to_vec(0, len).iter().all(|&b| b == 0xAA),
        "the fenced write overtook the read before it"
    );
    ensure!(
        target.buffer().to_vec(0, len).iter().all(|&b| b == 0xBB),
        "the fenced write did not land"
    );
    Ok(())
}

fn one_mib(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let len = 1 << 20;
    let src = region(&p.da, len, Access::LOCAL_WRITE)?;
    for i in 0..len {
        src.buffer().write(i, &[pattern(i)]);
    }
    let dst = region(&p.db, len, all_access())?;
    p.a.post_send(&SendWr::write(1, &[src.all()], dst.desc().at(0)))
        .ctx("post write")?;
    expect_ok(&p.cqa, 1, Opcode::Write)?;
    ensure!(
        dst.buffer().to_vec(0, len) == src.buffer().to_vec(0, len),
        "1 MiB write corrupted"
    );
    src.buffer().fill(0, len, 0);
    p.a.post_send(&SendWr::read(2, &[src.all()], dst.desc().at(0)))
        .ctx("post read")?;
    let c = expect_ok(&p.cqa, 2, Opcode::Read)?;
    ensure!(c.byte_len == len as u64, "read length {}", c.byte_len);
    ensure!(
        (0..len).all(|i| src.buffer().to_vec(i, 1)[0] == pattern(i)),
        "1 MiB read corrupted"
    );
    Ok(())
}

fn zero_length(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let local = region(&p.da, 16, Access::LOCAL_WRITE)?;
    let remote = region(&p.db, 16, all_access())?;
    p.a.post_send(&SendWr::write(1, &[], remote.desc().at(0)))
        .ctx("post zero-length write")?;
    p.a.post_send(&SendWr::read(
        2,
        &[local.slice(0..0).ctx("slice")?],
        remote.desc().at(0),
    ))
    .ctx("post zero-length read")?;
    let w = expect_ok(&p.cqa, 1, Opcode::Write)?;
    let r = expect_ok(&p.cqa, 2, Opcode::Read)?;
    ensure!(
        w.byte_len == 0 && r.byte_len == 0,
        "lengths {} {}",
        w.byte_len,
        r.byte_len
    );
    Ok(())
}

fn gather_scatter(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let a = region(&p.da, 64, Access::LOCAL_WRITE)?;
    a.buffer().write(0, b"AAAAbbbbCCCC");
    let t = region(&p.db, 64, all_access())?;
    let sgl = [a.slice(8..12).ctx("s")?, a.slice(0..4).ctx("s")?];
    p.a.post_send(&SendWr::write(1, &sgl, t.desc().at(10)))
        .ctx("post gather write")?;
    expect_ok(&p.cqa, 1, Opcode::Write)?;
    ensure!(
        t.buffer().to_vec(10, 8) == b"CCCCAAAA",
        "gather write placed {:?}",
        String::from_utf8_lossy(&t.buffer().to_vec(10, 8))
    );
    let b = region(&p.da, 64, Access::LOCAL_WRITE)?;
    let scat = [b.slice(40..43).ctx("s")?, b.slice(0..5).ctx("s")?];
    p.a.post_send(&SendWr::read(2, &scat, t.desc().at(10)))
        .ctx("post scatter read")?;
    expect_ok(&p.cqa, 2, Opcode::Read)?;
    ensure!(
        b.buffer().to_vec(40, 3) == b"CCC" && b.buffer().to_vec(0, 5) == b"CAAAA",
        "scatter read wrong"
    );
    Ok(())
}

fn target_never_polls(ctx: &Ctx) -> CaseResultOf {
    let peer = ctx.peer(&["--mode", "idle"])?;
    let local = region(&peer.domain, 64 << 10, Access::LOCAL_WRITE)?;
    // Read what the peer put there, write over part of it, read it back: all while the
    // peer process never polls.
    peer.ep
        .post_send(&SendWr::read(1, &[local.all()], peer.desc.at(0)))
        .ctx("post read")?;
    expect_ok(&peer.cq, 1, Opcode::Read)?;
    ensure!(
        (0..64 << 10).all(|i| local.buffer().to_vec(i, 1)[0] == pattern(i)),
        "read from the idle peer returned wrong data"
    );
    local.buffer().fill(0, 4096, 0xC3);
    peer.ep
        .post_send(&SendWr::write(
            2,
            &[local.slice(0..4096).ctx("s")?],
            peer.desc.at(8192),
        ))
        .ctx("post write")?;
    expect_ok(&peer.cq, 2, Opcode::Write)?;
    local.buffer().fill(0, 64 << 10, 0);
    peer.ep
        .post_send(&SendWr::read(
            3,
            &[local.slice(0..8192 + 4096 + 16).ctx("s")?],
            peer.desc.at(0),
        ))
        .ctx("post read back")?;
    expect_ok(&peer.cq, 3, Opcode::Read)?;
    ensure!(
        local.buffer().to_vec(8192, 4096).iter().all(|&b| b == 0xC3),
        "write to the idle peer did not land"
    );
    ensure!(
        local
            .buffer()
            .to_vec(8192 + 4096, 16)
            .iter()
            .enumerate()
            .all(|(i, &b)| b == pattern(8192 + 4096 + i)),
        "write overran"
    );
    let _ = Duration::ZERO;
    Ok(())
}
