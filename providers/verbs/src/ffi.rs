//! The module of the workspace that uses rdma-core: thin owning wrappers over libibverbs
//! and librdmacm objects, calling the functions `sys` loads at run time. Every other module
//! is safe code over these types.
//!
//! Ownership rules, enforced by the types:
//! * a [`Pd`] outlives every [`Mr`] and queue pair created on it (they hold an `Arc<Pd>`);
//! * a [`HwCq`] outlives the queue pairs that use it (endpoints hold the queue);
//! * a [`CmId`] is destroyed exactly once, after its queue pair;
//! * memory named by a posted work request stays alive until the request completed or its
//!   queue pair was destroyed: the callers keep the `Arc<Buffer>` (through `RegionRef`) in
//!   their ledger for exactly that long (see `ep.rs`).

use smallvec::SmallVec;
use std::collections::HashMap;
use std::ffi::CStr;
use std::io;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::RawFd;
use std::ptr;
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use crate::sys;

/// The last OS error as an [`io::Error`].
fn last_err() -> io::Error {
    let e = io::Error::last_os_error();
    if e.raw_os_error() == Some(0) {
        // Seen from rdma_create_qp on siw: libsiw fails a creation without setting errno
        // (see `SIW_SENTINEL_OFFSET`), and "Success (os error 0)" would read as if nothing
        // failed.
        return io::Error::other("failed without an errno (the library left errno at 0)");
    }
    e
}

/// Turns a C return code (0 ok, -1 with errno, or a positive errno) into a result.
fn check(rc: i32) -> io::Result<()> {
    match rc {
        0 => Ok(()),
        -1 => Err(last_err()),
        e if e > 0 => Err(io::Error::from_raw_os_error(e)),
        e => Err(io::Error::from_raw_os_error(-e)),
    }
}

// ----- discovery -------------------------------------------------------------------------

/// Raw facts of one port, as `ibv_query_port` reports them.
#[derive(Debug, Clone, Copy)]
pub(crate) struct RawPort {
    pub state: u32,
    pub max_mtu: u32,
    pub active_mtu: u32,
    pub max_msg_sz: u32,
    pub lid: u16,
    pub sm_lid: u16,
    pub lmc: u8,
    pub link_layer: u8,
}

/// A valid GID and its index in the port's table.
pub(crate) type RawGid = (u32, [u8; 16]);

/// Raw facts of one device, as `ibv_query_device` reports them, plus what probing found.
#[derive(Debug, Clone)]
pub(crate) struct RawDevice {
    pub name: String,
    pub transport: i32,
    pub node_guid: u64,
    pub fw_ver: String,
    pub vendor_id: u32,
    pub max_mr_size: u64,
    pub max_qp_wr: i32,
    pub max_sge: i32,
    pub max_sge_rd: i32,
    pub max_cqe: i32,
    pub max_qp_rd_atom: i32,
    pub max_qp_init_rd_atom: i32,
    pub atomic_cap: u32,
    /// Each port with its valid (non-zero) GIDs, lowest index first.
    pub ports: Vec<(RawPort, Vec<RawGid>)>,
    /// Largest inline payload a probe RC queue pair accepted (0 when none).
    pub max_inline: u32,
    /// Gather entries the probe queue pair accepted.
    pub probe_sge: u32,
}

/// Lists every verbs device libibverbs sees, with attributes, ports and GID tables.
/// `Err` carries errno when libibverbs itself failed (no kernel support).
pub(crate) fn probe_devices() -> io::Result<Vec<RawDevice>> {
    let mut out = Vec::new();
    each_device(|dev| match probe_one(dev) {
        Ok(d) => out.push(d),
        Err(e) => tracing::debug!("probing a verbs device failed: {e}"),
    })?;
    Ok(out)
}

/// Calls `f` with every device of libibverbs' device list, which is freed afterwards: a
/// device pointer must not outlive the call (a context opened from it may).
fn each_device(mut f: impl FnMut(*mut sys::ibv_device)) -> io::Result<()> {
    let mut n = 0i32;
    // SAFETY: `n` is a valid out-pointer; the list is freed below with
    // ibv_free_device_list, and no device pointer escapes the calls of `f`.
    let list = unsafe { sys::ibv_get_device_list(&mut n) };
    if list.is_null() {
        return Err(last_err());
    }
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers.
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        f(dev);
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { sys::ibv_free_device_list(list) };
    Ok(())
}

fn cstr(p: *const libc::c_char) -> String {
    if p.is_null() {
        return String::new();
    }
    // SAFETY: rdma-core returns NUL-terminated strings that live as long as the device.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn probe_one(dev: *mut sys::ibv_device) -> io::Result<RawDevice> {
    // SAFETY: `dev` is a valid device from the current device list.
    let name = cstr(unsafe { sys::ibv_get_device_name(dev) });
    // SAFETY: as above; the context is closed at the end of this function.
    let ctx = unsafe { sys::ibv_open_device(dev) };
    if ctx.is_null() {
        return Err(last_err());
    }
    let r = probe_ctx(ctx, name);
    // SAFETY: `ctx` was opened above, every object created on it was destroyed.
    unsafe { sys::ibv_close_device(ctx) };
    r
}

fn probe_ctx(ctx: *mut sys::ibv_context, name: String) -> io::Result<RawDevice> {
    // SAFETY: all-zero is a valid value of this plain C struct.
    let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `ctx` is open; `attr` is a valid out-pointer.
    check(unsafe { sys::ibv_query_device(ctx, &mut attr) })?;
    // SAFETY: an open context points at its device.
    let transport = unsafe { (*(*ctx).device).transport_type };
    let mut ports = Vec::new();
    let mut table_len = Vec::new();
    for p in 1..=attr.phys_port_cnt {
        // SAFETY: all-zero is a valid value of this plain C struct.
        let mut pa: sys::ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open; `pa` is a valid out-pointer of the full struct size.
        check(unsafe { sys::___ibv_query_port(ctx, p, &mut pa) })?;
        table_len.push(pa.gid_tbl_len.max(0) as u32);
        ports.push((
            RawPort {
                state: pa.state,
                max_mtu: pa.max_mtu,
                active_mtu: pa.active_mtu,
                max_msg_sz: pa.max_msg_sz,
                lid: pa.lid,
                sm_lid: pa.sm_lid,
                lmc: pa.lmc,
                link_layer: pa.link_layer,
            },
            Vec::new(),
        ));
    }
    // SAFETY: `ctx` is open.
    match unsafe { query_gid_table(ctx, &table_len) } {
        Some(entries) => {
            for (port, idx, gid) in entries {
                if let Some((_, gids)) = ports.get_mut(port as usize - 1) {
                    gids.push((idx, gid));
                }
            }
        }
        None => {
            for (i, (_, gids)) in ports.iter_mut().enumerate() {
                // SAFETY: `ctx` is open; the port number and table length are the device's.
                *gids = unsafe { query_gids_one_by_one(ctx, i as u8 + 1, table_len[i]) };
            }
        }
    }
    for (_, gids) in &mut ports {
        gids.sort_unstable_by_key(|(idx, _)| *idx);
    }
    let (max_inline, probe_sge) = qp_caps(ctx, &name, &attr);
    let fw = attr.fw_ver;
    Ok(RawDevice {
        name,
        transport,
        node_guid: u64::from_be(attr.node_guid),
        fw_ver: cstr(fw.as_ptr()),
        vendor_id: attr.vendor_id,
        max_mr_size: attr.max_mr_size,
        max_qp_wr: attr.max_qp_wr,
        max_sge: attr.max_sge,
        max_sge_rd: attr.max_sge_rd,
        max_cqe: attr.max_cqe,
        max_qp_rd_atom: attr.max_qp_rd_atom,
        max_qp_init_rd_atom: attr.max_qp_init_rd_atom,
        atomic_cap: attr.atomic_cap,
        ports,
        max_inline,
        probe_sge,
    })
}

/// Every valid GID of the device in one call (`ibv_query_gid_table`): `(port, index, gid)`,
/// or `None` when this rdma-core lacks the call or it failed (the caller then queries index
/// by index). `table_len` holds each port's table length, which bounds the answer.
///
/// # Safety
/// `ctx` is an open device context.
unsafe fn query_gid_table(
    ctx: *mut sys::ibv_context,
    table_len: &[u32],
) -> Option<Vec<(u32, u32, [u8; 16])>> {
    let max: usize = table_len.iter().map(|&n| n as usize).sum();
    let mut entries: Vec<sys::ibv_gid_entry> = (0..max.max(1))
        // SAFETY: all-zero is a valid value of this plain C struct (a GID and four integers).
        .map(|_| unsafe { std::mem::zeroed() })
        .collect();
    // SAFETY: `ctx` is open (the caller's contract).
    let n = unsafe { sys::ibv_query_gid_table(ctx, &mut entries) }?;
    if n < 0 {
        tracing::debug!(
            errno = -n,
            "ibv_query_gid_table failed; querying GIDs one by one"
        );
        return None;
    }
    entries.truncate((n as usize).min(max));
    Some(
        entries
            .iter()
            .filter(|e| e.port_num >= 1 && e.port_num as usize <= table_len.len())
            // SAFETY: every bit pattern of the union is a valid byte array.
            .map(|e| (e.port_num, e.gid_index, unsafe { e.gid.raw }))
            .filter(|(_, _, g)| *g != [0; 16])
            .collect(),
    )
}

/// The valid GIDs of one port, one `ibv_query_gid` per index (rdma-core before 30): an
/// empty entry reads as zeros and is left out.
///
/// # Safety
/// `ctx` is an open device context with a port `port` whose table has `len` entries.
unsafe fn query_gids_one_by_one(ctx: *mut sys::ibv_context, port: u8, len: u32) -> Vec<RawGid> {
    let mut gids = Vec::new();
    for idx in 0..len {
        // SAFETY: all-zero is a valid GID.
        let mut g: sys::ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: `ctx` is open, the index is inside the table, `g` is an out-pointer.
        if unsafe { sys::ibv_query_gid(ctx, port, idx as i32, &mut g) } != 0 {
            break;
        }
        // SAFETY: every bit pattern of the union is a valid byte array.
        let raw = unsafe { g.raw };
        if raw != [0; 16] {
            gids.push((idx, raw));
        }
    }
    gids
}

/// What [`probe_qp_caps`] learned, per device (name and node GUID), for the life of the
/// process: a device's limits do not change, and the probe creates up to ten queue pairs
/// (tens of milliseconds under emulation) while every domain opened runs discovery.
static QP_CAPS: OnceLock<Mutex<HashMap<DeviceKey, (u32, u32)>>> = OnceLock::new();

/// A device by name and node GUID.
type DeviceKey = (String, u64);

/// The device's inline and gather limits: [`probe_qp_caps`] the first time, remembered after.
fn qp_caps(ctx: *mut sys::ibv_context, name: &str, attr: &sys::ibv_device_attr) -> (u32, u32) {
    let key = (name.to_owned(), attr.node_guid);
    let cache = QP_CAPS.get_or_init(Mutex::default);
    if let Some(&caps) = cache.lock().unwrap_or_else(|e| e.into_inner()).get(&key) {
        return caps;
    }
    let caps = probe_qp_caps(ctx, attr);
    // Two threads probing at once both probe; both learn the same answer.
    cache
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key, caps);
    caps
}

/// Creates throw-away RC queue pairs to learn the largest inline payload and gather list
/// the device really accepts (device attributes do not report max inline).
fn probe_qp_caps(ctx: *mut sys::ibv_context, attr: &sys::ibv_device_attr) -> (u32, u32) {
    // SAFETY: `ctx` is open; the PD and CQ are destroyed before returning.
    let pd = unsafe { sys::ibv_alloc_pd(ctx) };
    if pd.is_null() {
        return (0, 0);
    }
    // SAFETY: as above.
    let cq = unsafe { sys::ibv_create_cq(ctx, 4, ptr::null_mut(), ptr::null_mut(), 0) };
    let mut best = (0u32, 0u32);
    if !cq.is_null() {
        let sge = attr.max_sge.clamp(1, 64) as u32;
        for inline in [1024u32, 512, 400, 256, 220, 128, 80, 64, 32, 0] {
            // SAFETY: all-zero is a valid init attribute, filled in below.
            let mut ia: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
            ia.send_cq = cq;
            ia.recv_cq = cq;
            ia.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
            ia.cap.max_send_wr = 1;
            ia.cap.max_recv_wr = 1;
            ia.cap.max_send_sge = sge;
            ia.cap.max_recv_sge = sge;
            ia.cap.max_inline_data = inline;
            // SAFETY: `pd` and `cq` are live; the QP is destroyed at once.
            let qp = unsafe { sys::ibv_create_qp(pd, &mut ia) };
            if !qp.is_null() {
                best = (
                    ia.cap.max_inline_data,
                    ia.cap.max_send_sge.min(ia.cap.max_recv_sge),
                );
                // SAFETY: created just above, destroyed once.
                unsafe { sys::ibv_destroy_qp(qp) };
                break;
            }
        }
        // SAFETY: created above; its QPs are gone.
        unsafe { sys::ibv_destroy_cq(cq) };
    }
    // SAFETY: allocated above; everything on it is gone.
    unsafe { sys::ibv_dealloc_pd(pd) };
    best
}

// ----- contexts and protection domains ---------------------------------------------------

/// A device context opened by librdmacm (the one its connection identifiers use). These
/// contexts stay open for the life of the process, so the handle is plain data.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Ctx(*mut sys::ibv_context);

// SAFETY: verbs contexts are thread-safe; librdmacm keeps them open for the process lifetime.
unsafe impl Send for Ctx {}
// SAFETY: as above.
unsafe impl Sync for Ctx {}

impl Ctx {
    /// The librdmacm context of the device called `name`.
    pub fn by_name(name: &str) -> io::Result<Ctx> {
        let mut n = 0i32;
        // SAFETY: `n` is a valid out-pointer; the array is freed below, the contexts
        // themselves stay open (librdmacm owns them).
        let list = unsafe { sys::rdma_get_devices(&mut n) };
        if list.is_null() {
            return Err(last_err());
        }
        let mut found = None;
        for i in 0..n.max(0) as usize {
            // SAFETY: the array holds `n` contexts.
            let c = unsafe { *list.add(i) };
            if c.is_null() {
                break;
            }
            // SAFETY: an open context points at its device.
            if cstr(unsafe { sys::ibv_get_device_name((*c).device) }) == name {
                found = Some(Ctx(c));
            }
        }
        // SAFETY: returned by rdma_get_devices, freed once.
        unsafe { sys::rdma_free_devices(list) };
        found.ok_or_else(|| {
            io::Error::new(
                io::ErrorKind::NotFound,
                format!("librdmacm has no device {name}"),
            )
        })
    }

    pub(crate) fn raw(self) -> *mut sys::ibv_context {
        self.0
    }
}

/// A protection domain.
#[derive(Debug)]
pub(crate) struct Pd {
    ptr: *mut sys::ibv_pd,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Pd {}
// SAFETY: as above.
unsafe impl Sync for Pd {}

impl Pd {
    pub fn alloc(ctx: Ctx) -> io::Result<Arc<Pd>> {
        // SAFETY: `ctx` is an open context.
        let ptr = unsafe { sys::ibv_alloc_pd(ctx.raw()) };
        if ptr.is_null() {
            return Err(last_err());
        }
        #[cfg(debug_assertions)]
        crate::fault::note_pd_allocated();
        Ok(Arc::new(Pd { ptr }))
    }
}

impl Drop for Pd {
    fn drop(&mut self) {
        // SAFETY: every MR on this PD holds an Arc<Pd>, and whatever holds a queue pair of
        // it holds one too until the queue pair is destroyed (an endpoint through its
        // domain, a connect helper and the identifier's reaper explicitly), so none is
        // left.
        let rc = unsafe { sys::ibv_dealloc_pd(self.ptr) };
        #[cfg(debug_assertions)]
        crate::fault::note_pd_dropped(rc == 0);
        if rc != 0 {
            tracing::warn!(
                "ibv_dealloc_pd failed: {}",
                io::Error::from_raw_os_error(rc)
            );
        }
    }
}

/// Verbs access flags.
pub(crate) mod access {
    pub const LOCAL_WRITE: u32 = 1;
    pub const REMOTE_WRITE: u32 = 2;
    pub const REMOTE_READ: u32 = 4;
    pub const REMOTE_ATOMIC: u32 = 8;
}

/// A memory registration. It holds its buffer, so the memory outlives the registration
/// by construction.
#[derive(Debug)]
pub(crate) struct Mr {
    ptr: *mut sys::ibv_mr,
    _pd: Arc<Pd>,
    _buf: Arc<fabric_api::Buffer>,
}

// SAFETY: verbs objects may be used from any thread.
unsafe impl Send for Mr {}
// SAFETY: as above.
unsafe impl Sync for Mr {}

impl Mr {
    /// Registers the whole buffer (at least one byte: every buffer, a zero-length one
    /// too, owns at least one whole 8-byte word, so the extra byte is inside it).
    pub fn register(pd: &Arc<Pd>, buf: &Arc<fabric_api::Buffer>, flags: u32) -> io::Result<Mr> {
        let len = buf.len().max(1);
        // SAFETY: the PD is live; the buffer is valid for `len` bytes (its length, or the
        // one whole word every buffer owns when it is empty: `Buffer::as_mut_ptr`) and this
        // Mr holds an Arc of it, so it is freed only after ibv_dereg_mr in Drop.
        let ptr = unsafe { sys::ibv_reg_mr(pd.ptr, buf.as_mut_ptr().cast(), len, flags as i32) };
        if ptr.is_null() {
            return Err(last_err());
        }
        Ok(Mr {
            ptr,
            _pd: pd.clone(),
            _buf: buf.clone(),
        })
    }

    pub fn lkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.ptr).lkey }
    }

    pub fn rkey(&self) -> u32 {
        // SAFETY: the MR is live.
        unsafe { (*self.ptr).rkey }
    }
}

impl Drop for Mr {
    fn drop(&mut self) {
        // SAFETY: registered in `register`, deregistered once.
        let rc = unsafe { sys::ibv_dereg_mr(self.ptr) };
        if rc != 0 {
            tracing::warn!("ibv_dereg_mr failed: {}", io::Error::from_raw_os_error(rc));
        }
    }
}

// ----- completion queues -----------------------------------------------------------------

/// One work completion, copied out of the device's queue.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Wc {
    pub wr_id: u64,
    pub status: u32,
    pub opcode: u32,
    pub vendor_err: u32,
    pub byte_len: u32,
    pub imm: Option<u32>,
    pub qp_num: u32,
}

/// `ibv_wc_opcode` values used here.
pub(crate) mod wc_opcode {
    pub const RECV_RDMA_WITH_IMM: u32 = 129;
}

/// A completion queue with its own completion channel (for the blocking wait).
#[derive(Debug)]
pub(crate) struct HwCq {
    cq: *mut sys::ibv_cq,
    chan: *mut sys::ibv_comp_channel,
    pub ctx: Ctx,
}

// SAFETY: polling, arming and channel reads are thread-safe in libibverbs.
unsafe impl Send for HwCq {}
// SAFETY: as above.
unsafe impl Sync for HwCq {}

impl HwCq {
    pub fn new(ctx: Ctx, entries: usize) -> io::Result<HwCq> {
        // SAFETY: `ctx` is open.
        let chan = unsafe { sys::ibv_create_comp_channel(ctx.raw()) };
        if chan.is_null() {
            return Err(last_err());
        }
        // SAFETY: the channel was created above and is live.
        let fd = unsafe { (*chan).fd };
        set_nonblocking(fd)?;
        // SAFETY: `ctx` and `chan` are live.
        let cq = unsafe { sys::ibv_create_cq(ctx.raw(), entries as i32, ptr::null_mut(), chan, 0) };
        if cq.is_null() {
            let e = last_err();
            // SAFETY: created above, no CQ uses it.
            unsafe { sys::ibv_destroy_comp_channel(chan) };
            return Err(e);
        }
        Ok(HwCq { cq, chan, ctx })
    }

    pub fn raw(&self) -> *mut sys::ibv_cq {
        self.cq
    }

    /// Polls up to `out.len()` completions (non-blocking); returns how many were filled.
    /// Inlined into the completion queue's poll: a spinning application's every poll
    /// comes here, and in the soft-RDMA guest a call and its return cost as much as twenty
    /// plain instructions.
    #[inline(always)]
    pub fn poll(&self, out: &mut [Wc]) -> io::Result<usize> {
        let mut raw: [std::mem::MaybeUninit<sys::ibv_wc>; 32] =
            [const { std::mem::MaybeUninit::uninit() }; 32];
        let want = out.len().min(raw.len());
        // SAFETY: the CQ is live; `raw` has room for `want` entries.
        let n = unsafe { sys::ibv_poll_cq(self.cq, want as i32, raw.as_mut_ptr().cast()) };
        if n < 0 {
            return Err(io::Error::other(format!("ibv_poll_cq returned {n}")));
        }
        for i in 0..n as usize {
            // SAFETY: ibv_poll_cq initialised the first `n` entries.
            let w = unsafe { raw[i].assume_init_ref() };
            let with_imm = w.wc_flags & 2 != 0; // IBV_WC_WITH_IMM
            out[i] = Wc {
                wr_id: w.wr_id,
                status: w.status,
                opcode: w.opcode,
                vendor_err: w.vendor_err,
                byte_len: w.byte_len,
                // SAFETY: with IBV_WC_WITH_IMM the union holds the immediate data.
                imm: with_imm
                    .then(|| u32::from_be(unsafe { w.imm_data_invalidated_rkey_union.imm_data })),
                qp_num: w.qp_num,
            };
        }
        Ok(n as usize)
    }

    /// Arms the queue: the next completion makes the channel readable.
    pub fn arm(&self) -> io::Result<()> {
        // SAFETY: the CQ is live.
        check(unsafe { sys::ibv_req_notify_cq(self.cq, 0) })
    }

    /// The completion channel's file descriptor (non-blocking).
    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is live.
        unsafe { (*self.chan).fd }
    }

    /// Consumes one pending channel event, if any, and acknowledges it.
    pub fn take_event(&self) -> bool {
        let mut cq = ptr::null_mut();
        let mut cq_ctx = ptr::null_mut();
        // SAFETY: the channel is live and non-blocking; out-pointers are valid.
        if unsafe { sys::ibv_get_cq_event(self.chan, &mut cq, &mut cq_ctx) } != 0 {
            return false;
        }
        // SAFETY: every event taken is acknowledged once, before the CQ is destroyed.
        unsafe { sys::ibv_ack_cq_events(cq, 1) };
        true
    }
}

impl Drop for HwCq {
    fn drop(&mut self) {
        // SAFETY: endpoints using this CQ hold it (Arc), so no QP uses it now; all
        // channel events were acknowledged as they were taken.
        unsafe {
            sys::ibv_destroy_cq(self.cq);
            sys::ibv_destroy_comp_channel(self.chan);
        }
    }
}

/// Sets O_NONBLOCK on `fd`.
pub(crate) fn set_nonblocking(fd: RawFd) -> io::Result<()> {
    // SAFETY: fcntl on a descriptor we own; no memory is involved.
    let flags = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if flags < 0 {
        return Err(last_err());
    }
    // SAFETY: as above.
    if unsafe { libc::fcntl(fd, libc::F_SETFL, flags | libc::O_NONBLOCK) } < 0 {
        return Err(last_err());
    }
    Ok(())
}

/// An eventfd used to wake threads blocked in [`poll_fds`].
#[derive(Debug)]
pub(crate) struct EventFd(RawFd);

impl EventFd {
    pub fn new() -> io::Result<EventFd> {
        // SAFETY: plain syscall creating a descriptor we own.
        let fd = unsafe { libc::eventfd(0, libc::EFD_NONBLOCK | libc::EFD_CLOEXEC) };
        if fd < 0 {
            return Err(last_err());
        }
        Ok(EventFd(fd))
    }
    pub fn fd(&self) -> RawFd {
        self.0
    }
    /// Makes the descriptor readable.
    pub fn signal(&self) {
        let one = 1u64;
        // SAFETY: writes 8 bytes from a live local to our descriptor.
        let _ = unsafe { libc::write(self.0, (&one as *const u64).cast(), 8) };
    }
    /// Makes the descriptor unreadable again.
    pub fn clear(&self) {
        let mut v = 0u64;
        // SAFETY: reads 8 bytes into a live local from our non-blocking descriptor.
        let _ = unsafe { libc::read(self.0, (&mut v as *mut u64).cast(), 8) };
    }
}

impl Drop for EventFd {
    fn drop(&mut self) {
        // SAFETY: closes the descriptor we own, once.
        unsafe { libc::close(self.0) };
    }
}

/// An `epoll` instance watching descriptors for input, level-triggered: its own descriptor
/// is readable while one of them is (a completion queue's notification descriptor).
#[derive(Debug)]
pub(crate) struct Epoll(std::os::fd::OwnedFd);

impl Epoll {
    /// Watches `fds`, which the caller keeps open as long as the instance is used.
    pub fn new(fds: &[RawFd]) -> io::Result<Epoll> {
        use std::os::fd::{FromRawFd, OwnedFd};
        // SAFETY: plain syscall creating a descriptor we own.
        let fd = unsafe { libc::epoll_create1(libc::EPOLL_CLOEXEC) };
        if fd < 0 {
            return Err(last_err());
        }
        // SAFETY: `fd` was just created and nothing else owns it.
        let ep = Epoll(unsafe { OwnedFd::from_raw_fd(fd) });
        for &f in fds {
            let mut ev = libc::epoll_event {
                events: libc::EPOLLIN as u32,
                u64: f as u64,
            };
            // SAFETY: `ev` is a live local the kernel only reads; `fd` and `f` are open.
            if unsafe { libc::epoll_ctl(fd, libc::EPOLL_CTL_ADD, f, &mut ev) } < 0 {
                return Err(last_err());
            }
        }
        Ok(ep)
    }
}

impl std::os::fd::AsFd for Epoll {
    fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        self.0.as_fd()
    }
}

/// Waits until one of `fds` is readable or `timeout` passes (`None`: forever). Returns
/// which are readable.
pub(crate) fn poll_fds(fds: &[RawFd], timeout: Option<Duration>) -> io::Result<Vec<bool>> {
    let mut p: Vec<libc::pollfd> = fds
        .iter()
        .map(|&fd| libc::pollfd {
            fd,
            events: libc::POLLIN,
            revents: 0,
        })
        .collect();
    let ms = timeout.map_or(-1, |t| t.as_millis().min(i32::MAX as u128) as i32);
    // SAFETY: `p` is a valid array of `p.len()` pollfd structs.
    let rc = unsafe { libc::poll(p.as_mut_ptr(), p.len() as libc::nfds_t, ms) };
    if rc < 0 {
        let e = last_err();
        if e.kind() == io::ErrorKind::Interrupted {
            return Ok(vec![false; fds.len()]);
        }
        return Err(e);
    }
    Ok(p.iter().map(|x| x.revents != 0).collect())
}

/// The locked-memory limit (soft), in bytes; `None` when unlimited.
pub(crate) fn memlock_limit() -> Option<u64> {
    // SAFETY: all-zero is a valid rlimit; getrlimit fills it.
    let mut r: libc::rlimit = unsafe { std::mem::zeroed() };
    // SAFETY: valid out-pointer.
    if unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut r) } != 0 {
        return None;
    }
    (r.rlim_cur != libc::RLIM_INFINITY).then_some(r.rlim_cur)
}

/// IPv4 and IPv6 addresses of the network interface `ifname`.
pub(crate) fn if_addrs(ifname: &str) -> Vec<IpAddr> {
    let mut head: *mut libc::ifaddrs = ptr::null_mut();
    // SAFETY: valid out-pointer; freed with freeifaddrs below.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut cur = head;
    while !cur.is_null() {
        // SAFETY: walking the list getifaddrs returned.
        let ifa = unsafe { &*cur };
        if cstr(ifa.ifa_name) == ifname && !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr is a valid sockaddr of its family.
            if let Some(sa) = unsafe { sockaddr_to_std(ifa.ifa_addr) } {
                out.push(sa.ip());
            }
        }
        cur = ifa.ifa_next;
    }
    // SAFETY: returned by getifaddrs, freed once.
    unsafe { libc::freeifaddrs(head) };
    out
}

/// Converts a C socket address.
///
/// # Safety
/// `sa` must point at a valid socket address of the family it names.
unsafe fn sockaddr_to_std(sa: *const libc::sockaddr) -> Option<SocketAddr> {
    // SAFETY: the caller guarantees `sa` is valid; the cast matches the family.
    unsafe {
        match i32::from((*sa).sa_family) {
            libc::AF_INET => {
                let s = &*(sa as *const libc::sockaddr_in);
                Some(SocketAddr::V4(SocketAddrV4::new(
                    Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr)),
                    u16::from_be(s.sin_port),
                )))
            }
            libc::AF_INET6 => {
                let s = &*(sa as *const libc::sockaddr_in6);
                Some(SocketAddr::V6(SocketAddrV6::new(
                    Ipv6Addr::from(s.sin6_addr.s6_addr),
                    u16::from_be(s.sin6_port),
                    s.sin6_flowinfo,
                    s.sin6_scope_id,
                )))
            }
            _ => None,
        }
    }
}

/// A C socket address built from a Rust one.
struct CSockAddr(libc::sockaddr_storage);

impl CSockAddr {
    fn new(a: SocketAddr) -> Self {
        // SAFETY: all-zero is a valid sockaddr_storage.
        let mut st: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
        match a {
            SocketAddr::V4(v4) => {
                // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
                let s = unsafe { &mut *(&mut st as *mut _ as *mut libc::sockaddr_in) };
                s.sin_family = libc::AF_INET as libc::sa_family_t;
                s.sin_port = v4.port().to_be();
                s.sin_addr.s_addr = u32::from(*v4.ip()).to_be();
            }
            SocketAddr::V6(v6) => {
                // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in6.
                let s = unsafe { &mut *(&mut st as *mut _ as *mut libc::sockaddr_in6) };
                s.sin6_family = libc::AF_INET6 as libc::sa_family_t;
                s.sin6_port = v6.port().to_be();
                s.sin6_addr.s6_addr = v6.ip().octets();
                s.sin6_scope_id = v6.scope_id();
            }
        }
        CSockAddr(st)
    }
    fn as_ptr(&mut self) -> *mut libc::sockaddr {
        (&mut self.0 as *mut libc::sockaddr_storage).cast()
    }
}

// ----- siw's mmap-key sentinel -------------------------------------------------------------

/// The mmap offset libsiw (rdma-core's `providers/siw`) reads as "the kernel made no mapping"
/// (`SIW_INVAL_UOBJ_KEY` in `rdma/siw-abi.h`, 0x90000). The kernel hands out the offsets of
/// a user context first-fit from 0 (`rdma_user_mmap_entry_insert_range`), so a queue whose
/// mapping happens to begin there is a good one that libsiw takes for a failure: it destroys
/// the QP or CQ it was creating and returns NULL with errno untouched (often 0). Where the
/// mappings of one context fall depends on the order its queues were created in, so this
/// strikes one run in ten or so of a process that opens a few endpoints from several threads.
#[cfg(debug_assertions)] // the device tests' check (`fault::mmap_sentinel`)
pub(crate) const SIW_SENTINEL_OFFSET: usize = 0x9_0000;

/// Completion entries of the guard CQ: 32 bytes each, so its queue maps 1 MiB, past the
/// sentinel whatever the page size.
const SENTINEL_GUARD_CQES: i32 = 32 * 1024;

/// Creates the guard CQ on `ctx`: in a context with nothing mapped yet its queue takes the
/// offsets from 0 to past 1 MiB, so no later mapping can begin at [`SIW_SENTINEL_OFFSET`].
///
/// # Safety
/// `ctx` is an open context, and the caller destroys the CQ before closing it (or never
/// closes it).
unsafe fn sentinel_guard_cq(ctx: *mut sys::ibv_context) -> io::Result<*mut sys::ibv_cq> {
    // SAFETY: `ctx` is open (the caller's contract); no channel, no context pointer.
    let cq = unsafe {
        sys::ibv_create_cq(
            ctx,
            SENTINEL_GUARD_CQES,
            ptr::null_mut(),
            ptr::null_mut(),
            0,
        )
    };
    if cq.is_null() {
        return Err(last_err());
    }
    Ok(cq)
}

/// Puts the guard CQ on librdmacm's context `ctx`, once per context, for the life of the
/// process (librdmacm keeps the context open as long; the 1 MiB is the price). Called
/// before the domain creates anything on the context; when the process created queues on
/// it before (another library, or a domain opened earlier), the guard lands past them and
/// protects nothing, which is logged.
pub(crate) fn guard_siw_sentinel(ctx: Ctx) {
    static GUARDED: Mutex<Vec<usize>> = Mutex::new(Vec::new());
    let mut guarded = GUARDED.lock().unwrap_or_else(|e| e.into_inner());
    if guarded.contains(&(ctx.raw() as usize)) {
        return;
    }
    // SAFETY: librdmacm's contexts stay open for the life of the process, and the guard CQ
    // is never destroyed.
    match unsafe { sentinel_guard_cq(ctx.raw()) } {
        Ok(_) => {
            guarded.push(ctx.raw() as usize);
            tracing::debug!("siw: guard CQ holds the mmap offsets below 1 MiB");
        }
        Err(e) => tracing::warn!(
            "siw: the guard CQ against libsiw's mmap-key sentinel failed ({e}); creating a \
             queue pair or CQ may fail now and then with errno 0"
        ),
    }
}

/// The index of the first of a run of one-page mappings from offset 0 that begins at
/// [`SIW_SENTINEL_OFFSET`].
#[cfg(debug_assertions)] // the device tests' check (`fault::mmap_sentinel`)
pub(crate) fn sentinel_page_index() -> usize {
    // SAFETY: sysconf has no preconditions.
    let page = unsafe { libc::sysconf(libc::_SC_PAGESIZE) }.max(4096) as usize;
    SIW_SENTINEL_OFFSET / page
}

/// On a private context of `device`, guarded first or not: creates one-page CQs until one
/// would map at [`SIW_SENTINEL_OFFSET`] (that one included); returns the index of the
/// first that failed, if any. Every object is destroyed before the context is closed.
#[cfg(debug_assertions)] // the device tests' check (`fault::mmap_sentinel`)
pub(crate) fn fill_to_sentinel(device: &str, guard: bool) -> io::Result<Option<usize>> {
    let mut ctx: *mut sys::ibv_context = ptr::null_mut();
    each_device(|dev| {
        // SAFETY: `dev` is a device of the live list.
        if ctx.is_null() && cstr(unsafe { sys::ibv_get_device_name(dev) }) == device {
            // SAFETY: as above; the context is closed at the end of this function.
            ctx = unsafe { sys::ibv_open_device(dev) };
        }
    })?;
    if ctx.is_null() {
        return Err(io::Error::new(
            io::ErrorKind::NotFound,
            format!("cannot open a context of {device}"),
        ));
    }
    let guard_cq = if guard {
        // SAFETY: `ctx` is open; the guard is destroyed below, before the context is closed.
        match unsafe { sentinel_guard_cq(ctx) } {
            Ok(cq) => Some(cq),
            Err(e) => {
                // SAFETY: nothing was created on `ctx`.
                unsafe { sys::ibv_close_device(ctx) };
                return Err(e);
            }
        }
    } else {
        None
    };
    // A CQ of 64 entries maps 64 * 32 bytes and its 8-byte control word: one page.
    let mut cqs = Vec::new();
    let mut failed = None;
    for i in 0..=sentinel_page_index() {
        // SAFETY: `ctx` is open; the CQ is destroyed below.
        let cq = unsafe { sys::ibv_create_cq(ctx, 64, ptr::null_mut(), ptr::null_mut(), 0) };
        if cq.is_null() {
            failed.get_or_insert(i);
        } else {
            cqs.push(cq);
        }
    }
    for cq in cqs.into_iter().chain(guard_cq) {
        // SAFETY: created above on `ctx`, destroyed once.
        unsafe { sys::ibv_destroy_cq(cq) };
    }
    // SAFETY: every object created on `ctx` was destroyed.
    unsafe { sys::ibv_close_device(ctx) };
    Ok(failed)
}

// ----- rdma_cm ---------------------------------------------------------------------------

/// `rdma_cm_event_type` values.
pub(crate) mod cm_event {
    pub use rdma_sys::rdma_cm_event_type::*;
}

/// A connection-manager event, copied out and already acknowledged.
#[derive(Debug, Clone)]
pub(crate) struct CmEvent {
    pub kind: u32,
    pub status: i32,
    /// The identifier the event is for (a new one for connection requests).
    pub id: usize,
    /// The listening identifier (connection requests).
    pub listen_id: usize,
    pub private_data: Vec<u8>,
    pub initiator_depth: u8,
    pub responder_resources: u8,
}

/// An rdma_cm event channel (non-blocking).
#[derive(Debug)]
pub(crate) struct EventChannel(*mut sys::rdma_event_channel);

// SAFETY: librdmacm event channels may be read from any thread.
unsafe impl Send for EventChannel {}
// SAFETY: as above.
unsafe impl Sync for EventChannel {}

impl EventChannel {
    pub fn new() -> io::Result<EventChannel> {
        // SAFETY: plain constructor.
        let ch = unsafe { sys::rdma_create_event_channel() };
        if ch.is_null() {
            return Err(last_err());
        }
        // SAFETY: the channel is live.
        set_nonblocking(unsafe { (*ch).fd })?;
        Ok(EventChannel(ch))
    }

    pub fn fd(&self) -> RawFd {
        // SAFETY: the channel is live.
        unsafe { (*self.0).fd }
    }

    /// Takes the next event if one is ready: copies what we need and acknowledges it at
    /// once (so `rdma_destroy_id` never waits on us).
    pub fn next(&self) -> Option<CmEvent> {
        let mut ev = ptr::null_mut();
        // SAFETY: the channel is live and non-blocking; `ev` is a valid out-pointer.
        if unsafe { sys::rdma_get_cm_event(self.0, &mut ev) } != 0 {
            return None;
        }
        // SAFETY: rdma_get_cm_event returned a valid event, read before it is acked.
        let out = unsafe {
            let e = &*ev;
            let conn = e.param.conn;
            let private_data = if conn.private_data.is_null() || conn.private_data_len == 0 {
                Vec::new()
            } else {
                std::slice::from_raw_parts(
                    conn.private_data.cast::<u8>(),
                    usize::from(conn.private_data_len),
                )
                .to_vec()
            };
            CmEvent {
                kind: e.event,
                status: e.status,
                id: e.id as usize,
                listen_id: e.listen_id as usize,
                private_data,
                initiator_depth: conn.initiator_depth,
                responder_resources: conn.responder_resources,
            }
        };
        // SAFETY: acknowledged exactly once, after the copy above.
        unsafe { sys::rdma_ack_cm_event(ev) };
        Some(out)
    }
}

impl Drop for EventChannel {
    fn drop(&mut self) {
        // SAFETY: every identifier on the channel was destroyed before (they keep the
        // channel's owner alive), and every event was acknowledged.
        unsafe { sys::rdma_destroy_event_channel(self.0) };
    }
}

/// Connection parameters for connect and accept.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ConnParam<'a> {
    pub private_data: &'a [u8],
    pub responder_resources: u8,
    pub initiator_depth: u8,
    pub retry_count: u8,
    pub rnr_retry_count: u8,
}

impl ConnParam<'_> {
    fn raw(&self) -> sys::rdma_conn_param {
        sys::rdma_conn_param {
            private_data: if self.private_data.is_empty() {
                ptr::null()
            } else {
                self.private_data.as_ptr().cast()
            },
            private_data_len: self.private_data.len() as u8,
            responder_resources: self.responder_resources,
            initiator_depth: self.initiator_depth,
            flow_control: 1,
            retry_count: self.retry_count,
            rnr_retry_count: self.rnr_retry_count,
            srq: 0,
            qp_num: 0,
        }
    }
}

/// Queue pair sizes.
#[derive(Debug, Clone, Copy)]
pub(crate) struct QpCaps {
    pub send_wr: u32,
    pub recv_wr: u32,
    pub send_sge: u32,
    pub recv_sge: u32,
    pub inline: u32,
}

/// A scatter/gather entry of a posted request, laid out as `ibv_sge` (checked below): a
/// list of them goes to the device library as it is, not copied entry by entry into a
/// zeroed array on every post.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sge {
    pub addr: u64,
    pub len: u32,
    pub lkey: u32,
}

const _: () = {
    use std::mem::{align_of, offset_of, size_of};
    assert!(size_of::<Sge>() == size_of::<sys::ibv_sge>());
    assert!(align_of::<Sge>() == align_of::<sys::ibv_sge>());
    assert!(offset_of!(Sge, addr) == offset_of!(sys::ibv_sge, addr));
    assert!(offset_of!(Sge, len) == offset_of!(sys::ibv_sge, length));
    assert!(offset_of!(Sge, lkey) == offset_of!(sys::ibv_sge, lkey));
};

impl Sge {
    /// The entry as the device library takes it.
    fn raw(&self) -> sys::ibv_sge {
        sys::ibv_sge {
            addr: self.addr,
            length: self.len,
            lkey: self.lkey,
        }
    }
}

/// `sges` as a request's `sg_list` (null when empty). The device library only reads the
/// list, during the post (it copies the entries into its queue), so handing it the
/// caller's shared slice is sound.
fn sg_list(sges: &[Sge]) -> *mut sys::ibv_sge {
    if sges.is_empty() {
        ptr::null_mut()
    } else {
        sges.as_ptr().cast::<sys::ibv_sge>().cast_mut()
    }
}

/// The operation of a hardware send-queue request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HwOp {
    Send {
        imm: Option<u32>,
    },
    Write {
        addr: u64,
        rkey: u32,
        imm: Option<u32>,
    },
    Read {
        addr: u64,
        rkey: u32,
    },
    FetchAdd {
        addr: u64,
        rkey: u32,
        add: u64,
    },
    CompareSwap {
        addr: u64,
        rkey: u32,
        compare: u64,
        swap: u64,
    },
}

/// The gather list of a request: up to two entries without a heap allocation (one is the
/// common case; a request split at a page boundary has two).
pub(crate) type Sges = SmallVec<[Sge; 2]>;

/// An inline payload: up to [`INLINE_STACK`] bytes without a heap allocation (credit
/// updates, emulation records and small application messages).
pub(crate) type Inline = SmallVec<[u8; INLINE_STACK]>;

/// Inline payload bytes an [`Inline`] holds in place (the emulation's records are 56).
pub(crate) const INLINE_STACK: usize = 64;

/// A hardware send-queue request (always signaled: see `cq.rs`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct HwWr {
    pub wr_id: u64,
    pub op: HwOp,
    pub sges: Sges,
    /// Inline payload copied at post time (the `sges` are ignored then).
    pub inline: Option<Inline>,
    pub fence: bool,
}

/// Requests of one `ibv_post_send` chain built on the stack; a longer chain (split reads
/// of a long scatter list) goes to the heap.
const CHAIN_STACK: usize = 4;

/// An rdma_cm identifier, with its queue pair once created.
#[derive(Debug)]
pub(crate) struct CmId {
    id: *mut sys::rdma_cm_id,
    has_qp: std::sync::atomic::AtomicBool,
}

// SAFETY: librdmacm identifiers and verbs queue pairs may be used from any thread; the
// owner serialises destruction (Drop).
unsafe impl Send for CmId {}
// SAFETY: as above.
unsafe impl Sync for CmId {}

/// The gather entries of a whole chain of requests (see [`gather_lists`]).
type ChainSges = SmallVec<[sys::ibv_sge; CHAIN_STACK * 2]>;

/// Where each request's entries lie in a [`ChainSges`]: (first, count).
type ChainSpans = SmallVec<[(usize, usize); CHAIN_STACK]>;

/// The gather lists of a chain of requests, all in one array (on the stack for a short
/// chain), and where each request's list lies in it: request `i` uses
/// `sges[spans[i].0..spans[i].0 + spans[i].1]`. An inline payload is one entry naming the
/// payload itself (no key: the device copies it at post time). No heap allocation for a
/// chain of up to [`CHAIN_STACK`] requests with two entries each.
fn gather_lists(wrs: &[HwWr]) -> (ChainSges, ChainSpans) {
    let mut sges = SmallVec::new();
    let mut spans = SmallVec::with_capacity(wrs.len());
    for w in wrs {
        let at = sges.len();
        match &w.inline {
            Some(data) if !data.is_empty() => sges.push(sys::ibv_sge {
                addr: data.as_ptr() as u64,
                length: data.len() as u32,
                lkey: 0,
            }),
            Some(_) => {}
            None => sges.extend(w.sges.iter().map(Sge::raw)),
        }
        spans.push((at, sges.len() - at));
    }
    (sges, spans)
}

/// Most gather entries the endpoint's direct path gives [`CmId::post_one`].
pub(crate) const ONE_SGES: usize = 4;

/// The flags of a hardware request: always signaled (see [`HwWr`]), inline and fenced as
/// asked.
fn send_flags(inline: bool, fence: bool) -> u32 {
    let mut flags = 2u32; // IBV_SEND_SIGNALED
    if inline {
        flags |= 8; // IBV_SEND_INLINE
    }
    if fence {
        flags |= 1; // IBV_SEND_FENCE
    }
    flags
}

/// Fills in a request's opcode, immediate data and remote operands for `op`.
fn fill_op(r: &mut sys::ibv_send_wr, op: HwOp) {
    use sys::ibv_wr_opcode as code;
    match op {
        HwOp::Send { imm } => {
            r.opcode = if imm.is_some() {
                code::IBV_WR_SEND_WITH_IMM
            } else {
                code::IBV_WR_SEND
            };
            r.imm_data_invalidated_rkey_union.imm_data = imm.unwrap_or(0).to_be();
        }
        HwOp::Write { addr, rkey, imm } => {
            r.opcode = if imm.is_some() {
                code::IBV_WR_RDMA_WRITE_WITH_IMM
            } else {
                code::IBV_WR_RDMA_WRITE
            };
            r.imm_data_invalidated_rkey_union.imm_data = imm.unwrap_or(0).to_be();
            r.wr.rdma = sys::rdma_t {
                remote_addr: addr,
                rkey,
            };
        }
        HwOp::Read { addr, rkey } => {
            r.opcode = code::IBV_WR_RDMA_READ;
            r.wr.rdma = sys::rdma_t {
                remote_addr: addr,
                rkey,
            };
        }
        HwOp::FetchAdd { addr, rkey, add } => {
            r.opcode = code::IBV_WR_ATOMIC_FETCH_AND_ADD;
            r.wr.atomic = sys::atomic_t {
                remote_addr: addr,
                compare_add: add,
                swap: 0,
                rkey,
            };
        }
        HwOp::CompareSwap {
            addr,
            rkey,
            compare,
            swap,
        } => {
            r.opcode = code::IBV_WR_ATOMIC_CMP_AND_SWP;
            r.wr.atomic = sys::atomic_t {
                remote_addr: addr,
                compare_add: compare,
                swap,
                rkey,
            };
        }
    }
}

/// A post's error as an `io::Error` (`ibv_post_send` and `ibv_post_recv` return an errno,
/// positive or negative by device library).
fn post_errno(rc: i32) -> io::Error {
    io::Error::from_raw_os_error(rc.abs())
}

impl CmId {
    pub fn new(ch: &EventChannel) -> io::Result<CmId> {
        let mut id = ptr::null_mut();
        // SAFETY: the channel is live; `id` is a valid out-pointer.
        check(unsafe {
            sys::rdma_create_id(
                ch.0,
                &mut id,
                ptr::null_mut(),
                sys::rdma_port_space::RDMA_PS_TCP,
            )
        })?;
        Ok(CmId {
            id,
            has_qp: false.into(),
        })
    }

    /// Adopts the identifier of a connection request.
    ///
    /// # Safety
    /// `raw` must be the `id` of a connection-request event not adopted before.
    pub unsafe fn adopt(raw: usize) -> CmId {
        CmId {
            id: raw as *mut sys::rdma_cm_id,
            has_qp: false.into(),
        }
    }

    /// The raw identifier, as events name it.
    pub fn key(&self) -> usize {
        self.id as usize
    }

    /// The device context the identifier is bound to (after address resolution or bind).
    pub fn ctx(&self) -> Option<Ctx> {
        // SAFETY: the identifier is live.
        let v = unsafe { (*self.id).verbs };
        (!v.is_null()).then_some(Ctx(v))
    }

    pub fn bind(&self, addr: SocketAddr) -> io::Result<()> {
        let mut a = CSockAddr::new(addr);
        // SAFETY: the identifier is live; the address is valid for the call.
        check(unsafe { sys::rdma_bind_addr(self.id, a.as_ptr()) })
    }

    pub fn listen(&self, backlog: i32) -> io::Result<()> {
        // SAFETY: the identifier is live and bound.
        check(unsafe { sys::rdma_listen(self.id, backlog) })
    }

    pub fn resolve_addr(
        &self,
        src: Option<SocketAddr>,
        dst: SocketAddr,
        timeout: Duration,
    ) -> io::Result<()> {
        let mut s = src.map(CSockAddr::new);
        let mut d = CSockAddr::new(dst);
        let sp = s.as_mut().map_or(ptr::null_mut(), |s| s.as_ptr());
        // SAFETY: the identifier is live; the addresses are valid for the call.
        check(unsafe {
            sys::rdma_resolve_addr(
                self.id,
                sp,
                d.as_ptr(),
                timeout.as_millis().clamp(1, 60_000) as i32,
            )
        })
    }

    pub fn resolve_route(&self, timeout: Duration) -> io::Result<()> {
        // SAFETY: the identifier is live.
        check(unsafe {
            sys::rdma_resolve_route(self.id, timeout.as_millis().clamp(1, 60_000) as i32)
        })
    }

    /// Sets the IP type of service (traffic class for RoCE v2).
    pub fn set_tos(&self, tos: u8) -> io::Result<()> {
        let mut v = tos;
        // SAFETY: the identifier is live; option RDMA_OPTION_ID (0) / RDMA_OPTION_ID_TOS
        // (0) takes one byte.
        check(unsafe { sys::rdma_set_option(self.id, 0, 0, (&mut v as *mut u8).cast(), 1) })
    }

    /// Sets the local ACK timeout of the identifier's RC queue pair: 4.096 us x
    /// 2^`timeout` per transmission before the device retries (InfiniBand transports;
    /// rdma_cm's `RDMA_OPTION_ID_ACK_TIMEOUT`). Before `rdma_resolve_route` on the active
    /// side (RoCE then derives the path's packet lifetime from it too), before
    /// `rdma_accept` on the passive side.
    pub fn set_ack_timeout(&self, timeout: u8) -> io::Result<()> {
        let mut v = timeout;
        // SAFETY: the identifier is live; option RDMA_OPTION_ID (0) /
        // RDMA_OPTION_ID_ACK_TIMEOUT (3) takes one byte (librdmacm copies it).
        check(unsafe { sys::rdma_set_option(self.id, 0, 3, (&mut v as *mut u8).cast(), 1) })
    }

    /// Creates the RC queue pair of this identifier; returns the sizes granted.
    pub fn create_qp(
        &mut self,
        pd: &Pd,
        send_cq: &HwCq,
        recv_cq: &HwCq,
        caps: QpCaps,
    ) -> io::Result<QpCaps> {
        // SAFETY: all-zero is a valid init attribute, filled in below.
        let mut ia: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        ia.send_cq = send_cq.raw();
        ia.recv_cq = recv_cq.raw();
        ia.qp_type = sys::ibv_qp_type::IBV_QPT_RC;
        ia.sq_sig_all = 0;
        ia.cap.max_send_wr = caps.send_wr;
        ia.cap.max_recv_wr = caps.recv_wr;
        ia.cap.max_send_sge = caps.send_sge;
        ia.cap.max_recv_sge = caps.recv_sge;
        ia.cap.max_inline_data = caps.inline;
        // SAFETY: identifier, PD and CQs are live; the QP is destroyed in Drop before the
        // identifier, and the owner keeps PD and CQs alive longer.
        check(unsafe { sys::rdma_create_qp(self.id, pd.ptr, &mut ia) })?;
        self.has_qp
            .store(true, std::sync::atomic::Ordering::Release);
        Ok(QpCaps {
            send_wr: ia.cap.max_send_wr,
            recv_wr: ia.cap.max_recv_wr,
            send_sge: ia.cap.max_send_sge,
            recv_sge: ia.cap.max_recv_sge,
            inline: ia.cap.max_inline_data,
        })
    }

    fn qp(&self) -> *mut sys::ibv_qp {
        // SAFETY: the identifier is live.
        unsafe { (*self.id).qp }
    }

    pub fn qp_num(&self) -> u32 {
        // SAFETY: only called after create_qp; the QP is live.
        unsafe { (*self.qp()).qp_num }
    }

    pub fn connect(&self, p: &ConnParam<'_>) -> io::Result<()> {
        let mut raw = p.raw();
        // SAFETY: identifier live; the parameters (and private data) are valid for the call.
        check(unsafe { sys::rdma_connect(self.id, &mut raw) })
    }

    pub fn accept(&self, p: &ConnParam<'_>) -> io::Result<()> {
        let mut raw = p.raw();
        // SAFETY: as in connect.
        check(unsafe { sys::rdma_accept(self.id, &mut raw) })
    }

    pub fn reject(&self) {
        // SAFETY: identifier live; no private data.
        let _ = unsafe { sys::rdma_reject(self.id, ptr::null(), 0) };
    }

    pub fn disconnect(&self) -> io::Result<()> {
        // SAFETY: identifier live.
        check(unsafe { sys::rdma_disconnect(self.id) })
    }

    /// The local socket address.
    pub fn local_addr(&self) -> Option<SocketAddr> {
        // SAFETY: the identifier is live; the route's source address is a sockaddr.
        unsafe { sockaddr_to_std(ptr::addr_of!((*self.id).route.addr.src_addr_union.src_addr)) }
    }

    /// The peer's socket address.
    pub fn peer_addr(&self) -> Option<SocketAddr> {
        // SAFETY: as above, destination address.
        unsafe { sockaddr_to_std(ptr::addr_of!((*self.id).route.addr.dst_addr_union.dst_addr)) }
    }

    /// The queue pair's state (`ibv_qp_state`).
    pub fn qp_state(&self) -> io::Result<u32> {
        // SAFETY: all-zero is valid for both structs.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        let mut init: sys::ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        // SAFETY: the QP is live; out-pointers valid.
        check(unsafe {
            sys::ibv_query_qp(
                self.qp(),
                &mut attr,
                sys::ibv_qp_attr_mask::IBV_QP_STATE.0 as i32,
                &mut init,
            )
        })?;
        Ok(attr.qp_state)
    }

    /// Sets the RNR NAK timer this side advertises (RTS to RTS).
    pub fn set_min_rnr_timer(&self, timer: u8) -> io::Result<()> {
        // SAFETY: all-zero is valid.
        let mut attr: sys::ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.min_rnr_timer = timer;
        // SAFETY: the QP is live.
        check(unsafe {
            sys::ibv_modify_qp(
                self.qp(),
                &mut attr,
                sys::ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER.0 as i32,
            )
        })
    }

    /// Posts a chain of send-queue requests. On failure returns how many were posted
    /// before the bad one, and the error.
    ///
    /// # Safety
    /// Every non-inline `Sge` must name memory registered under its `lkey` that stays
    /// alive until the request completes or the queue pair is destroyed.
    pub unsafe fn post_send(&self, wrs: &[HwWr]) -> Result<(), (usize, io::Error)> {
        if wrs.is_empty() {
            return Ok(());
        }
        let (mut sges, spans) = gather_lists(wrs);
        // SAFETY: all-zero is a valid (empty) send request; each is filled in below.
        let mut raw: SmallVec<[sys::ibv_send_wr; CHAIN_STACK]> = (0..wrs.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let sge_base = sges.as_mut_ptr();
        for (i, w) in wrs.iter().enumerate() {
            let r = &mut raw[i];
            r.wr_id = w.wr_id;
            let (at, n) = spans[i];
            r.sg_list = if n == 0 {
                ptr::null_mut()
            } else {
                // SAFETY: `at + n <= sges.len()` (`gather_lists` pushed the span); `sges`
                // is not moved or grown before `ibv_post_send` returns.
                unsafe { sge_base.add(at) }
            };
            r.num_sge = n as i32;
            r.send_flags = send_flags(w.inline.is_some(), w.fence);
            fill_op(r, w.op);
        }
        let base = raw.as_mut_ptr();
        for i in 0..raw.len() - 1 {
            // SAFETY: `i + 1` is inside `raw`; the chain lives until the call returns.
            raw[i].next = unsafe { base.add(i + 1) };
        }
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live; the chain and its sge arrays outlive the call; the
        // caller guarantees the named memory outlives the requests.
        let rc = unsafe { sys::ibv_post_send(self.qp(), base, &mut bad) };
        if rc == 0 {
            return Ok(());
        }
        let posted = if bad.is_null() {
            0
        } else {
            (bad as usize - base as usize) / std::mem::size_of::<sys::ibv_send_wr>()
        };
        Err((posted, post_errno(rc)))
    }

    /// Posts one request, built on the stack from its parts: the endpoint's direct path
    /// (no chain, no [`HwWr`]). An inline request names its payload where it lies: the
    /// device library copies it during the call, as it copies an [`Inline`] for
    /// [`post_send`](Self::post_send).
    ///
    /// # Safety
    /// At most [`ONE_SGES`] entries. Each names memory registered in this domain that stays
    /// alive until the request completes or the queue pair is destroyed (inline: during
    /// the call). Inlined into the direct path: a call less on every request's way.
    #[inline(always)]
    pub unsafe fn post_one(
        &self,
        wr_id: u64,
        op: HwOp,
        sges: &[Sge],
        inline: bool,
        fence: bool,
    ) -> io::Result<()> {
        debug_assert!(sges.len() <= ONE_SGES);
        // SAFETY: all-zero is a valid (empty) send request; filled in below.
        let mut r: sys::ibv_send_wr = unsafe { std::mem::zeroed() };
        r.wr_id = wr_id;
        r.sg_list = sg_list(sges);
        r.num_sge = sges.len() as i32;
        r.send_flags = send_flags(inline, fence);
        fill_op(&mut r, op);
        let mut bad: *mut sys::ibv_send_wr = ptr::null_mut();
        // SAFETY: the QP is live; `r` and `sges` outlive the call (the library only reads
        // the list); the caller guarantees the named memory outlives the request.
        let rc = unsafe { sys::ibv_post_send(self.qp(), &mut r, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(post_errno(rc))
        }
    }

    /// Posts one receive.
    ///
    /// # Safety
    /// The `sges` must name memory registered (LOCAL_WRITE) under their keys that stays
    /// alive until the receive completes or the queue pair is destroyed.
    #[inline(always)]
    pub unsafe fn post_recv(&self, wr_id: u64, sges: &[Sge]) -> io::Result<()> {
        let mut wr = sys::ibv_recv_wr {
            wr_id,
            next: ptr::null_mut(),
            sg_list: sg_list(sges),
            num_sge: sges.len() as i32,
        };
        let mut bad = ptr::null_mut();
        // SAFETY: the QP is live; `wr` and `sges` outlive the call (the library only reads
        // the list); the caller guarantees the memory outlives the receive.
        let rc = unsafe { sys::ibv_post_recv(self.qp(), &mut wr, &mut bad) };
        if rc == 0 {
            Ok(())
        } else {
            Err(post_errno(rc))
        }
    }

    /// Destroys the queue pair now (idempotent). After this no request of it touches memory.
    pub fn destroy_qp(&self) {
        if self.has_qp.swap(false, std::sync::atomic::Ordering::AcqRel) {
            // SAFETY: created by create_qp, destroyed once (the flag is swapped atomically).
            unsafe { sys::rdma_destroy_qp(self.id) };
        }
    }
}

impl Drop for CmId {
    fn drop(&mut self) {
        self.destroy_qp();
        // SAFETY: destroyed once; every event for it was acknowledged when read.
        let rc = unsafe { sys::rdma_destroy_id(self.id) };
        if rc != 0 {
            tracing::warn!("rdma_destroy_id failed: {}", last_err());
        }
    }
}

/// `ibv_qp_state` error value.
pub(crate) const QPS_ERR: u32 = 6;

// ----- the kernel TCP socket under an iWARP connection ------------------------------------

/// How long ago the TCP socket from `local` to `peer` last received a segment from its
/// peer: the smaller of `tcp_info`'s `tcpi_last_ack_recv` and `tcpi_last_data_recv`, asked
/// of the kernel through `NETLINK_SOCK_DIAG` (`inet_diag`, an exact lookup by address and
/// port). It finds the kernel's own sockets too, such as the one siw runs a connection
/// over, in this process's network namespace. `None` when the socket is not found or the
/// kernel cannot answer (no `inet_diag`).
pub(crate) fn tcp_last_heard(local: SocketAddr, peer: SocketAddr) -> Option<Duration> {
    use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
    const NETLINK_SOCK_DIAG: i32 = 4;
    const SOCK_DIAG_BY_FAMILY: u16 = 20;
    const NLM_F_REQUEST: u16 = 1;
    const INET_DIAG_INFO: u16 = 2;
    /// `struct nlmsghdr` (16) + `struct inet_diag_req_v2` (8 + a 48-byte sockid).
    const REQ_LEN: u32 = 72;
    /// `struct inet_diag_msg`: what precedes the attributes of an answer.
    const DIAG_MSG_LEN: usize = 72;
    let family = match (local, peer) {
        (SocketAddr::V4(_), SocketAddr::V4(_)) => libc::AF_INET,
        (SocketAddr::V6(_), SocketAddr::V6(_)) => libc::AF_INET6,
        _ => return None,
    };
    let mut req = Vec::with_capacity(REQ_LEN as usize);
    req.extend(REQ_LEN.to_ne_bytes());
    req.extend(SOCK_DIAG_BY_FAMILY.to_ne_bytes());
    req.extend(NLM_F_REQUEST.to_ne_bytes());
    req.extend(1u32.to_ne_bytes()); // sequence
    req.extend(0u32.to_ne_bytes()); // port id: the kernel assigns
    req.extend([
        family as u8,
        libc::IPPROTO_TCP as u8,
        1 << (INET_DIAG_INFO - 1),
        0,
    ]);
    req.extend(u32::MAX.to_ne_bytes()); // every TCP state
    req.extend(local.port().to_be_bytes());
    req.extend(peer.port().to_be_bytes());
    for a in [local.ip(), peer.ip()] {
        let mut b = [0u8; 16];
        match a {
            IpAddr::V4(a) => b[..4].copy_from_slice(&a.octets()),
            IpAddr::V6(a) => b = a.octets(),
        }
        req.extend(b);
    }
    req.extend(0u32.to_ne_bytes()); // any interface
    req.extend([0xff; 8]); // INET_DIAG_NOCOOKIE
    debug_assert_eq!(req.len(), REQ_LEN as usize);
    // SAFETY: socket(2) with constant arguments; the descriptor is owned just below.
    let fd = unsafe {
        libc::socket(
            libc::AF_NETLINK,
            libc::SOCK_DGRAM | libc::SOCK_CLOEXEC,
            NETLINK_SOCK_DIAG,
        )
    };
    if fd < 0 {
        return None;
    }
    // SAFETY: `fd` is a descriptor just created that nothing else owns.
    let fd = unsafe { OwnedFd::from_raw_fd(fd) };
    let tv = libc::timeval {
        tv_sec: 1,
        tv_usec: 0,
    };
    // SAFETY: `tv` is a valid timeval for the length given; `fd` is open.
    let rc = unsafe {
        libc::setsockopt(
            fd.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_RCVTIMEO,
            (&tv as *const libc::timeval).cast(),
            std::mem::size_of::<libc::timeval>() as libc::socklen_t,
        )
    };
    if rc != 0 {
        return None;
    }
    // SAFETY: `req` is valid for reads of its length; an unconnected netlink socket sends
    // to the kernel.
    let sent = unsafe { libc::send(fd.as_raw_fd(), req.as_ptr().cast(), req.len(), 0) };
    if sent != req.len() as isize {
        return None;
    }
    let mut buf = vec![0u8; 8192];
    // SAFETY: `buf` is valid for writes of its length.
    let n = unsafe { libc::recv(fd.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), 0) };
    let n = usize::try_from(n).ok()?;
    let u16_at = |b: &[u8], o: usize| Some(u16::from_ne_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |b: &[u8], o: usize| Some(u32::from_ne_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let msg = buf.get(..n)?;
    let len = (u32_at(msg, 0)? as usize).min(msg.len());
    if u16_at(msg, 4)? != SOCK_DIAG_BY_FAMILY {
        return None; // NLMSG_ERROR: no such socket (or no inet_diag)
    }
    let mut at = 16 + DIAG_MSG_LEN;
    while at + 4 <= len {
        let rta_len = u16_at(msg, at)? as usize;
        if rta_len < 4 {
            return None;
        }
        if u16_at(msg, at + 2)? == INET_DIAG_INFO {
            // `struct tcp_info`: tcpi_last_data_recv at 52, tcpi_last_ack_recv at 56 (ms).
            let info = msg.get(at + 4..at + rta_len)?;
            let ms = u32_at(info, TCPI_LAST_DATA_RECV)?.min(u32_at(info, TCPI_LAST_ACK_RECV)?);
            return Some(Duration::from_millis(u64::from(ms)));
        }
        at += (rta_len + 3) & !3;
    }
    None
}

/// Offset of `tcpi_last_data_recv` in `struct tcp_info`.
const TCPI_LAST_DATA_RECV: usize = 52;
/// Offset of `tcpi_last_ack_recv` in `struct tcp_info`.
const TCPI_LAST_ACK_RECV: usize = 56;

#[cfg(all(test, not(loom)))]
mod tcp_tests {
    use super::*;

    #[test]
    fn tcp_info_offsets_match_the_c_layout() {
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_last_data_recv),
            TCPI_LAST_DATA_RECV
        );
        assert_eq!(
            std::mem::offset_of!(libc::tcp_info, tcpi_last_ack_recv),
            TCPI_LAST_ACK_RECV
        );
    }

    #[test]
    fn last_heard_finds_a_connected_socket_and_not_an_unknown_one() {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let c = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (_s, _) = l.accept().unwrap();
        let (local, peer) = (c.local_addr().unwrap(), c.peer_addr().unwrap());
        match tcp_last_heard(local, peer) {
            Some(d) => assert!(d < Duration::from_secs(60), "{d:?}"),
            // A kernel without inet_diag (or a sandbox refusing netlink) answers nothing.
            None => eprintln!("inet_diag unavailable here: the probe falls back to completions"),
        }
        let gone = SocketAddr::from(([127, 0, 0, 1], 1));
        assert_eq!(tcp_last_heard(local, gone), None);
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn a_failure_that_left_errno_at_zero_does_not_read_as_success() {
        let set = |v: i32| {
            // SAFETY: errno is this thread's own variable; writing it is what C code does.
            #[allow(unsafe_code)]
            unsafe {
                *libc::__errno_location() = v
            }
        };
        set(0);
        let e = check(-1).expect_err("-1 is a failure");
        assert_eq!(e.raw_os_error(), None, "{e}");
        assert!(e.to_string().contains("without an errno"), "{e}");
        set(libc::EINVAL);
        let e = check(-1).expect_err("-1 is a failure");
        assert_eq!(e.raw_os_error(), Some(libc::EINVAL));
    }

    fn wr(sges: &[Sge], inline: Option<&[u8]>) -> HwWr {
        HwWr {
            wr_id: 0,
            op: HwOp::Send { imm: None },
            sges: Sges::from_slice(sges),
            inline: inline.map(Inline::from_slice),
            fence: false,
        }
    }

    #[test]
    fn a_chain_s_gather_lists_share_one_array_and_stay_on_the_stack_when_short() {
        let sge = |addr, len| Sge { addr, len, lkey: 7 };
        let chain = [
            wr(&[sge(0x1000, 8)], None),
            wr(&[], Some(&[1, 2, 3])),
            wr(&[], None),
            wr(&[sge(0x2000, 4), sge(0x3000, 5)], None),
        ];
        let (sges, spans) = gather_lists(&chain);
        assert_eq!(&spans[..], &[(0, 1), (1, 1), (2, 0), (2, 2)]);
        let flat: Vec<_> = sges.iter().map(|s| (s.addr, s.length, s.lkey)).collect();
        let inline = chain[1].inline.as_ref().expect("inline").as_ptr() as u64;
        assert_eq!(
            flat,
            [
                (0x1000, 8, 7),
                (inline, 3, 0),
                (0x2000, 4, 7),
                (0x3000, 5, 7)
            ]
        );
        assert!(!sges.spilled() && !spans.spilled());
        // An empty inline payload names nothing.
        let (sges, spans) = gather_lists(&[wr(&[], Some(&[]))]);
        assert!(sges.is_empty());
        assert_eq!(&spans[..], &[(0, 0)]);
    }
}
