//! One connection: send-queue bookkeeping, receive matching, the receive (progress) thread.
//!
//! Progress model: every endpoint has a receive thread that blocks in `read` on its socket
//! and handles whatever arrives (writes placed, reads answered, atomics executed, sends
//! matched, acks and responses completed), so one-sided operations complete while the
//! target application never polls, and nothing spins when nothing arrives. A transmit
//! thread sleeps until output is queued behind a busy socket (see [`crate::tx`]).
//!
//! Completion order: send-queue requests complete in post order. Each one waits for its
//! responses (a delivery ack per Send / Write / Immediate message when the peer acknowledges,
//! the last Read Response segment, the Atomic Response) and for its bytes to leave; the
//! target handles its stream in order, so responses arrive in request order.

use std::collections::{HashMap, VecDeque};
use std::io::{self, BufRead, BufReader, Read};
use std::net::{Shutdown, SocketAddr, TcpStream};
use std::sync::atomic::Ordering as AtomicOrdering;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fabric_api::pdata;
use fabric_api::{
    Access, AtomicOp, Buffer, Completion, EndpointState, Error, ErrorKind, Opcode, ProviderCode,
    RecvWr, Result, SendFlags, SendOp, SendWr, Status,
};

use crate::cq::TcpCq;
use crate::keys::{random_u32, KeyTable};
use crate::tx::{Kind, OutMsg, Payload, Queued, Tx};
use crate::wire::ddp::{
    self, atomic_op, opcode, qn, term, AtomicRequest, AtomicResponse, Header, ReadRequest,
    Terminate, TerminatedHeader,
};
use crate::wire::mpa::{self, features};
use crate::wire::WireError;

/// Bytes of unmatched incoming messages buffered per endpoint before the receive thread
/// stops reading (TCP back-pressure then holds the sender: nothing is lost). A message
/// larger than what is left waits, part-buffered, for a receive and is then placed into it
/// directly, so one endpoint never buffers more than this (semantics.md section 8).
pub(crate) const UNEXPECTED_LIMIT: usize = 8 << 20;

/// What one buffered unexpected message costs against [`UNEXPECTED_LIMIT`] beyond its
/// payload: a flood of zero-byte messages is bounded too.
pub(crate) const UNEXPECTED_ENTRY_COST: usize = 64;

/// Messages queued for the transmit thread beyond which the receive thread stops reading
/// from the peer: a peer that sends and never reads cannot grow our output (acks,
/// responses) without bound; TCP back-pressure then holds it.
pub(crate) const TX_QUEUE_LIMIT: usize = 4096;

/// What the connection setup agreed on.
#[derive(Debug, Clone)]
pub(crate) struct Negotiated {
    /// Extension features both peers speak ([`features`]).
    pub features: u8,
    /// CRC32c in use.
    pub crc: bool,
    /// Outstanding reads and atomics we may have in flight (min of our ORD, peer IRD).
    pub ord: u32,
    /// MPA revision in use.
    pub revision: u8,
    /// The peer's application private data.
    pub peer_private: Vec<u8>,
    /// Swallow the first zero-length Send (a peer-to-peer RTR).
    pub expect_send_rtr: bool,
    /// The credit area of a peer on this framework's iwarp provider (from its private-data
    /// frame): a graceful close writes the close mark there first ([`pdata`]).
    pub peer_area: Option<pdata::AreaDesc>,
}

impl Negotiated {
    fn has(&self, f: u8) -> bool {
        self.features & f != 0
    }
}

/// What a send-queue request still waits for.
#[derive(Debug)]
enum Resp {
    /// Delivery acks (or nothing, with a foreign peer).
    Acks,
    /// The last Read Response segment for this sink STag.
    Read { sink: u32 },
    /// The Atomic Response with this id, whose value lands at (buffer, offset).
    Atomic {
        req_id: u32,
        result: Arc<Buffer>,
        offset: usize,
    },
}

#[derive(Debug)]
struct Pending {
    seq: u64,
    context: u64,
    opcode: Opcode,
    signaled: bool,
    /// Write acks still expected (Write messages are acknowledged when placed).
    wait_write: u32,
    /// Message acks still expected (Send and Immediate Data are acknowledged when they
    /// land in a receive, which may be long after later writes were placed).
    wait_msg: u32,
    /// A Read or Atomic Response is still expected.
    wait_resp: bool,
    /// All bytes handed to the kernel.
    sent: bool,
    byte_len: u64,
    resp: Resp,
    error: Option<(ErrorKind, Option<ProviderCode>)>,
    /// An RDMA Write's target (STag, tagged offset, length): what a foreign peer's
    /// Terminate names when it refuses the write.
    write_target: Option<(u32, u64, u64)>,
}

impl Pending {
    fn done(&self) -> bool {
        self.error.is_some()
            || (self.wait_write == 0 && self.wait_msg == 0 && !self.wait_resp && self.sent)
    }
    fn is_read_like(&self) -> bool {
        matches!(self.resp, Resp::Read { .. } | Resp::Atomic { .. })
    }
}

type Sges = Vec<(Arc<Buffer>, usize, usize)>;

#[derive(Debug)]
struct PostedRecv {
    context: u64,
    sges: Sges,
    total: usize,
}

#[derive(Debug)]
enum Arrived {
    Send { data: Vec<u8>, imm: Option<u32> },
    WriteImm { imm: u32, len: u64 },
}

impl Arrived {
    /// What the message costs against [`UNEXPECTED_LIMIT`].
    fn cost(&self) -> usize {
        UNEXPECTED_ENTRY_COST
            + match self {
                Arrived::Send { data, .. } => data.len(),
                Arrived::WriteImm { .. } => 0,
            }
    }
}

/// A request held back by a fence or the ORD limit, with the messages that carry it.
#[derive(Debug)]
struct Gated {
    msgs: Vec<OutMsg>,
    read_like: bool,
    fence: bool,
}

#[derive(Debug)]
struct State {
    status: EndpointState,
    sq: VecDeque<Pending>,
    backlog: VecDeque<Gated>,
    /// Reads and atomics transmitted and not yet answered.
    reads_out: u32,
    read_sinks: HashMap<u32, Sges>,
    rq: VecDeque<PostedRecv>,
    /// The receive the current incoming message is being placed into: older than every
    /// receive in `rq`, and flushed with them if the connection ends mid-message.
    placing: Option<PostedRecv>,
    unexpected: VecDeque<Arrived>,
    unexpected_bytes: usize,
    next_seq: u64,
    msn: [u32; qn::COUNT],
    next_req_id: u32,
}

/// The shared state of one connection.
#[derive(Debug)]
pub(crate) struct Conn {
    pub domain_id: u64,
    pub keys: Arc<KeyTable>,
    pub sock: TcpStream,
    pub local: SocketAddr,
    pub peer: SocketAddr,
    pub neg: Negotiated,
    pub max_seg: usize,
    pub send_cq: TcpCq,
    pub recv_cq: TcpCq,
    pub sq_depth: usize,
    pub rq_depth: usize,
    st: Mutex<State>,
    st_cv: Condvar,
    tx: Tx,
}

/// Why the receive thread stopped.
#[derive(Debug)]
enum RxEnd {
    /// The peer closed the stream (graceful close or process exit).
    Eof,
    /// The stream failed.
    Io(io::Error),
    /// The peer sent something we must refuse: tell it with this Terminate.
    Violation(Terminate, String),
    /// The peer sent a Terminate.
    PeerTerminate(Terminate, Option<TerminatedHeader>),
    /// We closed or failed locally.
    Local,
}

impl From<io::Error> for RxEnd {
    fn from(e: io::Error) -> Self {
        if e.kind() == io::ErrorKind::UnexpectedEof {
            RxEnd::Eof
        } else {
            RxEnd::Io(e)
        }
    }
}

fn violation(t: Terminate, detail: impl Into<String>) -> RxEnd {
    RxEnd::Violation(t, detail.into())
}

fn wire_violation(e: WireError) -> RxEnd {
    let t = match e.field {
        "RDMAP opcode" => term::INVALID_OPCODE,
        "DDP version" | "RDMAP version" => Terminate {
            layer: 0,
            etype: 2,
            ecode: 0x05,
        },
        _ => term::FPDU,
    };
    violation(t, e.to_string())
}

impl Conn {
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        domain_id: u64,
        keys: Arc<KeyTable>,
        sock: TcpStream,
        neg: Negotiated,
        max_seg: usize,
        send_cq: TcpCq,
        recv_cq: TcpCq,
        sq_depth: usize,
        rq_depth: usize,
    ) -> io::Result<Arc<Conn>> {
        let local = sock.local_addr()?;
        let peer = sock.peer_addr()?;
        Ok(Arc::new(Conn {
            domain_id,
            keys,
            sock,
            local,
            peer,
            neg,
            max_seg,
            send_cq,
            recv_cq,
            sq_depth,
            rq_depth,
            st: Mutex::new(State {
                status: EndpointState::Connected,
                sq: VecDeque::new(),
                backlog: VecDeque::new(),
                reads_out: 0,
                read_sinks: HashMap::new(),
                rq: VecDeque::new(),
                placing: None,
                unexpected: VecDeque::new(),
                unexpected_bytes: 0,
                next_seq: 0,
                msn: [1; qn::COUNT],
                next_req_id: 1,
            }),
            st_cv: Condvar::new(),
            tx: Tx::default(),
        }))
    }

    /// Starts the receive and transmit threads.
    pub fn start(self: &Arc<Self>) -> io::Result<()> {
        let reader = self.sock.try_clone()?;
        let me = self.clone();
        std::thread::Builder::new()
            .name(format!("fabric-tcp-rx {}", self.local))
            .spawn(move || me.rx_main(reader))?;
        let me = self.clone();
        std::thread::Builder::new()
            .name(format!("fabric-tcp-tx {}", self.local))
            .spawn(move || me.tx_main())?;
        Ok(())
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.st.lock().expect("endpoint state poisoned")
    }

    pub fn state(&self) -> EndpointState {
        self.lock().status
    }

    fn check_connected(st: &State) -> Result<()> {
        match st.status {
            EndpointState::Connected => Ok(()),
            EndpointState::Error => Err(Error::new(
                ErrorKind::InvalidState,
                "endpoint is in the error state",
            )),
            EndpointState::Disconnected => Err(Error::new(
                ErrorKind::InvalidState,
                "endpoint is disconnected",
            )),
        }
    }

    // ----- posting -----------------------------------------------------------------

    fn gather(&self, sgl: &[fabric_api::Slice<'_>], need: Access) -> Result<(Sges, usize)> {
        if sgl.len() > crate::MAX_SGE as usize {
            return Err(Error::invalid(format!(
                "{} gather entries exceed the maximum of {}",
                sgl.len(),
                crate::MAX_SGE
            )));
        }
        let mut sges = Vec::with_capacity(sgl.len());
        let mut total = 0usize;
        for s in sgl {
            let r = s.check_local(self.domain_id, need)?;
            total += s.len();
            sges.push((r.shared_buffer(), s.offset(), s.len()));
        }
        if total as u64 > crate::MAX_MSG_SIZE {
            return Err(Error::invalid(format!(
                "message of {total} bytes exceeds the maximum of {}",
                crate::MAX_MSG_SIZE
            )));
        }
        Ok((sges, total))
    }

    fn need_feature(&self, f: u8, what: &str) -> Result<()> {
        if self.neg.has(f) {
            Ok(())
        } else {
            Err(Error::unsupported(format!(
                "{what} needs this framework's extension on both ends; the peer did not negotiate it (a foreign iWARP peer, or extensions disabled)"
            )))
        }
    }

    pub fn post_send(&self, wr: &SendWr<'_>) -> Result<()> {
        let acks = self.neg.has(features::ACKS);
        let inline = wr.flags.contains(SendFlags::INLINE);
        let mut msgs = Vec::with_capacity(2);
        let (wait_write, wait_msg, byte_len, resp_kind, read_like);
        enum R {
            Acks,
            Read(Sges),
            Atomic(Arc<Buffer>, usize),
        }
        let payload = |sges: Sges, total: usize| -> Result<Payload> {
            if inline {
                if total > crate::MAX_INLINE as usize {
                    return Err(Error::invalid(format!(
                        "inline payload of {total} bytes exceeds max inline {}",
                        crate::MAX_INLINE
                    )));
                }
                let mut v = Vec::with_capacity(total);
                for (b, off, len) in &sges {
                    let start = v.len();
                    v.resize(start + len, 0);
                    b.read(*off, &mut v[start..]);
                }
                Ok(Payload::Inline(v))
            } else {
                Ok(Payload::Memory(sges))
            }
        };
        match wr.op {
            SendOp::Send { sgl, imm } => {
                if imm.is_some() {
                    self.need_feature(features::IMMEDIATE, "send with immediate data")?;
                }
                let (sges, total) = self.gather(sgl, Access::empty())?;
                let op = if imm.is_some() {
                    opcode::SEND_IMM
                } else {
                    opcode::SEND
                };
                msgs.push(OutMsg {
                    kind: Kind::Untagged {
                        opcode: op,
                        ulp: imm.unwrap_or(0),
                        qn: qn::SEND,
                        msn: 0,
                    },
                    payload: payload(sges, total)?,
                    sent_seq: None,
                    inbound: false,
                });
                (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                    (0, u32::from(acks), total as u64, R::Acks, false);
            }
            SendOp::Write { sgl, remote, imm } => {
                if imm.is_some() {
                    self.need_feature(features::IMMEDIATE, "write with immediate data")?;
                }
                let (sges, total) = self.gather(sgl, Access::empty())?;
                msgs.push(OutMsg {
                    kind: Kind::Tagged {
                        opcode: opcode::WRITE,
                        stag: remote.key,
                        to: remote.addr,
                    },
                    payload: payload(sges, total)?,
                    sent_seq: None,
                    inbound: false,
                });
                if let Some(v) = imm {
                    let mut p = vec![0u8; ddp::IMMEDIATE_LEN];
                    p[..4].copy_from_slice(&v.to_be_bytes());
                    msgs.push(OutMsg::control(
                        Kind::Untagged {
                            opcode: opcode::IMMEDIATE,
                            ulp: 0,
                            qn: qn::SEND,
                            msn: 0,
                        },
                        p,
                    ));
                }
                let imm_msgs = msgs.len() as u32 - 1;
                (wait_write, wait_msg, byte_len, resp_kind, read_like) = (
                    u32::from(acks),
                    if acks { imm_msgs } else { 0 },
                    total as u64,
                    R::Acks,
                    false,
                );
            }
            SendOp::Read { sgl, remote } => {
                let (sges, total) = self.gather(sgl, Access::LOCAL_WRITE)?;
                if inline {
                    return Err(Error::invalid("a read cannot be inline"));
                }
                (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                    (0, 0, total as u64, R::Read(sges), true);
                msgs.push(read_request(total as u32, remote.key, remote.addr));
            }
            SendOp::Atomic { result, remote, op } => {
                self.need_feature(features::ATOMICS, "64-bit atomics")?;
                // Refused at post, as rxe refuses it (validate_send_wr: -EINVAL); the
                // target still checks, for peers that do not.
                if remote.addr % 8 != 0 {
                    return Err(Error::invalid(format!(
                        "atomic target {:#x} is not 8-byte aligned",
                        remote.addr
                    )));
                }
                if result.len() != 8 {
                    return Err(Error::invalid(format!(
                        "atomic result buffer must be 8 bytes, got {}",
                        result.len()
                    )));
                }
                let (sges, _) = self.gather(std::slice::from_ref(&result), Access::LOCAL_WRITE)?;
                let (b, off, _) = sges.into_iter().next().expect("one entry");
                let (code, add_swap, compare) = match op {
                    AtomicOp::FetchAdd { add } => (atomic_op::FETCH_ADD, add, 0),
                    AtomicOp::CompareSwap { compare, swap } => {
                        (atomic_op::COMPARE_SWAP, swap, compare)
                    }
                };
                msgs.push(OutMsg::control(
                    Kind::Untagged {
                        opcode: opcode::ATOMIC_REQUEST,
                        ulp: 0,
                        qn: qn::ATOMIC,
                        msn: 0,
                    },
                    AtomicRequest {
                        op: code,
                        req_id: 0,
                        stag: remote.key,
                        to: remote.addr,
                        add_swap,
                        add_swap_mask: !0,
                        compare,
                        compare_mask: !0,
                    }
                    .encode()
                    .to_vec(),
                ));
                (wait_write, wait_msg, byte_len, resp_kind, read_like) =
                    (0, 0, 8, R::Atomic(b, off), true);
            }
        }
        // A foreign peer sends no delivery acks. Base RDMAP still orders a Read Request
        // after the Sends and Writes before it, so a zero-length Read right behind them comes
        // back only once they were placed (or after the Terminate that refused them): the
        // request completes with that response. siw answers zero-length Reads without
        // checking any STag (siw_qp_rx.c, siw_init_rresp: no SGE when the length is 0).
        let (resp_kind, read_like) = match resp_kind {
            R::Acks if !acks => {
                msgs.push(read_request(0, 0, 0));
                (R::Read(Vec::new()), true)
            }
            other => (other, read_like),
        };

        let mut st = self.lock();
        Self::check_connected(&st)?;
        if st.sq.len() >= self.sq_depth {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("send queue of depth {} is full", self.sq_depth),
            ));
        }
        self.send_cq.reserve()?;
        let seq = st.next_seq;
        st.next_seq += 1;
        let resp = match resp_kind {
            R::Acks => Resp::Acks,
            R::Read(sges) => {
                let sink = loop {
                    let s = random_u32();
                    if s != 0 && !st.read_sinks.contains_key(&s) {
                        break s;
                    }
                };
                st.read_sinks.insert(sink, sges);
                // The Read Request is the request's last message.
                let body = match &mut msgs.last_mut().expect("a read request").payload {
                    Payload::Inline(v) => v,
                    Payload::Memory(_) => unreachable!("read requests are inline"),
                };
                body[..4].copy_from_slice(&sink.to_be_bytes());
                Resp::Read { sink }
            }
            R::Atomic(result, offset) => {
                let req_id = st.next_req_id;
                st.next_req_id = st.next_req_id.wrapping_add(1);
                if let Payload::Inline(v) = &mut msgs[0].payload {
                    v[4..8].copy_from_slice(&req_id.to_be_bytes());
                }
                Resp::Atomic {
                    req_id,
                    result,
                    offset,
                }
            }
        };
        let write_target = match msgs.first() {
            Some(OutMsg {
                kind:
                    Kind::Tagged {
                        opcode: opcode::WRITE,
                        stag,
                        to,
                    },
                payload,
                ..
            }) => Some((*stag, *to, payload.len() as u64)),
            _ => None,
        };
        msgs.last_mut().expect("at least one message").sent_seq = Some(seq);
        st.sq.push_back(Pending {
            seq,
            context: wr.context,
            opcode: wr.opcode(),
            signaled: wr.flags.contains(SendFlags::SIGNALED),
            wait_write,
            wait_msg,
            wait_resp: read_like,
            sent: false,
            byte_len,
            resp,
            error: None,
            write_target,
        });
        let gated = Gated {
            msgs,
            read_like,
            fence: wr.flags.contains(SendFlags::FENCE),
        };
        if st.backlog.is_empty() && self.may_start(&st, &gated) {
            self.start_gated(&mut st, gated);
        } else {
            st.backlog.push_back(gated);
        }
        Ok(())
    }

    fn may_start(&self, st: &State, g: &Gated) -> bool {
        !(g.fence && st.reads_out > 0 || g.read_like && st.reads_out >= self.neg.ord)
    }

    fn start_gated(&self, st: &mut State, g: Gated) {
        if g.read_like {
            st.reads_out += 1;
        }
        for m in g.msgs {
            self.transmit(st, m);
        }
    }

    fn release_backlog(&self, st: &mut State) {
        while let Some(g) = st.backlog.front() {
            if !self.may_start(st, g) {
                break;
            }
            let g = st.backlog.pop_front().expect("front exists");
            self.start_gated(st, g);
        }
    }

    pub fn post_recv(&self, wr: &RecvWr<'_>) -> Result<()> {
        let (sges, total) = self.gather(wr.sgl, Access::LOCAL_WRITE)?;
        let mut st = self.lock();
        Self::check_connected(&st)?;
        if st.rq.len() >= self.rq_depth {
            return Err(Error::new(
                ErrorKind::QueueFull,
                format!("receive queue of depth {} is full", self.rq_depth),
            ));
        }
        self.recv_cq.reserve()?;
        let recv = PostedRecv {
            context: wr.context,
            sges,
            total,
        };
        if let Some(arrived) = st.unexpected.pop_front() {
            st.unexpected_bytes -= arrived.cost();
            self.deliver_buffered(&mut st, recv, arrived);
        } else {
            st.rq.push_back(recv);
        }
        // The receive thread may wait for room or for a receive (back-pressure).
        self.st_cv.notify_all();
        Ok(())
    }

    /// Delivers a message that arrived before its receive was posted.
    fn deliver_buffered(&self, st: &mut State, recv: PostedRecv, arrived: Arrived) {
        match arrived {
            Arrived::Send { data, imm } => {
                if data.len() > recv.total {
                    self.message_too_long(st, recv, data.len());
                    return;
                }
                scatter(&recv.sges, 0, &data);
                self.complete_recv(st, recv.context, Opcode::Recv, data.len() as u64, imm);
            }
            Arrived::WriteImm { imm, len } => {
                self.complete_recv(st, recv.context, Opcode::RecvWriteWithImm, len, Some(imm))
            }
        }
    }

    fn complete_recv(
        &self,
        st: &mut State,
        context: u64,
        opcode: Opcode,
        byte_len: u64,
        imm: Option<u32>,
    ) {
        self.recv_cq.push(Completion {
            context,
            opcode,
            status: Status::Success,
            provider_code: None,
            byte_len,
            imm,
        });
        if self.neg.has(features::ACKS) {
            self.send_ack(st, ddp::ACK_MESSAGES | 1);
        }
    }

    /// A message longer than its receive: the receive completes LocalLength, the sender is
    /// told (Terminate, DDP "message too long", RemoteInvalidRequest there), both ends fail.
    fn message_too_long(&self, st: &mut State, recv: PostedRecv, len: usize) {
        tracing::debug!(
            len,
            room = recv.total,
            "message longer than the matched receive"
        );
        self.recv_cq.push(Completion {
            context: recv.context,
            opcode: Opcode::Recv,
            status: Status::Error(ErrorKind::LocalLength),
            provider_code: Some(term::MSG_TOO_LONG.code()),
            byte_len: len as u64,
            imm: None,
        });
        self.send_terminate(st, term::MSG_TOO_LONG);
        self.enter_error(st, None, EndpointState::Error);
    }

    // ----- transmit ------------------------------------------------------------------

    /// Assigns the MSN and hands the message to the socket or the transmit thread.
    fn transmit(&self, st: &mut State, mut m: OutMsg) {
        if let Kind::Untagged { qn, msn, .. } = &mut m.kind {
            *msn = st.msn[*qn as usize];
            st.msn[*qn as usize] = msn.wrapping_add(1);
        }
        let mut tx = self.tx.state.lock().expect("tx poisoned");
        if tx.closed {
            return;
        }
        if tx.queue.is_empty() && !tx.busy && m.payload.len() <= DIRECT_LIMIT {
            let bytes = m.encode(self.max_seg, self.neg.crc);
            let n = match socket2::SockRef::from(&self.sock)
                .send_with_flags(&bytes, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL)
            {
                Ok(n) => n,
                Err(e)
                    if e.kind() == io::ErrorKind::WouldBlock
                        || e.kind() == io::ErrorKind::Interrupted =>
                {
                    0
                }
                Err(e) => {
                    tracing::debug!("send failed: {e}");
                    0 // the receive thread sees the broken stream and fails the endpoint
                }
            };
            if n == bytes.len() {
                drop(tx);
                if let Some(seq) = m.sent_seq {
                    self.mark_sent(st, seq);
                }
                return;
            }
            tx.inbound += u32::from(m.inbound);
            tx.queue
                .push_back(Queued::Tail(bytes[n..].to_vec(), m.sent_seq, m.inbound));
        } else {
            tx.inbound += u32::from(m.inbound);
            tx.queue.push_back(Queued::Msg(m));
        }
        drop(tx);
        self.tx.wake.notify_one();
    }

    /// Acknowledges `ulp & ACK_COUNT` placed messages: writes, or (with [`ddp::ACK_MESSAGES`])
    /// sends and immediate data that landed in receives.
    fn send_ack(&self, st: &mut State, ulp: u32) {
        self.transmit(
            st,
            OutMsg::control(
                Kind::Untagged {
                    opcode: opcode::ACK,
                    ulp,
                    qn: qn::ACK,
                    msn: 0,
                },
                Vec::new(),
            ),
        );
    }

    fn send_terminate(&self, st: &mut State, t: Terminate) {
        self.transmit(
            st,
            OutMsg::control(
                Kind::Untagged {
                    opcode: opcode::TERMINATE,
                    ulp: 0,
                    qn: qn::TERMINATE,
                    msn: 0,
                },
                t.encode().to_vec(),
            ),
        );
    }

    fn mark_sent(&self, st: &mut State, seq: u64) {
        if let Some(p) = st.sq.iter_mut().find(|p| p.seq == seq) {
            p.sent = true;
        }
        self.drain_sq(st);
    }

    fn tx_main(self: Arc<Self>) {
        loop {
            let item = {
                let mut tx = self.tx.state.lock().expect("tx poisoned");
                loop {
                    if let Some(item) = tx.queue.pop_front() {
                        tx.busy = true;
                        // Taken before it is written: by the time the peer has this
                        // response (and may ask again), it no longer counts.
                        tx.inbound -= u32::from(item.inbound());
                        self.tx.drained.notify_all();
                        break item;
                    }
                    if tx.closed {
                        let _ = self.sock.shutdown(Shutdown::Both);
                        return;
                    }
                    tx = self.tx.wake.wait(tx).expect("tx poisoned");
                }
            };
            let (res, seq) = match &item {
                Queued::Tail(bytes, seq, _) => (io::Write::write_all(&mut &self.sock, bytes), *seq),
                Queued::Msg(m) => (
                    m.write_to(&self.sock, self.max_seg, self.neg.crc),
                    m.sent_seq,
                ),
            };
            drop(item);
            if let Err(e) = res {
                tracing::debug!("transmit failed: {e}");
                let mut tx = self.tx.state.lock().expect("tx poisoned");
                tx.closed = true;
                tx.queue.clear();
                tx.inbound = 0;
                tx.busy = false;
                drop(tx);
                self.tx.drained.notify_all();
                let _ = self.sock.shutdown(Shutdown::Both);
                return;
            }
            if let Some(seq) = seq {
                let mut st = self.lock();
                self.mark_sent(&mut st, seq);
            }
            self.tx.state.lock().expect("tx poisoned").busy = false;
        }
    }

    /// Stops output: the transmit thread writes what is queued (when `flush`), then shuts
    /// the socket down.
    fn close_tx(&self, flush: bool) {
        let mut tx = self.tx.state.lock().expect("tx poisoned");
        tx.closed = true;
        if !flush {
            tx.queue.clear();
            tx.inbound = 0;
        }
        drop(tx);
        self.tx.wake.notify_all();
        self.tx.drained.notify_all();
        if !flush {
            let _ = self.sock.shutdown(Shutdown::Both);
        }
    }

    // ----- completion and errors -------------------------------------------------------

    fn drain_sq(&self, st: &mut State) {
        while st.sq.front().is_some_and(Pending::done) {
            let p = st.sq.pop_front().expect("front exists");
            match p.error {
                None if !p.signaled => self.send_cq.unreserve(),
                None => self.send_cq.push(Completion {
                    context: p.context,
                    opcode: p.opcode,
                    status: Status::Success,
                    provider_code: None,
                    byte_len: p.byte_len,
                    imm: None,
                }),
                Some((kind, code)) => self.send_cq.push(Completion {
                    context: p.context,
                    opcode: p.opcode,
                    status: Status::Error(kind),
                    provider_code: code,
                    byte_len: 0,
                    imm: None,
                }),
            }
        }
    }

    /// Enters the error (or disconnected) state: the first unfinished request gets `head`,
    /// every other outstanding request and receive completes Flushed.
    fn enter_error(
        &self,
        st: &mut State,
        head: Option<(ErrorKind, Option<ProviderCode>)>,
        status: EndpointState,
    ) {
        if st.status != EndpointState::Connected {
            return;
        }
        st.status = status;
        let mut head = head;
        for p in st.sq.iter_mut().filter(|p| !p.done()) {
            p.error = Some(head.take().unwrap_or((ErrorKind::Flushed, None)));
        }
        st.backlog.clear();
        st.read_sinks.clear();
        self.drain_sq(st);
        let placing = st.placing.take();
        for r in placing.into_iter().chain(st.rq.drain(..)) {
            self.recv_cq.push(Completion {
                context: r.context,
                opcode: Opcode::Recv,
                status: Status::Error(ErrorKind::Flushed),
                provider_code: None,
                byte_len: 0,
                imm: None,
            });
        }
        st.unexpected.clear();
        st.unexpected_bytes = 0;
        self.st_cv.notify_all();
    }

    /// A foreign peer's Terminate named the RDMA Write it refused (its STag and tagged
    /// offset): that write takes the error, and the Sends and Writes posted before it were
    /// placed (the peer processes its stream in order) even where their confirming
    /// zero-length Read never came back: siw may send its Terminate ahead of Read Responses
    /// it still owes. Reads and atomics before it stay unfinished (their responses will
    /// not come) and are flushed. Returns whether a write matched; without a match nothing
    /// changes.
    fn blame_write(
        st: &mut State,
        stag: u32,
        to: u64,
        head: (ErrorKind, Option<ProviderCode>),
    ) -> bool {
        let hit = st.sq.iter().position(|p| {
            !p.done()
                && p.write_target
                    .is_some_and(|(s, base, len)| s == stag && to >= base && to - base < len.max(1))
        });
        let Some(i) = hit else { return false };
        for p in st.sq.iter_mut().take(i).filter(|p| !p.done()) {
            if matches!(p.opcode, Opcode::Send | Opcode::Write) {
                p.sent = true;
                p.wait_write = 0;
                p.wait_msg = 0;
                p.wait_resp = false;
            }
        }
        st.sq[i].error = Some(head);
        true
    }

    /// Local graceful close. Against this framework's iwarp provider the close mark goes
    /// into the peer's credit area first: iWARP gives the peer the same signal for a close
    /// and a failure, and the mark is how it tells them apart.
    pub fn close(&self) {
        let mut st = self.lock();
        let mark = (st.status == EndpointState::Connected)
            .then_some(self.neg.peer_area)
            .flatten();
        self.enter_error(&mut st, None, EndpointState::Disconnected);
        let Some(area) = mark else {
            drop(st);
            self.close_tx(false);
            return;
        };
        self.transmit(
            &mut st,
            OutMsg::control(
                Kind::Tagged {
                    opcode: opcode::WRITE,
                    stag: area.stag,
                    to: area.addr + pdata::area::CLOSED as u64,
                },
                1u64.to_ne_bytes().to_vec(),
            ),
        );
        drop(st);
        self.close_tx(true);
        // Bounded: a peer that stops reading must not hold up the close.
        let deadline = Instant::now() + CLOSE_MARK_WAIT;
        loop {
            let tx = self.tx.state.lock().expect("tx poisoned");
            if tx.queue.is_empty() && !tx.busy {
                break;
            }
            drop(tx);
            if Instant::now() >= deadline {
                tracing::debug!(peer = %self.peer, "close mark not written within {CLOSE_MARK_WAIT:?}");
                break;
            }
            std::thread::sleep(Duration::from_millis(1));
        }
        let _ = self.sock.shutdown(Shutdown::Both);
    }

    // ----- receive -------------------------------------------------------------------

    fn rx_main(self: Arc<Self>, stream: TcpStream) {
        let mut r = Rx::new(stream);
        let end = loop {
            if let Err(end) = self.rx_fpdu(&mut r) {
                break end;
            }
        };
        let mut st = self.lock();
        let was_connected = st.status == EndpointState::Connected;
        // Whatever arrives after a local close or error (a late ack, say) is not the
        // peer's fault: the connection is already over.
        let end = if was_connected { end } else { RxEnd::Local };
        match end {
            RxEnd::Violation(t, detail) => {
                tracing::warn!(peer = %self.peer, "peer violated the protocol or an access right: {detail}; sending Terminate {t:?}");
                // A receive taken for a message that will never finish is in
                // `st.placing`: enter_error flushes it first.
                self.send_terminate(&mut st, t);
                self.enter_error(&mut st, None, EndpointState::Error);
                drop(st);
                self.close_tx(true);
            }
            RxEnd::PeerTerminate(t, named) => {
                tracing::debug!(peer = %self.peer, "peer terminated the connection: {t:?}, naming {named:?}");
                let head = (t.error_kind(), Some(t.code()));
                let blamed = match named {
                    Some(TerminatedHeader::Tagged { stag, to }) => {
                        Self::blame_write(&mut st, stag, to, head)
                    }
                    _ => false,
                };
                // Unless a write took the error, the oldest unfinished request does.
                self.enter_error(&mut st, (!blamed).then_some(head), EndpointState::Error);
                drop(st);
                self.close_tx(false);
            }
            RxEnd::Eof | RxEnd::Io(_) | RxEnd::Local => {
                let head = match &end {
                    RxEnd::Io(e) if e.kind() == io::ErrorKind::TimedOut => Some((
                        ErrorKind::RetryExceeded,
                        e.raw_os_error().map(ProviderCode::Errno),
                    )),
                    _ => None,
                };
                if was_connected {
                    tracing::debug!(peer = %self.peer, "connection ended: {end:?}");
                }
                self.enter_error(&mut st, head, EndpointState::Disconnected);
                drop(st);
                self.close_tx(false);
            }
        }
    }

    /// Reads and handles one FPDU.
    fn rx_fpdu(&self, r: &mut Rx) -> std::result::Result<(), RxEnd> {
        self.wait_tx_room()?;
        let mut head = [0u8; 2 + ddp::UNTAGGED_LEN];
        r.reader.read_exact(&mut head[..4])?;
        let ulpdu_len = usize::from(u16::from_be_bytes([head[0], head[1]]));
        let hdr_len = Header::len_for_ctrl(u16::from_be_bytes([head[2], head[3]]));
        if ulpdu_len < hdr_len {
            return Err(violation(
                term::FPDU,
                format!("MPA ULPDU length {ulpdu_len} shorter than its DDP header ({hdr_len})"),
            ));
        }
        r.reader.read_exact(&mut head[4..2 + hdr_len])?;
        let hdr = Header::decode(&head[2..2 + hdr_len]).map_err(wire_violation)?;
        r.crc = if self.neg.crc {
            Some(crc32c::crc32c(&head[..2 + hdr_len]))
        } else {
            None
        };
        let len = ulpdu_len - hdr_len;
        self.handle(r, hdr, len)?;
        // Trailer: pad and CRC.
        let pad = mpa::pad_len(ulpdu_len);
        let mut trailer = [0u8; 7];
        r.reader.read_exact(&mut trailer[..pad + 4])?;
        if let Some(c) = r.crc {
            let c = crc32c::crc32c_append(c, &trailer[..pad]);
            if mpa::crc_bytes(c) != trailer[pad..pad + 4] {
                return Err(violation(term::CRC, "MPA CRC mismatch"));
            }
        }
        Ok(())
    }

    fn handle(&self, r: &mut Rx, hdr: Header, len: usize) -> std::result::Result<(), RxEnd> {
        match hdr {
            Header::Tagged {
                opcode: opcode::WRITE,
                stag,
                to,
                last,
            } => {
                if len > 0 {
                    match self.keys.lookup(stag, to, len as u64, Access::REMOTE_WRITE) {
                        // The target is remote-accessible memory, not tied to a local
                        // completion: placed as it arrives, word-atomically.
                        Ok(t) => r.place(&t.buffer, t.offset, len)?,
                        Err(t) => {
                            r.discard(len)?;
                            return Err(violation(t, format!("RDMA Write of {len} bytes to STag {stag:#x} at {to:#x} refused")));
                        }
                    }
                }
                r.write_len += len as u64;
                if last {
                    r.last_write_len = std::mem::take(&mut r.write_len);
                    if self.neg.has(features::ACKS) {
                        let mut st = self.lock();
                        self.send_ack(&mut st, 1);
                    }
                }
                Ok(())
            }
            Header::Tagged {
                opcode: _,
                stag,
                to,
                last,
            } => self.on_read_response(r, stag, to, len, last),
            Header::Untagged {
                opcode: op,
                ulp,
                qn: q,
                msn,
                mo,
                last,
            } => {
                if q as usize >= qn::COUNT {
                    r.discard(len)?;
                    return Err(violation(term::INVALID_QN, format!("DDP queue number {q}")));
                }
                let qi = q as usize;
                if msn != r.expect_msn[qi] || mo as usize != r.mo[qi] {
                    r.discard(len)?;
                    return Err(violation(
                        term::FPDU,
                        format!(
                            "DDP MSN/MO on queue {q}: got {msn}/{mo}, expected {}/{}",
                            r.expect_msn[qi], r.mo[qi]
                        ),
                    ));
                }
                r.mo[qi] += len;
                if last {
                    r.expect_msn[qi] = r.expect_msn[qi].wrapping_add(1);
                    r.mo[qi] = 0;
                }
                let ext_ok = |f: u8| self.neg.has(f);
                match (q, op) {
                    (
                        qn::SEND,
                        opcode::SEND
                        | opcode::SEND_SE
                        | opcode::SEND_INVALIDATE
                        | opcode::SEND_SE_INVALIDATE,
                    ) => self.on_send(r, None, mo as usize, len, last),
                    (qn::SEND, opcode::SEND_IMM) if ext_ok(features::IMMEDIATE) => {
                        self.on_send(r, Some(ulp), mo as usize, len, last)
                    }
                    (qn::SEND, opcode::IMMEDIATE)
                        if ext_ok(features::IMMEDIATE) && last && mo == 0 =>
                    {
                        let mut b = [0u8; ddp::IMMEDIATE_LEN];
                        if len != b.len() {
                            r.discard(len)?;
                            return Err(violation(
                                term::FPDU,
                                format!("Immediate Data payload of {len} bytes, expected 8"),
                            ));
                        }
                        r.read_payload(&mut b)?;
                        let imm = u32::from_be_bytes(b[..4].try_into().expect("4 bytes"));
                        let arrived = Arrived::WriteImm {
                            imm,
                            len: r.last_write_len,
                        };
                        let mut st = self.wait_unexpected_room(0)?;
                        match st.rq.pop_front() {
                            Some(recv) if st.unexpected.is_empty() => {
                                self.deliver_buffered(&mut st, recv, arrived)
                            }
                            other => {
                                if let Some(recv) = other {
                                    st.rq.push_front(recv);
                                }
                                st.unexpected_bytes += arrived.cost();
                                st.unexpected.push_back(arrived);
                            }
                        }
                        Ok(())
                    }
                    (qn::READ, opcode::READ_REQUEST) if last && mo == 0 => {
                        self.on_read_request(r, len)
                    }
                    (qn::TERMINATE, opcode::TERMINATE) => {
                        let mut b = vec![0u8; len.min(256)];
                        r.read_payload(&mut b)?;
                        r.discard(len - b.len())?;
                        // Peers of this framework follow RFC 5040; others may be siw.
                        let t = if self.neg.features == 0 {
                            Terminate::decode_foreign(&b)
                        } else {
                            Terminate::decode(&b)
                        }
                        .map_err(wire_violation)?;
                        Err(RxEnd::PeerTerminate(t, Terminate::terminated_header(&b)))
                    }
                    (qn::ATOMIC, opcode::ATOMIC_REQUEST)
                        if ext_ok(features::ATOMICS) && last && mo == 0 =>
                    {
                        self.on_atomic_request(r, len)
                    }
                    (qn::ATOMIC, opcode::ATOMIC_RESPONSE)
                        if ext_ok(features::ATOMICS) && last && mo == 0 =>
                    {
                        let mut b = [0u8; AtomicResponse::LEN];
                        if len != b.len() {
                            r.discard(len)?;
                            return Err(violation(
                                term::FPDU,
                                format!("Atomic Response of {len} bytes"),
                            ));
                        }
                        r.read_payload(&mut b)?;
                        let resp = AtomicResponse::decode(&b).map_err(wire_violation)?;
                        let mut st = self.lock();
                        self.response_unit(&mut st, Unit::Atomic(resp))
                    }
                    (qn::ACK, opcode::ACK) if ext_ok(features::ACKS) && len == 0 => {
                        let unit = if ulp & ddp::ACK_MESSAGES != 0 {
                            Unit::MessageAck
                        } else {
                            Unit::WriteAck
                        };
                        let mut st = self.lock();
                        for _ in 0..ulp & ddp::ACK_COUNT {
                            self.response_unit(&mut st, unit)?;
                        }
                        Ok(())
                    }
                    _ => {
                        r.discard(len)?;
                        Err(violation(
                            term::INVALID_OPCODE,
                            format!(
                                "RDMAP opcode {op:#x} on queue {q} (negotiated extensions {:#x})",
                                self.neg.features
                            ),
                        ))
                    }
                }
            }
        }
    }

    fn on_send(
        &self,
        r: &mut Rx,
        imm: Option<u32>,
        mo: usize,
        len: usize,
        last: bool,
    ) -> std::result::Result<(), RxEnd> {
        if mo == 0 {
            if self.neg.expect_send_rtr && !r.rtr_seen && len == 0 && last {
                r.rtr_seen = true;
                return Ok(());
            }
            // Receiver not ready and the buffer full: stop reading (back-pressure).
            let mut st = self.wait_unexpected_room(0)?;
            r.current = Some(if st.unexpected.is_empty() {
                match st.rq.pop_front() {
                    Some(recv) => {
                        st.placing = Some(recv);
                        Current::Matched { got: 0 }
                    }
                    None => Current::Buffered(Vec::new()),
                }
            } else {
                Current::Buffered(Vec::new())
            });
        }
        match r.current.take() {
            Some(Current::Buffered(data))
                if data.len() + len + UNEXPECTED_ENTRY_COST > UNEXPECTED_LIMIT =>
            {
                // Too big to buffer whole: wait for a receive (or room) and place the rest
                // straight into it; the bound holds for one message as for many.
                r.current = Some(self.buffer_or_match(data, len)?);
            }
            other => r.current = other,
        }
        let mut cur = r.current.take();
        match cur.as_mut() {
            Some(Current::Matched { got }) => {
                let room = self.lock().placing.as_ref().map_or(0, |p| p.total);
                if *got + len > room {
                    // Longer than its receive: fail it now, whatever the peer still sends
                    // (an endless message costs no more time than a short one).
                    r.discard(len)?;
                    let got = *got + len;
                    let mut st = self.lock();
                    if let Some(recv) = st.placing.take() {
                        self.message_too_long(&mut st, recv, got);
                    }
                    return Err(RxEnd::Local);
                }
                let at = *got;
                *got += len;
                self.place_locked(r, at, len, |st| st.placing.as_ref().map(|p| &p.sges))?;
            }
            Some(Current::Buffered(data)) => {
                let start = data.len();
                data.resize(start + len, 0);
                r.read_payload(&mut data[start..])?;
            }
            None => {
                r.discard(len)?;
                return Err(violation(
                    term::FPDU,
                    "Send continuation without a first segment",
                ));
            }
        }
        r.current = cur;
        if last {
            let cur = r.current.take().expect("current message");
            let mut st = self.lock();
            if st.status != EndpointState::Connected {
                return Err(RxEnd::Local);
            }
            match cur {
                Current::Matched { got } => {
                    let recv = st.placing.take().expect("a receive is being placed");
                    self.complete_recv(&mut st, recv.context, Opcode::Recv, got as u64, imm);
                }
                Current::Buffered(data) => {
                    let arrived = Arrived::Send { data, imm };
                    if st.unexpected.is_empty() {
                        if let Some(recv) = st.rq.pop_front() {
                            self.deliver_buffered(&mut st, recv, arrived);
                            return if st.status == EndpointState::Connected {
                                Ok(())
                            } else {
                                Err(RxEnd::Local)
                            };
                        }
                    }
                    st.unexpected_bytes += arrived.cost();
                    st.unexpected.push_back(arrived);
                }
            }
        }
        Ok(())
    }

    /// Waits until a message of `extra` more bytes (plus its entry cost) fits the unexpected
    /// buffer, or a receive is posted; returns the locked state. `Err(Local)` once the
    /// endpoint is no longer connected.
    fn wait_unexpected_room(
        &self,
        extra: usize,
    ) -> std::result::Result<MutexGuard<'_, State>, RxEnd> {
        let mut st = self.lock();
        loop {
            if st.status != EndpointState::Connected {
                return Err(RxEnd::Local);
            }
            if !st.rq.is_empty()
                || st.unexpected_bytes + extra + UNEXPECTED_ENTRY_COST <= UNEXPECTED_LIMIT
            {
                return Ok(st);
            }
            st = self.st_cv.wait(st).expect("endpoint state poisoned");
        }
    }

    /// A message being buffered would cross [`UNEXPECTED_LIMIT`] with its next `len`
    /// bytes: waits until it fits, or until it is the oldest unmatched message and a
    /// receive is posted, which it then continues in (its buffered bytes copied in first).
    fn buffer_or_match(&self, data: Vec<u8>, len: usize) -> std::result::Result<Current, RxEnd> {
        let mut st = self.lock();
        loop {
            if st.status != EndpointState::Connected {
                return Err(RxEnd::Local);
            }
            if st.unexpected.is_empty() {
                if let Some(recv) = st.rq.pop_front() {
                    let got = data.len();
                    if got > recv.total {
                        self.message_too_long(&mut st, recv, got);
                        return Err(RxEnd::Local);
                    }
                    scatter(&recv.sges, 0, &data);
                    st.placing = Some(recv);
                    return Ok(Current::Matched { got });
                }
            }
            if st.unexpected_bytes + data.len() + len + UNEXPECTED_ENTRY_COST <= UNEXPECTED_LIMIT {
                return Ok(Current::Buffered(data));
            }
            st = self.st_cv.wait(st).expect("endpoint state poisoned");
        }
    }

    /// Reads `len` payload bytes into the scatter list that `sink` finds in the state,
    /// starting `at` bytes into it. Every chunk is copied under the endpoint lock and only
    /// while `sink` still finds the list: once a close or an error has completed the
    /// operation it belongs to, nothing more lands in its memory.
    fn place_locked(
        &self,
        r: &mut Rx,
        mut at: usize,
        len: usize,
        sink: impl for<'s> Fn(&'s State) -> Option<&'s Sges>,
    ) -> std::result::Result<(), RxEnd> {
        let mut left = len;
        while left > 0 {
            let chunk = r.fill(left)?;
            let n = chunk.len();
            {
                let st = self.lock();
                match sink(&st).filter(|_| st.status == EndpointState::Connected) {
                    Some(sges) => scatter(sges, at, chunk),
                    None => {
                        drop(st);
                        r.consume(n);
                        r.discard(left - n)?;
                        return Err(RxEnd::Local);
                    }
                }
            }
            r.consume(n);
            at += n;
            left -= n;
        }
        Ok(())
    }

    /// Waits while the transmit queue is over [`TX_QUEUE_LIMIT`]: what we still owe the
    /// peer must leave before we read more of what it sends.
    fn wait_tx_room(&self) -> std::result::Result<(), RxEnd> {
        let mut tx = self.tx.state.lock().expect("tx poisoned");
        while tx.queue.len() >= TX_QUEUE_LIMIT && !tx.closed {
            tx = self.tx.drained.wait(tx).expect("tx poisoned");
        }
        Ok(())
    }

    fn on_read_request(&self, r: &mut Rx, len: usize) -> std::result::Result<(), RxEnd> {
        let mut b = [0u8; ReadRequest::LEN];
        if len != b.len() {
            r.discard(len)?;
            return Err(violation(
                term::FPDU,
                format!("Read Request of {len} bytes, expected 28"),
            ));
        }
        r.read_payload(&mut b)?;
        self.check_ird("RDMA Read Request")?;
        let rr = ReadRequest::decode(&b).map_err(wire_violation)?;
        let payload = if rr.size == 0 {
            Payload::Inline(Vec::new())
        } else {
            match self.keys.lookup(
                rr.src_stag,
                rr.src_to,
                u64::from(rr.size),
                Access::REMOTE_READ,
            ) {
                Ok(t) => Payload::Memory(vec![(t.buffer, t.offset, rr.size as usize)]),
                Err(t) => {
                    return Err(violation(
                        t,
                        format!(
                            "RDMA Read of {} bytes from STag {:#x} at {:#x} refused",
                            rr.size, rr.src_stag, rr.src_to
                        ),
                    ))
                }
            }
        };
        let mut st = self.lock();
        self.transmit(
            &mut st,
            OutMsg {
                kind: Kind::Tagged {
                    opcode: opcode::READ_RESPONSE,
                    stag: rr.sink_stag,
                    to: rr.sink_to,
                },
                payload,
                sent_seq: None,
                inbound: true,
            },
        );
        Ok(())
    }

    /// An inbound Read or Atomic Request beyond the IRD we advertised (responses we still
    /// owe and have not started sending) ends the connection: DDP "no buffer" on its queue,
    /// as an RNIC's full inbound read queue does.
    fn check_ird(&self, what: &str) -> std::result::Result<(), RxEnd> {
        let owed = self.tx.state.lock().expect("tx poisoned").inbound;
        if owed >= u32::from(crate::setup::IRD) {
            return Err(violation(
                term::NO_BUFFER,
                format!(
                    "{what} beyond the advertised IRD of {}: {owed} responses still owed",
                    crate::setup::IRD
                ),
            ));
        }
        Ok(())
    }

    fn on_atomic_request(&self, r: &mut Rx, len: usize) -> std::result::Result<(), RxEnd> {
        let mut b = [0u8; AtomicRequest::LEN];
        if len != b.len() {
            r.discard(len)?;
            return Err(violation(
                term::FPDU,
                format!("Atomic Request of {len} bytes, expected 52"),
            ));
        }
        r.read_payload(&mut b)?;
        self.check_ird("Atomic Request")?;
        let a = AtomicRequest::decode(&b).map_err(wire_violation)?;
        let t = self
            .keys
            .lookup(a.stag, a.to, 8, Access::REMOTE_ATOMIC)
            .map_err(|t| {
                violation(
                    t,
                    format!("atomic on STag {:#x} at {:#x} refused", a.stag, a.to),
                )
            })?;
        let word = t.buffer.atomic_u64(t.offset).ok_or_else(|| {
            violation(
                term::MISALIGNED_ATOMIC,
                format!("atomic target {:#x} is not 8-byte aligned", a.to),
            )
        })?;
        let original = match a.op {
            atomic_op::FETCH_ADD => word.fetch_add(a.add_swap, AtomicOrdering::SeqCst),
            _ => match word.compare_exchange(
                a.compare,
                a.add_swap,
                AtomicOrdering::SeqCst,
                AtomicOrdering::SeqCst,
            ) {
                Ok(v) | Err(v) => v,
            },
        };
        let mut resp = OutMsg::control(
            Kind::Untagged {
                opcode: opcode::ATOMIC_RESPONSE,
                ulp: 0,
                qn: qn::ATOMIC,
                msn: 0,
            },
            AtomicResponse {
                req_id: a.req_id,
                original,
            }
            .encode()
            .to_vec(),
        );
        resp.inbound = true;
        let mut st = self.lock();
        self.transmit(&mut st, resp);
        Ok(())
    }

    fn on_read_response(
        &self,
        r: &mut Rx,
        stag: u32,
        to: u64,
        len: usize,
        last: bool,
    ) -> std::result::Result<(), RxEnd> {
        let total = {
            let st = self.lock();
            match st.read_sinks.get(&stag) {
                Some(sges) => sges.iter().map(|s| s.2).sum::<usize>(),
                None if st.status != EndpointState::Connected => {
                    drop(st);
                    r.discard(len)?;
                    return Err(RxEnd::Local);
                }
                None => {
                    drop(st);
                    r.discard(len)?;
                    return Err(violation(
                        term::DDP_INVALID_STAG,
                        format!("Read Response for unknown sink STag {stag:#x}"),
                    ));
                }
            }
        };
        if total == 0 && len > 0 {
            // The kernel's siw answers a zero-length Read it serves from its IRQ with the
            // previous WQE's stale SGE (siw_activate_tx copies the SGE only when num_sge is
            // set, siw_qp_sq_proc_tx then forces num_sge = 1 for every Read Response). The
            // response is still ordered after everything before the Read, which is all a
            // zero-length Read is for: drop the bytes, never let them reach memory.
            tracing::debug!(
                len,
                "discarding the payload of a Read Response to a zero-length Read"
            );
            r.discard(len)?;
        } else if to
            .checked_add(len as u64)
            .is_none_or(|end| end > total as u64)
        {
            r.discard(len)?;
            return Err(violation(
                term::DDP_BASE_BOUNDS,
                format!("Read Response of {len} bytes at {to} overruns a {total}-byte sink"),
            ));
        } else {
            self.place_locked(r, to as usize, len, |st| st.read_sinks.get(&stag))?;
        }
        if last {
            let mut st = self.lock();
            st.read_sinks.remove(&stag);
            self.response_unit(&mut st, Unit::ReadDone(stag))?;
        }
        Ok(())
    }

    /// Credits a response to the oldest request waiting for one of its kind. Each kind
    /// arrives in request order (writes are placed in order, receives are matched in order,
    /// reads and atomics are answered in order), but kinds may overtake one another: a
    /// write is placed while an earlier send waits for a receive.
    fn response_unit(&self, st: &mut State, unit: Unit) -> std::result::Result<(), RxEnd> {
        let found =
            st.sq
                .iter_mut()
                .filter(|p| p.error.is_none())
                .find(|p| match (&unit, &p.resp) {
                    (Unit::WriteAck, _) => p.wait_write > 0,
                    (Unit::MessageAck, _) => p.wait_msg > 0,
                    (Unit::ReadDone(_), Resp::Read { .. })
                    | (Unit::Atomic(_), Resp::Atomic { .. }) => p.wait_resp,
                    _ => false,
                });
        let Some(p) = found else {
            return Err(violation(
                term::INVALID_OPCODE,
                format!("{unit:?} with no request waiting for it"),
            ));
        };
        match (&unit, &p.resp) {
            (Unit::WriteAck, _) => p.wait_write -= 1,
            (Unit::MessageAck, _) => p.wait_msg -= 1,
            (Unit::ReadDone(s), Resp::Read { sink }) if s == sink => p.wait_resp = false,
            (
                Unit::Atomic(a),
                Resp::Atomic {
                    req_id,
                    result,
                    offset,
                },
            ) if *req_id == a.req_id => {
                result.write(*offset, &a.original.to_ne_bytes());
                p.wait_resp = false;
            }
            _ => {
                return Err(violation(
                    term::INVALID_OPCODE,
                    format!("{unit:?} does not answer the oldest outstanding request of its kind"),
                ))
            }
        }
        if p.is_read_like() && !p.wait_resp {
            st.reads_out -= 1;
            self.release_backlog(st);
        }
        self.drain_sq(st);
        Ok(())
    }
}

/// A Read Request of `size` bytes at (`stag`, `to`); the sink STag is filled in at post time.
fn read_request(size: u32, stag: u32, to: u64) -> OutMsg {
    OutMsg::control(
        Kind::Untagged {
            opcode: opcode::READ_REQUEST,
            ulp: 0,
            qn: qn::READ,
            msn: 0,
        },
        ReadRequest {
            sink_stag: 0,
            sink_to: 0,
            size,
            src_stag: stag,
            src_to: to,
        }
        .encode()
        .to_vec(),
    )
}

/// Largest message the posting thread encodes and sends itself.
const DIRECT_LIMIT: usize = 16 << 10;

/// How long a graceful close waits for its close mark to reach the socket.
const CLOSE_MARK_WAIT: Duration = Duration::from_millis(200);

#[derive(Debug, Clone, Copy)]
enum Unit {
    WriteAck,
    MessageAck,
    ReadDone(u32),
    Atomic(AtomicResponse),
}

/// The incoming message in progress.
#[derive(Debug)]
enum Current {
    /// Being placed into the receive in `State::placing`, `got` bytes so far.
    Matched { got: usize },
    /// Being buffered as unexpected (no receive was posted when it began).
    Buffered(Vec<u8>),
}

/// Receive-thread state.
#[derive(Debug)]
struct Rx {
    reader: BufReader<TcpStream>,
    crc: Option<u32>,
    expect_msn: [u32; qn::COUNT],
    mo: [usize; qn::COUNT],
    current: Option<Current>,
    write_len: u64,
    last_write_len: u64,
    rtr_seen: bool,
}

impl Rx {
    fn new(stream: TcpStream) -> Self {
        Rx {
            reader: BufReader::with_capacity(64 << 10, stream),
            crc: None,
            expect_msn: [1; qn::COUNT],
            mo: [0; qn::COUNT],
            current: None,
            write_len: 0,
            last_write_len: 0,
            rtr_seen: false,
        }
    }

    fn read_payload(&mut self, dst: &mut [u8]) -> io::Result<()> {
        self.reader.read_exact(dst)?;
        if let Some(c) = self.crc.as_mut() {
            *c = crc32c::crc32c_append(*c, dst);
        }
        Ok(())
    }

    /// Up to `max` payload bytes that have arrived (at least one; blocks until then). Not
    /// consumed until [`consume`](Self::consume).
    fn fill(&mut self, max: usize) -> io::Result<&[u8]> {
        let buf = self.reader.fill_buf()?;
        if buf.is_empty() {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        let n = buf.len().min(max);
        Ok(&buf[..n])
    }

    /// Consumes `n` bytes returned by [`fill`](Self::fill), adding them to the CRC.
    fn consume(&mut self, n: usize) {
        if let Some(c) = self.crc.as_mut() {
            *c = crc32c::crc32c_append(*c, &self.reader.buffer()[..n]);
        }
        self.reader.consume(n);
    }

    /// Reads `len` payload bytes into `buffer` at `offset`, chunk by chunk, with the
    /// buffer's word-atomic copies: no reference to the memory is ever held.
    fn place(&mut self, buffer: &Buffer, offset: usize, len: usize) -> io::Result<()> {
        let mut done = 0;
        while done < len {
            let chunk = self.fill(len - done)?;
            let n = chunk.len();
            buffer.write(offset + done, chunk);
            self.consume(n);
            done += n;
        }
        Ok(())
    }

    fn discard(&mut self, mut len: usize) -> io::Result<()> {
        let mut scratch = [0u8; 4096];
        while len > 0 {
            let n = len.min(scratch.len());
            self.read_payload(&mut scratch[..n])?;
            len -= n;
        }
        Ok(())
    }
}

fn scatter(sges: &Sges, mut at: usize, mut data: &[u8]) {
    for (b, off, len) in sges {
        if data.is_empty() {
            break;
        }
        if at >= *len {
            at -= len;
            continue;
        }
        let take = (len - at).min(data.len());
        b.write(off + at, &data[..take]);
        data = &data[take..];
        at = 0;
    }
}
