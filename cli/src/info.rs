//! `fabric info`.

use std::process::ExitCode;

use fabric::{discover, Availability};

pub(crate) fn run(json: bool) -> Result<ExitCode, String> {
    let providers = discover();
    if json {
        println!(
            "{}",
            serde_json::to_string_pretty(&providers).map_err(|e| e.to_string())?
        );
        return Ok(ExitCode::SUCCESS);
    }
    for p in &providers {
        match &p.availability {
            Availability::Available => println!("{}: available", p.name),
            Availability::Unavailable { reason } => {
                println!("{}: unavailable: {reason}", p.name);
                continue;
            }
        }
        for d in &p.devices {
            println!(
                "  device {}: transport {}, link layer {}",
                d.name, d.transport, d.link_layer
            );
            for (k, v) in &d.details {
                println!("    {k}: {v}");
            }
        }
        let c = &p.caps;
        println!("  operations: {:?}", c.ops);
        let l = &c.limits;
        println!(
            "  limits: max message {} B, max inline {} B, max gather {}, send queue {}, receive queue {}, completion queue {}, outstanding reads/atomics {}, private data {} B",
            l.max_msg_size, l.max_inline, l.max_sge, l.max_send_queue, l.max_recv_queue, l.max_cq_entries, l.max_outstanding_reads, l.max_private_data
        );
        println!("  immediate data: {} bytes", c.imm_size);
        for e in &c.emulated {
            println!("  emulated: {} ({:?}): {}", e.feature, e.ops, e.how);
        }
        for (op, why) in &c.unsupported {
            println!("  unsupported: {op}: {why}");
        }
    }
    Ok(ExitCode::SUCCESS)
}
