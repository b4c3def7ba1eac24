use super::*;

fn prompt(len: usize, salt: u32) -> Vec<u32> {
    (0..len as u32).map(|i| i * 7 + salt).collect()
}

/// Allocates blocks for `tokens` after a prefix hit and commits every full block, as
/// the scheduler does once a prompt is computed.
fn run_sequence(bm: &mut BlockManager, tokens: &[u32]) -> (PrefixHit, Vec<BlockId>) {
    let hit = bm.match_prefix(tokens);
    let total = tokens.len().div_ceil(BLOCK_SIZE);
    let mut blocks = hit.blocks.clone();
    blocks.extend(bm.allocate(total - blocks.len()).unwrap());
    let mut parent = None;
    for (i, chunk) in tokens.chunks_exact(BLOCK_SIZE).enumerate() {
        parent = Some(bm.commit(blocks[i], parent, chunk).unwrap());
    }
    (hit, blocks)
}

#[test]
fn allocate_and_release_account_for_every_block() {
    let mut bm = BlockManager::new(4);
    let a = bm.allocate(3).unwrap();
    assert_eq!((bm.num_used(), bm.num_free()), (3, 1));
    assert!(bm.allocate(2).is_none(), "all-or-nothing");
    assert_eq!(bm.num_free(), 1);
    bm.release(&a).unwrap();
    assert_eq!((bm.num_used(), bm.num_free()), (0, 4));
    assert_eq!(bm.release(&a[..1]), Err(BlockError::NotInUse(a[0])));
    assert_eq!(bm.release(&[9]), Err(BlockError::UnknownBlock(9)));
}

#[test]
fn repeated_prompt_hits_its_full_blocks_only() {
    let mut bm = BlockManager::new(16);
    let p = prompt(40, 1); // 2 full blocks + 8 tokens
    let (hit, blocks) = run_sequence(&mut bm, &p);
    assert!(hit.blocks.is_empty());
    bm.release(&blocks).unwrap();
    assert_eq!(bm.num_used(), 0);
    assert_eq!(bm.num_cached(), 2);

    let (hit, blocks2) = run_sequence(&mut bm, &p);
    assert_eq!(hit.num_tokens(), 32);
    assert_eq!(&blocks2[..2], &blocks[..2], "same physical blocks reused");
    bm.release(&blocks2).unwrap();

    // A prompt that shares only the first block.
    let mut other = p.clone();
    other[20] += 1;
    let (hit, b3) = run_sequence(&mut bm, &other);
    assert_eq!(hit.blocks, vec![blocks[0]]);
    bm.release(&b3).unwrap();
}

#[test]
fn exact_block_multiple_leaves_one_token_to_compute() {
    let mut bm = BlockManager::new(8);
    let p = prompt(32, 3);
    let (_, blocks) = run_sequence(&mut bm, &p);
    bm.release(&blocks).unwrap();
    let hit = bm.match_prefix(&p);
    assert_eq!(hit.blocks.len(), 1, "last block is recomputed for logits");
    bm.release(&hit.blocks).unwrap();
}

#[test]
fn shared_blocks_are_counted_once_and_freed_last() {
    let mut bm = BlockManager::new(8);
    let p = prompt(33, 5);
    let (_, a) = run_sequence(&mut bm, &p);
    let (hit, b) = run_sequence(&mut bm, &p);
    assert_eq!(hit.blocks.len(), 2);
    assert_eq!(bm.ref_count(a[0]), 2);
    assert_eq!(bm.num_used(), 4, "2 shared + 1 tail each");
    bm.release(&a).unwrap();
    assert_eq!(bm.num_used(), 3);
    bm.release(&b).unwrap();
    assert_eq!(bm.num_used(), 0);
}

#[test]
fn cached_blocks_are_reclaimed_lru_when_free_runs_out() {
    let mut bm = BlockManager::new(4);
    let first = prompt(17, 1);
    let second = prompt(17, 2);
    let (_, a) = run_sequence(&mut bm, &first);
    bm.release(&a).unwrap();
    let (_, b) = run_sequence(&mut bm, &second);
    bm.release(&b).unwrap();
    assert_eq!(bm.num_cached(), 2);
    // Plain free blocks go first: the two cached ones survive.
    let x = bm.allocate(2).unwrap();
    assert_eq!(bm.num_cached(), 2);
    // Then the least recently released cached block (first prompt's) is evicted.
    let y = bm.allocate(1).unwrap();
    assert_eq!(bm.num_cached(), 1);
    assert!(bm.match_prefix(&first).blocks.is_empty());
    let hit = bm.match_prefix(&second);
    assert_eq!(hit.blocks.len(), 1);
    assert!(bm.allocate(1).is_none(), "the hit block is in use again");
    for ids in [x, y, hit.blocks] {
        bm.release(&ids).unwrap();
    }
    assert_eq!(bm.num_used(), 0);
}

#[test]
fn duplicate_content_keeps_the_first_copy() {
    let mut bm = BlockManager::new(4);
    let p = prompt(16, 9);
    let a = bm.allocate(1).unwrap();
    let b = bm.allocate(1).unwrap();
    let ha = bm.commit(a[0], None, &p).unwrap();
    let hb = bm.commit(b[0], None, &p).unwrap();
    assert_eq!(ha, hb);
    assert_eq!(bm.num_cached(), 1);
    bm.release(&b).unwrap();
    bm.release(&a).unwrap();
    let hit = bm.match_prefix(&[p.clone(), vec![1]].concat());
    assert_eq!(hit.blocks, a);
    bm.release(&hit.blocks).unwrap();
}

#[test]
fn pinned_blocks_outlive_their_sequence() {
    let mut bm = BlockManager::new(4);
    let a = bm.allocate(2).unwrap();
    bm.pin(&a).unwrap();
    assert_eq!(bm.num_pinned(), 2);
    bm.release(&a).unwrap();
    assert_eq!(bm.num_used(), 2, "the pin keeps them");
    bm.unpin(&a).unwrap();
    assert_eq!((bm.num_used(), bm.num_pinned()), (0, 0));
    assert_eq!(bm.unpin(&a), Err(BlockError::NotPinned(a[0])));
    assert_eq!(bm.pin(&a), Err(BlockError::NotInUse(a[0])));
}

#[test]
fn cache_changes_are_recorded_once_listened_for() {
    let mut bm = BlockManager::new(3);
    let p = prompt(17, 6);
    let (_, a) = run_sequence(&mut bm, &p);
    assert!(bm.drain_changes().is_empty(), "nobody listens yet");
    bm.release(&a).unwrap();
    bm.record_changes();
    let q = prompt(33, 7);
    let (_, b) = run_sequence(&mut bm, &q);
    let changes = bm.drain_changes();
    // The first prompt's cached block was reclaimed, the second's two were stored.
    let first = BlockHash::of(None, &p[..BLOCK_SIZE]);
    let h0 = BlockHash::of(None, &q[..BLOCK_SIZE]);
    let h1 = BlockHash::of(Some(h0), &q[BLOCK_SIZE..2 * BLOCK_SIZE]);
    assert_eq!(changes.len(), 3, "{changes:?}");
    assert_eq!(changes[0], CacheChange::Removed { hash: first });
    assert!(matches!(changes[1], CacheChange::Stored { hash, parent: None, .. } if hash == h0));
    assert!(
        matches!(changes[2], CacheChange::Stored { hash, parent: Some(p), tokens } if hash == h1 && p == h0 && tokens[..] == q[BLOCK_SIZE..2 * BLOCK_SIZE])
    );
    assert!(bm.drain_changes().is_empty(), "drained");
    // Hitting cached content again is not news.
    bm.release(&b).unwrap();
    let (_, again) = run_sequence(&mut bm, &q);
    assert!(bm.drain_changes().is_empty());
    bm.release(&again).unwrap();
}

#[test]
fn kept_blocks_survive_until_the_pool_needs_them() {
    let mut bm = BlockManager::new(4);
    let p = prompt(20, 4); // one full block (cached) and a partial one (not)
    let (_, seq) = run_sequence(&mut bm, &p);
    bm.pin(&seq).unwrap(); // as a finishing pin_on_finish sequence
    bm.release(&seq).unwrap();
    bm.keep(7, &seq).unwrap();
    bm.unpin(&seq).unwrap();
    assert_eq!((bm.num_pinned(), bm.num_used(), bm.num_free()), (0, 0, 4));
    // Plain free blocks go first: the kept ones are intact and can be claimed.
    let other = bm.allocate(2).unwrap();
    assert_eq!(bm.claim(7), Some(seq.clone()));
    assert_eq!(bm.num_pinned(), 2);
    assert_eq!(bm.claim(7), None, "claimed once");
    bm.unpin(&seq).unwrap();
    bm.release(&other).unwrap();
    assert_eq!(bm.num_free(), 4);

    // Kept again, then the pool runs out: they are reclaimed and the claim is refused.
    let (_, seq) = run_sequence(&mut bm, &p);
    bm.keep(8, &seq).unwrap();
    bm.release(&seq).unwrap();
    let all = bm.allocate(4).unwrap();
    assert_eq!(bm.kept_reclaimed(), 2);
    assert_eq!(bm.claim(8), None);
    assert_eq!(bm.num_keeps(), 0);
    bm.release(&all).unwrap();

    // A forgotten keep puts its uncached block back on the free list at once.
    let (_, seq) = run_sequence(&mut bm, &p);
    bm.keep(9, &seq).unwrap();
    bm.release(&seq).unwrap();
    assert!(bm.forget(9) && !bm.forget(9));
    assert_eq!(
        bm.evictable.len(),
        1,
        "only the cached full block stays in the LRU"
    );
    assert_eq!((bm.num_used(), bm.num_free()), (0, 4));
}
