//! Helpers shared by the integration tests.

#![allow(dead_code)]

pub mod scripted_server;

use std::path::PathBuf;
use std::time::Duration;

use clap::Parser;
use pdserve_bench::{BenchArgs, BenchCommand, MultiTurnArgs, ServeArgs};

/// Upper bound on any single test's benchmark run.
pub const TEST_LIMIT: Duration = Duration::from_secs(30);

#[derive(Debug, Parser)]
struct Cli {
    #[command(flatten)]
    bench: BenchArgs,
}

/// Parses `pdserve bench <args>`.
pub fn parse(args: &[&str]) -> Result<BenchCommand, clap::Error> {
    Cli::try_parse_from(std::iter::once("bench").chain(args.iter().copied()))
        .map(|c| c.bench.command)
}

/// `pdserve bench serve <args>`, which must parse.
pub fn serve_args(args: &[&str]) -> ServeArgs {
    let mut all = vec!["serve"];
    all.extend_from_slice(args);
    match parse(&all).expect("valid serve flags") {
        BenchCommand::Serve(a) => a,
        other => panic!("not serve: {other:?}"),
    }
}

/// `pdserve bench multi-turn <args>`, which must parse.
pub fn multi_turn_args(args: &[&str]) -> MultiTurnArgs {
    let mut all = vec!["multi-turn"];
    all.extend_from_slice(args);
    match parse(&all).expect("valid multi-turn flags") {
        BenchCommand::MultiTurn(a) => a,
        other => panic!("not multi-turn: {other:?}"),
    }
}

/// A fresh path under Cargo's per-test scratch directory.
pub fn scratch(name: &str) -> PathBuf {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("pdserve-bench-tests");
    std::fs::create_dir_all(&dir).expect("scratch dir");
    let path = dir.join(format!("{}-{name}", std::process::id()));
    let _ = std::fs::remove_file(&path);
    path
}

/// A shutdown signal that never fires.
pub async fn never() {
    std::future::pending::<()>().await
}
