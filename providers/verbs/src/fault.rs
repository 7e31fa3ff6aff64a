//! Device refusals on demand, for the device tests (debug builds only).
//!
//! `ibv_post_send` refusing a chain, whole or after part of it reached the device, cannot be
//! provoked through the provider: it checks every request before posting, and rxe and siw
//! accept what passes those checks. So the ledger's handling of a refusal
//! (`post_next_group`: a synchronous post refused whole fails at once and leaves nothing
//! behind; the rest of a group refused after its first requests stays held back, as does
//! a held-back group refused whole, retried by the RNR thread instead of in a loop; a
//! refusal that lasts past the grace period fails the request and the endpoint) is
//! tested through this hook, on a real queue pair in the soft-RDMA guest
//! (`providers/verbs/testsuite/conn_items.rs`).
//!
//! The hook is process-wide: a test that arms it must be the only one posting meanwhile.
//!
//! The module also counts the requests the endpoints' direct path posted ([`direct_posts`]),
//! so that the device tests can tell which connections take it, and the protection domains
//! alive and those the device refused to free ([`protection_domains_kept`]).

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Mutex;

#[derive(Debug)]
struct Refusal {
    at: usize,
    errno: i32,
    left: usize,
    /// After the first refusal, refuse every chain whole (`at` 0).
    then_whole: bool,
}

static ARMED: AtomicBool = AtomicBool::new(false);
static PLAN: Mutex<Option<Refusal>> = Mutex::new(None);
static REFUSED: AtomicUsize = AtomicUsize::new(0);

/// From now on, `times` times, the device refuses the request at index `at` of a posted
/// chain longer than `at`, with `errno` (`ibv_post_send`'s return); the requests before it
/// reach the device. Shorter chains are posted as usual.
pub fn refuse_posts(at: usize, errno: i32, times: usize) {
    plan(at, errno, times, false);
}

/// Refuses the request at index `at` of the next chain longer than `at` (the requests
/// before it reach the device), then every chain whole, until [`stop`]: a device that
/// takes part of a group and then nothing more.
pub fn refuse_rest(at: usize, errno: i32) {
    plan(at, errno, usize::MAX, true);
}

fn plan(at: usize, errno: i32, times: usize, then_whole: bool) {
    let mut p = PLAN.lock().unwrap_or_else(|e| e.into_inner());
    *p = (times > 0).then_some(Refusal {
        at,
        errno,
        left: times,
        then_whole,
    });
    ARMED.store(times > 0, Ordering::SeqCst);
}

/// Stops refusing.
pub fn stop() {
    refuse_posts(0, 0, 0);
}

/// How many chains were refused so far in this process.
pub fn refused() -> usize {
    REFUSED.load(Ordering::SeqCst)
}

static DIRECT: AtomicUsize = AtomicUsize::new(0);

/// Requests the endpoints' direct path (`EpCore::post_direct`) posted so far in this
/// process.
pub fn direct_posts() -> usize {
    DIRECT.load(Ordering::SeqCst)
}

/// Counts one request the direct path posted.
pub(crate) fn note_direct() {
    DIRECT.fetch_add(1, Ordering::SeqCst);
}

static CONFIRMED: AtomicUsize = AtomicUsize::new(0);

/// Sends whose delivery the peer's completed-receive count confirmed, their delivery read
/// never posted (connections that count deliveries), so far in this process.
pub fn confirmed_by_count() -> usize {
    CONFIRMED.load(Ordering::SeqCst)
}

/// Counts one send confirmed by the peer's count.
pub(crate) fn note_confirmed() {
    CONFIRMED.fetch_add(1, Ordering::SeqCst);
}

static CREDIT_UPDATES: AtomicUsize = AtomicUsize::new(0);

/// Credit updates (writes of the peer's credit word) posted so far in this process.
pub fn credit_updates() -> usize {
    CREDIT_UPDATES.load(Ordering::SeqCst)
}

/// Counts one credit update posted.
pub(crate) fn note_credit_update() {
    CREDIT_UPDATES.fetch_add(1, Ordering::SeqCst);
}

static PDS: AtomicUsize = AtomicUsize::new(0);
static PDS_KEPT: AtomicUsize = AtomicUsize::new(0);

/// Protection domains allocated and not yet freed, in this process.
pub fn protection_domains() -> usize {
    PDS.load(Ordering::SeqCst)
}

/// Protection domains the device refused to free (something still used them: the kernel
/// answers EBUSY and the domain leaks), so far in this process.
pub fn protection_domains_kept() -> usize {
    PDS_KEPT.load(Ordering::SeqCst)
}

/// Counts a protection domain allocated.
pub(crate) fn note_pd_allocated() {
    PDS.fetch_add(1, Ordering::SeqCst);
}

/// Counts a protection domain given up, and whether the device freed it.
pub(crate) fn note_pd_dropped(freed: bool) {
    PDS.fetch_sub(1, Ordering::SeqCst);
    if !freed {
        PDS_KEPT.fetch_add(1, Ordering::SeqCst);
    }
}

/// Whether a refusal is planned: the endpoint's direct path steps aside for the ledger's,
/// which asks [`take`].
pub(crate) fn armed() -> bool {
    ARMED.load(Ordering::Relaxed)
}

/// For the ledger, about to post a chain of `len` requests: where the device refuses it,
/// and with which `errno`, if it does.
pub(crate) fn take(len: usize) -> Option<(usize, i32)> {
    if !ARMED.load(Ordering::Relaxed) {
        return None;
    }
    let mut p = PLAN.lock().unwrap_or_else(|e| e.into_inner());
    let r = p.as_mut().filter(|r| r.at < len)?;
    let out = (r.at, r.errno);
    if r.then_whole {
        r.at = 0;
    }
    r.left -= 1;
    if r.left == 0 {
        *p = None;
        ARMED.store(false, Ordering::SeqCst);
    }
    REFUSED.fetch_add(1, Ordering::SeqCst);
    Some(out)
}

/// What libsiw makes of a queue mapped at its "no mapping" sentinel (see
/// `Profile::mmap_sentinel_guard`), on two private contexts of `device`: one-page CQs are
/// created until one maps at the sentinel's offset, first on a bare context, then on one
/// holding the domain's guard CQ. Each field is the index of the first CQ that failed, if
/// one did: on Linux 6.1's siw the bare context fails exactly at the sentinel's page, and
/// the guarded one does not fail.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SentinelCheck {
    /// The first CQ that failed on the bare context.
    pub bare: Option<usize>,
    /// The first CQ that failed on the guarded context.
    pub guarded: Option<usize>,
    /// The index of the CQ that maps at the sentinel offset (0x90000 over the page size).
    pub sentinel_index: usize,
}

/// Runs the [`SentinelCheck`] on `device`.
pub fn mmap_sentinel(device: &str) -> std::io::Result<SentinelCheck> {
    Ok(SentinelCheck {
        bare: crate::ffi::fill_to_sentinel(device, false)?,
        guarded: crate::ffi::fill_to_sentinel(device, true)?,
        sentinel_index: crate::ffi::sentinel_page_index(),
    })
}
