//! InfiniBand addressing: LIDs, port GIDs and the path record rdma_cm resolves for a
//! connection, as plain data checked on its own (no HCA needed).

use std::fmt;

use fabric_verbs::{Gid, PortFacts};

/// The default GID subnet prefix (IBTA: fe80::/64 until the SM assigns another).
pub const DEFAULT_SUBNET_PREFIX: u64 = 0xfe80_0000_0000_0000;
/// The default partition key (full membership).
pub const DEFAULT_PKEY: u16 = 0xffff;

/// What kind of LID a 16-bit value is (IBTA vol. 1, 4.1.3).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LidKind {
    /// 0: reserved, no LID assigned (the port is not configured by a subnet manager).
    Unassigned,
    /// 0x0001..=0xbfff.
    Unicast,
    /// 0xc000..=0xfffe.
    Multicast,
    /// 0xffff.
    Permissive,
}

/// Classifies a LID.
pub fn lid_kind(lid: u16) -> LidKind {
    match lid {
        0 => LidKind::Unassigned,
        0x0001..=0xbfff => LidKind::Unicast,
        0xc000..=0xfffe => LidKind::Multicast,
        0xffff => LidKind::Permissive,
    }
}

/// The LIDs a port answers to: base LID plus every path-bits value its LMC allows.
pub fn lid_range(base: u16, lmc: u8) -> Result<std::ops::RangeInclusive<u16>, String> {
    if lmc > 7 {
        return Err(format!("LMC {lmc} above 7"));
    }
    if lid_kind(base) != LidKind::Unicast {
        return Err(format!("base LID {base:#06x} is not a unicast LID"));
    }
    let n = 1u16 << lmc;
    if base & (n - 1) != 0 {
        return Err(format!(
            "base LID {base:#06x} is not aligned to its LMC {lmc}"
        ));
    }
    let last = base
        .checked_add(n - 1)
        .filter(|l| lid_kind(*l) == LidKind::Unicast)
        .ok_or_else(|| format!("LIDs {base:#06x} + {n} run out of the unicast range"))?;
    Ok(base..=last)
}

/// A port's own address.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PortAddress {
    /// Port number.
    pub port: u8,
    /// Base LID.
    pub lid: u16,
    /// LID mask control.
    pub lmc: u8,
    /// The subnet manager's LID.
    pub sm_lid: u16,
    /// GID index 0: subnet prefix and port GUID.
    pub gid: Gid,
}

impl PortAddress {
    /// The address of a configured, active InfiniBand port, or why it has none.
    pub fn of_port(p: &PortFacts) -> Result<PortAddress, String> {
        if !p.is_active() {
            return Err(format!(
                "port is {} (not ACTIVE)",
                fabric_verbs::device::port_state_name(p.state)
            ));
        }
        lid_range(p.lid, p.lmc)
            .map_err(|e| format!("no usable LID ({e}); is a subnet manager running?"))?;
        if lid_kind(p.sm_lid) != LidKind::Unicast {
            return Err(format!(
                "subnet manager LID {:#06x} is not unicast",
                p.sm_lid
            ));
        }
        let gid = p
            .gids
            .iter()
            .find(|g| g.index == 0)
            .map(|g| g.gid)
            .ok_or("GID table has no entry 0")?;
        Ok(PortAddress {
            port: p.num,
            lid: p.lid,
            lmc: p.lmc,
            sm_lid: p.sm_lid,
            gid,
        })
    }

    /// The source LID for `path_bits` (which of the LMC paths to use).
    pub fn slid(&self, path_bits: u8) -> Result<u16, String> {
        let n = 1u16 << self.lmc;
        if u16::from(path_bits) >= n {
            return Err(format!("path bits {path_bits} outside LMC {}", self.lmc));
        }
        Ok(self.lid | u16::from(path_bits))
    }
}

impl fmt::Display for PortAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "LID {:#06x} (LMC {}), SM LID {:#06x}, GID {}",
            self.lid, self.lmc, self.sm_lid, self.gid
        )
    }
}

/// The fields of a path record (SA PathRecord) that an RC connection uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PathRecord {
    /// Destination GID.
    pub dgid: Gid,
    /// Source GID.
    pub sgid: Gid,
    /// Destination LID.
    pub dlid: u16,
    /// Source LID.
    pub slid: u16,
    /// Partition key.
    pub pkey: u16,
    /// Path MTU in bytes.
    pub mtu: u32,
    /// Service level.
    pub sl: u8,
    /// Whether the packets need a global route header (different subnets).
    pub global: bool,
    /// Hop limit (with a GRH).
    pub hop_limit: u8,
}

/// Builds the path from `local` (using `path_bits`) to a remote port, checking what the
/// subnet rules require: unicast LIDs, a GRH when the subnet prefixes differ, an MTU both
/// ends support.
pub fn path_record(
    local: &PortAddress,
    path_bits: u8,
    remote_lid: u16,
    remote_gid: Gid,
    local_mtu: u32,
    remote_mtu: u32,
    sl: u8,
) -> Result<PathRecord, String> {
    if lid_kind(remote_lid) != LidKind::Unicast {
        return Err(format!("destination LID {remote_lid:#06x} is not unicast"));
    }
    if sl > 15 {
        return Err(format!("service level {sl} above 15"));
    }
    let mtu = local_mtu.min(remote_mtu);
    if ![256, 512, 1024, 2048, 4096].contains(&mtu) {
        return Err(format!("path MTU {mtu} is not an InfiniBand MTU"));
    }
    let global = remote_gid.subnet_prefix() != local.gid.subnet_prefix();
    Ok(PathRecord {
        dgid: remote_gid,
        sgid: local.gid,
        dlid: remote_lid,
        slid: local.slid(path_bits)?,
        pkey: DEFAULT_PKEY,
        mtu,
        sl,
        global,
        hop_limit: if global { 64 } else { 0 },
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use fabric_verbs::{GidEntry, GidKind, LinkLayer};

    fn port(lid: u16, lmc: u8, state: u32) -> PortFacts {
        PortFacts {
            num: 1,
            state,
            active_mtu: 4096,
            max_mtu: 4096,
            link_layer: LinkLayer::InfiniBand,
            max_msg: 1 << 30,
            lid,
            sm_lid: 1,
            lmc,
            gids: vec![GidEntry {
                index: 0,
                gid: Gid::from_parts(DEFAULT_SUBNET_PREFIX, 0x0002_c903_0001_2345),
                kind: GidKind::Unknown,
                netdev: None,
            }],
            netdev: None,
            addrs: Vec::new(),
        }
    }

    #[test]
    fn lids_are_classified_and_ranges_respect_the_lmc() {
        assert_eq!(lid_kind(0), LidKind::Unassigned);
        assert_eq!(lid_kind(1), LidKind::Unicast);
        assert_eq!(lid_kind(0xbfff), LidKind::Unicast);
        assert_eq!(lid_kind(0xc000), LidKind::Multicast);
        assert_eq!(lid_kind(0xffff), LidKind::Permissive);
        assert_eq!(lid_range(8, 2).unwrap(), 8..=11);
        assert!(lid_range(9, 2).unwrap_err().contains("aligned"));
        assert!(lid_range(0, 0).is_err());
        assert_eq!(lid_range(0xbff8, 3).unwrap(), 0xbff8..=0xbfff);
        assert!(lid_range(0xc000, 0).is_err());
        assert!(lid_range(8, 8).is_err());
    }

    #[test]
    fn port_addresses_need_an_active_configured_port() {
        let a = PortAddress::of_port(&port(0x12, 1, 4)).unwrap();
        assert_eq!(a.slid(1).unwrap(), 0x13);
        assert!(a.slid(2).is_err());
        assert_eq!(a.gid.interface_id(), 0x0002_c903_0001_2345);
        assert!(a.to_string().contains("LID 0x0012"));
        assert!(PortAddress::of_port(&port(0x12, 0, 1))
            .unwrap_err()
            .contains("DOWN"));
        assert!(PortAddress::of_port(&port(0, 0, 4))
            .unwrap_err()
            .contains("subnet manager"));
    }

    #[test]
    fn path_records_pick_mtu_slid_and_grh() {
        let a = PortAddress::of_port(&port(0x20, 2, 4)).unwrap();
        let same = Gid::from_parts(DEFAULT_SUBNET_PREFIX, 7);
        let p = path_record(&a, 3, 0x40, same, 4096, 2048, 0).unwrap();
        assert_eq!(
            (p.slid, p.dlid, p.mtu, p.global, p.pkey),
            (0x23, 0x40, 2048, false, 0xffff)
        );
        let other = Gid::from_parts(0xfec0_0000_0000_0001, 7);
        let p = path_record(&a, 0, 0x40, other, 4096, 4096, 3).unwrap();
        assert!(p.global && p.hop_limit > 0);
        assert!(path_record(&a, 0, 0xc001, same, 4096, 4096, 0).is_err());
        assert!(path_record(&a, 0, 0x40, same, 4096, 1000, 0).is_err());
        assert!(path_record(&a, 0, 0x40, same, 4096, 4096, 16).is_err());
        assert!(path_record(&a, 4, 0x40, same, 4096, 4096, 0).is_err());
    }
}
