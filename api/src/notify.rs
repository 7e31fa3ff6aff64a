//! Readiness as a file descriptor, in safe code: what providers use for the descriptors of
//! listeners ([`spi::Listener`](crate::spi::Listener)), connections being set up and
//! endpoint events ([`EndpointEvents`]).
//!
//! A [`Notifier`] is a level: raised or lowered. Its descriptor, the read end of a pipe
//! created on first use, is readable exactly while the level is raised (one byte sits in
//! the pipe), so `poll(2)`, `epoll` and tokio's `AsyncFd` can wait on it. Nothing ever
//! reads the descriptor but the notifier itself. A notifier whose descriptor nobody asked
//! for costs no descriptor: hundreds of endpoints need no hundreds of pipes unless an
//! event loop waits on each.

use std::collections::VecDeque;
use std::io::{self, PipeReader, PipeWriter, Read, Write};
use std::os::fd::{AsFd, BorrowedFd};
use std::sync::OnceLock;

use crate::sync::Mutex;
use crate::{EndpointState, Error, Result};

/// A level with a file descriptor that is readable while it is raised.
#[derive(Debug, Default)]
pub struct Notifier {
    pipe: OnceLock<(PipeReader, PipeWriter)>,
    /// The level, and whether the pipe holds its byte; the pipe is written and read only
    /// under this lock, so the byte always matches the level once the pipe exists.
    state: Mutex<Level>,
}

#[derive(Debug, Default)]
struct Level {
    raised: bool,
    in_pipe: bool,
}

impl Level {
    /// Makes the pipe's content match the level.
    fn sync(&mut self, pipe: Option<&(PipeReader, PipeWriter)>) {
        let Some((r, w)) = pipe else { return };
        if self.raised && !self.in_pipe {
            // One byte into an empty pipe never blocks and never fails short.
            if (&*w).write_all(&[1]).is_ok() {
                self.in_pipe = true;
            }
        } else if !self.raised && self.in_pipe {
            // The byte is there (written under this lock): the read returns at once.
            let mut b = [0u8; 1];
            if (&*r).read_exact(&mut b).is_ok() {
                self.in_pipe = false;
            }
        }
    }
}

impl Notifier {
    /// A lowered notifier, with no descriptor yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn level(&self) -> crate::sync::MutexGuard<'_, Level> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Raises the level: the descriptor becomes (or stays) readable.
    pub fn raise(&self) {
        let mut l = self.level();
        l.raised = true;
        l.sync(self.pipe.get());
    }

    /// Lowers the level unless `still` (evaluated under the notifier's lock) says there
    /// is still something to report. A producer that makes `still` true and then calls
    /// [`raise`](Self::raise) can therefore never be lost between the check and the
    /// lowering.
    pub fn lower_unless(&self, still: impl FnOnce() -> bool) {
        let mut l = self.level();
        if !still() {
            l.raised = false;
            l.sync(self.pipe.get());
        }
    }

    /// Lowers the level.
    pub fn lower(&self) {
        self.lower_unless(|| false)
    }

    /// Whether the level is raised.
    pub fn is_raised(&self) -> bool {
        self.level().raised
    }

    /// The descriptor, readable while the level is raised; created on first use (the
    /// only failure is running out of descriptors).
    pub fn fd(&self) -> Result<BorrowedFd<'_>> {
        // Looked at (and made) under the level's lock, as `raise` and `lower_unless` look
        // at it: the pipe reaches other threads through that lock, which valgrind's
        // helgrind sees, rather than through the `OnceLock`'s `Once` alone, which it does
        // not (a thread reading a pipe another made, with nothing else between them,
        // would look like a race with its creation).
        let mut l = self.level();
        if self.pipe.get().is_none() {
            let pipe = io::pipe().map_err(|e| {
                let e = Error::from(e);
                let msg = format!("cannot create a notification descriptor: {}", e.message());
                match e.code() {
                    Some(c) => Error::new(e.kind(), msg).with_code(c),
                    None => Error::new(e.kind(), msg),
                }
            })?;
            let _ = self.pipe.set(pipe);
            l.sync(self.pipe.get());
        }
        Ok(self.pipe.get().expect("created above").0.as_fd())
    }
}

/// Waits up to `timeout` (zero: not at all) for `fd` to become readable, with `poll(2)`;
/// returns whether it is. For checking a descriptor of this crate's kind (a queue, a
/// listener, a connection in the making, endpoint events) without an event loop.
pub fn wait_readable(fd: BorrowedFd<'_>, timeout: std::time::Duration) -> io::Result<bool> {
    use std::os::fd::AsRawFd;
    let mut p = libc::pollfd {
        fd: fd.as_raw_fd(),
        events: libc::POLLIN,
        revents: 0,
    };
    let ms = libc::c_int::try_from(timeout.as_millis()).unwrap_or(libc::c_int::MAX);
    loop {
        #[allow(unsafe_code)]
        // SAFETY: `p` is one valid, initialised pollfd that outlives the call, and the
        // count says one.
        let n = unsafe { libc::poll(&mut p, 1, ms) };
        match n {
            -1 if io::Error::last_os_error().kind() == io::ErrorKind::Interrupted => {}
            -1 => return Err(io::Error::last_os_error()),
            0 => return Ok(false),
            _ => return Ok(p.revents & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0),
        }
    }
}

/// What happened to a connection, reported once per change of an endpoint's state (see
/// [`spi::Endpoint::next_event`](crate::spi::Endpoint::next_event)).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum EndpointEvent {
    /// This side closed the connection ([`close`](crate::spi::Endpoint::close)).
    Closed,
    /// The peer closed the connection: its `close`, or its process ended.
    PeerClosed,
    /// The connection failed: an error completion, a reset, a peer that stopped
    /// answering. The error says which.
    Failed(Error),
}

impl EndpointEvent {
    /// The endpoint state this event leaves the endpoint in.
    pub fn state(&self) -> EndpointState {
        match self {
            EndpointEvent::Closed | EndpointEvent::PeerClosed => EndpointState::Disconnected,
            EndpointEvent::Failed(_) => EndpointState::Error,
        }
    }
}

/// Most events an endpoint keeps unread: a connection changes state at most a few times
/// (failed, then closed), so more means a provider bug, never a peer's doing.
const MAX_EVENTS: usize = 4;

/// An endpoint's queue of connection events and its descriptor: what providers embed to
/// implement [`spi::Endpoint::next_event`](crate::spi::Endpoint::next_event) and
/// [`spi::Endpoint::event_fd`](crate::spi::Endpoint::event_fd).
#[derive(Debug, Default)]
pub struct EndpointEvents {
    queue: Mutex<VecDeque<EndpointEvent>>,
    notifier: Notifier,
}

impl EndpointEvents {
    /// An empty queue.
    pub fn new() -> Self {
        Self::default()
    }

    fn queue(&self) -> crate::sync::MutexGuard<'_, VecDeque<EndpointEvent>> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Reports `ev`; the descriptor becomes readable. Beyond a few unread events the
    /// oldest is dropped (the last one says where the endpoint is).
    pub fn push(&self, ev: EndpointEvent) {
        let mut q = self.queue();
        if q.len() == MAX_EVENTS {
            q.pop_front();
        }
        q.push_back(ev);
        drop(q);
        self.notifier.raise();
    }

    /// Takes the oldest unread event.
    pub fn next(&self) -> Option<EndpointEvent> {
        let ev = self.queue().pop_front();
        self.notifier.lower_unless(|| !self.queue().is_empty());
        ev
    }

    /// The descriptor, readable while an event is unread.
    pub fn fd(&self) -> Result<BorrowedFd<'_>> {
        self.notifier.fd()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ErrorKind;

    fn readable(fd: BorrowedFd<'_>) -> bool {
        wait_readable(fd, std::time::Duration::ZERO).unwrap()
    }

    #[test]
    fn the_descriptor_follows_the_level() {
        let n = Notifier::new();
        n.raise();
        // Raised before the descriptor existed: readable from its creation on.
        let fd = n.fd().unwrap();
        assert!(readable(fd));
        n.raise();
        assert!(readable(fd));
        n.lower();
        assert!(!readable(fd));
        n.lower();
        assert!(!readable(fd));
        n.raise();
        assert!(readable(fd));
    }

    #[test]
    fn lower_unless_keeps_a_level_something_still_needs() {
        let n = Notifier::new();
        let fd = n.fd().unwrap();
        n.raise();
        n.lower_unless(|| true);
        assert!(readable(fd) && n.is_raised());
        n.lower_unless(|| false);
        assert!(!readable(fd) && !n.is_raised());
    }

    #[test]
    fn events_are_read_in_order_and_the_descriptor_empties_with_the_queue() {
        let ev = EndpointEvents::new();
        let fd = ev.fd().unwrap();
        assert!(!readable(fd));
        ev.push(EndpointEvent::Failed(Error::new(
            ErrorKind::RemoteAccess,
            "x",
        )));
        ev.push(EndpointEvent::PeerClosed);
        assert!(readable(fd));
        assert_eq!(ev.next().map(|e| e.state()), Some(EndpointState::Error));
        assert!(readable(fd));
        assert_eq!(ev.next(), Some(EndpointEvent::PeerClosed));
        assert!(!readable(fd));
        assert_eq!(ev.next(), None);
    }

    #[test]
    fn the_queue_is_bounded() {
        let ev = EndpointEvents::new();
        for _ in 0..100 {
            ev.push(EndpointEvent::Closed);
        }
        ev.push(EndpointEvent::PeerClosed);
        let mut n = 0;
        let mut last = None;
        while let Some(e) = ev.next() {
            n += 1;
            last = Some(e);
        }
        assert_eq!((n, last), (MAX_EVENTS, Some(EndpointEvent::PeerClosed)));
    }
}
