//! Serves in-memory exports over NBD, to try clients against the protocol and to measure the
//! server's ceiling without storage underneath (nothing is durable; a flush only counts).
//!
//! Usage: `cargo run --release -p keel-nbd --example memserve -- [ADDRESS] [NAME=SIZE_MIB ...]`
//! (default `127.0.0.1:10809 mem=256`), then for example
//! `fio --name=t --ioengine=nbd --uri=nbd://127.0.0.1:10809/mem --rw=randrw --bs=4k --iodepth=64`.
//! Logs go to stderr; set `RUST_LOG=keel_nbd=debug` for per-connection detail.

use std::sync::Arc;

use keel_nbd::testing::MemoryExports;

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "keel_nbd=info".into()),
        )
        .with_writer(std::io::stderr)
        .init();
    let mut arguments = std::env::args().skip(1);
    let address = arguments.next().unwrap_or_else(|| "127.0.0.1:10809".into());
    let exports = MemoryExports::new();
    let mut any = false;
    for spec in arguments {
        let (name, size_mib) = spec
            .split_once('=')
            .ok_or_else(|| format!("expected NAME=SIZE_MIB, got {spec:?}"))?;
        exports.insert(name, size_mib.parse::<u64>()? << 20);
        any = true;
    }
    if !any {
        exports.insert("mem", 256 << 20);
    }
    let listener = tokio::net::TcpListener::bind(&address).await?;
    eprintln!("serving NBD on {}", listener.local_addr()?);
    keel_nbd::serve(listener, Arc::new(exports), async {
        let _ = tokio::signal::ctrl_c().await;
    })
    .await?;
    Ok(())
}
