//! The conformance suite: docs/contract.md sections 2 to 9 as test cases, written once and
//! instantiated per provider.
//!
//! Every case runs against a provider chosen by name through the same run-time selection
//! applications use. Outcomes are [`Outcome::Pass`], [`Outcome::Fail`],
//! [`Outcome::Unsupported`] (only where the provider's capabilities, or what the connection
//! negotiated (`Endpoint::ops`), lack what the case needs, and only after the suite checked
//! that posting it returns `Unsupported`; `RNR_WAIT`, `READ_PROTECTION` and
//! `LISTEN_EARLY_CLOSE` are guarantees rather than operations) and
//! [`Outcome::NoDevice`] (the provider could not run here, with the reason). A provider that
//! could not run never passes.
//!
//! Cases marked multi-process start their peer as a separate process: the `fabric` binary's
//! hidden `peer` subcommand, which runs [`peer::main`].
//!
//! Each case carries the number of the contract section it proves ([`Case::section`]);
//! `docs/contract.md` lists, section by section, the cases and every provider's documented
//! deviations.
#![forbid(unsafe_code)]

mod cases;
pub mod harness;
pub mod peer;
pub mod report;

pub use cases::all_cases;
pub use harness::{Case, Ctx, Outcome};
pub use report::{CaseResult, Report};

/// True when a case called `name` is selected by `filter`: comma-separated substrings, any
/// of which selects (empty pieces are ignored; nothing but them selects every case).
pub fn filter_matches(filter: &str, name: &str) -> bool {
    let mut pieces = filter
        .split(',')
        .map(str::trim)
        .filter(|p| !p.is_empty())
        .peekable();
    pieces.peek().is_none() || pieces.any(|p| name.contains(p))
}

/// Runs every case (or those `filter` selects, see [`filter_matches`]) against each provider
/// label: a provider name, or `initiator>target` for a mixed pair (see [`Ctx::from_label`]).
pub fn run(
    providers: &[String],
    filter: Option<&str>,
    peer_exe: Option<std::path::PathBuf>,
    mut progress: impl FnMut(&CaseResult),
) -> Report {
    let mut results = Vec::new();
    for p in providers {
        let ctx = Ctx::from_label(p, peer_exe.clone());
        for case in all_cases() {
            if filter.is_some_and(|f| !filter_matches(f, case.name)) {
                continue;
            }
            let r = harness::run_case(&ctx, &case);
            progress(&r);
            results.push(r);
        }
    }
    Report {
        providers: providers.to_vec(),
        cases: results,
    }
}

#[cfg(test)]
mod tests {
    use super::filter_matches;

    #[test]
    fn a_filter_selects_by_any_of_its_substrings() {
        assert!(filter_matches("msg.", "msg.send_recv"));
        assert!(!filter_matches("msg.", "rma.write"));
        assert!(filter_matches("msg.,rma.", "rma.write"));
        assert!(filter_matches(" rma.w , x", "rma.write"));
        assert!(!filter_matches("msg.,cq.", "rma.write"));
        assert!(filter_matches("", "rma.write"));
        assert!(filter_matches(",", "rma.write"));
        assert!(!filter_matches(",msg.", "rma.write"));
    }
}
