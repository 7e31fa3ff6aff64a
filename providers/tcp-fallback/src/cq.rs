//! The completion queue: a bounded queue with reservation, so it can never overrun, and
//! the poll set of its endpoints' sockets: polling it makes progress (see
//! [`crate::engine`]).
//!
//! The queue itself is [`Inner`], generic over what its poll set sleeps in so that the
//! loom models run it over a model event.

use std::collections::VecDeque;
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::engine::sync::{AtomicUsize, Mutex};
use crate::engine::{PollSet, Poller};

use fabric_api::spi::CompletionQueue;
use fabric_api::{Completion, Error, ErrorKind, Result};

/// The queue behind a [`TcpCq`].
#[derive(Debug)]
pub(crate) struct Inner<P: Poller = mio::Poll> {
    queue: Mutex<VecDeque<Completion>>,
    /// The sockets of the endpoints reporting here, and a waker.
    pub(crate) set: Arc<PollSet<P>>,
    capacity: usize,
    /// Slots promised to posted operations plus completions not yet polled.
    reserved: AtomicUsize,
}

/// A completion queue of the tcp provider.
#[derive(Debug, Clone)]
pub struct TcpCq {
    inner: Arc<Inner>,
}

impl TcpCq {
    pub(crate) fn new(capacity: usize) -> Result<Self> {
        if capacity == 0 || capacity > crate::MAX_CQ_ENTRIES as usize {
            return Err(Error::invalid(format!(
                "completion queue capacity {capacity} outside 1..={}",
                crate::MAX_CQ_ENTRIES
            )));
        }
        Ok(TcpCq {
            inner: Arc::new(Inner::new(capacity, PollSet::new()?)),
        })
    }

    /// Promises a slot to an operation being posted; refused when the queue could overrun.
    pub(crate) fn reserve(&self) -> Result<()> {
        self.inner.reserve()
    }

    /// Gives back a slot whose operation completed without a completion entry.
    pub(crate) fn unreserve(&self) {
        self.inner.unreserve()
    }

    /// Delivers a completion into a slot reserved earlier.
    pub(crate) fn push(&self, c: Completion) {
        self.inner.push(c)
    }

    /// The poll set of this queue's endpoints.
    pub(crate) fn set(&self) -> &Arc<PollSet> {
        &self.inner.set
    }
}

impl CompletionQueue for TcpCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        self.inner.poll(out, max)
    }

    fn wait(&self, timeout: Duration) -> Result<bool> {
        self.inner.wait(timeout)
    }

    fn capacity(&self) -> usize {
        self.inner.capacity
    }

    /// Arms the queue's descriptor, the `epoll` instance of its endpoints' sockets: their
    /// readiness makes it readable (polling then makes the progress), and so does a
    /// completion pushed by another thread (the domain's progress thread, a post) after
    /// arming, through the poll set's waker.
    fn arm(&self) -> Result<bool> {
        Ok(self.inner.arm())
    }
}

/// The `epoll` descriptor of the queue's poll set: see [`TcpCq::arm`](CompletionQueue::arm).
impl AsFd for TcpCq {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.inner.set.as_fd()
    }
}

impl<P: Poller> Inner<P> {
    /// An empty queue of `capacity` entries whose endpoints' sockets are in `set`.
    pub(crate) fn new(capacity: usize, set: PollSet<P>) -> Self {
        Inner {
            queue: Mutex::new(VecDeque::with_capacity(capacity)),
            set: Arc::new(set),
            capacity,
            reserved: AtomicUsize::new(0),
        }
    }

    /// See [`TcpCq::reserve`].
    pub(crate) fn reserve(&self) -> Result<()> {
        let cap = self.capacity;
        self
            .reserved
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |r| (r < cap).then_some(r + 1))
            .map(|_| ())
            .map_err(|_| {
                Error::new(
                    ErrorKind::QueueFull,
                    format!("completion queue of {cap} entries would overrun: poll it before posting more"),
                )
            })
    }

    /// See [`TcpCq::unreserve`].
    pub(crate) fn unreserve(&self) {
        self.reserved.fetch_sub(1, Ordering::AcqRel);
    }

    /// See [`TcpCq::push`].
    pub(crate) fn push(&self, c: Completion) {
        let mut q = self.queue.lock().expect("cq poisoned");
        q.push_back(c);
        drop(q);
        self.set.wake();
    }

    /// See [`CompletionQueue::poll`].
    pub(crate) fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<usize> {
        // Progress first, without blocking: a zero-timeout look at the sockets (skipped
        // when another thread is polling them: it does the work).
        self.set.run_now();
        let mut q = self.queue.lock().expect("cq poisoned");
        let n = q.len().min(max);
        out.extend(q.drain(..n));
        drop(q);
        self.reserved.fetch_sub(n, Ordering::AcqRel);
        Ok(n)
    }

    /// See [`CompletionQueue::arm`]: true when armed with no completion queued.
    pub(crate) fn arm(&self) -> bool {
        !self
            .set
            .arm(|| !self.queue.lock().expect("cq poisoned").is_empty())
    }

    /// See [`CompletionQueue::wait`].
    pub(crate) fn wait(&self, timeout: Duration) -> Result<bool> {
        // However it returns: the progress threads that napped while this wait drove the
        // connections take them back within HANDOFF unless the application looks again.
        struct EndNaps<'a, P: Poller>(&'a PollSet<P>);
        impl<P: Poller> Drop for EndNaps<'_, P> {
            fn drop(&mut self) {
                self.0.end_naps_of_conns();
            }
        }
        let _end = EndNaps(&self.set);
        let deadline = Instant::now() + timeout;
        loop {
            if !self.queue.lock().expect("cq poisoned").is_empty() {
                return Ok(true);
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(false);
            }
            // Sleeps in epoll_wait on this queue's sockets and its waker (a completion
            // produced elsewhere wakes it); `push` checks for sleepers after queueing, and
            // the queue is re-checked here after every wake-up, so none is lost.
            self.set.run_unless(Some(deadline - now), || {
                !self.queue.lock().expect("cq poisoned").is_empty()
            });
        }
    }
}

/// A successful send completion with `context`: what the unit tests and the loom models
/// push.
#[cfg(test)]
pub(crate) fn sent(context: u64) -> Completion {
    Completion {
        context,
        opcode: fabric_api::Opcode::Send,
        status: fabric_api::Status::Success,
        provider_code: None,
        byte_len: 0,
        imm: None,
        ep_context: 0,
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;
    use std::os::fd::AsRawFd;

    fn c(context: u64) -> Completion {
        sent(context)
    }

    #[test]
    fn reservations_bound_the_queue_and_polling_frees_them() {
        let cq = TcpCq::new(2).unwrap();
        cq.reserve().unwrap();
        cq.reserve().unwrap();
        assert_eq!(cq.reserve().unwrap_err().kind(), ErrorKind::QueueFull);
        cq.push(c(1));
        cq.push(c(2));
        let mut out = Vec::new();
        assert_eq!(cq.poll(&mut out, 1).unwrap(), 1);
        cq.reserve().unwrap();
        assert_eq!(out[0].context, 1);
    }

    #[test]
    fn wait_times_out_then_wakes_on_push() {
        let cq = TcpCq::new(4).unwrap();
        assert!(!cq.wait(Duration::from_millis(20)).unwrap());
        let cq2 = cq.clone();
        let t = std::thread::spawn(move || cq2.wait(Duration::from_secs(10)).unwrap());
        std::thread::sleep(Duration::from_millis(20));
        cq.reserve().unwrap();
        cq.push(c(9));
        assert!(t.join().unwrap());
    }

    /// Whether `cq`'s descriptor becomes readable within `timeout`, seen from another
    /// `epoll` instance (as an event loop sees it: edge-triggered, like tokio).
    fn readable_within(cq: &TcpCq, timeout: Duration) -> bool {
        let mut poll = mio::Poll::new().unwrap();
        let fd = cq.as_fd().as_raw_fd();
        poll.registry()
            .register(
                &mut mio::unix::SourceFd(&fd),
                mio::Token(1),
                mio::Interest::READABLE,
            )
            .unwrap();
        let mut events = mio::Events::with_capacity(4);
        poll.poll(&mut events, Some(timeout)).unwrap();
        !events.is_empty()
    }

    #[test]
    fn arm_refuses_while_completions_are_pending() {
        let cq = TcpCq::new(4).unwrap();
        assert!(cq.arm().unwrap(), "an empty queue arms");
        cq.reserve().unwrap();
        cq.push(c(1));
        assert!(!cq.arm().unwrap(), "armed with a completion pending");
        let mut out = Vec::new();
        assert_eq!(cq.poll(&mut out, 4).unwrap(), 1);
        assert!(cq.arm().unwrap(), "the polled queue arms again");
    }

    #[test]
    fn armed_descriptor_becomes_readable_on_a_push_from_another_thread() {
        let cq = TcpCq::new(4).unwrap();
        for round in 0..3 {
            assert!(cq.arm().unwrap());
            let cq2 = cq.clone();
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                cq2.reserve().unwrap();
                cq2.push(c(round));
            });
            assert!(
                readable_within(&cq, Duration::from_secs(10)),
                "round {round}: the armed descriptor stayed unreadable after a push"
            );
            t.join().unwrap();
            let mut out = Vec::new();
            assert_eq!(cq.poll(&mut out, 4).unwrap(), 1);
            assert_eq!(out[0].context, round);
        }
    }
}
