//! A hooked tcp endpoint connected on loopback to a plain tcp endpoint.
#![allow(dead_code)]

use std::sync::Arc;
use std::time::{Duration, Instant};

use fabric_api::spi::{CompletionQueue, Domain, Endpoint, EndpointConfig, Listener};
use fabric_api::{Access, Buffer, Completion, EndpointState, MemoryRegion};
use fabric_hook::{HookConfig, HookCq, HookDomain, HookEndpoint};
use fabric_tcp::{TcpCq, TcpDomain, TcpEndpoint, TcpOptions};

/// Generous bound for anything that should happen promptly.
pub const PATIENCE: Duration = Duration::from_secs(20);

pub struct Pair {
    pub domain: HookDomain<TcpDomain>,
    pub cq: HookCq<TcpCq>,
    pub ep: HookEndpoint<TcpEndpoint>,
    pub mr: MemoryRegion,
    pub peer_domain: TcpDomain,
    pub peer_cq: TcpCq,
    pub peer_ep: TcpEndpoint,
    pub peer_mr: MemoryRegion,
}

const RW: Access = Access::LOCAL_WRITE
    .union(Access::REMOTE_WRITE)
    .union(Access::REMOTE_READ);

/// The hooked side connects; the plain side accepts.
pub fn pair(hooks: HookConfig) -> Pair {
    let domain = HookDomain::new(TcpDomain::open(TcpOptions::default()).unwrap(), hooks);
    let peer_domain = TcpDomain::open(TcpOptions::default()).unwrap();
    let cq = domain.create_cq(64).unwrap();
    let peer_cq = peer_domain.create_cq(64).unwrap();
    let listener = peer_domain.listen("127.0.0.1:0".parse().unwrap()).unwrap();
    let addr = listener.local_addr();
    let (ep, peer_ep) = std::thread::scope(|s| {
        let accepting = s.spawn(|| {
            listener
                .accept(&EndpointConfig::new(&peer_cq), PATIENCE)
                .unwrap()
        });
        let ep = domain.connect(addr, &EndpointConfig::new(&cq)).unwrap();
        (ep, accepting.join().unwrap())
    });
    let mr = domain.register(Arc::new(Buffer::new(4096)), RW).unwrap();
    let peer_mr = peer_domain
        .register(Arc::new(Buffer::new(4096)), RW)
        .unwrap();
    Pair {
        domain,
        cq,
        ep,
        mr,
        peer_domain,
        peer_cq,
        peer_ep,
        peer_mr,
    }
}

/// Waits for `n` completions (each with the time it was taken), or fails the test.
pub fn take<C: CompletionQueue>(cq: &C, n: usize) -> Vec<(Completion, Instant)> {
    let deadline = Instant::now() + PATIENCE;
    let mut got = Vec::new();
    while got.len() < n {
        let left = deadline.saturating_duration_since(Instant::now());
        assert!(
            !left.is_zero(),
            "only {} of {n} completions within {PATIENCE:?}: {got:?}",
            got.len()
        );
        cq.wait(left).unwrap();
        let mut out = Vec::new();
        cq.poll(&mut out, n - got.len()).unwrap();
        let now = Instant::now();
        got.extend(out.into_iter().map(|c| (c, now)));
    }
    got
}

/// Waits until `ep` leaves the connected state, or fails the test.
pub fn wait_not_connected<E: Endpoint>(ep: &E) -> EndpointState {
    let deadline = Instant::now() + PATIENCE;
    loop {
        let s = ep.state();
        if s != EndpointState::Connected {
            return s;
        }
        assert!(
            Instant::now() < deadline,
            "still connected after {PATIENCE:?}"
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
