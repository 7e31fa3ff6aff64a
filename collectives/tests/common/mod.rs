//! What the collectives' integration tests share: ranks as threads in one process, each
//! with its own tcp domain and RDM endpoint.

use std::sync::Arc;

use fabric::prelude::*;
use fabric_collectives::{Comm, CommConfig};
use fabric_rdm::{RdmConfig, RdmEndpoint};

/// Runs `f` on `n` ranks; each gets its communicator and its domain (to register in).
pub fn run_with<R: Send + 'static>(
    n: usize,
    cfg: CommConfig,
    f: impl Fn(&mut Comm, &AnyDomain) -> R + Send + Sync + 'static,
) -> Vec<R> {
    let mut eps = Vec::new();
    for _ in 0..n {
        let (d, _) = fabric::Selector::new()
            .providers("tcp")
            .and_then(|s| s.open())
            .expect("tcp");
        let d = Arc::new(d);
        let ep = RdmEndpoint::new(d.clone(), RdmConfig::default()).expect("endpoint");
        eps.push((d, ep));
    }
    let names: Vec<Vec<u8>> = eps.iter().map(|(_, e)| e.name()).collect();
    let f = Arc::new(f);
    let hs: Vec<_> = eps
        .into_iter()
        .enumerate()
        .map(|(r, (d, ep))| {
            let (names, f) = (names.clone(), f.clone());
            std::thread::spawn(move || {
                let mut c = Comm::new(d.clone(), ep, r, &names, cfg).expect("comm");
                f(&mut c, &d)
            })
        })
        .collect();
    hs.into_iter().map(|h| h.join().expect("rank")).collect()
}
