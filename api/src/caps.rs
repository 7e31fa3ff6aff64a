//! What a provider can do, declared up front (docs/contract.md section 1).

use std::collections::BTreeMap;

bitflags::bitflags! {
    /// Operations a provider supports, and the contract's guarantees that are not
    /// operations (a provider may lack them: the conformance suite then reports the cases
    /// that need them unsupported, with the declared reason).
    #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
    pub struct OpSet: u32 {
        /// Send / receive.
        const SEND = 1;
        /// Send with 32-bit immediate data.
        const SEND_IMM = 1 << 1;
        /// RDMA write.
        const WRITE = 1 << 2;
        /// RDMA write with immediate data.
        const WRITE_IMM = 1 << 3;
        /// RDMA read.
        const READ = 1 << 4;
        /// 64-bit fetch-and-add.
        const FETCH_ADD = 1 << 5;
        /// 64-bit compare-and-swap.
        const COMPARE_SWAP = 1 << 6;
        /// Inline sends.
        const INLINE = 1 << 7;
        /// Guarantee: a send that finds no posted receive waits for one (RC
        /// receiver-not-ready retry); nothing is lost, nothing errors.
        const RNR_WAIT = 1 << 8;
        /// Guarantee: a remote read of a region without REMOTE_READ is refused
        /// (RemoteAccess).
        const READ_PROTECTION = 1 << 9;
        /// Guarantee: a client that closes its connection before the listener accepted it
        /// (a port scanner, a hostile or crashing peer) leaves the listener serving
        /// others.
        const LISTEN_EARLY_CLOSE = 1 << 10;
    }
}

impl OpSet {
    /// Both atomics.
    pub const ATOMICS: OpSet = OpSet::FETCH_ADD.union(OpSet::COMPARE_SWAP);
    /// The guarantees, which cannot be posted.
    pub const GUARANTEES: OpSet = OpSet::RNR_WAIT
        .union(OpSet::READ_PROTECTION)
        .union(OpSet::LISTEN_EARLY_CLOSE);
}

/// Numeric limits of a provider or device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Limits {
    /// Largest message (send, write, read) in bytes.
    pub max_msg_size: u64,
    /// Largest inline payload.
    pub max_inline: u32,
    /// Largest gather/scatter list.
    pub max_sge: u32,
    /// Deepest send queue.
    pub max_send_queue: u32,
    /// Deepest receive queue.
    pub max_recv_queue: u32,
    /// Largest completion queue.
    pub max_cq_entries: u32,
    /// Outstanding reads and atomics per endpoint as initiator (ORD).
    pub max_outstanding_reads: u32,
    /// Largest private data on connect / accept.
    pub max_private_data: u32,
}

/// An operation that the provider performs by emulation rather than natively.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Emulation {
    /// The feature, in words.
    pub feature: String,
    /// The operations it concerns (empty for features that are not operations).
    pub ops: OpSet,
    /// How it is emulated.
    pub how: String,
}

/// Everything a provider declares about itself.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Capabilities {
    /// Supported operations.
    pub ops: OpSet,
    /// Limits.
    pub limits: Limits,
    /// Immediate data size in bytes (4).
    pub imm_size: u32,
    /// Operations emulated rather than native.
    pub emulated: Vec<Emulation>,
    /// Why each unsupported operation is unsupported.
    pub unsupported: BTreeMap<String, String>,
}

impl Capabilities {
    /// The reason an operation is unsupported, if it is.
    pub fn why_unsupported(&self, op: OpSet) -> Option<String> {
        if self.ops.contains(op) {
            return None;
        }
        let name = format!("{op:?}");
        Some(
            self.unsupported
                .iter()
                .find(|(k, _)| name.contains(k.as_str()))
                .map(|(k, v)| format!("{k}: {v}"))
                .unwrap_or_else(|| format!("{name} is not supported by this provider")),
        )
    }
}

/// One device a provider can use.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct DeviceInfo {
    /// Device name (`rxe0`, `siw0`, `loopback`...).
    pub name: String,
    /// Transport (`InfiniBand`, `iWARP`, `TCP`).
    pub transport: String,
    /// Link layer (`InfiniBand`, `Ethernet`, `-`).
    pub link_layer: String,
    /// Further facts (port state, MTU, GIDs...), as ordered key/value text.
    pub details: BTreeMap<String, String>,
}

/// Whether a provider can be used here, and if not, why.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(tag = "state", rename_all = "kebab-case")]
pub enum Availability {
    /// Usable.
    Available,
    /// Not usable, with the reason (no rdma-core, no device, port down, memlock...).
    Unavailable {
        /// The reason.
        reason: String,
    },
}

/// A provider as `discover()` reports it.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProviderInfo {
    /// Provider name (`ib`, `roce`, `iwarp`, `tcp`).
    pub name: String,
    /// Availability.
    pub availability: Availability,
    /// Devices it would use.
    pub devices: Vec<DeviceInfo>,
    /// Capabilities.
    pub caps: Capabilities,
}

impl ProviderInfo {
    /// True when usable.
    pub fn is_available(&self) -> bool {
        self.availability == Availability::Available
    }
}
