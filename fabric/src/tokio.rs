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
//! [`Stream`] of them. Connecting and accepting still block (run them in
//! `tokio::task::spawn_blocking`, or before the runtime starts).
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

use crate::{AnyCq, Completion, CqOps, Result};

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
}
