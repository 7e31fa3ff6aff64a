//! The decisions behind faults: seeded generators, per-trigger counters, and the counts of
//! faults injected.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::config::Trigger;

/// SplitMix64: small, fast, and the same sequence for the same seed on every platform.
#[derive(Debug, Clone)]
pub(crate) struct Rng(u64);

impl Rng {
    /// The generator of object number `stream` under `seed` (each endpoint and completion
    /// queue draws from its own stream, so threads do not perturb each other's faults).
    pub(crate) fn new(seed: u64, stream: u64) -> Self {
        let mut r = Rng(seed ^ stream.wrapping_mul(0xA076_1D64_78BD_642F));
        r.next_u64();
        r
    }

    pub(crate) fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// A uniform draw in [0, 1).
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }
}

/// A trigger with its event count.
#[derive(Debug, Clone)]
pub(crate) struct Armed {
    trigger: Trigger,
    count: u64,
}

impl Armed {
    pub(crate) fn new(trigger: Trigger) -> Self {
        Armed { trigger, count: 0 }
    }

    /// Counts one event; true when the fault fires on it. The generator is drawn from on
    /// every event whenever a probability is set, so the sequence depends only on the seed
    /// and the number of events.
    pub(crate) fn fires(&mut self, rng: &mut Rng) -> bool {
        self.count += 1;
        let by_count =
            self.trigger.every_nth > 0 && self.count.is_multiple_of(self.trigger.every_nth);
        let by_chance = self.trigger.probability > 0.0 && rng.unit() < self.trigger.probability;
        by_count || by_chance
    }
}

/// How many faults a hooked domain has injected so far.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct FaultStats {
    /// Posts refused (`fault.fail_post`).
    pub posts_failed: u64,
    /// Completions held back (`fault.delay`).
    pub completions_delayed: u64,
    /// Successful completions turned into error completions (`fault.drop`).
    pub completions_dropped: u64,
    /// Successful completions turned into `Flushed` because their endpoint had entered the
    /// error state through a dropped completion.
    pub completions_flushed: u64,
    /// Connections cut (`fault.cut`, or [`HookEndpoint::cut_connection`]).
    ///
    /// [`HookEndpoint::cut_connection`]: crate::HookEndpoint::cut_connection
    pub connections_cut: u64,
}

#[derive(Debug, Default)]
pub(crate) struct Counters {
    pub(crate) posts_failed: AtomicU64,
    pub(crate) completions_delayed: AtomicU64,
    pub(crate) completions_dropped: AtomicU64,
    pub(crate) completions_flushed: AtomicU64,
    pub(crate) connections_cut: AtomicU64,
}

impl Counters {
    pub(crate) fn bump(c: &AtomicU64) {
        c.fetch_add(1, Ordering::Relaxed);
    }

    pub(crate) fn snapshot(&self) -> FaultStats {
        let g = |c: &AtomicU64| c.load(Ordering::Relaxed);
        FaultStats {
            posts_failed: g(&self.posts_failed),
            completions_delayed: g(&self.completions_delayed),
            completions_dropped: g(&self.completions_dropped),
            completions_flushed: g(&self.completions_flushed),
            connections_cut: g(&self.connections_cut),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_nth_counts_from_one_and_probability_is_seeded() {
        let mut rng = Rng::new(1, 0);
        let mut a = Armed::new(Trigger::every(3));
        let fired: Vec<bool> = (0..6).map(|_| a.fires(&mut rng)).collect();
        assert_eq!(fired, [false, false, true, false, false, true]);

        let run = |seed| {
            let mut rng = Rng::new(seed, 4);
            let mut a = Armed::new(Trigger::probability(0.3));
            (0..200).map(|_| a.fires(&mut rng)).collect::<Vec<_>>()
        };
        assert_eq!(run(42), run(42));
        assert_ne!(run(42), run(43));
        let n = run(42).iter().filter(|&&f| f).count();
        assert!((20..=110).contains(&n), "{n} of 200 at p=0.3");
        let mut never = Armed::new(Trigger::probability(0.0));
        assert!(!(0..100).any(|_| never.fires(&mut rng)));
    }
}
