//! GIDs: formatting, their RoCE type from sysfs, and the IP address a RoCE GID encodes.

use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

/// What kind of GID a table entry is (sysfs `gid_attrs/types/<index>`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GidKind {
    /// InfiniBand or RoCE v1 (`IB/RoCE v1`): on an Ethernet port, RoCE v1 (not routable).
    IbOrRoceV1,
    /// RoCE v2 (`RoCE v2`): UDP/IP encapsulated, routable.
    RoceV2,
    /// No type information (iWARP devices, or sysfs not readable).
    Unknown,
}

impl GidKind {
    /// Parses the sysfs text.
    pub fn parse(s: &str) -> GidKind {
        match s.trim() {
            "RoCE v2" => GidKind::RoceV2,
            "IB/RoCE v1" => GidKind::IbOrRoceV1,
            _ => GidKind::Unknown,
        }
    }

    /// Short name for reports.
    pub fn as_str(&self) -> &'static str {
        match self {
            GidKind::IbOrRoceV1 => "IB/RoCE v1",
            GidKind::RoceV2 => "RoCE v2",
            GidKind::Unknown => "-",
        }
    }
}

/// A 128-bit GID.
#[derive(Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct Gid(pub [u8; 16]);

impl Gid {
    /// All zero (an empty table slot).
    pub fn is_zero(&self) -> bool {
        self.0 == [0; 16]
    }

    /// The GID read as an IPv6 address.
    pub fn as_ipv6(&self) -> Ipv6Addr {
        Ipv6Addr::from(self.0)
    }

    /// The IP address a RoCE GID stands for: IPv4 when IPv4-mapped (`::ffff:a.b.c.d`).
    pub fn ip(&self) -> IpAddr {
        let v6 = self.as_ipv6();
        match v6.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => IpAddr::V6(v6),
        }
    }

    /// The GID a RoCE v2 port uses for `ip` (IPv4-mapped for IPv4).
    pub fn for_ip(ip: IpAddr) -> Gid {
        match ip {
            IpAddr::V4(v4) => Gid(v4.to_ipv6_mapped().octets()),
            IpAddr::V6(v6) => Gid(v6.octets()),
        }
    }

    /// True for `fe80::/10` (link-local, derived from the MAC; never chosen for routing).
    pub fn is_link_local(&self) -> bool {
        self.0[0] == 0xfe && self.0[1] & 0xc0 == 0x80
    }

    /// True when the GID is an IPv4-mapped address.
    pub fn is_ipv4_mapped(&self) -> bool {
        self.as_ipv6().to_ipv4_mapped().is_some()
    }

    /// Subnet prefix (upper 64 bits, host order).
    pub fn subnet_prefix(&self) -> u64 {
        u64::from_be_bytes(self.0[..8].try_into().expect("8 bytes"))
    }

    /// Interface id (lower 64 bits, host order).
    pub fn interface_id(&self) -> u64 {
        u64::from_be_bytes(self.0[8..].try_into().expect("8 bytes"))
    }

    /// A GID from a subnet prefix and an interface id (InfiniBand port GIDs).
    pub fn from_parts(prefix: u64, guid: u64) -> Gid {
        let mut g = [0u8; 16];
        g[..8].copy_from_slice(&prefix.to_be_bytes());
        g[8..].copy_from_slice(&guid.to_be_bytes());
        Gid(g)
    }
}

impl fmt::Display for Gid {
    /// rdma-core's colon notation: eight groups of four hex digits.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for i in 0..8 {
            if i > 0 {
                f.write_str(":")?;
            }
            write!(f, "{:02x}{:02x}", self.0[2 * i], self.0[2 * i + 1])?;
        }
        Ok(())
    }
}

impl fmt::Debug for Gid {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Gid({self})")
    }
}

/// One entry of a port's GID table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct GidEntry {
    /// Index in the table (the `sgid_index` of an address vector).
    pub index: u32,
    /// The GID.
    pub gid: Gid,
    /// Its type.
    pub kind: GidKind,
    /// The network device it belongs to (RoCE), when sysfs says.
    pub netdev: Option<String>,
}

impl GidEntry {
    /// One-line description for `fabric info`.
    pub fn describe(&self) -> String {
        let mut s = format!("[{}] {} {}", self.index, self.gid, self.kind.as_str());
        if self.kind != GidKind::Unknown && !self.gid.is_link_local() {
            s.push_str(&format!(" ({})", self.gid.ip()));
        }
        if let Some(n) = &self.netdev {
            s.push_str(&format!(" on {n}"));
        }
        s
    }
}

/// The IPv4 address of an IPv4-mapped GID.
pub fn mapped_v4(g: &Gid) -> Option<Ipv4Addr> {
    g.as_ipv6().to_ipv4_mapped()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gids_format_parse_and_classify() {
        let v4: Ipv4Addr = "192.168.77.1".parse().unwrap();
        let g = Gid::for_ip(IpAddr::V4(v4));
        assert_eq!(g.to_string(), "0000:0000:0000:0000:0000:ffff:c0a8:4d01");
        assert_eq!(g.ip(), IpAddr::V4(v4));
        assert!(g.is_ipv4_mapped() && !g.is_link_local());
        assert_eq!(mapped_v4(&g), Some(v4));
        let ll = Gid::from_parts(0xfe80_0000_0000_0000, 0x0211_22ff_fe33_4455);
        assert!(ll.is_link_local() && !ll.is_ipv4_mapped());
        assert_eq!(ll.subnet_prefix(), 0xfe80_0000_0000_0000);
        assert_eq!(ll.interface_id(), 0x0211_22ff_fe33_4455);
        assert_eq!(GidKind::parse("RoCE v2\n"), GidKind::RoceV2);
        assert_eq!(GidKind::parse("IB/RoCE v1"), GidKind::IbOrRoceV1);
        assert_eq!(GidKind::parse(""), GidKind::Unknown);
        assert!(Gid::default().is_zero());
        let e = GidEntry {
            index: 1,
            gid: g,
            kind: GidKind::RoceV2,
            netdev: Some("dummy0".into()),
        };
        assert_eq!(
            e.describe(),
            "[1] 0000:0000:0000:0000:0000:ffff:c0a8:4d01 RoCE v2 (192.168.77.1) on dummy0"
        );
    }
}
