//! The tracing hook emits an event for every operation, inside a span per endpoint.
//! (One test in this binary: it installs the process-wide subscriber, to see the events of
//! the accepting thread too.)

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};

use common::{pair, take};
use fabric_api::spi::{Domain, Endpoint};
use fabric_api::{ErrorKind, RecvWr, SendWr};
use fabric_hook::{FaultConfig, HookConfig, Trigger};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn every_operation_is_traced_in_its_endpoint_span() {
    let captured = Captured::default();
    let writer = captured.clone();
    tracing_subscriber::fmt()
        .with_env_filter("fabric_hook=trace")
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .init();

    let p = pair(HookConfig {
        trace: true,
        fault: Some(
            FaultConfig::new()
                .seed(5)
                .fail_post(Trigger::every(4), ErrorKind::QueueFull),
        ),
    });
    let sgl = [p.mr.slice(0..16).unwrap()];
    let remote = p.peer_mr.desc();
    p.ep.post_send(&SendWr::write(0x71, &sgl, remote.at(32)))
        .unwrap();
    p.ep.post_recv(&RecvWr::new(0x72, &sgl)).unwrap();
    let peer_sgl = [p.peer_mr.slice(0..8).unwrap()];
    p.peer_ep.post_send(&SendWr::send(9, &peer_sgl)).unwrap();
    take(&p.cq, 2);
    p.ep.post_send(&SendWr::read(0x73, &sgl, remote.at(0)))
        .unwrap();
    // The fourth post is refused by the fault hook: traced, and reported as a fault.
    assert!(p.ep.post_recv(&RecvWr::new(0x74, &sgl)).is_err());
    take(&p.cq, 1);
    p.ep.close().unwrap();
    let Captured(buf) = &captured;
    let extra = p
        .domain
        .register(
            Arc::new(fabric_api::Buffer::new(64)),
            fabric_api::Access::LOCAL_WRITE,
        )
        .unwrap();
    drop(extra);

    let text = String::from_utf8(buf.lock().unwrap().clone()).unwrap();
    if std::env::var_os("SHOW_TRACE").is_some() {
        eprintln!("{text}");
    }
    let lines: Vec<&str> = text.lines().collect();
    let find = |needles: &[&str]| {
        lines
            .iter()
            .find(|l| needles.iter().all(|n| l.contains(n)))
            .unwrap_or_else(|| panic!("no line with {needles:?} in:\n{text}"))
    };
    find(&["fabric hooks active", "seed 5"]);
    find(&["fabric_ep{ep=1", "provider=tcp", "connect"]);
    find(&["register", "len=4096"]);
    find(&["deregister", "len=64"]);
    let write = find(&["post_send", "opcode=Write", "context=113", "len=16"]);
    assert!(
        write.contains("fabric_ep{ep=1"),
        "in the endpoint's span: {write}"
    );
    assert!(
        write.contains(&format!("remote_key={:#x}", remote.key)),
        "{write}"
    );
    assert!(
        write.contains(&format!("remote_addr={:#x}", remote.addr + 32)),
        "{write}"
    );
    find(&["post_recv", "context=114", "len=16"]);
    find(&["post_send", "opcode=Read", "context=115"]);
    find(&[
        "completion",
        "context=113",
        "opcode=Write",
        "status=Success",
        "fabric_ep{ep=1",
    ]);
    find(&[
        "completion",
        "context=114",
        "opcode=Recv",
        "status=Success",
        "byte_len=8",
    ]);
    find(&["completion", "context=115", "opcode=Read", "status=Success"]);
    find(&["post_recv", "context=116"]);
    find(&["injected fault", "fault.fail_post"]);
    find(&["close", "fabric_ep{ep=1"]);
}
