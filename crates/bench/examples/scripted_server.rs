//! An OpenAI-compatible server with scripted delays (the integration tests' test
//! double), for trying `pdserve bench` without a model:
//!
//! ```sh
//! cargo run -p pdserve-bench --example scripted_server -- --port 8000 --ttft-ms 50 --itl-ms 20
//! pdserve bench serve --url http://127.0.0.1:8000 --concurrency 4 --num-prompts 50
//! ```

#[path = "../tests/support/scripted_server.rs"]
mod scripted_server;

use clap::Parser;
use scripted_server::{Reply, ScriptedServer};

/// Flags of the scripted server.
#[derive(Debug, Parser)]
struct Args {
    /// Port on 127.0.0.1 (0: any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Delay before the first token, ms.
    #[arg(long, default_value_t = 50)]
    ttft_ms: u64,
    /// Delay between tokens, ms.
    #[arg(long, default_value_t = 20)]
    itl_ms: u64,
}

#[tokio::main]
async fn main() -> std::io::Result<()> {
    let args = Args::parse();
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", args.port)).await?;
    let (ttft, itl) = (args.ttft_ms, args.itl_ms);
    let server = ScriptedServer::start_on(listener, move |_| Reply::stream_ms(ttft, itl)).await;
    println!(
        "scripted OpenAI server on {} (TTFT {ttft} ms, ITL {itl} ms); Ctrl-C stops it",
        server.url()
    );
    tokio::signal::ctrl_c().await?;
    server.stop().await;
    Ok(())
}
