//! Section 6.

use crate::harness::Case;

pub(super) fn cases() -> Vec<Case> {
    Vec::new()
}
