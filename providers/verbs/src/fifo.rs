//! [`Fifo`]: the endpoint's queues of request records, in post order, whose push is
//! inlined into the post.
//!
//! The ledger keeps one record per request: pushed at the back by a post, taken from the
//! front by its completion, and only now and then looked through, taken out of the
//! middle or inserted into (errors, held-back requests, emulation). `VecDeque::push_back`
//! and `Vec::push` are each a call of their own when the record is this large (their
//! growth inlined into them): callgrind of the roce 8-byte send ping-pong in the
//! soft-RDMA guest counted one per post, some 25 instructions each plus the call, where
//! in QEMU's TCG a call and its return cost as much as twenty plain instructions
//! (docs/benchmarks-record.md, thirty-second and forty-sixth sessions). Here the queue is a ring of
//! slots that are reused, never dropped: a push that needs no room writes the record into
//! its slot and counts it, and the growth is apart.
//!
//! The records are the `len` slots from `head` on, wrapping at the end, every one `Some`;
//! every other slot is `None`.

use std::ops::{Bound, RangeBounds};

/// The slots of a queue's first growth.
const FIRST_SLOTS: usize = 8;

/// A queue of records in order; see the [module docs](self).
#[derive(Debug)]
pub(crate) struct Fifo<T> {
    slots: Vec<Option<T>>,
    head: usize,
    len: usize,
}

impl<T> Default for Fifo<T> {
    fn default() -> Self {
        Fifo {
            slots: Vec::new(),
            head: 0,
            len: 0,
        }
    }
}

type Halves<I> = std::iter::Flatten<std::iter::Chain<I, I>>;
/// The records of a [`Fifo`], front to back.
pub(crate) type Iter<'a, T> = Halves<std::slice::Iter<'a, Option<T>>>;
/// The records of a [`Fifo`], front to back, mutably.
pub(crate) type IterMut<'a, T> = Halves<std::slice::IterMut<'a, Option<T>>>;

impl<T> Fifo<T> {
    /// How many records it holds.
    #[inline(always)]
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds none.
    #[inline(always)]
    pub(crate) fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The slot of the record `i` places behind the front (`i` at most `len`, the slot a
    /// push fills), when there are slots.
    #[inline(always)]
    fn slot(&self, i: usize) -> usize {
        let at = self.head + i;
        if at >= self.slots.len() {
            at - self.slots.len()
        } else {
            at
        }
    }

    /// Adds `x` at the back.
    #[inline(always)]
    pub(crate) fn push_back(&mut self, x: T) {
        if self.len == self.slots.len() {
            self.grow();
        }
        let at = self.slot(self.len);
        let old = self.slots[at].replace(x);
        // A free slot holds nothing: there is nothing to drop (and no drop call to make).
        debug_assert!(old.is_none(), "a push into a slot in use");
        std::mem::forget(old);
        self.len += 1;
    }

    /// Doubles the slots, the records moved to the front in order.
    #[cold]
    #[inline(never)]
    fn grow(&mut self) {
        let n = (self.slots.len() * 2).max(FIRST_SLOTS);
        let mut slots = Vec::with_capacity(n);
        for i in 0..self.len {
            let at = self.slot(i);
            slots.push(self.slots[at].take());
        }
        slots.resize_with(n, || None);
        self.slots = slots;
        self.head = 0;
    }

    /// Takes the record at the front.
    #[inline(always)]
    pub(crate) fn pop_front(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let x = self.slots[self.head].take();
        debug_assert!(x.is_some(), "an empty slot inside the queue");
        self.head = self.slot(1);
        self.len -= 1;
        x
    }

    /// Takes the record at the back.
    pub(crate) fn pop_back(&mut self) -> Option<T> {
        if self.len == 0 {
            return None;
        }
        let at = self.slot(self.len - 1);
        self.len -= 1;
        self.slots[at].take()
    }

    /// The record at the front.
    #[inline(always)]
    pub(crate) fn front(&self) -> Option<&T> {
        if self.len == 0 {
            return None;
        }
        self.slots[self.head].as_ref()
    }

    /// The record `i` places behind the front.
    pub(crate) fn get(&self, i: usize) -> Option<&T> {
        if i >= self.len {
            return None;
        }
        self.slots[self.slot(i)].as_ref()
    }

    /// The record `i` places behind the front, mutably.
    pub(crate) fn get_mut(&mut self, i: usize) -> Option<&mut T> {
        if i >= self.len {
            return None;
        }
        let at = self.slot(i);
        self.slots[at].as_mut()
    }

    /// Takes out the record `i` places behind the front (those behind it move up).
    pub(crate) fn remove(&mut self, i: usize) -> Option<T> {
        if i >= self.len {
            return None;
        }
        let at = self.slot(i);
        let x = self.slots[at].take();
        for k in i..self.len - 1 {
            let (to, from) = (self.slot(k), self.slot(k + 1));
            self.slots[to] = self.slots[from].take();
        }
        self.len -= 1;
        x
    }

    /// Puts `x` `i` places behind the front (those from there on move back).
    ///
    /// # Panics
    /// If `i` is beyond the back.
    pub(crate) fn insert(&mut self, i: usize, x: T) {
        assert!(i <= self.len, "insert at {i} into {} records", self.len);
        if self.len == self.slots.len() {
            self.grow();
        }
        for k in (i..self.len).rev() {
            let (to, from) = (self.slot(k + 1), self.slot(k));
            self.slots[to] = self.slots[from].take();
        }
        let at = self.slot(i);
        self.slots[at] = Some(x);
        self.len += 1;
    }

    /// Drops every record.
    pub(crate) fn clear(&mut self) {
        while self.pop_front().is_some() {}
        self.head = 0;
    }

    /// Takes every record out, front to back.
    pub(crate) fn drain_all(&mut self) -> std::vec::IntoIter<T> {
        let mut all = Vec::with_capacity(self.len);
        while let Some(x) = self.pop_front() {
            all.push(x);
        }
        self.head = 0;
        all.into_iter()
    }

    /// The slots of the places in `a..b` (counted from the front): up to the end of the
    /// slots, and from their start.
    fn halves(&self, a: usize, b: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        if a == b {
            return (0..0, 0..0);
        }
        let (s, e) = (self.head + a, self.head + b);
        let n = self.slots.len();
        if e <= n {
            (s..e, 0..0)
        } else if s >= n {
            (s - n..e - n, 0..0)
        } else {
            (s..n, 0..e - n)
        }
    }

    /// The records, front to back.
    #[inline(always)]
    pub(crate) fn iter(&self) -> Iter<'_, T> {
        self.range(..)
    }

    /// The records, front to back, mutably.
    pub(crate) fn iter_mut(&mut self) -> IterMut<'_, T> {
        self.range_mut(..)
    }

    /// The records at the places in `r` (counted from the front).
    ///
    /// # Panics
    /// If `r` reaches beyond the back.
    pub(crate) fn range(&self, r: impl RangeBounds<usize>) -> Iter<'_, T> {
        let (a, b) = self.bounds(r);
        let (x, y) = self.halves(a, b);
        self.slots[x].iter().chain(self.slots[y].iter()).flatten()
    }

    /// The records at the places in `r`, mutably.
    ///
    /// # Panics
    /// If `r` reaches beyond the back.
    pub(crate) fn range_mut(&mut self, r: impl RangeBounds<usize>) -> IterMut<'_, T> {
        let (a, b) = self.bounds(r);
        let (x, y) = self.halves(a, b);
        // The second range (where the first wrapped) lies before the first: split there.
        debug_assert!(y.end <= x.start || y.is_empty());
        let (lo, hi) = self.slots.split_at_mut(x.start);
        let second = if y.is_empty() { &mut [] } else { &mut lo[y] };
        hi[..x.end - x.start]
            .iter_mut()
            .chain(second.iter_mut())
            .flatten()
    }

    /// `r`'s places, checked against the records.
    fn bounds(&self, r: impl RangeBounds<usize>) -> (usize, usize) {
        let a = match r.start_bound() {
            Bound::Included(&a) => a,
            Bound::Excluded(&a) => a + 1,
            Bound::Unbounded => 0,
        };
        let b = match r.end_bound() {
            Bound::Included(&b) => b + 1,
            Bound::Excluded(&b) => b,
            Bound::Unbounded => self.len,
        };
        assert!(
            a <= b && b <= self.len,
            "range {a}..{b} of {} records",
            self.len
        );
        (a, b)
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
    type IntoIter = std::vec::IntoIter<T>;

    /// The records, front to back.
    fn into_iter(mut self) -> Self::IntoIter {
        self.drain_all()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;

    /// Every operation, against `VecDeque` as the model, through emptying, growth, a
    /// standing backlog that wraps around the slots, and changes in the middle.
    #[test]
    fn behaves_as_a_vecdeque() {
        let mut f = Fifo::default();
        let mut m = VecDeque::new();
        let mut next = 0u32;
        let mut most = 0;
        // A small deterministic generator: the same sequence every run.
        let mut rng = 0x9e37_79b9_u32;
        let mut roll = |n: u32| {
            rng ^= rng << 13;
            rng ^= rng >> 17;
            rng ^= rng << 5;
            rng % n
        };
        for step in 0..20_000 {
            // Phases: a backlog that grows, one that stands (wrapping around the slots), one
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
            most = most.max(m.len());
            assert!(
                f.slots.len() <= (2 * most).max(FIRST_SLOTS),
                "slots bounded by the most records held"
            );
            assert_eq!(f.slots.iter().filter(|s| s.is_some()).count(), m.len());
            if !m.is_empty() {
                let i = roll(m.len() as u32) as usize;
                assert_eq!(f[i], m[i]);
                assert!(f.range(i..).eq(m.range(i..)));
                assert!(f.range(..i).eq(m.range(..i)));
                assert!(f.range_mut(i..).map(|x| *x).eq(m.range(i..).copied()));
                assert!(f.iter_mut().map(|x| *x).eq(m.iter().copied()));
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
