//! The conformance suite under `cargo test`: one test per (provider, case).
//!
//! Providers come from `FABRIC_CONFORMANCE_PROVIDERS` (default `tcp`; `tcp>iwarp` names a
//! mixed pair: tcp connects to an iwarp listener). A provider that
//! cannot run here (no device) makes its cases fail with the reason unless
//! `FABRIC_CONFORMANCE_ALLOW_NO_DEVICE=1`, which reports them as ignored: never as passed.

use libtest_mimic::{Arguments, Failed, Trial};

fn main() {
    let args = Arguments::from_args();
    let providers = std::env::var("FABRIC_CONFORMANCE_PROVIDERS").unwrap_or_else(|_| "tcp".into());
    let allow_no_device =
        std::env::var("FABRIC_CONFORMANCE_ALLOW_NO_DEVICE").is_ok_and(|v| v == "1");
    let exe = std::path::PathBuf::from(env!("CARGO_BIN_EXE_fabric"));
    let mut trials = Vec::new();
    for provider in providers.split(',').map(str::trim) {
        let ctx = fabric_conformance::Ctx::from_label(provider, Some(exe.clone()));
        for case in fabric_conformance::all_cases() {
            let ctx = ctx.clone();
            let name = format!("{provider}::{}", case.name);
            let no_device = !(ctx.info().is_available() && ctx.target_info().is_available());
            let trial = Trial::test(name, move || {
                let r = fabric_conformance::harness::run_case(&ctx, &case);
                match r.outcome.as_str() {
                    "pass" | "unsupported" => Ok(()),
                    _ => Err(Failed::from(format!("{}: {}", r.outcome, r.detail))),
                }
            });
            trials.push(if no_device && allow_no_device {
                trial.with_ignored_flag(true)
            } else {
                trial
            });
        }
    }
    libtest_mimic::run(&args, trials).exit();
}
