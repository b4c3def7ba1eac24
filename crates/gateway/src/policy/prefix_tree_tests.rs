use std::collections::HashMap;

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;

/// Checks every structural invariant; returns the number of reachable non-root nodes.
fn check<S: Symbol + fmt::Debug>(tree: &PrefixTree<S>) -> usize {
    let mut size = 0;
    let mut symbols = 0;
    let mut reachable = 0;
    let mut stack = vec![ROOT];
    while let Some(node) = stack.pop() {
        let n = &tree.nodes[node as usize];
        for pair in n.children.windows(2) {
            assert!(pair[0].0 < pair[1].0, "children sorted and distinct");
        }
        for &(first, child) in &n.children {
            let c = &tree.nodes[child as usize];
            assert!(!c.edge.is_empty());
            assert_eq!(c.edge[0], first);
            assert_eq!(c.parent, node);
            size += PrefixTree::<S>::charge(c.edge.len());
            symbols += c.edge.len();
            reachable += 1;
            stack.push(child);
        }
    }
    assert_eq!(size, tree.size);
    assert_eq!(symbols, tree.symbols);
    assert_eq!(reachable, tree.nodes());
    // The recency list holds every node once, each older than its ancestors.
    let mut position = HashMap::new();
    let mut at = tree.newest;
    let mut prev = NIL;
    while at != NIL {
        assert_eq!(tree.nodes[at as usize].newer, prev);
        assert!(position.insert(at, position.len()).is_none());
        prev = at;
        at = tree.nodes[at as usize].older;
    }
    assert_eq!(tree.oldest, prev);
    assert_eq!(position.len(), reachable);
    for (&node, &pos) in &position {
        let parent = tree.nodes[node as usize].parent;
        if parent != ROOT {
            assert!(position[&parent] < pos, "a parent is newer than its child");
        }
    }
    if tree.oldest != NIL {
        assert!(tree.nodes[tree.oldest as usize].children.is_empty());
    }
    reachable
}

#[test]
fn matches_longest_stored_prefix() {
    let mut tree = PrefixTree::<u8>::new(usize::MAX);
    tree.insert(b"hello world");
    tree.insert(b"hello there");
    assert_eq!(tree.match_len(b"hello wor"), 9);
    assert_eq!(tree.match_len(b"hello world and more"), 11);
    assert_eq!(tree.match_len(b"hello there"), 11);
    assert_eq!(tree.match_len(b"help"), 3);
    assert_eq!(tree.match_len(b"xyz"), 0);
    assert_eq!(tree.match_len(b""), 0);
    // "hello " is shared: stored once, in a node of its own.
    assert_eq!(tree.symbols(), 6 + 5 + 5);
    assert_eq!(tree.nodes(), 3);
    check(&tree);
}

#[test]
fn a_prefix_of_a_stored_prompt_adds_no_symbols() {
    let mut tree = PrefixTree::<u8>::new(usize::MAX);
    tree.insert(b"abcdef");
    tree.insert(b"abc");
    tree.insert(b"abcdef");
    assert_eq!(tree.symbols(), 6);
    assert_eq!(tree.nodes(), 2);
    assert_eq!(tree.match_len(b"abcdxx"), 4);
    check(&tree);
}

#[test]
fn evicts_the_least_recently_used_prompt_first() {
    let prompt = |c: u8| [c; 100];
    let one = PrefixTree::<u8>::charge(100);
    let mut tree = PrefixTree::<u8>::new(3 * one);
    for c in [b'a', b'b', b'c'] {
        tree.insert(&prompt(c));
    }
    assert_eq!(tree.size(), 3 * one);
    tree.insert(&prompt(b'a')); // a is now newer than b and c
    tree.insert(&prompt(b'd'));
    assert_eq!(tree.match_len(&prompt(b'b')), 0, "b was the oldest");
    for c in [b'a', b'c', b'd'] {
        assert_eq!(tree.match_len(&prompt(c)), 100);
    }
    assert_eq!(tree.size(), 3 * one);
    check(&tree);
}

#[test]
fn eviction_keeps_a_shared_prefix_that_is_still_used() {
    let system = [b's'; 200];
    let with = |tail: &[u8]| [&system[..], tail].concat();
    let mut tree = PrefixTree::<u8>::new(PrefixTree::<u8>::charge(200) * 4);
    tree.insert(&with(b"old question"));
    for i in 0..50 {
        tree.insert(&with(format!("question {i}").as_bytes()));
    }
    // Old leaves went, the system prompt every request shares stayed.
    assert_eq!(tree.match_len(&with(b"old question")), 200);
    assert_eq!(tree.match_len(&with(b"question 49")), 211);
    assert!(tree.size() <= PrefixTree::<u8>::charge(200) * 4);
    check(&tree);
}

#[test]
fn size_never_exceeds_the_cap_under_churn() {
    const CAP: usize = 1 << 20;
    let mut rng = StdRng::seed_from_u64(9);
    let mut tree = PrefixTree::<u8>::new(CAP);
    let mut prompt = vec![0u8; 200];
    for i in 0..100_000 {
        rng.fill(&mut prompt[..]);
        tree.insert(&prompt);
        assert!(tree.size() <= CAP, "{} > {CAP} after {i}", tree.size());
        assert_eq!(tree.match_len(&prompt), prompt.len());
        if i % 20_000 == 0 {
            check(&tree);
        }
    }
    // 100k prompts of 200 bytes are 20 MB; the tree kept the newest ~1 MiB of them, and
    // the arena never held more nodes than the cap admits at once.
    assert!(tree.size() > CAP - 1_000, "{}", tree.size());
    assert!(tree.symbols() > CAP / 2, "{}", tree.symbols());
    let most_nodes = CAP / PrefixTree::<u8>::node_overhead() + 1;
    assert!(tree.arena_len() <= most_nodes, "{}", tree.arena_len());
    check(&tree);
}

#[test]
fn agrees_with_a_brute_force_model() {
    let mut rng = StdRng::seed_from_u64(1);
    // 2000 bytes hold any one key's path (at most 11 nodes of about 80 bytes).
    for cap in [usize::MAX, 2_000] {
        let mut tree = PrefixTree::<u8>::new(cap);
        let mut stored: Vec<Vec<u8>> = Vec::new();
        for round in 0..3_000 {
            let len = rng.random_range(0..12);
            let key: Vec<u8> = (0..len).map(|_| b"abc"[rng.random_range(0..3)]).collect();
            let model = stored
                .iter()
                .map(|s| common_prefix(s, &key))
                .max()
                .unwrap_or(0);
            let got = tree.match_len(&key);
            if cap == usize::MAX {
                assert_eq!(got, model, "{key:?}");
            } else {
                // Evicted prompts may be gone, never invented.
                assert!(got <= model, "{key:?}: {got} > {model}");
            }
            if rng.random_bool(0.7) {
                tree.insert(&key);
                stored.push(key.clone());
                assert_eq!(tree.match_len(&key), key.len(), "the newest key stays");
                assert!(tree.size() <= cap);
            }
            if round % 100 == 0 {
                check(&tree);
            }
        }
        check(&tree);
    }
}

#[test]
fn the_newest_prompt_survives_when_it_fits() {
    let mut tree = PrefixTree::<u8>::new(1_000);
    for i in 0..200u32 {
        let key = format!("{i:05}-padding-padding");
        tree.insert(key.as_bytes());
        assert_eq!(tree.match_len(key.as_bytes()), key.len());
    }
    check(&tree);
}

#[test]
fn a_prompt_larger_than_the_cap_leaves_the_tree_within_it() {
    let mut tree = PrefixTree::<u8>::new(500);
    tree.insert(b"short");
    tree.insert(&[b'x'; 10_000]);
    assert!(tree.size() <= 500);
    check(&tree);
}

#[test]
fn token_trees_count_four_bytes_a_symbol() {
    let mut tree = PrefixTree::<u32>::new(usize::MAX);
    tree.insert(&[1, 2, 3, 4]);
    tree.insert(&[1, 2, 9]);
    assert_eq!(tree.match_len(&[1, 2, 3, 7]), 3);
    assert_eq!(tree.symbols(), 5);
    assert_eq!(
        tree.size(),
        3 * PrefixTree::<u32>::node_overhead() + 5 * size_of::<u32>()
    );
    check(&tree);
    tree.clear();
    assert_eq!((tree.size(), tree.nodes(), tree.match_len(&[1])), (0, 0, 0));
}
