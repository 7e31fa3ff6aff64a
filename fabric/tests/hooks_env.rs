//! `FABRIC_HOOKS` and `FABRIC_FAULT` (one test: it sets the process environment).

use fabric::prelude::*;
use fabric::Selector;

#[test]
fn environment_selects_hooks_and_faults_and_names_bad_keys() {
    std::env::remove_var("FABRIC_CONFIG");
    std::env::set_var("FABRIC_PROVIDER", "tcp");
    std::env::set_var("FABRIC_HOOKS", "fault,trace");
    std::env::set_var(
        "FABRIC_FAULT",
        "seed=99,fail_post.every_nth=1,fail_post.kind=Flushed",
    );
    let s = Selector::from_env().unwrap();
    let h = s.hook_config();
    assert!(h.trace);
    let f = h.fault.clone().unwrap();
    assert_eq!(f.seed, Some(99));
    assert_eq!(f.fail_post.unwrap().kind, ErrorKind::Flushed);
    let (domain, report) = s.open().unwrap();
    assert_eq!(domain.hooks().unwrap().seed(), Some(99));
    let text = report.to_string();
    assert!(text.contains("FABRIC_HOOKS=fault,trace"), "{text}");
    assert!(text.contains("hook active: fault (seed 99"), "{text}");

    std::env::set_var("FABRIC_FAULT", "fail_post.evry_nth=1");
    let e = Selector::from_env().unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Config);
    assert!(
        e.message().contains("FABRIC_FAULT") && e.message().contains("evry_nth"),
        "{e}"
    );

    std::env::set_var("FABRIC_FAULT", "");
    std::env::set_var("FABRIC_HOOKS", "trace,tracing");
    let e = Selector::from_env().unwrap_err();
    assert!(
        e.message().contains("FABRIC_HOOKS") && e.message().contains("\"tracing\""),
        "{e}"
    );

    std::env::set_var("FABRIC_HOOKS", "");
    let (domain, report) = Selector::from_env().unwrap().open().unwrap();
    assert!(domain.hooks().is_none() && report.hooks.is_empty());
}
