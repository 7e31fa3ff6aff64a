//! `fabric reliability <conformance.json>...`: RELIABILITY.md from conformance reports.
//!
//! Reads JSON reports (`fabric conformance --format json`), keeps the fault and
//! reliability scenarios (the `fault.*` cases, `conn.peer_killed_mid_transfer`,
//! `conn.peer_exit_is_a_disconnect`, `conn.graceful_close_flushes_both_sides`, the `bad.*`
//! hostile-input cases, `cq.error_state_flushes_and_refuses` and
//! `msg.both_directions_at_once`) and writes a markdown
//! table, scenario x provider, with each outcome and the time the case took next to the
//! bound it holds the provider to, then every case's detail (what it observed or why it
//! failed). Nothing in the document is written by hand: the bounds are the cases' own.

use std::collections::BTreeMap;
use std::fmt::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use fabric_conformance::{CaseResult, Report};

/// Cases outside `fault.*` and `bad.*` that belong in the document.
const EXTRA: [&str; 5] = [
    "conn.peer_killed_mid_transfer",
    "conn.peer_exit_is_a_disconnect",
    "conn.graceful_close_flushes_both_sides",
    "cq.error_state_flushes_and_refuses",
    "msg.both_directions_at_once",
];

/// True for the cases RELIABILITY.md covers.
pub(crate) fn selected(name: &str) -> bool {
    name.starts_with("fault.") || name.starts_with("bad.") || EXTRA.contains(&name)
}

/// The scenario a case provokes and the bound it holds providers to (from the case's code).
fn scenario(name: &str) -> (&'static str, &'static str) {
    match name {
        "fault.listener_gone" => (
            "listener dropped with a connection established: the connection keeps working both ways; a new connect is refused",
            "ConnectionRefused < 3 s",
        ),
        "fault.close_with_ops_in_flight" => (
            "close with 32 sends, 4 x 1 MiB writes and 4 x 1 MiB reads in flight: each completes once, in post order, Success or Flushed; the peer sees the disconnect and flushes its receives; what succeeded is intact",
            "peer Disconnected < 5 s; each completion < 10 s",
        ),
        "fault.deregister_while_peer_writes" => (
            "a peer process keeps RDMA Writes in flight while the target deregisters the region: the writer fails RemoteAccess, both ends in error, the memory stops changing, canaries untouched",
            "RemoteAccess < 5 s",
        ),
        "fault.silent_peer_host" => (
            "the peer host goes silent (nftables drops its packets; roce in the soft-RDMA guest: rxe1 to a peer on rxe2 across a veth pair, as rxe's in-kernel loopback between queue pairs of one device passes no filter) with an RDMA Read outstanding: the Read fails RetryExceeded",
            "the initiator's dead-peer bound: tcp and iwarp 10 s (dead_peer_timeout_ms), roce 1.879 s (ACK timeout x retries); + max(1 s, 25 %) timer slack",
        ),
        "conn.peer_killed_mid_transfer" => (
            "peer process SIGKILLed with 4 sends and a 64 KiB write outstanding: all complete, in order, sends not Success; posts refused after",
            "all errors < 10 s",
        ),
        "conn.peer_exit_is_a_disconnect" => (
            "peer process exits normally: this end reads it as a disconnect",
            "Disconnected < 5 s",
        ),
        "conn.graceful_close_flushes_both_sides" => (
            "graceful close with receives posted on both sides: both sides' receives complete Flushed, the peer sees Disconnected",
            "Disconnected < 5 s",
        ),
        "cq.error_state_flushes_and_refuses" => (
            "a remote access error behind a long write: the error, then everything outstanding Flushed in post order; new posts refused",
            "each completion < 10 s",
        ),
        "bad.oversized_private_data" => (
            "private data one byte over the maximum on connect",
            "InvalidArgument at once",
        ),
        "bad.queue_depths_and_capacity" => (
            "queue depths and completion-queue capacities of 0 and over the limits",
            "InvalidArgument at once",
        ),
        "bad.atomic_result_not_8_bytes" => (
            "an atomic whose result buffer is not 8 bytes",
            "refused at post",
        ),
        "bad.unknown_provider_and_config" => (
            "unknown provider names and malformed configuration",
            "an error naming the key",
        ),
        "bad.garbage_to_listener" => (
            "hostile clients send garbage, a truncated request, an oversized length and silence to a listener, and stay connected: it still serves a good client",
            "good client served < 10 s",
        ),
        "bad.client_closes_before_accept" => (
            "eight clients connect and close at once, before the listener accepted them (four silent, four with an MPA key): it still serves a good client",
            "good client served < 10 s",
        ),
        "bad.error_keeps_acknowledged_data" => (
            "a bad-key write after an acknowledged write: RemoteAccess; acknowledged data unchanged, refused write places nothing",
            "RemoteAccess < 10 s",
        ),
        "msg.both_directions_at_once" => (
            "both ends send 1000 messages to each other at once, from a thread each, 8 outstanding a side: all arrive in order, all sends complete (siw's own fence stopped such a connection for good: the iwarp provider keeps fences itself)",
            "no completion gap >= 10 s",
        ),
        _ => ("", "-"),
    }
}

/// One line of a markdown table cell: pipes escaped, no line breaks.
fn cell(s: &str) -> String {
    s.replace('|', "\\|").replace(['\n', '\r'], " ")
}

fn outcome_cell(c: &CaseResult) -> String {
    match c.outcome.as_str() {
        "pass" | "fail" => format!("{} {:.1} s", c.outcome, c.seconds),
        other => other.to_string(),
    }
}

/// The document from reports, each named by where it was read from.
pub(crate) fn render(reports: &[(String, Report)]) -> String {
    // Providers in first-seen order; a later report's result replaces an earlier one.
    let mut providers: Vec<String> = Vec::new();
    let mut results: BTreeMap<(String, String), CaseResult> = BTreeMap::new();
    let mut names: Vec<String> = Vec::new();
    for (_, r) in reports {
        for p in &r.providers {
            if !providers.contains(p) {
                providers.push(p.clone());
            }
        }
        for c in r.cases.iter().filter(|c| selected(&c.name)) {
            if !names.contains(&c.name) {
                names.push(c.name.clone());
            }
            results.insert((c.name.clone(), c.provider.clone()), c.clone());
        }
    }
    // Scenario order: the fault cases first, then the others as the suite runs them.
    names.sort_by_key(|n| !n.starts_with("fault."));
    // Providers that could not run anything here get a line, not a column.
    let (columns, absent): (Vec<String>, Vec<String>) = providers.into_iter().partition(|p| {
        results
            .values()
            .any(|c| &c.provider == p && c.outcome != "no-device")
    });
    let mut out = String::new();
    out.push_str("# Reliability\n\n");
    out.push_str(
        "What each provider does under faults: a peer that dies, exits, goes silent or keeps \
         writing into memory being deregistered; a listener that goes away; a close with \
         operations in flight; hostile input. Every row is a conformance case \
         (`conformance/src/cases/`), every cell its outcome on that provider and the time \
         the whole case took; the bound is the case's own limit. Generated by `fabric \
         reliability` from the JSON reports of one run; do not edit by hand.\n\n",
    );
    let _ = writeln!(
        out,
        "Reports: {}.\n",
        reports
            .iter()
            .map(|(f, r)| format!("`{f}` ({})", r.providers.join(", ")))
            .collect::<Vec<_>>()
            .join("; ")
    );
    let _ = write!(out, "| case | scenario | bound |");
    for p in &columns {
        let _ = write!(out, " {} |", cell(p));
    }
    out.push_str("\n|---|---|---|");
    for _ in &columns {
        out.push_str("---|");
    }
    out.push('\n');
    for n in &names {
        let (what, bound) = scenario(n);
        let _ = write!(out, "| `{n}` | {} | {} |", cell(what), cell(bound));
        for p in &columns {
            let o = results
                .get(&(n.clone(), p.clone()))
                .map_or("-".to_string(), outcome_cell);
            let _ = write!(out, " {o} |");
        }
        out.push('\n');
    }
    out.push('\n');
    for p in &absent {
        let reason = results
            .values()
            .find(|c| &c.provider == p)
            .map_or(String::new(), |c| c.detail.clone());
        let _ = writeln!(out, "{p}: no device here ({}).\n", cell(&reason));
    }
    out.push_str(
        "Outcomes: `pass`; `fail` (the detail says what was observed); `unsupported` (the \
         connection lacks an operation the case needs, and posting it was refused); \
         `no-device`.\n\n## What each case observed\n\n",
    );
    for n in &names {
        let _ = writeln!(out, "### `{n}`\n");
        for p in &columns {
            let Some(c) = results.get(&(n.clone(), p.clone())) else {
                continue;
            };
            let detail = if c.detail.is_empty() {
                "(no detail: the case records none when it passes)".to_string()
            } else {
                cell(&c.detail)
            };
            let _ = writeln!(out, "- **{p}** {}: {detail}", outcome_cell(c));
        }
        out.push('\n');
    }
    out
}

/// Reads the reports and writes the document to `output` (stdout when `None`).
pub(crate) fn run(files: &[PathBuf], output: Option<&Path>) -> Result<ExitCode, String> {
    if files.is_empty() {
        return Err("no report given (fabric reliability <conformance.json>...)".into());
    }
    let mut reports = Vec::new();
    for f in files {
        let text =
            std::fs::read_to_string(f).map_err(|e| format!("cannot read {}: {e}", f.display()))?;
        let r = Report::from_json(&text).map_err(|e| format!("{}: {e}", f.display()))?;
        reports.push((f.display().to_string(), r));
    }
    let doc = render(&reports);
    match output {
        Some(path) => std::fs::write(path, doc)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?,
        None => print!("{doc}"),
    }
    Ok(ExitCode::SUCCESS)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn case(name: &str, provider: &str, outcome: &str, detail: &str) -> CaseResult {
        CaseResult {
            name: name.into(),
            section: "7".into(),
            provider: provider.into(),
            outcome: outcome.into(),
            detail: detail.into(),
            seconds: 1.25,
        }
    }

    #[test]
    fn table_of_selected_cases_with_details() {
        let host = Report {
            providers: vec!["tcp".into()],
            cases: vec![
                case("msg.send_recv", "tcp", "pass", ""),
                case("fault.silent_peer_host", "tcp", "pass", "after 10 s | ok"),
                case("conn.peer_killed_mid_transfer", "tcp", "pass", ""),
            ],
        };
        let guest = Report {
            providers: vec!["roce".into(), "ib".into()],
            cases: vec![
                case("fault.silent_peer_host", "roce", "fail", "not silenced"),
                case(
                    "fault.silent_peer_host",
                    "ib",
                    "no-device",
                    "no InfiniBand device",
                ),
            ],
        };
        let doc = render(&[("a.json".into(), host), ("b.json".into(), guest)]);
        assert!(!doc.contains("msg.send_recv"), "{doc}");
        assert!(doc.contains("| tcp | roce |"), "{doc}");
        assert!(!doc.contains("| ib |"), "{doc}");
        assert!(
            doc.contains("ib: no device here (no InfiniBand device)"),
            "{doc}"
        );
        assert!(doc.contains("| pass 1.2 s | fail 1.2 s |"), "{doc}");
        assert!(doc.contains("after 10 s \\| ok"), "{doc}");
        // fault cases first; a missing result is a dash.
        let silent = doc.find("| `fault.silent_peer_host`").expect("row");
        let killed = doc.find("| `conn.peer_killed_mid_transfer`").expect("row");
        assert!(silent < killed, "{doc}");
        assert!(doc.contains("| pass 1.2 s | - |"), "{doc}");
    }
}
