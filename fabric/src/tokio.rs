//! Async waiting on completion queues with tokio (feature `tokio`).
//!
//! [`AsyncCq`] registers a queue's notification descriptor ([`CqOps::notify_fd`], the
//! [`AsFd`] of [`AnyCq`]) with tokio's reactor through [`AsyncFd`] and follows the
//! arm-then-re-poll loop of [`fabric_api::spi::CompletionQueue`]: poll; when nothing is
//! there, [`arm`](CqOps::arm); when armed, sleep until the descriptor is readable; again.
//! A task waiting on a queue costs no thread and never spins; the provider's own progress
//! goes on as without tokio (the tcp provider's progress thread, the device).
//!
//! [`AsyncCq::completion`] awaits the next completion; [`AsyncCq`] is also a
//! [`Stream`] of them. [`connect`] and [`accept`] set up connections without blocking the
//! runtime (over [`DomainOps::connect_start`] and [`ListenerOps::try_accept`] and their
//! descriptors), and [`next_event`] awaits an endpoint's connection event (failed,
//! closed, closed by the peer).
//!
//! ```no_run
//! # async fn demo(cq: fabric::AnyCq) -> fabric::Result<()> {
//! use fabric::tokio::AsyncCq;
//! let mut cq = AsyncCq::new(cq)?; // inside a tokio runtime
//! let c = cq.completion().await?;
//! println!("context {} completed: {}", c.context, c.status);
//! # Ok(())
//! # }
//! ```

use std::collections::VecDeque;
use std::os::fd::{AsFd, AsRawFd, RawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_core::Stream;
use tokio::io::unix::AsyncFd;
use tokio::io::Interest;

use crate::{
    AnyConnecting, AnyCq, AnyDomain, AnyEndpoint, AnyListener, Completion, CqOps, DomainOps,
    EndpointConfig, EndpointEvent, EndpointOps, ListenerOps, Result,
};

/// Completions taken from the queue per poll.
const BATCH: usize = 64;

/// The queue as tokio's reactor sees it: its notification descriptor.
#[derive(Debug)]
struct Notify(AnyCq);

impl AsRawFd for Notify {
    fn as_raw_fd(&self) -> RawFd {
        self.0.as_fd().as_raw_fd()
    }
}

/// A completion queue awaited through tokio: see the [module docs](self).
///
/// Follows the queue's arm-then-re-poll loop, which one waiter at a time may follow: do not
/// also wait on the same queue through another [`AsyncCq`] or its own descriptor. Polling
/// the queue directly meanwhile ([`AsyncCq::cq`]) is fine.
#[derive(Debug)]
pub struct AsyncCq {
    fd: AsyncFd<Notify>,
    /// Completions polled and not handed out yet.
    ready: VecDeque<Completion>,
    out: Vec<Completion>,
}

impl AsyncCq {
    /// Registers `cq`'s descriptor with the current tokio runtime's reactor. Fails outside
    /// a runtime (or one without I/O enabled), as [`AsyncFd::new`] does.
    pub fn new(cq: AnyCq) -> Result<AsyncCq> {
        // Tokio 1.54 deprecated the safe constructors for the unsafe
        // `register_with_interest`, whose contract (the descriptor stays open and the same
        // while registered) `Notify` keeps: it owns a handle to the queue, whose
        // descriptor is fixed for the queue's life. This crate forbids `unsafe`, so it keeps
        // the safe constructor, which every tokio 1.x has.
        #[allow(deprecated)]
        let fd = AsyncFd::with_interest(Notify(cq), Interest::READABLE)?;
        Ok(AsyncCq {
            fd,
            ready: VecDeque::new(),
            out: Vec::with_capacity(BATCH),
        })
    }

    /// The queue (to post with, or to poll without waiting).
    pub fn cq(&self) -> &AnyCq {
        &self.fd.get_ref().0
    }

    /// Waits for the next completion.
    pub async fn completion(&mut self) -> Result<Completion> {
        std::future::poll_fn(|cx| self.poll_completion(cx)).await
    }

    /// Polls for the next completion: ready with it, or pending with `cx`'s waker woken
    /// when the queue's descriptor becomes readable.
    pub fn poll_completion(&mut self, cx: &mut Context<'_>) -> Poll<Result<Completion>> {
        loop {
            if let Some(c) = self.ready.pop_front() {
                return Poll::Ready(Ok(c));
            }
            let cq = &self.fd.get_ref().0;
            if cq.poll(&mut self.out, BATCH)? > 0 {
                self.ready.extend(self.out.drain(..));
                continue;
            }
            if !cq.arm()? {
                // Pending already although the poll found nothing (a completion that
                // landed in between, or one a hook holds back): poll again, after letting
                // other tasks run.
                cx.waker().wake_by_ref();
                return Poll::Pending;
            }
            // Armed: the descriptor becomes readable when a completion may be pending.
            // Readiness tokio still holds from an earlier edge is cleared before the next
            // poll, so an edge after this point is never lost.
            match self.fd.poll_read_ready(cx) {
                Poll::Pending => return Poll::Pending,
                Poll::Ready(Ok(mut guard)) => guard.clear_ready(),
                Poll::Ready(Err(e)) => return Poll::Ready(Err(e.into())),
            }
        }
    }
}

/// A descriptor borrowed for one wait: the object owning it outlives the registration
/// (the functions below hold the borrow for as long as their `AsyncFd` lives).
struct Borrowed(RawFd);

impl AsRawFd for Borrowed {
    fn as_raw_fd(&self) -> RawFd {
        self.0
    }
}

/// Registers `fd` with the reactor and runs `attempt` until it gives something: after each
/// attempt that gives nothing, sleeps until the descriptor is readable (at most until
/// `deadline`, when given). Readiness is cleared before the next attempt, so a
/// notification after an attempt is never lost.
async fn until_ready<T>(
    fd: RawFd,
    deadline: Option<std::time::Instant>,
    mut attempt: impl FnMut() -> Result<Option<T>>,
) -> Result<T> {
    #[allow(deprecated)] // see `AsyncCq::new`
    let afd = AsyncFd::with_interest(Borrowed(fd), Interest::READABLE)?;
    loop {
        if let Some(t) = attempt()? {
            return Ok(t);
        }
        let ready = afd.readable();
        let mut guard = match deadline {
            None => ready.await?,
            Some(d) => match tokio::time::timeout_at(d.into(), ready).await {
                Ok(g) => g?,
                // The attempt reports its own time-out: one more.
                Err(_) => {
                    if let Some(t) = attempt()? {
                        return Ok(t);
                    }
                    continue;
                }
            },
        };
        guard.clear_ready();
    }
}

/// Connects to a listener at `addr` without blocking the runtime: the connection is
/// started at once and finished as the peer answers ([`AnyConnecting`]); fails as
/// [`DomainOps::connect`] does, also after `cfg.timeout`.
pub async fn connect(
    domain: &AnyDomain,
    addr: std::net::SocketAddr,
    cfg: &EndpointConfig<'_, AnyCq>,
) -> Result<AnyEndpoint> {
    let mut c: AnyConnecting = domain.connect_start(addr, cfg)?;
    let (fd, deadline) = (c.as_fd().as_raw_fd(), c.deadline());
    until_ready(fd, Some(deadline), || c.poll()).await
}

/// Accepts the next connection request on `listener` without blocking the runtime.
pub async fn accept(
    listener: &AnyListener,
    cfg: &EndpointConfig<'_, AnyCq>,
) -> Result<AnyEndpoint> {
    until_ready(listener.as_fd().as_raw_fd(), None, || {
        listener.try_accept(cfg)
    })
    .await
}

/// Waits for the endpoint's next connection event ([`EndpointOps::next_event`]).
pub async fn next_event(ep: &AnyEndpoint) -> Result<EndpointEvent> {
    let fd = ep.event_fd()?.as_raw_fd();
    until_ready(fd, None, || Ok(ep.next_event())).await
}

/// The queue's completions, in order; never ends (an error is an item, and the stream
/// goes on after it).
impl Stream for AsyncCq {
    type Item = Result<Completion>;

    fn poll_next(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        self.get_mut().poll_completion(cx).map(Some)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::prelude::*;
    use std::time::Duration;

    fn tcp_domain() -> AnyDomain {
        crate::Selector::new()
            .providers("tcp")
            .and_then(|s| s.open())
            .expect("tcp domain")
            .0
    }

    /// A receive completes on a queue nobody polls but the task awaiting it, with the
    /// message sent from another thread after the task went to sleep.
    #[test]
    fn completion_wakes_the_task() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let d = tcp_domain();
        let l = d.listen("127.0.0.1:0".parse().unwrap()).unwrap();
        let addr = l.local_addr();
        let cqa = d.create_cq(8).unwrap();
        let cqb = d.create_cq(8).unwrap();
        let (a, b) = std::thread::scope(|s| {
            let acc = s.spawn(|| {
                l.accept(&EndpointConfig::new(&cqb), Duration::from_secs(10))
                    .unwrap()
            });
            let a = d.connect(addr, &EndpointConfig::new(&cqa)).unwrap();
            (a, acc.join().unwrap())
        });
        let dst = d.alloc(64, Access::LOCAL_WRITE).unwrap();
        let src = d.alloc(64, Access::empty()).unwrap();
        b.post_recv(&RecvWr::new(7, &[dst.all()])).unwrap();
        let got = rt.block_on(async {
            let mut acq = AsyncCq::new(cqb.clone()).unwrap();
            let sender = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(50));
                a.post_send(&SendWr::send(1, &[src.all()])).unwrap();
                a
            });
            let c = tokio::time::timeout(Duration::from_secs(10), acq.completion()).await;
            sender.join().unwrap();
            c
        });
        let c = got.expect("no completion within 10 s").unwrap();
        assert_eq!((c.context, c.opcode, c.byte_len), (7, Opcode::Recv, 64));
    }

    /// Two tasks on one thread connect to each other's listener before either accepts
    /// (a ring of two): nothing blocks the thread, so both connections come up. Then one
    /// side closes and the other task's event wait wakes with `PeerClosed`.
    #[test]
    fn connect_accept_and_events_on_one_thread() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let d = tcp_domain();
        let (la, lb) = (
            d.listen("127.0.0.1:0".parse().unwrap()).unwrap(),
            d.listen("127.0.0.1:0".parse().unwrap()).unwrap(),
        );
        let (cqa, cqb) = (d.create_cq(8).unwrap(), d.create_cq(8).unwrap());
        rt.block_on(async {
            let (ca, cb) = (
                EndpointConfig {
                    ep_context: 1,
                    ..EndpointConfig::new(&cqa)
                },
                EndpointConfig {
                    ep_context: 2,
                    ..EndpointConfig::new(&cqb)
                },
            );
            // a connects to b's listener and b to a's, all before any accept.
            let work = async {
                tokio::try_join!(
                    connect(&d, lb.local_addr(), &ca),
                    connect(&d, la.local_addr(), &cb),
                    accept(&la, &ca),
                    accept(&lb, &cb),
                )
            };
            let (a_out, b_out, a_in, b_in) = tokio::time::timeout(Duration::from_secs(10), work)
                .await
                .expect("ring of two connected within 10 s")
                .unwrap();
            assert_eq!(a_out.state(), EndpointState::Connected);
            let waiter = next_event(&b_in);
            a_out.close().unwrap();
            let ev = tokio::time::timeout(Duration::from_secs(10), waiter)
                .await
                .expect("event within 10 s")
                .unwrap();
            assert_eq!(ev, EndpointEvent::PeerClosed);
            assert_eq!(a_out.next_event(), Some(EndpointEvent::Closed));
            drop((b_out, a_in));
        });
    }

    #[test]
    fn a_refused_connection_is_an_error_not_a_hang() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .unwrap();
        let d = tcp_domain();
        // A port nobody listens on: bind one, note it, close it.
        let addr = std::net::TcpListener::bind("127.0.0.1:0")
            .unwrap()
            .local_addr()
            .unwrap();
        let cq = d.create_cq(8).unwrap();
        let r = rt.block_on(async {
            tokio::time::timeout(
                Duration::from_secs(10),
                connect(&d, addr, &EndpointConfig::new(&cq)),
            )
            .await
            .expect("answer within 10 s")
        });
        assert_eq!(r.unwrap_err().kind(), ErrorKind::ConnectionRefused);
    }
}
