//! Reports: a text matrix (case x provider), JSON, JUnit XML.

use std::collections::BTreeMap;
use std::fmt::Write;

use serde::{Deserialize, Serialize};

/// One case on one provider.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct CaseResult {
    /// Case name.
    pub name: String,
    /// Section of the contract (docs/contract.md).
    pub section: String,
    /// Provider.
    pub provider: String,
    /// `pass`, `fail`, `unsupported` or `no-device`.
    pub outcome: String,
    /// Why (failure message, unsupported reason, missing device), or what was checked.
    pub detail: String,
    /// Seconds taken.
    #[serde(default)]
    pub seconds: f64,
}

/// The whole run.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct Report {
    /// Providers, in the order run.
    pub providers: Vec<String>,
    /// Every result.
    pub cases: Vec<CaseResult>,
}

impl Report {
    /// True when any case failed.
    pub fn any_fail(&self) -> bool {
        self.cases.iter().any(|c| c.outcome == "fail")
    }

    /// Counts per outcome.
    pub fn counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for c in &self.cases {
            *m.entry(c.outcome.clone()).or_insert(0) += 1;
        }
        m
    }

    /// Reads a report written by [`to_json`](Self::to_json).
    pub fn from_json(text: &str) -> Result<Self, String> {
        serde_json::from_str(text).map_err(|e| format!("not a conformance report: {e}"))
    }

    /// JSON: `{"providers": [...], "cases": [{"name","section","provider","outcome","detail","seconds"}]}`.
    pub fn to_json(&self) -> String {
        serde_json::to_string_pretty(self).expect("report serialises")
    }

    /// A case x provider matrix, then the details of everything that did not pass.
    pub fn to_text(&self) -> String {
        let mut rows: Vec<(String, String)> = Vec::new();
        for c in &self.cases {
            if !rows.iter().any(|(n, _)| *n == c.name) {
                rows.push((c.name.clone(), c.section.clone()));
            }
        }
        let w = rows.iter().map(|(n, _)| n.len()).max().unwrap_or(4).max(4);
        let mut out = String::new();
        let _ = write!(out, "{:<w$}  {:<4}", "case", "sec");
        for p in &self.providers {
            let _ = write!(out, "  {p:<11}");
        }
        out.push('\n');
        for (name, section) in &rows {
            let _ = write!(out, "{name:<w$}  {section:<4}");
            for p in &self.providers {
                let o = self
                    .cases
                    .iter()
                    .find(|c| &c.name == name && &c.provider == p)
                    .map_or("-", |c| c.outcome.as_str());
                let _ = write!(out, "  {o:<11}");
            }
            out.push('\n');
        }
        out.push('\n');
        for p in &self.providers {
            let mut counts = BTreeMap::new();
            for c in self.cases.iter().filter(|c| &c.provider == p) {
                *counts.entry(c.outcome.as_str()).or_insert(0) += 1;
            }
            let summary: Vec<String> = counts.iter().map(|(k, v)| format!("{v} {k}")).collect();
            let _ = writeln!(out, "{p}: {}", summary.join(", "));
        }
        // Failures one per line; a reason shared by many cases (no device, unsupported) once.
        let mut grouped: Vec<(&str, &str, &str, Vec<&str>)> = Vec::new();
        for c in self.cases.iter().filter(|c| c.outcome != "pass") {
            if c.outcome == "fail" {
                grouped.push((&c.outcome, &c.provider, &c.detail, vec![&c.name]));
            } else if let Some(g) = grouped
                .iter_mut()
                .find(|g| g.0 == c.outcome && g.1 == c.provider && g.2 == c.detail)
            {
                g.3.push(&c.name);
            } else {
                grouped.push((&c.outcome, &c.provider, &c.detail, vec![&c.name]));
            }
        }
        if !grouped.is_empty() {
            out.push('\n');
        }
        for (outcome, provider, detail, names) in grouped {
            let which = if names.len() > 3 {
                format!("{} cases", names.len())
            } else {
                names.join(", ")
            };
            let _ = writeln!(out, "{outcome} [{provider}] {which}: {detail}");
        }
        out
    }

    /// JUnit XML, one test suite per provider.
    pub fn to_junit(&self) -> String {
        let esc = |s: &str| {
            s.replace('&', "&amp;")
                .replace('<', "&lt;")
                .replace('>', "&gt;")
                .replace('"', "&quot;")
        };
        let mut out = String::from("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<testsuites name=\"fabric-conformance\">\n");
        for p in &self.providers {
            let cases: Vec<&CaseResult> = self.cases.iter().filter(|c| &c.provider == p).collect();
            let failures = cases.iter().filter(|c| c.outcome == "fail").count();
            let skipped = cases
                .iter()
                .filter(|c| c.outcome != "pass" && c.outcome != "fail")
                .count();
            let _ = writeln!(out, "  <testsuite name=\"{}\" tests=\"{}\" failures=\"{failures}\" skipped=\"{skipped}\">", esc(p), cases.len());
            for c in cases {
                let _ = write!(
                    out,
                    "    <testcase classname=\"{}.{}\" name=\"{}\" time=\"{:.3}\"",
                    esc(p),
                    esc(&c.section),
                    esc(&c.name),
                    c.seconds
                );
                match c.outcome.as_str() {
                    "pass" => out.push_str("/>\n"),
                    "fail" => {
                        let _ =
                            writeln!(out, "><failure message=\"{}\"/></testcase>", esc(&c.detail));
                    }
                    other => {
                        let _ = writeln!(
                            out,
                            "><skipped message=\"{}: {}\"/></testcase>",
                            other,
                            esc(&c.detail)
                        );
                    }
                }
            }
            out.push_str("  </testsuite>\n");
        }
        out.push_str("</testsuites>\n");
        out
    }
}
