//! `keel server`: opens the store, the volume and object namespaces, and serves S3, NBD and the
//! admin API until SIGINT/SIGTERM; then stops accepting, drains, and closes the store (which syncs
//! the log before the index closes).
//!
//! With no arguments it is a single-node cluster with its data in `./keel-data`.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use crate::metrics::timed;

use anyhow::Context;
use keel_namespace::volume::{VolumeIo, VolumeManager};
use keel_nbd::{Export, Exports, NbdError};
use tokio::net::{TcpListener, TcpSocket};
use tokio::sync::watch;

use crate::admin::AppState;
use crate::config::Config;
use crate::jobs::{JobProgress, Jobs};
use crate::scrub_schedule::{Pacer, ScrubRun, ScrubSchedule};

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
    /// A file holding the admin token (default: <data>/admin-token, created on first start).
    #[arg(long)]
    pub admin_token_file: Option<PathBuf>,
    /// Allow a data directory on tmpfs/ramfs (throwaway data: fsync means nothing there).
    #[arg(long)]
    pub ephemeral: bool,
    /// This node's name in the cluster (default: the host name).
    #[arg(long)]
    pub name: Option<String>,
    /// Node-to-node listen address (default 127.0.0.1:3902).
    #[arg(long)]
    pub cluster: Option<SocketAddr>,
    /// Node-to-node address other nodes dial (default: --cluster).
    #[arg(long)]
    pub advertise: Option<String>,
    /// Join the cluster that the node at this node-to-node address belongs to (first start only).
    #[arg(long)]
    pub join: Option<String>,
    /// The cluster's join token (`keel cluster token` on a member shows it).
    #[arg(long, env = "KEEL_CLUSTER_TOKEN", hide_env_values = true)]
    pub join_token: Option<String>,
    /// A file holding the join token (a member's `<data>/cluster-token`).
    #[arg(long, conflicts_with = "join_token")]
    pub join_token_file: Option<PathBuf>,
    /// Run as a metadata-only witness: the Raft log only, no volumes, objects, S3 or NBD.
    #[arg(long)]
    pub witness: bool,
    /// A failure-domain label, KEY=VALUE (host, rack, zone); repeat for several.
    #[arg(long = "label")]
    pub labels: Vec<String>,
    /// Metadata voters to keep: 1, 3 or 5 (default 3).
    #[arg(long)]
    pub voters: Option<usize>,
    /// Enable the fault-injection endpoint (tests only).
    #[arg(long, hide = true)]
    pub debug_faults: bool,
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
    if args.name.is_some() {
        config.cluster.name = args.name.clone();
    }
    if let Some(addr) = args.cluster {
        config.cluster.listen = addr;
    }
    if args.advertise.is_some() {
        config.cluster.advertise = args.advertise.clone();
    }
    if args.admin_token_file.is_some() {
        config.admin_token_file = args.admin_token_file.clone();
    }
    if args.join.is_some() {
        config.cluster.join = args.join.clone();
    }
    if args.join_token.is_some() {
        config.cluster.join_token = args.join_token.clone();
    }
    if let Some(path) = &args.join_token_file {
        let token = std::fs::read_to_string(path)
            .with_context(|| format!("reading the join token from {}", path.display()))?;
        config.cluster.join_token = Some(token.trim().to_string());
    }
    config.cluster.witness |= args.witness;
    if config.cluster.witness && args.data.is_empty() && args.config.is_none() {
        config.data = vec![PathBuf::from(crate::config::DEFAULT_WITNESS_DATA_DIR)];
    }
    for label in &args.labels {
        let (key, value) = label
            .split_once('=')
            .with_context(|| format!("--label {label:?}: use KEY=VALUE"))?;
        config
            .cluster
            .labels
            .insert(key.trim().to_string(), value.trim().to_string());
    }
    if let Some(voters) = args.voters {
        config.cluster.voters = voters;
    }
    config.cluster.debug_faults |= args.debug_faults;
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

fn bind_failed(role: &str, addr: SocketAddr) -> String {
    format!("cannot listen for {role} on {addr} (in use? pass --{role} ADDR)")
}

/// A port bound, not yet listened on: the client ports are bound before the node joins a
/// cluster (a port in use then stops the node before it becomes a member under addresses it
/// cannot serve) and listened on only once everything behind them is open.
struct Reserved {
    role: &'static str,
    addr: SocketAddr,
    socket: TcpSocket,
}

fn reserve(role: &'static str, addr: SocketAddr) -> anyhow::Result<Reserved> {
    let socket = if addr.is_ipv4() {
        TcpSocket::new_v4()
    } else {
        TcpSocket::new_v6()
    }
    .with_context(|| bind_failed(role, addr))?;
    // As a listener bound at once would: a restart binds past connections in TIME_WAIT.
    socket
        .set_reuseaddr(true)
        .with_context(|| bind_failed(role, addr))?;
    socket.bind(addr).with_context(|| bind_failed(role, addr))?;
    Ok(Reserved { role, addr, socket })
}

impl Reserved {
    fn listen(self) -> anyhow::Result<TcpListener> {
        let (role, addr) = (self.role, self.addr);
        self.socket
            .listen(LISTEN_BACKLOG)
            .with_context(|| bind_failed(role, addr))
    }
}

/// Connections a client listener queues before they are accepted (tokio's own default).
const LISTEN_BACKLOG: u32 = 1024;

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

    // The node-to-node listener first: the cluster starts on it. The client ports are bound
    // now too, before this node joins anything, so a port in use stops it before it becomes
    // a member; they listen only once everything behind them is open (a test treats an
    // accepting port as ready), and the cluster records their actual addresses then.
    let cluster_listener = reserve("cluster", config.cluster.listen)?.listen()?;
    let mut shown = config.clone();
    shown.cluster.listen = cluster_listener.local_addr()?;
    let admin_port = reserve("admin", config.admin)?;
    let client_ports = if config.cluster.witness {
        None
    } else {
        Some((reserve("s3", config.s3)?, reserve("nbd", config.nbd)?))
    };

    // The cluster next: every metadata change below goes through it.
    let membership = crate::cluster_net::start_cluster(&shown, store.clone(), cluster_listener)
        .await
        .context("starting the cluster")?;
    let cluster = membership.cluster.clone();
    let metadata: Arc<dyn keel_catalog::Metadata> = cluster.clone();
    {
        let store = store.clone();
        let data = config.data.clone();
        cluster.set_reporter(Box::new(move || node_report(&store, &data)));
    }

    let volumes = {
        let store = store.clone();
        let metadata = metadata.clone();
        Arc::new(tokio::task::spawn_blocking(move || VolumeManager::open(store, metadata)).await??)
    };
    let ops = if config.track_ops {
        keel_ops::Ops::new(
            Arc::new(keel_clock::SystemClock),
            std::time::Duration::from_secs_f64(config.slow_op_ms / 1000.0),
        )
    } else {
        keel_ops::Ops::disabled()
    };
    let replication = keel_replication::Replication::new(
        cluster.clone(),
        membership.transport.clone(),
        Arc::new(LocalVolumes {
            volumes: volumes.clone(),
        }),
        tokio::runtime::Handle::current(),
        keel_replication::Settings {
            move_after: std::time::Duration::from_millis(config.cluster.replica_move_after_ms),
            resync_bytes_per_second: (config.cluster.resync_mib_per_second > 0)
                .then_some(config.cluster.resync_mib_per_second << 20),
            resync_busy_percent: config.cluster.resync_busy_percent,
            snapshot_repair: config.cluster.snapshot_repair,
            rebuilds_max: config.cluster.rebuilds_max,
            point_every: keel_replication::POINT_EVERY,
        },
        ops.clone(),
    );
    membership.dispatch.set_above(replication.clone());
    let s3 = {
        let store = store.clone();
        let metadata = metadata.clone();
        let ops = ops.clone();
        Arc::new(
            tokio::task::spawn_blocking(move || {
                keel_s3::S3Frontend::open(store, metadata).map(|s3| s3.with_ops(ops))
            })
            .await??,
        )
    };
    // Keys are cluster-wide: only the node that formed the cluster makes the first one (or
    // any node told which one to have).
    let initial_key = if config.cluster.witness {
        None
    } else {
        let s3 = s3.clone();
        let formed = membership.formed;
        tokio::task::spawn_blocking(move || {
            let id = std::env::var("KEEL_ACCESS_KEY_ID").ok();
            let secret = std::env::var("KEEL_SECRET_ACCESS_KEY").ok();
            if formed || (id.is_some() && secret.is_some()) {
                s3.ensure_initial_key(id, secret)
            } else {
                Ok(None)
            }
        })
        .await??
    };
    let token = match &config.admin_token_file {
        Some(path) => {
            let token = std::fs::read_to_string(path)
                .with_context(|| format!("reading the admin token from {}", path.display()))?;
            let token = token.trim().to_string();
            if token.is_empty() {
                anyhow::bail!("the admin token file {} is empty", path.display());
            }
            token
        }
        None => admin_token(&config.data[0])?,
    };

    let admin_listener = admin_port.listen()?;
    let (s3_listener, nbd_listener) = match client_ports {
        None => (None, None),
        Some((s3, nbd)) => (Some(s3.listen()?), Some(nbd.listen()?)),
    };
    if let Some(listener) = &s3_listener {
        shown.s3 = listener.local_addr()?;
    }
    if let Some(listener) = &nbd_listener {
        shown.nbd = listener.local_addr()?;
    }
    shown.admin = admin_listener.local_addr()?;
    cluster.set_client_addresses(
        Some(shown.admin.to_string()),
        s3_listener.as_ref().map(|_| shown.s3.to_string()),
        nbd_listener.as_ref().map(|_| shown.nbd.to_string()),
    );

    // Handlers go in before the banner says "ready": a SIGTERM right after it must shut down
    // cleanly, not take the default action.
    let mut interrupt = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::interrupt())?;
    let mut terminate = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())?;

    print_banner(&shown, initial_key.as_ref(), &membership);

    let (stop, stopped) = watch::channel(false);
    let shutdown = |mut receiver: watch::Receiver<bool>| async move {
        let _ = receiver.wait_for(|stop| *stop).await;
    };

    let scrub = {
        let dir = config.data[0].clone();
        let interval = std::time::Duration::from_secs(config.scrub.interval_seconds);
        let busy_percent = config.scrub.busy_percent;
        Arc::new(
            tokio::task::spawn_blocking(move || {
                ScrubSchedule::open(
                    &dir,
                    interval,
                    busy_percent,
                    Arc::new(keel_clock::SystemClock),
                )
            })
            .await??,
        )
    };
    let jobs = Jobs::default();
    let scheduled_scrubs = tokio::spawn(scrub.clone().run(
        jobs.clone(),
        scheduled_scrub(store.clone(), replication.clone()),
        stopped.clone(),
    ));

    let lifecycle = Arc::new(crate::lifecycle::LifecycleStats::default());
    {
        let (objects, stats, stop) = (s3.objects().clone(), lifecycle.clone(), stopped.clone());
        tokio::spawn(crate::lifecycle::run(objects, stats, stop));
    }

    let sync_window = Arc::new(crate::sync_health::SyncWindow::default());
    {
        let (window, store, stop) = (sync_window.clone(), store.clone(), stopped.clone());
        tokio::spawn(async move {
            window.sample(store, &keel_clock::SystemClock, stop).await;
        });
    }
    if !config.cluster.witness {
        tokio::spawn(crate::nearfull::watch(
            cluster.clone(),
            config.data.clone(),
            config.nearfull_percent,
            store.reserve_bytes(),
            Arc::new(keel_clock::SystemClock),
            stopped.clone(),
        ));
    }
    let fill_window = Arc::new(crate::fill_rate::FillWindow::default());
    {
        let (window, dirs, stop) = (fill_window.clone(), config.data.clone(), stopped.clone());
        tokio::spawn(async move {
            window.sample(dirs, &keel_clock::SystemClock, stop).await;
        });
    }
    let nbd_metrics = crate::metrics::NbdMetrics::new();
    let refusals = Arc::new(crate::refusals::Refusals::default());
    let state = Arc::new(AppState {
        store: store.clone(),
        volumes: volumes.clone(),
        s3: s3.clone(),
        cluster: cluster.clone(),
        replication: replication.clone(),
        faults: membership.faults.clone(),
        token,
        jobs,
        scrub,
        sync_window,
        fill_window,
        lifecycle,
        config: shown,
        started,
        nbd_metrics: nbd_metrics.clone(),
        ops: ops.clone(),
        refusals: refusals.clone(),
    });
    let admin = axum::serve(admin_listener, crate::admin::router(state))
        .with_graceful_shutdown(shutdown(stopped.clone()));
    let nbd = async {
        match nbd_listener {
            Some(listener) => {
                keel_nbd::serve_with(
                    listener,
                    Arc::new(VolumeExports {
                        volumes: volumes.clone(),
                        replication: replication.clone(),
                        metadata: metadata.clone(),
                        metrics: nbd_metrics.clone(),
                        refusals: refusals.clone(),
                    }),
                    shutdown(stopped.clone()),
                    keel_nbd::Limits::default(),
                    ops.clone(),
                )
                .await
            }
            None => Ok(()),
        }
    };
    let s3_server = async {
        match s3_listener {
            Some(listener) => {
                keel_s3::serve(listener, (*s3).clone(), shutdown(stopped.clone())).await
            }
            None => Ok(()),
        }
    };

    let failure = node_failure(store.clone(), cluster.clone(), &keel_clock::SystemClock);
    let signals = async move {
        let failed = tokio::select! {
            _ = interrupt.recv() => None,
            _ = terminate.recv() => None,
            why = failure => Some(why),
        };
        match failed {
            Some(why) => tracing::error!("{why}: shutting down for a restart"),
            None => tracing::info!("shutting down"),
        }
        let _ = stop.send(true);
        Ok::<Option<&str>, std::io::Error>(failed)
    };
    let (admin_result, nbd_result, s3_result, signal_result) =
        tokio::join!(async { admin.await }, nbd, s3_server, signals);
    admin_result.context("admin API")?;
    nbd_result.context("NBD server")?;
    s3_result.context("S3 server")?;
    let failed = signal_result.context("signal handling")?;
    // A scheduled scrub stops at its next page or chunk.
    scheduled_scrubs.await?;
    // Clients are gone: each primary served here flushes to its replicas and notes what they
    // lack, so that a restart catches them up with only that.
    let stopping = replication.clone();
    tokio::task::spawn_blocking(move || stopping.shutdown()).await?;
    volumes.shutdown();
    drop(volumes);
    drop(s3);
    membership.shutdown().await;
    tokio::task::spawn_blocking(move || store.flush())
        .await?
        .context("final flush")?;
    if let Some(why) = failed {
        anyhow::bail!("{why} (see the log): restart the server");
    }
    eprintln!("keel: stopped cleanly");
    Ok(())
}

/// How often the server looks whether its store failed a sync.
const FAILURE_LOOK_EVERY: std::time::Duration = std::time::Duration::from_millis(100);

/// Resolves, saying why, once this node can no longer do its job: its store failed a sync
/// (it refuses writes until reopened: the kernel may have dropped what the sync covered), or
/// its Raft stopped on an error (it can change and learn nothing). Left running, such a node
/// still answers its peers and its clients: a primary there fails every write, also those
/// forwarded to it from other nodes, and no replica takes its volumes over (a write through
/// another node still failed 90 s after the failed sync, measured; stopped, one succeeds
/// 2.6 s after it, as after a crash). So the server stops instead, with an error, for its
/// supervisor (systemd, Kubernetes) to restart it, as PostgreSQL does after a failed fsync:
/// the store then replays its log from the device, and the node's replicas are caught up.
async fn node_failure(
    store: keel_store::Store,
    cluster: Arc<keel_cluster::Cluster>,
    clock: &dyn keel_clock::Clock,
) -> &'static str {
    let poisoned = async {
        while !store.poisoned() {
            clock.sleep(FAILURE_LOOK_EVERY).await;
        }
    };
    tokio::select! {
        _ = poisoned => {}
        _ = cluster.raft_stopped_wait() => {}
    }
    // A failed sync of a Raft write stops Raft at once: the store is the cause to name.
    if store.poisoned() {
        "this node's store failed a sync and refuses writes"
    } else {
        "this node's Raft stopped on an error"
    }
}

/// One scheduled scrub: this node's store, then the replicas of every replicated volume it
/// is the primary of. What fails is recorded in the run, and the rest still scrubbed.
fn scheduled_scrub(
    store: keel_store::Store,
    replication: Arc<keel_replication::Replication>,
) -> impl Fn(&mut Pacer, &JobProgress) -> Option<ScrubRun> + Send + Sync + 'static {
    move |pacer, progress| {
        let stopping = pacer.stopping();
        let stopped = || stopping.load(std::sync::atomic::Ordering::Relaxed);
        let mut run = ScrubRun::default();
        let scrubbed = store.scrub_until(
            &mut |p| {
                progress.report(p.done, p.total);
                pacer.pause();
            },
            &stopped,
        );
        match scrubbed {
            Ok(report) if report.interrupted => return None,
            Ok(report) => {
                run.extents_checked = report.extents_checked;
                run.bytes_checked = report.bytes_checked;
                run.repaired_copies = report.repaired_copies;
                run.unrecoverable_extents = report.unrecoverable_extents;
            }
            Err(error) => run.errors.push(format!("store: {error}")),
        }
        for name in replication.primary_here() {
            let compared = replication.scrub_target(&name).and_then(|primary| {
                primary.scrub(
                    &mut |done, total| {
                        progress.report(done, total);
                        pacer.pause();
                    },
                    &stopped,
                )
            });
            match compared {
                Ok(report) if report.interrupted => return None,
                Ok(report) => {
                    run.volumes_compared += 1;
                    run.volume_blocks_repaired +=
                        report.local_blocks_repaired + report.replica_blocks_repaired;
                }
                Err(error) => run.errors.push(format!("volume {name:?}: {error}")),
            }
        }
        Some(run)
    }
}

/// This node's report to the cluster leader: free space per data directory, poisoned store.
fn node_report(store: &keel_store::Store, data: &[PathBuf]) -> keel_cluster::NodeReport {
    keel_cluster::NodeReport {
        device_free_bytes: data
            .iter()
            .map(|dir| {
                keel_store::fsinfo::filesystem_info(dir)
                    .map(|info| info.available_bytes)
                    .unwrap_or(0)
            })
            .collect(),
        poisoned: store.stats().map(|stats| stats.poisoned).unwrap_or(true),
        ..keel_cluster::NodeReport::default()
    }
}

fn print_banner(
    config: &Config,
    initial_key: Option<&(String, String)>,
    membership: &crate::cluster_net::Membership,
) {
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
    let identity = membership.cluster.identity();
    println!(
        "  node   {} (id {}{}) in cluster {}",
        config.cluster.node_name(),
        identity.node_id,
        if config.cluster.witness {
            ", witness"
        } else {
            ""
        },
        hex::encode(identity.cluster_id)
    );
    println!(
        "  cluster {}  (node-to-node; others join with: keel server --join {} --join-token-file {})",
        membership.listen,
        config.cluster_advertise(),
        config.token_path().display()
    );
    if config.cluster.witness {
        println!("  admin  http://{}  (witness: no S3 or NBD)", config.admin);
        println!("ready");
        return;
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
    replication: Arc<keel_replication::Replication>,
    metadata: Arc<dyn keel_catalog::Metadata>,
    metrics: crate::metrics::NbdMetrics,
    /// What [`Exports::open`] refused, for the admin API.
    refusals: Arc<crate::refusals::Refusals>,
}

/// This node's own copies of volumes, for the replication engine.
struct LocalVolumes {
    volumes: Arc<VolumeManager>,
}

impl keel_replication::LocalVolumes for LocalVolumes {
    fn open_local(&self, name: &str) -> keel_namespace::volume::VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes.open_volume(name)
    }

    fn open_replica(&self, name: &str) -> keel_namespace::volume::VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes.open_replica(name)
    }

    fn open_local_snapshot(
        &self,
        volume: &str,
        snapshot: &str,
    ) -> keel_namespace::volume::VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes.open_snapshot(volume, snapshot)
    }

    fn open_snapshot_copy(
        &self,
        volume_id: u64,
        generation: u64,
        repair: Option<u64>,
    ) -> keel_namespace::volume::VolumeResult<Arc<dyn VolumeIo>> {
        self.volumes
            .open_snapshot_copy(volume_id, generation, repair)
    }

    fn write_snapshot_repair(
        &self,
        volume_id: u64,
        generation: u64,
        repair: u64,
        runs: &[(u64, &[u8])],
    ) -> keel_namespace::volume::VolumeResult<()> {
        self.volumes
            .write_snapshot_repair(volume_id, generation, repair, runs)
    }

    fn committed_sequence(&self) -> u64 {
        self.volumes.store().committed_sequence()
    }

    fn space_low(&self) -> bool {
        self.volumes.store().space_low().unwrap_or(false)
    }

    fn changed_since(
        &self,
        name: &str,
        volume_id: u64,
        since: u64,
        changed: &mut dyn FnMut(u64, u64),
    ) -> keel_namespace::volume::VolumeResult<()> {
        self.volumes.changed_since(name, volume_id, since, changed)
    }

    fn keep_record(
        &self,
        volume_id: u64,
        name: &[u8],
        value: Vec<u8>,
        sync: bool,
    ) -> keel_namespace::volume::VolumeResult<()> {
        self.volumes.keep_copy_record(volume_id, name, value, sync)
    }

    fn record(
        &self,
        volume_id: u64,
        name: &[u8],
    ) -> keel_namespace::volume::VolumeResult<Option<Vec<u8>>> {
        self.volumes.copy_record(volume_id, name)
    }

    fn forget_record(
        &self,
        volume_id: u64,
        name: &[u8],
    ) -> keel_namespace::volume::VolumeResult<()> {
        self.volumes.forget_copy_record(volume_id, name)
    }
}

impl Exports for VolumeExports {
    fn list(&self) -> Vec<String> {
        self.volumes.list().into_iter().map(|v| v.name).collect()
    }

    fn open(&self, name: &str) -> Result<Arc<dyn Export>, NbdError> {
        let open = || match name.split_once('@') {
            Some((volume, snapshot)) => self.replication.open_snapshot(volume, snapshot),
            None => self.replication.open(name),
        };
        let opened = match open() {
            // Created through another node a moment ago, and not applied here yet: once this
            // node caught up with the cluster's metadata, it exists or it does not.
            Err(
                keel_namespace::volume::VolumeError::NotFound { .. }
                | keel_namespace::volume::VolumeError::SnapshotNotFound { .. },
            ) => match self.metadata.catch_up() {
                Ok(()) => open(),
                Err(error) => {
                    tracing::info!(%error, export = name, "could not catch up with the cluster's metadata");
                    open()
                }
            },
            opened => opened,
        };
        let refused = match opened {
            Ok(handle) => {
                return Ok(Arc::new(VolumeExport {
                    handle,
                    metrics: self
                        .metrics
                        .volume(name.split_once('@').map_or(name, |(volume, _)| volume)),
                }))
            }
            Err(keel_namespace::volume::VolumeError::NotFound { .. })
            | Err(keel_namespace::volume::VolumeError::SnapshotNotFound { .. }) => {
                NbdError::ExportNotFound {
                    name: name.to_string(),
                }
            }
            Err(other) => NbdError::ExportUnavailable {
                name: name.to_string(),
                reason: other.to_string(),
            },
        };
        let now = keel_clock::Clock::wall_unix_ms(&keel_clock::SystemClock);
        self.refusals.record(name, refused.to_string(), now);
        Err(refused)
    }
}

struct VolumeExport {
    handle: Arc<dyn VolumeIo>,
    metrics: crate::metrics::VolumeSeries,
}

impl Export for VolumeExport {
    fn size_bytes(&self) -> u64 {
        self.handle.size_bytes()
    }

    fn block_size_bytes(&self) -> u32 {
        self.handle.block_size_bytes()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> std::io::Result<()> {
        timed(&self.metrics.read, || self.handle.read(offset, buf))?;
        self.metrics.bytes_read.inc_by(buf.len() as u64);
        Ok(())
    }

    fn write(&self, offset: u64, data: &[u8], fua: bool) -> std::io::Result<()> {
        timed(&self.metrics.write, || self.handle.write(offset, data, fua))?;
        self.metrics.bytes_written.inc_by(data.len() as u64);
        Ok(())
    }

    fn flush(&self) -> std::io::Result<()> {
        Ok(timed(&self.metrics.flush, || self.handle.flush())?)
    }

    fn trim(&self, offset: u64, length_bytes: u64) -> std::io::Result<()> {
        Ok(timed(&self.metrics.trim, || {
            self.handle.trim(offset, length_bytes)
        })?)
    }

    fn write_zeroes(
        &self,
        offset: u64,
        length_bytes: u64,
        fua: bool,
        may_trim: bool,
    ) -> std::io::Result<()> {
        Ok(timed(&self.metrics.zeroes, || {
            self.handle
                .write_zeroes(offset, length_bytes, fua, may_trim)
        })?)
    }

    fn read_only(&self) -> bool {
        self.handle.read_only()
    }
}
