//! A persistent vector for the state's value records: a 64-way trie of shared nodes.
//!
//! Cloning is O(1) (one reference count). Changing an entry copies the nodes on its
//! path that a clone still shares (two nodes up to 4096 entries, three up to 262144).
//! Reading an entry is one indexed load per level: the state's records are read many
//! times per operation and changed in place, snapshots being rare.

use std::sync::Arc;

const BITS: u32 = 6;
const WIDTH: usize = 1 << BITS;
const MASK: usize = WIDTH - 1;

// The variants are the same size for pointer-sized entries (the records' `Arc`s).
#[allow(clippy::large_enum_variant)]
#[derive(Clone)]
enum Node<T> {
    Leaf([Option<T>; WIDTH]),
    Branch([Option<Arc<Node<T>>>; WIDTH]),
}

impl<T> Node<T> {
    fn leaf() -> Self {
        Self::Leaf(std::array::from_fn(|_| None))
    }

    fn branch() -> Self {
        Self::Branch(std::array::from_fn(|_| None))
    }
}

/// A shared value made this holder's own, as `Arc::make_mut` makes it for values no
/// weak reference points to: copied while another holder shares it, else changed in
/// place. The unshared case, nearly every change, is two loads and the uniqueness
/// check inline. `None` never happens: a value is unshared here or a fresh copy.
#[inline]
pub(crate) fn own<T: Clone>(shared: &mut Arc<T>) -> Option<&mut T> {
    if Arc::strong_count(shared) != 1 || Arc::weak_count(shared) != 0 {
        copy_out(shared);
    }
    Arc::get_mut(shared)
}

/// Replaces a shared value with this holder's own copy of it.
#[cold]
#[inline(never)]
fn copy_out<T: Clone>(shared: &mut Arc<T>) {
    *shared = Arc::new(T::clone(shared));
}

/// A persistent vector: `push_back`, `pop_back`, reads and in-place changes by index.
pub struct PVec<T> {
    root: Option<Arc<Node<T>>>,
    len: usize,
    /// Branch levels above the leaves.
    depth: u32,
}

impl<T> Default for PVec<T> {
    fn default() -> Self {
        Self {
            root: None,
            len: 0,
            depth: 0,
        }
    }
}

impl<T> Clone for PVec<T> {
    fn clone(&self) -> Self {
        Self {
            root: self.root.clone(),
            len: self.len,
            depth: self.depth,
        }
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for PVec<T> {
    fn fmt(&self, formatter: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        formatter.debug_list().entries(self.iter()).finish()
    }
}

impl<T: PartialEq> PartialEq for PVec<T> {
    fn eq(&self, other: &Self) -> bool {
        self.len == other.len && self.iter().eq(other.iter())
    }
}

impl<T: Eq> Eq for PVec<T> {}

impl<T> PVec<T> {
    pub fn new() -> Self {
        Self::default()
    }

    pub fn len(&self) -> usize {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many entries the trie holds at its depth.
    fn capacity(&self) -> usize {
        1usize
            .checked_shl(BITS * (self.depth + 1))
            .unwrap_or(usize::MAX)
    }

    pub fn get(&self, index: usize) -> Option<&T> {
        if index >= self.len {
            return None;
        }
        let mut node = self.root.as_deref()?;
        let mut level = self.depth;
        loop {
            match node {
                Node::Branch(children) => {
                    node = children[(index >> (BITS * level)) & MASK].as_deref()?;
                    level = level.checked_sub(1)?;
                }
                Node::Leaf(entries) => return entries[index & MASK].as_ref(),
            }
        }
    }

    /// Iterates in index order.
    pub fn iter(&self) -> impl Iterator<Item = &T> + '_ {
        (0..self.len).filter_map(move |index| self.get(index))
    }
}

impl<T: Clone> PVec<T> {
    /// The slot of `index` (below the capacity), with the nodes on its path made this
    /// vector's own (copied where a clone shares them) and missing ones created.
    /// `None` never happens (see [`own`]).
    fn slot_mut(&mut self, index: usize) -> Option<&mut Option<T>> {
        let depth = self.depth;
        let mut node = own(self.root.get_or_insert_with(|| {
            Arc::new(if depth == 0 {
                Node::leaf()
            } else {
                Node::branch()
            })
        }))?;
        let mut level = depth;
        loop {
            match node {
                Node::Branch(children) => {
                    let child =
                        children[(index >> (BITS * level)) & MASK].get_or_insert_with(|| {
                            Arc::new(if level == 1 {
                                Node::leaf()
                            } else {
                                Node::branch()
                            })
                        });
                    node = own(child)?;
                    level = level.saturating_sub(1);
                }
                Node::Leaf(entries) => return Some(&mut entries[index & MASK]),
            }
        }
    }

    pub fn get_mut(&mut self, index: usize) -> Option<&mut T> {
        if index >= self.len {
            return None;
        }
        self.slot_mut(index)?.as_mut()
    }

    pub fn push_back(&mut self, value: T) {
        if self.len == self.capacity() {
            // Full at this depth: the old root becomes the new root's first child.
            let mut children: [Option<Arc<Node<T>>>; WIDTH] = std::array::from_fn(|_| None);
            children[0] = self.root.take();
            self.root = Some(Arc::new(Node::Branch(children)));
            self.depth += 1;
        }
        let index = self.len;
        if let Some(slot) = self.slot_mut(index) {
            *slot = Some(value);
            self.len += 1;
        }
    }

    pub fn pop_back(&mut self) -> Option<T> {
        let index = self.len.checked_sub(1)?;
        let value = self.slot_mut(index).and_then(Option::take);
        self.len = index;
        if self.len == 0 {
            *self = Self::default();
        }
        value
    }
}

/// Reads an entry that exists; out of range panics, as a slice's index does.
impl<T: Clone> std::ops::Index<usize> for PVec<T> {
    type Output = T;

    fn index(&self, index: usize) -> &T {
        self.get(index).expect("a persistent vector index in range")
    }
}

/// Changes an entry that exists; out of range panics, as a slice's index does.
impl<T: Clone> std::ops::IndexMut<usize> for PVec<T> {
    fn index_mut(&mut self, index: usize) -> &mut T {
        self.get_mut(index)
            .expect("a persistent vector index in range")
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::{PVec, own};

    #[test]
    fn own_changes_an_unshared_value_in_place_and_copies_a_shared_one() {
        let mut value = Arc::new(vec![1, 2]);
        let before = Arc::as_ptr(&value);
        if let Some(owned) = own(&mut value) {
            owned.push(3);
        }
        assert_eq!(
            Arc::as_ptr(&value),
            before,
            "an unshared value is not copied"
        );
        assert_eq!(*value, vec![1, 2, 3]);

        let other = Arc::clone(&value);
        if let Some(owned) = own(&mut value) {
            owned.push(4);
        }
        assert_ne!(Arc::as_ptr(&value), before, "a shared value is copied");
        assert_eq!(*value, vec![1, 2, 3, 4]);
        assert_eq!(*other, vec![1, 2, 3], "the other holder keeps its value");
        assert_eq!(Arc::strong_count(&other), 1);

        let weak = Arc::downgrade(&value);
        let copied = Arc::as_ptr(&value);
        if let Some(owned) = own(&mut value) {
            owned.push(5);
        }
        assert_ne!(
            Arc::as_ptr(&value),
            copied,
            "a weakly referenced value is copied"
        );
        assert_eq!(*value, vec![1, 2, 3, 4, 5]);
        // As with `Arc::make_mut`: the weak reference no longer reaches the value.
        assert!(weak.upgrade().is_none());
    }

    #[test]
    fn matches_a_vector_and_snapshots_keep_their_entries() {
        let mut vector: PVec<u32> = PVec::new();
        let mut model: Vec<u32> = Vec::new();
        let mut snapshots: Vec<(PVec<u32>, Vec<u32>)> = Vec::new();
        // Across depths 0..=2 (64, 4096 and 262144 entries) and back.
        for step in 0..5000u32 {
            vector.push_back(step);
            model.push(step);
            if step % 97 == 0 {
                snapshots.push((vector.clone(), model.clone()));
            }
            if step % 13 == 0 {
                let at = (step as usize * 7) % model.len();
                vector[at] += 1;
                model[at] += 1;
            }
            if step % 31 == 0 {
                assert_eq!(vector.pop_back(), model.pop());
            }
        }
        assert_eq!(vector.len(), model.len());
        assert!(vector.iter().eq(model.iter()));
        assert_eq!(vector.get(model.len()), None);
        for (snapshot, expected) in &snapshots {
            assert_eq!(snapshot.len(), expected.len());
            assert!(snapshot.iter().eq(expected.iter()));
        }
        while let Some(value) = model.pop() {
            assert_eq!(vector.pop_back(), Some(value));
        }
        assert!(vector.is_empty());
        assert_eq!(vector.pop_back(), None);
        vector.push_back(3);
        assert_eq!(vector.get(0), Some(&3));
        assert_eq!(vector.get(1), None);
    }
}
