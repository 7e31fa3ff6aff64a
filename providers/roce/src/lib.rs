//! The `roce` provider: RDMA over Converged Ethernet, version 2, on the shared verbs core.
//!
//! Devices: transport InfiniBand over an Ethernet link layer (mlx5 RoCE ports, the kernel's
//! soft-RoCE `rxe`). The provider picks a RoCE **v2** GID that matches the IP address in
//! use (IPv4-mapped `::ffff:a.b.c.d` for IPv4); it never falls back silently to a RoCE v1
//! or a link-local GID: when only those exist the provider is unusable and says why. The
//! device, port, GID index and RoCE version appear in the selection report.
//!
//! Traffic class: [`VerbsOptions::traffic_class`] is the IP type-of-service byte (DSCP in
//! the upper six bits, ECN in the lower two) of the RoCE v2 packets, set with rdma_cm's
//! `RDMA_OPTION_ID_TOS`; lossless classes for PFC and ECN marking are chosen with it (for
//! example DSCP 26 with ECT(0): `traffic_class = 106`).
//!
//! Everything the contract asks is native on RoCE: RC "receiver not ready" waits (RNR
//! retry 7, which verbs defines as infinite), atomics when the device has them
//! (`atomic_cap`), immediate data, error and flush semantics.
#![forbid(unsafe_code)]

use std::net::IpAddr;

use fabric_api::ProviderInfo;
use fabric_verbs::{
    DeviceFacts, Flavor, GidEntry, GidKind, LinkLayer, PortFacts, Profile, Selection, Transport,
};

pub use fabric_verbs::VerbsOptions;

pub use fabric_verbs::SOFT_ROCE_VENDOR_ID;

/// Provider name.
pub const NAME: &str = "roce";

pub use fabric_verbs::IB_CM_PRIVATE_DATA as CM_PRIVATE_DATA;

/// The RoCE flavor of the verbs core.
#[derive(Debug, Clone, Copy, Default)]
pub struct Roce;

/// A RoCE domain.
pub type RoceDomain = fabric_verbs::VerbsDomain<Roce>;
/// A RoCE completion queue.
pub type RoceCq = fabric_verbs::VerbsCq<Roce>;
/// A RoCE endpoint.
pub type RoceEndpoint = fabric_verbs::VerbsEndpoint<Roce>;
/// A RoCE listener.
pub type RoceListener = fabric_verbs::VerbsListener<Roce>;
/// A RoCE connection being set up ([`connect_start`](fabric_api::spi::Domain::connect_start)).
pub type RoceConnecting = fabric_verbs::VerbsConnecting<Roce>;

/// What `discover()` reports for this provider.
pub fn info(opts: &VerbsOptions) -> ProviderInfo {
    fabric_verbs::provider_info::<Roce>(opts)
}

/// Picks the GID to use on `port`: a RoCE v2 GID whose address is `want` (when given),
/// else the first RoCE v2 GID holding an IPv4-mapped address, else the first global RoCE
/// v2 IPv6 GID. Never a RoCE v1 or link-local one: the error says what was there instead.
pub fn select_gid(port: &PortFacts, want: Option<IpAddr>) -> Result<&GidEntry, String> {
    let v2 = |g: &&GidEntry| g.kind == GidKind::RoceV2 && !g.gid.is_link_local();
    let found = match want {
        Some(ip) => port.gids.iter().filter(v2).find(|g| g.gid.ip() == ip),
        None => port
            .gids
            .iter()
            .filter(v2)
            .find(|g| g.gid.is_ipv4_mapped())
            .or_else(|| port.gids.iter().find(v2)),
    };
    if let Some(g) = found {
        return Ok(g);
    }
    let table: Vec<String> = port.gids.iter().map(GidEntry::describe).collect();
    let what = match want {
        Some(ip) => format!("no RoCE v2 GID for address {ip}"),
        None => "no routable RoCE v2 GID (only RoCE v1 or link-local GIDs; give the netdev an IP address)".into(),
    };
    let v1_match = want.is_some_and(|ip| {
        port.gids
            .iter()
            .any(|g| g.kind == GidKind::IbOrRoceV1 && g.gid.ip() == ip)
    });
    let mut msg = format!("port {}: {what}", port.num);
    if v1_match {
        msg.push_str(" (a RoCE v1 GID has it: RoCE v1 is not used, it is not routable)");
    }
    msg.push_str(&format!(
        "; GID table: {}",
        if table.is_empty() {
            "empty".into()
        } else {
            table.join("; ")
        }
    ));
    Err(msg)
}

/// The RoCE version of a GID table entry, as the selection report names it.
pub fn roce_version(g: &GidEntry) -> &'static str {
    match g.kind {
        GidKind::RoceV2 => "RoCE v2",
        GidKind::IbOrRoceV1 => "RoCE v1",
        GidKind::Unknown => "unknown",
    }
}

impl Flavor for Roce {
    const NAME: &'static str = NAME;

    fn accepts(dev: &DeviceFacts) -> Result<(), String> {
        if dev.transport != Transport::InfiniBand {
            return Err(format!(
                "transport {}, not InfiniBand",
                dev.transport.name()
            ));
        }
        if !dev
            .ports
            .iter()
            .any(|p| p.link_layer == LinkLayer::Ethernet)
        {
            return Err("InfiniBand link layer, not Ethernet".into());
        }
        Ok(())
    }

    fn select(dev: &DeviceFacts, opts: &VerbsOptions) -> Result<Selection, String> {
        let mut why = Vec::new();
        for p in dev
            .ports
            .iter()
            .filter(|p| p.link_layer == LinkLayer::Ethernet)
        {
            if !p.is_active() {
                why.push(format!(
                    "port {} is {} (not ACTIVE)",
                    p.num,
                    fabric_verbs::device::port_state_name(p.state)
                ));
                continue;
            }
            match select_gid(p, opts.address) {
                Ok(g) => {
                    let tc = opts.traffic_class.map_or("default (0)".to_string(), |t| {
                        format!("{t} (DSCP {}, ECN {})", t >> 2, t & 3)
                    });
                    return Ok(Selection {
                        port: p.num,
                        addr: Some(g.gid.ip()),
                        gid: Some(g.clone()),
                        summary: format!(
                            "{} port {}, GID index {} {} ({}, {}){}, traffic class {tc}, active MTU {}",
                            dev.name,
                            p.num,
                            g.index,
                            g.gid,
                            g.gid.ip(),
                            roce_version(g),
                            g.netdev.as_ref().map(|n| format!(" on {n}")).unwrap_or_default(),
                            p.active_mtu
                        ),
                    });
                }
                Err(e) => why.push(e),
            }
        }
        Err(if why.is_empty() {
            "no Ethernet port".into()
        } else {
            why.join("; ")
        })
    }

    fn profile(dev: &DeviceFacts) -> Profile {
        Profile::ib_transport(dev)
    }

    fn no_device() -> String {
        "no RoCE device (no RDMA device with InfiniBand transport over an Ethernet link layer)"
            .into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_verbs::Gid;

    fn entry(index: u32, gid: Gid, kind: GidKind) -> GidEntry {
        GidEntry {
            index,
            gid,
            kind,
            netdev: Some("dummy0".into()),
        }
    }

    fn port(gids: Vec<GidEntry>) -> PortFacts {
        PortFacts {
            num: 1,
            state: 4,
            active_mtu: 1024,
            max_mtu: 4096,
            link_layer: LinkLayer::Ethernet,
            max_msg: 1 << 31,
            lid: 0,
            sm_lid: 0,
            lmc: 0,
            gids,
            netdev: Some("dummy0".into()),
            addrs: Vec::new(),
        }
    }

    fn ll() -> Gid {
        Gid::from_parts(0xfe80_0000_0000_0000, 0x5054_00ff_fe12_3456)
    }

    fn v4(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn picks_the_v2_gid_of_the_address_in_use() {
        // rxe's table on dummy0: link-local v1 and v2, then the IPv4-mapped v1 and v2.
        let a = Gid::for_ip(v4("192.168.77.1"));
        let p = port(vec![
            entry(0, ll(), GidKind::IbOrRoceV1),
            entry(1, ll(), GidKind::RoceV2),
            entry(2, a, GidKind::IbOrRoceV1),
            entry(3, a, GidKind::RoceV2),
        ]);
        let g = select_gid(&p, None).unwrap();
        assert_eq!((g.index, g.kind.clone()), (3, GidKind::RoceV2));
        let g = select_gid(&p, Some(v4("192.168.77.1"))).unwrap();
        assert_eq!(g.index, 3);
        assert_eq!(roce_version(g), "RoCE v2");
    }

    #[test]
    fn never_falls_back_to_v1_or_link_local() {
        let a = Gid::for_ip(v4("10.0.0.7"));
        let p = port(vec![
            entry(0, ll(), GidKind::RoceV2),
            entry(1, a, GidKind::IbOrRoceV1),
        ]);
        let e = select_gid(&p, None).unwrap_err();
        assert!(e.contains("no routable RoCE v2 GID"), "{e}");
        let e = select_gid(&p, Some(v4("10.0.0.7"))).unwrap_err();
        assert!(e.contains("RoCE v1 GID has it"), "{e}");
        assert!(e.contains("GID table"), "{e}");
        let e = select_gid(&port(vec![]), None).unwrap_err();
        assert!(e.contains("empty"), "{e}");
    }

    #[test]
    fn prefers_ipv4_mapped_then_global_ipv6_and_honours_a_wanted_address() {
        let v6: IpAddr = "2001:db8::5".parse().unwrap();
        let p = port(vec![
            entry(1, Gid::for_ip(v6), GidKind::RoceV2),
            entry(2, Gid::for_ip(v4("192.168.1.2")), GidKind::RoceV2),
        ]);
        assert_eq!(select_gid(&p, None).unwrap().index, 2);
        assert_eq!(select_gid(&p, Some(v6)).unwrap().index, 1);
        let only6 = port(vec![entry(1, Gid::for_ip(v6), GidKind::RoceV2)]);
        assert_eq!(select_gid(&only6, None).unwrap().index, 1);
        assert!(select_gid(&p, Some(v4("192.168.1.3"))).is_err());
    }

    #[test]
    fn on_a_machine_without_roce_the_provider_says_why() {
        let i = info(&VerbsOptions::default());
        assert_eq!(i.name, NAME);
        if let fabric_api::Availability::Unavailable { reason } = &i.availability {
            assert!(
                reason.starts_with("no RoCE device")
                    || reason.contains("port")
                    || reason.contains("RLIMIT"),
                "{reason}"
            );
        }
    }
}
