//! Connection setup without blocking: a non-blocking TCP connect, then the MPA Request
//! and Reply, each step taken when the socket is ready ([`TcpConnecting`]). The blocking
//! [`connect`](fabric_api::spi::Domain::connect) is the same machine, waited on.

use std::io::{self, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::{AsFd, AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use fabric_api::spi::{self, EndpointConfig, OwnedEndpointConfig};
use fabric_api::{Error, ErrorKind, ProviderCode, Result};
use mio::unix::SourceFd;
use mio::{Events, Interest, Poll, Token};

use crate::wire::mpa::{self, MpaFrame};
use crate::{setup, TcpCq, TcpDomain, TcpEndpoint};

#[derive(Debug)]
enum Phase {
    /// The TCP handshake is under way; the MPA Request waits.
    Tcp { request: Vec<u8> },
    /// Sending the MPA Request (`sent` of `out`), then reading the Reply (`got`, of which
    /// `need` bytes make it whole: the header first, then its private data).
    Mpa {
        out: Vec<u8>,
        sent: usize,
        got: Vec<u8>,
        need: usize,
    },
    /// The result was handed out.
    Done,
}

/// A tcp connection in the making: see [`spi::Connecting`]. Its descriptor is an `epoll`
/// instance watching the one socket, readable when the socket is (the TCP handshake
/// ended, the peer's reply arrived, or the connection failed).
#[derive(Debug)]
pub struct TcpConnecting {
    domain: TcpDomain,
    addr: SocketAddr,
    cfg: OwnedEndpointConfig<TcpCq>,
    poll: Poll,
    events: Events,
    /// Until the connection is handed out.
    sock: Option<TcpStream>,
    phase: Phase,
    deadline: Instant,
}

const SOCKET: Token = Token(0);

/// The neutral error of a failed TCP connect.
fn connect_error(addr: SocketAddr, e: io::Error, timeout: Duration) -> Error {
    if matches!(
        e.kind(),
        io::ErrorKind::NetworkUnreachable | io::ErrorKind::HostUnreachable
    ) {
        // No route is the same failure as no answer: the peer cannot be reached.
        return Error::new(ErrorKind::TimedOut, format!("{addr} is unreachable: {e}"))
            .with_code(ProviderCode::Errno(e.raw_os_error().unwrap_or(0)));
    }
    let e: Error = e.into();
    match e.kind() {
        ErrorKind::ConnectionRefused => Error::new(
            ErrorKind::ConnectionRefused,
            format!("nobody listens at {addr}"),
        ),
        ErrorKind::TimedOut => Error::new(
            ErrorKind::TimedOut,
            format!("{addr} did not answer within {timeout:?}"),
        ),
        _ => e,
    }
}

impl TcpConnecting {
    /// Starts connecting: see [`spi::Domain::connect_start`].
    pub(crate) fn start(
        domain: &TcpDomain,
        addr: SocketAddr,
        cfg: &EndpointConfig<'_, TcpCq>,
    ) -> Result<TcpConnecting> {
        crate::check_depths(cfg)?;
        let request = setup::request(&domain.shared.opts, cfg.private_data)?;
        let sock = socket2::Socket::new(
            socket2::Domain::for_address(addr),
            socket2::Type::STREAM,
            Some(socket2::Protocol::TCP),
        )?;
        sock.set_nonblocking(true)?;
        match sock.connect(&addr.into()) {
            Ok(()) => {}
            Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => {}
            Err(e) => return Err(connect_error(addr, e, cfg.timeout)),
        }
        let sock = TcpStream::from(sock);
        let poll = Poll::new()?;
        poll.registry().register(
            &mut SourceFd(&sock.as_raw_fd()),
            SOCKET,
            Interest::READABLE | Interest::WRITABLE,
        )?;
        Ok(TcpConnecting {
            domain: domain.clone(),
            addr,
            cfg: OwnedEndpointConfig::of(cfg),
            poll,
            events: Events::with_capacity(4),
            sock: Some(sock),
            phase: Phase::Tcp { request },
            deadline: Instant::now() + cfg.timeout,
        })
    }

    /// Waits for the connection: the blocking connect.
    pub(crate) fn wait(mut self) -> Result<TcpEndpoint> {
        loop {
            if let Some(ep) = spi::Connecting::poll(&mut self)? {
                return Ok(ep);
            }
            let left = self.deadline.saturating_duration_since(Instant::now());
            match self.poll.poll(&mut self.events, Some(left)) {
                Ok(()) => {}
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// One step of the machine; `Ok(None)` when it waits for the network.
    fn step(&mut self) -> Result<Option<TcpEndpoint>> {
        let invalid = || {
            Error::new(
                ErrorKind::InvalidState,
                "the connection was already handed out or failed",
            )
        };
        let sock = self.sock.as_ref().ok_or_else(invalid)?;
        if let Phase::Tcp { request } = &mut self.phase {
            if let Some(e) = sock.take_error()? {
                return Err(connect_error(self.addr, e, self.cfg.timeout));
            }
            match sock.peer_addr() {
                Ok(_) => {
                    self.phase = Phase::Mpa {
                        out: std::mem::take(request),
                        sent: 0,
                        got: Vec::with_capacity(mpa::HEADER_LEN),
                        need: mpa::HEADER_LEN,
                    }
                }
                Err(e) if e.raw_os_error() == Some(libc::ENOTCONN) => return Ok(None),
                Err(e) => return Err(connect_error(self.addr, e, self.cfg.timeout)),
            }
        }
        let Phase::Mpa {
            out,
            sent,
            got,
            need,
        } = &mut self.phase
        else {
            return Err(invalid());
        };
        fabric_api::sync::stream_sending(sock.as_fd());
        while *sent < out.len() {
            match (&*sock).write(&out[*sent..]) {
                Ok(n) => *sent += n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
        }
        // Never more than the reply: what follows it is the connection's stream.
        while got.len() < *need {
            let mut chunk = [0u8; 512];
            let want = (*need - got.len()).min(chunk.len());
            match (&*sock).read(&mut chunk[..want]) {
                Ok(0) => {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        "peer closed during MPA reply",
                    ))
                }
                Ok(n) => got.extend_from_slice(&chunk[..n]),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(None),
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e.into()),
            }
            fabric_api::sync::stream_received(sock.as_fd(), true);
            if got.len() == mpa::HEADER_LEN && *need == mpa::HEADER_LEN {
                let header: [u8; mpa::HEADER_LEN] = got[..].try_into().expect("header");
                let (_, pd_len) = MpaFrame::decode_header(&header, true)?;
                *need += pd_len;
            }
        }
        let header: [u8; mpa::HEADER_LEN] = got[..mpa::HEADER_LEN].try_into().expect("header");
        let (mut reply, _) = MpaFrame::decode_header(&header, true)?;
        reply.private_data = got[mpa::HEADER_LEN..].to_vec();
        let neg = setup::accept_reply(
            &reply,
            &self.domain.shared.opts,
            &self.domain.shared.keys,
            self.cfg.rq_depth,
        )?;
        let _ = self
            .poll
            .registry()
            .deregister(&mut SourceFd(&sock.as_raw_fd()));
        let sock = self.sock.take().expect("checked above");
        self.domain
            .finish_endpoint(sock, &self.cfg.config(), neg)
            .map(Some)
    }
}

impl spi::Connecting for TcpConnecting {
    type Endpoint = TcpEndpoint;

    fn poll(&mut self) -> Result<Option<TcpEndpoint>> {
        // Take the readiness the socket reported, so that the descriptor goes quiet until
        // the socket has news again (its registration is edge-triggered, and every step
        // reads or writes until the socket would block).
        let _ = self.poll.poll(&mut self.events, Some(Duration::ZERO));
        let r = match self.step() {
            Ok(None) if Instant::now() < self.deadline => return Ok(None),
            Ok(None) => Err(Error::new(
                ErrorKind::TimedOut,
                match self.phase {
                    Phase::Tcp { .. } => {
                        format!("{} did not answer within {:?}", self.addr, self.cfg.timeout)
                    }
                    _ => format!(
                        "no MPA reply from {} within {:?} (is its application accepting?)",
                        self.addr, self.cfg.timeout
                    ),
                },
            )),
            r => r,
        };
        if !matches!(&r, Err(e) if e.kind() == ErrorKind::InvalidState) {
            self.phase = Phase::Done;
        }
        r
    }

    fn deadline(&self) -> Instant {
        self.deadline
    }
}

impl AsFd for TcpConnecting {
    fn as_fd(&self) -> BorrowedFd<'_> {
        self.poll.registry().as_fd()
    }
}
