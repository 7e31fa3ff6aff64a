//! Section 2: memory registration.

use std::collections::HashSet;
use std::sync::Arc;
use std::time::Duration;

use fabric::prelude::*;

use super::cases;
use crate::ensure;
use crate::harness::{
    all_access, expect_err, expect_ok, expect_ok_each, next, note, region, wait_state, Case,
    CaseResultOf, Ctx, Ctxt, Pair,
};

pub(super) fn cases() -> Vec<Case> {
    cases! {
        "mr.remote_write_needs_local_write", "2", OpSet::empty() => remote_needs_local_write;
        "mr.descriptor_is_plain_data", "2", OpSet::empty() => descriptor_plain;
        "mr.keys_distinct_and_unguessable", "2", OpSet::empty() => keys_unguessable;
        "mr.bad_key", "2", OpSet::WRITE => bad_key;
        "mr.bad_key_transmit_complete", "2", OpSet::WRITE => bad_key_transmit_complete;
        "mr.bad_key_after_confirmed_transmit_complete", "2", OpSet::WRITE | OpSet::READ => bad_key_after_confirmed;
        "mr.write_out_of_bounds", "2", OpSet::WRITE => write_oob;
        "mr.read_out_of_bounds", "2", OpSet::READ => read_oob;
        "mr.write_needs_remote_write", "2", OpSet::WRITE => write_needs_access;
        "mr.read_needs_remote_read", "2", OpSet::READ | OpSet::READ_PROTECTION => read_needs_access;
        "mr.deregistered_key_is_dead", "2", OpSet::WRITE => deregistered_dead;
        "mr.key_of_another_domain", "2", OpSet::WRITE => other_domain_key;
        "mr.memory_outlives_deregistration_in_flight", "2", OpSet::WRITE => outlives;
        "mr.local_region_of_another_domain", "2", OpSet::SEND => local_other_domain;
        "mr.local_sink_needs_local_write", "2", OpSet::READ => sink_needs_local_write;
        "mr.slice_out_of_bounds", "2", OpSet::empty() => slice_oob;
    }
}

fn remote_needs_local_write(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    for bad in [
        Access::REMOTE_WRITE,
        Access::REMOTE_ATOMIC,
        Access::REMOTE_WRITE | Access::REMOTE_READ,
    ] {
        match d.register(Arc::new(Buffer::new(64)), bad) {
            Err(e) if e.kind() == ErrorKind::InvalidArgument => {}
            other => {
                return Err(format!(
                    "registering with {bad:?} returned {other:?}, expected InvalidArgument"
                ))
            }
        }
    }
    for good in [
        Access::REMOTE_READ,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        Access::all(),
        Access::empty(),
    ] {
        d.register(Arc::new(Buffer::new(64)), good)
            .ctx(&format!("registering with {good:?}"))?;
    }
    Ok(())
}

fn descriptor_plain(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let mr = region(&d, 12345, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
    let desc = mr.desc();
    ensure!(
        desc.addr == mr.buffer().addr(),
        "descriptor address {:#x} is not the buffer's {:#x}",
        desc.addr,
        mr.buffer().addr()
    );
    ensure!(desc.len == 12345, "descriptor length {}", desc.len);
    let back = RemoteDesc::from_bytes(&desc.to_bytes()).ctx("decode")?;
    ensure!(
        back == desc,
        "descriptor does not survive its byte encoding"
    );
    ensure!(
        RemoteDesc::from_bytes(&desc.to_bytes()[..10]).is_err(),
        "a truncated descriptor decoded"
    );
    Ok(())
}

fn keys_unguessable(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let regions: Vec<MemoryRegion> = (0..64)
        .map(|_| region(&d, 64, Access::LOCAL_WRITE | Access::REMOTE_WRITE))
        .collect::<Result<_, _>>()?;
    let keys: Vec<u32> = regions.iter().map(|r| r.desc().key).collect();
    let distinct: HashSet<u32> = keys.iter().copied().collect();
    ensure!(distinct.len() == keys.len(), "keys repeat: {keys:x?}");
    if ctx.initiator == "tcp" {
        // The software provider's keys are random: consecutive registrations must not
        // produce nearby keys.
        let close = keys
            .windows(2)
            .filter(|w| w[1].abs_diff(w[0]) < 1 << 16)
            .count();
        ensure!(
            close <= 2,
            "{close} of 63 consecutive key pairs are within 65536 of each other: {keys:x?}"
        );
        drop(regions);
        let again: Vec<u32> = (0..64)
            .map(|_| region(&d, 64, Access::LOCAL_WRITE).map(|r| r.desc().key))
            .collect::<Result<_, _>>()?;
        ensure!(
            again.iter().all(|k| !distinct.contains(k)),
            "a freed key came back at once"
        );
    }
    Ok(())
}

/// Posts `wr` built from a fresh pair and checks: RemoteAccess at the initiator, both ends
/// in the error state, and the target bytes untouched.
fn remote_access_error(
    ctx: &Ctx,
    target_access: Access,
    build: impl for<'a> Fn(&'a Pair, &'a MemoryRegion, &'a MemoryRegion) -> Result<(), String>,
) -> CaseResultOf {
    let p = ctx.pair()?;
    let local = region(&p.da, 8192, Access::LOCAL_WRITE)?;
    local.buffer().fill(0, 8192, 0x99);
    let target = region(&p.db, 4096, target_access)?;
    target.buffer().fill(0, 4096, 0x11);
    let rq = region(&p.db, 64, Access::LOCAL_WRITE)?;
    p.b.post_recv(&RecvWr::new(70, &[rq.all()]))
        .ctx("post_recv at target")?;
    build(&p, &local, &target)?;
    let c = expect_err(&p.cqa, 1, ErrorKind::RemoteAccess)?;
    ensure!(
        c.provider_code.is_some(),
        "error completion lost the provider's code: {c:?}"
    );
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(5))?;
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(5))?;
    expect_err(&p.cqb, 70, ErrorKind::Flushed)?;
    untouched(&target)
}

/// The 4 KiB target of a refused access still holds its 0x11 fill.
fn untouched(target: &MemoryRegion) -> CaseResultOf {
    ensure!(
        target.buffer().to_vec(0, 4096).iter().all(|&b| b == 0x11),
        "refused access changed target memory"
    );
    Ok(())
}

fn bad_key(ctx: &Ctx) -> CaseResultOf {
    remote_access_error(ctx, all_access(), |p, l, t| {
        let mut at = t.desc().at(0);
        at.key ^= 0x5a5a_0001;
        p.a.post_send(&SendWr::write(1, &[l.slice(0..64).ctx("s")?], at))
            .ctx("post")
    })
}

/// A transmit-complete write with a bad key (`SendFlags::TRANSMIT_COMPLETE`), and a
/// delivery-complete write behind it: the first's completion may come before the peer
/// refuses it (iWARP), but the refusal still ends the connection: both ends enter the
/// error state, the initiator's event names RemoteAccess, the write behind it completes
/// Flushed (it is not blamed for the refusal) or, posted after the connection ended, is
/// refused at post, and the target bytes are untouched.
fn bad_key_transmit_complete(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let local = region(&p.da, 64, Access::empty())?;
    local.buffer().fill(0, 64, 0x99);
    let target = region(&p.db, 4096, all_access())?;
    target.buffer().fill(0, 4096, 0x11);
    let mut at = target.desc().at(0);
    at.key ^= 0x5a5a_0001;
    p.a.post_send(&SendWr::write(1, &[local.all()], at).transmit_complete())
        .ctx("post")?;
    // The refusal may have ended the connection already (the first write's completion
    // does not wait for the peer): then the post itself is refused.
    let behind = match p
        .a
        .post_send(&SendWr::write(2, &[local.all()], target.desc().at(64)))
    {
        Ok(()) => true,
        Err(e) if e.kind() == ErrorKind::InvalidState => false,
        Err(e) => return Err(format!("post the write behind it: {e}")),
    };
    let c = next(&p.cqa, Duration::from_secs(10))?;
    ensure!(
        c.context == 1 && c.opcode == Opcode::Write,
        "expected the refused write's completion first, got {c:?}"
    );
    match c.status {
        Status::Success => note("the transmit-complete write completed before the peer refused it"),
        Status::Error(ErrorKind::RemoteAccess | ErrorKind::Flushed) => {}
        other => {
            return Err(format!(
                "a transmit-complete write with a bad key completed {other:?}"
            ))
        }
    }
    if behind {
        expect_err(&p.cqa, 2, ErrorKind::Flushed)?;
    }
    wait_state(&p.a, EndpointState::Error, Duration::from_secs(10))?;
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(10))?;
    match p.a.next_event() {
        Some(EndpointEvent::Failed(e)) if e.kind() == ErrorKind::RemoteAccess => {}
        other => return Err(format!("initiator's event after the refusal: {other:?}")),
    }
    untouched(&target)
}

/// A transmit-complete write that a later read confirmed, then a write with a bad key:
/// the refusal is the bad write's, which completes RemoteAccess as in `mr.bad_key` (once a
/// read has confirmed a transmit-complete request, it no longer stands in the way of
/// naming the refused one).
fn bad_key_after_confirmed(ctx: &Ctx) -> CaseResultOf {
    remote_access_error(ctx, all_access(), |p, l, t| {
        // The target's own bytes, so that the check of untouched memory still holds.
        let same = region(&p.da, 64, Access::LOCAL_WRITE)?;
        same.buffer().fill(0, 64, 0x11);
        p.a.post_send(&SendWr::write(3, &[same.all()], t.desc().at(0)).transmit_complete())
            .ctx("post the transmit-complete write")?;
        p.a.post_send(&SendWr::read(4, &[same.all()], t.desc().at(64)))
            .ctx("post the read behind it")?;
        expect_ok_each(&p.cqa, &[(3, Opcode::Write), (4, Opcode::Read)])?;
        let mut at = t.desc().at(0);
        at.key ^= 0x5a5a_0001;
        p.a.post_send(&SendWr::write(1, &[l.slice(0..64).ctx("s")?], at))
            .ctx("post")
    })
}

fn write_oob(ctx: &Ctx) -> CaseResultOf {
    remote_access_error(ctx, all_access(), |p, l, t| {
        p.a.post_send(&SendWr::write(
            1,
            &[l.slice(0..64).ctx("s")?],
            t.desc().at(4096 - 32),
        ))
        .ctx("post")
    })
}

fn read_oob(ctx: &Ctx) -> CaseResultOf {
    remote_access_error(ctx, all_access(), |p, l, t| {
        p.a.post_send(&SendWr::read(
            1,
            &[l.slice(0..4097).ctx("s")?],
            t.desc().at(0),
        ))
        .ctx("post")
    })
}

fn write_needs_access(ctx: &Ctx) -> CaseResultOf {
    remote_access_error(
        ctx,
        Access::LOCAL_WRITE | Access::REMOTE_READ | Access::REMOTE_ATOMIC,
        |p, l, t| {
            p.a.post_send(&SendWr::write(
                1,
                &[l.slice(0..64).ctx("s")?],
                t.desc().at(0),
            ))
            .ctx("post")
        },
    )
}

fn read_needs_access(ctx: &Ctx) -> CaseResultOf {
    remote_access_error(
        ctx,
        Access::LOCAL_WRITE | Access::REMOTE_WRITE,
        |p, l, t| {
            p.a.post_send(&SendWr::read(
                1,
                &[l.slice(0..64).ctx("s")?],
                t.desc().at(0),
            ))
            .ctx("post")
        },
    )
}

fn deregistered_dead(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let local = region(&p.da, 64, Access::empty())?;
    let target = region(&p.db, 4096, all_access())?;
    let desc = target.desc();
    // The key works while registered...
    p.a.post_send(&SendWr::write(1, &[local.all()], desc.at(0)))
        .ctx("post")?;
    expect_ok(&p.cqa, 1, Opcode::Write)?;
    // ...and is dead at once after deregistration.
    target.deregister();
    p.a.post_send(&SendWr::write(2, &[local.all()], desc.at(0)))
        .ctx("post after deregistration")?;
    expect_err(&p.cqa, 2, ErrorKind::RemoteAccess)?;
    wait_state(&p.b, EndpointState::Error, Duration::from_secs(5))
}

fn other_domain_key(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let third = ctx.domain()?;
    let local = region(&p.da, 64, Access::empty())?;
    let elsewhere = region(&third, 4096, all_access())?;
    // A key valid in another domain, with an address that is valid there, grants nothing here.
    p.a.post_send(&SendWr::write(1, &[local.all()], elsewhere.desc().at(0)))
        .ctx("post")?;
    expect_err(&p.cqa, 1, ErrorKind::RemoteAccess)?;
    ensure!(
        elsewhere.buffer().to_vec(0, 64).iter().all(|&b| b == 0),
        "write reached a region of another domain"
    );
    Ok(())
}

fn outlives(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let len = 4 << 20;
    let target = region(&p.db, len, all_access())?;
    let src = region(&p.da, len, Access::empty())?;
    src.buffer().fill(0, len, 0x3c);
    p.a.post_send(&SendWr::write(1, &[src.all()], target.desc().at(0)))
        .ctx("post")?;
    // The application drops its handle while the write is in flight: the operation keeps
    // the memory alive, and the data arrives intact.
    drop(src);
    expect_ok(&p.cqa, 1, Opcode::Write)?;
    ensure!(
        target.buffer().to_vec(0, len).iter().all(|&b| b == 0x3c),
        "data of a region dropped in flight was lost or corrupted"
    );
    Ok(())
}

fn local_other_domain(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let foreign = region(&p.db, 64, all_access())?;
    match p.a.post_send(&SendWr::send(1, &[foreign.all()])) {
        Err(e) if e.kind() == ErrorKind::LocalProtection => Ok(()),
        other => Err(format!(
            "posting a region of another domain returned {other:?}, expected LocalProtection"
        )),
    }
}

fn sink_needs_local_write(ctx: &Ctx) -> CaseResultOf {
    let p = ctx.pair()?;
    let sink = region(&p.da, 64, Access::REMOTE_READ)?;
    let target = region(&p.db, 64, all_access())?;
    match p
        .a
        .post_send(&SendWr::read(1, &[sink.all()], target.desc().at(0)))
    {
        Err(e) if e.kind() == ErrorKind::LocalProtection => {}
        other => {
            return Err(format!(
                "read into a region without LOCAL_WRITE returned {other:?}"
            ))
        }
    }
    match p.b.post_recv(&RecvWr::new(1, &[target.all()])) {
        Ok(()) => {}
        Err(e) => return Err(format!("receive into a LOCAL_WRITE region failed: {e}")),
    }
    let ro = region(&p.db, 64, Access::REMOTE_READ)?;
    match p.b.post_recv(&RecvWr::new(2, &[ro.all()])) {
        Err(e) if e.kind() == ErrorKind::LocalProtection => Ok(()),
        other => Err(format!(
            "receive into a region without LOCAL_WRITE returned {other:?}"
        )),
    }
}

fn slice_oob(ctx: &Ctx) -> CaseResultOf {
    let d = ctx.domain()?;
    let mr = region(&d, 100, Access::LOCAL_WRITE)?;
    ensure!(mr.slice(0..100).is_ok(), "whole-region slice refused");
    for (s, e) in [(0usize, 101usize), (90, 120), (101, 101)] {
        match mr.slice(s..e) {
            Err(err) if err.kind() == ErrorKind::LocalProtection => {}
            other => {
                return Err(format!(
                    "slice {s}..{e} of a 100-byte region returned {other:?}"
                ))
            }
        }
    }
    Ok(())
}
