//! [`Fifo`]: the endpoint's queues of request records, in post order, whose push is
//! inlined into the post.
//!
//! The ledger keeps one record per request: pushed at the back by a post, taken from the
//! front by its completion, and only now and then looked through, taken out of the
//! middle or inserted into (errors, held-back requests, emulation). `VecDeque::push_back`
//! is a call of its own (its growth inlined into it): callgrind of the roce 8-byte send
//! ping-pong in the soft-RDMA guest counted two per iteration on each side, one per post,
//! 29 instructions each plus the call, where in QEMU's TCG a call and its return cost as
//! much as twenty plain instructions (BENCHMARKS.md, thirty-second and forty-sixth
//! sessions). Here a push is `Vec::push`, whose growth is apart: inlined, a push that
//! needs no room writes the record and a length.
//!
//! The records are `items[head..]`, every one `Some`; a pop from the front takes its slot
//! and moves `head` on. An emptied queue starts again at the front of its vector (a
//! ping-pong's queues empty every iteration), and one that never empties drops its taken
//! slots once [`COMPACT_AT`] accumulate, so memory stays bounded by the records in flight.

use std::ops::{Bound, RangeBounds};

/// Taken slots at the front that a queue which never empties drops at once (a copy of
/// the records behind them, once per this many pops).
const COMPACT_AT: usize = 1024;

/// A queue of records in order; see the [module docs](self).
#[derive(Debug)]
pub(crate) struct Fifo<T> {
    items: Vec<Option<T>>,
    head: usize,
}

impl<T> Default for Fifo<T> {
    fn default() -> Self {
        Fifo {
            items: Vec::new(),
            head: 0,
        }
    }
}

/// The records of a [`Fifo`], front to back.
pub(crate) type Iter<'a, T> = std::iter::Flatten<std::slice::Iter<'a, Option<T>>>;
/// The records of a [`Fifo`], front to back, mutably.
pub(crate) type IterMut<'a, T> = std::iter::Flatten<std::slice::IterMut<'a, Option<T>>>;

impl<T> Fifo<T> {
    /// How many records it holds.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.items.len() - self.head
    }

    /// Whether it holds none.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.items.len() == self.head
    }

    /// Adds `x` at the back.
    #[inline(always)]
    pub(crate) fn push_back(&mut self, x: T) {
        self.items.push(Some(x));
    }

    /// Takes the record at the front.
    #[inline(always)]
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        let x = self.items.get_mut(self.head)?.take();
        debug_assert!(x.is_some(), "a taken slot inside the queue");
        self.head += 1;
        if self.head == self.items.len() {
            self.items.clear();
            self.head = 0;
        } else if self.head >= COMPACT_AT {
            self.compact();
        }
        x
    }

    /// Drops the taken slots at the front (a queue that has not emptied for a while).
    #[cold]
    #[inline(never)]
    fn compact(&mut self) {
        self.items.drain(..self.head);
        self.head = 0;
    }

    /// Takes the record at the back.
    pub(crate) fn pop_back(&mut self) -> Option<T> {
        if self.is_empty() {
            return None;
        }
        let x = self.items.pop().flatten();
        if self.is_empty() {
            self.clear();
        }
        x
    }

    /// The record at the front.
    #[inline(always)]
    pub(crate) fn front(&self) -> Option<&T> {
        self.items.get(self.head)?.as_ref()
    }

    /// The record `i` places behind the front.
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        self.items.get(self.head.checked_add(i)?)?.as_ref()
    }

    /// The record `i` places behind the front, mutably.
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        let at = self.head.checked_add(i)?;
        self.items.get_mut(at)?.as_mut()
    }

    /// Takes out the record `i` places behind the front (those behind it move up).
    pub(crate) fn remove(&mut self, i: usize) -> Option<T> {
        if i >= self.len() {
            return None;
        }
        if i == 0 {
            return self.pop_front();
        }
        self.items.remove(self.head + i)
    }

    /// Puts `x` `i` places behind the front (those from there on move back).
    ///
    /// # Panics
    /// If `i` is beyond the back.
    pub(crate) fn insert(&mut self, i: usize, x: T) {
        assert!(i <= self.len(), "insert at {i} into {} records", self.len());
        self.items.insert(self.head + i, Some(x));
    }

    /// Drops every record.
    pub(crate) fn clear(&mut self) {
        self.items.clear();
        self.head = 0;
    }

    /// Takes every record out, front to back.
    pub(crate) fn drain_all(&mut self) -> std::iter::Flatten<std::vec::Drain<'_, Option<T>>> {
        let head = std::mem::take(&mut self.head);
        // The taken slots at the front are `None`: flattened away.
        debug_assert!(self.items[..head].iter().all(Option::is_none));
        self.items.drain(..).flatten()
    }

    /// The records, front to back.
    #[inline(always)]
    pub(crate) fn iter(&self) -> Iter<'_, T> {
        self.items[self.head..].iter().flatten()
    }

    /// The records, front to back, mutably.
    pub(crate) fn iter_mut(&mut self) -> IterMut<'_, T> {
        self.items[self.head..].iter_mut().flatten()
    }

    /// The records at the places in `r` (counted from the front).
    ///
    /// # Panics
    /// If `r` reaches beyond the back.
    pub(crate) fn range(&self, r: impl RangeBounds<usize>) -> Iter<'_, T> {
        let (a, b) = self.bounds(r);
        self.items[a..b].iter().flatten()
    }

    /// The records at the places in `r`, mutably.
    ///
    /// # Panics
    /// If `r` reaches beyond the back.
    pub(crate) fn range_mut(&mut self, r: impl RangeBounds<usize>) -> IterMut<'_, T> {
        let (a, b) = self.bounds(r);
        self.items[a..b].iter_mut().flatten()
    }

    /// `r`'s places as indices into `items`.
    fn bounds(&self, r: impl RangeBounds<usize>) -> (usize, usize) {
        let len = self.len();
        let a = match r.start_bound() {
            Bound::Included(&a) => a,
            Bound::Excluded(&a) => a + 1,
            Bound::Unbounded => 0,
        };
        let b = match r.end_bound() {
            Bound::Included(&b) => b + 1,
            Bound::Excluded(&b) => b,
            Bound::Unbounded => len,
        };
        assert!(a <= b && b <= len, "range {a}..{b} of {len} records");
        (self.head + a, self.head + b)
    }
}

impl<T> std::ops::Index<usize> for Fifo<T> {
    type Output = T;

    fn index(&self, i: usize) -> &T {
        self.get(i).expect("index within the queue")
    }
}

impl<T> std::ops::IndexMut<usize> for Fifo<T> {
    fn index_mut(&mut self, i: usize) -> &mut T {
        self.get_mut(i).expect("index within the queue")
    }
}

impl<T> IntoIterator for Fifo<T> {
    type Item = T;
    type IntoIter = std::iter::Flatten<std::vec::IntoIter<Option<T>>>;

    /// The records, front to back (the taken slots before them are `None`: flattened
    /// away).
    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter().flatten()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Every operation, against `VecDeque` as the model, through emptying, a standing
    /// backlog past the compaction point, and changes in the middle.
    #[test]
    fn behaves_as_a_vecdeque() {
        let mut f = Fifo::default();
        let mut m = VecDeque::new();
        let mut next = 0u32;
        // A small deterministic generator: the same sequence every run.
        let mut rng = 0x9e37_79b9_u32;
        let mut roll = |n: u32| {
            rng ^= rng << 13;
            rng ^= rng >> 17;
            rng ^= rng << 5;
            rng % n
        };
        for step in 0..20_000 {
            // Phases: a backlog that grows, one that stands (past COMPACT_AT pops), one
            // that empties.
            let bias = match step / 2_000 % 3 {
                0 => 6,
                1 => 5,
                _ => 3,
            };
            match roll(12) {
                x if x < bias => {
                    f.push_back(next);
                    m.push_back(next);
                    next += 1;
                }
                x if x < 9 => assert_eq!(f.pop_front(), m.pop_front()),
                9 => assert_eq!(f.pop_back(), m.pop_back()),
                10 if !m.is_empty() => {
                    let i = roll(m.len() as u32) as usize;
                    assert_eq!(f.remove(i), m.remove(i));
                }
                _ => {
                    let i = roll(m.len() as u32 + 1) as usize;
                    f.insert(i, next);
                    m.insert(i, next);
                    next += 1;
                }
            }
            assert_eq!(f.len(), m.len());
            assert_eq!(f.is_empty(), m.is_empty());
            assert_eq!(f.front(), m.front());
            assert!(f.iter().eq(m.iter()));
            assert!(f.head < COMPACT_AT, "taken slots are dropped");
            if !m.is_empty() {
                let i = roll(m.len() as u32) as usize;
                assert_eq!(f[i], m[i]);
                assert!(f.range(i..).eq(m.range(i..)));
                assert!(f.range(..i).eq(m.range(..i)));
            }
        }
        let left: Vec<_> = f.drain_all().collect();
        assert!(left.iter().eq(m.iter()));
        assert!(f.is_empty() && f.front().is_none() && f.pop_front().is_none());
        for i in 0..5 {
            f.push_back(i);
        }
        f.pop_front();
        assert!(f.into_iter().eq(1..5));
    }

    #[test]
    fn changes_through_the_mutable_views_stay() {
        let mut f = Fifo::default();
        for i in 0..6 {
            f.push_back(i);
        }
        f.pop_front();
        f[0] = 10;
        for x in f.range_mut(3..) {
            *x += 100;
        }
        for x in f.iter_mut().take(1) {
            *x += 1;
        }
        assert_eq!(f.iter().copied().collect::<Vec<_>>(), [11, 2, 3, 104, 105]);
        assert_eq!(f.get(5), None);
        assert_eq!(f.remove(5), None);
    }
}
