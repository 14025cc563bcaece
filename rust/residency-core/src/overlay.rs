//! A small persistent map from positions to values, for the search's planning states
//! (docs/concepts/controller.md#search-bounds).
//!
//! It is a balanced (AVL) binary tree whose nodes are shared between the states that
//! hold them: a clone costs one reference count, and an insert copies only the path to
//! its key, one small node per level (`log2` of the entries). A hash array mapped trie
//! copies a node of up to dozens of slots per insert instead, and the depth-first search
//! keeps one such copy per state on its path.

use std::cmp::Ordering;
use std::sync::Arc;

/// A persistent map from `usize` keys to `V`, iterated in key order.
#[derive(Debug)]
pub(crate) struct Overlay<V> {
    root: Link<V>,
}

type Link<V> = Option<Arc<Node<V>>>;

#[derive(Debug)]
struct Node<V> {
    key: usize,
    value: V,
    height: u8,
    left: Link<V>,
    right: Link<V>,
}

impl<V> Default for Overlay<V> {
    fn default() -> Self {
        Self { root: None }
    }
}

impl<V> Clone for Overlay<V> {
    fn clone(&self) -> Self {
        Self {
            root: self.root.clone(),
        }
    }
}

fn height<V>(link: Option<&Arc<Node<V>>>) -> u8 {
    link.map_or(0, |node| node.height)
}

/// A node over two subtrees whose heights differ by at most one.
fn node<V>(key: usize, value: V, left: Link<V>, right: Link<V>) -> Arc<Node<V>> {
    let height = height(left.as_ref()).max(height(right.as_ref())) + 1;
    Arc::new(Node {
        key,
        value,
        height,
        left,
        right,
    })
}

/// A balanced node over two subtrees whose heights differ by at most two.
fn balance<V: Clone>(key: usize, value: V, left: Link<V>, right: Link<V>) -> Arc<Node<V>> {
    let (left_height, right_height) = (height(left.as_ref()), height(right.as_ref()));
    if left_height > right_height + 1 {
        if let Some(pivot) = &left {
            if height(pivot.left.as_ref()) >= height(pivot.right.as_ref()) {
                // Single rotation to the right.
                let lower = node(key, value, pivot.right.clone(), right);
                return node(
                    pivot.key,
                    pivot.value.clone(),
                    pivot.left.clone(),
                    Some(lower),
                );
            }
            if let Some(inner) = &pivot.right {
                // Double rotation: left at the pivot, then right.
                let new_left = node(
                    pivot.key,
                    pivot.value.clone(),
                    pivot.left.clone(),
                    inner.left.clone(),
                );
                let new_right = node(key, value, inner.right.clone(), right);
                return node(
                    inner.key,
                    inner.value.clone(),
                    Some(new_left),
                    Some(new_right),
                );
            }
        }
    } else if right_height > left_height + 1
        && let Some(pivot) = &right
    {
        if height(pivot.right.as_ref()) >= height(pivot.left.as_ref()) {
            let lower = node(key, value, left, pivot.left.clone());
            return node(
                pivot.key,
                pivot.value.clone(),
                Some(lower),
                pivot.right.clone(),
            );
        }
        if let Some(inner) = &pivot.left {
            let new_left = node(key, value, left, inner.left.clone());
            let new_right = node(
                pivot.key,
                pivot.value.clone(),
                inner.right.clone(),
                pivot.right.clone(),
            );
            return node(
                inner.key,
                inner.value.clone(),
                Some(new_left),
                Some(new_right),
            );
        }
    }
    node(key, value, left, right)
}

fn insert<V: Clone>(link: Option<&Arc<Node<V>>>, key: usize, value: V) -> Arc<Node<V>> {
    let Some(current) = link else {
        return node(key, value, None, None);
    };
    match key.cmp(&current.key) {
        Ordering::Less => balance(
            current.key,
            current.value.clone(),
            Some(insert(current.left.as_ref(), key, value)),
            current.right.clone(),
        ),
        Ordering::Greater => balance(
            current.key,
            current.value.clone(),
            current.left.clone(),
            Some(insert(current.right.as_ref(), key, value)),
        ),
        Ordering::Equal => node(key, value, current.left.clone(), current.right.clone()),
    }
}

impl<V: Clone> Overlay<V> {
    /// The value at `key`, if any.
    pub(crate) fn get(&self, key: usize) -> Option<&V> {
        let mut link = &self.root;
        while let Some(current) = link {
            match key.cmp(&current.key) {
                Ordering::Less => link = &current.left,
                Ordering::Greater => link = &current.right,
                Ordering::Equal => return Some(&current.value),
            }
        }
        None
    }

    /// Sets `key` to `value`, sharing every node off the path to it.
    pub(crate) fn insert(&mut self, key: usize, value: V) {
        self.root = Some(insert(self.root.as_ref(), key, value));
    }

    /// The entries in key order.
    pub(crate) fn iter(&self) -> impl Iterator<Item = (usize, &V)> {
        let mut pending: Vec<&Node<V>> = Vec::new();
        let mut link = self.root.as_deref();
        std::iter::from_fn(move || {
            while let Some(current) = link {
                pending.push(current);
                link = current.left.as_deref();
            }
            let current = pending.pop()?;
            link = current.right.as_deref();
            Some((current.key, &current.value))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::Overlay;
    use std::collections::BTreeMap;

    fn check_balanced<V>(link: Option<&std::sync::Arc<super::Node<V>>>) -> u8 {
        let Some(node) = link else { return 0 };
        let (left, right) = (
            check_balanced(node.left.as_ref()),
            check_balanced(node.right.as_ref()),
        );
        assert!(left.abs_diff(right) <= 1, "unbalanced at {}", node.key);
        assert_eq!(node.height, left.max(right) + 1);
        node.height
    }

    #[test]
    fn it_matches_a_map_and_keeps_old_versions() {
        let mut overlay: Overlay<u64> = Overlay::default();
        let mut model: BTreeMap<usize, u64> = BTreeMap::new();
        let mut versions = Vec::new();
        // A deterministic pseudo-random order of keys, with repeats.
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        for step in 0..3000u64 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            let key = usize::try_from(seed % 1024).unwrap_or(0);
            overlay.insert(key, step);
            model.insert(key, step);
            if step % 500 == 0 {
                versions.push((overlay.clone(), model.clone()));
            }
        }
        check_balanced(overlay.root.as_ref());
        let listed: Vec<(usize, u64)> = overlay.iter().map(|(key, &value)| (key, value)).collect();
        let expected: Vec<(usize, u64)> = model.iter().map(|(&key, &value)| (key, value)).collect();
        assert_eq!(listed, expected);
        assert_eq!(overlay.get(2000), None);
        for (old, old_model) in versions {
            let listed: Vec<(usize, u64)> = old.iter().map(|(key, &value)| (key, value)).collect();
            let expected: Vec<(usize, u64)> = old_model
                .iter()
                .map(|(&key, &value)| (key, value))
                .collect();
            assert_eq!(listed, expected);
            for (&key, value) in &old_model {
                assert_eq!(old.get(key), Some(value));
            }
        }
        // Ascending keys, the worst order for an unbalanced tree.
        let mut ascending: Overlay<u64> = Overlay::default();
        for key in 0..4096 {
            ascending.insert(key, 0);
        }
        assert!(check_balanced(ascending.root.as_ref()) <= 13);
    }
}
