//! Allreduce by recursive halving and doubling (Rabenseifner's algorithm) over RDMA Write,
//! for groups of a power of two ranks.
//!
//! The reduce-scatter halves: at level `s` a rank and its partner `r ^ (n >> (s + 1))`
//! hold the same range of blocks; each keeps one half (the lower rank the lower half) and
//! RDMA-writes the other half into the partner's landing buffer, followed by a small
//! tagged notification on the same connection (it arrives after the data is placed). The
//! receiver reduces what landed into its half, `lower rank's value op higher rank's value`.
//! After `log2(n)` levels rank `r` holds block `r` fully reduced. The allgather runs the
//! levels backwards: each rank writes what it holds final straight into the partner's
//! region at the same offsets, so the range held final doubles per level.
//!
//! Against the ring's `2(n-1)` steps this takes `2 log2(n)`, and each step is a pairwise
//! exchange; the bytes sent per rank are the same (`2(n-1)/n` of the payload), and so are
//! the bytes reduced. On a host with fewer cores than ranks the fewer, pairwise steps
//! leave less time waiting for a rank that is not running (Open MPI takes this algorithm
//! for the same sizes; see docs/benchmarks-record.md).
//!
//! **Bit-identical results.** Each element is reduced on one rank only, in a fixed tree
//! (pairs at distance `n/2` first, `1` last, the lower rank's operand first), and then
//! copied to every rank.
//!
//! **No handshake per call** (as in the write ring): every level lands in its own part of
//! the landing buffer, and a rank writes a place on its partner only after the partner has
//! used what was there. Within a call, the allgather writes a range into the partner's
//! region only after the partner wrote that range to us (it read it before); across calls,
//! a partner starts writing our landing buffer only after it finished the previous call,
//! which needs our allgather message of that level, sent after all our reductions.
//!
//! Descriptors: the landing buffers' are swapped with every partner when they are made;
//! each rank tells every partner its region (or its work buffer, for an allreduce of a
//! slice) on the first notification of their reduce-scatter level, only when it changed
//! since its last call.

use std::collections::VecDeque;
use std::ops::Range;
use std::sync::Arc;

use fabric::prelude::*;
use fabric::{Error, Result, Slice};
use fabric_rdm::{RecvBuf, Source};

use super::{
    check_ok, reduce_landed, reduce_landed_into, Comm, NOTE_SLOT, RECV_CTX, REDUCE_CHUNK, SEND_CTX,
    WRITE_CTX,
};
use crate::reduce::{DataType, ReduceOp};

/// Tag steps: the landing buffers' descriptor swap with the partner of level `s` is
/// `DESC_STEP + s`; step `i` of a call is `STEP + i` (reduce-scatter levels, then the
/// allgather's).
const DESC_STEP: u64 = 2944;
const STEP: u64 = 2960;
/// Largest group served (`2 log2(n)` steps fit between `STEP` and the write ring's tags).
pub(super) const MAX_RANKS: usize = 512;

/// This rank's halving-doubling buffers and what it knows of its partners'.
#[derive(Debug)]
pub(super) struct Halving {
    /// Where an allreduce of a slice sends from and the partners write its allgather.
    work: Option<Arc<MemoryRegion>>,
    /// Where the partner of level `s` writes the half this rank keeps (at `land_at[s]`).
    land: Arc<MemoryRegion>,
    /// Notification slots: level `s`'s region descriptor at `s * NOTE_SLOT`, ours after
    /// them.
    note: Arc<MemoryRegion>,
    /// Each level's partner's landing buffer.
    partner_land: Vec<RemoteDesc>,
    /// Each level's partner's region, as it last told us.
    partner_region: Vec<Option<RemoteDesc>>,
    /// The region every partner last heard of from us.
    told: Option<RemoteDesc>,
}

/// One rank's levels (byte ranges of the payload): at reduce-scatter level `s` it keeps
/// `keep[s]` and gives `give[s]` to `partner[s]`, whose half lands at `land_at[s]` in our
/// landing buffer. A partner has the same ranges as we do before its level, hence the
/// same `land_at`.
#[derive(Debug)]
struct Levels {
    partner: Vec<usize>,
    keep: Vec<Range<usize>>,
    give: Vec<Range<usize>>,
    land_at: Vec<usize>,
}

impl Levels {
    fn new(n: usize, r: usize, bounds: &[usize]) -> Self {
        let levels = n.trailing_zeros() as usize;
        let mut l = Levels {
            partner: Vec::with_capacity(levels),
            keep: Vec::with_capacity(levels),
            give: Vec::with_capacity(levels),
            land_at: Vec::with_capacity(levels),
        };
        let bytes = |b: Range<usize>| bounds[b.start]..bounds[b.end];
        let (mut lo, mut hi, mut at) = (0, n, 0);
        for s in 0..levels {
            let d = n >> (s + 1);
            let mid = lo + d;
            if r & d == 0 {
                l.give.push(bytes(mid..hi));
                hi = mid;
            } else {
                l.give.push(bytes(lo..mid));
                lo = mid;
            }
            l.partner.push(r ^ d);
            l.keep.push(bytes(lo..hi));
            l.land_at.push(at);
            at += bounds[hi] - bounds[lo];
        }
        l
    }
}

/// Landing buffer capacity for a payload of `total` bytes over `n` ranks: the same on every
/// rank (so all grow in the same call), and at least any rank's `sum(keep[s])`, which is at
/// most `(n-1)` blocks of at most `total/n + 8` bytes.
fn land_capacity(total: usize, n: usize) -> usize {
    (total + 8 * n).next_power_of_two()
}

impl Comm {
    /// Makes (or grows) the landing buffer for `total` bytes and swaps its descriptor with
    /// every partner. Every rank calls it with the same `total`, so all grow in the same
    /// call.
    fn ensure_halving(&mut self, total: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let cap = land_capacity(total, n);
        if self.halving.as_ref().is_some_and(|h| h.land.len() >= cap) {
            return Ok(());
        }
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let land = Arc::new(self.domain.alloc(cap, access)?);
        let levels = n.trailing_zeros() as usize;
        let mine = land.desc().to_bytes();
        let mut partner_land = Vec::with_capacity(levels);
        for s in 0..levels {
            let p = r ^ (n >> (s + 1));
            let got = self.step(
                DESC_STEP + s as u64,
                Some((p, &mine)),
                Some((p, mine.len())),
            )?;
            partner_land.push(RemoteDesc::from_bytes(&got)?);
        }
        let old = self.halving.take();
        let note = match &old {
            Some(h) => h.note.clone(),
            None => Arc::new(
                self.domain
                    .alloc(NOTE_SLOT * (levels + 1), Access::LOCAL_WRITE)?,
            ),
        };
        self.halving = Some(match old {
            Some(h) => Halving {
                land,
                partner_land,
                ..h
            },
            None => Halving {
                work: None,
                land,
                note,
                partner_land,
                partner_region: vec![None; levels],
                told: None,
            },
        });
        Ok(())
    }

    /// Allreduce of a slice by halving and doubling. The slice stays where the reductions
    /// happen (plain memory, no word-atomic staging of our operand); the work buffer (made
    /// or grown here; its descriptor travels like a region's) holds only what is sent from
    /// here, staged just before its step, and receives the allgather's ranges, copied out
    /// at the end.
    pub(super) fn halving_copied(
        &mut self,
        data: &mut [u8],
        bounds: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let total = data.len();
        self.ensure_halving(total)?;
        let have = self.halving.as_ref().and_then(|h| h.work.clone());
        let work = match have {
            Some(w) if w.len() >= total => w,
            _ => {
                let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
                let w = Arc::new(self.domain.alloc(total.next_power_of_two(), access)?);
                self.halving.as_mut().expect("made").work = Some(w.clone());
                w
            }
        };
        self.halving_guarded(work.slice(..total)?, Some(data), bounds, dtype, op)
    }

    /// Allreduce by halving and doubling of `data`, registered with remote write access,
    /// in place.
    pub(super) fn halving_in_place(
        &mut self,
        data: Slice<'_>,
        bounds: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        self.halving_guarded(data, None, bounds, dtype, op)
    }

    /// Runs the algorithm; on an error what this rank knows of its partners' regions is
    /// forgotten (the next call tells and expects every descriptor again).
    fn halving_guarded(
        &mut self,
        region: Slice<'_>,
        copied: Option<&mut [u8]>,
        bounds: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let res = self.halving_run(region, copied, bounds, dtype, op);
        if res.is_err() {
            if let Some(h) = &mut self.halving {
                h.told = None;
                h.partner_region.fill(None);
            }
        }
        res
    }

    /// One allreduce. `data` is the registered range sends come from and partners write
    /// the allgather into. With `copied` (the caller's slice, of the same length), the
    /// reduce-scatter reduces into `copied` instead: each step's send range is staged from
    /// it into `data` when the step starts (the half given at level 0 as it is, then each
    /// half given once reduced, then our own block), and the ranges the partners wrote are
    /// copied back into it at the end.
    fn halving_run(
        &mut self,
        data: Slice<'_>,
        mut copied: Option<&mut [u8]>,
        bounds: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let total = bounds[n];
        self.ensure_halving(total)?;
        let lv = Levels::new(n, r, bounds);
        let levels = lv.partner.len();
        let steps = 2 * levels;
        let h = self.halving.as_ref().expect("made");
        let (land, note) = (h.land.clone(), h.note.clone());
        let partner_land = h.partner_land.clone();
        let mut regions = h.partner_region.clone();
        // Tell our region when it changed since our last call.
        let d = data.region().desc();
        let mine = RemoteDesc {
            addr: d.addr + data.offset() as u64,
            len: data.len() as u64,
            key: d.key,
        };
        let own = levels * NOTE_SLOT;
        let told = if h.told == Some(mine) {
            0
        } else {
            note.buffer().write(own, &mine.to_bytes());
            RemoteDesc::ENCODED_LEN
        };
        // Step `i`: its level, and what it receives and sends (the reduce-scatter keeps
        // and gives; the allgather sends what was kept and gets what was given).
        let level = |i: usize| if i < levels { i } else { steps - 1 - i };
        let ranges = |i: usize| {
            let s = level(i);
            let (keep, give) = (lv.keep[s].clone(), lv.give[s].clone());
            if i < levels {
                (keep, give)
            } else {
                (give, keep)
            }
        };
        // Segments of a range: whole elements, at most 256 of them; both sides of a step
        // cut the same range the same way.
        let es = dtype.size();
        let write_segment = self.cfg.write_segment;
        let seg_len = |len: usize| write_segment.max(len.div_ceil(256)).max(es).div_ceil(es) * es;
        let nseg = |len: usize| len.div_ceil(seg_len(len)).max(1);
        let part = |b: Range<usize>, k: usize| {
            let seg = seg_len(b.len());
            let s = (b.start + k * seg).min(b.end);
            s..(s + seg).min(b.end)
        };
        // Every notification of the call, posted up front.
        let mut left: Vec<usize> = (0..steps).map(|i| nseg(ranges(i).0.len())).collect();
        for (i, &count) in left.iter().enumerate() {
            let from = Source::Peer(self.peers[lv.partner[level(i)]]);
            for k in 0..count {
                let (at, len) = if i < levels && k == 0 {
                    (i * NOTE_SLOT, NOTE_SLOT)
                } else {
                    (0, 0)
                };
                self.ep.trecv(
                    from,
                    self.tag(STEP + i as u64, k),
                    0,
                    RecvBuf::new(note.clone(), at, len),
                    RECV_CTX | (i << 8 | k) as u64,
                )?;
            }
        }
        let buf = data.region().buffer();
        let base = data.offset();
        let mut chunk = vec![0u8; REDUCE_CHUNK];
        let mut ours = vec![0u8; if copied.is_some() { 0 } else { REDUCE_CHUNK }];
        // Copied: stage step `i`'s send range from the slice (the reduce-scatter's given
        // half, then our own block; the allgather's later ranges are in `data` already).
        let stage = |copied: &mut Option<&mut [u8]>, i: usize| {
            if let Some(d) = copied {
                if i <= levels {
                    let range = ranges(i).1;
                    buf.write(base + range.start, &d[range]);
                }
            }
        };
        stage(&mut copied, 0);
        // Step `i`'s notification `k` (of `len` bytes) has arrived and its step is current:
        // learn the partner's region from the first of a reduce-scatter level, and reduce
        // what landed into our half.
        let mut arrive = |regions: &mut [Option<RemoteDesc>],
                          copied: &mut Option<&mut [u8]>,
                          i: usize,
                          k: usize,
                          len: usize|
         -> Result<()> {
            if i >= levels {
                return Ok(()); // the allgather's data is placed where it belongs
            }
            let s = i;
            let p = lv.partner[s];
            if k == 0 {
                let d = match len {
                    0 => regions[s].ok_or_else(|| {
                        Error::new(
                            ErrorKind::Protocol,
                            format!("rank {p} did not send its region's descriptor"),
                        )
                    })?,
                    RemoteDesc::ENCODED_LEN => {
                        let mut b = [0u8; RemoteDesc::ENCODED_LEN];
                        note.buffer().read(s * NOTE_SLOT, &mut b);
                        RemoteDesc::from_bytes(&b)?
                    }
                    _ => {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            format!("halving level {s}: a notification of {len} bytes"),
                        ))
                    }
                };
                if d.len != total as u64 {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!(
                            "allreduce: rank {p} passed {} bytes, rank {r} {total}: every \
                             rank passes the same length",
                            d.len
                        ),
                    ));
                }
                regions[s] = Some(d);
            } else if len != 0 {
                return Err(Error::new(
                    ErrorKind::Protocol,
                    format!("halving level {s}: a notification of {len} bytes"),
                ));
            }
            // Ours op theirs, the lower rank's operand first.
            let range = part(lv.keep[s].clone(), k);
            let landed = lv.land_at[s] + (range.start - lv.keep[s].start);
            match copied {
                Some(d) => reduce_landed_into(
                    dtype,
                    op,
                    &mut d[range],
                    (land.buffer(), landed),
                    p < r,
                    &mut chunk,
                ),
                None => reduce_landed(
                    dtype,
                    op,
                    (buf, base + range.start),
                    (land.buffer(), landed),
                    range.len(),
                    p < r,
                    (&mut chunk, &mut ours),
                ),
            }
            Ok(())
        };
        let mut early: Vec<Vec<(usize, usize)>> = vec![Vec::new(); steps];
        let sends = |i: usize| (0..nseg(ranges(i).1.len())).map(move |k| (i, k));
        let mut todo: VecDeque<(usize, usize)> = sends(0).collect();
        let (mut cur, mut writing, mut sending) = (0usize, 0usize, 0usize);
        let window = self.cfg.write_window.max(1);
        loop {
            while writing < window {
                let Some((i, k)) = todo.pop_front() else {
                    break;
                };
                let s = level(i);
                let p = lv.partner[s];
                let whole = ranges(i).1;
                let range = part(whole.clone(), k);
                let dest = if i < levels {
                    let pl = partner_land[s];
                    if ((lv.land_at[s] + whole.len()) as u64) > pl.len {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            format!("rank {p}'s landing buffer holds {} bytes", pl.len),
                        ));
                    }
                    pl.at((lv.land_at[s] + range.start - whole.start) as u64)
                } else {
                    regions[s]
                        .expect("learnt in the reduce-scatter")
                        .at(range.start as u64)
                };
                if !range.is_empty() {
                    let src = data.region().slice(base + range.start..base + range.end)?;
                    match self.ep.write(
                        self.peers[p],
                        &[src],
                        dest,
                        WRITE_CTX | (i << 8 | k) as u64,
                    ) {
                        Ok(()) => writing += 1,
                        // The connection's send queue is full: again after a completion.
                        Err(e) if e.kind() == ErrorKind::QueueFull && writing > 0 => {
                            todo.push_front((i, k));
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                let body = if i < levels && k == 0 {
                    own..own + told
                } else {
                    0..0
                };
                self.ep.tsend(
                    self.peers[p],
                    self.tag(STEP + i as u64, k),
                    note.slice(body)?,
                    SEND_CTX | (i << 8 | k) as u64,
                )?;
                sending += 1;
            }
            if cur == steps && writing == 0 && sending == 0 {
                break;
            }
            let c = self.next(false)?;
            check_ok(&c, STEP)?;
            if c.context & WRITE_CTX != 0 {
                writing -= 1;
                continue;
            }
            if c.context & RECV_CTX == 0 {
                sending -= 1;
                continue;
            }
            let idx = (c.context & !RECV_CTX) as usize;
            let (i, k) = (idx >> 8, idx & 0xff);
            if i == cur {
                arrive(&mut regions, &mut copied, i, k, c.len as usize)?;
                left[i] -= 1;
            } else {
                early[i].push((k, c.len as usize));
            }
            // Steps whose receives are all handled: the next one's sends can go.
            while cur < steps && left[cur] == 0 {
                cur += 1;
                if cur < steps {
                    stage(&mut copied, cur);
                    todo.extend(sends(cur));
                    for (k, len) in std::mem::take(&mut early[cur]) {
                        arrive(&mut regions, &mut copied, cur, k, len)?;
                        left[cur] -= 1;
                    }
                }
            }
        }
        // Copied: the ranges the partners wrote (every one but our own block, which the
        // slice holds reduced).
        if let Some(d) = copied {
            let own = lv.keep[levels - 1].clone();
            buf.read(base, &mut d[..own.start]);
            buf.read(base + own.end, &mut d[own.end..]);
        }
        let h = self.halving.as_mut().expect("made");
        h.partner_region = regions;
        h.told = Some(mine);
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every rank's kept ranges end in its own block; partners give each other what the
    /// other keeps; the landing offsets of partners agree and stay under the capacity.
    #[test]
    fn levels_halve_to_the_own_block() {
        for n in [2usize, 4, 8, 16] {
            for count in [n, n + 1, 3 * n - 1, 1000] {
                let bounds: Vec<usize> = (0..=n).map(|i| (count * i / n) * 4).collect();
                let all: Vec<Levels> = (0..n).map(|r| Levels::new(n, r, &bounds)).collect();
                for (r, l) in all.iter().enumerate() {
                    let last = l.keep.last().unwrap();
                    assert_eq!(*last, bounds[r]..bounds[r + 1], "n {n} rank {r}");
                    for s in 0..l.partner.len() {
                        let p = &all[l.partner[s]];
                        assert_eq!(p.keep[s], l.give[s], "n {n} rank {r} level {s}");
                        assert_eq!(p.land_at[s], l.land_at[s], "n {n} rank {r} level {s}");
                    }
                    let used = l.land_at.last().unwrap() + last.len();
                    assert!(used <= land_capacity(bounds[n], n), "n {n} count {count}");
                }
            }
        }
    }
}
