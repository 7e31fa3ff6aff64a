//! The README's middleware example: `cargo run -p fabric-rdm --example tagged -- server`,
//! then `... -- client` in another shell.

use fabric::prelude::*;
use fabric_rdm::{RdmConfig, RdmEndpoint, RecvBuf, Source};
use std::sync::Arc;
use std::time::Duration;

fn main() -> fabric::Result<()> {
    let (domain, report) = fabric::Selector::from_env()?.open()?;
    eprintln!("{report}");
    let domain = Arc::new(domain);
    let ep = RdmEndpoint::new(domain.clone(), RdmConfig::default())?;
    let role = std::env::args().nth(1).unwrap_or_default();
    if role == "server" {
        std::fs::write("/tmp/server.name", ep.name())?; // any out-of-band channel will do
        let buf = Arc::new(domain.alloc(1 << 20, Access::LOCAL_WRITE)?);
        // Any source, tags 0x100..=0x1ff.
        ep.trecv(Source::Any, 0x100, 0xff, RecvBuf::whole(buf.clone()), 1)?;
        let c = ep.next_completion(Duration::from_secs(60))?;
        println!(
            "{:?}: {} bytes, tag {:#x}, from {:?}",
            c.status, c.len, c.tag, c.peer
        );
        // Answer the sender by the handle the message came with.
        let reply = domain.alloc(8, Access::LOCAL_WRITE)?;
        ep.tsend(c.peer.expect("source"), 0x200, reply.all(), 2)?;
        ep.next_completion(Duration::from_secs(60))?;
    } else {
        let server = ep.av_insert_name(&std::fs::read("/tmp/server.name")?)?;
        // 256 KiB: sent by rendezvous, read by the server straight from this region.
        let msg = domain.alloc(256 << 10, Access::LOCAL_WRITE | Access::REMOTE_READ)?;
        ep.tsend(server, 0x142, msg.all(), 1)?;
        let back = Arc::new(domain.alloc(8, Access::LOCAL_WRITE)?);
        ep.trecv(Source::Peer(server), 0x200, 0, RecvBuf::whole(back), 2)?;
        for _ in 0..2 {
            let c = ep.next_completion(Duration::from_secs(60))?;
            println!("{:?} {:?}", c.op, c.status);
        }
    }
    Ok(())
}
