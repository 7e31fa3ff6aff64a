//! A slab: values in a vector, named by keys that carry their slot's index and a generation.
//!
//! The endpoint's operations, connections and requests in flight live in slabs: a look-up is
//! an index and a comparison, where a hash map (even with [`fabric::hash::IdHasher`]) spent
//! about 35 instructions, a dozen times per 8-byte message (callgrind, docs/benchmarks-record.md).
//!
//! A key is `generation << IDX | index`. A slot's generation starts at 1 and grows each
//! time its value is removed, so a key names one value only: a key kept after its value
//! left (a completion of a closed connection, a peer's echo of an old operation, a
//! cancelled receive's id) finds nothing, never a later value in the same slot. A slot
//! whose generation reached the largest is retired instead of reused: generations never
//! wrap, so no key is ever issued twice. Keys are never 0, and they stay below
//! `2^(IDX + GEN)`, so callers can pack them into wider words (a receive's context
//! carries a connection's key above its buffer index).

/// One slot: its generation, and its value while occupied.
#[derive(Debug)]
struct Slot<T> {
    gen: u64,
    value: Option<T>,
}

/// Values named by generation-checked keys (see the module documentation): at most
/// `2^IDX` at once, keys below `2^(IDX + GEN)`.
#[derive(Debug)]
pub(crate) struct Slab<T, const IDX: u32, const GEN: u32> {
    slots: Vec<Slot<T>>,
    /// Vacant slots, the most recently vacated last (reused first: warm in the cache).
    free: Vec<usize>,
    len: usize,
}

impl<T, const IDX: u32, const GEN: u32> Slab<T, IDX, GEN> {
    const GEN_MAX: u64 = {
        assert!(IDX + GEN <= 64 && IDX < 64 && GEN >= 1);
        u64::MAX >> (64 - GEN)
    };
    const MASK: u64 = (1 << IDX) - 1;

    /// An empty slab.
    pub(crate) fn new() -> Self {
        Slab {
            slots: Vec::new(),
            free: Vec::new(),
            len: 0,
        }
    }

    fn split(key: u64) -> (usize, u64) {
        ((key & Self::MASK) as usize, key >> IDX)
    }

    /// The key the next [`Slab::insert`] returns, when nothing else is inserted or removed
    /// in between (to name a request to a provider before it is kept here).
    pub(crate) fn vacant_key(&self) -> u64 {
        match self.free.last() {
            Some(&i) => self.slots[i].gen << IDX | i as u64,
            None => 1 << IDX | self.slots.len() as u64,
        }
    }

    /// Keeps `value`; returns its key. Panics beyond `2^IDX` values at once (the
    /// callers' own limits keep far below: the completion queue's capacity bounds the
    /// connections, memory the rest).
    pub(crate) fn insert(&mut self, value: T) -> u64 {
        self.len += 1;
        if let Some(i) = self.free.pop() {
            let s = &mut self.slots[i];
            debug_assert!(s.value.is_none());
            s.value = Some(value);
            return s.gen << IDX | i as u64;
        }
        let i = self.slots.len();
        assert!((i as u64) < 1 << IDX, "slab full: {i} values at once");
        self.slots.push(Slot {
            gen: 1,
            value: Some(value),
        });
        1 << IDX | i as u64
    }

    /// The value of `key`, if it is still here.
    pub(crate) fn get(&self, key: &u64) -> Option<&T> {
        let (i, gen) = Self::split(*key);
        self.slots
            .get(i)
            .filter(|s| s.gen == gen)
            .and_then(|s| s.value.as_ref())
    }

    /// The value of `key`, mutably, if it is still here.
    pub(crate) fn get_mut(&mut self, key: &u64) -> Option<&mut T> {
        let (i, gen) = Self::split(*key);
        self.slots
            .get_mut(i)
            .filter(|s| s.gen == gen)
            .and_then(|s| s.value.as_mut())
    }

    /// Whether `key`'s value is still here.
    pub(crate) fn contains_key(&self, key: &u64) -> bool {
        self.get(key).is_some()
    }

    /// Takes `key`'s value out; the key names nothing from now on.
    pub(crate) fn remove(&mut self, key: &u64) -> Option<T> {
        let (i, gen) = Self::split(*key);
        let s = self.slots.get_mut(i).filter(|s| s.gen == gen)?;
        let v = s.value.take()?;
        self.len -= 1;
        if s.gen < Self::GEN_MAX {
            s.gen += 1;
            self.free.push(i);
        }
        Some(v)
    }

    /// How many values are here.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Every value with its key, in slot order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (u64, &T)> {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| Some((s.gen << IDX | i as u64, s.value.as_ref()?)))
    }

    /// Every key.
    pub(crate) fn keys(&self) -> impl Iterator<Item = u64> + '_ {
        self.iter().map(|(k, _)| k)
    }

    /// Every value.
    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.slots.iter().filter_map(|s| s.value.as_ref())
    }

    /// Removes every value (their keys name nothing from now on).
    pub(crate) fn clear(&mut self) {
        let keys: Vec<u64> = self.keys().collect();
        for k in keys {
            self.remove(&k);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_name_one_value_only() {
        let mut s = Slab::<_, 4, 4>::new();
        let a = s.insert("a");
        let b = s.insert("b");
        assert_ne!(a, 0);
        assert_eq!((s.get(&a), s.get(&b), s.len()), (Some(&"a"), Some(&"b"), 2));
        assert_eq!(s.remove(&a), Some("a"));
        assert_eq!(s.get(&a), None);
        assert_eq!(s.remove(&a), None);
        assert_eq!(s.len(), 1);
        // The slot is reused under a new generation: the old key finds nothing.
        let predicted = s.vacant_key();
        let c = s.insert("c");
        assert_eq!(c, predicted);
        assert_eq!(c & 0xf, a & 0xf);
        assert_ne!(c, a);
        assert_eq!((s.get(&a), s.get(&c)), (None, Some(&"c")));
        *s.get_mut(&c).expect("c") = "c2";
        assert_eq!(s.iter().collect::<Vec<_>>(), [(c, &"c2"), (b, &"b")]);
        // A key naming a slot that does not exist, or a foreign number, finds nothing.
        assert_eq!(
            (s.get(&0), s.get(&u64::MAX), s.get(&(1 << 4 | 9))),
            (None, None, None)
        );
        assert_eq!(s.vacant_key(), 1 << 4 | 2);
        s.clear();
        assert_eq!((s.len(), s.get(&b), s.get(&c)), (0, None, None));
    }

    #[test]
    fn a_slot_at_the_last_generation_is_retired_not_wrapped() {
        // 2 generation bits: generations 1, 2, 3.
        let mut s = Slab::<_, 2, 2>::new();
        let mut seen = Vec::new();
        for _ in 0..3 {
            let k = s.insert(());
            assert!(!seen.contains(&k), "key {k} issued twice");
            assert!(k < 1 << 4, "key {k} wider than 4 bits");
            seen.push(k);
            s.remove(&k);
        }
        // Slot 0 is spent: the next value takes slot 1.
        assert_eq!(s.insert(()), 1 << 2 | 1);
        assert!(seen.iter().all(|k| s.get(k).is_none()));
    }

    #[test]
    fn vacant_key_predicts_insert() {
        let mut s = Slab::<_, 8, 8>::new();
        let mut live = Vec::new();
        for round in 0..200u32 {
            if round % 3 == 2 {
                let k = live.remove((round as usize * 7) % live.len());
                assert!(s.remove(&k).is_some());
            } else {
                let want = s.vacant_key();
                let k = s.insert(round);
                assert_eq!(k, want);
                live.push(k);
            }
            assert_eq!(s.len(), live.len());
        }
        for k in &live {
            assert!(s.contains_key(k));
        }
    }
}
