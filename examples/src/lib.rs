//! What the examples in this directory share: waiting for completions with a deadline, the
//! two-sides-in-one-process harness and a result type. Each example is a program of its own
//! (`cargo run -p fabric-examples --example NAME`); see `examples/README.md`.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::{Duration, Instant};

use fabric::prelude::*;
use fabric::Selector;

/// Errors of the examples: the framework's, or words.
pub type Result<T> = std::result::Result<T, Box<dyn std::error::Error + Send + Sync>>;

/// How long an example waits for any one thing (a connection, a completion) before giving
/// up with an error.
pub const DEADLINE: Duration = Duration::from_secs(30);

/// Waits for the completions of every context in `contexts`, in any order, and returns them
/// in that order. A completion with an error status, one for another context, or none
/// within [`DEADLINE`], is an error.
pub fn wait_all(cq: &AnyCq, contexts: &[u64]) -> Result<Vec<Completion>> {
    let deadline = Instant::now() + DEADLINE;
    let mut got: Vec<Option<Completion>> = vec![None; contexts.len()];
    let mut out = Vec::new();
    while got.iter().any(Option::is_none) {
        out.clear();
        if cq.poll(&mut out, contexts.len())? == 0 {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(format!("no completion for {contexts:?} within {DEADLINE:?}").into());
            }
            cq.wait(left.min(Duration::from_millis(500)))?;
            continue;
        }
        for c in out.drain(..) {
            if c.status != Status::Success {
                return Err(format!("operation {} failed: {:?}", c.context, c.status).into());
            }
            match contexts.iter().position(|&x| x == c.context) {
                Some(i) if got[i].is_none() => got[i] = Some(c),
                _ => return Err(format!("unexpected completion {c:?}").into()),
            }
        }
    }
    Ok(got.into_iter().flatten().collect())
}

/// Waits for the completion of `context` (see [`wait_all`]).
pub fn wait(cq: &AnyCq, context: u64) -> Result<Completion> {
    Ok(wait_all(cq, &[context])?.remove(0))
}

/// Waits for the peer to close `ep` (within [`DEADLINE`]); any other connection event, or
/// none, is an error.
///
/// The side that received the last message of a conversation calls this before it drops
/// its endpoint, and the side that sent it closes once that send completed. Closing first
/// would be abortive for the peer's last send, whose completion may still be on its way
/// (on iWARP it is that of a delivery read answered by this side): the peer would see it
/// `Flushed` although its message arrived.
pub fn await_peer_close(ep: &AnyEndpoint) -> Result<()> {
    match ep.wait_event(DEADLINE)? {
        Some(EndpointEvent::PeerClosed) => Ok(()),
        Some(other) => Err(format!("expected the peer to close, got {other:?}").into()),
        None => Err(format!("the peer did not close within {DEADLINE:?}").into()),
    }
}

/// Ends an example: prints the error in words (not `Debug`) and returns a failing exit code.
pub fn exit(result: Result<()>) -> std::process::ExitCode {
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            std::process::ExitCode::FAILURE
        }
    }
}

/// Which side(s) of an example a process runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Role {
    /// Server and client in this process (two domains, as two processes would have).
    Both,
    /// The server only: it prints the address to give the client.
    Server,
    /// The client only (needs `--connect`).
    Client,
}

/// Runs an example's server and client as `role` says: `server` gets its domain and a
/// listener on `listen`, `client` its domain and the address to connect to.
pub fn run_roles(
    selector: &Selector,
    role: Role,
    listen: SocketAddr,
    connect: Option<SocketAddr>,
    server: impl FnOnce(&AnyDomain, &AnyListener) -> Result<()> + Send,
    client: impl FnOnce(&AnyDomain, SocketAddr) -> Result<()>,
) -> Result<()> {
    let open = || -> Result<AnyDomain> {
        let (domain, report) = selector.open()?;
        println!("selected {report}");
        Ok(domain)
    };
    match role {
        Role::Server => {
            let domain = open()?;
            let listener = domain.listen(listen)?;
            println!("server listening on {}", listener.local_addr());
            server(&domain, &listener)
        }
        Role::Client => {
            let addr = connect
                .ok_or("--role client needs --connect ADDR (the address the server printed)")?;
            client(&open()?, addr)
        }
        Role::Both => {
            let server_domain = open()?;
            let listener = server_domain.listen(listen)?;
            let addr = listener.local_addr();
            let client_domain = open()?;
            std::thread::scope(|s| {
                let sv = s.spawn(|| server(&server_domain, &listener));
                let c = client(&client_domain, addr);
                let sv = sv.join().map_err(|_| "the server thread panicked")?;
                c.and(sv)
            })
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn wait_all_returns_in_the_order_asked_and_refuses_strangers() -> Result<()> {
        let selector = Selector::new().providers("tcp")?;
        run_roles(
            &selector,
            Role::Both,
            "127.0.0.1:0".parse()?,
            None,
            |domain, listener| {
                let cq = domain.create_cq(16)?;
                let ep = listener.accept(&EndpointConfig::new(&cq), DEADLINE)?;
                let mr = domain.alloc(16, Access::LOCAL_WRITE)?;
                ep.post_recv(&RecvWr::new(7, &[mr.slice(0..8)?]))?;
                ep.post_recv(&RecvWr::new(8, &[mr.slice(8..16)?]))?;
                let got = wait_all(&cq, &[8, 7])?;
                assert_eq!(got.iter().map(|c| c.context).collect::<Vec<_>>(), [8, 7]);
                Ok(())
            },
            |domain, addr| {
                let cq = domain.create_cq(16)?;
                let ep = domain.connect(addr, &EndpointConfig::new(&cq))?;
                let s = domain.alloc(8, Access::empty())?;
                ep.post_send(&SendWr::send(1, &[s.all()]))?;
                ep.post_send(&SendWr::send(2, &[s.all()]))?;
                // Sends complete in post order: 1 comes first, which nobody asked for.
                let e = wait_all(&cq, &[2]).unwrap_err();
                assert!(e.to_string().contains("unexpected completion"), "{e}");
                wait(&cq, 2)?;
                Ok(())
            },
        )
    }
}
