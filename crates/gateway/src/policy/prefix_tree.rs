//! A compressed prefix (radix) tree of prompts with a size cap and LRU eviction.
//!
//! One tree holds the prompts the gateway sent to one worker, so its longest match with a
//! new prompt estimates how much of that prompt the worker has cached. It is approximate
//! by design: the worker's own cache evicts on its own schedule.
//!
//! Memory is bounded: [`PrefixTree::size`] counts approximate heap bytes (the stored
//! symbols plus a fixed per-node overhead, [`PrefixTree::node_overhead`]), and every
//! insert that pushes it past the cap evicts least recently used leaves until it fits
//! again. Nodes live in one arena (freed slots are reused), so the arena never holds more
//! nodes than the cap allows at once, and memory stays flat under any amount of churn.
//!
//! Eviction is O(1) per node: all nodes but the root sit on a recency list, and every
//! insert touches its path deepest node first, so each node is always older than its
//! ancestors and the oldest node is always a leaf. No scan and no heap are needed.

use std::fmt;
use std::mem::size_of;

/// A prompt symbol: a byte of text or a token id.
pub trait Symbol: Copy + Eq + Ord + Send + Sync + 'static {}

impl Symbol for u8 {}
impl Symbol for u32 {}

const ROOT: u32 = 0;
const NIL: u32 = u32::MAX;

/// Allocator bookkeeping and rounding per heap block, a rough constant.
const ALLOC_OVERHEAD: usize = 16;

struct Node<S> {
    /// The edge from the parent: the symbols this node adds to its parent's prefix.
    edge: Box<[S]>,
    /// Children by the first symbol of their edge, sorted for binary search.
    children: Vec<(S, u32)>,
    parent: u32,
    /// Neighbours on the recency list (towards the most and the least recently used).
    newer: u32,
    older: u32,
}

impl<S> Node<S> {
    fn new(edge: Box<[S]>, parent: u32) -> Self {
        Self {
            edge,
            children: Vec::new(),
            parent,
            newer: NIL,
            older: NIL,
        }
    }
}

/// A radix tree over `S` whose approximate heap size stays at or under a cap.
pub struct PrefixTree<S> {
    /// Node arena; index 0 is the root (empty edge, never evicted, not on the list).
    nodes: Vec<Node<S>>,
    /// Freed arena slots, reused before the arena grows.
    free: Vec<u32>,
    /// Most recently used node.
    newest: u32,
    /// Least recently used node; always a leaf.
    oldest: u32,
    size: usize,
    symbols: usize,
    cap: usize,
}

impl<S: Symbol> PrefixTree<S> {
    /// An empty tree that holds at most about `cap` bytes.
    pub fn new(cap: usize) -> Self {
        Self {
            nodes: vec![Node::new(Box::new([]), NIL)],
            free: Vec::new(),
            newest: NIL,
            oldest: NIL,
            size: 0,
            symbols: 0,
            cap,
        }
    }

    /// The fixed bytes charged per node on top of its symbols: the node itself, its
    /// entry in the parent's child list and the edge's allocation.
    pub fn node_overhead() -> usize {
        size_of::<Node<S>>() + size_of::<(S, u32)>() + ALLOC_OVERHEAD
    }

    fn charge(edge_len: usize) -> usize {
        Self::node_overhead() + edge_len * size_of::<S>()
    }

    /// Approximate heap bytes held (never above the cap after an insert returns).
    pub fn size(&self) -> usize {
        self.size
    }

    /// Prompt symbols stored (shared prefixes once).
    pub fn symbols(&self) -> usize {
        self.symbols
    }

    /// Nodes besides the root.
    pub fn nodes(&self) -> usize {
        self.nodes.len() - 1 - self.free.len()
    }

    /// Arena slots ever allocated (live plus free); bounded by the cap.
    pub fn arena_len(&self) -> usize {
        self.nodes.len()
    }

    /// The length of the longest prefix of `key` stored in the tree.
    pub fn match_len(&self, key: &[S]) -> usize {
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let Some(child) = self.child(node, key[pos]) else {
                break;
            };
            let edge = &self.nodes[child as usize].edge;
            let common = common_prefix(edge, &key[pos..]);
            pos += common;
            if common < edge.len() {
                break;
            }
            node = child;
        }
        pos
    }

    /// Stores `key`, marks its path most recently used, then evicts the least recently
    /// used leaves until the tree fits its cap again.
    pub fn insert(&mut self, key: &[S]) {
        let mut node = ROOT;
        let mut pos = 0;
        while pos < key.len() {
            let children = &self.nodes[node as usize].children;
            match children.binary_search_by(|(s, _)| s.cmp(&key[pos])) {
                Err(slot) => {
                    let leaf = self.alloc(Node::new(key[pos..].into(), node));
                    self.nodes[node as usize]
                        .children
                        .insert(slot, (key[pos], leaf));
                    self.size += Self::charge(key.len() - pos);
                    self.symbols += key.len() - pos;
                    node = leaf;
                    pos = key.len();
                }
                Ok(slot) => {
                    let child = children[slot].1;
                    let edge_len = self.nodes[child as usize].edge.len();
                    let common = common_prefix(&self.nodes[child as usize].edge, &key[pos..]);
                    pos += common;
                    node = if common < edge_len {
                        self.split(node, slot, child, common)
                    } else {
                        child
                    };
                }
            }
        }
        self.touch_path(node);
        self.evict_to(self.cap);
    }

    /// Evicts least recently used leaves until the size is at most `limit`.
    pub fn evict_to(&mut self, limit: usize) {
        while self.size > limit && self.oldest != NIL {
            self.remove_leaf(self.oldest);
        }
    }

    /// Forgets everything.
    pub fn clear(&mut self) {
        *self = Self::new(self.cap);
    }

    fn child(&self, node: u32, first: S) -> Option<u32> {
        let children = &self.nodes[node as usize].children;
        children
            .binary_search_by(|(s, _)| s.cmp(&first))
            .ok()
            .map(|i| children[i].1)
    }

    fn alloc(&mut self, node: Node<S>) -> u32 {
        match self.free.pop() {
            Some(i) => {
                self.nodes[i as usize] = node;
                i
            }
            None => {
                self.nodes.push(node);
                u32::try_from(self.nodes.len() - 1).expect("fewer than 2^32 nodes")
            }
        }
    }

    /// Splits `child` (the `slot`-th child of `parent`) after `at` symbols of its edge;
    /// returns the new node holding the first part, which takes the child's place.
    fn split(&mut self, parent: u32, slot: usize, child: u32, at: usize) -> u32 {
        let edge = std::mem::take(&mut self.nodes[child as usize].edge);
        let (head, tail) = edge.split_at(at);
        let mut mid = Node::new(head.into(), parent);
        mid.children.push((tail[0], child));
        self.nodes[child as usize].edge = tail.into();
        let mid = self.alloc(mid);
        self.nodes[child as usize].parent = mid;
        self.nodes[parent as usize].children[slot].1 = mid;
        self.size += Self::node_overhead();
        // Just newer than the child keeps every node older than its ancestors.
        let newer = self.nodes[child as usize].newer;
        self.link(mid, newer, child);
        mid
    }

    /// Makes `node` and its ancestors the most recently used, the root-most newest.
    fn touch_path(&mut self, mut node: u32) {
        while node != ROOT {
            self.unlink(node);
            self.link(node, NIL, self.newest);
            node = self.nodes[node as usize].parent;
        }
    }

    fn remove_leaf(&mut self, leaf: u32) {
        debug_assert!(self.nodes[leaf as usize].children.is_empty());
        self.unlink(leaf);
        let node = std::mem::replace(&mut self.nodes[leaf as usize], Node::new(Box::new([]), NIL));
        let siblings = &mut self.nodes[node.parent as usize].children;
        if let Ok(i) = siblings.binary_search_by(|(s, _)| s.cmp(&node.edge[0])) {
            siblings.remove(i);
        }
        self.size -= Self::charge(node.edge.len());
        self.symbols -= node.edge.len();
        self.free.push(leaf);
    }

    /// Puts `node` on the recency list between `newer` and `older` (either may be NIL).
    fn link(&mut self, node: u32, newer: u32, older: u32) {
        self.nodes[node as usize].newer = newer;
        self.nodes[node as usize].older = older;
        match newer {
            NIL => self.newest = node,
            n => self.nodes[n as usize].older = node,
        }
        match older {
            NIL => self.oldest = node,
            o => self.nodes[o as usize].newer = node,
        }
    }

    /// Takes `node` off the recency list (a no-op for a node that is not on it).
    fn unlink(&mut self, node: u32) {
        let Node { newer, older, .. } = self.nodes[node as usize];
        if newer == NIL && older == NIL && self.newest != node {
            return;
        }
        match newer {
            NIL => self.newest = older,
            n => self.nodes[n as usize].older = older,
        }
        match older {
            NIL => self.oldest = newer,
            o => self.nodes[o as usize].newer = newer,
        }
        self.nodes[node as usize].newer = NIL;
        self.nodes[node as usize].older = NIL;
    }
}

impl<S> fmt::Debug for PrefixTree<S> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PrefixTree")
            .field("size", &self.size)
            .field("symbols", &self.symbols)
            .field("cap", &self.cap)
            .finish_non_exhaustive()
    }
}

/// How many leading symbols `a` and `b` share; compares in chunks first so long shared
/// prefixes go through `memcmp`.
fn common_prefix<S: Eq>(a: &[S], b: &[S]) -> usize {
    const CHUNK: usize = 32;
    let n = a.len().min(b.len());
    let mut i = 0;
    while i + CHUNK <= n && a[i..i + CHUNK] == b[i..i + CHUNK] {
        i += CHUNK;
    }
    while i < n && a[i] == b[i] {
        i += 1;
    }
    i
}

#[cfg(test)]
#[path = "prefix_tree_tests.rs"]
mod tests;
