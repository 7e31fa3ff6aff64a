//! What the hooks do: which are on, and the faults to inject.
//!
//! The same [`FaultConfig`] comes from a `[fault]` TOML table (it implements
//! `Deserialize`, so a config file embeds it directly), from the compact
//! `FABRIC_FAULT` form (`seed=7,fail_post.every_nth=3`, see [`FaultConfig::from_spec`]) or
//! from the builder methods. Unknown keys and bad values are errors naming the key.

use std::fmt;
use std::time::Duration;

use fabric_api::{Error, ErrorKind, Result};
use serde::Deserialize;

/// Names accepted in a hook list (`FABRIC_HOOKS`, `hooks = [...]`).
pub const HOOK_NAMES: [&str; 2] = ["trace", "fault"];

/// Which hooks wrap a domain.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct HookConfig {
    /// Log every operation with `tracing` (lifecycle and registrations at DEBUG, posts and
    /// completions at TRACE, target `fabric_hook`).
    pub trace: bool,
    /// Inject these faults; `None` injects nothing.
    pub fault: Option<FaultConfig>,
}

impl HookConfig {
    /// True when at least one hook is on (otherwise wrapping would only cost time).
    pub fn is_active(&self) -> bool {
        self.trace || self.fault.is_some()
    }

    /// Parses a hook list such as `"trace,fault"` into `(trace, fault)` switches; an
    /// unknown name is an error listing the valid ones. An empty list turns every hook off.
    pub fn parse_list(list: &str) -> Result<(bool, bool)> {
        let mut trace = false;
        let mut fault = false;
        for raw in list.split(',') {
            match raw.trim() {
                "" if list.trim().is_empty() => {}
                "trace" => trace = true,
                "fault" => fault = true,
                other => {
                    return Err(Error::new(
                        ErrorKind::Config,
                        format!(
                            "unknown hook {other:?} in {list:?}; valid names: {}",
                            HOOK_NAMES.join(", ")
                        ),
                    ))
                }
            }
        }
        Ok((trace, fault))
    }
}

/// When a fault fires: on every `every_nth` event (the Nth, 2Nth, ...) and/or on each
/// event with `probability`, drawn from the seeded generator. Events are counted per
/// endpoint (post faults) or per completion queue (completion faults).
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub struct Trigger {
    /// Fire on every Nth event; 0 never fires by count.
    pub every_nth: u64,
    /// Fire on each event with this probability (0 to 1).
    pub probability: f64,
}

impl Trigger {
    /// Fires on every `n`th event.
    pub fn every(n: u64) -> Self {
        Trigger {
            every_nth: n,
            probability: 0.0,
        }
    }

    /// Fires on each event with probability `p`.
    pub fn probability(p: f64) -> Self {
        Trigger {
            every_nth: 0,
            probability: p,
        }
    }

    fn validate(&self, key: &str) -> Result<(), String> {
        if !(0.0..=1.0).contains(&self.probability) {
            return Err(format!(
                "{key}.probability: {} is not between 0 and 1",
                self.probability
            ));
        }
        if self.every_nth == 0 && self.probability == 0.0 {
            return Err(format!(
                "{key}: never fires; set every_nth (1 or more) or probability (above 0)"
            ));
        }
        Ok(())
    }
}

impl fmt::Display for Trigger {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.every_nth, self.probability) {
            (0, p) => write!(f, "with probability {p}"),
            (n, 0.0) => write!(f, "every {n}th"),
            (n, p) => write!(f, "every {n}th and with probability {p}"),
        }
    }
}

/// Posts (send or receive) refused with an error of `kind`; the operation never reaches
/// the provider, yields no completion, and the endpoint stays usable.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct FailPost {
    /// Which posts (counted per endpoint, sends and receives together).
    pub trigger: Trigger,
    /// The kind the post returns (default `QueueFull`).
    pub kind: ErrorKind,
}

/// Completions held back before the application sees them. Order is kept: completions
/// behind a delayed one on the same queue wait for it.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Delay {
    /// Which completions (counted per completion queue).
    pub trigger: Trigger,
    /// How long each chosen completion is held, from when the wrapper first sees it.
    pub delay: Duration,
}

/// Successful completions that are lost, the way an acknowledgement is lost on the wire.
///
/// A dropped completion is never silently missing: it is delivered with status
/// `Error(status)` (default `RetryExceeded`), its context and opcode intact, and its
/// endpoint enters the error state exactly as after a real error completion: the
/// connection is closed (the peer sees a disconnect), later completions of that endpoint
/// arrive `Flushed` and new posts fail with `InvalidState`. The data may have reached
/// the peer (as with a lost ack). Every drop is also counted ([`FaultStats`]) and logged at
/// WARN.
///
/// [`FaultStats`]: crate::FaultStats
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct DropCompletion {
    /// Which successful completions (counted per completion queue).
    pub trigger: Trigger,
    /// The error status the dropped operation completes with (default `RetryExceeded`).
    pub status: ErrorKind,
}

/// Connections cut: after a chosen post is handed to the provider, the endpoint's
/// connection is closed underneath it. The peer sees a disconnect; the local endpoint
/// reports `EndpointState::Error`, its outstanding operations complete `Flushed` (or with
/// whatever the provider reports), and new posts fail with `InvalidState`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Cut {
    /// Which posts (counted per endpoint, sends and receives together).
    pub trigger: Trigger,
}

/// The faults to inject, and the seed that makes a run reproducible.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(try_from = "RawFault")]
pub struct FaultConfig {
    /// Seed of the generators behind probabilities; `None` picks one at random (reported in
    /// the selection report and a tracing event, so the run can be repeated).
    pub seed: Option<u64>,
    /// Posts refused.
    pub fail_post: Option<FailPost>,
    /// Completions delayed.
    pub delay: Option<Delay>,
    /// Completions dropped (reported as errors, see [`DropCompletion`]).
    pub drop: Option<DropCompletion>,
    /// Connections cut.
    pub cut: Option<Cut>,
}

impl FaultConfig {
    /// No faults (the wrapper counts and logs, nothing more).
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets the seed.
    pub fn seed(mut self, seed: u64) -> Self {
        self.seed = Some(seed);
        self
    }

    /// Refuses posts chosen by `trigger` with `kind`.
    pub fn fail_post(mut self, trigger: Trigger, kind: ErrorKind) -> Self {
        self.fail_post = Some(FailPost { trigger, kind });
        self
    }

    /// Delays completions chosen by `trigger` by `delay`.
    pub fn delay(mut self, trigger: Trigger, delay: Duration) -> Self {
        self.delay = Some(Delay { trigger, delay });
        self
    }

    /// Drops successful completions chosen by `trigger`, reporting them as `status`.
    pub fn drop_completions(mut self, trigger: Trigger, status: ErrorKind) -> Self {
        self.drop = Some(DropCompletion { trigger, status });
        self
    }

    /// Cuts the connection after posts chosen by `trigger`.
    pub fn cut(mut self, trigger: Trigger) -> Self {
        self.cut = Some(Cut { trigger });
        self
    }

    /// `other`'s settings over these: each of seed, fail_post, delay, drop, cut that
    /// `other` sets replaces this one's.
    pub fn merge(mut self, other: FaultConfig) -> Self {
        self.seed = other.seed.or(self.seed);
        self.fail_post = other.fail_post.or(self.fail_post);
        self.delay = other.delay.or(self.delay);
        self.drop = other.drop.or(self.drop);
        self.cut = other.cut.or(self.cut);
        self
    }

    /// Parses the compact form of the `FABRIC_FAULT` variable: comma-separated `key=value`
    /// pairs with the keys of the `[fault]` table, dotted
    /// (`seed=7,fail_post.every_nth=3,fail_post.kind=Flushed,delay.probability=0.5,delay.ms=20`).
    pub fn from_spec(spec: &str) -> Result<Self> {
        let mut doc = String::new();
        for pair in spec.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = pair.split_once('=').ok_or_else(|| {
                Error::new(
                    ErrorKind::Config,
                    format!("{pair:?} is not key=value (in {spec:?})"),
                )
            })?;
            let key = key.trim();
            let value = value.trim();
            let valid_key = !key.is_empty()
                && key.split('.').all(|k| {
                    !k.is_empty() && k.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
                });
            if !valid_key {
                return Err(Error::new(
                    ErrorKind::Config,
                    format!("bad key {key:?} in {spec:?}"),
                ));
            }
            // Numbers and booleans as they are; anything else (error kinds) as a string.
            let literal = value.parse::<i64>().is_ok()
                || value.parse::<f64>().is_ok()
                || value == "true"
                || value == "false";
            if literal {
                doc.push_str(&format!("{key} = {value}\n"));
            } else {
                let quoted = value.replace('\\', "\\\\").replace('"', "\\\"");
                doc.push_str(&format!("{key} = \"{quoted}\"\n"));
            }
        }
        toml::from_str(&doc).map_err(|e| {
            Error::new(
                ErrorKind::Config,
                format!("{spec:?}: {}", e.message().trim()),
            )
        })
    }
}

impl fmt::Display for FaultConfig {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(x) = &self.fail_post {
            parts.push(format!("fail {} post with {}", x.trigger, x.kind));
        }
        if let Some(x) = &self.delay {
            parts.push(format!("delay {} completion by {:?}", x.trigger, x.delay));
        }
        if let Some(x) = &self.drop {
            parts.push(format!(
                "drop {} successful completion (reported as {})",
                x.trigger, x.status
            ));
        }
        if let Some(x) = &self.cut {
            parts.push(format!("cut the connection after {} post", x.trigger));
        }
        if parts.is_empty() {
            parts.push("no faults configured".into());
        }
        f.write_str(&parts.join("; "))
    }
}

/// Every error kind a fault can name, by its [`ErrorKind::as_str`] name.
pub const ERROR_KINDS: [ErrorKind; 17] = [
    ErrorKind::LocalLength,
    ErrorKind::LocalProtection,
    ErrorKind::RemoteAccess,
    ErrorKind::RemoteInvalidRequest,
    ErrorKind::RemoteOperation,
    ErrorKind::RetryExceeded,
    ErrorKind::Flushed,
    ErrorKind::Unsupported,
    ErrorKind::QueueFull,
    ErrorKind::InvalidArgument,
    ErrorKind::InvalidState,
    ErrorKind::ConnectionRefused,
    ErrorKind::TimedOut,
    ErrorKind::Protocol,
    ErrorKind::NoDevice,
    ErrorKind::Config,
    ErrorKind::Io,
];

/// The error kind called `name` (as [`ErrorKind::as_str`] spells it).
pub fn error_kind(name: &str) -> Option<ErrorKind> {
    ERROR_KINDS.iter().copied().find(|k| k.as_str() == name)
}

fn parse_kind(key: &str, name: Option<String>, default: ErrorKind) -> Result<ErrorKind, String> {
    match name {
        None => Ok(default),
        Some(n) => error_kind(&n).ok_or_else(|| {
            let valid: Vec<&str> = ERROR_KINDS.iter().map(|k| k.as_str()).collect();
            format!(
                "{key}: unknown error kind {n:?}; valid: {}",
                valid.join(", ")
            )
        }),
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFault {
    seed: Option<u64>,
    fail_post: Option<RawFailPost>,
    delay: Option<RawDelay>,
    drop: Option<RawDrop>,
    cut: Option<RawCut>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawFailPost {
    every_nth: Option<u64>,
    probability: Option<f64>,
    kind: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDelay {
    every_nth: Option<u64>,
    probability: Option<f64>,
    ms: u64,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawDrop {
    every_nth: Option<u64>,
    probability: Option<f64>,
    status: Option<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct RawCut {
    every_nth: Option<u64>,
    probability: Option<f64>,
}

fn trigger(key: &str, every_nth: Option<u64>, probability: Option<f64>) -> Result<Trigger, String> {
    let t = Trigger {
        every_nth: every_nth.unwrap_or(0),
        probability: probability.unwrap_or(0.0),
    };
    t.validate(key)?;
    Ok(t)
}

impl TryFrom<RawFault> for FaultConfig {
    type Error = String;

    fn try_from(r: RawFault) -> Result<Self, String> {
        let fail_post = match r.fail_post {
            None => None,
            Some(f) => Some(FailPost {
                trigger: trigger("fault.fail_post", f.every_nth, f.probability)?,
                kind: parse_kind("fault.fail_post.kind", f.kind, ErrorKind::QueueFull)?,
            }),
        };
        let delay = match r.delay {
            None => None,
            Some(d) => Some(Delay {
                trigger: trigger("fault.delay", d.every_nth, d.probability)?,
                delay: Duration::from_millis(d.ms),
            }),
        };
        let drop = match r.drop {
            None => None,
            Some(d) => Some(DropCompletion {
                trigger: trigger("fault.drop", d.every_nth, d.probability)?,
                status: parse_kind("fault.drop.status", d.status, ErrorKind::RetryExceeded)?,
            }),
        };
        let cut = match r.cut {
            None => None,
            Some(c) => Some(Cut {
                trigger: trigger("fault.cut", c.every_nth, c.probability)?,
            }),
        };
        Ok(FaultConfig {
            seed: r.seed,
            fail_post,
            delay,
            drop,
            cut,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hook_lists_parse_and_unknown_names_are_errors() {
        assert_eq!(HookConfig::parse_list("trace,fault").unwrap(), (true, true));
        assert_eq!(HookConfig::parse_list(" fault ").unwrap(), (false, true));
        assert_eq!(HookConfig::parse_list("").unwrap(), (false, false));
        let e = HookConfig::parse_list("trace,chaos").unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Config);
        assert!(
            e.message().contains("\"chaos\"") && e.message().contains("trace, fault"),
            "{e}"
        );
        assert!(HookConfig::parse_list("trace,,fault").is_err());
    }

    #[test]
    fn fault_tables_parse_with_defaults() {
        let f: FaultConfig = toml::from_str(
            "seed = 9\n[fail_post]\nevery_nth = 3\n[delay]\nprobability = 0.5\nms = 20\n\
             [drop]\nevery_nth = 2\nstatus = \"RemoteOperation\"\n[cut]\nevery_nth = 7\n",
        )
        .unwrap();
        assert_eq!(f.seed, Some(9));
        assert_eq!(f.fail_post.unwrap().kind, ErrorKind::QueueFull);
        assert_eq!(f.fail_post.unwrap().trigger, Trigger::every(3));
        assert_eq!(f.delay.unwrap().delay, Duration::from_millis(20));
        assert_eq!(f.drop.unwrap().status, ErrorKind::RemoteOperation);
        assert_eq!(f.cut.unwrap().trigger.every_nth, 7);
        let d: FaultConfig = toml::from_str("[drop]\nprobability = 1.0\n").unwrap();
        assert_eq!(d.drop.unwrap().status, ErrorKind::RetryExceeded);
    }

    #[test]
    fn bad_fault_values_name_the_key() {
        let err = |text: &str| toml::from_str::<FaultConfig>(text).unwrap_err().to_string();
        assert!(err("[drop]\nprobability = 1.5\n").contains("fault.drop.probability"));
        assert!(err("[cut]\n").contains("fault.cut: never fires"));
        assert!(
            err("[fail_post]\nevery_nth = 1\nkind = \"Oops\"\n").contains("fault.fail_post.kind")
        );
        assert!(err("[delay]\nevery_nth = 1\n").contains("ms"));
        assert!(err("[delay]\nevery_nth = 1\nms = 5\nseconds = 1\n").contains("seconds"));
        assert!(err("sed = 1\n").contains("sed"));
    }

    #[test]
    fn compact_spec_parses_like_the_table_and_names_bad_keys() {
        let f = FaultConfig::from_spec(
            "seed=7, fail_post.every_nth=3, fail_post.kind=Flushed, delay.probability=0.5, delay.ms=20",
        )
        .unwrap();
        assert_eq!(f.seed, Some(7));
        assert_eq!(f.fail_post.unwrap().kind, ErrorKind::Flushed);
        assert_eq!(f.delay.unwrap().trigger, Trigger::probability(0.5));
        let e = FaultConfig::from_spec("cut.evry_nth=3").unwrap_err();
        assert!(e.message().contains("evry_nth"), "{e}");
        let e = FaultConfig::from_spec("drop.every_nth=1,drop.status=Nope").unwrap_err();
        assert!(e.message().contains("fault.drop.status"), "{e}");
        assert!(FaultConfig::from_spec("seed").is_err());
        assert_eq!(FaultConfig::from_spec("").unwrap(), FaultConfig::new());
    }

    #[test]
    fn merge_replaces_what_the_override_sets() {
        let base = FaultConfig::new()
            .seed(1)
            .cut(Trigger::every(5))
            .fail_post(Trigger::every(2), ErrorKind::QueueFull);
        let over = FaultConfig::new().seed(2).cut(Trigger::every(9));
        let m = base.merge(over);
        assert_eq!(m.seed, Some(2));
        assert_eq!(m.cut.unwrap().trigger, Trigger::every(9));
        assert_eq!(m.fail_post.unwrap().trigger, Trigger::every(2));
    }
}
