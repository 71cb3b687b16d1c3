//! Which TCP addresses a process listens on, read from `/proc` (Linux only),
//! so a test can prove every component is reachable on 127.0.0.1 only.

use std::collections::HashSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::Path;

use crate::error::{Error, Result};

/// TCP state code of a listening socket in `/proc/net/tcp`.
const TCP_LISTEN: &str = "0A";

/// The addresses `pid` has listening TCP sockets on (IPv4 and IPv6).
///
/// # Errors
/// When `/proc/<pid>` cannot be read (the process is gone, or this is not Linux).
pub fn listening_addresses(pid: u32) -> Result<Vec<SocketAddr>> {
    let proc_dir = Path::new("/proc").join(pid.to_string());
    let io_error = |path: &Path| {
        let path = path.to_owned();
        move |source| Error::Io { path, source }
    };
    // A socket belongs to the process if one of its fds links to socket:[inode].
    let fd_dir = proc_dir.join("fd");
    let mut inodes = HashSet::new();
    for entry in std::fs::read_dir(&fd_dir).map_err(io_error(&fd_dir))? {
        let Ok(entry) = entry else { continue };
        // fds come and go while we read; a vanished one is simply not a socket of interest.
        let Ok(target) = std::fs::read_link(entry.path()) else {
            continue;
        };
        if let Some(inode) = target
            .to_str()
            .and_then(|t| t.strip_prefix("socket:["))
            .and_then(|t| t.strip_suffix(']'))
        {
            inodes.insert(inode.to_owned());
        }
    }
    let mut addresses = Vec::new();
    for table in ["tcp", "tcp6"] {
        let path = proc_dir.join("net").join(table);
        let text = std::fs::read_to_string(&path).map_err(io_error(&path))?;
        addresses.extend(parse_listening(&text, &inodes));
    }
    Ok(addresses)
}

fn parse_listening(table: &str, inodes: &HashSet<String>) -> Vec<SocketAddr> {
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
            (*state == TCP_LISTEN && inodes.contains(*inode)).then(|| parse_address(local))?
        })
        .collect()
}

/// `0100007F:1F90` → 127.0.0.1:8080 (on a little-endian host). The kernel
/// prints each 32-bit word of the network-order address as a native integer,
/// so the word's native bytes are the address bytes; the port is a plain number.
fn parse_address(hex: &str) -> Option<SocketAddr> {
    let (address, port) = hex.split_once(':')?;
    let port = u16::from_str_radix(port, 16).ok()?;
    let words: Vec<u32> = (0..address.len() / 8)
        .map(|i| u32::from_str_radix(address.get(i * 8..i * 8 + 8).unwrap_or_default(), 16))
        .collect::<std::result::Result<_, _>>()
        .ok()?;
    let ip = match words.as_slice() {
        [word] => IpAddr::V4(Ipv4Addr::from(word.to_ne_bytes())),
        [a, b, c, d] => {
            let mut octets = [0u8; 16];
            for (chunk, word) in octets.chunks_exact_mut(4).zip([a, b, c, d]) {
                chunk.copy_from_slice(&word.to_ne_bytes());
            }
            IpAddr::V6(Ipv6Addr::from(octets))
        }
        _ => return None,
    };
    Some(SocketAddr::new(ip, port))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_ipv4_and_ipv6_listeners_of_the_given_inodes() {
        let tcp = "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 0100007F:7FFE 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 111 1 0\n\
   1: 00000000:0016 00000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 222 1 0\n\
   2: 0100007F:7FFE 0100007F:9C40 01 00000000:00000000 00:00000000 00000000     0        0 333 1 0\n";
        let tcp6 = "  sl  local_address                         remote_address                        st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n\
   0: 00000000000000000000000001000000:1F90 00000000000000000000000000000000:0000 0A 00000000:00000000 00:00000000 00000000     0        0 444 1 0\n";
        let ours: HashSet<String> = ["111", "222", "333", "444"].map(String::from).into();
        let v4 = parse_listening(tcp, &ours);
        assert_eq!(
            v4,
            vec![
                "127.0.0.1:32766".parse().expect("addr"),
                "0.0.0.0:22".parse().expect("addr")
            ]
        );
        let v6 = parse_listening(tcp6, &ours);
        assert_eq!(v6, vec!["[::1]:8080".parse().expect("addr")]);
        let not_ours = parse_listening(tcp, &HashSet::new());
        assert!(not_ours.is_empty());
    }
}
