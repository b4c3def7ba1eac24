//! Imported KV: a prefill's pinned blocks read by another engine, an import that meets
//! this engine's own prefix cache, and a decode that starts from the prefill's first token.

use super::*;

#[test]
fn pinned_blocks_can_be_read_and_imported_by_another_engine() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (prefill, prefill_thread, prefill_metrics) = start(FakeModel::new(16), config());
    let p = prompt(45, 11);
    // "Prefill": one token, blocks kept for a peer.
    let mut req = request(p.clone(), 1);
    req.pin_on_finish = true;
    let (ids, end) = collect(&mut prefill.submit(req).unwrap());
    assert_eq!(ids, reference(&p, 1));
    let SeqEvent::Finished {
        pinned: Some(pinned),
        ..
    } = end
    else {
        panic!("{end:?}")
    };
    assert_eq!(pinned.num_tokens, 45, "every prompt token has KV");
    assert_eq!(pinned.blocks.len(), 3);
    wait_for_blocks_used(&prefill_metrics, 3);
    assert_eq!(prefill_metrics.kv_blocks_pinned.get(), 3);
    let bytes = rt
        .block_on(prefill.read_blocks(pinned.blocks.clone()))
        .unwrap();
    assert_eq!(
        rt.block_on(prefill.read_blocks(vec![15])),
        Err(KvError::NotPinned(15))
    );

    // "Decode": a fresh engine loads all but the last prompt token and continues.
    let (decode, decode_thread, _) = start(FakeModel::new(16), config());
    let mut req = request(p.clone(), 6);
    req.kv_import = Some(KvImport {
        num_tokens: 44,
        blocks: bytes.clone(),
        reused: Default::default(),
        landed_at: None,
    });
    let (ids, end) = collect(&mut decode.submit(req).unwrap());
    assert_eq!(ids, reference(&p, 6), "imported KV continues identically");
    let SeqEvent::Finished { usage, .. } = end else {
        panic!("{end:?}")
    };
    assert_eq!((usage.cached_tokens, usage.kv_imported_tokens), (0, 44));

    // What the KV's source had not computed either stays cached for this request.
    let mut req = request(p.clone(), 2);
    req.kv_import = Some(KvImport {
        num_tokens: 44,
        blocks: bytes,
        reused: pdserve_kv_transfer::ReusedTokens {
            prefix_cache_tokens: 16,
            earlier_turn_tokens: 40,
        },
        landed_at: None,
    });
    let SeqEvent::Finished { usage, .. } = collect(&mut decode.submit(req).unwrap()).1 else {
        panic!("the import failed")
    };
    assert_eq!(
        (
            usage.cached_tokens,
            usage.earlier_turn_tokens,
            usage.kv_imported_tokens
        ),
        (44, 28, 44),
        "reused counts are cut to the imported tokens"
    );

    // A malformed import fails the request, not the engine.
    let mut bad = request(p.clone(), 2);
    bad.kv_import = Some(KvImport {
        num_tokens: 44,
        blocks: vec![vec![1, 2, 3]],
        reused: Default::default(),
        landed_at: None,
    });
    assert!(matches!(
        collect(&mut decode.submit(bad).unwrap()).1,
        SeqEvent::Failed(_)
    ));

    rt.block_on(prefill.unpin(pinned.blocks.clone())).unwrap();
    assert_eq!(prefill_metrics.kv_blocks_pinned.get(), 0);
    assert_eq!(prefill_metrics.kv_blocks_used.get(), 0);
    assert!(
        rt.block_on(prefill.unpin(pinned.blocks)).is_err(),
        "double unpin is refused"
    );
    stop(prefill, prefill_thread);
    stop(decode, decode_thread);
}

/// An import of a prompt whose prefix this engine already caches takes new blocks only
/// for the rest: the cached blocks serve (the import's copies of them are never
/// written), the prefix cache counts them, and the output is unchanged.
#[test]
fn an_import_writes_only_what_the_prefix_cache_lacks() {
    let (decode, thread, metrics) = start(FakeModel::new(16), config());
    let p = prompt(45, 11);
    // A prompt sharing p's first two blocks, computed here.
    let sibling = [&p[..32], &prompt(8, 99)[..]].concat();
    assert_eq!(
        collect(&mut decode.submit(request(sibling.clone(), 1)).unwrap()).0,
        reference(&sibling, 1)
    );
    assert_eq!(metrics.prefix_cache_hits.get(), 0);
    // The fake model's block bytes: each slot's token, u32::MAX where empty.
    let block = |tokens: &[u32]| -> Vec<u8> {
        (0..BLOCK_SIZE)
            .flat_map(|i| tokens.get(i).copied().unwrap_or(u32::MAX).to_le_bytes())
            .collect()
    };
    // p's first two blocks as another prompt's KV: wrong output if they were written.
    let wrong = prompt(16, 77);
    let mut req = request(p.clone(), 6);
    req.kv_import = Some(KvImport {
        num_tokens: 44,
        blocks: vec![block(&wrong), block(&wrong), block(&p[32..44])],
        reused: Default::default(),
        landed_at: None,
    });
    let (ids, end) = collect(&mut decode.submit(req).unwrap());
    assert_eq!(ids, reference(&p, 6), "the cached prefix served");
    let SeqEvent::Finished { usage, .. } = end else {
        panic!("{end:?}")
    };
    assert_eq!((usage.cached_tokens, usage.kv_imported_tokens), (0, 44));
    assert_eq!(metrics.prefix_cache_hits.get(), 32);
    // Nothing cached: every imported block is written (and the wrong ones show).
    let other = prompt(45, 5);
    let mut req = request(other.clone(), 6);
    req.kv_import = Some(KvImport {
        num_tokens: 44,
        blocks: vec![block(&wrong), block(&other[16..32]), block(&other[32..44])],
        reused: Default::default(),
        landed_at: None,
    });
    assert_ne!(
        collect(&mut decode.submit(req).unwrap()).0,
        reference(&other, 6)
    );
    wait_for_blocks_used(&metrics, 0);
    stop(decode, thread);
}

/// A decode that starts from the prefill's own first token imports the whole prompt's
/// KV, reports that token at once, and continues exactly as the aggregated run; a given
/// token that leaves nothing to run is refused.
#[test]
fn a_decode_from_the_prefills_first_token_continues_identically() {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    let (prefill, prefill_thread, _) = start(FakeModel::new(16), config());
    let p = prompt(45, 12);
    let mut req = request(p.clone(), 1);
    req.pin_on_finish = true;
    let (first, end) = collect(&mut prefill.submit(req).unwrap());
    let SeqEvent::Finished {
        pinned: Some(pinned),
        ..
    } = end
    else {
        panic!("{end:?}")
    };
    let bytes = rt
        .block_on(prefill.read_blocks(pinned.blocks.clone()))
        .unwrap();
    let import = |num_tokens| KvImport {
        num_tokens,
        blocks: bytes.clone(),
        reused: Default::default(),
        landed_at: None,
    };

    let (decode, decode_thread, decode_metrics) = start(FakeModel::new(16), config());
    let mut req = request(p.clone(), 6);
    req.first_token = Some(first[0]);
    req.kv_import = Some(import(45));
    let mut rx = decode.submit(req).unwrap();
    assert_eq!(
        rx.try_recv(),
        Ok(SeqEvent::Token {
            id: first[0],
            logprobs: None
        }),
        "the given token is reported as the request is submitted"
    );
    let (rest, end) = collect(&mut rx);
    let mut ids = vec![first[0]];
    ids.extend(rest);
    assert_eq!(ids, reference(&p, 6), "token for token the aggregated run");
    let SeqEvent::Finished { usage, .. } = end else {
        panic!("{end:?}")
    };
    assert_eq!(
        (
            usage.prompt_tokens,
            usage.completion_tokens,
            usage.kv_imported_tokens
        ),
        (45, 6, 45)
    );
    // Five tokens were sampled here: the first came with the request.
    assert_eq!(decode_metrics.generation_tokens.get(), 5);

    // Without a given token the last prompt position must be left to compute.
    let mut whole = request(p.clone(), 6);
    whole.kv_import = Some(import(45));
    assert!(matches!(
        collect(&mut decode.submit(whole).unwrap()).1,
        SeqEvent::Failed(_)
    ));
    // A given token that would already end the request is refused.
    let mut ends = request(p.clone(), 1);
    ends.first_token = Some(first[0]);
    assert!(matches!(
        collect(&mut decode.submit(ends).unwrap()).1,
        SeqEvent::Failed(_)
    ));

    rt.block_on(prefill.unpin(pinned.blocks)).unwrap();
    stop(prefill, prefill_thread);
    stop(decode, decode_thread);
}
