//! Tokenizer, incremental detokenizer and chat template of the default model, checked
//! against ids from the model's own tokenizer configuration (SmolLM2: digits split
//! individually, GPT-2 byte-level split without prefix space, ChatML control tokens).

use pdserve_model::{
    ensure_default_model, home_dir, ChatTemplate, ChatTurn, IncrementalDecoder, Tokenizer,
};

fn tokenizer() -> (Tokenizer, ChatTemplate) {
    let path = ensure_default_model(&home_dir()).expect("default model");
    let tokenizer = Tokenizer::load(&path).expect("tokenizer");
    let template = ChatTemplate::load(&path, &tokenizer).expect("template");
    (tokenizer, template)
}

/// Reference ids produced by Hugging Face `tokenizers` with SmolLM2's published
/// pre-tokenizer over this GGUF's vocabulary and merges.
const REFERENCE: &[(&str, &[u32])] = &[
    ("Hello, world!", &[19556, 28, 905, 17]),
    (
        "The year 2024 had 366 days.",
        &[
            504, 713, 216, 34, 32, 34, 36, 761, 216, 35, 38, 38, 2009, 30,
        ],
    ),
    (
        "naïve café — 東京 🚀",
        &[
            3546, 46494, 37366, 1841, 17097, 247, 126, 16736, 122, 15107, 244, 218,
        ],
    ),
    (
        "  leading spaces\tand\nnewlines",
        &[216, 2899, 5600, 197, 397, 198, 2241, 5110],
    ),
    (
        "<|im_start|>user\nHi<|im_end|>\n",
        &[1, 4093, 198, 26843, 2, 198],
    ),
    (
        "What is the capital of France?",
        &[1780, 314, 260, 3575, 282, 4649, 47],
    ),
];

#[test]
fn ids_match_the_reference_tokenizer() {
    let (tok, _) = tokenizer();
    for (text, ids) in REFERENCE {
        assert_eq!(&tok.encode(text, false).unwrap(), ids, "{text:?}");
        // SmolLM2 does not add BOS.
        assert_eq!(&tok.encode(text, true).unwrap(), ids, "{text:?}");
        assert_eq!(&tok.decode(ids, false).unwrap(), text);
    }
}

#[test]
fn special_tokens_and_eos() {
    let (tok, _) = tokenizer();
    assert_eq!(tok.bos_token_id(), Some(1));
    assert_eq!(tok.bos_token(), "<|im_start|>");
    assert_eq!(tok.eos_token(), "<|im_end|>");
    assert!(tok.eos_token_ids().contains(&2));
    assert_eq!(tok.token_to_id("<|im_end|>"), Some(2));
    let ids = tok
        .encode("<|im_start|>assistant\nOK<|im_end|>", false)
        .unwrap();
    assert_eq!(tok.decode(&ids, true).unwrap(), "assistant\nOK");
    assert_eq!(tok.vocab_size(), 49152);
}

#[test]
fn unicode_round_trips() {
    let (tok, _) = tokenizer();
    for text in [
        "Grüße aus Zürich, ½ cup of crème brûlée",
        "日本語のテキストと中文混合 — and Ελληνικά, русский, العربية, עברית",
        "emoji 👩‍👩‍👧‍👦 🇫🇷 🚀🔥 and math ∑∫√∞ ≠ ≤",
        "tabs\tand\r\nCRLF   spaces 0123456789 3.14159",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids, false).unwrap(), text);
    }
}

#[test]
fn incremental_decoder_emits_whole_characters() {
    let (tok, _) = tokenizer();
    let text = "naïve café — 東京 🚀 and 👩‍👩‍👧 done";
    let ids = tok.encode(text, false).unwrap();
    let mut decoder = IncrementalDecoder::new(false);
    let mut pieces = Vec::new();
    for &id in &ids {
        if let Some(piece) = decoder.step(&tok, id).unwrap() {
            assert!(
                !piece.contains('\u{FFFD}'),
                "partial character in {piece:?}"
            );
            pieces.push(piece);
        }
    }
    pieces.extend(decoder.flush(&tok).unwrap());
    assert_eq!(pieces.concat(), text);
    // Multi-byte characters span several byte-level tokens, so some steps emit nothing.
    assert!(pieces.len() < ids.len());
}

#[test]
fn chatml_template_renders_like_transformers() {
    let (_, template) = tokenizer();
    let turn = |role: &str, content: &str| ChatTurn {
        role: role.into(),
        content: content.into(),
    };
    let rendered = template
        .render(
            &[
                turn("user", "Hi there"),
                turn("assistant", "Hello!"),
                turn("user", "What is 2+2?"),
            ],
            true,
        )
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n\
         <|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nHello!<|im_end|>\n\
         <|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"
    );
    let rendered = template
        .render(&[turn("system", "Be brief."), turn("user", "Hi")], false)
        .unwrap();
    assert_eq!(
        rendered,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
    );
}

#[test]
fn raise_exception_becomes_a_template_error() {
    let template = ChatTemplate::new(
        "{% if messages[0]['role'] != 'user' %}{{ raise_exception('first message must be from the user') }}{% endif %}{{ bos_token }}",
        "<s>",
        "</s>",
    )
    .unwrap();
    let err = template
        .render(
            &[ChatTurn {
                role: "assistant".into(),
                content: "x".into(),
            }],
            false,
        )
        .unwrap_err();
    assert!(
        err.to_string()
            .contains("first message must be from the user"),
        "{err}"
    );
    let ok = template
        .render(
            &[ChatTurn {
                role: "user".into(),
                content: "x".into(),
            }],
            false,
        )
        .unwrap();
    assert_eq!(ok, "<s>");
}

/// The GGUF's tokenizer written as a Hugging Face folder (`tokenizer.json`,
/// `tokenizer_config.json`) reads back as the same tokenizer and template.
#[test]
fn a_hugging_face_folder_of_the_same_tokenizer_encodes_alike() {
    let (tok, template) = tokenizer();
    let dir = std::env::temp_dir().join(format!("pdserve-text-hf-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tok.to_hf_json().unwrap()).unwrap();
    let config = serde_json::json!({
        "bos_token": tok.bos_token(),
        "eos_token": {"content": tok.eos_token(), "special": true},
        "chat_template": template.source(),
    });
    std::fs::write(dir.join("tokenizer_config.json"), config.to_string()).unwrap();
    assert!(pdserve_model::is_hf_tokenizer(&dir));
    let hf = Tokenizer::from_hf_folder(&dir).unwrap();
    let hf_template = ChatTemplate::from_hf_folder(&dir, &hf).unwrap();
    std::fs::remove_dir_all(&dir).unwrap();

    for (text, ids) in REFERENCE {
        assert_eq!(hf.encode(text, true).unwrap(), *ids, "{text:?}");
        assert_eq!(
            hf.encode(text, true).unwrap(),
            tok.encode(text, true).unwrap()
        );
    }
    assert_eq!(hf.eos_token_ids(), tok.eos_token_ids());
    assert_eq!(hf.bos_token_id(), tok.bos_token_id());
    let turns = [ChatTurn {
        role: "user".into(),
        content: "What is 2+2?".into(),
    }];
    assert_eq!(
        hf_template.render(&turns, true).unwrap(),
        template.render(&turns, true).unwrap()
    );
}

/// With pieces cached, the default model encodes every reference text and rendered chat
/// to the same ids as without, the first time and again.
#[test]
fn cached_pieces_encode_to_the_same_ids() {
    let (plain, template) = tokenizer();
    let (mut cached, _) = tokenizer();
    assert!(cached.cache_pieces(1 << 20));
    let turn = |role: &str, content: &str| ChatTurn {
        role: role.into(),
        content: content.into(),
    };
    let mut texts: Vec<String> = REFERENCE.iter().map(|(t, _)| t.to_string()).collect();
    let mut turns = vec![turn("system", "You answer in one line. 2024-12-04")];
    for (question, answer) in [
        ("Hi there", "Hello! 👋"),
        ("What is 2+2?", "4"),
        ("  spaces\tand\nnewlines ", "<|im_end|> inside text"),
        ("naïve café — 東京 🚀", ""),
    ] {
        turns.push(turn("user", question));
        texts.push(template.render(&turns, true).unwrap());
        turns.push(turn("assistant", answer));
    }
    texts.push("<|im_start|><|im_start|>x<|im_end|><|im_end".into());
    for round in ["first", "again"] {
        for text in &texts {
            for special in [false, true] {
                assert_eq!(
                    cached.encode(text, special).unwrap(),
                    plain.encode(text, special).unwrap(),
                    "{round} {text:?}"
                );
            }
        }
    }
}
