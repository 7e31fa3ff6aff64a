//! The `ib` provider: native InfiniBand on the shared verbs core.
//!
//! Devices: transport InfiniBand over an InfiniBand link layer (mlx4/mlx5 IB ports). Ports
//! are addressed by LID inside a subnet (the subnet manager assigns them) and by GID
//! across subnets; connections go through rdma_cm over IPoIB, which resolves an IP
//! address to a GID and a path record (see [`addr`]).
//!
//! There is no software InfiniBand: on machines without an InfiniBand HCA the provider
//! reports itself unavailable ("no InfiniBand device"), and never passes a test vacuously.
#![forbid(unsafe_code)]

pub mod addr;

use fabric_api::ProviderInfo;
use fabric_verbs::{DeviceFacts, Flavor, LinkLayer, Profile, Selection, Transport};

pub use fabric_verbs::VerbsOptions;

pub use fabric_verbs::SOFT_ROCE_VENDOR_ID;

/// Provider name.
pub const NAME: &str = "ib";

pub use fabric_verbs::IB_CM_PRIVATE_DATA as CM_PRIVATE_DATA;

/// The InfiniBand flavor of the verbs core.
#[derive(Debug, Clone, Copy, Default)]
pub struct Ib;

/// An InfiniBand domain.
pub type IbDomain = fabric_verbs::VerbsDomain<Ib>;
/// An InfiniBand completion queue.
pub type IbCq = fabric_verbs::VerbsCq<Ib>;
/// An InfiniBand endpoint.
pub type IbEndpoint = fabric_verbs::VerbsEndpoint<Ib>;
/// An InfiniBand listener.
pub type IbListener = fabric_verbs::VerbsListener<Ib>;
/// An InfiniBand connection being set up ([`connect_start`](fabric_api::spi::Domain::connect_start)).
pub type IbConnecting = fabric_verbs::VerbsConnecting<Ib>;

/// What `discover()` reports for this provider.
pub fn info(opts: &VerbsOptions) -> ProviderInfo {
    fabric_verbs::provider_info::<Ib>(opts)
}

fn is_ib(l: LinkLayer) -> bool {
    // Old drivers leave the link layer unspecified on InfiniBand ports.
    matches!(l, LinkLayer::InfiniBand | LinkLayer::Unspecified)
}

impl Flavor for Ib {
    const NAME: &'static str = NAME;

    fn accepts(dev: &DeviceFacts) -> Result<(), String> {
        if dev.transport != Transport::InfiniBand {
            return Err(format!(
                "transport {}, not InfiniBand",
                dev.transport.name()
            ));
        }
        if !dev.ports.iter().any(|p| is_ib(p.link_layer)) {
            return Err("Ethernet link layer (RoCE), not InfiniBand".into());
        }
        Ok(())
    }

    fn select(dev: &DeviceFacts, opts: &VerbsOptions) -> Result<Selection, String> {
        let mut why = Vec::new();
        for p in dev.ports.iter().filter(|p| is_ib(p.link_layer)) {
            match addr::PortAddress::of_port(p) {
                Ok(a) => {
                    let ip = match opts.address {
                        Some(w) if p.addrs.contains(&w) => Some(w),
                        Some(w) => {
                            why.push(format!(
                                "port {}: {w} is not an IPoIB address of this port",
                                p.num
                            ));
                            continue;
                        }
                        None => p
                            .addrs
                            .iter()
                            .find(|a| a.is_ipv4())
                            .or(p.addrs.first())
                            .copied(),
                    };
                    let Some(ip) = ip else {
                        why.push(format!(
                            "port {}: no IPoIB address (rdma_cm needs one)",
                            p.num
                        ));
                        continue;
                    };
                    return Ok(Selection {
                        port: p.num,
                        addr: Some(ip),
                        gid: p.gids.first().cloned(),
                        summary: format!(
                            "{} port {}, {a}, IPoIB address {ip}, active MTU {}",
                            dev.name, p.num, p.active_mtu
                        ),
                    });
                }
                Err(e) => why.push(format!("port {}: {e}", p.num)),
            }
        }
        Err(if why.is_empty() {
            "no InfiniBand port".into()
        } else {
            why.join("; ")
        })
    }

    fn profile(dev: &DeviceFacts) -> Profile {
        Profile::ib_transport(dev)
    }

    fn no_device() -> String {
        "no InfiniBand device (no RDMA device with an InfiniBand link layer)".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn without_an_infiniband_hca_the_provider_is_unavailable_and_says_so() {
        let i = info(&VerbsOptions::default());
        assert_eq!(i.name, NAME);
        // These machines have no InfiniBand HCA (rxe and siw are Ethernet): never usable.
        if std::env::var_os("FABRIC_HAVE_IB").is_none() {
            match &i.availability {
                fabric_api::Availability::Unavailable { reason } => {
                    assert!(reason.starts_with("no InfiniBand device"), "{reason}")
                }
                other => panic!("ib available without an InfiniBand HCA: {other:?}"),
            }
        }
    }
}
