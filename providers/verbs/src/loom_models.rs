//! loom models of the lock protocol between a completion queue, its internal-slot ledger
//! and the endpoints reporting into it.
//!
//! The queue is the real [`CqInner`] (slot ledger, reaping, draining, polling, ranked
//! lock) over a model device queue; the endpoint is a model of `EpCore`'s credit path that
//! follows its protocol step for step (`post_recv`, `send_credit`, `retry_blocked`, the
//! completion handler), with its ledger behind the real ranked endpoint lock. Run with:
//!
//! ```sh
//! CARGO_TARGET_DIR=target/loom RUSTFLAGS="--cfg loom" cargo test -p fabric-verbs --release --lib loom
//! ```
//!
//! The path that deadlocked: the RNR thread retries an owed credit update while every
//! internal slot is held by a credit update whose completion waits in the device queue;
//! getting a slot means reaping, and the drain calls back into the same endpoint. The
//! models run it against the application polling and posting receives at the same time.
//! `old_order_*` keep the old protocol (reaping with the endpoint lock held) and must fail:
//! by the order check, and, with the check off, by loom's own deadlock detection.
//!
//! The dead-peer path of iWARP domains (`EpCore::check_liveness`, `EpCore::declare_dead`)
//! runs on the same helper thread and follows the same order: it reaps with no endpoint
//! lock held, posts a probe under the ledger's lock only if an internal slot is free, and
//! declares death under the ledger's lock alone before taking the queue's lock and then
//! the ledger's again. `liveness_probe_and_death_*` runs it against the application
//! polling and posting a receive, and checks that every slot comes back.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use loom::sync::Mutex;
use loom::thread;

use crate::cq::{CompletionTarget, CqInner, CqState, DeviceQueue};
use crate::ffi::Wc;
use crate::sync::{Rank, Ranked};

/// The device's completion queue: what the "hardware" completed, not yet drained. Its
/// lock is a leaf (the real device queue is lock-free to the core).
#[derive(Debug, Default)]
struct ModelDevice {
    q: Mutex<VecDeque<Wc>>,
}

impl ModelDevice {
    /// The device completes a request (at once: the completion waits to be drained).
    fn complete(&self, qp_num: u32, wr_id: u64) {
        self.q.lock().unwrap().push_back(Wc {
            wr_id,
            status: 0,
            opcode: 0,
            vendor_err: 0,
            byte_len: 0,
            imm: None,
            qp_num,
        });
    }
}

impl DeviceQueue for ModelDevice {
    fn poll(&self, out: &mut [Wc]) -> std::io::Result<usize> {
        let mut q = self.q.lock().unwrap();
        let n = q.len().min(out.len());
        for (o, wc) in out.iter_mut().zip(q.drain(..n)) {
            *o = wc;
        }
        Ok(n)
    }
}

type Cq = CqInner<ModelDevice, ModelEp>;

/// The credit part of `EpCore`'s ledger.
#[derive(Debug, Default)]
struct Ledger {
    /// Credit updates posted and not completed (by request id): each holds an internal
    /// slot until its completion is drained.
    outstanding: Vec<u64>,
    next_seq: u64,
    /// Receives ever posted.
    recvs_posted: u64,
    /// The value of the last credit update posted (what the peer will know).
    advertised: u64,
    /// A credit update is owed.
    credit_dirty: bool,
    /// Liveness probes posted (the dead-peer path).
    probes: u64,
    /// Declared dead (`EpCore::declare_dead`): nothing is posted any more, and
    /// completions of requests the provider already retired are ignored.
    dead: bool,
}

/// An endpoint of the model: `EpCore`'s credit path.
#[derive(Debug)]
struct ModelEp {
    qpn: u32,
    send_cq: Arc<Cq>,
    st: Ranked<Ledger>,
    /// The thread reaping in `retry_blocked` (instrumentation, not a loom object).
    reaper: std::sync::Mutex<Option<thread::ThreadId>>,
}

/// Executions in which the RNR thread's reap drained a completion into the endpoint it
/// was retrying for: the path that deadlocked (instrumentation: the models assert they
/// reach it).
static REAP_INTO_SELF: AtomicUsize = AtomicUsize::new(0);
/// Executions explored.
static EXECUTIONS: AtomicUsize = AtomicUsize::new(0);

impl ModelEp {
    fn new(send_cq: &Arc<Cq>, qpn: u32) -> Arc<ModelEp> {
        let ep = Arc::new(ModelEp {
            qpn,
            send_cq: send_cq.clone(),
            st: Ranked::new(Rank::Endpoint, Ledger::default()),
            reaper: std::sync::Mutex::new(None),
        });
        send_cq.lock().qps.insert(qpn, ep.clone());
        ep
    }

    /// `EpCore::post_credit`: needs an internal slot already reserved.
    fn post_credit(&self, l: &mut Ledger) {
        let seq = l.next_seq;
        l.next_seq += 1;
        l.outstanding.push(seq);
        l.advertised = l.recvs_posted;
        l.credit_dirty = false;
        self.send_cq.hw.complete(self.qpn, seq);
    }

    /// `EpCore::post_recv`'s credit path: under the ledger's lock the update is sent if an
    /// internal slot is free (`send_credit`, never reaping); short of one, the queue is
    /// reaped with the ledger's lock released, and the update tried once more. Returns
    /// whether it reaped (instrumentation).
    fn post_recv(&self) -> bool {
        let mut l = self.st.lock();
        if l.dead {
            return false; // InvalidState
        }
        l.recvs_posted += 1;
        l.credit_dirty = true;
        if !self.send_credit(&mut l) {
            return false;
        }
        drop(l);
        self.send_cq.reap();
        let mut l = self.st.lock();
        self.send_credit(&mut l);
        true
    }

    /// `EpCore::send_credit`: never reaps (the ledger's lock is held); true when the
    /// update is still owed for lack of a slot.
    fn send_credit(&self, l: &mut Ledger) -> bool {
        if !l.credit_dirty || l.dead {
            return false;
        }
        if !self.send_cq.reserve_internal(1) {
            return true;
        }
        self.post_credit(l);
        false
    }

    /// `EpCore::retry_blocked`: reaps with the ledger's lock released.
    fn retry_blocked(&self) -> bool {
        for reaped in [false, true] {
            let mut l = self.st.lock();
            let short = self.send_credit(&mut l);
            if !short || reaped {
                return l.credit_dirty;
            }
            drop(l);
            *self.reaper.lock().unwrap() = Some(thread::current().id());
            self.send_cq.reap();
            *self.reaper.lock().unwrap() = None;
        }
        unreachable!("the second pass returns")
    }

    /// `EpCore::check_liveness` on a quiet endpoint: reap with no endpoint lock held, then
    /// post a probe under the ledger's lock if an internal slot is free (never reaping).
    fn check_liveness(&self) {
        *self.reaper.lock().unwrap() = Some(thread::current().id());
        self.send_cq.reap();
        *self.reaper.lock().unwrap() = None;
        let mut l = self.st.lock();
        if l.dead || !self.send_cq.reserve_internal(1) {
            return;
        }
        let seq = l.next_seq;
        l.next_seq += 1;
        l.outstanding.push(seq);
        l.probes += 1;
        self.send_cq.hw.complete(self.qpn, seq);
    }

    /// `EpCore::declare_dead`: under the ledger's lock alone, mark the endpoint dead and
    /// take its records (the queue pair is destroyed there); then, queue lock first,
    /// drain (completions of taken records are ignored) and retire the records, giving
    /// their slots back.
    fn declare_dead(&self) {
        let taken = {
            let mut l = self.st.lock();
            l.dead = true;
            l.credit_dirty = false;
            std::mem::take(&mut l.outstanding)
        };
        let mut st = self.send_cq.lock();
        self.send_cq.drain(&mut st);
        let _l = self.st.lock();
        self.send_cq.release_internal(taken.len());
    }

    /// The old `retry_blocked`: `send_credit(reap = true)` under the ledger's lock.
    fn retry_blocked_old_order(&self) -> bool {
        let mut l = self.st.lock();
        if l.credit_dirty && self.send_cq.reserve_internal_reaping(1) {
            self.post_credit(&mut l);
        }
        l.credit_dirty
    }

    /// A receive posted while every slot is taken and nothing completed yet: the
    /// update is owed (`post_recv` when reaping found nothing).
    fn recv_without_slot(&self) {
        let mut l = self.st.lock();
        l.recvs_posted += 1;
        l.credit_dirty = true;
    }
}

impl CompletionTarget<ModelDevice> for ModelEp {
    /// `EpCore::handle_completion` for an internal request of the send queue: give the
    /// slot back, then send what is owed (no reaping: the queue's lock is held).
    fn on_completion(self: &Arc<Self>, cq: &Cq, _st: &mut CqState<ModelEp>, wc: &Wc) {
        if *self.reaper.lock().unwrap() == Some(thread::current().id()) {
            REAP_INTO_SELF.fetch_add(1, Ordering::Relaxed);
        }
        let mut l = self.st.lock();
        let Some(pos) = l.outstanding.iter().position(|s| *s == wc.wr_id) else {
            assert!(l.dead, "a completion for a request not outstanding");
            return;
        };
        l.outstanding.remove(pos);
        cq.release_internal(1);
        self.send_credit(&mut l);
    }
}

/// A send queue with one internal slot, held by a credit update whose completion waits
/// in the device queue, and a credit update owed: the state the RNR thread deadlocked in.
fn exhausted_with_credit_owed() -> (Arc<Cq>, Arc<ModelEp>) {
    EXECUTIONS.fetch_add(1, Ordering::Relaxed);
    let cq = Arc::new(Cq::new(ModelDevice::default(), 4, 1).expect("eventfd"));
    let ep = ModelEp::new(&cq, 7);
    assert!(!ep.post_recv(), "a slot was free");
    ep.recv_without_slot();
    assert_eq!(cq.internal_in_use(), 1);
    (cq, ep)
}

/// What must hold once everything settled: every slot back, every receive advertised,
/// and nothing left for the application (credit updates are the provider's own).
fn settle_and_check(cq: &Arc<Cq>, ep: &Arc<ModelEp>) {
    // The RNR thread keeps retrying while the endpoint says it is blocked.
    for _ in 0..3 {
        if !ep.retry_blocked() {
            break;
        }
    }
    cq.reap();
    let l = ep.st.lock();
    assert!(!l.credit_dirty, "a credit update is still owed: {l:?}");
    assert_eq!(l.advertised, l.recvs_posted, "{l:?}");
    assert!(l.outstanding.is_empty(), "{l:?}");
    drop(l);
    assert_eq!(cq.internal_in_use(), 0, "internal slots leaked");
    assert_eq!(cq.reserved_in_use(), 0, "application slots leaked");
    let mut st = cq.lock();
    assert!(
        st.ready.is_empty(),
        "provider requests reached the application"
    );
    // Teardown: the queue forgets the endpoint (breaks the Arc cycle).
    st.qps.clear();
}

/// The RNR thread retries the owed update (reaping for a slot) while the application
/// polls the same queue: both drains call back into the endpoint.
/// Runs `model` and checks that it explored more than one execution and reached the
/// RNR thread's reap draining into its own endpoint.
fn explore(name: &str, model: impl FnOnce()) {
    let (e0, r0) = (
        EXECUTIONS.load(Ordering::Relaxed),
        REAP_INTO_SELF.load(Ordering::Relaxed),
    );
    model();
    let (e, r) = (
        EXECUTIONS.load(Ordering::Relaxed) - e0,
        REAP_INTO_SELF.load(Ordering::Relaxed) - r0,
    );
    println!("{name}: {e} executions; the RNR thread's reap drained {r} completions into its own endpoint");
    assert!(e > 1, "{name}: only {e} executions explored");
    assert!(
        r > 0,
        "{name}: never reached the reap draining into its own endpoint"
    );
}

#[test]
fn loom_retry_reaps_while_application_polls() {
    explore("retry_reaps_while_application_polls", || {
        loom::model(|| {
            let (cq, ep) = exhausted_with_credit_owed();
            let rnr = {
                let ep = ep.clone();
                thread::spawn(move || {
                    ep.retry_blocked();
                })
            };
            let app = {
                let cq = cq.clone();
                thread::spawn(move || {
                    let mut out = Vec::new();
                    cq.poll_ready(&mut out, 4);
                    assert!(out.is_empty());
                })
            };
            rnr.join().unwrap();
            app.join().unwrap();
            settle_and_check(&cq, &ep);
        })
    });
}

/// As above, with the application also posting a receive (whose credit update finds no
/// slot free: it reaps the send queue with the endpoint lock released, then tries again).
#[test]
fn loom_retry_reaps_while_application_polls_and_posts() {
    // Exhaustive (no preemption bound): some 27 000 executions, seconds in release.
    let reaped = Arc::new(AtomicUsize::new(0));
    let counted = reaped.clone();
    explore("retry_reaps_while_application_polls_and_posts", || {
        loom::model(move || {
            let (cq, ep) = exhausted_with_credit_owed();
            let rnr = {
                let ep = ep.clone();
                thread::spawn(move || {
                    ep.retry_blocked();
                })
            };
            let app = {
                let cq = cq.clone();
                thread::spawn(move || {
                    let mut out = Vec::new();
                    cq.poll_ready(&mut out, 4);
                })
            };
            if ep.post_recv() {
                counted.fetch_add(1, Ordering::Relaxed);
            }
            rnr.join().unwrap();
            app.join().unwrap();
            settle_and_check(&cq, &ep);
        })
    });
    assert!(
        reaped.load(Ordering::Relaxed) > 0,
        "the receive's post never reaped for its credit update"
    );
}

/// The old protocol fails the order check (in every interleaving where the RNR thread
/// must reap: always, here, since the slot is taken until the queue is drained).
#[test]
#[should_panic(
    expected = "lock order violated: taking a completion-queue lock while holding an endpoint lock"
)]
fn loom_old_order_fails_the_order_check() {
    loom::model(|| {
        let (cq, ep) = exhausted_with_credit_owed();
        let rnr = {
            let ep = ep.clone();
            thread::spawn(move || {
                ep.retry_blocked_old_order();
            })
        };
        let app = {
            let cq = cq.clone();
            thread::spawn(move || {
                let mut out = Vec::new();
                cq.poll_ready(&mut out, 4);
            })
        };
        rnr.join().unwrap();
        app.join().unwrap();
        settle_and_check(&cq, &ep);
    });
}

/// The old protocol with the order check off: loom finds the deadlock itself (the RNR
/// thread waits for the endpoint lock it holds, the application for the queue's lock).
#[test]
#[should_panic(expected = "deadlock")]
fn loom_old_order_deadlocks() {
    loom::model(|| {
        let (cq, ep) = exhausted_with_credit_owed();
        let rnr = {
            let ep = ep.clone();
            thread::spawn(move || {
                crate::sync::unchecked();
                ep.retry_blocked_old_order();
            })
        };
        let app = {
            let cq = cq.clone();
            thread::spawn(move || {
                crate::sync::unchecked();
                let mut out = Vec::new();
                cq.poll_ready(&mut out, 4);
            })
        };
        rnr.join().unwrap();
        app.join().unwrap();
        settle_and_check(&cq, &ep);
    });
}

/// The dead-peer path against the application: the helper thread's liveness check (reap
/// with no endpoint lock, then a probe under the ledger's lock) and its declaration of
/// death (ledger lock alone, then queue lock and ledger lock) while the application polls
/// the queue and posts a receive. No order violation, no deadlock, every slot back.
#[test]
fn loom_liveness_probe_and_death_while_application_polls_and_posts() {
    explore(
        "liveness_probe_and_death_while_application_polls_and_posts",
        || {
            let mut b = loom::model::Builder::new();
            // Bounded to three preemptions (some thousands of executions, under a second in
            // release): unbounded it explores 1.9 million executions in about three
            // minutes, all passing (run once when the model was written).
            b.preemption_bound = Some(3);
            b.check(|| {
                let (cq, ep) = exhausted_with_credit_owed();
                let helper = {
                    let ep = ep.clone();
                    thread::spawn(move || {
                        ep.check_liveness();
                        ep.declare_dead();
                    })
                };
                let app = {
                    let cq = cq.clone();
                    thread::spawn(move || {
                        let mut out = Vec::new();
                        cq.poll_ready(&mut out, 4);
                    })
                };
                let _ = ep.post_recv();
                helper.join().unwrap();
                app.join().unwrap();
                assert!(!ep.retry_blocked(), "a dead endpoint owes nothing");
                cq.reap();
                let l = ep.st.lock();
                assert!(l.dead && l.outstanding.is_empty(), "{l:?}");
                drop(l);
                assert_eq!(cq.internal_in_use(), 0, "internal slots leaked");
                assert_eq!(cq.reserved_in_use(), 0, "application slots leaked");
                let mut st = cq.lock();
                assert!(
                    st.ready.is_empty(),
                    "provider requests reached the application"
                );
                st.qps.clear();
            })
        },
    );
}
