//! `keel server`: opens the store, the volume and object namespaces, and serves S3, NBD and the
//! admin API until SIGINT/SIGTERM; then stops accepting, drains, and closes the store (which syncs
//! the log before the index closes).
//!
//! With no arguments it is a single-node cluster with its data in `./keel-data`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::Context;
use keel_namespace::volume::{VolumeHandle, VolumeManager};
use keel_nbd::{Export, Exports, NbdError};
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::admin::AppState;
use crate::config::Config;
use crate::jobs::Jobs;

pub const ADMIN_TOKEN_FILE: &str = "admin-token";

#[derive(clap::Args, Debug, Default)]
pub struct ServerArgs {
    /// TOML configuration file (see docs/configuration.md); flags override it.
    #[arg(long)]
    pub config: Option<PathBuf>,
    /// Data directory; give it twice for a local mirror. Default ./keel-data.
    #[arg(long = "data")]
    pub data: Vec<PathBuf>,
    /// S3 listen address (default 127.0.0.1:3900).
    #[arg(long)]
    pub s3: Option<SocketAddr>,
    /// NBD listen address (default 127.0.0.1:10809).
    #[arg(long)]
    pub nbd: Option<SocketAddr>,
    /// Admin API, dashboard and /metrics address (default 127.0.0.1:3903).
    #[arg(long)]
    pub admin: Option<SocketAddr>,
    /// Allow a data directory on tmpfs/ramfs (throwaway data: fsync means nothing there).
    #[arg(long)]
    pub ephemeral: bool,
}

pub fn effective_config(args: &ServerArgs) -> anyhow::Result<Config> {
    let mut config = match &args.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    if !args.data.is_empty() {
        config.data = args.data.clone();
    }
    if let Some(addr) = args.s3 {
        config.s3 = addr;
    }
    if let Some(addr) = args.nbd {
        config.nbd = addr;
    }
    if let Some(addr) = args.admin {
        config.admin = addr;
    }
    config.ephemeral |= args.ephemeral;
    config.validate()?;
    Ok(config)
}

/// Reads the admin token, creating a random one (mode 0600) on first start.
fn admin_token(dir: &Path) -> anyhow::Result<String> {
    use std::io::Write;
    use std::os::unix::fs::OpenOptionsExt;
    let path = dir.join(ADMIN_TOKEN_FILE);
    match std::fs::read_to_string(&path) {
        Ok(token) if !token.trim().is_empty() => return Ok(token.trim().to_string()),
        Ok(_) => {}
        Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
        Err(error) => return Err(error).with_context(|| format!("reading {}", path.display())),
    }
    let mut bytes = [0u8; 24];
    rand::Rng::fill(&mut rand::rngs::OsRng, &mut bytes);
    let token = hex::encode(bytes);
    let mut file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(true)
        .write(true)
        .mode(0o600)
        .open(&path)
        .with_context(|| format!("creating {}", path.display()))?;
    file.write_all(token.as_bytes())?;
    file.sync_all()?;
    Ok(token)
}

async fn bind(role: &str, addr: SocketAddr) -> anyhow::Result<TcpListener> {
    TcpListener::bind(addr)
        .await
        .with_context(|| format!("cannot listen for {role} on {addr} (in use? pass --{role} ADDR)"))
}

pub fn run(args: ServerArgs) -> anyhow::Result<()> {
    let config = effective_config(&args)?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("keel")
        .build()?;
    runtime.block_on(serve(config))
}

async fn serve(config: Config) -> anyhow::Result<()> {
    let started = Instant::now();
    let store_config = config.store_config();
    let store = tokio::task::spawn_blocking(move || keel_store::Store::open(store_config))
        .await?
        .context("opening the store")?;
    let metadata: Arc<dyn keel_catalog::Metadata> = {
        let store = store.clone();
        Arc::new(
            tokio::task::spawn_blocking(move || keel_catalog::LocalCatalog::open(store)).await??,
        )
    };
    let volumes = {
        let store = store.clone();
        let metadata = metadata.clone();
        Arc::new(tokio::task::spawn_blocking(move || VolumeManager::open(store, metadata)).await??)
    };
    let s3 = {
        let store = store.clone();
        let metadata = metadata.clone();
        Arc::new(
            tokio::task::spawn_blocking(move || keel_s3::S3Frontend::open(store, metadata))
                .await??,
        )
    };
    let initial_key = {
        let s3 = s3.clone();
        tokio::task::spawn_blocking(move || {
            s3.ensure_initial_key(
                std::env::var("KEEL_ACCESS_KEY_ID").ok(),
                std::env::var("KEEL_SECRET_ACCESS_KEY").ok(),
            )
        })
        .await??
    };
    let token = admin_token(&config.data[0])?;

    let s3_listener = bind("s3", config.s3).await?;
    let nbd_listener = bind("nbd", config.nbd).await?;
    let admin_listener = bind("admin", config.admin).await?;
    let s3_addr = s3_listener.local_addr()?;
    let nbd_addr = nbd_listener.local_addr()?;
    let admin_addr = admin_listener.local_addr()?;

    // Handlers go in before the banner says "ready": a SIGTERM right after it must shut down
    // cleanly, not take the default action.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;

    let mut shown = config.clone();
    shown.s3 = s3_addr;
    shown.nbd = nbd_addr;
    shown.admin = admin_addr;
    print_banner(&shown, initial_key.as_ref());

    let (stop, stopped) = watch::channel(false);
    let shutdown = |mut receiver: watch::Receiver<bool>| async move {
        let _ = receiver.wait_for(|stop| *stop).await;
    };

    let state = Arc::new(AppState {
        store: store.clone(),
        volumes: volumes.clone(),
        s3: s3.clone(),
        token,
        jobs: Jobs::default(),
        config: shown,
        started,
    });
    let admin = axum::serve(admin_listener, crate::admin::router(state))
        .with_graceful_shutdown(shutdown(stopped.clone()));
    let nbd = keel_nbd::serve(
        nbd_listener,
        Arc::new(VolumeExports {
            volumes: volumes.clone(),
        }),
        shutdown(stopped.clone()),
    );
    let s3_server = keel_s3::serve(s3_listener, (*s3).clone(), shutdown(stopped.clone()));

    let signals = async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
        }
        tracing::info!("shutting down");
        let _ = stop.send(true);
        Ok::<(), std::io::Error>(())
    };
    let (admin_result, nbd_result, s3_result, signal_result) =
        tokio::join!(async { admin.await }, nbd, s3_server, signals);
    admin_result.context("admin API")?;
    nbd_result.context("NBD server")?;
    s3_result.context("S3 server")?;
    signal_result.context("signal handling")?;
    drop(volumes);
    drop(s3);
    tokio::task::spawn_blocking(move || store.flush())
        .await?
        .context("final flush")?;
    eprintln!("keel: stopped cleanly");
    Ok(())
}

fn print_banner(config: &Config, initial_key: Option<&(String, String)>) {
    let describe = |dir: &PathBuf| {
        let fs = keel_store::fsinfo::filesystem_info(dir)
            .map(|i| i.filesystem)
            .unwrap_or_else(|_| "unknown".into());
        let cache = keel_store::fsinfo::write_cache(dir)
            .map(|c| format!(", {} write cache {}", c.device, c.mode))
            .unwrap_or_default();
        format!("{} ({fs}{cache})", dir.display())
    };
    println!("keel {} serving", env!("CARGO_PKG_VERSION"));
    for dir in &config.data {
        println!("  data   {}", describe(dir));
    }
    if config.ephemeral {
        println!("  WARNING: --ephemeral: data may be on a volatile filesystem");
    }
    println!("  s3     http://{}", config.s3);
    println!("  nbd    nbd://{}/VOLUME", config.nbd);
    println!("  admin  http://{}  (dashboard, /metrics)", config.admin);
    match initial_key {
        Some((id, secret)) => {
            println!("  access key created:");
            println!("    AWS_ACCESS_KEY_ID={id}");
            println!("    AWS_SECRET_ACCESS_KEY={secret}");
            println!(
                "    try: AWS_ACCESS_KEY_ID={id} AWS_SECRET_ACCESS_KEY={secret} aws --endpoint-url http://{} s3 mb s3://demo",
                config.s3
            );
        }
        None => {
            match std::env::var("KEEL_ACCESS_KEY_ID") {
                Ok(id) => println!("  access key {id} (from KEEL_ACCESS_KEY_ID)"),
                Err(_) => println!(
                    "  access keys: `keel key list` (secrets are shown once, when created)"
                ),
            }
            println!(
                "    try: aws --endpoint-url http://{} s3 ls   (with AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY set)",
                config.s3
            );
        }
    }
    println!("ready");
}

/// Volumes as NBD exports: `NAME` is the volume, `NAME@SNAPSHOT` a read-only snapshot.
struct VolumeExports {
    volumes: Arc<VolumeManager>,
}

impl Exports for VolumeExports {
    fn list(&self) -> Vec<String> {
        self.volumes.list().into_iter().map(|v| v.name).collect()
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, NbdError> {
        let opened = match name.split_once('@') {
            Some((volume, snapshot)) => self.volumes.open_snapshot(volume, snapshot),
            None => self.volumes.open_volume(name),
        };
        match opened {
            Ok(handle) => Ok(Arc::new(VolumeExport { handle })),
            Err(keel_namespace::volume::VolumeError::NotFound { .. })
            | Err(keel_namespace::volume::VolumeError::SnapshotNotFound { .. }) => {
                Err(NbdError::ExportNotFound {
                    name: name.to_string(),
                })
            }
            Err(other) => Err(NbdError::ExportUnavailable {
                name: name.to_string(),
                reason: other.to_string(),
            }),
        }
    }
}

struct VolumeExport {
    handle: Arc<VolumeHandle>,
}

impl Export for VolumeExport {
    fn size_bytes(&self) -> u64 {
        self.handle.size_bytes()
    }

    fn block_size_bytes(&self) -> u32 {
        self.handle.block_size_bytes()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        Ok(self.handle.read(offset, buf)?)
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        Ok(self.handle.write(offset, data, fua)?)
    }

    fn flush(&self) -> std::io::Result<()> {
        Ok(self.handle.flush()?)
    }

    fn trim(&self, offset: u64, length_bytes: u64) -> std::io::Result<()> {
        Ok(self.handle.trim(offset, length_bytes)?)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
        may_trim: bool,
    ) -> std::io::Result<()> {
        Ok(self
            .handle
            .write_zeroes(offset, length_bytes, fua, may_trim)?)
    }

    fn read_only(&self) -> bool {
        self.handle.read_only()
    }
}
