//! Who is trusted: a client whose source address lies in a configured network, or who
//! carries the shared token. Only trusted clients may pin workers, preview decisions,
//! set priorities and use the admin endpoints.

use std::fmt;
use std::net::IpAddr;
use std::str::FromStr;

use http::{HeaderMap, HeaderName};
use serde::{Deserialize, Deserializer};

use crate::config::TrustConfig;

/// A network in CIDR notation, `10.0.0.0/8` or `fd00::/8`; a bare address is a /32 or /128.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Cidr {
    addr: IpAddr,
    prefix_bits: u8,
}

impl Cidr {
    /// Whether `ip` lies in this network. An IPv4-mapped IPv6 address matches IPv4 networks.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map_or(ip, IpAddr::V4),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                masked(u128::from(u32::from(net)), u128::from(u32::from(ip)), 32, self.prefix_bits)
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => masked(u128::from(net), u128::from(ip), 128, self.prefix_bits),
            _ => false,
        }
    }
}

fn masked(net: u128, ip: u128, width: u8, prefix: u8) -> bool {
    if prefix == 0 {
        return true;
    }
    let shift = u32::from(width - prefix);
    (net >> shift) == (ip >> shift)
}

impl FromStr for Cidr {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let (addr, bits) = match s.split_once('/') {
            Some((a, b)) => (a, Some(b)),
            None => (s, None),
        };
        let addr: IpAddr = addr.parse().map_err(|_| format!("{s:?} is not an IP network"))?;
        let width = if addr.is_ipv4() { 32 } else { 128 };
        let prefix_bits = match bits {
            None => width,
            Some(b) => {
                b.parse::<u8>().ok().filter(|&b| b <= width).ok_or_else(|| format!("{s:?} has a bad prefix length"))?
            }
        };
        Ok(Cidr { addr, prefix_bits })
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_bits)
    }
}

impl<'de> Deserialize<'de> for Cidr {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        String::deserialize(d)?.parse().map_err(serde::de::Error::custom)
    }
}

/// The trust decision for requests.
#[derive(Clone, Debug)]
pub struct Trust {
    cidrs: Vec<Cidr>,
    token_header: HeaderName,
    token: Option<Vec<u8>>,
}

/// The token header when the config names none.
pub const TOKEN_HEADER_DEFAULT: &str = "x-kvroute-token";

impl Trust {
    /// From a validated config.
    pub fn new(cfg: &TrustConfig) -> Self {
        let name = cfg.token_header.as_deref().unwrap_or(TOKEN_HEADER_DEFAULT);
        Trust {
            cidrs: cfg.cidrs.clone(),
            token_header: HeaderName::from_bytes(name.as_bytes())
                .unwrap_or(HeaderName::from_static(TOKEN_HEADER_DEFAULT)),
            token: cfg.token.as_ref().map(|t| t.as_bytes().to_vec()),
        }
    }

    /// Whether a request from `peer` with `headers` is trusted. Work is linear in the
    /// configured networks.
    pub fn is_trusted(&self, peer: IpAddr, headers: &HeaderMap) -> bool {
        if self.cidrs.iter().any(|c| c.contains(peer)) {
            return true;
        }
        match (&self.token, headers.get(&self.token_header)) {
            (Some(want), Some(got)) => constant_time_eq(want, got.as_bytes()),
            _ => false,
        }
    }

    /// The header carrying the token (never forwarded upstream).
    pub fn token_header(&self) -> &HeaderName {
        &self.token_header
    }
}

/// Compares without an early exit, so the time taken says nothing about where a guess
/// first differs.
fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[track_caller]
    fn check(net: &str, ip: &str, inside: bool) {
        let c: Cidr = net.parse().unwrap();
        assert_eq!(c.contains(ip.parse().unwrap()), inside, "{ip} in {net}");
    }

    #[test]
    fn cidr_membership() {
        check("10.0.0.0/8", "10.200.1.1", true);
        check("10.0.0.0/8", "11.0.0.1", false);
        check("127.0.0.1", "127.0.0.1", true);
        check("127.0.0.1", "127.0.0.2", false);
        check("0.0.0.0/0", "8.8.8.8", true);
        check("192.168.1.0/24", "::ffff:192.168.1.9", true);
        check("fd00::/8", "fd12::1", true);
        check("fd00::/8", "fe80::1", false);
        check("::1/128", "127.0.0.1", false);
    }

    #[test]
    fn bad_networks_are_refused() {
        for s in ["10.0.0.0/33", "::/129", "10.0.0/8", "x", "10.0.0.0/-1"] {
            assert!(s.parse::<Cidr>().is_err(), "{s}");
        }
    }

    #[test]
    fn token_trust() {
        let t = Trust::new(&TrustConfig { cidrs: vec![], token_header: None, token: Some("s3cret".into()) });
        let mut h = HeaderMap::new();
        let ip = "203.0.113.5".parse().unwrap();
        assert!(!t.is_trusted(ip, &h));
        h.insert(TOKEN_HEADER_DEFAULT, "s3cre".parse().unwrap());
        assert!(!t.is_trusted(ip, &h));
        h.insert(TOKEN_HEADER_DEFAULT, "s3cret".parse().unwrap());
        assert!(t.is_trusted(ip, &h));
    }
}
