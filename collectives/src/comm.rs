//! The communicator and its algorithms.

use std::collections::VecDeque;
use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric::{Error, Result, Slice};
use fabric_rdm::{Peer, RdmCompletion, RdmEndpoint, RecvBuf, Source};

use crate::reduce::{from_bytes, reduce, to_bytes, DataType, Element, ReduceOp};

mod halving;

/// Tags of collectives: this bit, the call's sequence number, the step.
const TAG_BIT: u64 = 1 << 63;
const SEND_CTX: u64 = 0;
const RECV_CTX: u64 = 1 << 32;
const WRITE_CTX: u64 = 1 << 33;
/// Steps of the write ring: the descriptor swap, then its stages (`2(n-1)` of them).
const DESC_STEP: u64 = 3071;
const RING_STEP: u64 = 3072;
/// Largest group the write ring serves (its stages' steps fit in the tag).
const MAX_WRITE_RING: usize = 512;
/// The write ring reduces a segment this many bytes at a time (a multiple of every
/// element size), so that the partial result stays in cache between the reduction and its
/// copy into the registered buffer.
const REDUCE_CHUNK: usize = 32 << 10;
/// Bytes per slot of the write ring's notification region: an in-place ring's notes carry
/// a region descriptor (see [`Comm::allreduce_region_bytes`]).
const NOTE_SLOT: usize = 32;

/// A step in flight (see [`Comm::start`]).
#[derive(Debug)]
struct Pending {
    step: u64,
    sends: usize,
    recvs: usize,
    rlen: usize,
    rseg: usize,
    /// Bytes sent.
    slen: usize,
}

/// Algorithm thresholds.
#[derive(Debug, Clone, Copy)]
pub struct CommConfig {
    /// Allreduce and allgather payloads up to this many bytes use recursive doubling
    /// (latency-bound); larger ones the ring (bandwidth-bound).
    pub small_max: usize,
    /// Broadcasts up to this many bytes use a binomial tree; larger ones a pipelined chain.
    pub bcast_small_max: usize,
    /// Chunk of the pipelined broadcast.
    pub bcast_chunk: usize,
    /// Large transfers move in segments of this many bytes (at least 1/256 of the
    /// transfer), each its own message, so reductions overlap the transfer.
    pub segment: usize,
    /// How long one step may wait for a peer before the collective fails.
    pub timeout: Duration,
    /// How long a rank waiting for a small step (up to [`CommConfig::small_max`] bytes,
    /// latency-bound) polls the endpoint without sleeping, yielding the core between polls
    /// as MPI ranks do, before it sleeps in the completion queue. Large steps never spin
    /// beyond `RdmConfig::busy_poll`: on a host with fewer cores than busy threads a
    /// spinning rank takes the core from the ranks and progress threads moving the data.
    /// Zero leaves all waiting to [`RdmEndpoint::wait`].
    pub spin: Duration,
    /// Allreduce payloads above [`CommConfig::small_max`] use the pipelined write ring
    /// (segments RDMA-written straight into the next rank's buffer, each followed by a
    /// small tagged message, reduced as they arrive) when the provider has RDMA Write;
    /// false keeps the ring of tagged messages.
    pub write_ring: bool,
    /// Segment of the write ring, in bytes (at least 1/256 of a block).
    pub write_segment: usize,
    /// Writes the write ring keeps in flight to the next rank (and halving and doubling
    /// to its partner).
    pub write_window: usize,
    /// Allreduce payloads above [`CommConfig::small_max`] and up to this many bytes, on a
    /// power-of-two group, take recursive halving and doubling (Rabenseifner's algorithm:
    /// `2 log2(n)` pairwise steps, RDMA-written as the write ring's) instead of the write
    /// ring's `2(n-1)` steps, when the write ring would serve them. Zero: never.
    pub halving_max: usize,
    /// Transfers up to this many bytes (and [`CommConfig::small_max`]) go as eager
    /// messages of at most the endpoint's `RdmConfig::eager_max` each, all in flight at
    /// once; larger ones as one message per [`CommConfig::segment`], a rendezvous above the
    /// eager size. Zero: never cut into eager messages. On tcp (4 ranks, 2 cores) eager
    /// pieces won at 16 KiB, tied at 32 KiB and lost at 64 KiB.
    pub eager_pieces_max: usize,
    /// Allreduce payloads up to this many bytes, on a power-of-two group of at most 64
    /// ranks, gather every rank's data by recursive doubling and fold it in rank order
    /// ([`Comm::allreduce_bytes`]); zero: never. Every rank sends `log2(n)` messages as in
    /// recursive doubling, but the result does not depend on the order of the rounds, so
    /// calls alternate it (by their sequence number): in back-to-back calls the first
    /// message goes to the rank the previous call heard from last and carries the
    /// transport's delivery acknowledgement of that message (tcp holds it for the next
    /// message to that peer) instead of a system call of its own.
    pub gather_max: usize,
}

impl Default for CommConfig {
    fn default() -> Self {
        CommConfig {
            small_max: 64 << 10,
            bcast_small_max: 256 << 10,
            bcast_chunk: 256 << 10,
            segment: 512 << 10,
            timeout: Duration::from_secs(60),
            spin: Duration::from_millis(100),
            write_ring: true,
            write_segment: 1 << 20,
            write_window: 48,
            halving_max: 4 << 20,
            eager_pieces_max: 32 << 10,
            gather_max: 256,
        }
    }
}

/// A group of ranks over one RDM endpoint each, running collectives. Every rank calls the
/// same collectives in the same order.
#[derive(Debug)]
pub struct Comm {
    ep: RdmEndpoint,
    domain: Arc<AnyDomain>,
    rank: usize,
    peers: Vec<Peer>,
    seq: u64,
    cfg: CommConfig,
    sbuf: MemoryRegion,
    rbuf: Arc<MemoryRegion>,
    /// Completions polled but not handed out yet.
    ready: VecDeque<RdmCompletion>,
    polled: Vec<RdmCompletion>,
    /// The write ring's buffers (made on the first large allreduce).
    ring: Option<WriteRing>,
    /// Halving and doubling's buffers (made on the first allreduce that takes it).
    halving: Option<halving::Halving>,
    /// The endpoint's eager size.
    eager_max: usize,
    /// What [`Comm::finish`] reads a received segment into (kept to reuse its
    /// allocation: a small step allocates nothing).
    seg_buf: Vec<u8>,
    /// The gathered blocks and the packed send of [`Comm::gather_doubling`] (kept).
    gather_buf: (Vec<u8>, Vec<u8>),
    /// The descriptor of the caller's region that this rank last sent round the in-place
    /// write ring (the previous rank holds it); `None`: send it with the next call.
    region_told: Option<RemoteDesc>,
    /// The next rank's region as it last told us.
    next_region: Option<RemoteDesc>,
    /// Where a registered-buffer allreduce that takes a copying path works (kept).
    region_tmp: Vec<u8>,
}

/// Where the write ring's data lives.
enum RingData<'a> {
    /// The caller's slice: the ring sends from and gathers into its own `work` buffer and
    /// copies between it and the slice.
    Copied(&'a mut [u8]),
    /// The caller's registered memory: sent from, reduced and gathered in place.
    InPlace(Slice<'a>),
}

/// The algorithm an allreduce takes (the same on every rank: it depends on the length, the
/// group and the configuration only).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Algo {
    /// One rank: nothing to do.
    Alone,
    /// [`Comm::gather_doubling`].
    Gather,
    /// [`Comm::recursive_doubling`].
    Doubling,
    /// [`Comm::write_ring`].
    WriteRing,
    /// Recursive halving and doubling over RDMA Write (the `halving` module).
    Halving,
    /// The ring of tagged messages.
    TaggedRing,
}

/// The write ring's registered buffers on this rank and where they are on the next one.
#[derive(Debug)]
struct WriteRing {
    /// The data being reduced (the result in the end); the previous rank writes the
    /// allgather's blocks straight into it. Made by the first allreduce of a slice (an
    /// in-place ring works in the caller's region instead).
    work: Option<Arc<MemoryRegion>>,
    /// Where the previous rank writes its reduce-scatter blocks.
    land: Arc<MemoryRegion>,
    /// The notifications' receive and send slots ([`NOTE_SLOT`] bytes per rank).
    note: Arc<MemoryRegion>,
    next_work: Option<RemoteDesc>,
    next_land: RemoteDesc,
}

impl Comm {
    /// A communicator of `names.len()` ranks (every rank's endpoint name, in rank order);
    /// this process is `rank`, its endpoint `ep` in `domain`.
    pub fn new(
        domain: Arc<AnyDomain>,
        ep: RdmEndpoint,
        rank: usize,
        names: &[Vec<u8>],
        cfg: CommConfig,
    ) -> Result<Self> {
        if rank >= names.len() {
            return Err(Error::invalid(format!(
                "rank {rank} of {} ranks",
                names.len()
            )));
        }
        let peers = names
            .iter()
            .map(|n| ep.av_insert_name(n))
            .collect::<Result<Vec<_>>>()?;
        let access = Access::LOCAL_WRITE | Access::REMOTE_READ;
        let sbuf = domain.alloc(4096, access)?;
        let rbuf = Arc::new(domain.alloc(4096, access)?);
        let eager_max = ep.eager_max();
        Ok(Comm {
            ep,
            domain,
            rank,
            peers,
            seq: 0,
            cfg,
            sbuf,
            rbuf,
            ready: VecDeque::new(),
            polled: Vec::new(),
            ring: None,
            halving: None,
            eager_max,
            seg_buf: Vec::new(),
            gather_buf: (Vec::new(), Vec::new()),
            region_told: None,
            next_region: None,
            region_tmp: Vec::new(),
        })
    }

    /// The next completion. With `spin`, polls (yielding the core between polls) for up
    /// to [`CommConfig::spin`] first; then (or at once) waits in the endpoint, which polls
    /// for `RdmConfig::busy_poll` and then sleeps, until the step timeout.
    fn next(&mut self, spin: bool) -> Result<RdmCompletion> {
        if let Some(c) = self.ready.pop_front() {
            return Ok(c);
        }
        let start = Instant::now();
        let spin = if spin { self.cfg.spin } else { Duration::ZERO };
        while start.elapsed() < spin {
            self.ep.poll(&mut self.polled)?;
            if !self.polled.is_empty() {
                self.ready.extend(self.polled.drain(..));
                return Ok(self.ready.pop_front().expect("polled"));
            }
            std::thread::yield_now();
        }
        self.ep
            .next_completion(self.cfg.timeout.saturating_sub(spin))
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Number of ranks.
    pub fn size(&self) -> usize {
        self.peers.len()
    }

    /// The endpoint underneath.
    pub fn endpoint(&self) -> &RdmEndpoint {
        &self.ep
    }

    fn ensure(&mut self, send: usize, recv: usize) -> Result<()> {
        let access = Access::LOCAL_WRITE | Access::REMOTE_READ;
        if self.sbuf.len() < send {
            self.sbuf = self.domain.alloc(send.next_power_of_two(), access)?;
        }
        if self.rbuf.len() < recv {
            self.rbuf = Arc::new(self.domain.alloc(recv.next_power_of_two(), access)?);
        }
        Ok(())
    }

    fn tag(&self, step: u64, segment: usize) -> u64 {
        TAG_BIT | (self.seq & 0xff_ffff_ffff) << 20 | (step & 0xfff) << 8 | segment as u64 & 0xff
    }

    /// One step: sends `send` to rank `to` and receives `recv_len` bytes from rank `from`
    /// (either may be absent); returns what arrived.
    fn step(
        &mut self,
        step: u64,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, usize)>,
    ) -> Result<Vec<u8>> {
        self.step_tags(step, step, send, recv)
    }

    /// [`Comm::step`] with the send tagged `sstep` and the receive `rstep`.
    fn step_tags(
        &mut self,
        sstep: u64,
        rstep: u64,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, usize)>,
    ) -> Result<Vec<u8>> {
        let p = self.start(sstep, rstep, send, recv)?;
        let mut out = vec![0u8; p.rlen];
        self.finish(p, |off, d| out[off..off + d.len()].copy_from_slice(d))?;
        Ok(out)
    }

    /// Segment size for a transfer of `len` bytes (at most 256 segments, a multiple of 8
    /// bytes).
    ///
    /// A small transfer (up to [`CommConfig::eager_pieces_max`] and
    /// [`CommConfig::small_max`]) goes in segments of the endpoint's eager size: all in
    /// flight at once, none waiting for a rendezvous' round trips.
    fn segment(&self, len: usize) -> usize {
        let seg = if len <= self.cfg.eager_pieces_max.min(self.cfg.small_max) {
            self.eager_max
        } else {
            self.cfg.segment
        };
        // Whole 8-byte words (so whole elements of every type: steps reduce segment by
        // segment), and at most 256 segments (the tag's segment field).
        (seg / 8 * 8)
            .max(8)
            .max(len.div_ceil(256).next_multiple_of(8))
    }

    /// Posts one step in segments (receives first, then sends, from a registered copy of
    /// `send`): segment `k` of a step is its own tagged message, so the reduction of one
    /// overlaps the transfer of the next.
    fn start(
        &mut self,
        sstep: u64,
        rstep: u64,
        send: Option<(usize, &[u8])>,
        recv: Option<(usize, usize)>,
    ) -> Result<Pending> {
        self.ensure(send.map_or(0, |s| s.1.len()), recv.map_or(0, |r| r.1))?;
        let mut p = Pending {
            step: rstep,
            sends: 0,
            recvs: 0,
            rlen: 0,
            rseg: 1,
            slen: 0,
        };
        if let Some((from, len)) = recv {
            let seg = self.segment(len);
            let n = len.div_ceil(seg).max(1);
            for k in 0..n {
                let off = k * seg;
                let l = seg.min(len - off.min(len));
                self.ep.trecv(
                    Source::Peer(self.peers[from]),
                    self.tag(rstep, k),
                    0,
                    RecvBuf::new(self.rbuf.clone(), off, l),
                    RECV_CTX | k as u64,
                )?;
            }
            (p.recvs, p.rlen, p.rseg) = (n, len, seg);
        }
        if let Some((to, data)) = send {
            self.sbuf.buffer().write(0, data);
            let seg = self.segment(data.len());
            let n = data.len().div_ceil(seg).max(1);
            for k in 0..n {
                let off = (k * seg).min(data.len());
                let end = (off + seg).min(data.len());
                self.ep.tsend(
                    self.peers[to],
                    self.tag(sstep, k),
                    self.sbuf.slice(off..end)?,
                    SEND_CTX | k as u64,
                )?;
            }
            (p.sends, p.slen) = (n, data.len());
        }
        Ok(p)
    }

    /// Waits for a step posted by [`Comm::start`], handing each received segment (its
    /// offset and bytes) to `on_seg` as it lands.
    fn finish(&mut self, p: Pending, mut on_seg: impl FnMut(usize, &[u8])) -> Result<()> {
        let (mut sends, mut recvs) = (p.sends, p.recvs);
        // Reused between steps (a small step allocates nothing); an error drops it.
        let mut tmp = std::mem::take(&mut self.seg_buf);
        let spin = p.rlen.max(p.slen) <= self.cfg.small_max;
        while sends + recvs > 0 {
            let c = self.next(spin)?;
            check_ok(&c, p.step)?;
            if c.context & RECV_CTX != 0 {
                let k = (c.context & !RECV_CTX) as usize;
                let off = k * p.rseg;
                let want = p.rseg.min(p.rlen - off.min(p.rlen));
                if c.len as usize != want || c.msg_len as usize != want {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!(
                            "collective step {}: segment {k} of {} bytes, {want} expected",
                            p.step, c.msg_len
                        ),
                    ));
                }
                tmp.resize(want, 0);
                self.rbuf.buffer().read(off, &mut tmp);
                on_seg(off, &tmp);
                recvs -= 1;
            } else {
                sends -= 1;
            }
        }
        self.seg_buf = tmp;
        Ok(())
    }

    /// Waits until every rank has called it (dissemination: log2(n) rounds).
    pub fn barrier(&mut self) -> Result<()> {
        self.seq += 1;
        let (n, r) = (self.size(), self.rank);
        let mut dist = 1;
        let mut k = 0;
        while dist < n {
            self.step(
                k,
                Some(((r + dist) % n, &[])),
                Some(((r + n - dist) % n, 0)),
            )?;
            dist <<= 1;
            k += 1;
        }
        Ok(())
    }

    /// Gives every rank `root`'s `data` (its length must be the same everywhere).
    pub fn broadcast_bytes(&mut self, data: &mut [u8], root: usize) -> Result<()> {
        self.seq += 1;
        let n = self.size();
        if root >= n {
            return Err(Error::invalid(format!("root {root} of {n} ranks")));
        }
        if n == 1 {
            return Ok(());
        }
        let vr = (self.rank + n - root) % n;
        let real = |v: usize| (v + root) % n;
        if data.len() <= self.cfg.bcast_small_max {
            // Binomial tree.
            let mut mask = 1;
            while mask < n {
                if vr & mask != 0 {
                    let got = self.step(0, None, Some((real(vr - mask), data.len())))?;
                    data.copy_from_slice(&got);
                    break;
                }
                mask <<= 1;
            }
            mask >>= 1;
            while mask > 0 {
                if vr + mask < n {
                    self.step(0, Some((real(vr + mask), data)), None)?;
                }
                mask >>= 1;
            }
            return Ok(());
        }
        // Pipelined chain root -> root+1 -> ... in chunks.
        let c = self.cfg.bcast_chunk.max(1);
        let chunks = data.len().div_ceil(c);
        let total = data.len();
        let range = |i: usize| i * c..((i + 1) * c).min(total);
        for i in 0..=chunks {
            let send = (i > 0 && vr + 1 < n).then(|| (real(vr + 1), range(i - 1)));
            let recv = (i < chunks && vr > 0).then(|| (real(vr - 1), range(i)));
            let sdata = send.as_ref().map(|(to, r)| (*to, data[r.clone()].to_vec()));
            let got = self.step_tags(
                i.saturating_sub(1) as u64,
                i as u64,
                sdata.as_ref().map(|(to, d)| (*to, d.as_slice())),
                recv.as_ref().map(|(from, r)| (*from, r.len())),
            )?;
            if let Some((_, r)) = recv {
                data[r].copy_from_slice(&got);
            }
        }
        Ok(())
    }

    /// Every rank's `input` (equal lengths), concatenated in rank order, on every rank.
    pub fn allgather_bytes(&mut self, input: &[u8]) -> Result<Vec<u8>> {
        self.seq += 1;
        let (n, r, b) = (self.size(), self.rank, input.len());
        let mut out = vec![0u8; n * b];
        out[r * b..(r + 1) * b].copy_from_slice(input);
        if n.is_power_of_two() && n * b <= self.cfg.small_max {
            // Recursive doubling: the blocks held double each round.
            let mut dist = 1;
            let mut k = 0;
            while dist < n {
                let partner = r ^ dist;
                let mine = (r / dist) * dist;
                let theirs = (partner / dist) * dist;
                let send = out[mine * b..(mine + dist) * b].to_vec();
                let got = self.step(k, Some((partner, &send)), Some((partner, dist * b)))?;
                out[theirs * b..(theirs + dist) * b].copy_from_slice(&got);
                dist <<= 1;
                k += 1;
            }
        } else {
            self.ring_allgather(&mut out, &(0..=n).map(|i| i * b).collect::<Vec<_>>(), 0)?;
        }
        Ok(out)
    }

    /// Ring allgather of blocks `bounds[i]..bounds[i+1]` of `buf`, rank `i` holding block
    /// `(i + shift) % n` complete at the start.
    fn ring_allgather(&mut self, buf: &mut [u8], bounds: &[usize], shift: usize) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let blk = |i: usize| bounds[i % n]..bounds[i % n + 1];
        for s in 0..n - 1 {
            let sb = blk(r + shift + n - s);
            let rb = blk(r + shift + n - s - 1);
            let p = self.start(
                2048 + s as u64,
                2048 + s as u64,
                Some(((r + 1) % n, &buf[sb])),
                Some(((r + n - 1) % n, rb.len())),
            )?;
            let dst = &mut buf[rb];
            self.finish(p, |off, d| dst[off..off + d.len()].copy_from_slice(d))?;
        }
        Ok(())
    }

    /// Ring reduce-scatter over blocks `bounds`: afterwards rank `r` holds block `r` fully
    /// reduced (each block reduced along the ring in one fixed order).
    fn ring_reduce_scatter(
        &mut self,
        buf: &mut [u8],
        bounds: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let blk = |i: usize| bounds[i % n]..bounds[i % n + 1];
        for s in 0..n - 1 {
            let sb = blk(r + 2 * n - s - 1);
            let rb = blk(r + 2 * n - s - 2);
            let p = self.start(
                s as u64,
                s as u64,
                Some(((r + 1) % n, &buf[sb])),
                Some(((r + n - 1) % n, rb.len())),
            )?;
            let dst = &mut buf[rb];
            self.finish(p, |off, d| {
                reduce(dtype, op, &mut dst[off..off + d.len()], d, true)
            })?;
        }
        Ok(())
    }

    /// Element boundaries of `n` near-equal blocks of `count` elements, in bytes.
    fn bounds(&self, count: usize, size: usize) -> Vec<usize> {
        let n = self.size();
        (0..=n).map(|i| (count * i / n) * size).collect()
    }

    /// Reduces `data` (elements of `dtype`, little-endian) across ranks and scatters it:
    /// returns this rank's block (block `i` holds elements `count*i/n .. count*(i+1)/n`).
    pub fn reduce_scatter_bytes(
        &mut self,
        data: &[u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<Vec<u8>> {
        check_len(data, dtype)?;
        self.seq += 1;
        let bounds = self.bounds(data.len() / dtype.size(), dtype.size());
        let mut buf = data.to_vec();
        if self.size() > 1 {
            self.ring_reduce_scatter(&mut buf, &bounds, dtype, op)?;
        }
        Ok(buf[bounds[self.rank]..bounds[self.rank + 1]].to_vec())
    }

    /// Reduces `data` across ranks in place; every rank gets the same bits.
    pub fn allreduce_bytes(
        &mut self,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        check_len(data, dtype)?;
        self.seq += 1;
        let algo = self.algo(data.len(), dtype);
        self.allreduce_copied(algo, data, dtype, op)
    }

    /// The algorithm for an allreduce of `len` bytes of `dtype`.
    fn algo(&self, len: usize, dtype: DataType) -> Algo {
        let n = self.size();
        let count = len / dtype.size();
        if n == 1 {
            Algo::Alone
        } else if len <= self.cfg.gather_max && n.is_power_of_two() && n <= 64 {
            Algo::Gather
        } else if len <= self.cfg.small_max || count < n {
            Algo::Doubling
        } else if !self.cfg.write_ring || !self.domain.info().caps.ops.contains(OpSet::WRITE) {
            Algo::TaggedRing
        } else if len <= self.cfg.halving_max && n.is_power_of_two() && n <= halving::MAX_RANKS {
            Algo::Halving
        } else if n <= MAX_WRITE_RING {
            Algo::WriteRing
        } else {
            Algo::TaggedRing
        }
    }

    /// Runs `algo` on the caller's slice (the sequence number already taken).
    fn allreduce_copied(
        &mut self,
        algo: Algo,
        data: &mut [u8],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let count = data.len() / dtype.size();
        match algo {
            Algo::Alone => Ok(()),
            Algo::Gather => self.gather_doubling(data, dtype, op),
            Algo::Doubling => self.recursive_doubling(data, dtype, op),
            Algo::WriteRing => {
                let bounds = self.bounds(count, dtype.size());
                self.write_ring(RingData::Copied(data), &bounds, dtype, op)
            }
            Algo::Halving => {
                let bounds = self.bounds(count, dtype.size());
                self.halving_copied(data, &bounds, dtype, op)
            }
            Algo::TaggedRing => {
                let bounds = self.bounds(count, dtype.size());
                self.ring_reduce_scatter(data, &bounds, dtype, op)?;
                self.ring_allgather(data, &bounds, 0)
            }
        }
    }

    /// Reduces the elements of `dtype` (little-endian) in `data`, memory the caller
    /// registered in this communicator's domain, across ranks in place: every rank passes
    /// its own region (or a slice of one), all of the same length, and gets the same bits as
    /// [`Comm::allreduce_bytes`] on the same values.
    ///
    /// **No copy in, no copy out** on the large path (the pipelined write ring, above
    /// [`CommConfig::small_max`] when the provider has RDMA Write): segments are sent
    /// straight from `data`, reduced into it, and the previous rank RDMA-writes the gathered
    /// result into it. So the region needs [`Access::REMOTE_WRITE`] (and `LOCAL_WRITE`,
    /// which registration requires with it), whatever the size; a region without it, of
    /// another domain, deregistered, or a length that is not a whole number of elements is
    /// refused (`LocalProtection`, `InvalidArgument`) before anything is sent. The other
    /// paths (small payloads, one rank, the tagged ring) copy the data out into a buffer the
    /// communicator keeps, run as [`Comm::allreduce_bytes`] does and copy the result back.
    ///
    /// The ring needs where the next rank's region is. Each rank sends its region's
    /// descriptor round the ring on the reduce-scatter's first notifications, which go to
    /// the previous rank anyway (forwarded by the ranks between), and only when it changed
    /// since this rank's previous in-place allreduce: reusing a region costs nothing,
    /// changing it costs no extra message either. The previous rank checks the length: a
    /// rank that passes another length than the next makes that rank fail with `Protocol`
    /// (and the others then time out, as any mismatched collective does).
    ///
    /// While the call runs the region's bytes are unspecified (peers write into it); read
    /// the result after it returns. Data is read and written through the region's buffer
    /// (`Buffer::write_slice` / `read_slice` on a little-endian host).
    ///
    /// ```no_run
    /// # use fabric::prelude::*;
    /// # use fabric_collectives::{Comm, ReduceOp};
    /// # fn f(comm: &mut Comm, domain: &AnyDomain) -> fabric::Result<()> {
    /// let mut v = vec![1.0f32; 1 << 20];
    /// // Registered once, reused by every call.
    /// let region = domain.alloc(v.len() * 4, Access::LOCAL_WRITE | Access::REMOTE_WRITE)?;
    /// region.buffer().write_slice(0, &v);
    /// comm.allreduce_region::<f32>(&region, v.len(), ReduceOp::Sum)?;
    /// region.buffer().read_slice(0, &mut v);
    /// # Ok(()) }
    /// ```
    pub fn allreduce_region_bytes(
        &mut self,
        data: Slice<'_>,
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let len = data.len();
        if !len.is_multiple_of(dtype.size()) {
            return Err(Error::invalid(format!(
                "allreduce_region: {len} bytes is not a whole number of {dtype} elements"
            )));
        }
        let need = Access::LOCAL_WRITE | Access::REMOTE_WRITE;
        if let Err(e) = data.check_local(self.sbuf.to_ref().domain_id(), need) {
            return Err(Error::new(
                e.kind(),
                format!(
                    "allreduce_region: {} (the region must be registered in this \
                     communicator's domain with LOCAL_WRITE | REMOTE_WRITE)",
                    e.message()
                ),
            ));
        }
        self.seq += 1;
        let algo = self.algo(len, dtype);
        if algo == Algo::Alone {
            return Ok(());
        }
        if algo == Algo::WriteRing {
            let bounds = self.bounds(len / dtype.size(), dtype.size());
            let res = self.write_ring(RingData::InPlace(data), &bounds, dtype, op);
            if res.is_err() {
                // Whatever the ranks learnt of each other's regions in this call is unsure.
                (self.region_told, self.next_region) = (None, None);
            }
            return res;
        }
        if algo == Algo::Halving {
            let bounds = self.bounds(len / dtype.size(), dtype.size());
            return self.halving_in_place(data, &bounds, dtype, op);
        }
        let mut tmp = std::mem::take(&mut self.region_tmp);
        tmp.resize(len, 0);
        let buf = data.region().buffer();
        buf.read(data.offset(), &mut tmp);
        let res = self.allreduce_copied(algo, &mut tmp, dtype, op);
        if res.is_ok() {
            buf.write(data.offset(), &tmp);
        }
        self.region_tmp = tmp;
        res
    }

    /// [`Comm::allreduce_region_bytes`] over the first `count` elements of `T` in `region`.
    pub fn allreduce_region<T: Element>(
        &mut self,
        region: &MemoryRegion,
        count: usize,
        op: ReduceOp,
    ) -> Result<()> {
        let es = T::DTYPE.size();
        let len = count
            .checked_mul(es)
            .filter(|&l| l <= region.len())
            .ok_or_else(|| {
                Error::invalid(format!(
                    "allreduce_region: {count} elements of {} do not fit a region of {} bytes",
                    T::DTYPE,
                    region.len()
                ))
            })?;
        self.allreduce_region_bytes(region.slice(..len)?, T::DTYPE, op)
    }

    /// Makes (or grows) the write ring's buffers to hold `len` bytes (the work buffer too
    /// when `need_work`: an allreduce of a slice) and swaps their descriptors with the
    /// neighbours: ours go to the previous rank, the next rank's come here. Every rank
    /// calls it with the same `len` and `need_work` (a collective's payload and kind), so all
    /// grow in the same call.
    fn ensure_ring(&mut self, len: usize, need_work: bool) -> Result<()> {
        let (land_ok, work_ok) = match &self.ring {
            Some(w) => (
                w.land.len() >= len,
                !need_work || w.work.as_ref().is_some_and(|b| b.len() >= len),
            ),
            None => (false, false),
        };
        if land_ok && work_ok {
            return Ok(());
        }
        let (n, r) = (self.size(), self.rank);
        let cap = len.next_power_of_two();
        let access = Access::LOCAL_WRITE | Access::REMOTE_WRITE | Access::REMOTE_READ;
        let old = self.ring.take();
        let (old_work, old_land, old_note) = match old {
            Some(w) => (w.work, Some(w.land), Some(w.note)),
            None => (None, None, None),
        };
        let land = match old_land {
            Some(l) if land_ok => l,
            _ => Arc::new(self.domain.alloc(cap, access)?),
        };
        let work = if work_ok {
            old_work
        } else {
            Some(Arc::new(self.domain.alloc(cap, access)?))
        };
        let note = match old_note {
            Some(b) => b,
            None => Arc::new(
                self.domain
                    .alloc((NOTE_SLOT * n).max(64), Access::LOCAL_WRITE)?,
            ),
        };
        // Ours: the work buffer's descriptor (zero length when there is none), the landing
        // buffer's.
        let none = RemoteDesc {
            addr: 0,
            len: 0,
            key: 0,
        };
        let mut mine = work.as_ref().map_or(none, |w| w.desc()).to_bytes().to_vec();
        mine.extend_from_slice(&land.desc().to_bytes());
        let got = self.step(
            DESC_STEP,
            Some(((r + n - 1) % n, &mine)),
            Some(((r + 1) % n, mine.len())),
        )?;
        let next_work = RemoteDesc::from_bytes(&got[..RemoteDesc::ENCODED_LEN])?;
        let next_land = RemoteDesc::from_bytes(&got[RemoteDesc::ENCODED_LEN..])?;
        if next_land.len < len as u64 || (need_work && next_work.len < len as u64) {
            return Err(Error::new(
                ErrorKind::Protocol,
                format!(
                    "rank {}'s ring buffers hold {} bytes, {len} needed",
                    (r + 1) % n,
                    if need_work {
                        next_work.len.min(next_land.len)
                    } else {
                        next_land.len
                    }
                ),
            ));
        }
        self.ring = Some(WriteRing {
            work,
            land,
            note,
            next_work: (next_work.len > 0).then_some(next_work),
            next_land,
        });
        Ok(())
    }

    /// Ring allreduce as one pipeline of segments (as NCCL's ring does it): each segment
    /// goes through `2(n-1)` stages, the reduce-scatter's `n-1` then the allgather's. At
    /// stage `t` a rank RDMA-writes segment `k` of its block into the next rank's buffer
    /// (the landing buffer while reducing, the work buffer or the caller's region while
    /// gathering) and follows the write with a small tagged message on the same
    /// connection, which arrives after the data is placed; the receiver reduces (or keeps)
    /// the segment and sends it on as stage `t+1` at once, without waiting for the rest of
    /// the block. Each block is reduced along the ring in the same order as
    /// [`Comm::ring_reduce_scatter`], so every rank holds the same bits.
    ///
    /// No step needs a handshake: in one call every block lands in its own place, and a
    /// rank writes a place on the next rank only once the data there has been used (the
    /// ring's own dependencies: a block is final only after every rank has passed it on),
    /// also across calls (a rank finishes a call only after every block became final, so
    /// after the next rank reduced everything this rank wrote to it). In place
    /// ([`RingData::InPlace`]) the same holds for the caller's region: a rank's input at a
    /// block is read once, when the block passes through it in the reduce-scatter, before
    /// the block's final value can come back round the ring into that place.
    ///
    /// In place, the notifications of segment 0 in the reduce-scatter carry the region
    /// descriptor of the rank where the block started (empty: the same as that rank's
    /// previous call), each rank passing on what it received; the block started at the next
    /// rank, so the previous rank learns where to write the gathered blocks before its
    /// first allgather stage, and holds its allgather writes until then.
    fn write_ring(
        &mut self,
        mut data: RingData<'_>,
        bounds: &[usize],
        dtype: DataType,
        op: ReduceOp,
    ) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let total = bounds[n];
        let in_place = matches!(data, RingData::InPlace(_));
        self.ensure_ring(total, !in_place)?;
        let w = self.ring.as_ref().expect("made");
        let (work, land, note) = (w.work.clone(), w.land.clone(), w.note.clone());
        let (next_work, next_land) = (w.next_work, w.next_land);
        let blk = |i: usize| bounds[i % n]..bounds[i % n + 1];
        let biggest = (0..n).map(|i| blk(i).len()).max().unwrap_or(0);
        // Segments: the same number in every block, whole elements.
        let es = dtype.size();
        let seg = self
            .cfg
            .write_segment
            .max(biggest.div_ceil(256))
            .max(es)
            .div_ceil(es)
            * es;
        let nseg = biggest.div_ceil(seg).max(1);
        let stages = 2 * (n - 1);
        let (prev, next) = (self.peers[(r + n - 1) % n], self.peers[(r + 1) % n]);
        // Stage t: the block sent and the block received.
        let send_blk = |t: usize| {
            if t < n - 1 {
                blk(r + 2 * n - t - 1)
            } else {
                blk(r + 2 * n - (t - (n - 1)))
            }
        };
        let recv_blk = |t: usize| {
            if t < n - 1 {
                blk(r + 2 * n - t - 2)
            } else {
                blk(r + 2 * n - (t - (n - 1)) - 1)
            }
        };
        let part = |b: std::ops::Range<usize>, k: usize| {
            let s = (b.start + k * seg).min(b.end);
            s..(s + seg).min(b.end)
        };
        // In place: the note slots. Slot t receives stage t's descriptor (segment 0 of the
        // reduce-scatter), slot n-1 holds ours; `told` is the length of what we send.
        let own = (n - 1) * NOTE_SLOT;
        let carries = |t: usize, k: usize| in_place && k == 0 && t < n - 1;
        let mut told = 0;
        if let RingData::InPlace(s) = &data {
            let d = s.region().desc();
            let mine = RemoteDesc {
                addr: d.addr + s.offset() as u64,
                len: s.len() as u64,
                key: d.key,
            };
            if self.region_told != Some(mine) {
                note.buffer().write(own, &mine.to_bytes());
                told = RemoteDesc::ENCODED_LEN;
                self.region_told = Some(mine);
            }
        }
        // What arrived in each slot (bytes), the next rank's region once known this call,
        // and allgather stages held until then.
        let mut got = vec![0usize; n - 1];
        let mut next_region: Option<RemoteDesc> = None;
        let mut held: Vec<(usize, usize)> = Vec::new();
        // Every notification of the call, posted up front.
        for t in 0..stages {
            for k in 0..nseg {
                let (at, len) = if carries(t, k) {
                    (t * NOTE_SLOT, NOTE_SLOT)
                } else {
                    (0, 0)
                };
                self.ep.trecv(
                    Source::Peer(prev),
                    self.tag(RING_STEP + t as u64, k),
                    0,
                    RecvBuf::new(note.clone(), at, len),
                    RECV_CTX | (t * nseg + k) as u64,
                )?;
            }
        }
        // Copied, the data stays in `data` and `work` holds what is sent from here (and
        // receives the allgather's blocks): first the block sent at stage 0 as it is, later
        // each segment once reduced. In place, the region is all of that.
        if let RingData::Copied(d) = &data {
            let first = send_blk(0);
            work.as_ref()
                .expect("made")
                .buffer()
                .write(first.start, &d[first]);
        }
        // Segments ready to send (stage, segment), writes in flight, completions owed.
        let mut todo: VecDeque<(usize, usize)> = (0..nseg).map(|k| (0, k)).collect();
        let mut writing = 0usize;
        let mut owed = 2 * stages * nseg; // every notification sent and received
        let mut chunk = vec![0u8; REDUCE_CHUNK.min(seg)];
        let mut mine = vec![0u8; if in_place { chunk.len() } else { 0 }];
        while owed > 0 || writing > 0 {
            while writing < self.cfg.write_window.max(1) {
                let Some((t, k)) = todo.pop_front() else {
                    break;
                };
                if in_place && t >= n - 1 && next_region.is_none() {
                    held.push((t, k));
                    continue;
                }
                let range = part(send_blk(t), k);
                if !range.is_empty() {
                    let dest = if t < n - 1 {
                        next_land
                    } else if let Some(d) = next_region {
                        d
                    } else {
                        next_work.expect("exchanged with the work buffer")
                    };
                    let src = match &data {
                        RingData::Copied(_) => work.as_ref().expect("made").slice(range.clone())?,
                        RingData::InPlace(s) => s
                            .region()
                            .slice(s.offset() + range.start..s.offset() + range.end)?,
                    };
                    match self.ep.write(
                        next,
                        &[src],
                        dest.at(range.start as u64),
                        WRITE_CTX | (t * nseg + k) as u64,
                    ) {
                        Ok(()) => writing += 1,
                        // The connection's send queue is full: again after a completion.
                        Err(e) if e.kind() == ErrorKind::QueueFull && writing > 0 => {
                            todo.push_front((t, k));
                            break;
                        }
                        Err(e) => return Err(e),
                    }
                }
                // Stage 0 sends our descriptor; later stages pass on what came in.
                let body = match (carries(t, k), t) {
                    (false, _) => 0..0,
                    (true, 0) => own..own + told,
                    (true, t) => (t - 1) * NOTE_SLOT..(t - 1) * NOTE_SLOT + got[t - 1],
                };
                self.ep.tsend(
                    next,
                    self.tag(RING_STEP + t as u64, k),
                    note.slice(body)?,
                    SEND_CTX | (t * nseg + k) as u64,
                )?;
            }
            let c = self.next(false)?;
            check_ok(&c, RING_STEP)?;
            if c.context & WRITE_CTX != 0 {
                writing -= 1;
                continue;
            }
            owed -= 1;
            if c.context & RECV_CTX == 0 {
                continue;
            }
            let i = (c.context & !RECV_CTX) as usize;
            let (t, k) = (i / nseg, i % nseg);
            if carries(t, k) {
                let len = c.len as usize;
                if len != 0 && len != RemoteDesc::ENCODED_LEN {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("write ring stage {t}: a notification of {len} bytes"),
                    ));
                }
                got[t] = len;
                if t == n - 2 {
                    // The descriptor of the next rank's region.
                    let d = if len == 0 {
                        self.next_region.ok_or_else(|| {
                            Error::new(
                                ErrorKind::Protocol,
                                format!(
                                    "rank {} did not send its region's descriptor",
                                    (r + 1) % n
                                ),
                            )
                        })?
                    } else {
                        let mut b = [0u8; RemoteDesc::ENCODED_LEN];
                        note.buffer().read(t * NOTE_SLOT, &mut b);
                        RemoteDesc::from_bytes(&b)?
                    };
                    if d.len != total as u64 {
                        return Err(Error::new(
                            ErrorKind::Protocol,
                            format!(
                                "allreduce_region: rank {} passed {} bytes, rank {r} {total}: \
                                 every rank passes the same length",
                                (r + 1) % n,
                                d.len
                            ),
                        ));
                    }
                    self.next_region = Some(d);
                    next_region = Some(d);
                    todo.extend(held.drain(..));
                }
            }
            let range = part(recv_blk(t), k);
            if t < n - 1 && !range.is_empty() {
                // Reduce-scatter: the one that landed op our input, in the ring's order,
                // straight into what is sent on, a cache-sized chunk at a time (one pass
                // over the landing buffer, the input and the send buffer). Each block is
                // received once in the reduce-scatter, so the input is still ours there;
                // copied, only our own block, final after stage n-2, goes back into it.
                let last = t == n - 2;
                match &mut data {
                    RingData::Copied(d) => {
                        let mut at = range.start;
                        while at < range.end {
                            let end = (at + REDUCE_CHUNK).min(range.end);
                            let tmp = &mut chunk[..end - at];
                            land.buffer().read(at, tmp);
                            reduce(dtype, op, tmp, &d[at..end], false);
                            work.as_ref().expect("made").buffer().write(at, tmp);
                            if last {
                                d[at..end].copy_from_slice(tmp);
                            }
                            at = end;
                        }
                    }
                    RingData::InPlace(s) => reduce_landed(
                        dtype,
                        op,
                        (s.region().buffer(), s.offset() + range.start),
                        (land.buffer(), range.start),
                        range.len(),
                        true,
                        (&mut chunk, &mut mine),
                    ),
                }
            } else if !range.is_empty() {
                // Allgather: a final segment, written into `work` (or in place) by the
                // previous rank.
                if let RingData::Copied(d) = &mut data {
                    work.as_ref()
                        .expect("made")
                        .buffer()
                        .read(range.start, &mut d[range]);
                }
            }
            if t + 1 < stages {
                todo.push_back((t + 1, k));
            }
        }
        Ok(())
    }

    /// Allreduce of a small payload on a power-of-two group (see [`CommConfig::gather_max`]):
    /// recursive doubling gathers every rank's `data` (after the rounds of masks `m` in
    /// `order`, a rank holds the blocks of ranks `r ^ x`, `x` any combination of them; each
    /// round sends the held blocks in rank order, packed), then every rank folds the `n`
    /// blocks in rank order, `((v0 op v1) op v2) ...`: the same bits on every rank and in
    /// every call, whatever the order of the rounds. Odd calls take the masks from the
    /// largest down, even calls from 1 up.
    fn gather_doubling(&mut self, data: &mut [u8], dtype: DataType, op: ReduceOp) -> Result<()> {
        let (n, r, len) = (self.size(), self.rank, data.len());
        let rounds = n.trailing_zeros();
        let (mut all, mut pack) = std::mem::take(&mut self.gather_buf);
        all.resize(n * len, 0);
        all[r * len..(r + 1) * len].copy_from_slice(data);
        // Bit p set: rank p's block is held.
        let mut held: u64 = 1 << r;
        let ranks = |set: u64| (0..n).filter(move |&p| set >> p & 1 == 1);
        for i in 0..rounds {
            let m = if self.seq % 2 == 1 {
                1 << (rounds - 1 - i)
            } else {
                1 << i
            };
            let partner = r ^ m;
            // Theirs: our set moved by the mask (xor is a bijection), sorted likewise.
            let theirs = ranks(held).fold(0u64, |t, p| t | 1 << (p ^ m));
            pack.clear();
            for p in ranks(held) {
                pack.extend_from_slice(&all[p * len..(p + 1) * len]);
            }
            let k = 200 + u64::from(i);
            let st = self.start(k, k, Some((partner, &pack)), Some((partner, pack.len())))?;
            // The segments land in message order: block j of the message is the j-th rank
            // of `theirs`, at `j * len` in the message.
            let slots: [usize; 64] = {
                let mut a = [0usize; 64];
                for (j, p) in ranks(theirs).enumerate() {
                    a[j] = p;
                }
                a
            };
            self.finish(st, |off, d| {
                let mut at = 0;
                while at < d.len() {
                    let pos = off + at;
                    let (j, within) = (pos / len.max(1), pos % len.max(1));
                    let take = (len - within).min(d.len() - at);
                    let dst = slots[j] * len + within;
                    all[dst..dst + take].copy_from_slice(&d[at..at + take]);
                    at += take;
                }
            })?;
            held |= theirs;
        }
        data.copy_from_slice(&all[..len]);
        for p in 1..n {
            reduce(dtype, op, data, &all[p * len..(p + 1) * len], false);
        }
        self.gather_buf = (all, pack);
        Ok(())
    }

    /// Recursive doubling; a non-power-of-two group first folds its extra ranks in. Each
    /// pair computes `lower rank's value op higher rank's value`, so both hold the same bits.
    /// Each step reduces the partner's data as it is read out of the receive buffer (our
    /// own left for the send first), so a call allocates nothing once the buffers grew.
    fn recursive_doubling(&mut self, data: &mut [u8], dtype: DataType, op: ReduceOp) -> Result<()> {
        let (n, r) = (self.size(), self.rank);
        let p2 = 1 << (usize::BITS - 1 - n.leading_zeros());
        let rem = n - p2;
        let len = data.len();
        // Fold: among the first 2*rem ranks, even ones hand their data to the odd one above.
        let newrank = if r < 2 * rem {
            if r % 2 == 0 {
                let p = self.start(0, 0, Some((r + 1, data)), None)?;
                self.finish(p, |_, _| {})?;
                None
            } else {
                let p = self.start(0, 0, None, Some((r - 1, len)))?;
                self.finish(p, |off, d| {
                    reduce(dtype, op, &mut data[off..off + d.len()], d, true)
                })?;
                Some(r / 2)
            }
        } else {
            Some(r - rem)
        };
        if let Some(nr) = newrank {
            let real = |v: usize| if v < rem { v * 2 + 1 } else { v + rem };
            let mut mask = 1;
            let mut k = 1;
            while mask < p2 {
                let pn = nr ^ mask;
                let partner = real(pn);
                // `start` copies `data` out for the send before anything is received.
                let p = self.start(k, k, Some((partner, data)), Some((partner, len)))?;
                self.finish(p, |off, d| {
                    reduce(dtype, op, &mut data[off..off + d.len()], d, pn < nr)
                })?;
                mask <<= 1;
                k += 1;
            }
        }
        // Unfold: odd ranks give the result back.
        if r < 2 * rem {
            if r % 2 == 1 {
                let p = self.start(100, 100, Some((r - 1, data)), None)?;
                self.finish(p, |_, _| {})?;
            } else {
                let p = self.start(100, 100, None, Some((r + 1, len)))?;
                self.finish(p, |off, d| data[off..off + d.len()].copy_from_slice(d))?;
            }
        }
        Ok(())
    }

    /// [`Comm::allreduce_bytes`] over typed elements.
    pub fn allreduce<T: Element>(&mut self, data: &mut [T], op: ReduceOp) -> Result<()> {
        let mut b = to_bytes(data);
        self.allreduce_bytes(&mut b, T::DTYPE, op)?;
        from_bytes(&b, data);
        Ok(())
    }

    /// [`Comm::reduce_scatter_bytes`] over typed elements.
    pub fn reduce_scatter<T: Element>(&mut self, data: &[T], op: ReduceOp) -> Result<Vec<T>> {
        let b = self.reduce_scatter_bytes(&to_bytes(data), T::DTYPE, op)?;
        let mut out = vec![T::get(&[0; 8][..T::DTYPE.size()]); b.len() / T::DTYPE.size()];
        from_bytes(&b, &mut out);
        Ok(out)
    }

    /// [`Comm::allgather_bytes`] over typed elements.
    pub fn allgather<T: Element>(&mut self, input: &[T]) -> Result<Vec<T>> {
        let b = self.allgather_bytes(&to_bytes(input))?;
        let mut out = vec![T::get(&[0; 8][..T::DTYPE.size()]); b.len() / T::DTYPE.size()];
        from_bytes(&b, &mut out);
        Ok(out)
    }

    /// [`Comm::broadcast_bytes`] over typed elements.
    pub fn broadcast<T: Element>(&mut self, data: &mut [T], root: usize) -> Result<()> {
        let mut b = to_bytes(data);
        self.broadcast_bytes(&mut b, root)?;
        from_bytes(&b, data);
        Ok(())
    }
}

impl Drop for Comm {
    /// Closes the endpoint gracefully (up to 5 s, or the step timeout if shorter): the
    /// last messages of the last collective reach ranks still waiting for them before the
    /// connections close.
    fn drop(&mut self) {
        let _ = self.ep.close(self.cfg.timeout.min(Duration::from_secs(5)));
    }
}

/// Fails with the completion's status unless it succeeded.
fn check_ok(c: &RdmCompletion, step: u64) -> Result<()> {
    if c.is_ok() {
        return Ok(());
    }
    Err(Error::new(
        match c.status {
            fabric_rdm::RdmStatus::Error(k) => k,
            _ => ErrorKind::InvalidState,
        },
        format!(
            "collective step {step}: {:?} completed {:?}",
            c.op, c.status
        ),
    ))
}

/// Reduces `len` bytes that landed in a registered buffer into the registered bytes at
/// `acc`, in place: `acc op landed`, or `landed op acc` when `landed_first`. A chunk at a
/// time through the two staging buffers (the landed bytes, ours): two word-atomic copies
/// out, the vectorized reduction, one copy back.
fn reduce_landed(
    dtype: DataType,
    op: ReduceOp,
    acc: (&Buffer, usize),
    landed: (&Buffer, usize),
    len: usize,
    landed_first: bool,
    (theirs, mine): (&mut [u8], &mut [u8]),
) {
    let mut at = 0;
    while at < len {
        let k = (len - at).min(theirs.len()).min(mine.len());
        let (t, m) = (&mut theirs[..k], &mut mine[..k]);
        landed.0.read(landed.1 + at, t);
        acc.0.read(acc.1 + at, m);
        reduce(dtype, op, m, t, landed_first);
        acc.0.write(acc.1 + at, m);
        at += k;
    }
}

/// Reduces `acc.len()` bytes that landed in a registered buffer at `landed` into `acc`, plain
/// memory, in place: `acc op landed`, or `landed op acc` when `landed_first`. A chunk at a
/// time through `staging`: one word-atomic copy out, the vectorized reduction.
fn reduce_landed_into(
    dtype: DataType,
    op: ReduceOp,
    acc: &mut [u8],
    landed: (&Buffer, usize),
    landed_first: bool,
    staging: &mut [u8],
) {
    let step = staging.len();
    for (i, a) in acc.chunks_mut(step).enumerate() {
        let theirs = &mut staging[..a.len()];
        landed.0.read(landed.1 + i * step, theirs);
        reduce(dtype, op, a, theirs, landed_first);
    }
}

fn check_len(data: &[u8], dtype: DataType) -> Result<()> {
    if !data.len().is_multiple_of(dtype.size()) {
        return Err(Error::invalid(format!(
            "{} bytes is not a whole number of {} elements",
            data.len(),
            dtype
        )));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A domain and an endpoint on the tcp provider.
    fn open() -> (Arc<AnyDomain>, RdmEndpoint) {
        let (d, _) = fabric::Selector::new()
            .providers("tcp")
            .and_then(|s| s.open())
            .expect("tcp");
        let d = Arc::new(d);
        let ep = RdmEndpoint::new(d.clone(), fabric_rdm::RdmConfig::default()).expect("ep");
        (d, ep)
    }

    /// The algorithm depends on the length, the group and the configuration only; an
    /// in-place allreduce takes the write ring (or halving and doubling) exactly where a
    /// slice's does.
    #[test]
    fn algorithm_by_length() {
        let eps: Vec<_> = (0..4).map(|_| open()).collect();
        let names: Vec<Vec<u8>> = eps.iter().map(|(_, e)| e.name()).collect();
        let mut eps = eps.into_iter();
        let (d, ep) = eps.next().expect("rank 0");
        let cfg = CommConfig::default();
        let mut c = Comm::new(d, ep, 0, &names, cfg).expect("comm");
        assert_eq!(c.algo(8, DataType::F32), Algo::Gather);
        assert_eq!(c.algo(cfg.gather_max + 8, DataType::F64), Algo::Doubling);
        assert_eq!(c.algo(cfg.small_max, DataType::F32), Algo::Doubling);
        assert_eq!(c.algo(cfg.small_max + 4, DataType::F32), Algo::Halving);
        assert_eq!(c.algo(cfg.halving_max, DataType::F32), Algo::Halving);
        assert_eq!(c.algo(cfg.halving_max + 4, DataType::F32), Algo::WriteRing);
        c.cfg.halving_max = 0;
        assert_eq!(c.algo(cfg.small_max + 4, DataType::F32), Algo::WriteRing);
        c.cfg.halving_max = cfg.halving_max;
        c.cfg.write_ring = false;
        assert_eq!(c.algo(cfg.small_max + 4, DataType::F32), Algo::TaggedRing);
    }

    /// Bad input to the registered-buffer allreduce is refused before anything is sent, with
    /// a message that says what is wrong; good input on one rank leaves the data as it is.
    #[test]
    fn region_input_is_checked() {
        let (d, ep) = open();
        let name = ep.name();
        let mut c = Comm::new(d.clone(), ep, 0, &[name], CommConfig::default()).expect("comm");
        let rw = Access::LOCAL_WRITE | Access::REMOTE_WRITE;

        let local = d.alloc(64, Access::LOCAL_WRITE).expect("alloc");
        let e = c
            .allreduce_region_bytes(local.all(), DataType::F32, ReduceOp::Sum)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::LocalProtection, "{e}");
        assert!(e.message().contains("REMOTE_WRITE"), "{e}");

        let region = d.alloc(64, rw).expect("alloc");
        let e = c
            .allreduce_region_bytes(region.slice(0..6).unwrap(), DataType::I32, ReduceOp::Sum)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains("whole number"), "{e}");

        let e = c
            .allreduce_region::<f64>(&region, 9, ReduceOp::Max)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e}");
        assert!(e.message().contains("do not fit"), "{e}");
        assert!(region.slice(0..65).is_err(), "a slice past the region");

        let (other, _ep) = open();
        let foreign = other.alloc(64, rw).expect("alloc");
        let e = c
            .allreduce_region::<u8>(&foreign, 64, ReduceOp::Sum)
            .unwrap_err();
        assert_eq!(e.kind(), ErrorKind::LocalProtection, "{e}");

        region.buffer().write_slice(0, &[1.5f64, -2.0, 7.25]);
        c.allreduce_region::<f64>(&region, 3, ReduceOp::Sum)
            .expect("one rank");
        let mut back = [0f64; 3];
        region.buffer().read_slice(0, &mut back);
        assert_eq!(back, [1.5, -2.0, 7.25]);
    }
}
