//! Tag matching: posted (expected) receives and unexpected messages, built for speed.
//!
//! Posted receives without a wildcard (a named source, ignore mask 0) sit in a hash map
//! keyed by `(source, tag)`, each bucket a FIFO; receives with a wildcard (any source or a
//! nonzero ignore mask) sit in one list in post order. Every receive gets a sequence number
//! when posted; an arriving message looks at the front of its bucket and at the first
//! matching wildcard receive and takes whichever was posted first. That is the contract's
//! rule ("the first posted receive, in post order, whose source and masked tag match") at
//! the cost of one hash look-up plus a scan of the wildcard list only.
//!
//! Unexpected messages are kept in arrival order (a B-tree keyed by arrival number, for
//! wildcard receives and probes) and in a hash map of FIFOs keyed by `(source, tag)` (for
//! exact receives). Messages from one source arrive in the order they were sent (one
//! connection per direction), so taking the earliest match is MPI's non-overtaking rule.
//!
//! The idea follows UCX's `tag_match.h` (expected hash plus wildcard queue, unexpected
//! hash) and libfabric's `util_srx_ctx`; the code is our own.

use std::collections::{BTreeMap, VecDeque};

/// Maps keyed by what a peer chooses (its index and the message's tag): foldhash, seeded
/// at random per map, instead of SipHash; a peer cannot aim at collisions it cannot
/// compute.
type PeerKeyed<V> = foldhash::HashMap<(u32, u64), V>;

/// Where a receive accepts messages from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Src {
    /// Any peer.
    Any,
    /// One peer (its address-vector index).
    Peer(u32),
}

/// What a receive or a probe matches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Spec {
    /// Source.
    pub src: Src,
    /// Tag.
    pub tag: u64,
    /// Bits of the tag to ignore.
    pub ignore: u64,
}

impl Spec {
    /// True when a message from `src` with `tag` matches.
    pub fn matches(&self, src: u32, tag: u64) -> bool {
        (self.src == Src::Any || self.src == Src::Peer(src)) && (tag ^ self.tag) & !self.ignore == 0
    }

    fn exact_key(&self) -> Option<(u32, u64)> {
        match self.src {
            Src::Peer(p) if self.ignore == 0 => Some((p, self.tag)),
            _ => None,
        }
    }
}

/// The matching engine; `R` is what a posted receive carries, `U` an unexpected message.
#[derive(Debug)]
pub struct Matcher<R, U> {
    next_seq: u64,
    posted: crate::IdMap<(Spec, R)>,
    exp_exact: PeerKeyed<VecDeque<u64>>,
    exp_wild: BTreeMap<u64, Spec>,
    next_arrival: u64,
    unexp: BTreeMap<u64, (u32, u64, U)>,
    unexp_exact: PeerKeyed<VecDeque<u64>>,
}

impl<R, U> Default for Matcher<R, U> {
    fn default() -> Self {
        Matcher {
            next_seq: 1,
            posted: crate::IdMap::default(),
            exp_exact: PeerKeyed::default(),
            exp_wild: BTreeMap::new(),
            next_arrival: 1,
            unexp: BTreeMap::new(),
            unexp_exact: PeerKeyed::default(),
        }
    }
}

impl<R, U> Matcher<R, U> {
    /// Posts a receive (after the caller found no unexpected match); returns its number.
    pub fn post(&mut self, spec: Spec, r: R) -> u64 {
        let seq = self.next_seq;
        self.next_seq += 1;
        match spec.exact_key() {
            Some(k) => self.exp_exact.entry(k).or_default().push_back(seq),
            None => {
                self.exp_wild.insert(seq, spec);
            }
        }
        self.posted.insert(seq, (spec, r));
        seq
    }

    /// The earliest posted receive a message from `src` with `tag` matches, if any.
    pub fn find_posted(&mut self, src: u32, tag: u64) -> Option<u64> {
        let mut exact = None;
        if let Some(q) = self.exp_exact.get_mut(&(src, tag)) {
            // Cancelled receives are removed lazily from their bucket.
            while let Some(&s) = q.front() {
                if self.posted.contains_key(&s) {
                    exact = Some(s);
                    break;
                }
                q.pop_front();
            }
            if q.is_empty() {
                self.exp_exact.remove(&(src, tag));
            }
        }
        let limit = exact.unwrap_or(u64::MAX);
        let wild = self
            .exp_wild
            .range(..limit)
            .find(|(_, spec)| spec.matches(src, tag))
            .map(|(&s, _)| s);
        wild.or(exact)
    }

    /// The posted receive `seq`.
    pub fn posted_mut(&mut self, seq: u64) -> Option<&mut R> {
        self.posted.get_mut(&seq).map(|(_, r)| r)
    }

    /// Removes the posted receive `seq` (matched for good, or cancelled).
    pub fn take_posted(&mut self, seq: u64) -> Option<R> {
        let (spec, r) = self.posted.remove(&seq)?;
        if spec.exact_key().is_none() {
            self.exp_wild.remove(&seq);
        }
        Some(r)
    }

    /// Removes every posted receive naming source `src` (not the any-source ones).
    pub fn take_posted_from(&mut self, src: u32) -> Vec<R> {
        let seqs: Vec<u64> = self
            .posted
            .iter()
            .filter(|(_, (s, _))| s.src == Src::Peer(src))
            .map(|(&k, _)| k)
            .collect();
        let mut seqs = seqs;
        seqs.sort_unstable();
        seqs.into_iter()
            .filter_map(|s| self.take_posted(s))
            .collect()
    }

    /// Posted receives.
    pub fn posted_len(&self) -> usize {
        self.posted.len()
    }

    /// Keeps a message that matched no receive; returns its arrival number.
    pub fn push_unexpected(&mut self, src: u32, tag: u64, u: U) -> u64 {
        let a = self.next_arrival;
        self.next_arrival += 1;
        self.unexp.insert(a, (src, tag, u));
        self.unexp_exact.entry((src, tag)).or_default().push_back(a);
        a
    }

    /// The earliest unexpected message `spec` matches.
    pub fn find_unexpected(&self, spec: &Spec) -> Option<u64> {
        match spec.exact_key() {
            Some(k) => self.unexp_exact.get(&k).and_then(|q| q.front().copied()),
            None => self
                .unexp
                .iter()
                .find(|(_, (s, t, _))| spec.matches(*s, *t))
                .map(|(&a, _)| a),
        }
    }

    /// The unexpected message `a`: source, tag and payload.
    pub fn unexpected(&self, a: u64) -> Option<(u32, u64, &U)> {
        self.unexp.get(&a).map(|(s, t, u)| (*s, *t, u))
    }

    /// Removes the unexpected message `a`.
    pub fn take_unexpected(&mut self, a: u64) -> Option<(u32, u64, U)> {
        let (s, t, u) = self.unexp.remove(&a)?;
        if let Some(q) = self.unexp_exact.get_mut(&(s, t)) {
            // The earliest match of any spec is the front of its bucket; search anyway.
            if let Some(i) = q.iter().position(|&x| x == a) {
                q.remove(i);
            }
            if q.is_empty() {
                self.unexp_exact.remove(&(s, t));
            }
        }
        Some((s, t, u))
    }

    /// Unexpected messages kept.
    pub fn unexpected_len(&self) -> usize {
        self.unexp.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(p: u32, tag: u64) -> Spec {
        Spec {
            src: Src::Peer(p),
            tag,
            ignore: 0,
        }
    }

    #[test]
    fn first_posted_wins_between_exact_and_wildcard() {
        let mut m: Matcher<&str, ()> = Matcher::default();
        let w = m.post(
            Spec {
                src: Src::Any,
                tag: 0,
                ignore: u64::MAX,
            },
            "wild",
        );
        let e = m.post(exact(3, 9), "exact");
        assert_eq!(m.find_posted(3, 9), Some(w));
        assert_eq!(m.take_posted(w), Some("wild"));
        assert_eq!(m.find_posted(3, 9), Some(e));
        // An exact receive posted before a wildcard one wins.
        let w2 = m.post(
            Spec {
                src: Src::Any,
                tag: 9,
                ignore: 0,
            },
            "wild2",
        );
        assert_eq!(m.find_posted(3, 9), Some(e));
        m.take_posted(e);
        assert_eq!(m.find_posted(3, 9), Some(w2));
        assert_eq!(m.find_posted(3, 8), None);
    }

    #[test]
    fn ignore_mask_and_source() {
        let s = Spec {
            src: Src::Peer(1),
            tag: 0xab00,
            ignore: 0xff,
        };
        assert!(s.matches(1, 0xab17));
        assert!(!s.matches(2, 0xab17));
        assert!(!s.matches(1, 0xac17));
    }

    #[test]
    fn cancelled_receives_are_skipped() {
        let mut m: Matcher<u32, ()> = Matcher::default();
        let a = m.post(exact(0, 1), 1);
        let b = m.post(exact(0, 1), 2);
        assert_eq!(m.take_posted(a), Some(1));
        assert_eq!(m.find_posted(0, 1), Some(b));
        assert_eq!(m.posted_len(), 1);
    }

    #[test]
    fn unexpected_in_arrival_order_per_source() {
        let mut m: Matcher<(), &str> = Matcher::default();
        m.push_unexpected(1, 5, "a");
        m.push_unexpected(2, 5, "b");
        m.push_unexpected(1, 5, "c");
        let any5 = Spec {
            src: Src::Any,
            tag: 5,
            ignore: 0,
        };
        let a = m.find_unexpected(&exact(1, 5)).unwrap();
        assert_eq!(m.take_unexpected(a).unwrap().2, "a");
        let b = m.find_unexpected(&any5).unwrap();
        assert_eq!(m.take_unexpected(b).unwrap().2, "b");
        let c = m.find_unexpected(&exact(1, 5)).unwrap();
        assert_eq!(m.unexpected(c).unwrap().2, &"c");
        assert_eq!(m.take_unexpected(c).unwrap().2, "c");
        assert_eq!(m.unexpected_len(), 0);
        assert_eq!(m.find_unexpected(&any5), None);
    }

    #[test]
    fn receives_from_a_source_are_taken_in_post_order() {
        let mut m: Matcher<u32, ()> = Matcher::default();
        m.post(exact(4, 1), 10);
        m.post(
            Spec {
                src: Src::Any,
                tag: 1,
                ignore: 0,
            },
            11,
        );
        m.post(exact(4, 2), 12);
        assert_eq!(m.take_posted_from(4), vec![10, 12]);
        assert_eq!(m.posted_len(), 1);
    }
}
