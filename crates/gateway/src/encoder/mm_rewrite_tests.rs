use serde_json::json;

use super::*;
use crate::encoder::media::extract;

fn request(parts: Value) -> ChatCompletionRequest {
    serde_json::from_value(json!({
        "model": "m",
        "messages": [
            {"role": "system", "content": "be brief"},
            {"role": "user", "content": parts},
        ],
        "max_tokens": 5,
        "ec_transfer_params": {"client": 1},
    }))
    .unwrap()
}

fn report(hash: &str, metadata: Value) -> Option<ItemReport> {
    Some(ItemReport {
        mm_hash: hash.into(),
        ec_mm_hash: format!("ec-{hash}"),
        metadata: metadata.as_object().cloned().unwrap_or_default(),
        transfer_id: Some(format!("t-{hash}")),
    })
}

fn parts_of(request: &ChatCompletionRequest) -> Value {
    serde_json::to_value(&request.messages[1].content).unwrap()
}

#[test]
fn every_kind_becomes_its_embeds_reference() {
    let original = request(json!([
        {"type": "text", "text": "describe"},
        {"type": "image_url", "image_url": {"url": "http://x/i.png"}},
        {"type": "audio_url", "audio_url": {"url": "http://x/a.wav"}},
        {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
        {"type": "video_url", "video_url": {"url": "http://x/v.mp4"}},
    ]));
    let items = extract(&original);
    let reports = [
        report("i", json!({"image_grid_thw": [[1, 4, 6]]})),
        report("a", json!({"audio_feature_lengths": [30]})),
        report("b", json!({"audio_feature_lengths": [[12]]})),
        report(
            "v",
            json!({"video_grid_thw": [[2, 4, 4]], "second_per_grid_ts": 0.5}),
        ),
    ];
    let out = rewrite(&original, &items, &reports).unwrap();
    assert_eq!(
        parts_of(&out),
        json!([
            {"type": "text", "text": "describe"},
            {"type": "image_embeds", "image_embeds": {"image_grid_thw": [1, 4, 6]}, "uuid": "i"},
            {"type": "audio_embeds", "audio_embeds": {"audio_feature_lengths": [30]}, "uuid": "a"},
            {"type": "audio_embeds", "audio_embeds": {"audio_feature_lengths": [12]}, "uuid": "b"},
            {"type": "video_embeds", "video_embeds": {"video_grid_thw": [2, 4, 4],
                                                      "second_per_grid_ts": [0.5]}, "uuid": "v"},
        ])
    );
    // The client's own ec_transfer_params survive, the transfer handles are added.
    assert_eq!(
        out.extra[EC_TRANSFER_PARAMS],
        json!({"client": 1, "ec_items": [
            {"mm_hash": "ec-i", "transfer_id": "t-i"}, {"mm_hash": "ec-a", "transfer_id": "t-a"},
            {"mm_hash": "ec-b", "transfer_id": "t-b"}, {"mm_hash": "ec-v", "transfer_id": "t-v"},
        ]})
    );
    assert_eq!(out.messages[0], original.messages[0]);
    assert_eq!(out.generation.max_tokens, Some(5));
}

#[test]
fn unreported_items_stay_raw_and_nothing_reported_changes_nothing() {
    let original = request(json!([
        {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
        {"type": "image_url", "image_url": {"url": "http://x/2.png"}},
    ]));
    let items = extract(&original);
    assert!(rewrite(&original, &items, &[None, None]).is_none());
    assert!(rewrite(&original, &items, &[report("1", json!({})), None]).is_none());
    let out = rewrite(
        &original,
        &items,
        &[None, report("2", json!({"image_grid_thw": [[1, 2, 2]]}))],
    )
    .unwrap();
    let parts = parts_of(&out);
    assert_eq!(parts[0], original_part(&original, 0));
    assert_eq!(parts[1]["type"], "image_embeds");
    assert_eq!(
        out.extra[EC_TRANSFER_PARAMS]["ec_items"],
        json!([{"mm_hash": "ec-2", "transfer_id": "t-2"}])
    );
}

fn original_part(request: &ChatCompletionRequest, i: usize) -> Value {
    parts_of(request)[i].clone()
}

#[test]
fn audio_with_an_unreported_item_keeps_the_whole_request_raw_with_uuids() {
    let original = request(json!([
        {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
        {"type": "input_audio", "input_audio": {"data": "AAA", "format": "wav"}},
    ]));
    let items = extract(&original);
    let reports = [report("img", json!({"image_grid_thw": [[1, 2, 2]]})), None];
    let out = rewrite(&original, &items, &reports).unwrap();
    let parts = parts_of(&out);
    assert_eq!(parts[0]["type"], "image_url");
    assert_eq!(parts[0]["uuid"], "img");
    assert_eq!(parts[1]["type"], "input_audio");
    assert_eq!(parts[1]["uuid"], content_uuid(&original_part(&original, 1)));
    assert_eq!(
        out.extra[EC_TRANSFER_PARAMS]["ec_items"],
        json!([{"mm_hash": "ec-img", "transfer_id": "t-img"}])
    );
}

fn keys(n: usize) -> ItemKeys {
    ItemKeys {
        uuids: (0..n).map(|i| Some(format!("u{i}"))).collect(),
        transfer_ids: vec![None; n],
    }
}

fn answer(v: Value) -> Map<String, Value> {
    v.as_object().cloned().unwrap()
}

#[test]
fn answers_match_by_position_then_uuid_then_sole_entry() {
    let original = request(json!([
        {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
        {"type": "image_url", "image_url": {"url": "http://x/2.png"}},
        {"type": "image_url", "image_url": {"url": "http://x/3.png"}},
    ]));
    let items = extract(&original);
    let keys = keys(3);
    let ctx = MatchContext {
        items: &items,
        keys: &keys,
        use_audio_in_video: false,
        push: false,
    };
    let mut reports = vec![None; 3];
    let mut handles = Map::new();
    // Items 0 and 2 were one batch: position 1 of it is item 2.
    let batch = answer(json!({
        "h-b": {"metadata": {"image_grid_thw": [[1, 2, 2]]}, "item_indices": [1], "peer_port": 9},
        "u0": {"metadata": {"image_grid_thw": [[1, 4, 4]]}},
    }));
    match_answer(&batch, &[0, 2], &ctx, &mut reports, &mut handles).unwrap();
    assert_eq!(reports[0].as_ref().unwrap().ec_mm_hash, "u0");
    let second = reports[2].as_ref().unwrap();
    assert_eq!(
        (second.mm_hash.as_str(), second.ec_mm_hash.as_str()),
        ("u2", "h-b")
    );
    assert_eq!(handles["h-b"]["peer_port"], 9);
    // A single item takes the only entry, whatever its key.
    let single = answer(json!({"whatever": {"metadata": {"image_grid_thw": [[1, 2, 2]]}}}));
    match_answer(&single, &[1], &ctx, &mut reports, &mut handles).unwrap();
    assert_eq!(reports[1].as_ref().unwrap().mm_hash, "u1");
    assert_eq!(handles.len(), 3);
    // Nothing reported: nothing matched, no error.
    let mut fresh = vec![None; 3];
    match_answer(&Map::new(), &[0, 1], &ctx, &mut fresh, &mut handles).unwrap();
    assert!(fresh.iter().all(Option::is_none));
}

#[test]
fn bad_duplicate_and_unmatched_indices_are_errors() {
    let original = request(json!([
        {"type": "image_url", "image_url": {"url": "http://x/1.png"}},
        {"type": "image_url", "image_url": {"url": "http://x/2.png"}},
    ]));
    let items = extract(&original);
    let keys = keys(2);
    let ctx = MatchContext {
        items: &items,
        keys: &keys,
        use_audio_in_video: false,
        push: false,
    };
    let run = |v: Value| {
        let mut reports = vec![None; 2];
        match_answer(&answer(v), &[0, 1], &ctx, &mut reports, &mut Map::new())
    };
    for (bad, why) in [
        (json!({"a": {"item_indices": [2]}}), "invalid"),
        (json!({"a": {"item_indices": [-1]}}), "invalid"),
        (json!({"a": {"item_indices": [true]}}), "invalid"),
        (json!({"a": {"item_indices": "0"}}), "invalid"),
        (
            json!({"a": {"item_indices": [0]}, "b": {"item_indices": [0, 1]}}),
            "duplicate",
        ),
        (json!({"a": {"item_indices": [0]}}), "cannot be matched"),
        (
            json!({"a": {"metadata": {}}, "b": {"metadata": {}}}),
            "cannot be matched",
        ),
    ] {
        let err = run(bad.clone()).unwrap_err();
        assert!(err.contains(why), "{bad}: {err}");
    }
    assert!(run(json!({"a": {"item_indices": [0, 1], "metadata": {}}})).is_ok());
}

#[test]
fn a_video_with_its_audio_track_stays_raw_without_push_handles() {
    let original = request(json!([{"type": "video_url", "video_url": {"url": "http://x/v.mp4"}}]));
    let items = extract(&original);
    let keys = ItemKeys {
        uuids: vec![Some("v".into())],
        transfer_ids: vec![None],
    };
    let two = answer(json!({
        "x": {"metadata": {"video_grid_thw": [[1, 2, 2]]}},
        "y": {"metadata": {"audio_feature_lengths": [3]}},
    }));
    let mut ctx = MatchContext {
        items: &items,
        keys: &keys,
        use_audio_in_video: true,
        push: false,
    };
    let mut reports = vec![None];
    match_answer(&two, &[0], &ctx, &mut reports, &mut Map::new()).unwrap();
    assert!(reports[0].is_none());
    ctx.push = true;
    assert!(match_answer(&two, &[0], &ctx, &mut reports, &mut Map::new()).is_err());
}
