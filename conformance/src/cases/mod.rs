//! The cases, one module per section of semantics.md.

use fabric::OpSet;

use crate::harness::Case;

mod msg;
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
    v.extend(msg::cases());
    v.extend(rma::cases());
    v
}

#[allow(dead_code)]
pub(crate) const NONE: OpSet = OpSet::empty();
