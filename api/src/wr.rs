//! Work requests (what applications post) and completions (what they get back).

use std::fmt;

use crate::{ErrorKind, ProviderCode, Slice};

/// A remote address: the target's virtual address and the key of the region holding it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct RemoteAddr {
    /// Target virtual address.
    pub addr: u64,
    /// Remote key (rkey / STag).
    pub key: u32,
}

bitflags::bitflags! {
    /// Per-request flags.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub struct SendFlags: u32 {
        /// Generate a completion (unset: "unsignaled", no completion on success; an error
        /// still completes).
        const SIGNALED = 1;
        /// Copy the payload at post time (up to the provider's max inline); the buffer is
        /// free again as soon as the post returns.
        const INLINE = 1 << 1;
        /// Do not start this request before every earlier read and atomic has completed.
        const FENCE = 1 << 2;
        /// More posts follow at once (libfabric's `FI_MORE`): the provider may hold this
        /// request back so that it leaves with the next ones, small messages in one
        /// system call or doorbell. A hint, never a wait without bound: the held requests
        /// leave with the next post on the endpoint without `MORE`, at the application's
        /// next poll, wait or arm of the endpoint's completion queues, at its close, and
        /// (progress `auto`) within 1 ms from the provider's progress thread. The tcp
        /// provider coalesces small messages this way; the verbs providers post every
        /// request at once (the flag changes nothing there).
        const MORE = 1 << 3;
        /// Transmit complete (libfabric's `FI_TRANSMIT_COMPLETE`), for sends and writes: the
        /// completion may come once the request has left for the peer, which will deliver
        /// it unless the connection fails, instead of once its data is in the target's
        /// memory (the contract's default, delivery complete). Where the transport's own
        /// completion already means delivery (InfiniBand and RoCE complete on the peer's
        /// acknowledgement, the tcp provider on its own) nothing changes. On iWARP, whose
        /// devices complete a send or write once TCP has it, the provider skips the RDMA
        /// Read that confirms delivery: the request costs what the device's own does.
        ///
        /// The price is where a refusal shows. If the peer refuses such a request (a bad
        /// remote key, a receive too short), its completion may already have said
        /// success: the endpoint then enters the error state with an
        /// [`EndpointEvent::Failed`](crate::EndpointEvent::Failed) naming the likely
        /// error, and every request still outstanding completes `Flushed` (none is blamed
        /// for it: the device does not tell which request the peer refused). Ordering is
        /// unchanged: a send after a write is still received after the write's data is
        /// visible, a read after a write still returns the written data.
        const TRANSMIT_COMPLETE = 1 << 4;
    }
}

/// The 64-bit atomic operations of the contract (docs/contract.md section 5).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AtomicOp {
    /// Adds `add` (wrapping) and returns the old value.
    FetchAdd {
        /// Addend.
        add: u64,
    },
    /// Stores `swap` if the word equals `compare`; returns the old value either way.
    CompareSwap {
        /// Expected value.
        compare: u64,
        /// Replacement value.
        swap: u64,
    },
}

/// The operation of a send-queue work request.
#[derive(Debug, Clone, Copy)]
pub enum SendOp<'a> {
    /// Two-sided send from a gather list, with optional 32-bit immediate data.
    Send {
        /// Gather list (may be empty: a zero-byte message).
        sgl: &'a [Slice<'a>],
        /// Immediate data delivered in the receive completion.
        imm: Option<u32>,
    },
    /// One-sided write; with `imm` it also consumes a receive at the target.
    Write {
        /// Gather list.
        sgl: &'a [Slice<'a>],
        /// Where to write.
        remote: RemoteAddr,
        /// Immediate data (write-with-immediate).
        imm: Option<u32>,
    },
    /// One-sided read into a scatter list.
    Read {
        /// Scatter list (needs LOCAL_WRITE).
        sgl: &'a [Slice<'a>],
        /// Where to read from.
        remote: RemoteAddr,
    },
    /// 64-bit atomic at an 8-byte aligned remote word; the old value lands in `result`.
    Atomic {
        /// 8-byte local buffer for the old value (host byte order; needs LOCAL_WRITE).
        result: Slice<'a>,
        /// The remote word.
        remote: RemoteAddr,
        /// Which operation.
        op: AtomicOp,
    },
}

/// A send-queue work request.
#[derive(Debug, Clone, Copy)]
pub struct SendWr<'a> {
    /// The caller's context, returned in the completion.
    pub context: u64,
    /// The operation.
    pub op: SendOp<'a>,
    /// Flags (signaled by default).
    pub flags: SendFlags,
}

impl<'a> SendWr<'a> {
    fn new(context: u64, op: SendOp<'a>) -> Self {
        SendWr {
            context,
            op,
            flags: SendFlags::SIGNALED,
        }
    }
    /// A send of the gather list.
    pub fn send(context: u64, sgl: &'a [Slice<'a>]) -> Self {
        Self::new(context, SendOp::Send { sgl, imm: None })
    }
    /// A write of the gather list to `remote`.
    pub fn write(context: u64, sgl: &'a [Slice<'a>], remote: RemoteAddr) -> Self {
        Self::new(
            context,
            SendOp::Write {
                sgl,
                remote,
                imm: None,
            },
        )
    }
    /// A read from `remote` into the scatter list.
    pub fn read(context: u64, sgl: &'a [Slice<'a>], remote: RemoteAddr) -> Self {
        Self::new(context, SendOp::Read { sgl, remote })
    }
    /// A fetch-and-add at `remote`; the old value lands in `result`.
    pub fn fetch_add(context: u64, result: Slice<'a>, remote: RemoteAddr, add: u64) -> Self {
        Self::new(
            context,
            SendOp::Atomic {
                result,
                remote,
                op: AtomicOp::FetchAdd { add },
            },
        )
    }
    /// A compare-and-swap at `remote`; the old value lands in `result`.
    pub fn compare_swap(
        context: u64,
        result: Slice<'a>,
        remote: RemoteAddr,
        compare: u64,
        swap: u64,
    ) -> Self {
        Self::new(
            context,
            SendOp::Atomic {
                result,
                remote,
                op: AtomicOp::CompareSwap { compare, swap },
            },
        )
    }
    /// Adds 32-bit immediate data (sends and writes only; ignored otherwise).
    pub fn with_imm(mut self, value: u32) -> Self {
        match &mut self.op {
            SendOp::Send { imm, .. } | SendOp::Write { imm, .. } => *imm = Some(value),
            _ => {}
        }
        self
    }
    /// Copies the payload at post time.
    pub fn inline(mut self) -> Self {
        self.flags |= SendFlags::INLINE;
        self
    }
    /// No completion on success.
    pub fn unsignaled(mut self) -> Self {
        self.flags -= SendFlags::SIGNALED;
        self
    }
    /// Waits for earlier reads and atomics before starting.
    pub fn fenced(mut self) -> Self {
        self.flags |= SendFlags::FENCE;
        self
    }
    /// More posts follow at once ([`SendFlags::MORE`]): the provider may hold this request
    /// to send it with them.
    pub fn more(mut self) -> Self {
        self.flags |= SendFlags::MORE;
        self
    }
    /// Transmit complete ([`SendFlags::TRANSMIT_COMPLETE`]): the completion may come once
    /// the request has left, not once its data is at the target.
    pub fn transmit_complete(mut self) -> Self {
        self.flags |= SendFlags::TRANSMIT_COMPLETE;
        self
    }
    /// The completion opcode this request produces.
    pub fn opcode(&self) -> Opcode {
        match self.op {
            SendOp::Send { .. } => Opcode::Send,
            SendOp::Write { .. } => Opcode::Write,
            SendOp::Read { .. } => Opcode::Read,
            SendOp::Atomic {
                op: AtomicOp::FetchAdd { .. },
                ..
            } => Opcode::FetchAdd,
            SendOp::Atomic {
                op: AtomicOp::CompareSwap { .. },
                ..
            } => Opcode::CompareSwap,
        }
    }
}

/// A receive-queue work request: where the next incoming message lands.
#[derive(Debug, Clone, Copy)]
pub struct RecvWr<'a> {
    /// The caller's context.
    pub context: u64,
    /// Scatter list (needs LOCAL_WRITE).
    pub sgl: &'a [Slice<'a>],
}

impl<'a> RecvWr<'a> {
    /// A receive into the scatter list.
    pub fn new(context: u64, sgl: &'a [Slice<'a>]) -> Self {
        RecvWr { context, sgl }
    }
}

/// The operation a completion reports.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Opcode {
    /// A send (with or without immediate) completed at the initiator.
    Send,
    /// A write (with or without immediate) completed at the initiator.
    Write,
    /// A read completed at the initiator.
    Read,
    /// A fetch-and-add completed at the initiator.
    FetchAdd,
    /// A compare-and-swap completed at the initiator.
    CompareSwap,
    /// A receive consumed by a send.
    Recv,
    /// A receive consumed by a write-with-immediate.
    RecvWriteWithImm,
}

/// Success, or the neutral error of a failed operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum Status {
    /// The operation succeeded.
    Success,
    /// The operation failed.
    Error(ErrorKind),
}

impl fmt::Display for Status {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Status::Success => f.write_str("Success"),
            Status::Error(k) => write!(f, "{k}"),
        }
    }
}

/// One completion-queue entry.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Completion {
    /// The caller's context from the work request.
    pub context: u64,
    /// The operation.
    pub opcode: Opcode,
    /// Success or the neutral error.
    pub status: Status,
    /// The provider's own code for an error (ibv_wc_status, Terminate code, errno).
    pub provider_code: Option<ProviderCode>,
    /// Bytes received (receives) or transferred.
    pub byte_len: u64,
    /// Immediate data, if the message carried any.
    pub imm: Option<u32>,
    /// The [`EndpointConfig::ep_context`](crate::spi::EndpointConfig::ep_context) of the
    /// endpoint the operation was posted on: which endpoint a completion came from.
    pub ep_context: u64,
}

impl Completion {
    /// The completion of an operation flushed by the error state or a close.
    pub fn flushed(context: u64, opcode: Opcode) -> Self {
        Completion {
            context,
            opcode,
            status: Status::Error(crate::ErrorKind::Flushed),
            provider_code: None,
            byte_len: 0,
            imm: None,
            ep_context: 0,
        }
    }

    /// The same completion, naming the endpoint by its `ep_context`.
    pub fn on_endpoint(mut self, ep_context: u64) -> Self {
        self.ep_context = ep_context;
        self
    }

    /// True when the status is success.
    pub fn is_ok(&self) -> bool {
        self.status == Status::Success
    }
}

/// Life cycle of an endpoint.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub enum EndpointState {
    /// Connected: operations may be posted.
    Connected,
    /// An error completion happened: outstanding operations were flushed, posts fail.
    Error,
    /// Closed locally or by the peer (the disconnect event).
    Disconnected,
}
