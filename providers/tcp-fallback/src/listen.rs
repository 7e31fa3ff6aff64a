//! The listener: one thread per listener accepts TCP connections and reads their MPA
//! Requests, all at once and without blocking on any of them (a `mio` poll set), so a
//! client that connects and never speaks stalls nobody. [`accept`](crate::TcpListener)
//! then only answers a request that is complete.
//!
//! Bounds (docs/contract.md section 8): at most [`MAX_HALF_OPEN`] connections may be in the
//! middle of their handshake (beyond it new connections are closed at once), each gets
//! [`REQUEST_TIMEOUT`] to send its whole request (then it is closed), a request is at most
//! an MPA header plus 512 bytes, and at most [`READY_BACKLOG`] complete requests wait for
//! the application's `accept` (beyond it the peer gets an MPA reject naming the bound).

use std::collections::{HashMap, VecDeque};
use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use fabric_api::sync::{Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use fabric_api::Notifier;

use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token, Waker};

use crate::wire::mpa::{self, MpaFrame};

/// Connections whose MPA Request is still incomplete, per listener.
pub const MAX_HALF_OPEN: usize = 256;
/// Time a new connection has to send its whole MPA Request.
pub const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Complete requests waiting for the application's `accept`.
pub const READY_BACKLOG: usize = 64;

const LISTENER: Token = Token(0);
const WAKER: Token = Token(1);

/// A connection whose MPA Request has arrived whole.
#[derive(Debug)]
pub(crate) struct Incoming {
    pub sock: TcpStream,
    pub peer: SocketAddr,
    pub request: MpaFrame,
}

/// Complete requests waiting for `accept`, and the listener's descriptor: readable while
/// one waits.
#[derive(Debug, Default)]
pub(crate) struct Ready {
    queue: Mutex<VecDeque<Incoming>>,
    arrived: Condvar,
    pub notifier: Notifier,
}

impl Ready {
    fn queue(&self) -> fabric_api::sync::MutexGuard<'_, VecDeque<Incoming>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Queues a complete request; gives it back when [`READY_BACKLOG`] already wait.
    fn offer(&self, item: Incoming) -> Result<(), Incoming> {
        let mut q = self.queue();
        if q.len() >= READY_BACKLOG {
            return Err(item);
        }
        q.push_back(item);
        drop(q);
        self.notifier.raise();
        self.arrived.notify_one();
        Ok(())
    }

    /// Takes the oldest complete request, waiting up to `timeout` for one.
    pub fn take(&self, timeout: Duration) -> Option<Incoming> {
        let deadline = Instant::now() + timeout;
        let mut q = self.queue();
        let item = loop {
            if let Some(i) = q.pop_front() {
                break Some(i);
            }
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                break None;
            }
            q = self
                .arrived
                .wait_timeout(q, left)
                .unwrap_or_else(|p| p.into_inner())
                .0;
        };
        drop(q);
        // Under the notifier's lock: a request queued meanwhile keeps it raised.
        self.notifier.lower_unless(|| !self.queue().is_empty());
        item
    }
}

/// The listener's thread and the queue of complete requests.
#[derive(Debug)]
pub(crate) struct Acceptor {
    pub ready: Arc<Ready>,
    waker: Waker,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

struct HalfOpen {
    sock: TcpStream,
    peer: SocketAddr,
    buf: Vec<u8>,
    /// Bytes the request needs in all (header first, then header plus private data).
    need: usize,
    deadline: Instant,
}

impl Acceptor {
    /// Starts the thread on a bound listener.
    pub fn start(listener: TcpListener) -> io::Result<Acceptor> {
        let local = listener.local_addr()?;
        listener.set_nonblocking(true)?;
        let poll = Poll::new()?;
        poll.registry().register(
            &mut SourceFd(&listener.as_raw_fd()),
            LISTENER,
            Interest::READABLE,
        )?;
        let waker = Waker::new(poll.registry(), WAKER)?;
        let ready = Arc::new(Ready::default());
        // The descriptor exists from the start: `AsFd` cannot fail later.
        ready.notifier.fd().map_err(io::Error::other)?;
        let stop = Arc::new(AtomicBool::new(false));
        let (stop2, ready2) = (stop.clone(), ready.clone());
        let thread = std::thread::Builder::new()
            .name(format!("fabric-tcp-listen {local}"))
            .spawn(move || run(poll, listener, &ready2, &stop2))?;
        Ok(Acceptor {
            ready,
            waker,
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        // The thread sees the flag at its next wake-up; it closes the listening socket and
        // every half-open connection as it returns.
        fabric_api::sync::atomic_only(&*self.stop); // publishes nothing: the join orders
        self.stop.store(true, Ordering::Release);
        let _ = self.waker.wake();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn run(mut poll: Poll, listener: TcpListener, ready: &Ready, stop: &AtomicBool) {
    let mut events = Events::with_capacity(128);
    let mut half: HashMap<Token, HalfOpen> = HashMap::new();
    let mut next = 2usize;
    loop {
        let now = Instant::now();
        let timeout = half
            .values()
            .map(|h| h.deadline.saturating_duration_since(now))
            .min();
        if let Err(e) = poll.poll(&mut events, timeout) {
            if e.kind() == io::ErrorKind::Interrupted {
                continue;
            }
            tracing::error!("listener poll failed: {e}");
            return;
        }
        if stop.load(Ordering::Acquire) {
            return;
        }
        for ev in events.iter() {
            match ev.token() {
                LISTENER => accept_all(&poll, &listener, &mut half, &mut next),
                WAKER => {}
                t => {
                    let done = half.get_mut(&t).map(progress);
                    match done {
                        Some(Progress::Waiting) | None => {}
                        Some(Progress::Failed(why)) => {
                            let h = half.remove(&t).expect("present");
                            let _ = poll
                                .registry()
                                .deregister(&mut SourceFd(&h.sock.as_raw_fd()));
                            tracing::warn!(peer = %h.peer, "connection request dropped: {why}");
                        }
                        Some(Progress::Complete(request)) => {
                            let h = half.remove(&t).expect("present");
                            let _ = poll
                                .registry()
                                .deregister(&mut SourceFd(&h.sock.as_raw_fd()));
                            hand_over(ready, h, request);
                        }
                    }
                }
            }
        }
        let now = Instant::now();
        half.retain(|_, h| {
            if h.deadline > now {
                return true;
            }
            tracing::warn!(peer = %h.peer, "connection request dropped: no complete MPA Request within {REQUEST_TIMEOUT:?}");
            let _ = poll.registry().deregister(&mut SourceFd(&h.sock.as_raw_fd()));
            false
        });
    }
}

fn accept_all(
    poll: &Poll,
    listener: &TcpListener,
    half: &mut HashMap<Token, HalfOpen>,
    next: &mut usize,
) {
    loop {
        match listener.accept() {
            Ok((sock, peer)) => {
                if half.len() >= MAX_HALF_OPEN {
                    tracing::warn!(%peer, "connection closed: {MAX_HALF_OPEN} connections are already in their handshake");
                    continue;
                }
                if let Err(e) = sock.set_nonblocking(true) {
                    tracing::warn!(%peer, "connection dropped: {e}");
                    continue;
                }
                let token = Token(*next);
                *next = next.wrapping_add(1).max(2);
                if let Err(e) = poll.registry().register(
                    &mut SourceFd(&sock.as_raw_fd()),
                    token,
                    Interest::READABLE,
                ) {
                    tracing::warn!(%peer, "connection dropped: {e}");
                    continue;
                }
                half.insert(
                    token,
                    HalfOpen {
                        sock,
                        peer,
                        buf: Vec::with_capacity(mpa::HEADER_LEN),
                        need: mpa::HEADER_LEN,
                        deadline: Instant::now() + REQUEST_TIMEOUT,
                    },
                );
            }
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of descriptors, say: the pending connection stays in the kernel's
                // backlog and is retried on the next readiness.
                tracing::warn!("accept failed: {e}");
                return;
            }
        }
    }
}

enum Progress {
    Waiting,
    Failed(String),
    Complete(MpaFrame),
}

/// Reads what has arrived of a request, never more than it needs.
fn progress(h: &mut HalfOpen) -> Progress {
    loop {
        let have = h.buf.len();
        if have == h.need {
            if h.need == mpa::HEADER_LEN {
                let header: [u8; mpa::HEADER_LEN] = h.buf[..].try_into().expect("header");
                match MpaFrame::decode_header(&header, false) {
                    Ok((_, 0)) => {}
                    Ok((_, pd_len)) => {
                        h.need += pd_len;
                        continue;
                    }
                    Err(e) => return Progress::Failed(format!("bad MPA Request: {e}")),
                }
            }
            let header: [u8; mpa::HEADER_LEN] =
                h.buf[..mpa::HEADER_LEN].try_into().expect("header");
            fabric_api::sync::stream_received(std::os::fd::AsFd::as_fd(&h.sock), true);
            return match MpaFrame::decode_header(&header, false) {
                Ok((mut frame, _)) => {
                    frame.private_data = h.buf[mpa::HEADER_LEN..].to_vec();
                    Progress::Complete(frame)
                }
                Err(e) => Progress::Failed(format!("bad MPA Request: {e}")),
            };
        }
        let mut chunk = [0u8; 512];
        let want = (h.need - have).min(chunk.len());
        match h.sock.read(&mut chunk[..want]) {
            Ok(0) => return Progress::Failed("peer closed during its MPA Request".into()),
            Ok(n) => h.buf.extend_from_slice(&chunk[..n]),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Progress::Waiting,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Progress::Failed(e.to_string()),
        }
    }
}

/// Queues a complete request for `accept`, or rejects it when the backlog is full.
fn hand_over(ready: &Ready, h: HalfOpen, request: MpaFrame) {
    if let Err(e) = h.sock.set_nonblocking(false) {
        tracing::warn!(peer = %h.peer, "connection dropped: {e}");
        return;
    }
    let item = Incoming {
        sock: h.sock,
        peer: h.peer,
        request,
    };
    if let Err(item) = ready.offer(item) {
        tracing::warn!(peer = %item.peer, "connection rejected: {READY_BACKLOG} requests already wait for accept");
        reject(
            item,
            &format!("listener backlog of {READY_BACKLOG} requests is full"),
        );
    }
}

/// Answers a request with an MPA reject carrying `why` (best effort, never blocking long).
pub(crate) fn reject(item: Incoming, why: &str) {
    let f = MpaFrame::reject(item.request.revision, why);
    let mut sock = item.sock;
    let _ = sock.set_write_timeout(Some(Duration::from_millis(100)));
    let _ = sock.write_all(&f.encode());
}
