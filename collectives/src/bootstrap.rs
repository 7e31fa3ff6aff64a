//! Finding each other: rank and size from the launcher's environment, and a small TCP
//! rendezvous that gathers every rank's endpoint name and hands the table to all.
//!
//! Protocol (all integers u32 little-endian): each rank connects to the rendezvous address
//! and sends `rank, size, len, name[len]`; once all `size` ranks are in, the server sends
//! each of them `size` and then `len, name[len]` for ranks 0 to size-1, and closes.
//!
//! Rank and size come from, in this order: `FABRIC_RANK`/`FABRIC_SIZE`; Open MPI's
//! `OMPI_COMM_WORLD_RANK`/`OMPI_COMM_WORLD_SIZE`; PMIx's `PMIX_RANK` with Open MPI's size;
//! Slurm's `SLURM_PROCID`/`SLURM_NTASKS`. The rendezvous address is `FABRIC_RDV_ADDR`
//! (`host:port`, default `127.0.0.1:29517`); unless `FABRIC_RDV_HOSTED=1` (a launcher
//! such as `fabric allreduce --np N` serves it), rank 0 serves it. Across hosts, set
//! `FABRIC_RDV_ADDR` to an address of rank 0's host and bind the endpoints to an address
//! the other hosts reach.

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use fabric::{Error, ErrorKind, Result};

/// Default rendezvous address.
pub const DEFAULT_RDV: &str = "127.0.0.1:29517";

/// Rank and size from the launcher's environment, if it set them.
pub fn rank_size_from_env() -> Result<Option<(usize, usize)>> {
    rank_size_from(|k| std::env::var(k).ok())
}

/// [`rank_size_from_env`] over any variable look-up.
pub fn rank_size_from(get: impl Fn(&str) -> Option<String>) -> Result<Option<(usize, usize)>> {
    let pairs = [
        ("FABRIC_RANK", "FABRIC_SIZE"),
        ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("PMIX_RANK", "OMPI_COMM_WORLD_SIZE"),
        ("SLURM_PROCID", "SLURM_NTASKS"),
    ];
    for (r, s) in pairs {
        if let (Some(rank), Some(size)) = (get(r), get(s)) {
            let parse = |name: &str, v: &str| {
                v.trim()
                    .parse::<usize>()
                    .map_err(|e| Error::new(ErrorKind::Config, format!("{name}={v:?}: {e}")))
            };
            let (rank, size) = (parse(r, &rank)?, parse(s, &size)?);
            if size == 0 || rank >= size {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("{r}={rank} is not below {s}={size}"),
                ));
            }
            return Ok(Some((rank, size)));
        }
    }
    Ok(None)
}

/// The rendezvous address from `FABRIC_RDV_ADDR`, else [`DEFAULT_RDV`].
pub fn rdv_addr_from_env() -> Result<SocketAddr> {
    let v = std::env::var("FABRIC_RDV_ADDR").unwrap_or_else(|_| DEFAULT_RDV.into());
    v.parse()
        .map_err(|e| Error::new(ErrorKind::Config, format!("FABRIC_RDV_ADDR={v:?}: {e}")))
}

fn put(w: &mut impl Write, v: u32) -> std::io::Result<()> {
    w.write_all(&v.to_le_bytes())
}

fn get(r: &mut impl Read) -> std::io::Result<u32> {
    let mut b = [0u8; 4];
    r.read_exact(&mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// Serves one rendezvous of `size` ranks on `listener`, within `timeout`.
pub fn serve(listener: &TcpListener, size: usize, timeout: Duration) -> Result<()> {
    let deadline = Instant::now() + timeout;
    listener.set_nonblocking(true)?;
    let mut conns: Vec<Option<(TcpStream, Vec<u8>)>> = (0..size).map(|_| None).collect();
    let mut have = 0;
    while have < size {
        match listener.accept() {
            Ok((mut s, _)) => {
                s.set_nonblocking(false)?;
                s.set_read_timeout(Some(
                    deadline
                        .saturating_duration_since(Instant::now())
                        .max(Duration::from_millis(1)),
                ))?;
                let rank = get(&mut s)? as usize;
                let their_size = get(&mut s)? as usize;
                let len = get(&mut s)? as usize;
                if their_size != size || rank >= size || len > 4096 || conns[rank].is_some() {
                    return Err(Error::new(
                        ErrorKind::Protocol,
                        format!("rendezvous: rank {rank} of {their_size} (name {len} bytes) does not fit a job of {size}"),
                    ));
                }
                let mut name = vec![0u8; len];
                s.read_exact(&mut name)?;
                conns[rank] = Some((s, name));
                have += 1;
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                if Instant::now() >= deadline {
                    return Err(Error::new(
                        ErrorKind::TimedOut,
                        format!("rendezvous: {have} of {size} ranks arrived within {timeout:?}"),
                    ));
                }
                std::thread::sleep(Duration::from_millis(2));
            }
            Err(e) => return Err(e.into()),
        }
    }
    let mut table = Vec::new();
    put(&mut table, size as u32)?;
    for (_, name) in conns.iter().flatten() {
        put(&mut table, name.len() as u32)?;
        table.extend_from_slice(name);
    }
    for (s, _) in conns.iter_mut().flatten() {
        s.write_all(&table)?;
    }
    Ok(())
}

/// Sends this rank's `name` to the rendezvous at `rdv` (retrying until it listens) and
/// returns every rank's name, in rank order.
pub fn exchange(
    rdv: SocketAddr,
    rank: usize,
    size: usize,
    name: &[u8],
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    let deadline = Instant::now() + timeout;
    let mut s = loop {
        match TcpStream::connect_timeout(&rdv, Duration::from_secs(1)) {
            Ok(s) => break s,
            Err(e) if Instant::now() < deadline => {
                let _ = e;
                std::thread::sleep(Duration::from_millis(20));
            }
            Err(e) => {
                return Err(Error::new(
                    ErrorKind::TimedOut,
                    format!("rendezvous at {rdv} not reached within {timeout:?}: {e}"),
                ))
            }
        }
    };
    s.set_read_timeout(Some(
        deadline
            .saturating_duration_since(Instant::now())
            .max(Duration::from_millis(1)),
    ))?;
    let mut msg = Vec::new();
    put(&mut msg, rank as u32)?;
    put(&mut msg, size as u32)?;
    put(&mut msg, name.len() as u32)?;
    msg.extend_from_slice(name);
    s.write_all(&msg)?;
    let n = get(&mut s)? as usize;
    if n != size {
        return Err(Error::new(
            ErrorKind::Protocol,
            format!("rendezvous answered {n} ranks, expected {size}"),
        ));
    }
    (0..n)
        .map(|_| {
            let len = get(&mut s)? as usize;
            let mut b = vec![0u8; len];
            s.read_exact(&mut b)?;
            Ok(b)
        })
        .collect()
}

/// [`exchange`], serving the rendezvous from this process when `serve_here` (rank 0
/// under a launcher that does not serve it).
pub fn exchange_or_serve(
    rdv: SocketAddr,
    rank: usize,
    size: usize,
    name: &[u8],
    serve_here: bool,
    timeout: Duration,
) -> Result<Vec<Vec<u8>>> {
    if !serve_here {
        return exchange(rdv, rank, size, name, timeout);
    }
    let listener = TcpListener::bind(rdv)?;
    let server = std::thread::spawn(move || serve(&listener, size, timeout));
    let names = exchange(rdv, rank, size, name, timeout);
    server
        .join()
        .map_err(|_| Error::new(ErrorKind::Io, "rendezvous server panicked"))??;
    names
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[test]
    fn rank_and_size_from_each_launcher() {
        let env = |pairs: &[(&str, &str)]| {
            let m: HashMap<String, String> = pairs
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect();
            move |k: &str| m.get(k).cloned()
        };
        assert_eq!(
            rank_size_from(env(&[
                ("OMPI_COMM_WORLD_RANK", "2"),
                ("OMPI_COMM_WORLD_SIZE", "4")
            ]))
            .unwrap(),
            Some((2, 4))
        );
        assert_eq!(
            rank_size_from(env(&[("SLURM_PROCID", "0"), ("SLURM_NTASKS", "8")])).unwrap(),
            Some((0, 8))
        );
        assert_eq!(rank_size_from(env(&[])).unwrap(), None);
        assert!(rank_size_from(env(&[("FABRIC_RANK", "4"), ("FABRIC_SIZE", "4")])).is_err());
        assert!(rank_size_from(env(&[("FABRIC_RANK", "x"), ("FABRIC_SIZE", "4")])).is_err());
    }

    #[test]
    fn three_ranks_exchange_names() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = l.local_addr().unwrap();
        let server = std::thread::spawn(move || serve(&l, 3, Duration::from_secs(10)));
        let ts: Vec<_> = (0..3)
            .map(|r| {
                std::thread::spawn(move || {
                    exchange(
                        addr,
                        r,
                        3,
                        format!("name{r}").as_bytes(),
                        Duration::from_secs(10),
                    )
                    .unwrap()
                })
            })
            .collect();
        for t in ts {
            assert_eq!(
                t.join().unwrap(),
                vec![b"name0".to_vec(), b"name1".to_vec(), b"name2".to_vec()]
            );
        }
        server.join().unwrap().unwrap();
    }
}
