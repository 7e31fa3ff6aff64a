//! The `iwarp` provider: iWARP (RDMAP/DDP/MPA over TCP) devices on the shared verbs core.
//!
//! Devices: transport iWARP (Chelsio, Intel, the kernel's soft-iWARP `siw`). Connections
//! go through rdma_cm only (iWARP has no out-of-band QP setup).
//!
//! What iWARP lacks natively, and what this provider does about it:
//! * **Atomics and immediate data**: not in RDMAP (RFC 5040), and siw implements none of
//!   RFC 7306. Emulated between peers of this framework over base RDMAP (negotiated in the
//!   connection's private data; see the fabric-verbs crate's `emu` module): an atomic is a
//!   request written into the peer's emulation area, executed by the peer's provider (its
//!   domain helper thread, so the target application need not poll, or the target
//!   application's own poll of the endpoint's queue when it finds the request first,
//!   which lets the helper wake less often) on the same 64-bit
//!   atomic word as every framework atomic, the old value written back; one atomic is in
//!   flight per endpoint. Immediate data is written into a ring slot of the peer's area
//!   ahead of the send it belongs to; a write with immediate data is the write, that
//!   record and a zero-length send, which consumes one posted receive after the data is
//!   placed. Against a foreign iWARP peer both stay refused at post with `Unsupported`.
//! * **Receiver not ready**: an iWARP Send that finds no posted receive is fatal (DDP
//!   "no buffer" Terminate). The provider runs credit-based flow control so the contract's
//!   "the sender waits" holds: each endpoint registers a small credit area and hands its
//!   descriptor to the peer in the connection's private data; after every posted receive
//!   it RDMA-writes its count of posted receives into the peer's area; a send goes to the
//!   device only while the peer's count exceeds the sends already sent, and is held (with
//!   everything posted after it, in order) until then. Held sends are retried on a timer
//!   by the domain's RNR thread, as a device retries after an RNR NAK.
//! * **Delivery-complete sends and writes**: iWARP completes them at transmit. Each is
//!   followed by a 64-byte RDMA Read of the peer's credit area; the application's
//!   completion is the read's, so it means the bytes were placed at the target (RDMAP
//!   processes a stream in order). Each send and write is fenced behind earlier reads, so
//!   at most one of them is unconfirmed at a time: throughput costs a round trip per send
//!   or write, and when the peer terminates the connection the first unconfirmed request
//!   is the one it refused.
//! * **Transmit complete on request**: a send or write posted
//!   `SendFlags::TRANSMIT_COMPLETE` (libfabric's `FI_TRANSMIT_COMPLETE`) goes without its
//!   read and unfenced; siw's completion (TCP has the data) is the application's. Until a
//!   read posted after it completes, the provider cannot tell whether the peer refused it,
//!   so a connection that dies meanwhile blames no request: the endpoint's `Failed` event
//!   says what happened, the requests outstanding complete `Flushed` (contract section 4).
//!   Its memory is free at its completion, as any request's: every hardware request is
//!   posted signaled, and siw copies a signaled request's payload into the socket (it
//!   sends straight from the application's pages only for unsignaled requests of a page or
//!   more, where TCP may still need them after the completion: `siw_qp_tx.c`).
//! * **Sends confirmed by the peer's count** (both ends of this provider: the
//!   `FLAG_RECEIVED` bit of the emulation trailer): a credit update also carries the count
//!   of receives the peer completed, packed into the same word (`pdata::CreditWord`). A
//!   send's delivery read is then held back when the send leaves, and never posted if the
//!   peer's count covers the send first, which a peer that reposts a receive before it
//!   replies always does: a request/reply exchange costs no read. The read goes after all
//!   when anything is posted behind the send, when the endpoint is drained, or after a
//!   millisecond without the count. Why it matters on siw: a Read Request is answered from
//!   siw's transmit thread, and every send the target posts meanwhile waits for that
//!   thread too (`siw_post_send` transmits directly only from an idle send slot), so the
//!   read behind a request delayed the reply by a thread wake-up. Writes keep their read:
//!   the target's provider never sees a write, so nothing but a read confirms it. The tcp
//!   provider does not offer the bit; with it, sends keep their reads.
//! * **Credit updates batched for transmit-complete sends** (both ends of this provider:
//!   the `FLAG_LAZY_CREDITS` bit of the emulation trailer). On siw every credit update is
//!   an FPDU of its own and a TCP segment of its own (siw pushes each short FPDU), so one
//!   update per receive doubles the segments of a request/reply exchange. The sender keeps
//!   a word of the receiver's emulation area (`emu_wire::MODE_OFF`) saying whether its
//!   sends wait for the receiver's count: written only when that changes, ahead of the
//!   send that changes it. While it says they do not (transmit-complete sends), the
//!   receiver writes an update only when the sender may run short: when what it was told
//!   it may still send is at most half of the receives posted and unfilled, looked at on
//!   every receive posted and every one filled; once nothing was posted or filled for a
//!   millisecond, the domain's helper thread reaps the receive queue so that the fills are
//!   looked at (a receiver that stops looking must not keep posted receives from a sender
//!   that ran out of credit). With one receive posted
//!   at a time that is still one update per receive; with a window of 64 in a steady
//!   exchange, one per 32. Delivery-complete sends keep an update per receive: it is what
//!   confirms them.
//! * **The direct path for what needs nothing added**: a request to which none of the
//!   above applies (a transmit-complete send or write while no read carrying an earlier
//!   request's completion is outstanding, a send only with a credit in hand and the peer
//!   told its sends need no count, a read that is not split) goes to siw from the stack,
//!   as on roce, not through the provider's ledger of planned requests: in the guest that
//!   ledger cost about 4 100 instructions per 8-byte transmit-complete write, the direct
//!   path about 900 (callgrind; docs/benchmarks-record.md, twenty-sixth session). Payloads of at
//!   most 32 bytes still go inline, and small reads or writes that would cross a page
//!   still take the ledger's path, which splits them (`Profile::small_page_crossing`).
//! * **Fences are the provider's on siw** (`Profile::soft_fence`): a fenced request waits
//!   in the provider until the reads before it completed and then goes to siw unfenced.
//!   siw's own fence (Linux 6.1) can stop a connection for good: the fenced request waits
//!   in siw's transmit slot, and a Read Request arriving meanwhile is parked in the
//!   inbound read queue without restarting the transmitter (`siw_init_rresp`), so with
//!   both ends fenced behind a read of the other, neither answers. Seen as rare stalls of
//!   the RDM cases (both ends quiet until the dead-peer timeout) until this changed; the
//!   conformance case `msg.both_directions_at_once` sends both ways at once.
//! * **Why a connection died**: siw logs a received Terminate in the kernel log only and
//!   flushes everything. When the connection dies without the peer's close mark, the
//!   first unconfirmed request completes with the error the Terminate most likely carried
//!   (`RemoteAccess` for writes and reads, `RemoteInvalidRequest` for sends), the raw
//!   status (`IBV_WC_WR_FLUSH_ERR`) kept beside it; the rest complete `Flushed`. A peer
//!   that died without a Terminate is reported the same way.
//! * **siw does not check REMOTE_READ** (Linux 6.1 `siw_qp_tx.c`: Read Responses are
//!   built with `siw_check_sgl_tx(pd, wqe, 0)`, no permission): every STag with any
//!   remote right is readable by the peer on siw.
//! * **Scatter reads**: an RDMA Read has one sink (`max_sge_rd` 1 on siw); a read into a
//!   longer scatter list is split into one read per entry.
//! * **Read sinks need remote write**: the Read Request names the sink by STag and the
//!   response is a tagged placement, so every region registered with LOCAL_WRITE gets a
//!   local registration that also grants REMOTE_WRITE. Protection consequence: the STag
//!   of that local registration travels to the peer in every read that uses the region as
//!   a sink, and with it the peer may write anywhere into that region for as long as the
//!   region lives. It is never the region's remote key (which deregistration kills at
//!   once), but regions used as read sinks are writable by peers that were read from.
//! * **Dead peers**: an iWARP queue pair has no ACK timer and siw's kernel TCP socket has
//!   neither keepalive nor `TCP_USER_TIMEOUT`, so a silent peer host would hold outstanding
//!   work for TCP's retransmission limit (about 15 minutes) or forever when idle. The core
//!   detects dead peers itself (`Profile::liveness_probes`): the domain's helper thread
//!   probes a quiet endpoint with a delivery read and declares it dead after the dead-peer
//!   timeout without a sign of life (`[iwarp] dead_peer_timeout_ms`, default 10 s): the
//!   oldest outstanding operation completes `RetryExceeded`, the rest `Flushed`, the
//!   endpoint enters `Error` and its queue pair is destroyed. See the fabric-verbs crate
//!   docs for what counts as a sign of life and the exact bound.
//! * **Foreign iWARP peers** (rdma-core's `rping`, any verbs application: connection
//!   private data without this framework's frame, and no hello mark from the tcp provider
//!   within 5 s): no credits, no delivery-complete sends and writes and no dead-peer
//!   probes, because all of those would need zero-length RDMA Reads, which siw answers with
//!   a stale length (`siw: rresp len: 64 != 0`, then a Terminate). When such a peer
//!   connects, the provider posts four early receives (64 KiB each) before it accepts:
//!   the peer may send before the application could post a receive (rping's client does),
//!   and the application's first receives are completed from them by a copy.
//! * **Small page crossings** (siw, Linux 6.1 `siw_try_1seg`): a payload of at most 32
//!   bytes from registered memory that crosses a page boundary is garbled (always for Read
//!   Responses). Such reads are split at the remote page boundary, such writes at the local
//!   one, and such sends go inline.
//! * **Short Read Responses from siw's transmit thread** (Linux 6.1 `siw_try_1seg`): siw
//!   copies a payload of at most 32 bytes with `copy_from_user` whenever the queue pair's
//!   `in_syscall` flag is set, and the owner's `ibv_post_send` clears that flag only after
//!   it finished transmitting. A Read Request that arrives in between is answered by siw's
//!   transmit thread, which has no user address space: the copy fails (`EFAULT`), siw drops
//!   the connection, and both ends see it end without a close mark (kernel log with siw's
//!   dynamic debug: `wqe type 9 processing failed: -14`). The write ping-pong of `fabric
//!   perf` lost its connection so in 2 of 54 guest runs. Delivery reads and liveness probes
//!   therefore read the peer's whole credit area (64 bytes), which siw builds from the
//!   registered pages, and on siw every send or write of at most 32 bytes goes inline
//!   (copied from the request, not from user memory; `Profile::small_page_crossing`). An
//!   application's own read of at most 32 bytes from a siw peer stays exposed: the
//!   provider cannot lengthen it.
//! * **libsiw's mmap sentinel** (`Profile::mmap_sentinel_guard`): libsiw reads a queue
//!   the kernel mapped at offset 0x90000 as "no mapping", destroys the queue pair or CQ it
//!   just created and returns NULL with errno untouched (often 0). The kernel places the
//!   queues of a context first-fit from offset 0, so which one lands there depends on the
//!   order endpoints were opened in; the `ring_allreduce` example (three endpoints opened
//!   from three threads) failed so about one run in ten. The first domain on siw in a
//!   process puts a 1 MiB CQ on librdmacm's context before anything else, which holds the
//!   offsets below 1 MiB for the life of the process.
//! * **Graceful close versus failure**: siw reports both as a closed connection. A closing
//!   endpoint writes a close mark into the peer's credit area first, so the peer reports
//!   `Disconnected` for a close and `Error` for anything else.
//! * **A close right after a receive**: the receive completes when the message is placed,
//!   the sender's completion when the delivery read behind it is answered, a moment
//!   later. A receiver that closes in between flushes that read, and the sender sees a
//!   delivered message `Flushed` (the contract allows it: a close flushes what the peer
//!   has outstanding). Between two iwarp endpoints a receiver that reposted a receive
//!   before it closed has usually confirmed the send by its count already (the read was
//!   still held back), and the sender then sees success. On roce the device acknowledges
//!   in the same step as it completes
//!   the receive, so the window is far smaller there, but the rule is the same: the side
//!   that received a conversation's last message waits for `EndpointEvent::PeerClosed`
//!   before it closes (`AnyEndpoint::wait_event`; the examples do).
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::net::IpAddr;

use fabric_api::{Emulation, OpSet, ProviderInfo};
use fabric_verbs::{DeviceFacts, Flavor, Profile, Selection, Transport};

pub use fabric_verbs::VerbsOptions;

/// Provider name.
pub const NAME: &str = "iwarp";

/// Private data an MPA revision 2 request or reply carries for the application: 512 bytes
/// in RFC 5044, 256 in the Linux iWARP CM (`RDMA_MAX_PRIVATE_DATA`), less the 8 bytes of
/// the enhanced-mode IRD/ORD header.
pub const MPA_PRIVATE_DATA: u32 = 248;

/// The iWARP flavor of the verbs core.
#[derive(Debug, Clone, Copy, Default)]
pub struct Iwarp;

/// An iWARP domain.
pub type IwarpDomain = fabric_verbs::VerbsDomain<Iwarp>;
/// An iWARP completion queue.
pub type IwarpCq = fabric_verbs::VerbsCq<Iwarp>;
/// An iWARP endpoint.
pub type IwarpEndpoint = fabric_verbs::VerbsEndpoint<Iwarp>;
/// An iWARP listener.
pub type IwarpListener = fabric_verbs::VerbsListener<Iwarp>;
/// An iWARP connection being set up ([`connect_start`](fabric_api::spi::Domain::connect_start)).
pub type IwarpConnecting = fabric_verbs::VerbsConnecting<Iwarp>;

/// What `discover()` reports for this provider.
pub fn info(opts: &VerbsOptions) -> ProviderInfo {
    fabric_verbs::provider_info::<Iwarp>(opts)
}

/// The local address to connect from: the configured one if its network device carries
/// it, else the first IPv4 address of the device's netdev, else the first address.
pub fn select_address(
    netdev: Option<&str>,
    addrs: &[IpAddr],
    want: Option<IpAddr>,
) -> Result<IpAddr, String> {
    let dev = netdev.unwrap_or("(unknown)");
    match want {
        Some(w) if addrs.contains(&w) => Ok(w),
        Some(w) => Err(format!(
            "address {w} is not on the device's network interface {dev}"
        )),
        None => addrs
            .iter()
            .find(|a| a.is_ipv4())
            .or_else(|| addrs.first())
            .copied()
            .ok_or_else(|| {
                format!(
                    "network interface {dev} has no IP address: rdma_cm cannot reach this device"
                )
            }),
    }
}

impl Flavor for Iwarp {
    const NAME: &'static str = NAME;

    fn accepts(dev: &DeviceFacts) -> Result<(), String> {
        if dev.transport == Transport::Iwarp {
            Ok(())
        } else {
            Err(format!("transport {}, not iWARP", dev.transport.name()))
        }
    }

    fn select(dev: &DeviceFacts, opts: &VerbsOptions) -> Result<Selection, String> {
        let mut why = Vec::new();
        for p in &dev.ports {
            if !p.is_active() {
                why.push(format!(
                    "port {} is {} (not ACTIVE)",
                    p.num,
                    fabric_verbs::device::port_state_name(p.state)
                ));
                continue;
            }
            match select_address(p.netdev.as_deref(), &p.addrs, opts.address) {
                Ok(a) => {
                    return Ok(Selection {
                        port: p.num,
                        addr: Some(a),
                        gid: p.gids.first().cloned(),
                        summary: format!(
                            "{} port {}, address {a} on {}, active MTU {}",
                            dev.name,
                            p.num,
                            p.netdev.as_deref().unwrap_or("?"),
                            p.active_mtu
                        ),
                    })
                }
                Err(e) => why.push(format!("port {}: {e}", p.num)),
            }
        }
        Err(if why.is_empty() {
            "no port".into()
        } else {
            why.join("; ")
        })
    }

    fn profile(dev: &DeviceFacts) -> Profile {
        let mut unsupported = BTreeMap::new();
        // The emulation writes an atomic request (56 bytes) inline.
        let emulate = dev.max_inline >= EMULATION_INLINE;
        if !emulate {
            let why = format!("iWARP (RFC 5040 RDMAP) has neither atomics nor immediate data, and the emulation needs inline writes of {EMULATION_INLINE} bytes; {} allows {}", dev.name, dev.max_inline);
            for k in ["FETCH_ADD", "COMPARE_SWAP", "SEND_IMM", "WRITE_IMM"] {
                unsupported.insert(k.to_string(), why.clone());
            }
        }
        // The kernel's soft-iWARP answers reads of any valid key (siw_qp_tx.c builds Read
        // Responses with siw_check_sgl_tx(pd, wqe, 0): key and bounds, no access right).
        let read_protection = dev.vendor_id != SIW_VENDOR_ID;
        if !read_protection {
            unsupported.insert(
                "READ_PROTECTION".to_string(),
                "siw (Linux soft-iWARP) does not check REMOTE_READ when it answers an RDMA Read (siw_qp_tx.c: siw_check_sgl_tx(pd, wqe, 0)); any valid key is readable".to_string(),
            );
        }
        // siw (Linux 6.1 siw_cm.c) releases its listening socket when a client closes a
        // connection the listener has not accepted yet (see `Profile::listen_early_close`).
        let listen_early_close = dev.vendor_id != SIW_VENDOR_ID;
        if !listen_early_close {
            unsupported.insert(
                "LISTEN_EARLY_CLOSE".to_string(),
                "siw (Linux soft-iWARP) closes its listening socket when a client closes a TCP connection before siw accepted it: the queued socket carries the listener's sk_user_data, so siw_cm_llp_state_change queues SIW_CM_WORK_PEER_CLOSE on the listening endpoint, whose handler releases the listening socket without an event to rdma_cm (siw_cm.c); later clients get a TCP reset (ConnectionRefused)".to_string(),
            );
        }
        let split = dev.max_sge_rd < dev.max_sge;
        let emu = |feature: &str, ops: OpSet, how: &str| Emulation {
            feature: feature.into(),
            ops,
            how: how.into(),
        };
        let mut emulated = vec![
            emu("receiver not ready", OpSet::SEND, "credit-based flow control: the receiver RDMA-writes its posted-receive count into the sender's credit area; sends wait in the provider for credits (retried on a timer like an RNR retry)"),
            emu("delivery-complete sends and writes", OpSet::SEND | OpSet::WRITE, "each is fenced behind earlier reads (on siw by the provider, which holds it until they completed: siw's own fence can deadlock a connection) and followed by a 64-byte RDMA Read of the peer; the completion is the read's. Between two endpoints of this provider a send's read is held back, and dropped when the count of completed receives that the peer's credit updates carry confirms the send first. A request posted TRANSMIT_COMPLETE (libfabric's FI_TRANSMIT_COMPLETE) has no read: the device's own completion (TCP has the data) is its completion, and a refusal of it shows as the endpoint's failure"),
            emu("read sinks", OpSet::READ, "regions with LOCAL_WRITE are registered locally with REMOTE_WRITE too (iWARP read responses are tagged placements)"),
            emu("dead-peer detection", OpSet::SEND | OpSet::WRITE | OpSet::READ, "emulated, like UCX's keepalive: the queue pair has no ACK timer and the kernel's TCP socket under it no keepalive, so the domain's helper thread watches every endpoint; any completion or TCP segment from the peer is a sign of life, a quiet endpoint is probed with a delivery read, and one quiet for the dead-peer timeout ([iwarp] dead_peer_timeout_ms, default 10 s) is declared dead: the oldest outstanding operation completes RetryExceeded, the rest Flushed, the queue pair is destroyed"),
        ];
        if emulate {
            emulated.push(emu("atomics", OpSet::ATOMICS, "emulated between peers of this framework (iWARP has no atomics): the request is written into the peer's emulation area and executed there by the peer's provider on its domain helper thread (no help from the target application; a poll of the target's queue that finds the request first serves it, and while polls look at the area the helper looks every 32 ms; else every 2 ms while atomics came lately, slower the longer none came, up to 32 ms), atomic with respect to every framework atomic on the word, the old value written back; one atomic in flight per endpoint; unavailable against a foreign iWARP peer"));
            emulated.push(emu("immediate data", OpSet::SEND_IMM | OpSet::WRITE_IMM, "emulated between peers of this framework (iWARP has no immediate data): the immediate is written into the peer's ring slot of the send ahead of it; a write with immediate data is the write, that record and a zero-length send consuming one posted receive after the data is placed; unavailable against a foreign iWARP peer"));
        }
        if split {
            emulated.push(emu("scatter reads", OpSet::READ, &format!("a read into more than {} scatter entries is split into one RDMA Read per entry", dev.max_sge_rd.max(1))));
        }
        Profile {
            atomics: false,
            immediate: false,
            emulate,
            credits: true,
            delivery_reads: true,
            split_reads: split,
            sink_remote_write: true,
            transport_private_data: MPA_PRIVATE_DATA,
            rnr_retry: 7,
            retry: 7,
            // iWARP has no local ACK timer: the core's liveness probes bound how long a
            // dead peer holds outstanding work (see the fabric-verbs crate docs).
            ack_timeout: None,
            min_rnr_timer: None,
            infer_terminate: true,
            length_as_malformed_wqe: false,
            read_protection,
            listen_early_close,
            soft_fence: dev.vendor_id == SIW_VENDOR_ID,
            liveness_probes: true,
            small_page_crossing: dev.vendor_id == SIW_VENDOR_ID,
            mmap_sentinel_guard: dev.vendor_id == SIW_VENDOR_ID,
            unsupported,
            emulated,
        }
    }

    fn no_device() -> String {
        "no iWARP device (no RDMA device with iWARP transport)".into()
    }
}

/// The inline write the emulation of atomics needs (an atomic request).
const EMULATION_INLINE: u32 = 56;

/// IEEE vendor id the kernel's soft-iWARP reports ("bmt").
const SIW_VENDOR_ID: u32 = 0x626d74;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn address_selection_prefers_ipv4_and_checks_a_wanted_one() {
        let a: Vec<IpAddr> = vec!["fe80::1".parse().unwrap(), "192.168.78.1".parse().unwrap()];
        assert_eq!(select_address(Some("dummy1"), &a, None).unwrap(), a[1]);
        assert_eq!(
            select_address(Some("dummy1"), &a, Some(a[0])).unwrap(),
            a[0]
        );
        assert!(
            select_address(Some("dummy1"), &a, Some("10.0.0.1".parse().unwrap()))
                .unwrap_err()
                .contains("not on")
        );
        assert!(select_address(None, &[], None)
            .unwrap_err()
            .contains("no IP address"));
    }

    #[test]
    fn atomics_and_immediate_data_are_emulated_where_inline_writes_allow() {
        let dev = DeviceFacts {
            name: "siw0".into(),
            transport: Transport::Iwarp,
            node_guid: 0,
            fw_ver: String::new(),
            vendor_id: 0x626d74,
            max_mr_size: 1 << 40,
            max_qp_wr: 32768,
            max_sge: 6,
            max_sge_rd: 1,
            max_cqe: 1 << 20,
            max_qp_rd_atom: 128,
            max_qp_init_rd_atom: 128,
            atomic_cap: 0,
            max_inline: 80,
            ports: Vec::new(),
        };
        let p = Iwarp::profile(&dev);
        assert!(!p.atomics && !p.immediate && p.credits && p.split_reads && p.sink_remote_write);
        assert!(p.emulate);
        assert!(p.liveness_probes && p.ack_timeout.is_none());
        for f in ["dead-peer detection", "atomics", "immediate data"] {
            assert!(
                p.emulated
                    .iter()
                    .any(|e| e.feature == f && e.how.starts_with("emulated")),
                "{f}"
            );
        }
        for k in ["FETCH_ADD", "COMPARE_SWAP", "SEND_IMM", "WRITE_IMM"] {
            assert!(!p.unsupported.contains_key(k), "{k}");
        }
        let small = DeviceFacts {
            max_inline: 32,
            ..dev.clone()
        };
        let q = Iwarp::profile(&small);
        assert!(!q.emulate);
        for k in ["FETCH_ADD", "COMPARE_SWAP", "SEND_IMM", "WRITE_IMM"] {
            assert!(q.unsupported[k].contains("inline"), "{k}");
        }
        assert!(Iwarp::accepts(&dev).is_ok());
        let roce = DeviceFacts {
            transport: Transport::InfiniBand,
            ..dev
        };
        assert!(Iwarp::accepts(&roce).unwrap_err().contains("not iWARP"));
    }
}
