//! The cases, one module per section of the contract (docs/contract.md).

use crate::harness::Case;

mod atomic;
mod backlog;
mod bad;
mod conn;
mod cq;
mod fault;
mod mr;
mod msg;
mod rdm;
mod rma;

/// Declares cases: `name, section, needs => body`.
macro_rules! cases {
    ($($name:literal, $section:literal, $needs:expr => $run:path;)*) => {
        vec![$(Case { name: $name, section: $section, needs: $needs, run: $run }),*]
    };
}
pub(crate) use cases;

/// Every case, in section order.
pub fn all_cases() -> Vec<Case> {
    let mut v = Vec::new();
    v.extend(mr::cases());
    v.extend(msg::cases());
    v.extend(rma::cases());
    v.extend(atomic::cases());
    v.extend(cq::cases());
    v.extend(backlog::cases());
    v.extend(conn::cases());
    v.extend(bad::cases());
    v.extend(fault::cases());
    v.extend(rdm::cases());
    v
}
