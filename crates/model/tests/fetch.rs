//! Model fetching and GGUF validation errors.

use pdserve_model::{
    ensure_default_model, ensure_default_model_with_python, home_dir, inspect, Model, ModelError,
};

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir =
        std::env::temp_dir().join(format!("pdserve-model-test-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn default_model_is_a_valid_llama_gguf() {
    let path = ensure_default_model(&home_dir()).unwrap();
    assert!(path.ends_with("models/SmolLM2-135M-Instruct.Q4_1.gguf"));
    let config = inspect(&path).unwrap();
    assert_eq!(config.architecture, "llama");
    assert_eq!(
        (config.num_layers, config.num_heads, config.num_kv_heads),
        (30, 9, 3)
    );
    assert_eq!(
        (config.head_dim, config.hidden_size, config.vocab_size),
        (64, 576, 49152)
    );
    // A second call finds the file in place.
    assert_eq!(ensure_default_model(&home_dir()).unwrap(), path);
}

#[test]
fn missing_python_is_a_clear_error() {
    let home = scratch_dir("nopython");
    let err = ensure_default_model_with_python(&home, "/nonexistent/python3").unwrap_err();
    assert!(matches!(err, ModelError::PipUnavailable(_)), "{err}");
    assert!(err.to_string().contains("--model"), "{err}");
    let _ = std::fs::remove_dir_all(home);
}

#[test]
fn files_that_are_not_gguf_models_are_rejected() {
    let dir = scratch_dir("badgguf");
    let not_gguf = dir.join("model.gguf");
    std::fs::write(&not_gguf, b"PK\x03\x04 definitely not a gguf file").unwrap();
    let err = Model::load(&not_gguf).err().unwrap();
    assert!(matches!(err, ModelError::InvalidGguf { .. }), "{err}");
    assert!(err.to_string().contains("magic"), "{err}");

    let truncated = dir.join("truncated.gguf");
    std::fs::write(&truncated, b"GGUF\x03\x00\x00\x00\xff\xff\xff\xff").unwrap();
    assert!(matches!(
        inspect(&truncated).unwrap_err(),
        ModelError::InvalidGguf { .. }
    ));

    let missing = dir.join("missing.gguf");
    assert!(matches!(
        inspect(&missing).unwrap_err(),
        ModelError::Io { .. }
    ));
    let _ = std::fs::remove_dir_all(dir);
}
