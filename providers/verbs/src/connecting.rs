//! Connections set up without blocking the application (`spi::Domain::connect_start`):
//! the blocking connection setup of `connect`, run on a short-lived thread that hands its
//! endpoint over.

use std::fmt;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use fabric_api::spi::{self, EndpointConfig};
use fabric_api::{Error, ErrorKind, Notifier, Result};

use crate::cq::VerbsCq;
use crate::domain::VerbsDomain;
use crate::ep::VerbsEndpoint;
use crate::Flavor;

/// Where a connection made on a helper thread stands.
enum Slot<T> {
    /// The thread is still at it.
    Running,
    /// The thread's result, not taken yet.
    Done(Result<T>),
    /// The result was taken (or the time-out reported).
    Taken,
    /// Nobody will take it: the owner was dropped, or it reported the time-out. A result
    /// arriving now is dropped by the thread that made it.
    Abandoned,
}

/// The hand-over between the helper thread (`deliver`) and the connection's owner
/// (`poll`, `abandon`), with the level that makes the owner's descriptor readable once the
/// result is there. Generic so that its state machine is testable without a device.
pub(crate) struct Handoff<T> {
    slot: Mutex<Slot<T>>,
    ready: Notifier,
}

impl<T> Handoff<T> {
    /// A hand-over whose descriptor exists already (the only failure: no descriptor left).
    pub fn new() -> Result<Self> {
        let h = Handoff {
            slot: Mutex::new(Slot::Running),
            ready: Notifier::new(),
        };
        h.ready.fd()?;
        Ok(h)
    }

    fn slot(&self) -> MutexGuard<'_, Slot<T>> {
        self.slot.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The helper thread's result: kept for the owner (whose descriptor becomes readable),
    /// or dropped here when the owner abandoned the connection.
    pub fn deliver(&self, r: Result<T>) {
        let mut s = self.slot();
        if matches!(*s, Slot::Running) {
            *s = Slot::Done(r);
            drop(s);
            self.ready.raise();
        } else {
            drop(s);
            // Outside the lock: dropping an endpoint closes it.
            drop(r);
        }
    }

    /// The owner's poll: the result once (then `InvalidState`), `Ok(None)` while the
    /// thread runs, and `late()` once `deadline` passed without a result (the connection
    /// is abandoned then: a result that comes after is dropped).
    pub fn poll(&self, deadline: Instant, late: impl FnOnce() -> Error) -> Result<Option<T>> {
        let mut s = self.slot();
        match std::mem::replace(&mut *s, Slot::Taken) {
            Slot::Running if Instant::now() < deadline => {
                *s = Slot::Running;
                Ok(None)
            }
            Slot::Running => {
                *s = Slot::Abandoned;
                Err(late())
            }
            Slot::Done(r) => {
                drop(s);
                r.map(Some)
            }
            Slot::Taken | Slot::Abandoned => {
                *s = Slot::Abandoned;
                Err(Error::new(
                    ErrorKind::InvalidState,
                    "the connection attempt has finished already: its result was returned by an earlier poll",
                ))
            }
        }
    }

    /// The owner goes away: a result already there is dropped (outside the lock), one
    /// still to come is dropped by the thread that makes it.
    pub fn abandon(&self) {
        let old = std::mem::replace(&mut *self.slot(), Slot::Abandoned);
        drop(old);
    }

    /// The descriptor, readable once the result is there.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.ready
            .fd()
            .expect("the descriptor is made when the hand-over is")
    }
}

type OwnedConfig<F> = fabric_api::spi::OwnedEndpointConfig<VerbsCq<F>>;

/// A connection of a verbs provider being set up without blocking the application: what
/// [`connect_start`](spi::Domain::connect_start) returns.
///
/// Establishment runs on a short-lived provider thread (`fabric-cm-connect`), the same
/// blocking setup as [`connect`](spi::Domain::connect): rdma_cm's setup is a chain of steps
/// that each wait for an event (address and route resolution, the peer's accept), and
/// `rdma_connect` itself blocks in the kernel on iWARP (siw connects its TCP socket
/// synchronously, for minutes when nobody answers), so no step can be made from
/// [`poll`](spi::Connecting::poll) without blocking. The thread ends once the connection is
/// up or failed, around the deadline at the latest; it keeps the domain alive until then.
/// Its result is handed over to [`poll`](spi::Connecting::poll), and the descriptor
/// ([`AsFd`]) becomes readable when it is there.
///
/// Dropping an unfinished connection abandons it: the thread finishes on its own within
/// the timeout and drops (so closes) the endpoint it made. A poll after the
/// [`deadline`](spi::Connecting::deadline) without a result reports the time-out and
/// abandons the connection the same way.
pub struct VerbsConnecting<F: Flavor> {
    handoff: Arc<Handoff<VerbsEndpoint<F>>>,
    addr: SocketAddr,
    deadline: Instant,
    timeout: Duration,
}

impl<F: Flavor> VerbsConnecting<F> {
    /// Starts the helper thread (the configuration checked by the caller).
    pub(crate) fn start(
        dom: VerbsDomain<F>,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, VerbsCq<F>>,
    ) -> Result<Self> {
        let deadline = Instant::now() + cfg.timeout;
        let handoff = Arc::new(Handoff::new()?);
        let owned = OwnedConfig::of(cfg);
        let h = handoff.clone();
        std::thread::Builder::new()
            .name("fabric-cm-connect".into())
            .spawn(move || {
                let r = dom.establish(addr, &owned.config(), deadline);
                h.deliver(r);
            })
            .map_err(|e| {
                Error::new(
                    ErrorKind::Io,
                    format!("cannot start a thread to connect to {addr}: {e}"),
                )
            })?;
        Ok(VerbsConnecting {
            handoff,
            addr,
            deadline,
            timeout: cfg.timeout,
        })
    }
}

impl<F: Flavor> fmt::Debug for VerbsConnecting<F> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("VerbsConnecting")
            .field("provider", &F::NAME)
            .field("addr", &self.addr)
            .field("deadline", &self.deadline)
            .finish()
    }
}

impl<F: Flavor> spi::Connecting for VerbsConnecting<F> {
    type Endpoint = VerbsEndpoint<F>;

    fn poll(&mut self) -> Result<Option<VerbsEndpoint<F>>> {
        let (addr, timeout) = (self.addr, self.timeout);
        self.handoff.poll(self.deadline, || {
            Error::new(
                ErrorKind::TimedOut,
                format!("connection with {addr}: no answer within {timeout:?}"),
            )
        })
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }
}

/// Readable once the helper thread's result is there (and from then on).
impl<F: Flavor> AsFd for VerbsConnecting<F> {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.handoff.fd()
    }
}

impl<F: Flavor> Drop for VerbsConnecting<F> {
    fn drop(&mut self) {
        self.handoff.abandon();
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;
    use std::sync::atomic::{AtomicUsize, Ordering};

    fn readable(fd: BorrowedFd<'_>) -> bool {
        fabric_api::notify::wait_readable(fd, Duration::ZERO).expect("poll")
    }

    /// Stands for an endpoint: counts its drops (a dropped endpoint is a closed one).
    struct Fake(Arc<AtomicUsize>);

    impl Drop for Fake {
        fn drop(&mut self) {
            self.0.fetch_add(1, Ordering::SeqCst);
        }
    }

    fn far() -> Instant {
        Instant::now() + Duration::from_secs(3600)
    }

    fn late() -> Error {
        Error::new(ErrorKind::TimedOut, "late")
    }

    #[test]
    fn the_result_is_polled_once_and_the_descriptor_says_when() {
        let drops = Arc::new(AtomicUsize::new(0));
        let h = Handoff::<Fake>::new().unwrap();
        assert!(!readable(h.fd()));
        assert!(matches!(h.poll(far(), late), Ok(None)));
        h.deliver(Ok(Fake(drops.clone())));
        assert!(readable(h.fd()));
        let ep = h.poll(far(), late).unwrap().expect("delivered");
        let again = h.poll(far(), late).map(|_| ()).unwrap_err();
        assert_eq!(again.kind(), ErrorKind::InvalidState);
        assert_eq!(drops.load(Ordering::SeqCst), 0);
        drop(ep);
        assert_eq!(drops.load(Ordering::SeqCst), 1);
    }

    #[test]
    fn an_error_is_polled_once() {
        let h = Handoff::<Fake>::new().unwrap();
        h.deliver(Err(Error::new(ErrorKind::ConnectionRefused, "nobody")));
        assert!(readable(h.fd()));
        let e = h.poll(far(), late).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::ConnectionRefused);
        let e = h.poll(far(), late).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidState);
    }

    #[test]
    fn an_abandoned_connection_drops_its_endpoint_whenever_it_comes() {
        let drops = Arc::new(AtomicUsize::new(0));
        // Abandoned before the result: the delivering thread drops it.
        let h = Handoff::<Fake>::new().unwrap();
        h.abandon();
        h.deliver(Ok(Fake(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // Abandoned after it: dropped by the abandoning owner.
        let h = Handoff::<Fake>::new().unwrap();
        h.deliver(Ok(Fake(drops.clone())));
        h.abandon();
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_poll_past_the_deadline_reports_the_time_out_and_abandons() {
        let drops = Arc::new(AtomicUsize::new(0));
        let h = Handoff::<Fake>::new().unwrap();
        let past = Instant::now();
        let e = h.poll(past, late).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::TimedOut);
        let e = h.poll(past, late).map(|_| ()).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::InvalidState);
        // The thread's late result is dropped by the thread.
        h.deliver(Ok(Fake(drops.clone())));
        assert_eq!(drops.load(Ordering::SeqCst), 1);
        // A result that came in time is returned even when polled after the deadline.
        let h = Handoff::<Fake>::new().unwrap();
        h.deliver(Ok(Fake(drops.clone())));
        assert!(h.poll(past, late).unwrap().is_some());
        assert_eq!(drops.load(Ordering::SeqCst), 2);
    }

    #[test]
    fn a_result_from_another_thread_wakes_a_poll_on_the_descriptor() {
        let h = Arc::new(Handoff::<u32>::new().unwrap());
        let h2 = h.clone();
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(20));
            h2.deliver(Ok(7));
        });
        let mut p = libc::pollfd {
            fd: h.fd().as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        #[allow(unsafe_code)]
        // SAFETY: `p` is one valid pollfd for the duration of the call.
        let n = unsafe { libc::poll(&mut p, 1, 10_000) };
        assert_eq!(n, 1);
        assert_eq!(h.poll(far(), late).unwrap(), Some(7));
        t.join().unwrap();
    }
}
